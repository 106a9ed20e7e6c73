"""The cost of one fully specified strategy: the single source of truth of the planner.

A *candidate* fixes ``(dp, tp, pp, zero_stage, micro_batch_size, num_micro_batches)`` (and
compile, offload, sequence parallelism); a *strategy* adds the stage partition (``pp`` contiguous
ranges of the layer table) and the recomputed layers. :func:`evaluate` prices a strategy; the ILP
(:mod:`planner.search.ilp`) optimizes exactly this function, and the plan's ``predicted`` block is
its output.

Per layer, one micro-batch of ``b`` sequences of ``s`` tokens, per device (``cost_models.layer_row``
reads the table's row; ``X_tp`` is the part tp divides, ``X_sp`` the part sequence parallelism does):

- compute: ``F = fwd - fwd_tp + fwd_tp / tp`` FLOPs (GEMMs priced by shape, ``cost_models.gemm_cost``)
  plus the memory-bound bytes ``Q`` (split likewise) at the memory bandwidth, plus ``op_overhead_s``
  per operator call (``num_ops`` forward, twice in backward; ``max`` of device and host time when
  ``hw.ops_async``, their sum otherwise). Backward adds ``3 x`` the gradient bytes (accumulation).
- TP: one all-reduce of ``tp_allreduce_bytes`` per forward and of ``tp_allreduce_bwd_bytes`` per
  backward (``collective_time`` on the TP placement, plus a copy at memory bandwidth and
  ``sync_overhead_s`` per call); at tp > 1 the vocab-parallel loss's ``tp_loss_*_bytes`` are added.
  Sequence parallelism turns each all-reduce into a reduce-scatter + all-gather (same bytes, twice
  the calls) and divides the ``*_sp`` activations and bytes by tp; the backward gathers each
  column-parallel input once more (only the positions are saved: ``sp_all_gather_bytes`` again).
- recompute: ``rec = recompute_ratio x t_fwd + t_tp_rec``, where the rerun skips the final,
  boundary-sized all-reduce: ``max(tp_allreduce_bytes - boundary_bytes, 0)`` in one call fewer.
  Selective: ``sel_rec = recompute_ratio x t_core`` frees ``core_saved_bytes``.
- state: ``P = ceil(param_count_tp / tp) + (param_count - param_count_tp)`` parameters, model state
  by ``cost_models.memory.model_state_bytes`` per layer (ZeRO pads each layer to ``dp``); ZeRO-2/3
  transients sized by the stage's largest layer. Activations: ``saved - saved_tp + saved_tp / tp``,
  a checkpointed layer keeps ``input_bytes``; ``boundary_bytes`` crosses a stage cut.
- compiled (``Candidate.compile``): ``r = 1 + tp collective calls (+ 2 per MoE layer at ep > 1)`` regions cost ``r x
  COMPILED_REGION_OPS`` calls of overhead, memory-bound bytes scale by ``COMPILED_BYTES_FRACTION``;
  compiling costs ``COMPILE_S_PER_CLASS`` per distinct layer class of the busiest stage, once per run
  (``Evaluation.extra["compile_s"]``, weighed by ``planner.search.solve``).
- DP/ZeRO (``comm_cost.zero_dp_collectives``): ZeRO 0/1 once per step after the last backward;
  ZeRO 2 reduce-scatters every micro-batch (``zero_mb``) and all-gathers once; ZeRO 3 gathers for
  forward and backward and reduce-scatters every micro-batch. A tied weight across stages adds a
  copy and a gradient all-reduce (``cost_models.tied_cost``); offload adds its exposed transfers to
  ``zero_mb`` / ``dp_step`` and its host AdamW to ``opt`` (``cost_models.offload_cost``).
- experts (``Candidate.expert_parallel``, ``cost_models.expert_cost``): a MoE row's routed experts
  divide by ep (their state over the ``dp / ep`` expert-data group), its expert products are
  priced at the rows each local expert gets times the load, and its all-to-alls (``t_ep``, per
  micro-batch, in ``work``; again in ``rec`` when recomputed) by alpha-beta on the expert group.
- overlap (``Candidate.overlap``, plan.json ``overlap``): TP and DP/ZeRO collectives are charged
  only what their window of independent compute cannot hide, per layer (``cost_models.overlap_cost``):
  ``tp``, ``zero_mb``, ``dp_step`` hold the exposed seconds, ``*_hidden_s`` the hidden ones, and the
  contention ``overlap_contention x hidden`` joins the compute (per step: ``dp_contention_s``, in
  ``dp_step`` and reported as ``compute``). Every term stays a per-layer constant (ILP unchanged).

Step time (1F1B, ``p`` stages, ``m`` micro-batches), stage ``k`` holding layers ``S_k``, recomputed ``R``::

    work_k = sum_{S_k} (t_fwd + t_bwd + t_tp + t_ep) + sum_{S_k & R} rec_l + p2p_k
    T_k    = work_k + sum_{S_k} zero_mb_l          one micro-batch through stage k
    D      = max_k sum_{S_k} (dp_step_l + opt_l)    exposed DP/ZeRO traffic + optimizer step
    step   = (m - 1) max_k T_k + sum_k T_k + D

``p2p_k`` sends the stage's output forward and the previous stage's gradient back. The first
micro-batch crosses every stage, the other ``m - 1`` follow the slowest: equal stages give the
textbook ``(m + p - 1) T``. ``bubble_fraction = (sum_k T_k - T) / (m T + sum_k T_k - T)``.

Memory of stage ``k``: model state + its largest layer's ZeRO transients + ``min(p - k, m)``
micro-batches of activations (``cost_models.memory``); feasible when every stage fits
``memory_bytes x memory_headroom`` and, with offload, the node's host and NVMe bytes fit too.

Time breakdown (``predicted.time``) at the bottleneck stage ``k*`` (largest ``T_k``) and the tail
stage ``d*`` (largest ``D``): ``compute``, ``recompute``, ``tp_comm`` are ``m x`` stage ``k*``'s;
``pp_bubble = sum_k T_k - T + m p2p_k*``; ``ep_comm = m x`` stage ``k*``'s all-to-alls (a
recomputed forward's too, as its TP collectives are ``tp_comm``: where the runtime times them);
``dp_comm = m (zero_mb_k* - offload_mb_k*) + dp_d* - offload_step_d* - dp_contention_d*``
(``compute`` gains ``dp_contention_d*``); ``optimizer = opt_d*``; ``offload = m offload_mb_k* +
offload_step_d*``. The parts sum to the step time. ``predicted.hidden``: the hidden seconds there.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Sequence

from cost_models.comm_cost import (
    GroupPlacement,
    axis_placement,
    collective_time,
    step_control_bytes,
    zero_dp_collectives,
)
from cost_models.compression_cost import StageExchange, shares, stage_exchange
from cost_models.compute import optimizer_step_time
from cost_models.context_cost import ContextSetting, context_row
from cost_models.expert_cost import ExpertSetting, expert_load, expert_placements
from cost_models.hardware import HardwareProfile
from cost_models.layer_row import LayerRow, NumericTable
from cost_models.layer_work import (
    COMPILED_BYTES_FRACTION,
    COMPILED_REGION_OPS,
    LayerCost,
    WorkSetting,
    compiled_regions,
    remembered,
    row_work,
)
from cost_models.memory import (
    buckets_leave,
    bytes_per_param,
    inflight_microbatches,
    model_state_bytes,
    reduction_bytes,
    shard_elements,
    stage_activation_bytes,
    zero_transient_bytes,
)
from cost_models.offload_cost import (
    OffloadedLayer,
    layer_offload,
    offload_breakdown,
    offload_buffer_bytes,
    ranks_per_node,
)
from cost_models.overlap_cost import DpExposure, DpTraffic, dp_exposure
from cost_models.tied_cost import TiedCost, tied_weight_costs
from runtime.contract.choices import ContextMethod, GradCompression, OffloadTier, names
from runtime.contract.collective_bytes import ring_bytes
from runtime.contract.compressed_exchange import ERROR_ELEMENT_BYTES
from runtime.contract.limits import REDUCTIONS_IN_FLIGHT
from runtime.contract.overlap import OVERLAP_ALL, Overlap
from runtime.contract.rank_layout import crosses_nodes

__all__ = [
    "NumericTable",
    "Candidate",
    "Strategy",
    "LayerCost",
    "COMPILED_REGION_OPS",
    "COMPILED_BYTES_FRACTION",
    "COMPILE_S_PER_CLASS",
    "compile_seconds",
    "compiled_regions",
    "CandidateCosts",
    "StageCost",
    "Evaluation",
    "candidate_costs",
    "work_floor",
    "free_work_floor",
    "draft_costs",
    "state_floor",
    "evaluate",
    "predicted_fields",
    "hidden_breakdown",
    "memory_bound",
    "pipeline_time",
    "boundary_placements",
    "warmup_step_s",
    "warmup_time",
    "compressed_exchange",
]

#: Seconds to compile one layer class, forward and backward, with a cold cache (inductor's C++
#: kernels on a CPU, Triton's on a GPU).
COMPILE_S_PER_CLASS: dict[str, float] = {"cpu": 15.0, "gpu": 30.0}


def compile_seconds(hw: HardwareProfile, classes: int) -> float:
    """Time to compile ``classes`` distinct layer classes on ``hw`` (a GPU when the profile's
    devices run operators asynchronously from the host, ``ops_async``)."""
    return COMPILE_S_PER_CLASS["gpu" if hw.ops_async else "cpu"] * classes


@dataclass(frozen=True, order=True)
class Candidate:
    """Degrees and batching: what the search enumerates around each ILP."""

    dp: int
    tp: int
    pp: int
    zero_stage: int
    micro_batch_size: int
    num_micro_batches: int
    compile: bool = False
    """Each layer class runs under ``torch.compile`` (module docstring, "compiled")."""
    offload_optimizer: str = "none"
    """Where the optimizer state lives and AdamW runs: ``none`` (device), ``cpu``, ``nvme``
    (``cost_models.offload_cost``)."""
    offload_params: str = "none"
    """Where the ZeRO-3 parameter shards live: ``none`` (device), ``cpu``, ``nvme``."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism in the tensor-parallel regions (tp > 1; module docstring, "TP")."""
    dp_compression: str = "none"
    """``onebit-adam``: 1-bit Adam's compressed momentum exchange after a full-precision warm-up
    (``cost_models.compression_cost``); needs dp > 1, ZeRO 0 or 1 and no offload."""
    overlap: Overlap = field(default=OVERLAP_ALL, compare=False)
    """What the run overlaps with compute (``runtime.contract.overlap``; plan.json ``overlap``):
    the request's setting, the same for every candidate of a search (so not compared)."""
    expert_parallel: int = 1
    """Ranks of each data-parallel group sharing the routed experts (divides dp;
    ``cost_models.expert_cost``); 1 for a dense model."""
    moe_imbalance: float = field(default=1.0, compare=False)
    """The busiest rank's expert tokens over the mean (``--moe-imbalance``): the request's."""
    moe_capacity_factor: float | None = field(default=None, compare=False)
    """Tokens an expert takes, over its even share (``--moe-capacity-factor``); None: dropless."""
    context_parallel: int = 1
    """Ranks splitting each sequence (``cost_models.context_cost``); 1: none. A mesh axis of its
    own: ``gpus = dp * cp * tp * pp``."""
    cp_method: str = ContextMethod.RING.value
    """How the context-parallel group computes attention (``ring``, ``all-gather``, ``ulysses``)."""

    def __post_init__(self) -> None:
        if self.compressed and (self.dp < 2 or self.zero_stage > 1 or self.offloads):
            raise ValueError(f"1-bit Adam needs dp > 1, ZeRO 0 or 1 and no offload: {self.describe()}")
        if self.expert_parallel < 1 or self.dp % self.expert_parallel:
            raise ValueError(f"expert_parallel {self.expert_parallel} must divide dp {self.dp}")
        if self.expert_parallel > 1 and (self.compressed or self.offloads):
            raise ValueError(f"expert parallelism is not priced with 1-bit Adam or offload: {self.describe()}")
        if self.context_parallel < 1 or self.cp_method not in names(ContextMethod):
            raise ValueError(f"context parallelism needs cp >= 1 and a known method: {self.describe()}")
        if self.context_parallel > 1 and (self.compressed or self.offloads or self.expert_parallel > 1):
            raise ValueError(f"context parallelism runs without 1-bit Adam, offload or ep: {self.describe()}")

    def compiled_as(self, on: bool) -> "Candidate":
        """This candidate with ``compile`` set to ``on``, every other field as is (none of
        ``__post_init__``'s checks reads it: a search makes thousands of these twins)."""
        twin = object.__new__(Candidate)
        twin.__dict__.update(self.__dict__)
        twin.__dict__["compile"] = bool(on)
        return twin

    @property
    def expert_load(self) -> float:
        """The busiest rank's expert rows over the even share (``cost_models.expert_cost.expert_load``)."""
        return expert_load(self.expert_parallel, self.moe_imbalance, self.moe_capacity_factor)

    @property
    def compressed(self) -> bool:
        """True when the data-parallel exchange is 1-bit Adam's (after its warm-up)."""
        return self.dp_compression != GradCompression.NONE

    @property
    def degrees(self) -> tuple[int, int, int]:
        return self.dp, self.tp, self.pp

    @property
    def weight_dp(self) -> int:
        """Ranks holding the same weights, ``dp * cp``: gradients are reduced and ZeRO state sharded
        over them (with cp between tp and dp in the rank layout they are the data-parallel axis of
        a ``(pp, dp * cp, tp)`` mesh, which prices their placement)."""
        return self.dp * self.context_parallel

    @property
    def mesh(self) -> tuple[int, int, int, int, int]:
        """``(dp, tp, pp, ep, cp)``: what makes two candidates different layouts of the devices (the
        search keeps the best of each; context-parallel methods compete within a layout)."""
        return self.dp, self.tp, self.pp, self.expert_parallel, self.context_parallel

    @property
    def offloads(self) -> bool:
        """True when some state lives off the device."""
        return self.offload_optimizer != OffloadTier.NONE or self.offload_params != OffloadTier.NONE

    def describe(self) -> str:
        off = [
            f"{kind} on {tier}"
            for kind, tier in (("optimizer", self.offload_optimizer), ("params", self.offload_params))
            if tier != OffloadTier.NONE
        ]
        return (
            f"dp={self.dp} tp={self.tp} pp={self.pp} zero={self.zero_stage} "
            f"micro-batch={self.micro_batch_size} x {self.num_micro_batches}"
            + (", sequence-parallel" if self.sequence_parallel else "")
            + (", compiled" if self.compile else "")
            + (f", offload {' and '.join(off)}" if off else "")
            + (", 1-bit Adam" if self.compressed else "")
            + ("" if self.overlap.any else ", no overlap")
            + (f", ep={self.expert_parallel}" if self.expert_parallel > 1 else "")
            + (f", cp={self.context_parallel} ({self.cp_method})" if self.context_parallel > 1 else "")
        )


