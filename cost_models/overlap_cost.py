"""What overlapped communication costs: each collective's window of independent compute.

The runtime (``runtime.contract.overlap``) runs collectives beside compute. A collective of ``c``
seconds beside a window of ``w`` seconds of compute that does not depend on it costs
``max(0, c - w)`` exposed seconds, and hides ``h = min(c, w)``; the compute that ran beside it is
slowed by the profile's ``overlap_slowdown`` ``kappa`` (``cost_models.hardware``): ``kappa h``
more seconds of compute (*contention*). Windows, per layer, as the runtime runs them:

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
  ends) and, at ZeRO 3, the backward gather of row ``j - 1`` (prefetched one layer ahead);
- forward: the parameter all-gather of row ``j + 1`` (ZeRO 1/2: once per step, waited at first use
  in the next step's forward; ZeRO 3: every micro-batch, prefetched one layer ahead).

Row 0's reduction and forward gather and the last row's backward gather have no window. Each
window's exposure ``max(0, sum c - w)`` is charged to the row owning the window, so every term
is a per-row constant and the ILP stays linear. Repeated blocks keep one cost: the first block's
difference from the steady state (its neighbour is the embedding row) is moved onto row 0, which
is exact whenever rows 0 and 1 share a stage (a pipeline cut right after row 0 misplaces it).
A stage's first row's collectives are priced with the previous row's window even when that row
is on another stage (an error of one layer's reduction per pipeline boundary).

Not overlapped (priced as before): tied-weight all-reduces, the 1-bit Adam exchange, and the
data-parallel traffic of plans that offload (the offload engine waits for its transfers).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

__all__ = [
    "COLUMN_WGRAD_SHARE",
    "Hidden",
    "hide",
    "tp_exposure",
    "TpExposure",
    "DpTraffic",
    "DpExposure",
    "dp_exposure",
]

#: Of a transformer block's weight-gradient products, the share of the column-parallel linears,
#: whose input gradients are all-reduced in backward: in a GPT block QKV (3 h^2) and the first MLP
#: linear (4 h^2) of 12 h^2.
COLUMN_WGRAD_SHARE = 7 / 12


class Hidden(NamedTuple):
    """A collective (or several) beside a window: the exposed and the hidden seconds."""

    exposed_s: float
    hidden_s: float


def hide(comm_s: float, window_s: float) -> Hidden:
    """``comm_s`` of communication beside ``window_s`` of independent compute."""
    hidden = min(max(comm_s, 0.0), max(window_s, 0.0))
    return Hidden(max(comm_s, 0.0) - hidden, hidden)


def _chunked(comm_s: float, window_s: float, chunks: int) -> Hidden:
    """A collective decomposed into ``chunks`` beside partial products: one chunk at least exposed."""
    exposed = max(comm_s / max(chunks, 1), comm_s - max(window_s, 0.0), 0.0)
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
) -> TpExposure:
    """Exposed and hidden TP seconds (module docstring). ``passes``: the row's forward, backward
    and weight-gradient compute seconds of one micro-batch; ``regather_s``: under sequence
    parallelism, the backward's all-gathers of the column-parallel inputs (not in ``bwd_comm_s``)."""
    forward_s, backward_s, wgrad_s = passes
    if sequence_parallel:
        fwd = _chunked(fwd_comm_s, forward_s, tp)
        regather = hide(regather_s, COLUMN_WGRAD_SHARE * max(backward_s - wgrad_s, 0.0))
        bwd = _add(regather, _chunked(bwd_comm_s, backward_s - regather.hidden_s, tp))
    else:
        fwd = Hidden(fwd_comm_s, 0.0)
        bwd = hide(bwd_comm_s, COLUMN_WGRAD_SHARE * wgrad_s)
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


class DpExposure(NamedTuple):
    """One row's share of the data-parallel cost once overlapped."""

    step: Hidden
    """Per step (ZeRO 0/1 reductions, ZeRO 1/2 gathers)."""
    micro_batch: Hidden
    """Per micro-batch (ZeRO 2/3)."""


def _row_exposure(j: int, traffic: Sequence[DpTraffic], fwd: Sequence[float], bwd: Sequence[float]) -> DpExposure:
    n = len(traffic)
    after = traffic[j + 1] if j + 1 < n else DpTraffic()
    before = traffic[j - 1] if j > 0 else DpTraffic()
    step = _add(hide(after.grad_step_s, bwd[j]), hide(after.gather_step_s, fwd[j]))
    mb = _add(hide(after.reduce_mb_s + before.bwd_gather_mb_s, bwd[j]), hide(after.fwd_gather_mb_s, fwd[j]))
    own = traffic[j]
    if j == 0:  # nothing runs after row 0's backward or before its forward
        step = _add(step, Hidden(own.grad_step_s + own.gather_step_s, 0.0))
        mb = _add(mb, Hidden(own.reduce_mb_s + own.fwd_gather_mb_s, 0.0))
    if j == n - 1:  # the first backward's gather: nothing runs before it
        mb = _add(mb, Hidden(own.bwd_gather_mb_s, 0.0))
    return DpExposure(step, mb)


def _add(a: Hidden, b: Hidden) -> Hidden:
    return Hidden(a.exposed_s + b.exposed_s, a.hidden_s + b.hidden_s)


def _sub(a: Hidden, b: Hidden) -> Hidden:
    return Hidden(a.exposed_s - b.exposed_s, a.hidden_s - b.hidden_s)


def dp_exposure(
    traffic: Sequence[DpTraffic], fwd: Sequence[float], bwd: Sequence[float], uniform_blocks: bool
) -> list[DpExposure]:
    """Each row's exposed and hidden DP seconds (module docstring). ``uniform_blocks``: rows
    ``1 .. n-3`` are identical blocks, which then keep one cost (the difference moves to row 0);
    only the rows next to a different one are worked out then (a block between blocks is the
    steady state)."""
    n = len(traffic)
    if not (uniform_blocks and n >= 5):
        return [_row_exposure(j, traffic, fwd, bwd) for j in range(n)]
    steady = _row_exposure(2, traffic, fwd, bwd)
    first = _row_exposure(0, traffic, fwd, bwd)
    step, mb = first.step, first.micro_batch
    for j in {1, n - 3}:  # the blocks beside the embedding row and the last block
        exact = _row_exposure(j, traffic, fwd, bwd)
        step = _add(step, _sub(exact.step, steady.step))
        mb = _add(mb, _sub(exact.micro_batch, steady.micro_batch))
    return (
        [DpExposure(step, mb)]
        + [steady] * (n - 3)
        + [_row_exposure(n - 2, traffic, fwd, bwd), _row_exposure(n - 1, traffic, fwd, bwd)]
    )
