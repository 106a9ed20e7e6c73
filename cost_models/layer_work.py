"""One layer's work under one tensor-parallel setting: compute, TP collectives and activations.

The candidate-independent part of a layer's cost (``cost_models.strategy``'s module docstring
gives the model: compute, TP, recompute, selective recompute, compiled layers): a function of the
typed row (``cost_models.layer_row.LayerRow``), the profile, the dtype and a :class:`WorkSetting`
only, so the candidates that agree on those share it (``NumericTable.work_memo``). The state and
ZeRO fields of the :class:`LayerCost` it returns are 0; ``cost_models.strategy`` fills them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, NamedTuple, Sequence

from cost_models.comm_cost import GroupPlacement, collective_time
from cost_models.compute import compute_time
from cost_models.context_cost import ContextSetting, context_exchange
from cost_models.expert_cost import ExpertSetting, all_to_all_times, expert_state_split, matmul_seconds
from cost_models.hardware import HardwareProfile
from cost_models.layer_row import LayerRow, Sharded
from cost_models.memory import backward_transient_bytes, bytes_per_param, split_by_tp
from cost_models.overlap_cost import Hidden, TpExposure, tp_exposure
from cost_models.wgrad import fused_weight_elements, wgrad_device_time, wgrad_kept_bytes
from passes.table_fields import Gemm
from runtime.contract.collective_bytes import ring_bytes

__all__ = [
    "COMPILED_REGION_OPS",
    "COMPILED_BYTES_FRACTION",
    "compiled_regions",
    "LayerCost",
    "WorkSetting",
    "remembered",
    "row_work",
]

#: Host cost of one call of a compiled region, in eager operator calls (``hw.op_overhead_s`` each):
#: forward; backward twice that, like an eager operator (module docstring, "compiled").
COMPILED_REGION_OPS = 10

#: Fraction of a layer's memory-bound bytes a compiled layer still moves once its elementwise
#: chains are fused (module docstring, "compiled").
COMPILED_BYTES_FRACTION = 0.75


def compiled_regions(row: LayerRow, tp: int, ep: int = 1) -> int:
    """Compiled regions of one layer: one, plus a graph break at each tensor-parallel collective
    the runtime issues eagerly (``runtime.tensor_parallel.EAGER_ONLY``) and, under expert
    parallelism, at each MoE layer's dispatch and combine (variable-size all-to-alls)."""
    traffic = row.tp_traffic
    breaks = int(traffic.allreduce_fwd_calls) + int(traffic.allreduce_bwd_calls) if tp > 1 else 0
    return 1 + breaks + (2 * row.experts.moe_layers if ep > 1 else 0)


