"""What overlapped communication costs: each collective's window of independent compute.

The runtime (``runtime.contract.overlap``) runs collectives beside compute, and each slows the
other (``cost_models.hardware``): compute by the profile's ``overlap_slowdown`` ``kappa`` (``t``
seconds of it take ``(1 + kappa) t``), the collective to its ``overlap_comm_rate`` ``rho`` of its
speed. A window of ``w`` seconds of compute that does not depend on a collective of ``c`` seconds
therefore lasts ``(1 + kappa) w`` beside it and hides ``h = min(c, g w)`` of it, with the *gain*
``g = rho (1 + kappa)`` (``HardwareProfile.overlap_window_gain``); ``c - h`` is exposed. Over the
``h / rho`` seconds both run, compute loses ``kappa / (1 + kappa)`` of its speed: ``h kappa / g``
more seconds of compute (the *contention*, ``HardwareProfile.overlap_contention`` per hidden
second). On a GPU ``rho = 1`` (NCCL keeps its own SMs); on a CPU whose cores run both, the two
rates share the cores (measured here: ``1 / (1 + kappa) + rho`` about 1). Windows, per layer, as
the runtime runs them:

Tensor parallel (per micro-batch, one layer's own products; :func:`tp_exposure`):

- without sequence parallelism the forward all-reduces are in line (their output feeds the next
  operator); the backward all-reduce of a column-parallel input gradient runs beside that linear's
  weight-gradient product: window ``COLUMN_WGRAD_SHARE x`` the layer's weight-gradient time;
- with sequence parallelism the all-gather before a column-parallel matmul and the reduce-scatter
  after a row-parallel one run in ``tp`` chunks beside the partial products (Wang et al. 2023,
  "Overlap communication with dependent computation via decomposition"): about one chunk is
  exposed, ``max(c / tp, c - w)`` with ``w`` the pass's compute; the backward's re-gather of the
  column-parallel inputs (only each rank's positions are saved) runs beside their input-gradient
  products (Megatron-LM's order): window ``COLUMN_WGRAD_SHARE x`` the row's input-gradient time
  (backward less weight gradients), and what it hides is taken from the chunked collectives' window;
- a recomputed forward's collectives are exposed in the forward's proportion.

Data parallel / ZeRO (:func:`dp_exposure`, layer table rows ``0..n-1``; ``f_j``, ``b_j`` row ``j``'s
forward and backward compute of one micro-batch). Row ``j``'s pass is the window of:

- backward: the gradient reduction of row ``j + 1`` (ZeRO 0/1: all-reduce in the last
  micro-batch; ZeRO 2/3: reduce-scatter every micro-batch; launched when row ``j + 1``'s backward
  ends) and, at ZeRO 3, the backward gather of row ``j - 1`` (prefetched one layer ahead). ZeRO
  0/1 reductions go by *bucket*, as the runtime forms them (:func:`grad_buckets`: consecutive rows
  in backward order up to ``GRAD_BUCKET_BYTES``, the first up to ``FIRST_BUCKET_BYTES``): a
  bucket's all-reduce launches when its first row's backward ends and its window is the backward
  of the rows down to the next bucket's launch. Layers of 25 MiB or more are buckets of their own
  (the per-row rule above); small models' layers share buckets and much of their reduction waits
  for the end of backward (a 4-block GPT of hidden 256 reduces its blocks with the embedding);
- forward: the ZeRO-3 parameter all-gather of row ``j + 1`` (every micro-batch, prefetched one
  layer ahead).

ZeRO 1/2 gather each row's parameters once per step: ``step()`` updates the rows in forward order
and launches row ``j``'s all-gather as soon as row ``j``'s update is done, and the next forward
waits for it at row ``j``'s first use. :func:`_gathers` runs that on one channel: the gathers go
in launch order, beside the remaining updates (``u_j`` row ``j``'s optimizer seconds on this
rank, :func:`dp_exposure`'s ``update``) and then the forward, whose rows wait for theirs. The
first row's gather (often the embedding, the largest) hides under every later row's update.
Measured on 2 CPU ranks (``benchmarks/bench_validate.py``'s dp2-z1, a per-wait log): the gathers'
waits came to 1-1.6 ms a step where a forward-only window priced 7.7 ms. The channel runs over
the whole table, as one stage's (a later pipeline stage starts its own: an error of the backlog
carried over a stage boundary).

Row 0's reduction and ZeRO-3 forward gather and the last row's backward gather have no window. Each
window's exposure ``max(0, sum c - w)`` is charged to the row owning the window, so every term
is a per-row constant and the ILP stays linear. Repeated blocks keep one cost: the first block's
difference from the steady state (its neighbour is the embedding row) is moved onto row 0, which
is exact whenever rows 0 and 1 share a stage (a pipeline cut right after row 0 misplaces it).
A stage's first row's collectives are priced with the previous row's window even when that row
is on another stage (an error of one layer's reduction per pipeline boundary).

Not overlapped (priced as before): tied-weight all-reduces, the 1-bit Adam exchange (its
full-precision warm-up is), and the data-parallel traffic of plans that offload (the offload
engine waits for its transfers). The buckets are formed over the whole table, as one stage's: a
pipeline stage's own buckets start at its last row (small layers only; an error of one bucket per
stage boundary).
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

from runtime.contract.limits import FIRST_BUCKET_BYTES, GRAD_BUCKET_BYTES

__all__ = [
    "COLUMN_WGRAD_SHARE",
    "Hidden",
    "hide",
    "tp_exposure",
    "TpExposure",
    "DpTraffic",
    "DpExposure",
    "dp_exposure",
    "grad_buckets",
]

#: Of a transformer block's weight-gradient products, the share of the column-parallel linears,
#: whose input gradients are all-reduced in backward: in a GPT block QKV (3 h^2) and the first MLP
#: linear (4 h^2) of 12 h^2.
COLUMN_WGRAD_SHARE = 7 / 12


class Hidden(NamedTuple):
    """A collective (or several) beside a window: the exposed and the hidden seconds."""

    exposed_s: float
    hidden_s: float


def hide(comm_s: float, window_s: float, gain: float = 1.0) -> Hidden:
    """``comm_s`` of communication beside ``window_s`` of independent compute, of which a second
    hides ``gain`` seconds of communication (``HardwareProfile.overlap_window_gain``)."""
    hidden = min(max(comm_s, 0.0), gain * max(window_s, 0.0))
    return Hidden(max(comm_s, 0.0) - hidden, hidden)


def _chunked(comm_s: float, window_s: float, chunks: int, gain: float) -> Hidden:
    """A collective decomposed into ``chunks`` beside partial products: one chunk at least exposed."""
    exposed = max(comm_s / max(chunks, 1), comm_s - gain * max(window_s, 0.0), 0.0)
    exposed = min(exposed, max(comm_s, 0.0))
    return Hidden(exposed, max(comm_s, 0.0) - exposed)


class TpExposure(NamedTuple):
    """A row's tensor-parallel collectives of one micro-batch once overlapped."""

    fwd: Hidden
    bwd: Hidden
    rec: Hidden
    """What a recompute repeats."""


