"""Context parallelism: one sequence split over ``cp`` ranks, priced per layer-table row.

A context-parallel group holds ``s / cp`` positions of every sequence on each rank (two chunks of
``2 cp``, balanced for a causal mask: ``runtime.context_parallel.layout``). Per row and micro-batch:

- **Work and activations.** Everything position-wise (projections, MLP, norms, the loss) runs on
  ``s / cp`` tokens; the attention cores run this rank's queries against every key they see, so
  each rank does ``1 / cp`` of the kept query-key pairs. Both are ``1 / cp`` of the row at the full
  length ``s``: the row's FLOPs, memory-bound bytes and activations are the full row's over ``cp``
  (:func:`context_row`). That is also what a long sequence needs for memory: the cores keep no
  score matrix (flash-style kernels save ``q, k, v, out`` and the log-sum-exp, linear in ``s``).
  Products are priced at their local shapes (``m = b s / cp``); the cores' extra key range, the
  FLOPs beyond the local products, at the flat rate (``cost_models.gemm_cost.layer_matmul_time``).
- **Exchange** (:func:`context_exchange`), per attention core, ``n = s / cp`` local positions,
  ``kv = 2 b n (kv_heads / tp) head_dim`` elements of keys and values:

  ========== ========================================================= ============================
  method     forward (again in a recompute)                            backward
  ========== ========================================================= ============================
  ring       ``cp - 1`` sends of ``kv``, each beside one key block's    ``cp - 1`` sends of ``kv``
             compute (``core_fwd / cp``): the exposed remainder         beside a block's backward,
                                                                        ``cp`` exposed sends of the
                                                                        fp32 gradient block
  all-gather all-gather of the whole keys and values (exposed); the     reduce-scatter of their
             gathered ``(cp - 1) / cp`` of ``kv`` stays saved            gradients (exposed)
  ulysses    all-to-alls of q, k, v and out (exposed); needs the        the same four, reversed
             query and key/value heads per tp rank divisible by cp;
             the output stays saved twice (below)
  ========== ========================================================= ============================

  Ulysses' attention runs over the whole sequence on ``heads / (tp cp)`` heads, so its score tiles
  hold that many heads; its output is kept in the heads' layout for the attention's backward and,
  after the all-to-all back, in the positions' layout as the output projection's input: one
  output more per core than one process, where the projection saves the tensor attention saved.

  ``runtime.context_parallel`` runs exactly these (the ring posts each block's transfer before
  the block's compute and waits after it; its gradient pass is waited at once). Each wait costs
  ``sync_overhead_s``; hidden seconds cost ``overlap_contention x`` of compute (contention). The
  core's backward is priced at twice its forward (its four products against the forward's two).
- **State.** Weights are replicated over the cp group: gradients are reduced and ZeRO state
  sharded over the ``dp * cp`` ranks holding the same weights. Under the (pp, dp, cp, tp) layout
  (``runtime.contract.rank_layout``) that group is exactly the data-parallel axis of a
  ``(pp, dp * cp, tp)`` mesh, so ``cost_models.strategy`` prices state as at ``dp * cp``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from cost_models.comm_cost import GroupPlacement, collective_time
from cost_models.compute import compute_time, dtype_bytes
from cost_models.hardware import HardwareProfile
from cost_models.layer_row import AttentionCore, Largest, LayerRow, Sharded
from cost_models.overlap_cost import hide
from runtime.contract.choices import ContextMethod
from runtime.contract.collective_bytes import ring_bytes
from runtime.contract.limits import ATTENTION_TILE, ATTENTION_TILE_TENSORS

__all__ = [
    "CORE_BACKWARD_RATIO",
    "ContextSetting",
    "ContextTimes",
    "context_row",
    "context_exchange",
    "core_count",
    "local_heads",
    "ulysses_obstacle",
]

#: The attention core's backward over its forward: four products (dQ, dK, dV, dP) against two.
CORE_BACKWARD_RATIO = 2.0

#: Bytes per element of the ring's travelling key/value gradient (``runtime.context_parallel.ring``
#: accumulates it in float32).
GRAD_BLOCK_BYTES = 4


@dataclass(frozen=True)
class ContextSetting:
    """A candidate's context parallelism as a row's work sees it (``cp == 1``: none)."""

    cp: int = 1
    method: str = ContextMethod.RING.value
    placement: GroupPlacement | None = None
    """Where the context-parallel group's ranks live (its collectives and ring sends)."""
    heads: int = 0
    """Query heads of an attention core at tp = 1 (the model's)."""
    kv_heads: int = 0
    """Key/value heads at tp = 1."""
    head_dim: int = 0
    micro_batch: int = 1
    """Sequences of a micro-batch (the score tiles are per sequence)."""


