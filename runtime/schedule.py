"""Pipeline schedules as data: per-rank action lists, a validator and a deadlock simulator.

A schedule for ``p`` stages and ``m`` micro-batches is a list of ``p`` lists; list ``s`` holds the
:class:`Action` s that the rank running stage ``s`` executes, in order. Nothing else decides the
order: the executor in :mod:`runtime.pipeline` only walks its list.

Action kinds (``i`` is the micro-batch):

- ``F``: forward of micro-batch ``i``; ``B``: backward of micro-batch ``i``.
- ``SEND_ACT`` / ``RECV_ACT``: activations of ``i`` from stage ``s`` to ``s + 1``.
- ``SEND_GRAD`` / ``RECV_GRAD``: gradients of ``i`` from stage ``s + 1`` back to ``s``.

Communication semantics (shared by :func:`simulate` and the executor):

- **Sends are asynchronous.** A send is posted (``isend``) and the rank moves on at once; the
  message is delivered whenever the receiver posts its receive. The executor waits for its
  outstanding sends only after its last action.
- **Receives block.** A rank that reaches ``RECV_*`` waits until the matching message exists.
- **Messages between two ranks in one direction are matched in order** (FIFO, no tags): the
  k-th ``SEND_ACT`` of stage ``s`` is the k-th ``RECV_ACT`` of stage ``s + 1``, so both must name
  the same micro-batch. :func:`validate_schedule` checks this.

Under these semantics a schedule deadlocks exactly when, at some point, every unfinished rank is
blocked in a receive whose message will never be posted; :func:`simulate` executes the lists
without processes and raises :class:`DeadlockError` naming the blocked actions and the cycle of
ranks waiting on each other.

1F1B (one forward, one backward). Stage ``s`` first runs ``w_s = min(p - s - 1, m)`` warm-up
forwards, then alternates one forward and one backward ``m - w_s`` times, then drains the
remaining ``w_s`` backwards. Stage ``s`` therefore holds at most ``min(p - s, m)`` micro-batches of
activations, against ``m`` for GPipe (all forwards, then all backwards). With equal stage times
``f`` and ``b`` and free communication both take ``(m + p - 1)(f + b)``, of which each stage
computes ``m (f + b)``, so the bubble (idle) fraction is ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

__all__ = [
    "F",
    "B",
    "SEND_ACT",
    "RECV_ACT",
    "SEND_GRAD",
    "RECV_GRAD",
    "KINDS",
    "Action",
    "Schedule",
    "ScheduleError",
    "DeadlockError",
    "one_f_one_b",
    "gpipe",
    "validate_rank",
    "validate_schedule",
    "simulate",
    "SimResult",
    "peak_inflight",
    "one_f_one_b_bubble",
    "format_schedule",
]

F = "F"
B = "B"
SEND_ACT = "SEND_ACT"
RECV_ACT = "RECV_ACT"
SEND_GRAD = "SEND_GRAD"
RECV_GRAD = "RECV_GRAD"
KINDS = (F, B, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)
_SENDS = {SEND_ACT: RECV_ACT, SEND_GRAD: RECV_GRAD}
_RECVS = {RECV_ACT: SEND_ACT, RECV_GRAD: SEND_GRAD}


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` applied to ``microbatch`` on pipeline stage ``stage``."""

    stage: int
    """Pipeline stage (= index of the rank's list in the schedule)."""
    kind: str
    """One of :data:`KINDS`."""
    microbatch: int
    """Micro-batch index, ``0 .. m - 1``."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"stage and micro-batch must be >= 0, got {self.stage}, {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``"RECV_ACT3@s1"`` -> ``Action(1, "RECV_ACT", 3)``."""
        head, sep, stage = text.strip().partition("@s")
        kind = head.rstrip("0123456789")
        mb = head[len(kind):]
        if not sep or not mb or not stage.isdigit():
            raise ValueError(f"cannot parse action {text!r}; expected e.g. 'F3@s1'")
        return cls(int(stage), kind, int(mb))

    @property
    def peer(self) -> int | None:
        """Stage at the other end of a communication action (``None`` for compute)."""
        if self.kind in (SEND_ACT, RECV_GRAD):
            return self.stage + 1
        if self.kind in (RECV_ACT, SEND_GRAD):
            return self.stage - 1
        return None


Schedule = list[list[Action]]


class ScheduleError(ValueError):
    """A schedule is malformed (missing, duplicated or misordered actions, unmatched messages)."""