def tp_exposure(
    fwd_comm_s: float,
    bwd_comm_s: float,
    rec_comm_s: float,
    passes: tuple[float, float, float],
    tp: int,
    sequence_parallel: bool,
    regather_s: float = 0.0,
    gain: float = 1.0,
) -> TpExposure:
    """Exposed and hidden TP seconds (module docstring). ``passes``: the row's forward, backward
    and weight-gradient compute seconds of one micro-batch; ``regather_s``: under sequence
    parallelism, the backward's all-gathers of the column-parallel inputs (not in ``bwd_comm_s``);
    ``gain``: the profile's ``overlap_window_gain``."""
    forward_s, backward_s, wgrad_s = passes
    if sequence_parallel:
        fwd = _chunked(fwd_comm_s, forward_s, tp, gain)
        regather = hide(regather_s, COLUMN_WGRAD_SHARE * max(backward_s - wgrad_s, 0.0), gain)
        bwd = _add(regather, _chunked(bwd_comm_s, backward_s - regather.hidden_s / gain, tp, gain))
    else:
        fwd = Hidden(fwd_comm_s, 0.0)
        bwd = hide(bwd_comm_s, COLUMN_WGRAD_SHARE * wgrad_s, gain)
    share = fwd.exposed_s / fwd_comm_s if fwd_comm_s > 0 else 1.0
    rec = Hidden(rec_comm_s * share, rec_comm_s * (1 - share))
    return TpExposure(fwd, bwd, rec)