@dataclass(frozen=True)
class LayerCost:
    """One layer's per-device costs under one candidate (seconds and bytes)."""

    compute_s: float
    """Forward + backward compute of one micro-batch."""
    fwd_s: float
    tp_s: float
    """TP all-reduces of forward + backward of one micro-batch."""
    tp_fwd_s: float
    rec_s: float
    """Extra time when checkpointed: forward compute + forward TP all-reduce + the forward's
    expert all-to-alls (``ep_rec_s``)."""
    zero_mb_s: float
    """ZeRO 2/3 collectives of one micro-batch (inside every micro-step)."""
    dp_step_s: float
    """Per-step DP/ZeRO collectives (exposed)."""
    opt_s: float
    params_b: int
    grads_b: int
    optimizer_b: int
    trans_params_b: int
    """ZeRO-3 gathered weights while this layer (and the prefetched next) runs."""
    trans_grads_b: int
    """ZeRO-2/3 full gradients and reduced shards in flight, bounded with this layer standing
    for every layer of the window (``cost_models.memory.model_state_bytes``)."""
    bt_b: float
    """Backward transient: twice the layer's largest activation (``backward_transient_bytes``)."""
    saved_b: float
    input_b: float
    boundary_b: float
    tp_sent_b: float
    """Bytes sent by the TP all-reduces of one forward of one micro-batch."""
    tp_bwd_sent_b: float
    """Bytes sent by the TP all-reduces of one backward of one micro-batch."""
    tp_rec_sent_b: float
    """Bytes sent by the TP all-reduces a recompute repeats (all but the final, boundary-sized one)."""
    zero_mb_sent_b: float
    dp_step_sent_b: float
    num_params: int
    """Parameters on one device (after the TP split, and the expert-parallel split of the routed experts)."""
    expert_params: int = 0
    """Of ``num_params``, the routed experts' (this rank's ``experts / ep``): their state is sharded
    over the expert-data-parallel group (``cost_models.expert_cost``)."""
    ep_s: float = 0.0
    """Expert-parallel all-to-alls (dispatch + combine) of forward + backward of one micro-batch."""
    ep_fwd_s: float = 0.0
    """Of ``ep_s``, the forward's."""
    ep_rec_s: float = 0.0
    """Of ``rec_s``, the all-to-alls a recomputed forward runs again."""
    ep_sent_b: float = 0.0
    """Bytes the all-to-alls of forward + backward of one micro-batch send."""
    ep_rec_sent_b: float = 0.0
    """Bytes the all-to-alls of a recomputed forward send."""
    wgrad_s: float = 0.0
    """The weight-gradient part of the backward (``W`` of a zero-bubble schedule): the products
    that contract over the micro-batch's tokens, priced by shape, with the gradient accumulation
    and their share of the host overhead; without listed products, half of the backward's matmul
    work (``cost_models.schedule_cost``, "The W split")."""
    wgrad_keep_b: float = 0.0
    """Bytes a split backward keeps from ``B`` to ``W`` beyond the activations: the gradient of
    each weight product's output (the runtime restarts ``W`` at those autograd edges), from the
    forward products that multiply the micro-batch's tokens by a weight (0 without listed products)."""
    tail_b: float = 0.0
    """Of ``saved_b``, what a split backward frees at ``B`` when this layer ends its chunk: the
    saved activations downstream of every weight product (the loss's log-probabilities), which
    only the chunk's outputs hold (``passes.split_backward``)."""
    offload_mb_s: float = 0.0
    """Exposed offload transfers of one micro-batch (included in ``zero_mb_s``)."""
    offload_step_s: float = 0.0
    """Exposed offload transfers per step (included in ``dp_step_s``)."""
    host_b: int = 0
    """Host bytes of this layer's offloaded state on one rank (``cost_models.offload_cost``)."""
    nvme_b: int = 0
    """NVMe bytes of this layer's offloaded state on one rank."""
    sel_rec_s: float = 0.0
    """Extra time under selective recompute: the attention cores' forward run again."""
    sel_saved_b: float = 0.0
    """Activation bytes selective recompute frees (what only the attention cores keep); 0 for a
    layer without attention, which cannot recompute selectively."""
    compressed_numel: int = 0
    """Elements this row adds to the rank's 1-bit Adam momentum vector (0 without compression):
    ``dp_step_s`` and ``opt_s`` then hold its share of the compressed exchange and compression
    compute (``cost_models.compression_cost``), ``optimizer_b`` stage 0's state and its error buffers."""
    warmup_dp_step_s: float = 0.0
    """``dp_step_s`` of a full-precision step (the warm-up of a compressed plan; else ``dp_step_s``)."""
    warmup_opt_s: float = 0.0
    """``opt_s`` of a full-precision step."""
    warmup_dp_step_sent_b: float = 0.0
    """``dp_step_sent_b`` of a full-precision step."""
    warmup_dp_contention_s: float = 0.0
    """``dp_contention_s`` of a full-precision step (a compressed plan's warm-up overlaps its
    reductions; its compressed steps do not)."""
    tp_hidden_s: float = 0.0
    """TP seconds of one micro-batch hidden under compute (``tp_s`` is the exposed rest; the
    contention they cost is in ``compute_s``, ``cost_models.overlap_cost``)."""
    tp_rec_hidden_s: float = 0.0
    """TP seconds a recompute of this layer hides (its exposed rest and contention are in ``rec_s``)."""
    tp_rec_s: float = 0.0
    """Of ``rec_s``, the recomputed forward's exposed TP collectives: reported as ``tp_comm``, where
    the runtime times a collective wherever it runs (``runtime.timing``)."""
    cp_s: float = 0.0
    """Exposed context-parallel attention exchange of forward + backward of one micro-batch
    (``cost_models.context_cost``; its contention is in ``compute_s``)."""
    cp_fwd_s: float = 0.0
    """Of ``cp_s``, the forward's."""
    cp_rec_s: float = 0.0
    """Of ``rec_s``, the exchange a recomputed forward runs again (exposed, with its contention)."""
    cp_sent_b: float = 0.0
    """Bytes the exchange of forward + backward of one micro-batch sends."""
    cp_rec_sent_b: float = 0.0
    """Bytes a recomputed forward's exchange sends."""
    cp_hidden_s: float = 0.0
    """Exchange seconds of one micro-batch hidden under the attention cores' compute (the ring's)."""
    zero_mb_hidden_s: float = 0.0
    """ZeRO 2/3 seconds of one micro-batch hidden under compute (``zero_mb_s`` is the exposed rest;
    their contention is in ``compute_s``)."""
    dp_step_hidden_s: float = 0.0
    """Per-step DP/ZeRO seconds hidden under compute (``dp_step_s`` is the exposed rest plus
    ``dp_contention_s``)."""
    dp_contention_s: float = 0.0
    """Of ``dp_step_s``, the compute slowed beside the hidden per-step collectives
    (``overlap_contention x dp_step_hidden_s``): reported as ``compute``."""

    @property
    def work_s(self) -> float:
        return self.compute_s + self.tp_s + self.ep_s + self.cp_s

    @property
    def state_b(self) -> int:
        return self.params_b + self.grads_b + self.optimizer_b

    @property
    def trans_b(self) -> int:
        return self.trans_params_b + self.trans_grads_b

    def but(self, **changes: float | int) -> "LayerCost":
        """A copy with ``changes``: ``dataclasses.replace`` without re-running ``__init__`` over
        the fifty-odd fields (the search builds a copy per row and candidate; nothing here is
        validated at construction)."""
        if not _LAYER_COST_FIELDS.issuperset(changes):
            raise TypeError(f"LayerCost has no fields {sorted(set(changes) - _LAYER_COST_FIELDS)}")
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        copied.__dict__.update(changes)
        return copied


