"""Whether the plan compresses its data-parallel exchange with 1-bit Adam, and why.

A 1-bit Adam candidate (``Candidate.dp_compression``, ``cost_models.compression_cost``) is a
variant of a plain dp > 1, ZeRO 0/1, on-device candidate: the same work, another per-step tail
(the compressed exchange and its compute instead of the gradient all-reduce) and more memory
(stage 0's optimizer state and the error buffers). So it is searched as such a variant, never as
another dimension of the ILP:

- pinned (``--dp-compression onebit-adam``): only the variants are searched (``solve``);
- pinned ``none``: none is;
- free: after the plain search, the variants of the plain candidates whose work alone
  (``work_lower_bound``: a bound of every tail) is below the plain winner's step are priced,
  those whose own bound still is are searched, and the compressed winner is kept only when the
  whole run is shorter with it: ``warm-up x its full-precision step + the rest x its compressed
  step`` against ``steps x the plain winner's step``, the warm-up being
  ``runtime.contract.compressed_exchange.default_warmup`` of the run's steps (``--tokens``, else
  ``DEFAULT_HORIZON_STEPS``).

Sound: a compressed strategy's warm-up step is a feasible plain strategy (same partition, less
memory), so it is at least the plain winner's step; a compressed candidate pays only when its
steady step is below the plain winner's, which is what the pruning keeps. The free plan is
therefore never slower over the run than either pin. When compression wins, the plain winner
stays among the runners-up, so the gain is visible.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cost_models.strategy import Evaluation, warmup_step_s
from planner.search.candidates import compression_variants, work_lower_bound
from planner.search.ilp import COUNTERS, TIME_TOL, SearchResult, _rank_key, search
from planner.units import format_seconds
from runtime.contract.compressed_exchange import default_warmup

__all__ = ["CompressionChoice", "choose_compression", "final_choice", "run_seconds", "with_runner_up"]


def run_seconds(evaluation: Evaluation, steps: int) -> float:
    """Seconds of a run of ``steps`` steps of ``evaluation``'s strategy, a compressed one's warm-up
    at its full-precision price."""
    if not evaluation.strategy.candidate.compressed:
        return steps * evaluation.step_time_s
    warm = min(default_warmup(steps), steps)
    return warm * warmup_step_s(evaluation) + (steps - warm) * evaluation.step_time_s


@dataclass(frozen=True)
class CompressionChoice:
    """Whether the plan compresses, and the figures behind it (the report's line)."""

    on: bool
    mode: str
    """``auto`` (the search decided), or the pinned value of ``--dp-compression``."""
    steps: int
    """Steps of the run the choice is weighed over."""
    warmup: int
    """Full-precision steps before compression (``compression_warmup``; 0 without compression)."""
    compressed_step_s: float | None
    """The best compressed strategy's steady step (None: no compressed strategy could win)."""
    plain_step_s: float | None
    """The best uncompressed strategy's step (None: not searched, under a pin)."""
    run_gain: float = 0.0
    """Fraction of the run's time compression saves against the plain winner (negative: costs)."""

    def reason(self) -> str | None:
        """One line for the report: only when compression is chosen or pinned (None otherwise)."""
        if self.mode != "auto":
            head = f"{self.mode}, pinned by --dp-compression {self.mode}"
            if not self.on:
                return head
            gain = (
                f"; {self.run_gain:.1%} shorter run than the best plan without it"
                if self.plain_step_s is not None
                else ""
            )
            return f"{head}: after {self.warmup:,} full-precision steps of {self.steps:,}{gain}"
        if not self.on or self.compressed_step_s is None:
            return None
        if self.plain_step_s is None:
            return (
                f"onebit-adam, the fastest strategy found, after {self.warmup:,} full-precision steps "
                f"(15% of the run's {self.steps:,})"
            )
        return (
            f"onebit-adam, because it shortens the step from {format_seconds(self.plain_step_s)} to "
            f"{format_seconds(self.compressed_step_s)} after {self.warmup:,} full-precision steps "
            f"(15% of the run's {self.steps:,}): {self.run_gain:.1%} less time over the run"
        )


def _choice(request, mode: str, best: Evaluation, plain: Evaluation | None, compressed: Evaluation | None):
    steps = request.horizon_steps()
    on = best.strategy.candidate.compressed
    gain = 0.0
    if plain is not None and compressed is not None:
        gain = 1 - run_seconds(compressed, steps) / run_seconds(plain, steps)
    return CompressionChoice(
        on=on,
        mode=mode,
        steps=steps,
        warmup=default_warmup(steps) if on else 0,
        compressed_step_s=compressed.step_time_s if compressed is not None else None,
        plain_step_s=plain.step_time_s if plain is not None else None,
        run_gain=gain,
    )


def choose_compression(
    request, price, kinds: list[str], entries: list, result: SearchResult, solver: str
) -> tuple[SearchResult, list, CompressionChoice | None]:
    """The search result to plan from, the entries it searched, and the compression choice.

    ``price(candidates)`` gives the search entries of candidates (``solve.candidate_entries``);
    ``entries`` and ``result`` are the search so far (only compressed candidates under the pin)."""
    mode = request.dp_compression or "auto"
    if result.best is None:
        return result, entries, None
    if mode != "auto":
        return result, entries, _choice(request, mode, result.winner(), None, None)
    plain = result.winner()
    best = plain.step_time_s
    compiled = plain.strategy.candidate.compile  # the variants take the winner's compile mode
    limit = best * (1 + TIME_TOL)
    base = [
        entry.cand
        for entry in entries
        if entry.cand.compile != compiled
        or (entry.floor < limit and not entry.too_big and work_lower_bound(entry.costs) < limit)
    ]  # a candidate whose state overflows the device overflows it compressed (stage 0's optimizer state)
    base = list(dict.fromkeys(dataclasses.replace(candidate, compile=False) for candidate in base))
    kept = [
        entry
        for entry in price(compression_variants(base))
        if entry.floor < limit
        and not entry.too_big
        and entry.time_lb < limit
        and entry.memory_lb <= entry.costs.capacity
    ]
    if not kept:
        return result, entries, None
    compressed_result = search(kept, kinds, request.checkpoint, solver)
    compressed = compressed_result.best
    steps = request.horizon_steps()
    if compressed is None or run_seconds(compressed, steps) >= run_seconds(plain, steps):
        return result, entries + kept, None
    merged = dataclasses.replace(
        compressed_result,
        ranked=sorted(compressed_result.ranked + result.ranked, key=_rank_key),
        extra=sorted(compressed_result.extra + result.extra, key=_rank_key),
    )
    for counter in COUNTERS:
        setattr(merged, counter, getattr(merged, counter) + getattr(result, counter))
    merged.notes = result.notes + merged.notes
    merged.answers = {**result.answers, **merged.answers}
    return merged, entries + kept, _choice(request, mode, compressed, plain, compressed)


def final_choice(request, choice: CompressionChoice | None, result: SearchResult) -> CompressionChoice | None:
    """The choice as the final ranking (after the schedule post-pass) has it: a free search's
    line only while the winner compresses, its figures the winner's and the best plain one's."""
    if choice is None or choice.mode != "auto" or result.best is None:
        return choice
    winner = result.winner()
    if not winner.strategy.candidate.compressed:
        return None
    plain = min(
        (ev for ev in result.ranked + result.extra if not ev.strategy.candidate.compressed),
        key=_rank_key,
        default=None,
    )
    return _choice(request, choice.mode, winner, plain, winner)


def with_runner_up(result: SearchResult) -> SearchResult:
    """``result`` with its best strategy without compression as its first runner-up, when the
    winner compresses (so the report shows the gain)."""
    if not result.ranked or not result.winner().strategy.candidate.compressed:
        return result
    pool = result.ranked[1:] + result.extra
    plain = min((ev for ev in pool if not ev.strategy.candidate.compressed), key=_rank_key, default=None)
    if plain is None:
        return result
    return dataclasses.replace(
        result,
        ranked=[result.ranked[0], plain, *(ev for ev in result.ranked[1:] if ev is not plain)],
        extra=[ev for ev in result.extra if ev is not plain],
    )