class DeadlockError(ScheduleError):
    """No rank can make progress; ``stuck`` holds each unfinished rank's blocked action."""

    def __init__(self, message: str, stuck: Sequence[Action]):
        super().__init__(message)
        self.stuck = list(stuck)


# --------------------------------------------------------------------------- generators


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def _fwd(s: int, p: int, i: int) -> list[Action]:
    out = [Action(s, RECV_ACT, i)] if s > 0 else []
    out.append(Action(s, F, i))
    if s < p - 1:
        out.append(Action(s, SEND_ACT, i))
    return out


def _bwd(s: int, p: int, i: int) -> list[Action]:
    out = [Action(s, RECV_GRAD, i)] if s < p - 1 else []
    out.append(Action(s, B, i))
    if s > 0:
        out.append(Action(s, SEND_GRAD, i))
    return out


def one_f_one_b(num_stages: int, num_microbatches: int, *, strict: bool = True) -> Schedule:
    """The 1F1B schedule: warm-up forwards, alternating forward/backward, cool-down backwards.

    Stage ``s`` runs ``w = min(p - s - 1, m)`` forwards, then ``m - w`` pairs (forward ``w + k``,
    backward ``k``), then backwards ``m - w .. m - 1``. Each compute action is wrapped in its
    receive and send. With ``strict`` (the default), fewer micro-batches than stages is an error:
    the pipeline could never fill, and the executor refuses it too. ``strict=False`` still builds
    the (valid, deadlock-free) schedule, for analysis.
    """
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    if strict and m < p:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages: got {m} micro-batches for "
            f"{p} stages; raise the number of micro-batches (smaller micro-batch size) or use fewer stages"
        )
    sched: Schedule = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts: list[Action] = []
        for i in range(warm):
            acts += _fwd(s, p, i)
        for k in range(m - warm):
            acts += _fwd(s, p, warm + k)
            acts += _bwd(s, p, k)
        for k in range(m - warm, m):
            acts += _bwd(s, p, k)
        sched.append(acts)
    return sched


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all ``m`` forwards, then all ``m`` backwards (in order 0..m-1).

    Same bubble as 1F1B for equal stage times, but every stage holds the activations of all ``m``
    micro-batches at the turn.
    """
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    return [
        [a for i in range(m) for a in _fwd(s, p, i)] + [a for i in range(m) for a in _bwd(s, p, i)]
        for s in range(p)
    ]


def one_f_one_b_bubble(num_stages: int, num_microbatches: int) -> float:
    """Analytic bubble fraction of 1F1B (and GPipe) with equal stage times: ``(p-1)/(m+p-1)``."""
    _check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def format_schedule(sched: Schedule) -> str:
    """One line per rank, e.g. ``rank 1: RECV_ACT0@s1 F0@s1 ...``."""
    return "\n".join(f"rank {s}: " + " ".join(map(str, acts)) for s, acts in enumerate(sched))


# --------------------------------------------------------------------------- validation


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def validate_rank(actions: Sequence[Action], stage: int, num_stages: int, num_microbatches: int) -> None:
    """Check one rank's list on its own (no cross-rank matching).

    Every micro-batch has exactly one ``F`` and one ``B``, ``B`` after ``F``; a stage with a
    predecessor receives each micro-batch's activations before its ``F`` and sends its input
    gradient after its ``B``; a stage with a successor sends activations after ``F`` and receives
    the output gradient before ``B``. Raises :class:`ScheduleError` naming the offending action.
    """
    _check_sizes(num_stages, num_microbatches)
    p, m, s = num_stages, num_microbatches, stage
    if not 0 <= s < p:
        raise ScheduleError(f"stage {s} is outside 0..{p - 1}")
    allowed = {F, B}
    if s > 0:
        allowed |= {RECV_ACT, SEND_GRAD}
    if s < p - 1:
        allowed |= {SEND_ACT, RECV_GRAD}
    pos: dict[tuple[str, int], int] = {}
    counts: Counter = Counter()
    for idx, a in enumerate(actions):
        if not isinstance(a, Action):
            raise ScheduleError(f"rank {s}'s list holds {a!r} at position {idx}, not an Action")
        if a.stage != s:
            raise ScheduleError(f"{a} is in rank {s}'s list but names stage {a.stage}")
        if a.microbatch >= m:
            raise ScheduleError(f"{a} names micro-batch {a.microbatch}, but there are only {m} (0..{m - 1})")
        if a.kind not in allowed:
            where = "the first" if a.kind in (RECV_ACT, SEND_GRAD) else "the last"
            raise ScheduleError(f"{a} cannot run on {where} stage (stage {s} of {p}): there is no neighbour")
        counts[(a.kind, a.microbatch)] += 1
        if counts[(a.kind, a.microbatch)] > 1:
            raise ScheduleError(f"{a} appears more than once in rank {s}'s list (position {idx} repeats it)")
        pos[(a.kind, a.microbatch)] = idx
    # Each required action exists, and dependencies come first.
    required = ((F, RECV_ACT), (SEND_ACT, F), (B, F), (B, RECV_GRAD), (SEND_GRAD, B))
    for i in range(m):
        for kind in sorted(allowed, key=KINDS.index):
            if (kind, i) not in pos:
                raise ScheduleError(f"rank {s}'s list has no {Action(s, kind, i)} (every micro-batch needs one)")
        for later, earlier in required:
            if later in allowed and earlier in allowed and pos[(later, i)] < pos[(earlier, i)]:
                raise ScheduleError(
                    f"{Action(s, later, i)} comes before {Action(s, earlier, i)} in rank {s}'s list, "
                    f"but it needs that one's result"
                )


def validate_schedule(sched: Schedule, num_stages: int, num_microbatches: int) -> None:
    """Check every rank's list (:func:`validate_rank`) and that every message is received.

    Messages from stage ``s`` to stage ``t`` of one kind are matched in order, so the sequence of
    micro-batches of ``s``'s sends must equal that of ``t``'s receives, position by position.
    """
    _check_sizes(num_stages, num_microbatches)
    if len(sched) != num_stages:
        raise ScheduleError(f"the schedule has {len(sched)} rank lists but there are {num_stages} stages")
    for s, acts in enumerate(sched):
        validate_rank(acts, s, num_stages, num_microbatches)
    for s in range(num_stages - 1):
        for send_kind, src, dst in ((SEND_ACT, s, s + 1), (SEND_GRAD, s + 1, s)):
            recv_kind = _SENDS[send_kind]
            sends = [a for a in sched[src] if a.kind == send_kind]
            recvs = [a for a in sched[dst] if a.kind == recv_kind]
            for k, (snd, rcv) in enumerate(zip(sends, recvs)):
                if snd.microbatch != rcv.microbatch:
                    raise ScheduleError(
                        f"{snd} is stage {src}'s {_ordinal(k + 1)} {send_kind} but stage {dst}'s "
                        f"{_ordinal(k + 1)} {recv_kind} is {rcv}: messages between two ranks are "
                        f"matched in order, so micro-batch {snd.microbatch}'s data would arrive as "
                        f"micro-batch {rcv.microbatch}'s"
                    )
            if len(sends) != len(recvs):  # cannot happen after validate_rank, kept as a guard
                raise ScheduleError(f"stage {src} posts {len(sends)} {send_kind} but stage {dst} {len(recvs)} {recv_kind}")


# --------------------------------------------------------------------------- simulation


@dataclass
class SimResult:
    """Outcome of :func:`simulate`: per-action times (Gantt data) and the bubble."""

    timeline: list[list[tuple[Action, float, float]]]
    """Per rank, ``(action, start, end)`` in execution order. A receive starts when the rank
    reaches it and ends when the message has arrived (its span is waiting time)."""
    makespan: float
    """Time at which the last rank finishes."""
    compute_time: list[float]
    """Per stage, the summed duration of its ``F`` and ``B`` actions."""
    bubble_fraction: float
    """``1 - sum(compute_time) / (num_stages * makespan)``: the share of stage-time not computing."""
    start: dict[Action, float] = field(default_factory=dict)
    end: dict[Action, float] = field(default_factory=dict)


TimeSpec = float | Sequence[float] | Callable[[int], float]


def _per_stage(spec: TimeSpec, s: int, name: str) -> float:
    if callable(spec):
        v = spec(s)
    elif isinstance(spec, (int, float)):
        v = spec
    else:
        v = spec[s]
    if v < 0:
        raise ValueError(f"{name} for stage {s} is negative ({v})")
    return float(v)


def simulate(
    sched: Schedule,
    *,
    forward_time: TimeSpec = 1.0,
    backward_time: TimeSpec = 2.0,
    p2p_time: float = 0.0,
    send_time: float = 0.0,
) -> SimResult:
    """Execute the per-rank lists under the executor's semantics, without processes.

    Each rank runs its actions in order on its own clock. ``F`` and ``B`` take ``forward_time`` /
    ``backward_time`` (a number, a per-stage sequence, or a function of the stage). A send occupies
    its rank for ``send_time`` and never blocks; its message arrives ``p2p_time`` after the send
    ends. A receive blocks until its message has arrived: ``end = max(reached, arrival)``.

    Because a rank's times depend only on its own earlier actions and on arrival times of messages
    already sent, the ranks can be advanced in any order; when no rank can advance and some are
    unfinished, the schedule deadlocks: :class:`DeadlockError` names each blocked receive and the
    cycle of ranks waiting on one another. A receive whose queue head is another micro-batch's
    message raises :class:`ScheduleError` (the FIFO mismatch :func:`validate_schedule` reports).
    """
    p = len(sched)
    if p == 0:
        raise ValueError("empty schedule")
    ptr = [0] * p
    clock = [0.0] * p
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    compute = [0.0] * p
    # (src, dst, send kind) -> FIFO of (micro-batch, arrival time, send action)
    queues: dict[tuple[int, int, str], deque] = {}
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}

    def record(s: int, a: Action, t0: float, t1: float) -> None:
        timeline[s].append((a, t0, t1))
        start[a], end[a] = t0, t1
        clock[s] = t1
        ptr[s] += 1

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while ptr[s] < len(sched[s]):
                a = sched[s][ptr[s]]
                if a.stage != s:
                    raise ScheduleError(f"{a} is in rank {s}'s list but names stage {a.stage}")
                t0 = clock[s]
                if a.kind in (F, B):
                    d = _per_stage(forward_time if a.kind == F else backward_time, s, f"{a.kind} time")
                    compute[s] += d
                    record(s, a, t0, t0 + d)
                elif a.kind in _SENDS:
                    if not 0 <= a.peer < p:
                        raise ScheduleError(f"{a} sends to stage {a.peer}, which does not exist")
                    q = queues.setdefault((s, a.peer, a.kind), deque())
                    q.append((a.microbatch, t0 + send_time + p2p_time, a))
                    record(s, a, t0, t0 + send_time)
                else:
                    src = a.peer
                    q = queues.get((src, s, _RECVS[a.kind]))
                    if not q:
                        break  # blocked
                    mb, arrival, snd = q[0]
                    if mb != a.microbatch:
                        raise ScheduleError(
                            f"{a} would receive {snd}'s message: messages between two ranks are "
                            f"matched in order, so the schedules disagree on the order"
                        )
                    q.popleft()
                    record(s, a, t0, max(t0, arrival))
                progress = True

    unfinished = [s for s in range(p) if ptr[s] < len(sched[s])]
    if unfinished:
        raise _deadlock(sched, ptr, unfinished)
    makespan = max(clock) if p else 0.0
    busy = sum(compute)
    bubble = 1.0 - busy / (p * makespan) if makespan > 0 else 0.0
    return SimResult(timeline, makespan, compute, bubble, start, end)


def _deadlock(sched: Schedule, ptr: list[int], unfinished: list[int]) -> DeadlockError:
    stuck = [sched[s][ptr[s]] for s in unfinished]
    lines = []
    waits_on: dict[int, int] = {}
    for a in stuck:
        src = a.peer
        if not 0 <= src < len(sched):
            lines.append(f"  {a} waits for a message from stage {src}, which does not exist")
            continue
        want = Action(src, _RECVS[a.kind], a.microbatch)
        if ptr[src] >= len(sched[src]):
            lines.append(f"  {a} waits for {want}, but rank {src} finished without sending it")
        else:
            waits_on[a.stage] = src
            lines.append(f"  {a} waits for {want}; rank {src} is blocked at {sched[src][ptr[src]]}")
    cycle = _find_cycle(waits_on)
    head = "deadlock: no rank can make progress"
    if cycle:
        head += "; ranks wait on each other in a cycle " + " -> ".join(f"rank {r}" for r in cycle + cycle[:1])
    return DeadlockError(head + "\n" + "\n".join(lines), stuck)


def _find_cycle(waits_on: dict[int, int]) -> list[int]:
    for start in sorted(waits_on):
        seen: list[int] = []
        r = start
        while r in waits_on and r not in seen:
            seen.append(r)
            r = waits_on[r]
        if r in seen:
            return seen[seen.index(r):]
    return []


def peak_inflight(sched: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose ``F`` has run and whose ``B`` has not.

    That is the number of micro-batches of activations a stage holds at its peak: ``min(p - s, m)``
    for 1F1B and ``m`` for GPipe.
    """
    peaks = []
    for acts in sched:
        live = peak = 0
        for a in acts:
            if a.kind == F:
                live += 1
                peak = max(peak, live)
            elif a.kind == B:
                live -= 1
        peaks.append(peak)
    return peaks