_LAYER_COST_FIELDS = frozenset(field.name for field in fields(LayerCost))


@dataclass(frozen=True)
class WorkSetting:
    """What a row's work depends on beside the row, the profile and the dtype: candidates that
    agree on it share the row's work (``NumericTable.work_memo``)."""

    tp: int
    sequence_parallel: bool
    """Sequence parallelism in the tensor-parallel regions (only at tp > 1)."""
    compiled: bool
    """The layer runs under ``torch.compile`` (module docstring, "compiled")."""
    tp_placement: GroupPlacement
    """Where the tensor-parallel group's ranks live (prices its collectives)."""
    tokens: float
    """Tokens of one micro-batch (``b s``): tells the weight-gradient products apart."""
    overlap_tp: bool = True
    """The run overlaps its tensor-parallel collectives (``runtime.contract.overlap``): each is
    charged what its window cannot hide, plus contention (``cost_models.overlap_cost``)."""
    expert: ExpertSetting = ExpertSetting()
    """Expert parallelism and the routing load (``cost_models.expert_cost``; ep 1 for a dense model)."""
    context: ContextSetting = ContextSetting()
    """Context parallelism (``cost_models.context_cost``; cp 1: none). ``tokens`` is then the
    rank's ``b s / cp`` and the row the rank's (``context_cost.context_row``)."""


class _PassTimes(NamedTuple):
    """Seconds of a row's passes of one micro-batch (host overhead included)."""

    forward_s: float
    backward_s: float
    wgrad_s: float
    """The weight-gradient part of ``backward_s``."""
    selective_s: float
    """The attention cores' forward run again (0 without cores)."""


class _TpTimes(NamedTuple):
    """Seconds and bytes sent of a row's tensor-parallel collectives in one micro-batch."""

    fwd_s: float
    fwd_sent_b: float
    bwd_s: float
    bwd_sent_b: float
    rec_s: float
    """What a recompute repeats (all but the final, boundary-sized all-reduce)."""
    rec_sent_b: float
    regather_s: float = 0.0
    """Under sequence parallelism, the backward's all-gathers of the column-parallel inputs (only
    each rank's positions are saved; its bytes are in ``bwd_sent_b``, its seconds not in ``bwd_s``)."""


