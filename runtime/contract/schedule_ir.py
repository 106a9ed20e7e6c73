"""Pipeline schedules as data: per-rank action lists, a validator and a deadlock simulator.

A schedule for ``p`` pipeline ranks, ``m`` micro-batches and ``v`` model chunks per rank
(*virtual stages*; ``v = 1`` unless interleaved) is a list of ``p`` lists; list ``s`` holds the
:class:`Action` s that pipeline rank ``s`` executes, in order. Nothing else decides the order: the
executor in :mod:`runtime.pipeline.executor` only walks its list.

Model chunks. The model is cut into ``p v`` chunks in model order; chunk ``c`` runs on rank
``c % p`` as that rank's local chunk ``c // p`` (:attr:`Action.chunk`). With ``v = 1`` chunk =
stage and every local chunk index is 0, so 1F1B and GPipe lists read as they always did. Chunk
``c`` sends its activations to chunk ``c + 1`` on rank ``(c + 1) % p``: from rank ``p - 1`` the
pipeline wraps round to rank 0 between rounds of chunks.

Action kinds (``i`` is the micro-batch, all on one model chunk):

- ``F``: forward; ``B``: backward, the full one, or with ``W`` actions only the gradient of the
  chunk's inputs, ``W`` computing the weight gradients later (zero-bubble schedules).
- ``SEND_ACT`` / ``RECV_ACT``: activations of ``i`` from chunk ``c`` to ``c + 1``.
- ``SEND_GRAD`` / ``RECV_GRAD``: gradients of ``i`` from chunk ``c + 1`` back to ``c``.
  A receive names the chunk that *uses* the message.

Communication semantics (shared by :func:`simulate` and the executor):

- **Sends are asynchronous.** A send is posted (``isend``) and the rank moves on at once; the
  message is delivered whenever the receiver posts its receive. The executor waits for its
  outstanding sends only after its last action.
- **Receives block.** A rank that reaches ``RECV_*`` waits until the matching message exists.
- **Messages from one rank to another are matched in order** (one FIFO per direction of each
  pair, all kinds together: point-to-point transfers carry no tags): the k-th message rank ``q``
  sends to rank ``r`` is the k-th one ``r`` receives from ``q``, so both must name the same
  chunk, kind and micro-batch. :func:`validate_schedule` checks this. With ``v > 1`` one pair
  carries activations and gradients both ways, so the generators place each receive where the
  sender's order puts it (:func:`with_communication`).

A schedule deadlocks exactly when every unfinished rank is blocked in a receive whose message
will never be posted; :func:`simulate` executes the lists without processes and raises
:class:`DeadlockError` naming the blocked actions and the cycle of ranks waiting on each other.
:func:`analyze` prices any schedule from the simulation (bubble, per-rank peak activations).

1F1B (one forward, one backward). Stage ``s`` first runs ``w_s = min(p - s - 1, m)`` warm-up
forwards, then alternates one forward and one backward ``m - w_s`` times, then drains the
remaining ``w_s`` backwards. Stage ``s`` therefore holds at most ``min(p - s, m)`` micro-batches of
activations, against ``m`` for GPipe (all forwards, then all backwards). With equal stage times
``f`` and ``b`` and free communication both take ``(m + p - 1)(f + b)``, of which each stage
computes ``m (f + b)``, so the bubble (idle) fraction is ``(p - 1) / (m + p - 1)``; idle time per
unit of compute (the *bubble ratio* of Megatron-LM and the zero-bubble paper) is ``(p - 1) / m``.

Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's order). Each rank runs ``v`` chunks of
``1/v`` of its layers. Forwards go round the ranks in groups of ``p`` micro-batches: the rank's
k-th forward is chunk ``(k // p) % v`` of micro-batch ``(k // (p v)) p + k % p``; backwards take
the same order with the chunks reversed. Rank ``r`` warms up with ``2 (p - r - 1) + (v - 1) p``
forwards, then alternates, then drains. The bubble ratio shrinks to ``(p - 1) / (v m)`` for
``v`` times the pipeline messages; rank 0 holds ``(1 + (p - 1) / (p v))`` times 1F1B's
activations. The order needs ``m >= p`` and ``m`` a multiple of ``p`` (a partial last group
deadlocks for some sizes under these semantics, e.g. p=4, m=5, v=3): :func:`interleaved_one_f_one_b`
refuses other ``m`` with a :class:`ScheduleError` that says so.

Zero bubble (Qi et al. 2023, ZB-H1). 1F1B's order with backward split in ``B`` and ``W``: rank
``r`` delays its ``W`` s by ``r`` micro-batches, so the ``W`` s fill the cool-down that 1F1B
spends idle. Full activations in flight (``F`` done, ``B`` not) stay 1F1B's ``min(p - r, m)``;
the inputs kept for ``W`` at most ``p`` micro-batches. With ``F = B = W`` the bubble ratio is
``(p - 1) / (3 m)``, a third of 1F1B's. :func:`interleaved_zero_bubble` is the same split on the
interleaved order (torch's ``ScheduleInterleavedZeroBubble``).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

__all__ = [
    "F",
    "B",
    "W",
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
    "interleaved_one_f_one_b",
    "interleaved_compute",
    "interleaved_zero_bubble",
    "zero_bubble_h1",
    "with_communication",
    "validate_rank",
    "validate_schedule",
    "simulate",
    "SimResult",
    "TimingProgram",
    "analyze",
    "ScheduleStats",
    "peak_open",
    "peak_inflight",
    "peak_weight_pending",
    "one_f_one_b_bubble",
    "format_schedule",
    "num_chunks",
]

F = "F"
B = "B"
W = "W"
SEND_ACT = "SEND_ACT"
RECV_ACT = "RECV_ACT"
SEND_GRAD = "SEND_GRAD"
RECV_GRAD = "RECV_GRAD"
KINDS = (F, B, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD, W)
COMPUTE = (F, B, W)
_SENDS = {SEND_ACT: RECV_ACT, SEND_GRAD: RECV_GRAD}
_RECVS = {RECV_ACT: SEND_ACT, RECV_GRAD: SEND_GRAD}
#: Which way along the model each communication kind points (+1: to the next chunk).
_DIRECTION = {SEND_ACT: 1, RECV_GRAD: 1, RECV_ACT: -1, SEND_GRAD: -1}


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` applied to ``microbatch`` on the rank's model chunk ``chunk``."""

    stage: int
    """Pipeline rank (= index of the rank's list in the schedule)."""
    kind: str
    """One of :data:`KINDS`."""
    microbatch: int
    """Micro-batch index, ``0 .. m - 1``."""
    chunk: int = 0
    """The rank's model chunk (virtual stage) in model order, ``0 .. v - 1``: model chunk
    ``chunk * p + stage``. Always 0 when ``v = 1``."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.stage < 0 or self.microbatch < 0 or self.chunk < 0:
            raise ValueError(
                f"stage, micro-batch and chunk must be >= 0, got {self.stage}, {self.microbatch}, {self.chunk}"
            )

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}" + (f"c{self.chunk}" if self.chunk else "")

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``"RECV_ACT3@s1"`` -> ``Action(1, "RECV_ACT", 3)``; a local chunk
        other than 0 follows the stage: ``"W2@s0c1"`` -> ``Action(0, "W", 2, 1)``."""
        head, sep, where = text.strip().partition("@s")
        kind = head.rstrip("0123456789")
        mb = head[len(kind) :]
        stage, csep, chunk = where.partition("c")
        if not sep or not mb or not stage.isdigit() or (csep and not chunk.isdigit()):
            raise ValueError(f"cannot parse action {text!r}; expected e.g. 'F3@s1' or 'F3@s1c1'")
        return cls(int(stage), kind, int(mb), int(chunk) if csep else 0)

    def model_chunk(self, num_stages: int) -> int:
        """Index of this action's chunk in model order (``chunk * p + stage``)."""
        return self.chunk * num_stages + self.stage

    @property
    def peer(self) -> int | None:
        """Stage at the other end of a communication action when ``v = 1`` (``None`` for compute).
        With model chunks use :meth:`peer_of`."""
        return self.stage + _DIRECTION[self.kind] if self.kind in _DIRECTION else None

    def peer_of(self, num_stages: int) -> tuple[int, int] | None:
        """``(rank, local chunk)`` of the chunk at the other end of a communication action."""
        if self.kind not in _DIRECTION:
            return None
        chunk = self.model_chunk(num_stages) + _DIRECTION[self.kind]
        return chunk % num_stages, chunk // num_stages if chunk >= 0 else -1