@dataclass(frozen=True)
class Strategy:
    """A fully specified strategy: a candidate plus stage ranges and recomputed layers."""

    candidate: Candidate
    stages: tuple[tuple[int, int], ...]
    """Inclusive layer-table ranges, one per pipeline stage, contiguous and covering the table."""
    checkpoint: frozenset = frozenset()
    """Layer-table indices whose activations are recomputed in backward."""
    schedule: str = "1f1b"
    """The pipeline schedule (``cost_models.schedule_cost``): ``1f1b``, ``interleaved``, ``zero-bubble``."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank; with ``v > 1`` ``stages`` lists the ``pp * v`` chunks in
    model order (chunk ``c`` on rank ``c % pp``)."""
    selective: frozenset = frozenset()
    """Layer-table indices whose attention cores are recomputed (disjoint from ``checkpoint``)."""


@functools.lru_cache(maxsize=1024)
def boundary_placements(dp: int, tp: int, pp: int, gpus_per_node: int) -> tuple[GroupPlacement, ...]:
    """Placement of the worst rank pair across each pipeline boundary ``j -> j + 1``.

    Under ``rank = (pp_i * dp + dp_i) * tp + tp_i`` stage ``j``'s rank ``r`` talks to ``r + dp*tp``;
    a boundary is inter-node when any such pair lives on two nodes.
    """
    width = dp * tp
    return tuple(
        GroupPlacement(2, 2, 1) if crosses_nodes(j, j + 1, width, gpus_per_node) else GroupPlacement(2, 1, 2)
        for j in range(pp - 1)
    )


class CandidateCosts:
    """Every per-layer number of one candidate, and the per-boundary send times."""

    def __init__(
        self,
        cand: Candidate,
        layers: list[LayerCost],
        hw: HardwareProfile,
        gpus_per_node: int,
        capacity: float,
        distinct: list[tuple[LayerCost, int]] | None = None,
    ):
        self.cand = cand
        self.layers = layers
        self.draft = False
        """Whether these are ``draft_costs`` (no data-parallel traffic): bounds only, and the
        relaxed stage model (``planner.search.candidates``) leaves the last block out as it does
        a distinct one, since once priced it may be one."""
        if distinct is None:
            counts: dict[LayerCost, int] = {}
            for cost in layers:
                counts[cost] = counts.get(cost, 0) + 1
            distinct = list(counts.items())
        self.distinct = distinct
        """Each distinct layer cost with the number of layers that have it."""
        self.hw = hw
        self.capacity = capacity
        self.placements = boundary_placements(cand.weight_dp, cand.tp, cand.pp, gpus_per_node)
        self.dp_placement = axis_placement("dp", cand.weight_dp, cand.tp, cand.pp, gpus_per_node)
        self.tp_placement = axis_placement("tp", cand.weight_dp, cand.tp, cand.pp, gpus_per_node)
        """Where the tensor-parallel group's ranks live (gathers a split pipeline message)."""
        """Where the data-parallel group's ranks live (prices the compressed exchange)."""
        pp, micro_batches = cand.pp, cand.num_micro_batches
        self.inflight: list[float] = [inflight_microbatches(k, pp, micro_batches) for k in range(pp)]
        self._send: dict[tuple[float, int], float] = {}
        self.loss_transient_b = 0.0
        """The last layer's backward transient (a language model's loss: ``2 x logits``)."""
        self.dtype = "fp32"
        """Training dtype (sizes the ZeRO buffers)."""
        self.ranks_per_node = ranks_per_node(cand.weight_dp * cand.tp * cand.pp, gpus_per_node)
        """Ranks of a node sharing its host memory and drives (``cost_models.offload_cost``)."""
        self.host_buffers_b = 0
        """Pinned offload buffers of one rank (``cost_models.offload_cost.offload_buffer_bytes``)."""
        self.host_room = math.inf
        """Host bytes per rank left for offloaded layer state: the node's usable host memory over its
        ranks, less the buffers (``inf`` without offload)."""
        self.nvme_room = math.inf
        """NVMe bytes per rank for offloaded layer state (``inf`` without NVMe offload)."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def send_s(self, layer: int, boundary: int) -> float:
        """Seconds to send layer ``layer``'s output across pipeline boundary ``boundary``: a
        blocking transfer (its alpha-beta time and one wait for the peer). Between two nodes,
        without sequence parallelism, the ``tp`` ranks of a stage hold the same activation and
        each sends a ``1 / tp`` slice that the receiving ranks all-gather over their
        tensor-parallel group (``runtime.pipeline.transport``, Megatron-LM's scatter/gather:
        Narayanan et al. 2021, section 4.1): the network carries ``1 / tp`` of the bytes, the
        node's links the rest. Under sequence parallelism the activation is already split; inside
        a node the split would only add the gather's latency."""
        key = (self.layers[layer].boundary_b, boundary)
        seconds = self._send.get(key)
        if seconds is None:
            nbytes, tp = key[0], self.cand.tp
            placement = self.placements[boundary]
            split = tp > 1 and not self.cand.sequence_parallel and not placement.intra_node
            seconds = float(collective_time("send", nbytes / tp if split else nbytes, placement, self.hw))
            if split:
                seconds += float(collective_time("all_gather", nbytes, self.tp_placement, self.hw))
            seconds += self.hw.sync_overhead_s
            self._send[key] = seconds
        return seconds

    def is_uniform(self) -> bool:
        """True when the blocks (rows 1..L) cost the same, except possibly the last one: the ILP
        can then count blocks per stage. Remembered for the rows it was asked of (the same
        objects; a row replaced since is asked again): the search asks often, and each answer
        compares every row's fifty-odd fields."""
        known = self.__dict__.get("_uniform")
        if known is not None and len(known[0]) == len(self.layers) and all(map(operator.is_, known[0], self.layers)):
            return known[1]
        block = self.layers[1] if self.num_layers >= 3 else None
        uniform = block is not None and all(cost is block or cost == block for cost in self.layers[2:-2])
        self.__dict__["_uniform"] = (tuple(self.layers), uniform)
        return uniform