class DpTraffic(NamedTuple):
    """One row's data-parallel collectives by when the runtime runs them (seconds, one device)."""

    grad_step_s: float = 0.0
    """Gradient all-reduce of the last micro-batch (ZeRO 0/1)."""
    gather_step_s: float = 0.0
    """Parameter all-gather after the optimizer step, waited in the next forward (ZeRO 1/2)."""
    reduce_mb_s: float = 0.0
    """Gradient reduce-scatter of every micro-batch (ZeRO 2/3)."""
    fwd_gather_mb_s: float = 0.0
    """ZeRO-3 parameter gather for the forward of every micro-batch."""
    bwd_gather_mb_s: float = 0.0
    """ZeRO-3 parameter gather for the backward of every micro-batch."""
    grad_bytes: float = 0.0
    """Bytes of the row's gradient that ``grad_step_s`` all-reduces (ZeRO 0/1): what fills its bucket."""


class DpExposure(NamedTuple):
    """One row's share of the data-parallel cost once overlapped."""

    step: Hidden
    """Per step (ZeRO 0/1 reductions, ZeRO 1/2 gathers)."""
    micro_batch: Hidden
    """Per micro-batch (ZeRO 2/3)."""


def grad_buckets(traffic: Sequence[DpTraffic]) -> list[list[int]]:
    """The ZeRO 0/1 gradient buckets over the rows that all-reduce one, as the runtime forms them
    (``runtime.data_parallel.grad_reduction.make_buckets``): consecutive rows in backward order,
    the first bucket at most ``FIRST_BUCKET_BYTES``, the others ``GRAD_BUCKET_BYTES`` (a larger row
    is a bucket of its own). Each bucket lists its rows from the last to the first."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size, cap = 0.0, float(min(GRAD_BUCKET_BYTES, FIRST_BUCKET_BYTES))
    for j in reversed(range(len(traffic))):
        row_bytes = traffic[j].grad_bytes
        if row_bytes <= 0 and traffic[j].grad_step_s <= 0:
            continue
        if current and size + row_bytes > cap:
            buckets.append(current)
            current, size, cap = [], 0.0, float(GRAD_BUCKET_BYTES)
        current.append(j)
        size += row_bytes
    if current:
        buckets.append(current)
    return buckets


def _carries(row: DpTraffic) -> bool:
    """Whether the row all-reduces a gradient (ZeRO 0/1): it joins a bucket."""
    return row.grad_bytes > 0 or row.grad_step_s > 0


def _single_rows(traffic: Sequence[DpTraffic], rows: Sequence[int]) -> bool:
    """Whether ``rows`` (every distinct row) make one-row buckets only: any two reductions exceed
    a bucket (``grad_buckets``; the first bucket's smaller cap then holds too)."""
    return all(traffic[j].grad_bytes * 2 > GRAD_BUCKET_BYTES for j in rows if _carries(traffic[j]))


def _one_row_reduction(j: int, traffic: Sequence[DpTraffic], bwd: Sequence[float]) -> Hidden:
    """Row ``j``'s share when every bucket is one row: row ``j + 1``'s all-reduce beside the
    backward down to the next row that reduces (row ``j`` itself, unless it has no gradient), and
    at row 0 its own, exposed."""
    share = Hidden(0.0, 0.0)
    if j + 1 < len(traffic) and _carries(traffic[j + 1]):
        stop = j
        while stop > 0 and not _carries(traffic[stop]):
            stop -= 1
        share = hide(traffic[j + 1].grad_step_s, bwd[j] if stop == j else sum(bwd[stop : j + 1]))
    if j == 0 and _carries(traffic[0]):
        share = _add(share, Hidden(traffic[0].grad_step_s, 0.0))
    return share


def _many_row_reductions(traffic: Sequence[DpTraffic], bwd: Sequence[float]) -> list[Hidden]:
    """Every row's share of the reductions, bucket by bucket (``_one_row_reduction``'s rule with a
    bucket's rows in place of one: its all-reduce launches when its first row's backward ends,
    beside the backward of the rows down to the next bucket's launch, charged to the row just
    below its launch; the bucket row 0 launches, to row 0)."""
    shares = [Hidden(0.0, 0.0)] * len(traffic)
    buckets = grad_buckets(traffic)
    for k, bucket in enumerate(buckets):
        launch = bucket[-1]
        comm_s = sum(traffic[j].grad_step_s for j in bucket)
        if launch == 0:
            shares[0] = _add(shares[0], Hidden(comm_s, 0.0))
            continue
        stop = buckets[k + 1][-1] if k + 1 < len(buckets) else 0
        shares[launch - 1] = _add(shares[launch - 1], hide(comm_s, sum(bwd[stop:launch])))
    return shares


def _row_exposure(
    j: int,
    traffic: Sequence[DpTraffic],
    passes: tuple[Sequence[float], Sequence[float], Sequence[float]],
    bucketed: Sequence[Hidden] | None,
) -> DpExposure:
    """Row ``j``'s exposure but its ZeRO 1/2 gather (:func:`_gathers`); ``passes``: every row's
    forward, backward and optimizer-update windows; ``bucketed``: every row's reductions when
    buckets hold several rows (``_many_row_reductions``), None when each is one row."""
    fwd, bwd, _update = passes
    n = len(traffic)
    after = traffic[j + 1] if j + 1 < n else DpTraffic()
    before = traffic[j - 1] if j > 0 else DpTraffic()
    step = bucketed[j] if bucketed is not None else _one_row_reduction(j, traffic, bwd)
    own = traffic[j]
    mb = _add(hide(after.reduce_mb_s + before.bwd_gather_mb_s, bwd[j]), hide(after.fwd_gather_mb_s, fwd[j]))
    if j == 0:  # nothing runs after row 0's backward or before its forward
        mb = _add(mb, Hidden(own.reduce_mb_s + own.fwd_gather_mb_s, 0.0))
    if j == n - 1:  # the first backward's gather: nothing runs before it
        mb = _add(mb, Hidden(own.bwd_gather_mb_s, 0.0))
    return DpExposure(step, mb)


def _gathers(
    traffic: Sequence[DpTraffic], passes: tuple[Sequence[float], Sequence[float], Sequence[float]], uniform: bool
) -> list[Hidden]:
    """Each row's ZeRO 1/2 gather as the runtime runs them (module docstring): one channel in
    launch order, row ``j``'s launched when row ``j``'s update ends and waited at row ``j``'s
    first use in the next forward (which starts when the updates end, and is held by each
    wait). A row is charged its wait (exposed) and the rest of its gather (hidden; a row that
    waits for earlier gathers may show less than nothing hidden: the totals are exact).
    ``uniform``: rows ``1 .. n-3`` are identical blocks, which share their mean (the same total;
    the block-count ILP needs identical rows)."""
    fwd, _bwd, update = passes
    comm = [row.gather_step_s for row in traffic]
    n = len(traffic)
    if not any(comm):  # ZeRO 0 and 3: nothing gathered once per step
        return [_NOTHING] * n
    clock, channel, ends = 0.0, 0.0, []
    for launch_after, seconds in zip(update, comm):  # the optimizer step, row by row
        clock += launch_after
        channel = max(channel, clock) + seconds
        ends.append(channel)
    waits = []
    for done, forward in zip(ends, fwd):  # the next forward
        wait = max(done - clock, 0.0)
        waits.append(wait)
        clock += wait + forward
    if not (uniform and n >= 5):
        return [Hidden(wait, seconds - wait) for wait, seconds in zip(waits, comm)]
    shares = [
        Hidden(wait, seconds - wait) for wait, seconds in zip(waits[:1] + waits[n - 2 :], comm[:1] + comm[n - 2 :])
    ]
    blocks = n - 3
    block_waits = waits[1 : n - 2]
    mean = Hidden(sum(block_waits) / blocks, sum(map(operator.sub, comm[1 : n - 2], block_waits)) / blocks)
    return shares[:1] + [mean] * blocks + shares[1:]


_NOTHING = Hidden(0.0, 0.0)


def _add(a: Hidden, b: Hidden) -> Hidden:
    return Hidden(a.exposed_s + b.exposed_s, a.hidden_s + b.hidden_s)


def _sub(a: Hidden, b: Hidden) -> Hidden:
    return Hidden(a.exposed_s - b.exposed_s, a.hidden_s - b.hidden_s)


def dp_exposure(
    traffic: Sequence[DpTraffic],
    fwd: Sequence[float],
    bwd: Sequence[float],
    uniform_blocks: bool,
    update: Sequence[float] | None = None,
) -> list[DpExposure]:
    """Each row's exposed and hidden DP seconds (module docstring); ``update``: each row's
    optimizer seconds (the ZeRO 1/2 gathers' first window; none when not given).
    ``uniform_blocks``: rows ``1 .. n-3`` are identical blocks, which then keep one cost (the
    difference moves to row 0); only the rows next to a different one are worked out then (a
    block between blocks is the steady state). Gradient buckets of several rows (small layers)
    break the blocks' symmetry: every row is then worked out."""
    n = len(traffic)
    passes = (fwd, bwd, update if update is not None else [0.0] * n)
    uniform = uniform_blocks and n >= 5
    rows, gathers = _exposures_but_gathers(traffic, passes, uniform), _gathers(traffic, passes, uniform)
    if uniform and rows[1] is rows[n - 3] and gathers[1] is gathers[n - 3]:  # one steady block: 4 rows to add
        ends = [DpExposure(_add(rows[j].step, gathers[j]), rows[j].micro_batch) for j in (0, 1, n - 2, n - 1)]
        return ends[:1] + ends[1:2] * (n - 3) + ends[2:]
    combined: dict[tuple[int, int], DpExposure] = {}  # rows that shared objects still do
    out: list[DpExposure] = []
    last: tuple = (None, None)
    for row, gather in zip(rows, gathers):
        if row is last[0] and gather is last[1]:  # a run of repeated blocks
            out.append(out[-1])
            continue
        key = (id(row), id(gather))
        exposure = combined.get(key)
        if exposure is None:
            exposure = combined[key] = DpExposure(_add(row.step, gather), row.micro_batch)
        out.append(exposure)
        last = (row, gather)
    return out


def _exposures_but_gathers(
    traffic: Sequence[DpTraffic], passes: tuple[Sequence[float], Sequence[float], Sequence[float]], uniform: bool
) -> list[DpExposure]:
    """:func:`dp_exposure` without the ZeRO 1/2 gathers."""
    n, bwd = len(traffic), passes[1]
    one_row = _single_rows(traffic, sorted({0, 1, n - 3, n - 2, n - 1}) if uniform else range(n))
    bucketed = None if one_row else _many_row_reductions(traffic, bwd)
    if not (uniform and one_row):
        return [_row_exposure(j, traffic, passes, bucketed) for j in range(n)]
    steady = _row_exposure(2, traffic, passes, None)
    first = _row_exposure(0, traffic, passes, None)
    step, mb = first.step, first.micro_batch
    for j in {1, n - 3}:  # the blocks beside the embedding row and the last block
        exact = _row_exposure(j, traffic, passes, None)
        step = _add(step, _sub(exact.step, steady.step))
        mb = _add(mb, _sub(exact.micro_batch, steady.micro_batch))
    return (
        [DpExposure(step, mb)]
        + [steady] * (n - 3)
        + [_row_exposure(n - 2, traffic, passes, None), _row_exposure(n - 1, traffic, passes, None)]
    )