Schedule = list[list[Action]]


class ScheduleError(ValueError):
    """A schedule is malformed (missing, duplicated or misordered actions, unmatched messages)."""


class DeadlockError(ScheduleError):
    """No rank can make progress; ``stuck`` holds each unfinished rank's blocked action."""

    def __init__(self, message: str, stuck: Sequence[Action]):
        super().__init__(message)
        self.stuck = list(stuck)


def num_chunks(sched: Schedule) -> int:
    """``v``: model chunks per rank that a schedule uses (1 + its largest local chunk index)."""
    return 1 + max((action.chunk for acts in sched for action in acts), default=0)


# --------------------------------------------------------------------------- generators


def _check_sizes(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    if virtual_stages > 1 and num_stages < 2:
        raise ScheduleError(
            f"{virtual_stages} model chunks on a single pipeline rank: interleaving needs at least 2 "
            "pipeline ranks (with one rank, run the chunks as one stage, virtual_stages=1)"
        )


def _fwd(stage: int, p: int, i: int) -> list[Action]:
    out = [Action(stage, RECV_ACT, i)] if stage > 0 else []
    out.append(Action(stage, F, i))
    if stage < p - 1:
        out.append(Action(stage, SEND_ACT, i))
    return out


def _bwd(stage: int, p: int, i: int) -> list[Action]:
    out = [Action(stage, RECV_GRAD, i)] if stage < p - 1 else []
    out.append(Action(stage, B, i))
    if stage > 0:
        out.append(Action(stage, SEND_GRAD, i))
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
    for stage in range(p):
        warm = min(p - stage - 1, m)
        acts: list[Action] = []
        for i in range(warm):
            acts += _fwd(stage, p, i)
        for k in range(m - warm):
            acts += _fwd(stage, p, warm + k)
            acts += _bwd(stage, p, k)
        for k in range(m - warm, m):
            acts += _bwd(stage, p, k)
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
        [action for i in range(m) for action in _fwd(stage, p, i)]
        + [action for i in range(m) for action in _bwd(stage, p, i)]
        for stage in range(p)
    ]


