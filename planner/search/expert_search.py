"""Expert parallelism in the search's answer: the runner-up without it, plan.json's ``model.moe``,
and the figures the report shows about the experts.

The search itself treats ``ep`` as one more degree of a candidate (``planner.search.candidates``:
the divisors of ``gcd(dp, experts)``, one value for a dense model); this module holds what is
specific to mixtures of experts around it:

- ``with_replicated_experts`` / ``listed_runners_up``: when the winner shards its experts, the best
  strategy with every expert replicated (ep 1) is kept and listed among plan.json's
  ``alternatives``, so the gain is visible;
- ``model_moe`` / ``replicated_note``: the table's MoE facts (``passes.moe``) as plan.json's
  ``model.moe``, or the note saying why a model's experts stay replicated;
- ``expert_summary``: per rank, the experts it holds, the tokens each gets per micro-batch, the
  all-to-alls' bytes and seconds per step, and what a routing imbalance of 1.2 would add (the
  winner's partition priced again at that load, 1F1B, ``cost_models.strategy.evaluate``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cost_models.hardware import HardwareProfile
from cost_models.strategy import Evaluation, NumericTable, candidate_costs, evaluate
from planner.search.ilp import SearchResult, search

__all__ = [
    "ExpertSummary",
    "expert_summary",
    "with_replicated_experts",
    "listed_runners_up",
    "model_moe",
    "replicated_note",
    "REPORTED_IMBALANCE",
]

#: The routing imbalance whose price the report shows beside the plan's.
REPORTED_IMBALANCE = 1.2


def with_replicated_experts(
    result: SearchResult, candidates: list, price, kinds, checkpoint: str, solver: str
) -> SearchResult:
    """``result`` with the best strategy without expert parallelism (ep 1) among its runners-up
    when the winner shards its experts (so the plan shows what ep gains). The main search keeps
    the best of the few fastest layouts only, and an ep-1 strategy it kept need not be the best
    one (a pipelined ep-1 layout may have been pruned by the ep > 1 incumbents), so the ep-1
    ``candidates`` are searched on their own, compiled as the winner is (``price``: candidates ->
    search entries, ``planner.search.solve.candidate_entries``)."""
    if not result.ranked or result.winner().strategy.candidate.expert_parallel == 1:
        return result
    compiled = result.winner().strategy.candidate.compile
    plain_candidates = sorted(
        {dataclasses.replace(c, compile=compiled) for c in candidates if c.expert_parallel == 1 and not c.compressed}
    )
    plain = search(price(plain_candidates), kinds, checkpoint, solver, keep=1)
    if not plain.ranked:
        return result
    best = plain.ranked[0]
    kept = [ev for ev in result.ranked + result.extra if ev.strategy.candidate.expert_parallel == 1]
    if any(ev.step_time_s <= best.step_time_s * (1 + 1e-9) for ev in kept):
        return result
    return dataclasses.replace(result, extra=result.extra + [best])


def replicated_note(model: dict) -> str | None:
    """The report's line for a mixture of experts the graph did not let the planner shard."""
    facts = model.get("moe")
    if isinstance(facts, dict) and facts.get("reason") and not facts.get("experts"):
        return f"experts replicated on every data-parallel rank (no expert parallelism): {facts['reason']}"
    return None


def model_moe(model: dict, capacity_factor: float | None) -> dict:
    """plan.json's ``model.moe`` from the table's facts (``passes.moe``); ``{}`` for a dense model
    or one whose experts the pass could not read (the report says why: ``replicated_note``)."""
    facts = model.get("moe")
    if not isinstance(facts, dict) or not facts.get("experts"):
        return {}
    return {
        "layers": [int(i) for i in facts["layers"]],
        "experts": int(facts["experts"]),
        "top_k": int(facts["top_k"]),
        "shared_experts": int(facts.get("shared_experts", 0)),
        "capacity_factor": capacity_factor,
    }