def _memory_bound_bytes(amount: Sharded, tp_loss_bytes: float, tp: int, sequence_parallel: bool) -> float:
    """Memory-bound bytes per device, with the runtime's vocab-parallel loss at tp > 1."""
    per_device = amount.per_device(tp, sequence_parallel)
    if tp > 1:
        per_device = max(per_device + tp_loss_bytes / tp, 0.0)
    return per_device


def _device_seconds(
    flops: float,
    gemms: Sequence[Gemm],
    bytes_moved: float,
    hw: HardwareProfile,
    dtype: str,
    tp: int,
    experts: tuple[Sequence[Gemm], float, ExpertSetting] = ((), 0.0, ExpertSetting()),
) -> float:
    """Device time of a pass: its products priced by shape (small ones reach less of the peak on
    a GPU, ``cost_models.gemm_cost``; the flat rate on a CPU), the routed experts' at the rows each
    local expert gets (``experts``: their listed products, rows per expert at the even share, the
    setting; ``cost_models.expert_cost``), its memory-bound bytes at the memory bandwidth."""
    expert_gemms, tokens, setting = experts
    matmul = matmul_seconds(flops, gemms, expert_gemms, tokens, setting, hw, dtype, tp)
    return float(matmul + compute_time(0.0, bytes_moved, hw, dtype))


def _pass_times(row: LayerRow, hw: HardwareProfile, dtype: str, setting: WorkSetting, params: int) -> _PassTimes:
    """Per-op roofline summed: matmul-class FLOPs at the achievable rate, memory-bound ops' bytes
    at the memory bandwidth, and a fixed cost per operator call (backward runs about two per
    forward op). Backward also accumulates each micro-batch's weight gradients into the gradient
    buffers: read both, write one, 3 x the gradient bytes of the weights whose products do not
    accumulate themselves (``cost_models.wgrad.fused_weight_elements``). Compiled: a few region calls
    instead of every operator's, and fused memory-bound chains (module docstring)."""
    tp, sequence_parallel = setting.tp, setting.sequence_parallel
    if setting.compiled:
        ops_s = compiled_regions(row, tp, setting.expert.ep) * COMPILED_REGION_OPS * hw.op_overhead_s
        fused = COMPILED_BYTES_FRACTION
    else:
        ops_s, fused = row.num_ops * hw.op_overhead_s, 1.0
    # the tensor-parallel linears accumulate into the gradient buffer with the product itself:
    # column-parallel ones whenever their autograd function runs (SP or overlapped TP), row-parallel
    # ones under SP with overlap in fp32 (a low-precision gradient sums its pieces in fp32 first)
    self_accumulating = fused_weight_elements(
        row,
        tp,
        setting.tokens,
        column=sequence_parallel or setting.overlap_tp,
        row_parallel=sequence_parallel and setting.overlap_tp and dtype == "fp32",
    )
    accumulate = 3 * max(params - self_accumulating, 0.0) * bytes_per_param(dtype)["grads"]
    fwd_flops, bwd_flops = (
        row.fwd_flops.per_device(tp, sequence_parallel),
        row.bwd_flops.per_device(tp, sequence_parallel),
    )
    fwd_bytes = _memory_bound_bytes(row.fwd_bytes, row.tp_loss_fwd_bytes, tp, sequence_parallel)
    bwd_bytes = _memory_bound_bytes(row.bwd_bytes, row.tp_loss_bwd_bytes, tp, sequence_parallel)
    routed = row.experts
    device_fwd = _device_seconds(
        fwd_flops, row.fwd_gemms, fused * fwd_bytes, hw, dtype, tp, (routed.fwd_gemms, routed.tokens, setting.expert)
    )
    device_bwd = _device_seconds(
        bwd_flops,
        row.bwd_gemms,
        fused * bwd_bytes + accumulate,
        hw,
        dtype,
        tp,
        (routed.bwd_gemms, routed.tokens, setting.expert),
    )
    # A GPU runs the operators while the host issues the next ones: the slower of the two bounds
    # the layer. A CPU rank issues and runs them on the same core: they add up.
    combine = max if hw.ops_async else (lambda device, host: device + host)
    forward_s, backward_s = combine(device_fwd, ops_s), combine(device_bwd, 2 * ops_s)
    device_wgrad = wgrad_device_time(row, bwd_flops, hw, dtype, tp, setting.tokens) + float(
        compute_time(0.0, accumulate, hw, dtype)
    )
    wgrad_s = backward_s * min(device_wgrad / device_bwd, 1.0) if device_bwd > 0 else 0.0
    # selective recompute: the attention cores' forward, priced like a forward of its own
    core = row.core
    core_ops_s = (min(core.num_ops, COMPILED_REGION_OPS) if setting.compiled else core.num_ops) * hw.op_overhead_s
    device_core = _device_seconds(
        core.fwd_flops.per_device(tp, sequence_parallel),
        core.gemms,
        fused * core.fwd_bytes.per_device(tp, sequence_parallel),
        hw,
        dtype,
        tp,
    )
    selective_s = (
        hw.recompute_ratio * combine(device_core, core_ops_s)
        if core.saved_bytes.per_device(tp, sequence_parallel) > 0
        else 0.0
    )
    return _PassTimes(forward_s, backward_s, wgrad_s, selective_s)