def with_communication(compute: Sequence[Sequence[Action]], num_stages: int, virtual_stages: int = 1) -> Schedule:
    """Add the sends and receives to per-rank lists of compute actions (``F``, ``B``, ``W``).

    Each send follows the action that produces its message (``SEND_ACT`` after ``F`` of every
    chunk but the last, ``SEND_GRAD`` after ``B`` of every chunk but the first). Messages from one
    rank to another are matched in order, so a rank posts its receives from each sender in that
    sender's send order, each as late as possible: just before the first compute action that
    needs it or a message the sender posted after it. With ``v = 1`` that is right before use,
    as in :func:`one_f_one_b`.
    """
    p, v = num_stages, virtual_stages
    last = p * v - 1
    sends: list[list[Action]] = []
    for rank, acts in enumerate(compute):
        out: list[Action] = []
        for action in acts:
            if action.kind not in COMPUTE:
                raise ScheduleError(f"{action} is not a compute action; give only F, B and W")
            out.append(action)
            chunk = action.model_chunk(p)
            if action.kind == F and chunk < last:
                out.append(Action(rank, SEND_ACT, action.microbatch, action.chunk))
            elif action.kind == B and chunk > 0:
                out.append(Action(rank, SEND_GRAD, action.microbatch, action.chunk))
        sends.append(out)
    # each message once: (sender, send, the receiver's local chunk), by receiver, in send order
    incoming: list[list[tuple[int, Action, int]]] = [[] for _ in range(p)]
    for sender, out in enumerate(sends):
        for action in out:
            if action.kind in _SENDS:
                peer, chunk = _peer(action, p)
                incoming[peer].append((sender, action, chunk))
    return [_place_receives(compute[receiver], sends[receiver], incoming[receiver], receiver) for receiver in range(p)]


def _place_receives(
    own: Sequence[Action], mine: list[Action], incoming: list[tuple[int, Action, int]], receiver: int
) -> list[Action]:
    """Rank ``receiver``'s list with its sends (``mine``: its compute actions and sends) and its
    receives (``incoming``: the messages for it), each as late as the order of its sender's
    messages allows (:func:`with_communication`)."""
    # Per sender: the receives in send order and the position that needs each.
    use = {(action.kind, action.chunk, action.microbatch): position for position, action in enumerate(own)}
    queues: dict[int, list[tuple[int, Action]]] = {}
    for sender, action, chunk in incoming:
        recv = Action(receiver, _SENDS[action.kind], action.microbatch, chunk)
        need = use.get((F if action.kind == SEND_ACT else B, chunk, action.microbatch), len(own))
        queues.setdefault(sender, []).append((need, recv))
    # Latest position each queue's k-th receive may take: the minimum need over its suffix.
    for items in queues.values():
        latest = len(own)
        for k in range(len(items) - 1, -1, -1):
            latest = min(latest, items[k][0])
            items[k] = (latest, items[k][1])
    heads = {sender: 0 for sender in queues}
    senders = sorted(queues)
    out = []
    position = 0
    for action in mine:
        if action.kind in COMPUTE:
            for sender in senders:
                items = queues[sender]
                while heads[sender] < len(items) and items[heads[sender]][0] <= position:
                    out.append(items[heads[sender]][1])
                    heads[sender] += 1
            position += 1
        out.append(action)
    for sender in sorted(queues):  # messages no compute action uses (a malformed input): at the end
        out += [recv for _, recv in queues[sender][heads[sender] :]]
    return out