class ContextTimes(NamedTuple):
    """A row's context-parallel exchange in one micro-batch."""

    fwd_s: float
    """Exposed seconds of the forward's exchange (waits included)."""
    bwd_s: float
    rec_s: float
    """What a recomputed forward exchanges again (exposed)."""
    hidden_s: float
    """Seconds of forward + backward exchange hidden under the cores' compute (the ring's)."""
    rec_hidden_s: float
    fwd_sent_b: float
    bwd_sent_b: float
    saved_b: float
    """Activation bytes the method adds per micro-batch (all-gather: the gathered keys and values)."""
    transient_b: float = 0.0
    """The backward's float32 tiles of scores (``ATTENTION_TILE_TENSORS`` of ``b x heads x t x t``,
    ``t`` the tile or the chunk when smaller): a transient beside the layer's others."""


NO_EXCHANGE = ContextTimes(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def _scaled(amount: Sharded, factor: float) -> Sharded:
    return Sharded(amount.whole * factor, amount.tp_part * factor, amount.sp_part * factor)


def context_row(full: LayerRow, local: LayerRow, cp: int) -> LayerRow:
    """One rank's row under context parallelism (module docstring, "Work and activations"):
    ``full`` is the row at ``(b, s)``, ``local`` at ``(b, s / cp)``."""
    share = 1.0 / cp

    def part(amount: Sharded) -> Sharded:
        return _scaled(amount, share)

    core = full.core
    return dataclasses.replace(
        local,
        fwd_flops=part(full.fwd_flops),
        bwd_flops=part(full.bwd_flops),
        fwd_bytes=part(full.fwd_bytes),
        bwd_bytes=part(full.bwd_bytes),
        tp_loss_fwd_bytes=full.tp_loss_fwd_bytes * share,
        tp_loss_bwd_bytes=full.tp_loss_bwd_bytes * share,
        saved_bytes=part(full.saved_bytes),
        tail_saved_bytes=part(full.tail_saved_bytes),
        frontier_out_bytes=part(full.frontier_out_bytes),
        input_bytes=part(full.input_bytes),
        boundary_bytes=part(full.boundary_bytes),
        peak_act_bytes=Largest(full.peak_act_bytes.replicated * share, full.peak_act_bytes.sharded * share),
        core=AttentionCore(
            fwd_flops=part(core.fwd_flops),
            fwd_bytes=part(core.fwd_bytes),
            saved_bytes=part(core.saved_bytes),
            num_ops=local.core.num_ops,
            gemms=local.core.gemms,
        ),
    )


def local_heads(heads: int, tp: int) -> int:
    """Heads one tensor-parallel rank holds: ``heads / tp``, or one replicated key/value head
    where tp is a multiple of them."""
    return max(heads // tp, 1)


def core_count(row: LayerRow) -> int:
    """Attention cores in a row: each lists its two forward products (scores and weighted values)."""
    if row.core.fwd_flops.whole <= 0:
        return 0
    return max(sum(int(gemm.count) for gemm in row.core.gemms) // 2, 1)


def ulysses_obstacle(setting: ContextSetting, tp: int) -> str | None:
    """Why Ulysses cannot split this model's heads over ``cp`` at ``tp`` (None: it can)."""
    for what, heads in (("query", setting.heads), ("key/value", setting.kv_heads)):
        local = local_heads(heads, tp) if heads else 0
        if not local or local % setting.cp:
            return (
                f"Ulysses scatters attention heads over the context-parallel group, but {local or 'no'} {what} "
                f"heads per tensor-parallel rank (of {heads or '?'} at tp={tp}) do not divide by cp={setting.cp}"
            )
    return None


def context_exchange(
    row: LayerRow, setting: ContextSetting, tp: int, local_tokens: float, hw: HardwareProfile, dtype: str
) -> ContextTimes:
    """The row's attention exchange under ``setting`` (module docstring, "Exchange"); ``row`` is
    the rank's row (:func:`context_row`), ``local_tokens`` its ``b s / cp`` positions of a micro-batch."""
    cores = core_count(row)
    if setting.cp == 1 or cores == 0:
        return NO_EXCHANGE
    assert setting.placement is not None
    element = dtype_bytes(dtype)
    kv_elements = 2 * local_tokens * local_heads(setting.kv_heads, tp) * setting.head_dim
    if setting.method == ContextMethod.RING:
        core_fwd_s = float(
            compute_time(row.core.fwd_flops.per_device(tp), row.core.fwd_bytes.per_device(tp), hw, dtype)
        )
        times = _ring(cores, kv_elements * element, kv_elements * GRAD_BLOCK_BYTES, core_fwd_s / cores, setting, hw)
    elif setting.method == ContextMethod.ALL_GATHER:
        times = _gathered(cores, kv_elements * element, setting, hw)
    else:
        q_elements = local_tokens * (setting.heads // tp) * setting.head_dim
        times = _ulysses(cores, (2 * q_elements + kv_elements) * element, setting, hw)
        times = times._replace(saved_b=cores * q_elements * element)
    return times._replace(transient_b=tile_transient_bytes(setting, tp, local_tokens))


def tile_transient_bytes(setting: ContextSetting, tp: int, local_tokens: float) -> float:
    """``ContextTimes.transient_b``: the tile is ``ATTENTION_TILE`` or the chunk (``s / 2cp``
    positions) when smaller, over the rank's heads (a cp-th of them under Ulysses);
    ``local_tokens`` is ``b s / cp``."""
    sequences = setting.micro_batch
    chunk = local_tokens / (2 * sequences)
    heads = local_heads(setting.heads, tp)
    if setting.method == ContextMethod.ULYSSES:  # the whole sequence on a cp-th of the heads
        heads = max(heads // setting.cp, 1)
    return float(ATTENTION_TILE_TENSORS * 4 * sequences * heads * min(ATTENTION_TILE, chunk) ** 2)


def _send(nbytes: float, setting: ContextSetting, hw: HardwareProfile) -> float:
    """One ring step: a send to the next rank (crossing nodes when the group does) and its wait."""
    assert setting.placement is not None
    pair = GroupPlacement(2, 1, 2) if setting.placement.intra_node else GroupPlacement(2, 2, 1)
    return float(collective_time("send", nbytes, pair, hw)) + hw.sync_overhead_s


def _ring(
    cores: int, kv_b: float, grad_b: float, core_fwd_s: float, setting: ContextSetting, hw: HardwareProfile
) -> ContextTimes:
    steps = setting.cp - 1
    block_fwd_s, block_bwd_s = core_fwd_s / setting.cp, CORE_BACKWARD_RATIO * core_fwd_s / setting.cp
    forward = hide(_send(kv_b, setting, hw), block_fwd_s, hw.overlap_window_gain)
    backward = hide(_send(kv_b, setting, hw), block_bwd_s, hw.overlap_window_gain)
    gradient_s = setting.cp * _send(grad_b, setting, hw)
    fwd_s = cores * steps * forward.exposed_s
    return ContextTimes(
        fwd_s=fwd_s,
        bwd_s=cores * (steps * backward.exposed_s + gradient_s),
        rec_s=fwd_s,
        hidden_s=cores * steps * (forward.hidden_s + backward.hidden_s),
        rec_hidden_s=cores * steps * forward.hidden_s,
        fwd_sent_b=cores * steps * kv_b,
        bwd_sent_b=cores * (steps * kv_b + setting.cp * grad_b),
        saved_b=0.0,
    )


def _gathered(cores: int, kv_b: float, setting: ContextSetting, hw: HardwareProfile) -> ContextTimes:
    """Keys and values gathered whole (two collectives), their gradients reduce-scattered."""
    assert setting.placement is not None
    cp, whole = setting.cp, kv_b * setting.cp / 2  # one of keys or values, the whole sequence
    gather = float(collective_time("all_gather", whole, setting.placement, hw)) + hw.sync_overhead_s
    scatter = float(collective_time("reduce_scatter", whole, setting.placement, hw)) + hw.sync_overhead_s
    fwd_s = cores * 2 * gather
    return ContextTimes(
        fwd_s=fwd_s,
        bwd_s=cores * 2 * scatter,
        rec_s=fwd_s,
        hidden_s=0.0,
        rec_hidden_s=0.0,
        fwd_sent_b=cores * 2 * float(ring_bytes("all_gather", whole, cp)),
        bwd_sent_b=cores * 2 * float(ring_bytes("reduce_scatter", whole, cp)),
        saved_b=cores * kv_b * (cp - 1),
    )


def _ulysses(cores: int, local_b: float, setting: ContextSetting, hw: HardwareProfile) -> ContextTimes:
    """Four all-to-alls each way (q, k, v, out), ``local_b`` their local bytes together; the
    calls are priced one by one (each its latency), split by their share of the bytes."""
    assert setting.placement is not None
    per_call = local_b / 4
    one = float(collective_time("all_to_all", per_call, setting.placement, hw)) + hw.sync_overhead_s
    sent = cores * 4 * float(ring_bytes("all_to_all", per_call, setting.cp))
    fwd_s = cores * 4 * one
    return ContextTimes(fwd_s, fwd_s, fwd_s, 0.0, 0.0, sent, sent, 0.0)