def _tp_times(row: LayerRow, hw: HardwareProfile, setting: WorkSetting) -> _TpTimes:
    """The row's tensor-parallel collectives (module docstring, "TP", "recompute"), each blocking
    call with its ``sync_overhead_s`` wait."""
    tp, traffic = setting.tp, row.tp_traffic

    def collective(nbytes: float, kind: str = "all_reduce") -> tuple[float, float]:
        if tp == 1 or nbytes <= 0:
            return 0.0, 0.0
        # The runtime all-reduces a contiguous copy of the activation (autograd may share the
        # original): a read and a write of the bytes on top of the collective.
        return (
            float(collective_time(kind, nbytes, setting.tp_placement, hw)) + 2 * nbytes / hw.memory_bandwidth,
            float(ring_bytes(kind, nbytes, tp)),
        )

    def together(*parts: tuple[float, float]) -> tuple[float, float]:
        return sum(part[0] for part in parts), sum(part[1] for part in parts)

    if setting.sequence_parallel:  # the regions' end all-reduces become reduce-scatters + all-gathers
        scattered, gathered = traffic.sp_reduce_scatter_bytes, traffic.sp_all_gather_bytes
        fwd_s, fwd_sent = together(
            collective(max(traffic.allreduce_fwd_bytes - scattered, 0.0)),
            collective(scattered, "reduce_scatter"),
            collective(gathered, "all_gather"),
        )
        bwd_s, bwd_sent = together(
            collective(max(traffic.allreduce_bwd_bytes - gathered, 0.0) + traffic.sp_grad_all_reduce_bytes),
            collective(scattered + traffic.sp_split_bytes, "all_gather"),
            collective(gathered, "reduce_scatter"),
        )
        fwd_s += (traffic.allreduce_fwd_calls + traffic.sp_all_gather_calls) * hw.sync_overhead_s
        regather_s, regather_sent = collective(gathered, "all_gather")  # the saved positions, gathered again
        regather_s += traffic.sp_all_gather_calls * hw.sync_overhead_s
        bwd_sent += regather_sent
        bwd_s += (
            traffic.allreduce_bwd_calls
            + traffic.sp_reduce_scatter_calls
            + (traffic.sp_grad_all_reduce_bytes > 0)
            + (traffic.sp_split_bytes > 0)
        ) * hw.sync_overhead_s
    else:
        regather_s = 0.0
        fwd_s, fwd_sent = collective(traffic.allreduce_fwd_bytes)
        bwd_s, bwd_sent = collective(traffic.allreduce_bwd_bytes)
        if tp > 1:  # every all-reduce is a point where the tp ranks wait for each other
            fwd_s += traffic.allreduce_fwd_calls * hw.sync_overhead_s
            bwd_s += traffic.allreduce_bwd_calls * hw.sync_overhead_s
    # Recompute stops early (torch's non-reentrant checkpoint) once the last saved tensor is
    # rebuilt: the layer's final all-reduce, whose output (boundary-sized) only feeds the
    # residual stream, is not run again.
    boundary = row.boundary_bytes.whole
    rec_s, rec_sent = collective(max(traffic.allreduce_fwd_bytes - boundary, 0.0))
    if tp > 1:
        skipped = int(boundary > 0 and traffic.allreduce_fwd_bytes >= boundary)
        rec_s += max(traffic.allreduce_fwd_calls - skipped, 0) * hw.sync_overhead_s
    return _TpTimes(fwd_s, fwd_sent, bwd_s, bwd_sent, rec_s, rec_sent, regather_s)