def _interleaved_order(p: int, m: int, v: int, rank: int, warmup: int, split: bool, w_delay: int) -> list[Action]:
    """Rank ``r``'s compute actions in Megatron's interleaved order (see the module docstring).

    ``warmup`` forwards first, then one forward and one backward at a time, then the remaining
    backwards. With ``split`` each backward is a ``B`` and the ``W`` of the backward ``w_delay``
    backwards earlier follows it (the remaining ``W`` s close the list).
    """
    total = m * v

    def fwd(k: int) -> Action:
        return Action(rank, F, (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int, kind: str) -> Action:
        return Action(rank, kind, (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    out = [fwd(k) for k in range(warmup)]
    done_w = 0
    for k in range(total):
        if warmup + k < total:
            out.append(fwd(warmup + k))
        out.append(bwd(k, B))
        if split and k >= w_delay:
            out.append(bwd(done_w, W))
            done_w += 1
    if split:
        out += [bwd(k, W) for k in range(done_w, total)]
    return out


def _check_interleaved(p: int, m: int, v: int, name: str) -> None:
    _check_sizes(p, m, v)
    if m < p:
        raise ScheduleError(
            f"{name} needs at least as many micro-batches as pipeline ranks: got {m} for {p}; "
            "raise the number of micro-batches (smaller micro-batch size) or use fewer stages"
        )
    if v > 1 and m % p:
        raise ScheduleError(
            f"{name} with {v} model chunks per rank runs micro-batches in groups of p = {p} "
            f"(each group goes through one chunk on every rank before the next chunk): {m} "
            f"micro-batches is not a multiple of {p}, and a partial last group makes ranks wait on "
            f"each other (e.g. p=4, m=5, v=3 deadlocks); use {max(p, m - m % p)} or {m - m % p + p} "
            "micro-batches, or v = 1"
        )


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B with ``v`` model chunks per rank in Megatron-LM's order.

    Rank ``r`` warms up with ``min(2 (p - r - 1) + (v - 1) p, m v)`` forwards (chunk by chunk
    in groups of ``p`` micro-batches), then alternates a forward and a backward, then drains; see
    the module docstring for the order and its costs. ``v = 1`` is :func:`one_f_one_b`.
    Raises :class:`ScheduleError` when ``m < p`` or, with ``v > 1``, ``m`` is not a multiple of
    ``p``.
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    _check_interleaved(p, m, v, "interleaved 1F1B")
    if v == 1:
        return one_f_one_b(p, m)
    return with_communication(interleaved_compute(p, m, v), p, v)


def interleaved_compute(num_stages: int, num_microbatches: int, virtual_stages: int, split: bool = False) -> Schedule:
    """Each rank's compute actions of :func:`interleaved_one_f_one_b` (``split``: of
    :func:`interleaved_zero_bubble`, ``B`` and ``W`` apart) without the sends and receives
    (:func:`with_communication` adds them): what an analysis of the order alone reads (the
    activations held), for far less than placing every message. Same checks."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    _check_interleaved(p, m, v, "the zero-bubble schedule" if split else "interleaved 1F1B")
    if split:
        return [
            _interleaved_order(p, m, v, rank, min((v - 1) * p + p - rank - 1, m * v), True, rank) for rank in range(p)
        ]
    return [
        _interleaved_order(p, m, v, rank, min(2 * (p - rank - 1) + (v - 1) * p, m * v), False, 0) for rank in range(p)
    ]


def interleaved_zero_bubble(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Zero-bubble pipeline: the (interleaved) 1F1B order with backward split into ``B`` and ``W``.

    Rank ``r`` warms up with ``(v - 1) p + p - r - 1`` forwards (1F1B's count plus whole rounds
    of chunks), then alternates a forward and a ``B``, each ``B`` followed by the ``W`` of the
    backward ``r`` backwards earlier; the remaining ``W`` s fill the cool-down. ``v = 1`` is ZB-H1
    (Qi et al. 2023); ``v > 1`` is torch's ``ScheduleInterleavedZeroBubble`` order. Same
    micro-batch rules as :func:`interleaved_one_f_one_b`.
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    return with_communication(interleaved_compute(p, m, v, split=True), p, v)


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B's order and memory, ``W`` delayed ``r`` micro-batches on rank
    ``r`` to fill the cool-down; bubble ratio ``(p - 1) / (3 m)`` when ``F = B = W``."""
    return interleaved_zero_bubble(num_stages, num_microbatches, 1)


def one_f_one_b_bubble(num_stages: int, num_microbatches: int) -> float:
    """Analytic bubble fraction of 1F1B (and GPipe) with equal stage times: ``(p-1)/(m+p-1)``."""
    _check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def format_schedule(sched: Schedule) -> str:
    """One line per rank, e.g. ``rank 1: RECV_ACT0@s1 F0@s1 ...``."""
    return "\n".join(f"rank {stage}: " + " ".join(map(str, acts)) for stage, acts in enumerate(sched))


# --------------------------------------------------------------------------- validation


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def validate_rank(
    actions: Sequence[Action], stage: int, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> None:
    """Check one rank's list on its own (no cross-rank matching).

    Every (chunk, micro-batch) has exactly one ``F`` and one ``B``, ``B`` after ``F``, and, if the
    list has any ``W``, exactly one ``W`` after its ``B``. A chunk with a predecessor receives each
    micro-batch's activations before its ``F`` and sends its input gradient after its ``B``; a
    chunk with a successor sends activations after ``F`` and receives the output gradient before
    ``B``. Raises :class:`ScheduleError` naming the offending action.
    """
    _check_sizes(num_stages, num_microbatches, virtual_stages)
    p, m, v = num_stages, num_microbatches, virtual_stages
    if not 0 <= stage < p:
        raise ScheduleError(f"stage {stage} is outside 0..{p - 1}")
    noun = "stage" if v == 1 else "model chunk"

    def allowed(chunk: int) -> set[str]:
        model_chunk = chunk * p + stage
        kinds = {F, B, W}
        if model_chunk > 0:
            kinds |= {RECV_ACT, SEND_GRAD}
        if model_chunk < p * v - 1:
            kinds |= {SEND_ACT, RECV_GRAD}
        return kinds

    pos: dict[tuple[str, int, int], int] = {}
    counts: Counter = Counter()
    for idx, action in enumerate(actions):
        if not isinstance(action, Action):
            raise ScheduleError(f"rank {stage}'s list holds {action!r} at position {idx}, not an Action")
        if action.stage != stage:
            raise ScheduleError(f"{action} is in rank {stage}'s list but names stage {action.stage}")
        if action.microbatch >= m:
            raise ScheduleError(f"{action} names micro-batch {action.microbatch}, but there are only {m} (0..{m - 1})")
        if action.chunk >= v:
            raise ScheduleError(
                f"{action} names local chunk {action.chunk}, but there are {v} model chunk{'s' if v > 1 else ''} per rank "
                f"(pass virtual_stages)"
            )
        if action.kind not in allowed(action.chunk):
            where = "the first" if action.kind in (RECV_ACT, SEND_GRAD) else "the last"
            raise ScheduleError(
                f"{action} cannot run on {where} {noun} ({noun} {action.model_chunk(p)} of {p * v}): there is no neighbour"
            )
        key = (action.kind, action.chunk, action.microbatch)
        counts[key] += 1
        if counts[key] > 1:
            raise ScheduleError(f"{action} appears more than once in rank {stage}'s list (position {idx} repeats it)")
        pos[key] = idx
    split = any(action.kind == W for action in actions)
    # Each required action exists, and dependencies come first.
    required = ((F, RECV_ACT), (SEND_ACT, F), (B, F), (B, RECV_GRAD), (SEND_GRAD, B), (W, B))
    for j in range(v):
        kinds = allowed(j) - (set() if split else {W})
        for i in range(m):
            for kind in sorted(kinds, key=KINDS.index):
                if (kind, j, i) not in pos:
                    why = " (the list has W actions, so every B needs its W)" if kind == W else ""
                    raise ScheduleError(
                        f"rank {stage}'s list has no {Action(stage, kind, i, j)} (every micro-batch needs one){why}"
                    )
            for later, earlier in required:
                if later in kinds and earlier in kinds and pos[(later, j, i)] < pos[(earlier, j, i)]:
                    raise ScheduleError(
                        f"{Action(stage, later, i, j)} comes before {Action(stage, earlier, i, j)} in rank {stage}'s list, "
                        f"but it needs that one's result"
                    )


def _messages(sched: Schedule, src: int, dst: int) -> tuple[list[Action], list[Action]]:
    """The sends of ``src`` to ``dst`` and the receives of ``dst`` from ``src``, each in list order."""
    p = len(sched)
    sends = [action for action in sched[src] if action.kind in _SENDS and _peer(action, p)[0] == dst]
    recvs = [action for action in sched[dst] if action.kind in _RECVS and _peer(action, p)[0] == src]
    return sends, recvs


def validate_schedule(sched: Schedule, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    """Check every rank's list (:func:`validate_rank`) and that every message is received.

    Messages from rank ``q`` to rank ``r`` are matched in order, so the k-th send of ``q`` to
    ``r`` and the k-th receive of ``r`` from ``q`` must name the same kind, chunk and micro-batch.
    """
    _check_sizes(num_stages, num_microbatches, virtual_stages)
    p = num_stages
    if len(sched) != p:
        raise ScheduleError(f"the schedule has {len(sched)} rank lists but there are {p} stages")
    for stage, acts in enumerate(sched):
        validate_rank(acts, stage, p, num_microbatches, virtual_stages)
    for src in range(p):
        for dst in range(p):
            sends, recvs = _messages(sched, src, dst)
            kinds = {action.kind for action in sends}
            what = next(iter(kinds)) if len(kinds) == 1 else f"message to stage {dst}"
            rwhat = _SENDS[what] if len(kinds) == 1 else f"receive from stage {src}"
            for k, (snd, rcv) in enumerate(zip(sends, recvs)):
                rank, chunk = _peer(snd, p)
                if (_SENDS[snd.kind], chunk, snd.microbatch) != (rcv.kind, rcv.chunk, rcv.microbatch):
                    raise ScheduleError(
                        f"{snd} is stage {src}'s {_ordinal(k + 1)} {what} but stage {dst}'s "
                        f"{_ordinal(k + 1)} {rwhat} is {rcv}: messages between two ranks are "
                        f"matched in order, so {snd}'s data would arrive as {rcv}'s"
                    )
            if len(sends) != len(recvs):  # cannot happen after validate_rank, kept as a guard
                raise ScheduleError(
                    f"stage {src} posts {len(sends)} messages to stage {dst}, which receives {len(recvs)}"
                )


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
    """Per rank, the summed duration of its ``F``, ``B`` and ``W`` actions."""
    bubble_fraction: float
    """``1 - sum(compute_time) / (num_stages * makespan)``: the share of stage-time not computing."""
    start: dict[Action, float] = field(default_factory=dict)
    end: dict[Action, float] = field(default_factory=dict)

    @property
    def bubble_ratio(self) -> float:
        """Idle time per unit of compute, ``(p makespan - sum compute) / sum compute``: the
        bubble as Megatron-LM and the zero-bubble paper count it (``(p - 1) / m`` for 1F1B)."""
        busy = sum(self.compute_time)
        return (len(self.compute_time) * self.makespan - busy) / busy if busy > 0 else 0.0


TimeSpec = float | Sequence[float] | Callable[[int], float]


def _per_stage(spec: TimeSpec, chunk: int, name: str) -> float:
    if callable(spec):
        value = spec(chunk)
    elif isinstance(spec, (int, float)):
        value = spec
    else:
        value = spec[chunk]
    if value < 0:
        raise ValueError(f"{name} for stage {chunk} is negative ({value})")
    return float(value)


def _peer(action: Action, num_stages: int) -> tuple[int, int]:
    """``(rank, local chunk)`` at the other end of a communication action."""
    peer = action.peer_of(num_stages)
    assert peer is not None, f"{action} is not a communication action"
    return peer


def _durations(
    sched: Schedule, forward_time: TimeSpec, backward_time: TimeSpec, weight_time: TimeSpec | None
) -> dict[str, TimeSpec]:
    """Each compute kind's time; with ``W`` actions and no ``weight_time``, ``B`` and ``W`` each
    take half of ``backward_time``."""
    return _durations_of(
        any(action.kind == W for acts in sched for action in acts), forward_time, backward_time, weight_time
    )


def _durations_of(
    split: bool, forward_time: TimeSpec, backward_time: TimeSpec, weight_time: TimeSpec | None
) -> dict[str, TimeSpec]:
    """:func:`_durations` of a schedule that has ``W`` actions (``split``) or none."""
    if split and weight_time is None:
        full_backward = backward_time

        def half_backward(chunk: int) -> float:
            return _per_stage(full_backward, chunk, "B time") / 2

        backward_time = weight_time = half_backward
    durations: dict[str, TimeSpec] = {F: forward_time, B: backward_time}
    if weight_time is not None:
        durations[W] = weight_time
    return durations


class _Simulation:
    """The state of :func:`simulate`: each rank's clock and next action, and the messages in flight."""

    def __init__(self, sched: Schedule, durations: dict[str, TimeSpec], p2p_time: float, send_time: float):
        ranks = len(sched)
        self.sched, self.durations = sched, durations
        self.p2p_time, self.send_time = p2p_time, send_time
        self.chunks = num_chunks(sched)
        self.next_index = [0] * ranks
        self.clock = [0.0] * ranks
        self.timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(ranks)]
        self.compute = [0.0] * ranks
        self.queues: dict[tuple[int, int], deque] = {}
        """(sender, receiver) -> FIFO of (arrival time, send action)."""
        self.start: dict[Action, float] = {}
        self.end: dict[Action, float] = {}
        self.order: list[tuple[int, Action]] = []
        """Every action as it ran, over all ranks: an order that no times change (:class:`TimingProgram`)."""

    def _record(self, rank: int, action: Action, began: float, ended: float) -> None:
        self.order.append((rank, action))
        self.timeline[rank].append((action, began, ended))
        self.start[action], self.end[action] = began, ended
        self.clock[rank] = ended
        self.next_index[rank] += 1

    def _step(self, rank: int, action: Action) -> bool:
        """Run ``action`` on ``rank``; False when it is a receive whose message is not there yet."""
        ranks = len(self.sched)
        began = self.clock[rank]
        if action.kind in COMPUTE:
            duration = _per_stage(self.durations[action.kind], action.model_chunk(ranks), f"{action.kind} time")
            self.compute[rank] += duration
            self._record(rank, action, began, began + duration)
        elif action.kind in _SENDS:
            receiver, _ = _peer(action, ranks)
            if not 0 <= action.model_chunk(ranks) + _DIRECTION[action.kind] < ranks * self.chunks:
                raise ScheduleError(f"{action} sends to {_target(action, ranks, self.chunks)}, which does not exist")
            arrival = began + self.send_time + self.p2p_time
            self.queues.setdefault((rank, receiver), deque()).append((arrival, action))
            self._record(rank, action, began, began + self.send_time)
        else:
            sender, _ = _peer(action, ranks)
            queue = self.queues.get((sender, rank))
            if not queue:
                return False  # blocked
            arrival, send = queue[0]
            if (_SENDS[send.kind], _peer(send, ranks)[1], send.microbatch) != (
                action.kind,
                action.chunk,
                action.microbatch,
            ):
                raise ScheduleError(
                    f"{action} would receive {send}'s message: messages between two ranks are "
                    f"matched in order, so the schedules disagree on the order"
                )
            queue.popleft()
            self._record(rank, action, began, max(began, arrival))
        return True

    def _advance(self, rank: int) -> bool:
        """Run ``rank``'s actions until it blocks or finishes; whether it ran any."""
        progressed = False
        actions = self.sched[rank]
        while self.next_index[rank] < len(actions):
            action = actions[self.next_index[rank]]
            if action.stage != rank:
                raise ScheduleError(f"{action} is in rank {rank}'s list but names stage {action.stage}")
            if not self._step(rank, action):
                break
            progressed = True
        return progressed

    def run(self) -> SimResult:
        ranks = len(self.sched)
        progress = True
        while progress:
            progress = False
            for rank in range(ranks):
                progress |= self._advance(rank)
        unfinished = [rank for rank in range(ranks) if self.next_index[rank] < len(self.sched[rank])]
        if unfinished:
            raise _deadlock(self.sched, self.next_index, unfinished)
        makespan = max(self.clock) if ranks else 0.0
        busy = sum(self.compute)
        bubble = 1.0 - busy / (ranks * makespan) if makespan > 0 else 0.0
        return SimResult(self.timeline, makespan, self.compute, bubble, self.start, self.end)


def simulate(
    sched: Schedule,
    *,
    forward_time: TimeSpec = 1.0,
    backward_time: TimeSpec = 2.0,
    weight_time: TimeSpec | None = None,
    p2p_time: float = 0.0,
    send_time: float = 0.0,
) -> SimResult:
    """Execute the per-rank lists under the executor's semantics, without processes.

    Each rank runs its actions in order on its own clock. Times are given per model chunk (a
    number, a sequence indexed by the chunk's place in model order, or a function of it; with
    ``v = 1`` that is the stage). ``F`` takes ``forward_time``. In a schedule without ``W``,
    ``B`` takes ``backward_time``; with ``W`` actions, ``B`` takes ``backward_time`` and ``W``
    ``weight_time``, or, when ``weight_time`` is ``None``, each takes half of ``backward_time``
    (the same work as one full backward, split). A send occupies its rank for ``send_time`` and
    never blocks; its message arrives ``p2p_time`` after the send ends. A receive blocks until its
    message has arrived: ``end = max(reached, arrival)``.

    Because a rank's times depend only on its own earlier actions and on arrival times of messages
    already sent, the ranks can be advanced in any order; when no rank can advance and some are
    unfinished, the schedule deadlocks: :class:`DeadlockError` names each blocked receive and the
    cycle of ranks waiting on one another. A receive whose queue head is another message raises
    :class:`ScheduleError` (the FIFO mismatch :func:`validate_schedule` reports).
    """
    if not sched:
        raise ValueError("empty schedule")
    durations = _durations(sched, forward_time, backward_time, weight_time)
    return _Simulation(sched, durations, p2p_time, send_time).run()


_SEND_SLOT, _RECV_SLOT = -1, -2


class TimingProgram:
    """A schedule's simulation with the times left open: what :func:`simulate` does, as flat
    integer steps, so that one schedule can be priced under many times (the planner prices each
    kept strategy's chunk times) at a fraction of a simulation's cost.

    Which send each receive waits for does not depend on the times (messages between two ranks
    are matched in order), and neither does an order in which every action comes after its
    rank's previous one and every receive after its send. One walk of the lists in such an order
    fixes, for each action in turn, its rank and either its compute slot (kind and model chunk)
    or the message; :meth:`makespan` replays those steps with the times, adding them in the same
    order per rank as :func:`simulate` (the same floats). A schedule the walk cannot finish (a
    deadlock, a misordered message, an action on the wrong rank) is handed to :func:`simulate`,
    whose error says what is wrong."""

    SEND = _SEND_SLOT
    """A step's slot when it is a send (its message is its own step's index)."""
    RECEIVE = _RECV_SLOT
    """A step's slot when it is a receive (its message is the index of the send's step)."""

    def __init__(self, ranks: int, chunks: int, steps: Sequence[Sequence[int]], split: bool):
        steps = list(steps)
        self._init(
            ranks, chunks, [step[0] for step in steps], [step[1] for step in steps], [step[2] for step in steps], split
        )

    @classmethod
    def of_columns(
        cls, ranks: int, chunks: int, rank: list[int], slot: list[int], message: list[int], *, split: bool
    ) -> "TimingProgram":
        """The program of these steps given as three columns (what a store of the program reads
        back without building a tuple per step)."""
        program = cls.__new__(cls)
        program._init(ranks, chunks, rank, slot, message, split)
        return program

    def _init(self, ranks: int, chunks: int, rank: list[int], slot: list[int], message: list[int], split: bool) -> None:
        if not len(rank) == len(slot) == len(message):
            raise ValueError("the columns of a program's steps differ in length")
        self.ranks, self.chunks = ranks, chunks
        self.columns = (rank, slot, message)
        """The steps as three columns: ``rank``, ``slot`` and ``message`` per action in a runnable
        order; ``slot`` is ``k p v + c`` for compute kind ``k`` (``F``, ``B``, ``W``) of model
        chunk ``c``, else :attr:`SEND` or :attr:`RECEIVE`."""
        self.split = split
        """Whether the schedule has ``W`` actions (``B`` is then the input-gradient half)."""
        self.messages = slot.count(_SEND_SLOT)
        """Point-to-point messages of one step, over all ranks."""

    @property
    def steps(self) -> list[tuple[int, int, int]]:
        """``(rank, slot, message)`` per action in a runnable order (:attr:`columns` as rows)."""
        return list(zip(*self.columns))

    @classmethod
    def of(cls, sched: Schedule) -> "TimingProgram":
        """The program of ``sched``; raises :func:`simulate`'s error for a schedule that cannot run."""
        ranks, chunks = len(sched), num_chunks(sched)
        slots = {kind: index * ranks * chunks for index, kind in enumerate(COMPUTE)}
        queues: list[list[deque]] = [[deque() for _ in range(ranks)] for _ in range(ranks)]
        """``[sender][receiver]``: the messages sent and not received yet, as (index, what)."""
        steps: list[tuple[int, int, int]] = []
        done = [0] * ranks
        progress = True
        while progress:
            progress = False
            for rank, acts in enumerate(sched):
                index = done[rank]
                while index < len(acts) and cls._walk(acts[index], rank, ranks, chunks, slots, queues, steps):
                    index += 1
                progress |= index > done[rank]
                done[rank] = index
        if any(index < len(acts) for index, acts in zip(done, sched)):
            simulate(sched)  # raises the deadlock or mismatch that stopped the walk
            raise ScheduleError("the schedule's messages cannot be matched")  # pragma: no cover
        return cls(ranks, chunks, tuple(steps), any(action.kind == W for acts in sched for action in acts))

    @staticmethod
    def _walk(action: Action, rank: int, ranks: int, chunks: int, slots: dict, queues: list, steps: list) -> bool:
        """Append ``action``'s step; False when it cannot run yet or is malformed (stops the walk)."""
        kind = action.kind
        if action.stage != rank:
            return False
        if kind in slots:
            steps.append((rank, slots[kind] + action.chunk * ranks + rank, 0))
            return True
        target = action.chunk * ranks + rank + _DIRECTION[kind]
        if not 0 <= target < ranks * chunks:
            return False
        peer, chunk = target % ranks, target // ranks
        if kind in _SENDS:
            message = len(steps)  # the send's step names its message
            queues[rank][peer].append((message, (_SENDS[kind], chunk, action.microbatch)))
            steps.append((rank, _SEND_SLOT, message))
            return True
        queue = queues[peer][rank]
        if not queue or queue[0][1] != (kind, action.chunk, action.microbatch):
            return False
        steps.append((rank, _RECV_SLOT, queue.popleft()[0]))
        return True

    def makespan(
        self,
        *,
        forward_time: TimeSpec = 1.0,
        backward_time: TimeSpec = 2.0,
        weight_time: TimeSpec | None = None,
        p2p_time: float = 0.0,
        send_time: float = 0.0,
    ) -> float:
        """:func:`simulate`'s makespan under these times (the same arguments, the same result)."""
        durations = _durations_of(self.split, forward_time, backward_time, weight_time)
        table = [
            _per_stage(durations[kind], chunk, f"{kind} time") if kind in durations else 0.0
            for kind in COMPUTE
            for chunk in range(self.ranks * self.chunks)
        ]
        clock = [0.0] * self.ranks
        arrivals = [0.0] * len(self.columns[0])  # by the index of the send's step
        for rank, slot, message in zip(*self.columns):
            if slot >= 0:
                clock[rank] += table[slot]
            elif slot == _SEND_SLOT:
                clock[rank] += send_time
                arrivals[message] = clock[rank] + p2p_time
            elif arrivals[message] > clock[rank]:
                clock[rank] = arrivals[message]
        return max(clock)


def _deadlock(sched: Schedule, next_index: list[int], unfinished: list[int]) -> DeadlockError:
    ranks, chunks = len(sched), num_chunks(sched)
    stuck = [sched[rank][next_index[rank]] for rank in unfinished]
    lines = []
    waits_on: dict[int, int] = {}
    for action in stuck:
        sender, chunk = _peer(action, ranks)
        if not 0 <= action.model_chunk(ranks) + _DIRECTION[action.kind] < ranks * chunks:
            lines.append(f"  {action} waits for a message from {_target(action, ranks, chunks)}, which does not exist")
            continue
        want = Action(sender, _RECVS[action.kind], action.microbatch, chunk)
        if next_index[sender] >= len(sched[sender]):
            lines.append(f"  {action} waits for {want}, but rank {sender} finished without sending it")
        else:
            waits_on[action.stage] = sender
            lines.append(
                f"  {action} waits for {want}; rank {sender} is blocked at {sched[sender][next_index[sender]]}"
            )
    cycle = _find_cycle(waits_on)
    head = "deadlock: no rank can make progress"
    if cycle:
        head += "; ranks wait on each other in a cycle " + " -> ".join(f"rank {rank}" for rank in cycle + cycle[:1])
    return DeadlockError(head + "\n" + "\n".join(lines), stuck)


def _target(action: Action, num_stages: int, chunks: int) -> str:
    target = action.model_chunk(num_stages) + _DIRECTION[action.kind]
    return f"stage {target}" if chunks == 1 else f"model chunk {target}"


def _find_cycle(waits_on: dict[int, int]) -> list[int]:
    for first in sorted(waits_on):
        seen: list[int] = []
        rank = first
        while rank in waits_on and rank not in seen:
            seen.append(rank)
            rank = waits_on[rank]
        if rank in seen:
            return seen[seen.index(rank) :]
    return []


# --------------------------------------------------------------------------- analysis


def peak_inflight(sched: Schedule) -> list[int]:
    """Per rank, the most (chunk, micro-batch) pairs whose ``F`` has run and whose ``B`` has not.

    That is the activations a rank holds at its peak, in units of one chunk's micro-batch
    (divide by ``v`` for whole-stage units): ``min(p - s, m)`` for 1F1B and ZB-H1, ``m`` for
    GPipe.
    """
    return peak_open(sched, F, B)


def peak_weight_pending(sched: Schedule) -> list[int]:
    """Per rank, the most (chunk, micro-batch) pairs whose ``F`` has run and whose ``W`` has not
    (their ``B`` if the schedule has no ``W``), in chunk units; at most ``p`` for ZB-H1. The paper
    counts only the inputs of the weight-gradient products as held between ``B`` and ``W``; the
    executor (:mod:`runtime.pipeline.executor`) keeps the chunk's whole graph until ``W``, so for it this
    is the count of full activations."""
    split = any(action.kind == W for acts in sched for action in acts)
    return peak_open(sched, F, W if split else B)


def peak_open(sched: Schedule, opens: str, closes: str) -> list[int]:
    """Per rank, the most actions of kind ``opens`` whose ``closes`` has not run yet (chunk units):
    ``(F, B)`` counts activations held, ``(B, W)`` weight gradients pending."""
    peaks = []
    for acts in sched:
        live = peak = 0
        for action in acts:
            if action.kind == opens:
                live += 1
                peak = max(peak, live)
            elif action.kind == closes:
                live -= 1
        peaks.append(peak)
    return peaks


@dataclass(frozen=True)
class ScheduleStats:
    """What a schedule costs, from :func:`analyze`: what the planner prices a schedule by."""

    makespan: float
    """Simulated time of one step's pipeline (the last rank's end)."""
    bubble_fraction: float
    """Share of rank-time not computing: ``1 - busy / (p makespan)``."""
    bubble_ratio: float
    """Idle time per unit of compute (``(p - 1) / m`` for 1F1B with equal stages)."""
    peak_activations: tuple[int, ...]
    """Per rank, peak micro-batches of full activations (``F`` done, ``B`` not), in units of one
    chunk's micro-batch activations."""
    peak_weight_inputs: tuple[int, ...]
    """Per rank, peak micro-batches whose ``W`` is pending (the inputs the weight gradients
    need), in chunk units; equal to ``peak_activations`` without ``W`` actions."""
    messages: int
    """Point-to-point messages sent in one step, over all ranks."""


def analyze(
    sched: Schedule,
    *,
    forward_time: TimeSpec = 1.0,
    backward_time: TimeSpec = 2.0,
    weight_time: TimeSpec | None = None,
    p2p_time: float = 0.0,
    send_time: float = 0.0,
) -> ScheduleStats:
    """Simulate ``sched`` (see :func:`simulate` for the times) and summarize its cost."""
    res = simulate(
        sched,
        forward_time=forward_time,
        backward_time=backward_time,
        weight_time=weight_time,
        p2p_time=p2p_time,
        send_time=send_time,
    )
    return ScheduleStats(
        makespan=res.makespan,
        bubble_fraction=res.bubble_fraction,
        bubble_ratio=res.bubble_ratio,
        peak_activations=tuple(peak_inflight(sched)),
        peak_weight_inputs=tuple(peak_weight_pending(sched)),
        messages=sum(action.kind in _SENDS for acts in sched for action in acts),
    )