def listed_runners_up(result: SearchResult, winner: Evaluation, n: int = 3) -> list[Evaluation]:
    """The runners-up plan.json lists: the best of the ``n`` fastest other layouts, and, when the
    winner shards its experts, the best without (in place of the slowest, when it is not among them)."""
    alts = result.runners_up(n)
    if winner.strategy.candidate.expert_parallel == 1 or any(
        alt.strategy.candidate.expert_parallel == 1 for alt in alts
    ):
        return alts
    plain = [ev for ev in result.ranked[1:] + result.extra if ev.strategy.candidate.expert_parallel == 1]
    if not plain:
        return alts
    best = min(plain, key=lambda ev: ev.step_time_s)
    return (alts[: n - 1] if len(alts) >= n else alts) + [best]


@dataclass(frozen=True)
class ExpertSummary:
    """What the report says about a mixture of experts' plan (per device, per step)."""

    experts_per_rank: int
    """Routed experts of each MoE layer one rank holds (``experts / ep``)."""
    tokens_per_expert: float
    """Token rows each local expert multiplies per micro-batch, at the plan's load."""
    all_to_all_bytes: float
    """Bytes one device of the busiest stage sends in all-to-alls per step."""
    all_to_all_s: float
    """``predicted.time.ep_comm``."""
    imbalance: float
    """The plan's routing imbalance (``--moe-imbalance``)."""
    imbalanced_step_s: float | None
    """The step at ``REPORTED_IMBALANCE`` (1F1B, the plan's partition); None when the plan already
    assumes at least that much, or the experts are replicated (the imbalance then costs nothing)."""
    step_s: float
    """The same partition's 1F1B step at the plan's imbalance (what ``imbalanced_step_s`` compares with)."""


def expert_summary(
    request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int, evaluation: Evaluation
) -> ExpertSummary | None:
    """The report's MoE figures for ``evaluation`` (None for a dense model)."""
    facts = table.model.get("moe")
    if not isinstance(facts, dict) or not facts.get("experts"):
        return None
    strategy = evaluation.strategy
    cand = strategy.candidate
    ep, experts = cand.expert_parallel, int(facts["experts"])
    tokens = cand.micro_batch_size * request.seq_len * int(facts["top_k"]) * ep / experts * cand.expert_load
    stage = evaluation.stages[evaluation.bottleneck_stage]
    capacity = hw.memory_bytes * request.memory_headroom

    def priced(candidate) -> tuple[Evaluation, list]:
        costs = candidate_costs(table, hw, request.dtype, request.seq_len, candidate, gpus_per_node, capacity)
        flat = _one_f_one_b_stages(strategy)
        return evaluate(costs, flat, sorted(strategy.checkpoint), sorted(strategy.selective)), costs.layers

    base, layers = priced(cand)
    sent = cand.num_micro_batches * sum(
        layers[i].ep_sent_b + (layers[i].ep_rec_sent_b if i in strategy.checkpoint else 0.0)
        for i in range(stage.first, stage.last + 1)
    )
    worse = None
    if ep > 1 and cand.moe_imbalance < REPORTED_IMBALANCE:
        worse = priced(dataclasses.replace(cand, moe_imbalance=REPORTED_IMBALANCE))[0].step_time_s
    return ExpertSummary(
        experts_per_rank=experts // ep,
        tokens_per_expert=tokens,
        all_to_all_bytes=sent,
        all_to_all_s=float(evaluation.time.get("ep_comm", 0.0)),
        imbalance=cand.moe_imbalance,
        imbalanced_step_s=worse,
        step_s=base.step_time_s,
    )


def _one_f_one_b_stages(strategy) -> list[tuple[int, int]]:
    """The strategy's stages as 1F1B's ``pp`` ranges (an interleaved plan's chunks merged per rank
    would not be contiguous: its chunk ranges are re-cut into ``pp`` equal runs of chunks)."""
    stages = list(strategy.stages)
    pp = strategy.candidate.pp
    if len(stages) == pp:
        return stages
    per = len(stages) // pp
    return [(stages[k * per][0], stages[(k + 1) * per - 1][1]) for k in range(pp)]