def row_work(
    row: LayerRow, hw: HardwareProfile, dtype: str, setting: WorkSetting, memo: dict | None = None
) -> tuple[LayerCost, float]:
    """The candidate-independent part of ``_layer_cost`` (its state fields 0) and the backward's
    seconds. ``memo`` (``NumericTable.work_memo``) shares the passes' and the tensor-parallel
    collectives' seconds between settings that differ in what those do not read (a context
    method or placement, the tensor-parallel group's placement)."""
    tp, sequence_parallel = setting.tp, setting.sequence_parallel
    params = int(split_by_tp(row.param_count.tp_part, row.param_count.whole - row.param_count.tp_part, tp))
    routed = row.experts
    dense, local_experts = expert_state_split(
        params,
        int(split_by_tp(routed.param_count.tp_part, routed.param_count.whole - routed.param_count.tp_part, tp)),
        setting.expert.ep,
    )
    params = dense + local_experts
    passes, tp_comm = _shared_times(row, hw, dtype, setting, params, memo)
    routing = all_to_all_times(
        routed.dispatch_bytes.per_device(tp, sequence_parallel), routed.moe_layers, setting.expert, hw
    )
    tp_seen = _tp_seen(tp_comm, passes, setting, hw)
    exchange = context_exchange(row, setting.context, tp, setting.tokens, hw, dtype)
    slow = hw.overlap_contention * (tp_seen.fwd.hidden_s + tp_seen.bwd.hidden_s + exchange.hidden_s)
    saved = row.saved_bytes.per_device(tp, sequence_parallel)
    gradient_bytes = bytes_per_param(dtype)["grads"] * row.largest_param.per_device_elements(tp)
    work = LayerCost(
        compute_s=passes.forward_s + passes.backward_s + slow,
        fwd_s=passes.forward_s + hw.overlap_contention * tp_seen.fwd.hidden_s,
        tp_s=tp_seen.fwd.exposed_s + tp_seen.bwd.exposed_s,
        tp_fwd_s=tp_seen.fwd.exposed_s,
        rec_s=hw.recompute_ratio * passes.forward_s
        + tp_seen.rec.exposed_s
        + hw.overlap_contention * (tp_seen.rec.hidden_s + exchange.rec_hidden_s)
        + routing.rec_s
        + exchange.rec_s,
        zero_mb_s=0.0,
        dp_step_s=0.0,
        opt_s=0.0,
        params_b=row.buffer_bytes,
        grads_b=0,
        optimizer_b=0,
        trans_params_b=0,
        trans_grads_b=0,
        bt_b=float(backward_transient_bytes(row.peak_act_bytes.per_device(tp), gradient_bytes))
        + _regathered_bytes(row, setting)
        + exchange.transient_b,
        saved_b=saved + exchange.saved_b,
        input_b=row.input_bytes.whole - row.input_bytes.sp_removed(tp, sequence_parallel),
        boundary_b=row.boundary_bytes.whole - row.boundary_bytes.sp_removed(tp, sequence_parallel),
        tp_sent_b=tp_comm.fwd_sent_b,
        tp_bwd_sent_b=tp_comm.bwd_sent_b,
        tp_rec_sent_b=tp_comm.rec_sent_b,
        zero_mb_sent_b=0.0,
        dp_step_sent_b=0.0,
        num_params=params,
        expert_params=local_experts,
        ep_s=routing.fwd_s + routing.bwd_s,
        ep_fwd_s=routing.fwd_s,
        ep_rec_s=routing.rec_s,
        ep_sent_b=routing.fwd_sent_b + routing.bwd_sent_b,
        ep_rec_sent_b=routing.rec_sent_b,
        wgrad_s=passes.wgrad_s,
        wgrad_keep_b=wgrad_kept_bytes(row, dtype, tp, setting.tokens, sequence_parallel),
        sel_rec_s=passes.selective_s,
        sel_saved_b=row.core.saved_bytes.per_device(tp, sequence_parallel),
        tail_b=min(max(row.tail_saved_bytes.per_device(tp, sequence_parallel), 0.0), saved),
        tp_hidden_s=tp_seen.fwd.hidden_s + tp_seen.bwd.hidden_s,
        tp_rec_hidden_s=tp_seen.rec.hidden_s,
        tp_rec_s=tp_seen.rec.exposed_s,
        cp_s=exchange.fwd_s + exchange.bwd_s,
        cp_fwd_s=exchange.fwd_s,
        cp_rec_s=exchange.rec_s,
        cp_sent_b=exchange.fwd_sent_b + exchange.bwd_sent_b,
        cp_rec_sent_b=exchange.fwd_sent_b,
        cp_hidden_s=exchange.hidden_s,
    )
    return work, passes.backward_s