@dataclass(frozen=True)
class _CandidatePricing:
    """What every row of one candidate is priced with (``candidate_costs``)."""

    hw: HardwareProfile
    dtype: str
    candidate: Candidate
    setting: WorkSetting
    dp_placement: GroupPlacement
    """Where the data-parallel group's ranks live (prices the ZeRO collectives)."""
    ranks_per_node: int
    """Ranks sharing a node's host memory and drives (offload)."""
    gpus_per_node: int = 1

    def expert_data(self) -> "_CandidatePricing":
        """The pricing of the routed experts' state: dp is the expert-data-parallel group's
        ``dp / ep`` ranks, placed as ``runtime.contract.rank_layout.expert_ranks`` places them."""
        cand = self.candidate
        ep = cand.expert_parallel
        edp = expert_placements(cand.dp, cand.tp, cand.pp, ep, self.gpus_per_node)[1]
        return dataclasses.replace(
            self, candidate=dataclasses.replace(cand, dp=cand.dp // ep, expert_parallel=1), dp_placement=edp
        )


def candidate_costs(
    table: NumericTable,
    hw: HardwareProfile,
    dtype: str,
    seq_len: int,
    cand: Candidate,
    gpus_per_node: int,
    capacity: float,
) -> CandidateCosts:
    """Per-layer costs of ``cand`` (identical rows are priced once)."""
    distinct_rows, row_of_layer = context_rows(table, cand.micro_batch_size, seq_len, cand.context_parallel)
    pricing = _pricing(table, hw, dtype, seq_len, cand, gpus_per_node)
    priced = [_layer_cost(row, pricing, table.work_memo) for row in distinct_rows]
    row_costs = [cost for cost, _ in priced]
    layers = [row_costs[i] for i in row_of_layer]
    overlapped = _overlaps_dp(cand)
    if overlapped:
        layers = _overlap_dp(layers, [priced[i][1] for i in row_of_layer], hw)
    zero = 0 if cand.compressed else cand.zero_stage  # compressed: stage 0's optimizer memory
    tied = tied_weight_costs(table.tied, cand.weight_dp, cand.tp, cand.pp, zero, dtype, hw, gpus_per_node)
    for weight in tied:
        _add_tied_weight(layers, weight, cand.offload_optimizer)
        if cand.compressed:
            _compress_tied_copy(layers, weight.last, weight.params_b // bytes_per_param(dtype)["weights"], pricing)
    costs = CandidateCosts(
        cand,
        layers,
        hw,
        gpus_per_node,
        capacity,
        distinct=_distinct(layers)
        if tied or overlapped
        else [(cost, row_of_layer.count(i)) for i, cost in enumerate(row_costs)],
    )
    costs.dtype = dtype
    if cand.offloads:
        _set_offload_room(costs, row_costs, pricing.ranks_per_node)
    # The last row's transient: for a language model the loss backward's 2 x logits.
    costs.loss_transient_b = costs.layers[-1].bt_b
    return costs


def _pricing(
    table: NumericTable, hw: HardwareProfile, dtype: str, seq_len: int, cand: Candidate, gpus_per_node: int
) -> _CandidatePricing:
    """What ``cand``'s rows are priced with: its work setting, placements and node share."""
    return _CandidatePricing(
        hw=hw,
        dtype=dtype,
        candidate=cand,
        setting=_work_setting(table, seq_len, cand, gpus_per_node),
        dp_placement=axis_placement("dp", cand.weight_dp, cand.tp, cand.pp, gpus_per_node),
        ranks_per_node=ranks_per_node(cand.weight_dp * cand.tp * cand.pp, gpus_per_node),
        gpus_per_node=gpus_per_node,
    )


def _work_setting(table: NumericTable, seq_len: int, cand: Candidate, gpus_per_node: int) -> WorkSetting:
    """What ``cand``'s rows' work depends on beside the row, the profile and the dtype."""
    return WorkSetting(
        tp=cand.tp,
        sequence_parallel=cand.sequence_parallel and cand.tp > 1,
        compiled=cand.compile,
        tp_placement=axis_placement("tp", cand.weight_dp, cand.tp, cand.pp, gpus_per_node),
        tokens=cand.micro_batch_size * seq_len / cand.context_parallel,
        overlap_tp=cand.overlap.tp,
        expert=_expert_setting(cand, gpus_per_node),
        context=context_setting(table, cand, gpus_per_node),
    )


def work_floor(
    table: NumericTable, hw: HardwareProfile, dtype: str, seq_len: int, cand: Candidate, gpus_per_node: int
) -> float:
    """A step time no strategy of ``cand`` beats, from its rows' work alone: at most the
    ``time_lower_bound`` of ``candidate_costs`` (``planner.search.candidates``) and about a
    twentieth of its price, so a search can order candidates by it and price only those it visits.

    The step is at least ``(m - 1) T + sum_k T_k`` with ``sum_k T_k >= W``, every row's work once
    (``row_work``: compute and tensor-, expert- and context-parallel traffic of one micro-batch),
    and ``T >= max(W / p, largest row)``. Pricing a candidate only adds to a row's work (ZeRO and
    offload transfers, pipeline sends, what overlapped collectives cost compute, the per-step
    tail), so the floor holds. Memoized per work setting: candidates that differ in ZeRO stage,
    data-parallel placement or offload share it."""
    total, largest = _row_works(table, hw, dtype, seq_len, cand, gpus_per_node)
    slowest = max(total / cand.pp, largest)
    return (cand.num_micro_batches - 1) * slowest + max(total, slowest)


def draft_costs(
    table: NumericTable,
    hw: HardwareProfile,
    dtype: str,
    seq_len: int,
    cand: Candidate,
    gpus_per_node: int,
    capacity: float,
) -> CandidateCosts:
    """``candidate_costs`` with the data-parallel traffic free (no ZeRO collective, gradient
    reduction or offload transfer, so nothing to overlap) and no tied-weight copies: every row's
    work, state, activations and tail at most the priced ones', so a lower bound of time or
    memory computed on it bounds the priced candidate too. It skips what the overlap model works
    out (most of a price): a search can rule a candidate out on it first."""
    distinct_rows, row_of_layer = context_rows(table, cand.micro_batch_size, seq_len, cand.context_parallel)
    pricing = _pricing(table, hw, dtype, seq_len, cand, gpus_per_node)
    row_costs = [
        _layer_cost(row, pricing, table.work_memo)[0].but(zero_mb_s=0.0, dp_step_s=0.0) for row in distinct_rows
    ]
    costs = CandidateCosts(
        cand,
        [row_costs[i] for i in row_of_layer],
        hw,
        gpus_per_node,
        capacity,
        distinct=[(cost, row_of_layer.count(i)) for i, cost in enumerate(row_costs)],
    )
    costs.dtype = dtype
    costs.loss_transient_b = costs.layers[-1].bt_b
    costs.draft = True
    return costs


def free_work_floor(
    table: NumericTable, hw: HardwareProfile, dtype: str, seq_len: int, cand: Candidate, gpus_per_node: int
) -> float:
    """``work_floor`` of any schedule (no fill or drain): the busiest rank runs ``m`` micro-batches
    of at least the average rank's work and of its largest row; at most the schedule-free bound
    of the priced candidate (``planner.search.schedule_search.schedule_free_bound``)."""
    total, largest = _row_works(table, hw, dtype, seq_len, cand, gpus_per_node)
    return cand.num_micro_batches * max(total / cand.pp, largest)


def _row_works(
    table: NumericTable, hw: HardwareProfile, dtype: str, seq_len: int, cand: Candidate, gpus_per_node: int
) -> tuple[float, float]:
    """Every row's work of one micro-batch once, and the largest row's (``work_floor``; memoized
    per candidate fields, then per work setting: layouts that differ in ``dp`` or ``pp`` alone
    mostly share one)."""
    memo = table.work_memo
    key = ("work_floor", id(hw), dtype, seq_len, gpus_per_node, _work_fields(cand))
    known = memo.get(key)
    if known is None:
        setting = _work_setting(table, seq_len, cand, gpus_per_node)
        shared = ("row_works", id(hw), dtype, seq_len, setting, cand.micro_batch_size, cand.context_parallel)
        known = memo.get(shared)
        if known is None:
            rows, row_of_layer = context_rows(table, cand.micro_batch_size, seq_len, cand.context_parallel)
            works = [_row_work(row, hw, dtype, setting, memo)[0].work_s for row in rows]
            known = memo[shared] = (sum(works[i] for i in row_of_layer), max(works))
        memo[key] = known
    return known


def _work_fields(cand: Candidate) -> tuple:
    """The fields of ``cand`` its rows' work depends on (``_work_setting``'s inputs; a memo key
    read without building the setting): all but its ZeRO stage, offload, compression and count of
    micro-batches."""
    return (cand.micro_batch_size, *_layout_fields(cand))


def _layout_fields(cand: Candidate) -> tuple:
    """``_work_fields`` but the micro-batch size."""
    return (
        cand.dp,
        cand.tp,
        cand.pp,
        cand.compile,
        cand.sequence_parallel,
        cand.overlap,
        cand.expert_parallel,
        cand.moe_imbalance,
        cand.moe_capacity_factor,
        cand.context_parallel,
        cand.cp_method,
    )


def state_floor(
    table: NumericTable, hw: HardwareProfile, dtype: str, seq_len: int, cand: Candidate, gpus_per_node: int
) -> float:
    """Bytes of model state no strategy of ``cand`` goes under on its most loaded device: the
    rows' parameters, gradients and optimizer state (under its ZeRO stage, data parallelism and
    offload) spread evenly over the pipeline stages, and the largest row's whole. At most the
    ``memory_lower_bound`` of ``candidate_costs`` (``planner.search.candidates``: pricing only
    adds activations, transients and tied copies), so a search can rule out a candidate whose
    state alone overflows the device without pricing its traffic; the row states are memoized
    and priced once for both. A row's state reads its integer fields only (parameter and buffer
    counts, which no ``(b, s)`` changes), so the floor is memoized across micro-batch sizes."""
    key = (
        "state_floor",
        id(hw),
        dtype,
        seq_len,
        gpus_per_node,
        _layout_fields(cand),
        cand.zero_stage,
        cand.offload_optimizer,
        cand.offload_params,
        cand.dp_compression,
    )
    known = table.work_memo.get(key)
    if known is None:
        rows, row_of_layer = context_rows(table, cand.micro_batch_size, seq_len, cand.context_parallel)
        pricing = _pricing(table, hw, dtype, seq_len, cand, gpus_per_node)
        states = [_state_bytes(*_work_and_state(row, pricing, table.work_memo)) for row in rows]
        known = table.work_memo[key] = (sum(map(states.__getitem__, row_of_layer)), max(states))
    total, largest = known
    return max(total / cand.pp, largest)


def context_rows(table: NumericTable, micro_batch: int, seq_len: int, cp: int) -> tuple[list[LayerRow], list[int]]:
    """The distinct rows one rank runs at ``(b, s)`` under context parallelism ``cp`` and, per
    layer, the index of its row (``cost_models.context_cost.context_row``; cached in the table,
    whose row identities key the shared work)."""
    rows, row_of_layer = table.layer_rows(micro_batch, seq_len)
    if cp == 1:
        return rows, row_of_layer
    key = ("context_rows", micro_batch, seq_len, cp)
    cached = table.cache.get(key)
    if cached is None:
        local = table.rows(micro_batch, seq_len // cp)
        first = [row_of_layer.index(i) for i in range(len(rows))]  # a layer of each distinct row
        cached = [context_row(row, LayerRow.from_numbers(local[j]), cp) for row, j in zip(rows, first)], row_of_layer
        table.cache[key] = cached
    return cached


def context_setting(table: NumericTable, cand: Candidate, gpus_per_node: int) -> ContextSetting:
    """The candidate's context parallelism as a row's work sees it (the model's heads from the
    layer table; the group placed as ``runtime.contract.rank_layout`` places it)."""
    cp = cand.context_parallel
    if cp == 1:
        return ContextSetting()
    model = table.model
    return ContextSetting(
        cp=cp,
        method=cand.cp_method,
        placement=axis_placement("cp", cand.dp, cand.tp, cand.pp, gpus_per_node, cp),
        heads=int(model.get("heads") or 0),
        kv_heads=int(model.get("kv_heads") or model.get("heads") or 0),
        head_dim=int(model.get("head_dim") or 0),
        micro_batch=cand.micro_batch_size,
    )


def _expert_setting(cand: Candidate, gpus_per_node: int) -> ExpertSetting:
    """The candidate's expert parallelism as a row's work sees it (placement only at ep > 1)."""
    ep = cand.expert_parallel
    placement = expert_placements(cand.dp, cand.tp, cand.pp, ep, gpus_per_node)[0] if ep > 1 else None
    return ExpertSetting(ep=ep, load=cand.expert_load, placement=placement)


def _add_tied_weight(layers: list[LayerCost], weight: TiedCost, offload_optimizer: str) -> None:
    """A tied weight's copy on its last reader's stage, and its gradient all-reduce on both readers."""
    first = layers[weight.first]
    layers[weight.first] = first.but(
        dp_step_s=first.dp_step_s + weight.time_s,
        dp_step_sent_b=first.dp_step_sent_b + weight.sent_b,
        warmup_dp_step_s=first.warmup_dp_step_s + weight.time_s,
        warmup_dp_step_sent_b=first.warmup_dp_step_sent_b + weight.sent_b,
    )
    last = layers[weight.last]
    offloaded = offload_optimizer != OffloadTier.NONE  # the copy's optimizer state lives with the others
    layers[weight.last] = last.but(
        dp_step_s=last.dp_step_s + weight.time_s,
        dp_step_sent_b=last.dp_step_sent_b + weight.sent_b,
        warmup_dp_step_s=last.warmup_dp_step_s + weight.time_s,
        warmup_dp_step_sent_b=last.warmup_dp_step_sent_b + weight.sent_b,
        params_b=last.params_b + weight.params_b,
        grads_b=last.grads_b + weight.grads_b,
        optimizer_b=last.optimizer_b + (0 if offloaded else weight.optimizer_b),
        host_b=last.host_b + (weight.optimizer_b if offload_optimizer == OffloadTier.CPU else 0),
        nvme_b=last.nvme_b + (weight.optimizer_b if offload_optimizer == OffloadTier.NVME else 0),
    )


def _compress_tied_copy(layers: list[LayerCost], index: int, numel: int, pricing: "_CandidatePricing") -> None:
    """A tied weight's copy joins its stage's compressed momentum vector (its share of the
    exchange and compute, its error buffers)."""
    layer = layers[index]
    exchange_s, compute_s = shares(numel, pricing.dp_placement, pricing.hw)
    layers[index] = layer.but(
        compressed_numel=layer.compressed_numel + numel,
        dp_step_s=layer.dp_step_s + exchange_s,
        opt_s=layer.opt_s + compute_s,
        optimizer_b=layer.optimizer_b + _error_share_b(numel, pricing.candidate.dp),
    )


def _error_share_b(numel: int, dp: int) -> int:
    """A layer's share of the error buffers, rounded down (the stage's exact figure adds the rest)."""
    return int(ERROR_ELEMENT_BYTES * numel * (1 + 1 / dp))


def _set_offload_room(costs: CandidateCosts, row_costs: Sequence[LayerCost], ranks: int) -> None:
    """Host and NVMe capacity per rank for offloaded state, at the request's headroom."""
    cand, hw = costs.cand, costs.hw
    headroom = costs.capacity / hw.memory_bytes
    largest = max(shard_elements(cost.num_params, cand.dp) for cost in row_costs)
    costs.host_buffers_b = offload_buffer_bytes(
        largest, costs.dtype, cand.offload_optimizer, cand.offload_params, staged=hw.ops_async
    )
    costs.host_room = (hw.host_memory_bytes or 0) * headroom / ranks - costs.host_buffers_b
    if OffloadTier.NVME in (cand.offload_optimizer, cand.offload_params):
        costs.nvme_room = (hw.nvme_bytes or 0) * headroom / ranks


def _layer_cost(row: LayerRow, pricing: _CandidatePricing, memo: dict | None = None) -> tuple[LayerCost, DpTraffic]:
    """One row's costs under a candidate: its work (compute, tp collectives, activations; a
    function of the row and ``pricing.setting`` only, so shared through ``memo`` by every
    candidate that agrees on those) and its model state and ZeRO traffic (dp, ZeRO, offload)."""
    work, state = _work_and_state(row, pricing, memo)
    return _with_state(work, *state)


def _work_and_state(
    row: LayerRow, pricing: _CandidatePricing, memo: dict | None
) -> tuple[LayerCost, tuple["_LayerState", "_CompressedTerms | None"]]:
    """A row's work and its model state and DP/ZeRO costs, each through ``memo`` when given."""
    hw, dtype = pricing.hw, pricing.dtype
    work, backward_s = _row_work(row, hw, dtype, pricing.setting, memo)
    state_key = ("state", id(hw), dtype, work.num_params, work.expert_params, _state_key(work, backward_s, pricing))
    state = memo.get(state_key) if memo is not None else None
    if state is None:
        state = _row_state(work, backward_s, pricing)
        if memo is not None:
            memo[state_key] = state
    return work, state


def _row_work(
    row: LayerRow, hw: HardwareProfile, dtype: str, setting: WorkSetting, memo: dict | None
) -> tuple[LayerCost, float]:
    """``row_work``, through ``memo`` (``NumericTable.work_memo``) when given."""
    return remembered(
        memo, (id(row), id(hw), dtype, setting), lambda: row_work(row, hw, dtype, setting, memo), (row, hw)
    )


def _state_key(work: LayerCost, backward_s: float, pricing: _CandidatePricing) -> tuple:
    """What a row's model state and DP/ZeRO costs depend on beside its work (``_with_state``):
    candidates that differ only in micro-batching, pipeline depth or context-parallel method
    share it."""
    cand = pricing.candidate
    experts = (
        (cand.dp, cand.tp, cand.pp, cand.expert_parallel, pricing.gpus_per_node)
        if cand.expert_parallel > 1 and work.expert_params
        else None
    )
    return (
        cand.zero_stage,
        cand.weight_dp,
        cand.offload_optimizer,
        cand.offload_params,
        cand.dp_compression,
        pricing.dp_placement,
        pricing.ranks_per_node,
        experts,
        (work.fwd_s, backward_s) if cand.offloads else None,
    )


def _row_state(
    work: LayerCost, backward_s: float, pricing: _CandidatePricing
) -> tuple["_LayerState", "_CompressedTerms | None"]:
    """A row's model state and DP/ZeRO costs (and 1-bit Adam's terms when compressed)."""
    cand = pricing.candidate
    params = work.num_params
    if cand.expert_parallel > 1 and work.expert_params:  # the experts' state over the expert-data group
        state = _merged_state(
            _layer_state(params - work.expert_params, pricing, work.fwd_s, backward_s),
            _layer_state(work.expert_params, pricing.expert_data(), work.fwd_s, backward_s),
        )
    else:
        state = _layer_state(params, pricing, work.fwd_s, backward_s)
    return state, (_compressed_terms(params, pricing) if cand.compressed else None)


def _state_bytes(work: LayerCost, state_terms: tuple["_LayerState", "_CompressedTerms | None"]) -> int:
    """``state_b`` of ``_with_state``'s cost, without building it."""
    state, compressed = state_terms
    return (
        state.base["params"]
        + work.params_b
        + state.base["grads"]
        + state.base["optimizer"]
        + (compressed.error_b if compressed else 0)
    )


def _with_state(
    work: LayerCost, state: "_LayerState", compressed: "_CompressedTerms | None"
) -> tuple[LayerCost, DpTraffic]:
    """A row's work with its model state and DP/ZeRO traffic (``_layer_cost``)."""
    params = work.num_params
    cost = work.but(
        zero_mb_s=state.zero_mb_s + state.offload.mb_s,
        dp_step_s=compressed.dp_step_s if compressed else state.dp_step_s + state.offload.step_s,
        opt_s=compressed.opt_s if compressed else state.opt_s,
        offload_mb_s=state.offload.mb_s,
        offload_step_s=state.offload.step_s,
        host_b=state.offload.host_b,
        nvme_b=state.offload.nvme_b,
        params_b=state.base["params"] + work.params_b,
        grads_b=state.base["grads"],
        optimizer_b=state.base["optimizer"] + (compressed.error_b if compressed else 0),
        trans_params_b=state.peak["params"] - state.base["params"],
        trans_grads_b=state.peak["grads"] - state.base["grads"],
        zero_mb_sent_b=state.zero_mb_sent_b,
        dp_step_sent_b=0.0 if compressed else state.dp_step_sent_b,
        compressed_numel=params if compressed else 0,
        warmup_dp_step_s=state.dp_step_s + state.offload.step_s,
        warmup_opt_s=state.opt_s,
        warmup_dp_step_sent_b=state.dp_step_sent_b,
    )
    return cost, state.traffic


def _overlaps_dp(cand: Candidate) -> bool:
    """Whether ``cand``'s DP/ZeRO collectives run beside compute (``cost_models.overlap_cost``:
    not with offload, whose transfers the offload engine waits where they are issued; with 1-bit
    Adam only the full-precision warm-up's reductions, its compressed exchange is waited in the step)."""
    return cand.overlap.dp and cand.weight_dp > 1 and not cand.offloads


def _overlap_dp(layers: list[LayerCost], traffic: list[DpTraffic], hw: HardwareProfile) -> list[LayerCost]:
    """``layers`` with their ZeRO traffic charged what its windows cannot hide (exposed in
    ``zero_mb_s`` / ``dp_step_s``, hidden in ``*_hidden_s``) and the contention: per micro-batch in
    ``compute_s``, per step in ``dp_step_s`` (as ``dp_contention_s``). Rows that share a cost and an
    exposure share the result (repeated blocks stay one object). A window of ``w`` seconds hides
    ``hw.overlap_window_gain x w`` seconds of communication; each hidden second costs
    ``hw.overlap_contention`` seconds of compute."""
    n = len(layers)
    # list.count compares by identity first: repeated blocks, one object, are counted at C speed
    uniform = n >= 5 and layers[1 : n - 2].count(layers[1]) == n - 3
    steady = uniform and traffic[1 : n - 2].count(traffic[1]) == n - 3
    fwd, bwd, update = _windows(layers, hw.overlap_window_gain, steady)
    seen = dp_exposure(traffic, fwd, bwd, uniform, update)
    if steady and seen[1] is seen[n - 3]:  # rows 1 .. n-3: one block, one exposure, one result
        ends = [_exposed_layer(layers[j], traffic[j], seen[j], hw.overlap_contention) for j in (0, 1, n - 2, n - 1)]
        return ends[:1] + ends[1:2] * (n - 3) + ends[2:]
    made: dict[tuple, LayerCost] = {}
    out: list[LayerCost] = []
    last: tuple = (None, None)
    for layer, row, exposure in zip(layers, traffic, seen):
        if layer is last[0] and exposure is last[1]:  # a run of repeated blocks
            out.append(out[-1])
            continue
        key = (id(layer), exposure)
        cost = made.get(key)
        if cost is None:
            cost = made[key] = _exposed_layer(layer, row, exposure, hw.overlap_contention)
        out.append(cost)
        last = (layer, exposure)
    return out


def _windows(layers: list[LayerCost], gain: float, steady: bool) -> tuple[list[float], list[float], list[float]]:
    """Each row's forward, backward and optimizer-update seconds, times ``gain``; ``steady``: rows
    ``1 .. n-3`` are one block, worked out once."""
    rows = (layers[0], layers[1], layers[-2], layers[-1]) if steady else layers
    windows = (
        [gain * layer.fwd_s for layer in rows],
        [gain * (layer.compute_s - layer.fwd_s) for layer in rows],
        [gain * layer.opt_s for layer in rows],
    )
    if not steady:
        return windows
    blocks = len(layers) - 3
    fwd, bwd, update = (window[:1] + window[1:2] * blocks + window[2:] for window in windows)
    return fwd, bwd, update


def _exposed_layer(layer: LayerCost, row: DpTraffic, exposure: DpExposure, contention: float) -> LayerCost:
    """``layer`` with its DP/ZeRO traffic split by ``exposure`` (``contention``: compute seconds
    lost per hidden second). A compressed row (ZeRO 0/1, so all its traffic per step) keeps its
    exchange: only its full-precision warm-up runs the overlapped reductions."""
    step_total = row.grad_step_s + row.gather_step_s
    mb_total = row.reduce_mb_s + row.fwd_gather_mb_s + row.bwd_gather_mb_s
    step_contention = contention * exposure.step.hidden_s
    warmup = layer.warmup_dp_step_s - step_total + exposure.step.exposed_s + step_contention
    if layer.compressed_numel:
        return layer.but(warmup_dp_step_s=warmup, warmup_dp_contention_s=step_contention)
    return layer.but(
        compute_s=layer.compute_s + contention * exposure.micro_batch.hidden_s,
        zero_mb_s=layer.zero_mb_s - mb_total + exposure.micro_batch.exposed_s,
        zero_mb_hidden_s=exposure.micro_batch.hidden_s,
        dp_step_s=layer.dp_step_s - step_total + exposure.step.exposed_s + step_contention,
        warmup_dp_step_s=warmup,
        dp_step_hidden_s=exposure.step.hidden_s,
        dp_contention_s=step_contention,
        warmup_dp_contention_s=step_contention,
    )


def _distinct(layers: Sequence[LayerCost]) -> list[tuple[LayerCost, int]]:
    """Each distinct layer cost with its count, hashing each object once (rows share objects)."""
    n = len(layers)
    pairs: Iterable[Sequence[Any]]
    if n >= 5 and len(set(map(id, layers[1 : n - 2]))) == 1:  # rows 1 .. n-3 one object: at C speed
        pairs = [(layers[0], 1), (layers[1], n - 3), (layers[n - 2], 1), (layers[n - 1], 1)]
    else:
        by_object: dict[int, list] = {}
        entry: list = [None, 0]
        for cost in layers:
            if cost is not entry[0]:  # runs of one object (repeated blocks) count in place
                entry = by_object.setdefault(id(cost), [cost, 0])
            entry[1] += 1
        pairs = by_object.values()
    counts: dict[LayerCost, int] = {}
    for cost, count in pairs:
        counts[cost] = counts.get(cost, 0) + count
    return list(counts.items())


@dataclass(frozen=True)
class _LayerState:
    """A row's model state and uncompressed data-parallel costs under one candidate."""

    base: dict
    peak: dict
    offload: Any
    zero_mb_s: float
    dp_step_s: float
    opt_s: float
    zero_mb_sent_b: float
    dp_step_sent_b: float
    traffic: DpTraffic
    """The DP/ZeRO seconds by when the runtime runs them (``cost_models.overlap_cost``)."""


def _layer_state(params: int, pricing: _CandidatePricing, fwd_s: float, backward_s: float) -> _LayerState:
    """Model state (stage 0's optimizer state when compressed: the engine gathers its shards at
    the switch), ZeRO traffic and the AdamW step of a row of ``params`` parameters."""
    hw, dtype, cand = pricing.hw, pricing.dtype, pricing.candidate
    zero, dp = cand.zero_stage, cand.weight_dp
    offload_optimizer, offload_params = cand.offload_optimizer, cand.offload_params
    memory_zero = 0 if cand.compressed else zero
    base = model_state_bytes(
        params, dtype, memory_zero, dp, offload_optimizer=offload_optimizer, offload_params=offload_params
    )
    peak = model_state_bytes(
        params,
        dtype,
        memory_zero,
        dp,
        largest_layer_params=params,
        prefetch=True,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
    )
    offload = layer_offload(
        OffloadedLayer(params, dtype, zero, dp, offload_optimizer, offload_params),
        hw,
        pricing.ranks_per_node,
        fwd_s,
        backward_s,
    )
    per_microbatch, per_step = _zero_collectives(params, dtype, zero, dp)
    mb_times = [_collectives_time([c], pricing.dp_placement, hw) for c in per_microbatch]
    step_times = [_collectives_time([c], pricing.dp_placement, hw) for c in per_step]
    optimizer_params = shard_elements(params, dp) if zero >= 1 else params
    opt_s = (
        offload.optimizer_s
        if offload.optimizer_s is not None
        else (float(optimizer_step_time(optimizer_params, hw, dtype)) if params else 0.0)
    )
    return _LayerState(
        base=base,
        peak=peak,
        offload=offload,
        zero_mb_s=sum(mb_times),
        dp_step_s=sum(step_times),
        opt_s=opt_s,
        zero_mb_sent_b=sum(float(ring_bytes(kind, size, dp)) for kind, size in per_microbatch),
        dp_step_sent_b=sum(float(ring_bytes(kind, size, dp)) for kind, size in per_step),
        traffic=_dp_traffic(zero, mb_times, step_times, float(per_step[0][1]) if zero <= 1 and per_step else 0.0),
    )


def _merged_state(dense: _LayerState, experts: _LayerState) -> _LayerState:
    """A row's state as two parts: the dense parameters over dp, the local experts over the
    expert-data group (no offload with expert parallelism: ``Candidate`` refuses it)."""
    return _LayerState(
        base={key: dense.base[key] + experts.base[key] for key in dense.base},
        peak={key: dense.peak[key] + experts.peak[key] for key in dense.peak},
        offload=dense.offload,
        zero_mb_s=dense.zero_mb_s + experts.zero_mb_s,
        dp_step_s=dense.dp_step_s + experts.dp_step_s,
        opt_s=dense.opt_s + experts.opt_s,
        zero_mb_sent_b=dense.zero_mb_sent_b + experts.zero_mb_sent_b,
        dp_step_sent_b=dense.dp_step_sent_b + experts.dp_step_sent_b,
        traffic=DpTraffic(*(a + b for a, b in zip(dense.traffic, experts.traffic))),
    )


def _dp_traffic(
    zero_stage: int, per_microbatch: Sequence[float], per_step: Sequence[float], grad_bytes: float = 0.0
) -> DpTraffic:
    """The seconds of ``_zero_collectives``'s lists by role (their order is fixed there);
    ``grad_bytes``: the ZeRO 0/1 all-reduce's size (what fills its bucket)."""
    if not per_microbatch and not per_step:
        return DpTraffic()
    if zero_stage == 3:  # all-gather (forward), all-gather (backward), reduce-scatter
        return DpTraffic(
            fwd_gather_mb_s=per_microbatch[0], bwd_gather_mb_s=per_microbatch[1], reduce_mb_s=per_microbatch[2]
        )
    if zero_stage == 2:  # reduce-scatter every micro-batch, all-gather once
        return DpTraffic(reduce_mb_s=sum(per_microbatch), gather_step_s=sum(per_step))
    # ZeRO 0: all-reduce; ZeRO 1: all-reduce, then all-gather
    return DpTraffic(grad_step_s=per_step[0], gather_step_s=sum(per_step[1:]), grad_bytes=grad_bytes)


class _CompressedTerms(NamedTuple):
    dp_step_s: float
    opt_s: float
    error_b: int


def _compressed_terms(params: int, pricing: _CandidatePricing) -> _CompressedTerms:
    """A row's compressed-step tail: its share of the exchange (no gradient collective), the whole
    AdamW step (every rank updates the whole model) plus its share of the compression compute,
    and its share of the error buffers (``cost_models.compression_cost``)."""
    exchange_s, compute_s = shares(params, pricing.dp_placement, pricing.hw)
    adam_s = float(optimizer_step_time(params, pricing.hw, pricing.dtype)) if params else 0.0
    return _CompressedTerms(exchange_s, adam_s + compute_s, _error_share_b(params, pricing.candidate.dp))


def _zero_collectives(
    params: int, dtype: str, zero_stage: int, dp: int
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """A layer's DP/ZeRO collectives, split into those of every micro-batch and those of the step."""
    collectives = zero_dp_collectives(params, dtype, zero_stage, dp)
    if zero_stage == 3:  # gathers for forward and backward + gradient reduce-scatter, every micro-batch
        return list(collectives), []
    if zero_stage == 2:  # gradient reduce-scatter every micro-batch, parameter all-gather once
        return (
            [collective for collective in collectives if collective[0] == "reduce_scatter"],
            [collective for collective in collectives if collective[0] != "reduce_scatter"],
        )
    return [], list(collectives)


def _collectives_time(collectives: Sequence[tuple[str, int]], placement: GroupPlacement, hw: HardwareProfile) -> float:
    return sum(float(collective_time(kind, size, placement, hw)) for kind, size in collectives)


def selective_view(layers: Sequence[LayerCost], indices: Sequence[int], selective: frozenset) -> list[LayerCost]:
    """``layers`` (rows ``indices``) as the memory model sees them under selective recompute: a
    selective layer keeps ``saved - sel_saved`` and re-materializes its cores in backward, a
    transient at least ``sel_saved`` (its recompute time is added by the callers)."""
    if not selective:
        return list(layers)
    return [
        layer.but(saved_b=layer.saved_b - layer.sel_saved_b, bt_b=max(layer.bt_b, layer.sel_saved_b))
        if i in selective
        else layer
        for layer, i in zip(layers, indices)
    ]


def check_selective(costs: CandidateCosts, checkpoint: frozenset, selective: frozenset) -> None:
    """Selective layers exist, have attention cores and are not also recomputed whole."""
    n = costs.num_layers
    if any(not 0 <= i < n for i in selective):
        raise ValueError(f"selective layers {sorted(selective)} outside 0..{n - 1}")
    if checkpoint & selective:
        raise ValueError(f"layers {sorted(checkpoint & selective)} are both recomputed whole and selectively")
    bad = sorted(i for i in selective if costs.layers[i].sel_saved_b <= 0)
    if bad:
        raise ValueError(f"layers {bad} have no attention core to recompute selectively")


@dataclass
class StageCost:
    """One pipeline stage's share of a strategy's cost."""

    first: int
    last: int
    compute_s: float
    recompute_s: float
    tp_s: float
    """Exposed tensor-parallel collectives of one micro-batch (recomputed forwards' included; not in ``recompute_s``)."""
    p2p_s: float
    zero_mb_s: float
    work_s: float
    ep_s: float
    """Expert-parallel all-to-alls of one micro-batch (recomputed forwards' included; not in ``recompute_s``)."""
    cp_s: float
    """Exposed context-parallel exchange of one micro-batch (recomputed forwards' included; not in
    ``recompute_s``)."""
    micro_step_s: float
    """``work + zero_mb``: one micro-batch's forward + backward on this stage."""
    dp_s: float
    opt_s: float
    fwd_s: float
    """Forward part of the micro-step, for drawing the schedule (``fwd_s + bwd_s = micro_step_s``)."""
    bwd_s: float
    """Backward part (with recompute) of the micro-step, for drawing the schedule."""
    memory: dict
    """``params, grads, optimizer, activations, total`` in bytes on one device of this stage."""
    comm_bytes: float
    """Bytes one device of this stage sends per step (ring convention)."""
    memory_bound: int = 0
    """The conservative peak feasibility is judged by (what the ILP constrains): every
    transient at once, each ZeRO window filled with the stage's largest layer."""
    offload_mb_s: float = 0.0
    """Exposed offload transfers of one micro-batch (part of ``zero_mb_s``)."""
    offload_step_s: float = 0.0
    """Exposed offload transfers per step (part of ``dp_s``)."""
    host_b: int = 0
    """Host bytes one rank of this stage needs: offloaded state + pinned buffers."""
    nvme_b: int = 0
    """NVMe bytes one rank of this stage needs."""
    warmup_dp_s: float = 0.0
    """``dp_s`` of a full-precision step (a compressed plan's warm-up; else the same)."""
    warmup_opt_s: float = 0.0
    """``opt_s`` of a full-precision step."""
    warmup_contention_s: float = 0.0
    """``dp_contention_s`` of a full-precision step (in ``warmup_dp_s``)."""
    warmup_comm_bytes: float = 0.0
    """``comm_bytes`` of a full-precision step (a compressed plan's warm-up; else the same)."""
    exchange: StageExchange | None = None
    """The stage's compressed exchange (1-bit Adam; None without compression)."""
    tp_hidden_s: float = 0.0
    """TP seconds of one micro-batch hidden under compute (``cost_models.overlap_cost``)."""
    rec_hidden_s: float = 0.0
    """TP seconds of one micro-batch's recomputed forwards hidden under compute."""
    zero_mb_hidden_s: float = 0.0
    """ZeRO 2/3 seconds of one micro-batch hidden under compute."""
    dp_hidden_s: float = 0.0
    """Per-step DP/ZeRO seconds hidden under compute."""
    dp_contention_s: float = 0.0
    """Of ``dp_s``, the compute slowed beside the hidden per-step collectives (reported as compute)."""
    cp_hidden_s: float = 0.0
    """Context-parallel exchange seconds of one micro-batch hidden under the cores' compute."""


@dataclass
class Evaluation:
    """The cost of a strategy: step time, its parts, memory and traffic."""

    strategy: Strategy
    stages: list[StageCost]
    step_time_s: float
    micro_step_s: float
    tail_s: float
    time: dict
    memory: dict
    peak_stage: int
    bottleneck_stage: int
    comm_bytes_per_device: float
    bubble_fraction: float
    feasible: bool
    capacity: float = 0.0
    extra: dict = field(default_factory=dict)


def evaluate(
    costs: CandidateCosts,
    stages: Sequence[Sequence[int]],
    checkpoint: Sequence[int] = (),
    selective: Sequence[int] = (),
) -> Evaluation:
    """Price a strategy of candidate ``costs.cand`` (see the module docstring for every formula)."""
    cand = costs.cand
    micro_batches = cand.num_micro_batches
    ranges = _checked_stages(stages, cand.pp, costs.num_layers)
    checkpointed = frozenset(int(i) for i in checkpoint)
    if any(not 0 <= i < costs.num_layers for i in checkpointed):
        raise ValueError(f"checkpoint layers {sorted(checkpointed)} outside 0..{costs.num_layers - 1}")
    selected = frozenset(int(i) for i in selective)
    check_selective(costs, checkpointed, selected)
    out = [_one_f_one_b_stage(costs, ranges, k, checkpointed, selected) for k in range(cand.pp)]
    critical = critical_stages(out)
    micro_step = max(stage.micro_step_s for stage in out)
    tail = out[critical.tail].dp_s + out[critical.tail].opt_s
    fill = (
        pipeline_time([stage.micro_step_s for stage in out], micro_batches) - micro_batches * micro_step
    )  # the other stages' fill and drain
    bottleneck = out[critical.bottleneck]
    extra, fits = capacity_extra(costs, out, [range(first, last + 1) for first, last in ranges])
    return Evaluation(
        strategy=Strategy(cand, ranges, checkpointed, selective=selected),
        stages=out,
        step_time_s=micro_batches * micro_step + fill + tail,
        micro_step_s=micro_step,
        tail_s=tail,
        time=time_breakdown(out, micro_batches, critical, pp_bubble=fill + micro_batches * bottleneck.p2p_s),
        memory=dict(out[critical.peak].memory),
        peak_stage=critical.peak,
        bottleneck_stage=critical.bottleneck,
        comm_bytes_per_device=max(stage.comm_bytes for stage in out),
        bubble_fraction=fill / (micro_batches * micro_step + fill) if micro_step > 0 else 0.0,
        feasible=fits,
        capacity=costs.capacity,
        extra=extra,
    )


def _checked_stages(stages: Sequence[Sequence[int]], pp: int, num_layers: int) -> tuple[tuple[int, int], ...]:
    """``stages`` as ``pp`` contiguous non-empty ``(first, last)`` ranges covering the layers."""
    ranges = tuple((int(first), int(last)) for first, last in stages)
    if len(ranges) != pp:
        raise ValueError(f"{len(ranges)} stage ranges for pp={pp}")
    expect = 0
    for first, last in ranges:
        if first != expect or last < first:
            raise ValueError(f"stages {ranges} are not contiguous non-empty ranges from layer 0")
        expect = last + 1
    if expect != num_layers:
        raise ValueError(f"stages {ranges} do not cover the {num_layers} layers")
    return ranges


@dataclass(frozen=True)
class StageWork:
    """One stage's layers and the parts of its micro-step that its schedule decides."""

    first: int
    last: int
    layers: Sequence[LayerCost]
    """The stage's layers as the memory model sees them (``selective_view``)."""
    recomputed: Sequence[bool]
    """Per layer, whether it is checkpointed (recomputed whole)."""
    recompute_s: float
    p2p_s: float
    """Stage-to-stage transfers of one micro-batch."""
    sent_b: float
    """Bytes those transfers send."""


def _one_f_one_b_stage(
    costs: CandidateCosts,
    ranges: Sequence[tuple[int, int]],
    stage: int,
    checkpointed: frozenset,
    selected: frozenset,
) -> StageCost:
    """Stage ``stage``'s cost under 1F1B."""
    first, last = ranges[stage]
    indices = range(first, last + 1)
    view = selective_view(costs.layers[first : last + 1], indices, selected)
    recomputed = [i in checkpointed for i in indices]
    recompute_s = sum(layer.rec_s for layer, whole in zip(view, recomputed) if whole) + sum(
        layer.sel_rec_s for i, layer in zip(indices, view) if i in selected
    )
    p2p_s, sent_b = 0.0, 0.0
    if stage < costs.cand.pp - 1:
        p2p_s += costs.send_s(last, stage)
        sent_b += costs.layers[last].boundary_b
    if stage > 0:
        previous = ranges[stage - 1][1]
        p2p_s += costs.send_s(previous, stage - 1)
        sent_b += costs.layers[previous].boundary_b
    # the released order holds where it was measured, one stage (cost_models.memory, "backward
    # order"); a pipeline stage keeps every activation beside its largest transient
    memory, bound = _stage_memory(costs, view, recomputed, stage, released=costs.cand.pp == 1)
    # drawing only: ZeRO-3 gathers once for forward (1/3 of its traffic), the rest is backward
    zero_mb_s = sum(layer.zero_mb_s for layer in view)
    forward_s = sum(layer.fwd_s + layer.tp_fwd_s + layer.ep_fwd_s + layer.cp_fwd_s for layer in view) + (
        zero_mb_s / 3 if costs.cand.zero_stage == 3 else 0.0
    )
    work = StageWork(first, last, view, recomputed, recompute_s, p2p_s, sent_b)
    return stage_cost(costs, work, forward_s, memory, bound)


def _stage_comm_bytes(cand: Candidate, work: StageWork, dp_step_sent_b: float) -> float:
    """Bytes a device of the stage sends per step: every micro-batch's TP, EP and CP traffic (the
    recomputed forwards' again), its transfers and ZeRO traffic, the per-step DP traffic
    (``dp_step_sent_b``, the stage's sum) and the step's control collectives."""
    view = work.layers
    tp_passes = sum(
        layer.tp_sent_b
        + layer.tp_bwd_sent_b
        + layer.ep_sent_b
        + layer.cp_sent_b
        + ((layer.tp_rec_sent_b + layer.ep_rec_sent_b + layer.cp_rec_sent_b) if whole else 0.0)
        for layer, whole in zip(view, work.recomputed)
    )
    return (
        cand.num_micro_batches * (tp_passes + work.sent_b + sum(layer.zero_mb_sent_b for layer in view))
        + dp_step_sent_b
        + step_control_bytes(cand.weight_dp, cand.tp, cand.pp)
    )


#: The layer fields a stage sums over all its layers (:func:`stage_cost`).
_STAGE_SUMS = (
    "compute_s",
    "tp_s",
    "zero_mb_s",
    "dp_step_s",
    "opt_s",
    "warmup_dp_step_s",
    "warmup_dp_contention_s",
    "warmup_opt_s",
    "dp_step_sent_b",
    "warmup_dp_step_sent_b",
    "ep_s",
    "cp_s",
    "offload_mb_s",
    "offload_step_s",
    "host_b",
    "nvme_b",
    "tp_hidden_s",
    "zero_mb_hidden_s",
    "dp_step_hidden_s",
    "dp_contention_s",
    "cp_hidden_s",
)
#: And over its recomputed layers.
_RECOMPUTED_SUMS = ("ep_rec_s", "cp_rec_s", "tp_rec_s", "tp_rec_hidden_s")


def _field_sums(layers: Sequence[LayerCost], names: Sequence[str]) -> dict[str, float]:
    """Each named field summed over ``layers``, in order (what ``sum`` of each gives): the fields
    read once per layer, the columns summed in C."""
    rows = map(operator.attrgetter(*names), layers)
    totals = list(map(sum, zip(*rows))) if layers else [0] * len(names)
    return dict(zip(names, totals))


def stage_cost(costs: CandidateCosts, work: StageWork, forward_s: float, memory: dict, bound: int) -> StageCost:
    """A stage's cost from its layers and schedule-decided parts (``forward_s``: the forward part
    of its micro-step but the transfers, which are split evenly between the two passes)."""
    cand, view = costs.cand, work.layers
    total = _field_sums(view, _STAGE_SUMS)
    # the collectives, all-to-alls and context exchanges of the recomputed forwards are in
    # ``recompute_s`` (``rec_s``); reported as tp_comm, ep_comm and cp_comm (as the runtime times them)
    again = _field_sums([layer for layer, whole in zip(view, work.recomputed) if whole], _RECOMPUTED_SUMS)
    compute, tp_s, zero_mb_s = total["compute_s"], total["tp_s"], total["zero_mb_s"]
    busy = compute + tp_s + work.recompute_s + work.p2p_s + sum(layer.ep_s + layer.cp_s for layer in view)
    comm = _stage_comm_bytes(cand, work, total["dp_step_sent_b"])
    forward_s = forward_s + work.p2p_s / 2
    dp_s, opt_s = total["dp_step_s"], total["opt_s"]
    warmup_dp_s, warmup_opt_s = total["warmup_dp_step_s"], total["warmup_opt_s"]
    warmup_comm = comm - total["dp_step_sent_b"] + total["warmup_dp_step_sent_b"]
    exchange = None
    if cand.compressed:  # the stage's whole vector, exactly, in place of the layers' shares
        exchange = compressed_exchange(costs, view)
        exchange_share, compute_share = shares(exchange.numel, costs.dp_placement, costs.hw)
        dp_s += exchange.exchange_s - exchange_share
        opt_s += exchange.compute_s - compute_share
        comm += exchange.sent_b
        extra_b = int(math.ceil(exchange.error_b)) - sum(
            _error_share_b(layer.compressed_numel, cand.dp) for layer in view
        )
        memory = {**memory, "optimizer": memory["optimizer"] + extra_b, "total": memory["total"] + extra_b}
        bound += extra_b
    else:  # (an uncompressed layer's warm-up contention is its own)
        warmup_dp_s, warmup_opt_s = dp_s, opt_s
    return StageCost(
        first=work.first,
        last=work.last,
        compute_s=compute,
        recompute_s=work.recompute_s - again["ep_rec_s"] - again["cp_rec_s"] - again["tp_rec_s"],
        tp_s=tp_s + again["tp_rec_s"],
        ep_s=total["ep_s"] + again["ep_rec_s"],
        cp_s=total["cp_s"] + again["cp_rec_s"],
        p2p_s=work.p2p_s,
        zero_mb_s=zero_mb_s,
        work_s=busy,
        micro_step_s=busy + zero_mb_s,
        dp_s=dp_s,
        opt_s=opt_s,
        fwd_s=forward_s,
        bwd_s=busy + zero_mb_s - forward_s,
        memory=memory,
        comm_bytes=comm,
        memory_bound=bound,
        offload_mb_s=total["offload_mb_s"],
        offload_step_s=total["offload_step_s"],
        host_b=int(total["host_b"]) + (costs.host_buffers_b if cand.offloads else 0),
        nvme_b=int(total["nvme_b"]),
        warmup_dp_s=warmup_dp_s,
        warmup_opt_s=warmup_opt_s,
        warmup_contention_s=total["warmup_dp_contention_s"],
        warmup_comm_bytes=warmup_comm,
        exchange=exchange,
        tp_hidden_s=total["tp_hidden_s"],
        rec_hidden_s=again["tp_rec_hidden_s"],
        zero_mb_hidden_s=total["zero_mb_hidden_s"],
        dp_hidden_s=total["dp_step_hidden_s"],
        dp_contention_s=total["dp_contention_s"],
        cp_hidden_s=total["cp_hidden_s"],
    )


def compressed_exchange(costs: CandidateCosts, layers: Sequence[LayerCost]) -> StageExchange:
    """The compressed exchange of a stage holding ``layers`` (its whole momentum vector)."""
    return stage_exchange(sum(layer.compressed_numel for layer in layers), costs.dp_placement, costs.hw)


def _warmup_tail_stage(evaluation: Evaluation) -> StageCost:
    return max(evaluation.stages, key=lambda stage: stage.warmup_dp_s + stage.warmup_opt_s)


def warmup_step_s(evaluation: Evaluation) -> float:
    """The step time of a full-precision step of ``evaluation``'s strategy: a compressed plan's
    warm-up step (the same work, the uncompressed tail); the step time itself otherwise."""
    if not evaluation.strategy.candidate.compressed:
        return evaluation.step_time_s
    stage = _warmup_tail_stage(evaluation)
    return evaluation.step_time_s - evaluation.tail_s + stage.warmup_dp_s + stage.warmup_opt_s


def warmup_time(evaluation: Evaluation) -> dict[str, float]:
    """``evaluation.time`` of a full-precision step (``warmup_step_s``'s parts): a compressed
    plan's tail is its exposed exchange (``dp_comm``) and optimizer, swapped for the warm-up's."""
    if not evaluation.strategy.candidate.compressed:
        return dict(evaluation.time)
    tail = max(evaluation.stages, key=lambda stage: stage.dp_s + stage.opt_s)
    stage = _warmup_tail_stage(evaluation)
    contention = stage.warmup_contention_s - tail.dp_contention_s  # the warm-up's reductions overlap
    return {
        **evaluation.time,
        "compute": evaluation.time["compute"] + contention,
        "dp_comm": evaluation.time["dp_comm"] - tail.dp_s + stage.warmup_dp_s - contention,
        "optimizer": stage.warmup_opt_s,
    }


class CriticalStages(NamedTuple):
    """The stages a strategy's totals are read at."""

    bottleneck: int
    """The largest micro-step (paces the pipeline)."""
    tail: int
    """The largest per-step tail: DP/ZeRO traffic + optimizer step."""
    peak: int
    """The largest memory."""


def critical_stages(stages: Sequence[StageCost]) -> CriticalStages:
    indices = range(len(stages))
    return CriticalStages(
        bottleneck=max(indices, key=lambda k: stages[k].micro_step_s),
        tail=max(indices, key=lambda k: stages[k].dp_s + stages[k].opt_s),
        peak=max(indices, key=lambda k: stages[k].memory["total"]),
    )


def time_breakdown(
    stages: Sequence[StageCost], micro_batches: int, critical: CriticalStages, pp_bubble: float
) -> dict[str, float]:
    """plan.json's ``predicted.time``: the bottleneck stage's micro-steps, the tail stage's step
    parts, and the schedule's pipeline overhead (module docstring, "Time breakdown")."""
    busiest, tail = stages[critical.bottleneck], stages[critical.tail]
    return {
        "compute": micro_batches * busiest.compute_s + tail.dp_contention_s,
        "recompute": micro_batches * busiest.recompute_s,
        "tp_comm": micro_batches * busiest.tp_s,
        "pp_bubble": pp_bubble,
        "dp_comm": micro_batches * (busiest.zero_mb_s - busiest.offload_mb_s)
        + tail.dp_s
        - tail.offload_step_s
        - tail.dp_contention_s,
        "optimizer": tail.opt_s,
        "offload": micro_batches * busiest.offload_mb_s + tail.offload_step_s,
        "ep_comm": micro_batches * busiest.ep_s,
        "cp_comm": micro_batches * busiest.cp_s,
    }


def hidden_breakdown(evaluation: "Evaluation") -> dict[str, float]:
    """plan.json's ``predicted.hidden``: per part, the seconds of communication the step hides
    under compute, read at the same stages as ``predicted.time`` (``time_breakdown``):
    ``tp_comm``, ``dp_comm``, ``cp_comm`` (the ring's key/value sends under the cores' compute),
    and ``recompute`` (a recomputed forward's TP collectives)."""
    critical = critical_stages(evaluation.stages)
    busiest, tail = evaluation.stages[critical.bottleneck], evaluation.stages[critical.tail]
    micro_batches = evaluation.strategy.candidate.num_micro_batches
    return {
        "tp_comm": float(micro_batches * busiest.tp_hidden_s),
        "recompute": float(micro_batches * busiest.rec_hidden_s),
        "dp_comm": float(micro_batches * busiest.zero_mb_hidden_s + tail.dp_hidden_s),
        "cp_comm": float(micro_batches * busiest.cp_hidden_s),
    }


def capacity_extra(
    costs: CandidateCosts,
    stages: Sequence[StageCost],
    stage_layers: Sequence[Sequence[int]],
    more: dict | None = None,
) -> tuple[dict, bool]:
    """``Evaluation.extra`` (the memory bound, host and NVMe bytes per node, then ``more``, the
    offloaded bytes by kind, the compile time) and whether the strategy fits the device, host and
    NVMe capacity. ``stage_layers``: the layer indices of each stage."""
    cand = costs.cand
    bound = max(stage.memory_bound for stage in stages)
    host_rank, nvme_rank = max(stage.host_b for stage in stages), max(stage.nvme_b for stage in stages)
    ranks = costs.ranks_per_node
    extra: dict = {"memory_bound": bound, "host_bytes": ranks * host_rank, "nvme_bytes": ranks * nvme_rank}
    extra.update(more or {})
    if cand.offloads:  # by state kind, on the stage with the most host bytes (for the report)
        most = max(range(len(stages)), key=lambda k: (stages[k].host_b, stages[k].nvme_b))
        extra["offload_bytes"] = offload_breakdown(
            [costs.layers[i].num_params for i in stage_layers[most]],
            cand.dp,
            cand.zero_stage,
            costs.dtype,
            cand.offload_optimizer,
            cand.offload_params,
            costs.host_buffers_b,
        )
    fits_offload = (
        host_rank - (costs.host_buffers_b if cand.offloads else 0) <= costs.host_room and nvme_rank <= costs.nvme_room
    )
    if cand.compile:  # once per run: the stage with the most distinct layer classes
        classes = max(len({_layer_class(costs.layers[i]) for i in indices}) for indices in stage_layers)
        extra["compile_s"] = compile_seconds(costs.hw, classes)
    return extra, bound <= costs.capacity and fits_offload


def _layer_class(layer: LayerCost) -> tuple:
    """What tells the generated layer classes apart (one ``torch.compile`` each,
    ``runtime.stages.compile_layers``): the layer's own work and shapes, not where it sits
    (the data-parallel overlap prices blocks at bucket edges apart, their backward's contention
    included, and they share a class)."""
    return (layer.fwd_s, layer.params_b, layer.saved_b, layer.input_b, layer.boundary_b, layer.bt_b)


def pipeline_time(micro_steps: Sequence[float], micro_batches: int) -> float:
    """1F1B's time for ``m`` micro-batches over stages of these micro-step times (fwd + bwd):
    ``(m - 1) max_k T_k + sum_k T_k``: exact for equal stages; never below the schedule simulated
    with unequal ones whose backward/forward ratio is the same, a few percent below it when the
    ratios differ (a stage waits on a slower neighbour's gradient); always at or under the textbook
    ``(m + p - 1) max_k T_k`` (``tests/runtime/test_schedule.py`` checks these against
    ``runtime.contract.schedule_ir.simulate``)."""
    return (micro_batches - 1) * max(micro_steps) + sum(micro_steps)


def memory_bound(evaluation: Evaluation) -> int:
    """The conservative peak an evaluation's feasibility is judged by (the ILP's memory)."""
    return int(evaluation.extra.get("memory_bound", evaluation.memory["total"]))


def _stage_memory(
    costs: CandidateCosts,
    layers: Sequence[LayerCost],
    recomputed: Sequence[bool],
    stage: int,
    inflight: float | None = None,
    released: bool = False,
) -> tuple[dict, int]:
    """One stage's predicted peak (``params, grads, optimizer, activations, total``) and its
    conservative bound (see ``cost_models.memory``: "Backward transients"). ``inflight``: the
    micro-batches of the stage's activations held at once when the schedule is not 1F1B
    (``cost_models.schedule_cost``). ``released``: a layer's backward frees what it saved, so
    an earlier layer's backward does not meet it; False: the peak is taken with every activation
    alive (a split backward, zero bubble's ``W``, keeps the weight products' inputs until it runs,
    and a pipeline stage's measured peak under 1F1B was above the released order's)."""
    cand = costs.cand
    pp, micro_batches, zero_stage, dp = cand.pp, cand.num_micro_batches, cand.zero_stage, cand.weight_dp
    leave = buckets_leave(zero_stage, dp, cand.offload_optimizer)

    def acts(transient: float) -> float:
        return float(
            stage_activation_bytes(
                [layer.saved_b for layer in layers],
                [layer.input_b for layer in layers],
                recomputed,
                stage,
                pp,
                micro_batches,
                transient_peak=transient,
                inflight=inflight,
            )
        )

    max_transient = max(layer.bt_b for layer in layers)
    params = sum(layer.params_b for layer in layers)
    grads = sum(layer.grads_b for layer in layers)
    optim = sum(layer.optimizer_b for layer in layers)
    zero_buffers = zero_transient_bytes(
        [layer.num_params for layer in layers], costs.dtype, zero_stage, dp, cand.offload_optimizer, cand.offload_params
    )
    # Each layer j's backward, in backward order: the micro-batches in flight hold all their
    # activations but the one running backward, which holds only what layers 0..j saved (autograd
    # freed the later layers' as their backward ran, when ``released``) and j's own transient. (a)
    # every such moment before any ZeRO-2/3 reduction is launched; (b) with the reductions of j and
    # the layers after it in flight. With one micro-batch per step a ZeRO-2/3 gradient shard exists
    # only once its layer's backward has run (``shards_later``: the runtime allocates it at its
    # first reduction and frees it after the step).
    shards_later = leave and micro_batches == 1
    held = inflight_microbatches(stage, pp, micro_batches) if inflight is None else inflight
    keep = [layer.input_b if whole else layer.saved_b for layer, whole in zip(layers, recomputed)]
    red = [reduction_bytes(layer.num_params, costs.dtype, dp) for layer in layers] if leave else []
    state = params + zero_buffers["params"] + optim  # what every moment holds beside grads and activations
    peak = (-math.inf, 0.0, 0.0)  # (total, grads, activations) of the first largest moment

    def moment(held_grads: float, activations: float) -> None:
        nonlocal peak
        total = state + held_grads + activations
        if total > peak[0]:
            peak = (total, held_grads, activations)

    if not released:  # the largest transient with every activation alive
        moment(0 if shards_later else grads, acts(max_transient))
    others = (held - 1) * sum(keep)  # the other micro-batches in flight, whole
    shards_after = grads  # the shards of the layers after j (all of them before the loop)
    for j, (layer, kept) in enumerate(zip(layers, itertools.accumulate(keep))):
        shards_after -= layer.grads_b
        running = others + kept + max(layer.bt_b, layer.saved_b if recomputed[j] else 0.0)
        if released:
            moment(0 if shards_later else grads, running)
        if leave and j < len(layers) - 1:
            shards = shards_after if shards_later and released else grads
            moment(shards + sum(red[j : j + REDUCTIONS_IN_FLIGHT + 1]), running)
    parts = {"params": params + zero_buffers["params"], "optimizer": optim, "grads": peak[1], "activations": peak[2]}
    mem = {key: int(math.ceil(value)) for key, value in parts.items()}
    mem["total"] = sum(mem.values())
    big = max(layers, key=lambda layer: layer.trans_b)
    bound = params + grads + optim + big.trans_b + acts(max_transient)
    return mem, int(math.ceil(bound))


def predicted_fields(evaluation: Evaluation, flops_per_step: float, gpus: int, peak_flops: float) -> dict:
    """plan.json's ``predicted`` block for an evaluation (model FLOPs: recompute excluded)."""
    tflops = flops_per_step / evaluation.step_time_s / gpus / 1e12 if evaluation.step_time_s > 0 else 0.0
    return {
        "step_time_s": float(evaluation.step_time_s),
        "peak_memory_bytes": int(evaluation.memory["total"]),
        "tflops_per_device": float(tflops),
        "mfu": float(tflops * 1e12 / peak_flops),
        "comm_bytes_per_device": float(evaluation.comm_bytes_per_device),
        "bubble_fraction": float(evaluation.bubble_fraction),
        "memory": {
            **{k: int(value) for k, value in evaluation.memory.items()},
            "host": int(evaluation.extra.get("host_bytes", 0)),
            "nvme": int(evaluation.extra.get("nvme_bytes", 0)),
        },
        "time": {k: float(value) for k, value in evaluation.time.items()},
        "hidden": hidden_breakdown(evaluation),
        "compression": compression_fields(evaluation),
    }


def compression_fields(evaluation: Evaluation) -> dict | None:
    """plan.json's ``predicted.compression`` (None without compression): the full-precision
    warm-up step and the compressed exchange of the tail stage (``cost_models.compression_cost``)."""
    if not evaluation.strategy.candidate.compressed:
        return None
    exchange = evaluation.stages[critical_stages(evaluation.stages).tail].exchange
    assert exchange is not None
    return {
        "warmup_step_time_s": float(warmup_step_s(evaluation)),
        "warmup_time": {k: float(value) for k, value in warmup_time(evaluation).items()},
        "warmup_comm_bytes_per_device": float(max(stage.warmup_comm_bytes for stage in evaluation.stages)),
        "exchange_bytes_per_device": exchange.sent_b,
        "exchange_s": float(exchange.exchange_s),
        "compute_s": float(exchange.compute_s),
        "error_buffer_bytes": int(math.ceil(exchange.error_b)),
        "warmup_peak_memory_bytes": warmup_peak_bytes(evaluation),
    }


def warmup_peak_bytes(evaluation: Evaluation) -> int:
    """The peak memory of a compressed plan's full-precision warm-up. The runtime allocates the
    error buffers at the first compressed step and, at ZeRO-1, gathers the optimizer state it
    sharded over dp until then (the compressed steps keep stage 0's): each stage holds its error
    buffers less, and at ZeRO-1 all but a ``1/dp`` share of the rest of its optimizer state."""
    cand = evaluation.strategy.candidate
    stages = evaluation.stages

    def warm(stage: StageCost) -> float:
        error = math.ceil(stage.exchange.error_b) if stage.exchange else 0
        state = stage.memory["optimizer"] - error
        sharded = state - state / cand.weight_dp if cand.zero_stage == 1 else 0.0
        return stage.memory["total"] - error - sharded

    top = max(stage.memory["total"] for stage in stages)
    return int(evaluation.memory["total"] - top + max(warm(stage) for stage in stages))