def _shared_times(
    row: LayerRow, hw: HardwareProfile, dtype: str, setting: WorkSetting, params: int, memo: dict | None
) -> tuple[_PassTimes, _TpTimes]:
    """The row's passes and tensor-parallel collectives, each keyed by what it reads."""
    tp, sequence_parallel = setting.tp, setting.sequence_parallel
    passes = remembered(
        memo,
        ("passes", id(row), id(hw), dtype, tp, sequence_parallel, setting.compiled, setting.tokens)
        + (setting.overlap_tp, setting.expert, params),
        lambda: _pass_times(row, hw, dtype, setting, params),
        (row, hw),
    )
    tp_comm = remembered(
        memo,
        ("tp_times", id(row), id(hw), tp, sequence_parallel, setting.tp_placement),
        lambda: _tp_times(row, hw, setting),
        (row, hw),
    )
    return passes, tp_comm


def remembered(memo: dict | None, key: tuple, compute: Callable[[], Any], keyed_by: tuple) -> Any:
    """``compute()``, through ``memo`` when given; the objects whose ids are in ``key``
    (``keyed_by``) stay referenced beside the value, so their ids cannot be reused."""
    if memo is None:
        return compute()
    known = memo.get(key)
    if known is None:
        known = memo[key] = (compute(), keyed_by)
    return known[0]


def _regathered_bytes(row: LayerRow, setting: WorkSetting) -> float:
    """Under sequence parallelism, the column-parallel input a backward gathers again for its weight
    gradients (only its positions are saved), held beside that linear's other backward transients:
    one of the row's gathered inputs, whole (their mean: a GPT block's two are equal)."""
    calls = row.tp_traffic.sp_all_gather_calls
    if not (setting.sequence_parallel and setting.tp > 1 and calls):
        return 0.0
    return row.tp_traffic.sp_all_gather_bytes / calls


def _tp_seen(tp_comm: _TpTimes, passes: _PassTimes, setting: WorkSetting, hw: HardwareProfile) -> TpExposure:
    """The row's TP seconds split into exposed and hidden (all exposed when the run does not
    overlap them, ``WorkSetting.overlap_tp``)."""
    if not setting.overlap_tp or setting.tp == 1:
        bwd = Hidden(tp_comm.bwd_s + tp_comm.regather_s, 0.0)
        return TpExposure(Hidden(tp_comm.fwd_s, 0.0), bwd, Hidden(tp_comm.rec_s, 0.0))
    return tp_exposure(
        tp_comm.fwd_s,
        tp_comm.bwd_s,
        tp_comm.rec_s,
        (passes.forward_s, passes.backward_s, passes.wgrad_s),
        setting.tp,
        setting.sequence_parallel,
        regather_s=tp_comm.regather_s,
        gain=hw.overlap_window_gain,
    )
