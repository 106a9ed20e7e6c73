"""The Plan: the planner's output, ``plan.json`` (schema_version 1), loaded back with validation.

Every field of the contract in ``shared/CONVENTIONS.md`` is here with its meaning. ``Plan``
checks its invariants in ``__post_init__`` (``dp*cp*tp*pp == gpus``, ``global_batch == dp *
micro_batch_size * num_micro_batches``, contiguous stages covering the layer table, ...), so a
plan that exists is a plan the runtime can run. ``load_plan`` turns any malformed file into a
``PlanError`` that names the field and what it should be.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, NoReturn

from planner.errors import UserError
from runtime.contract.choices import ZERO_STAGES, ContextMethod, GradCompression, OffloadTier, ScheduleName, names
from runtime.contract.data_roles import INPUT_ROLES
from runtime.contract.dtype_table import DTYPES
from runtime.contract.input_errors import ConfigError
from runtime.contract.overlap import OVERLAP_ALL, Overlap

__all__ = [
    "Plan",
    "ModelInfo",
    "HardwareInfo",
    "Predicted",
    "SolverInfo",
    "Alternative",
    "PlanError",
    "load_plan",
    "save_plan",
    "SCHEMA_VERSION",
    "MEMORY_KEYS",
    "TIME_KEYS",
    "LATER_TIME_KEYS",
    "MOE_KEYS",
    "OFFLOAD_TIERS",
    "OFFLOAD_KINDS",
    "HOST_MEMORY_KEYS",
    "NO_OFFLOAD",
    "COST_KEYS",
    "SCHEDULES",
    "TIME_LABELS",
    "COMPRESSIONS",
    "CP_METHODS",
    "NO_CONTEXT_PARALLEL",
    "plan_hash",
    "output_problem",
    "check_plan_out",
]

SCHEMA_VERSION = 1
MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "total")
MOE_KEYS = ("layers", "experts", "top_k", "shared_experts", "capacity_factor")
"""plan.json ``model.moe``'s keys (an empty object for a dense model)."""
COST_KEYS = ("tokens", "days", "gpu_hours", "money", "by_part")
SCHEDULES = names(ScheduleName)
"""The pipeline schedules a plan may name (plan.json ``schedule``)."""

COMPRESSIONS = names(GradCompression)
"""The data-parallel exchanges a plan may name (plan.json ``dp_compression``)."""
TIME_KEYS = ("compute", "recompute", "tp_comm", "pp_bubble", "dp_comm", "optimizer", "offload", "ep_comm", "cp_comm")
LATER_TIME_KEYS = ("offload", "ep_comm", "cp_comm")
"""Time parts added after the first plans: a plan written before one existed loads it as 0 s."""
OFFLOAD_TIERS = names(OffloadTier)
OFFLOAD_KINDS = ("optimizer", "params")
HOST_MEMORY_KEYS = ("host", "nvme")
"""``predicted.memory`` keys beyond the device's: bytes per node in host memory and NVMe files (0
without offload; a plan written before them loads with 0)."""
TIME_LABELS = {
    "compute": "compute (forward + backward)",
    "recompute": "recompute (checkpointed layers)",
    "tp_comm": "TP collectives",
    "pp_bubble": "pipeline bubble + stage transfers",
    "dp_comm": "DP / ZeRO communication",
    "optimizer": "optimizer step",
    "offload": "offload transfers (host / NVMe)",
    "ep_comm": "expert-parallel all-to-alls",
    "cp_comm": "context-parallel attention exchange",
}
"""What each ``predicted.time`` key means, as the report and the runners-up say it."""


CP_METHODS = names(ContextMethod)
"""How a context-parallel group computes attention (plan.json ``context_parallel.method``)."""
NO_CONTEXT_PARALLEL = {"degree": 1, "method": "ring"}
"""plan.json's ``context_parallel`` without context parallelism (and what a plan without the key loads as)."""

NO_OFFLOAD = {"optimizer": "none", "params": "none"}
"""plan.json's ``offload`` when every state lives on the device (and what a plan without the key loads as)."""


class PlanError(UserError):
    """A plan.json that is missing, unreadable or breaks the schema (the message names the field)."""


def _fail(where: str, msg: str) -> NoReturn:
    raise PlanError(f"plan: {where} {msg}")


def _check_int(where: str, value: Any, least: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(where, f"must be an integer, got {value!r}.")
    if least is not None and value < least:
        _fail(where, f"must be >= {least}, got {value}.")


def _check_num(where: str, value: Any, least: float | None = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(where, f"must be a finite number, got {value!r}.")
    if least is not None and value < least:
        _fail(where, f"must be >= {least}, got {value}.")


def _check_str(where: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        _fail(where, f"must be a non-empty string, got {value!r}.")


@dataclass
class ModelInfo:
    """What was planned: enough to rebuild the model without the original command line."""

    spec: str
    """Model spec as given to ``--model`` (``gpt2``, ``hf:llama``, ``file.py:factory`` ...)."""
    params: int
    """Total parameter count."""
    layers: int
    """Number of transformer blocks L (the layer table has L + 2 rows)."""
    flops_per_step: float
    """Forward + backward FLOPs of one global batch (without recompute)."""
    sizes: dict = field(default_factory=dict)
    """Size overrides used to build the model (``layers``, ``hidden``, ``heads`` ...)."""
    layer_names: list = field(default_factory=list)
    """Module path of each layer-table row (index 0 = pre, L + 1 = post)."""
    inputs: list = field(default_factory=list)
    """The model's inputs in order, each ``{name, role, dtype, shape, vocab}``: what training feeds
    it (``role``: tokens, labels, targets, ones, zeros or positions; see ``passes.inputs``), its
    sizes (``"b"``, ``"s"`` or a number) and the ids it can index. Empty in plans written before
    it existed: such a model takes ``(tokens, targets)``."""
    attention: dict = field(default_factory=dict)
    """The attention's mask (``passes.mask_density.summarize``): ``mask`` (full, causal, sliding,
    custom), ``window`` (sliding, else null), ``density`` (the share of the square the masks keep,
    mean over blocks, at ``seq_len``), ``per_layer`` (when blocks differ), ``priced`` (time and
    FLOPs follow the density: the kernel skips the masked pairs), ``reason`` (why not) and
    ``saved_flops`` (per step, vs the full square). Empty without attention or in older plans."""
    moe: dict = field(default_factory=dict)
    """The mixture-of-experts layers the graph holds: ``layers`` (layer-table rows with routed
    experts), ``experts`` (routed experts per layer), ``top_k`` (experts each token goes to),
    ``shared_experts`` (experts every token goes to) and ``capacity_factor`` (tokens an expert
    takes, as a multiple of its even share; null = dropless). Empty for a dense model or an older
    plan."""

    def __post_init__(self):
        _check_str("model.spec", self.spec)
        _check_int("model.params", self.params, 0)
        _check_int("model.layers", self.layers, 0)
        _check_num("model.flops_per_step", self.flops_per_step)
        if not isinstance(self.sizes, dict):
            _fail("model.sizes", "must be an object.")
        for k, size in self.sizes.items():
            _check_int(f"model.sizes.{k}", size, 1)
        if not isinstance(self.layer_names, list) or not all(isinstance(n, str) for n in self.layer_names):
            _fail("model.layer_names", "must be a list of strings.")
        if not isinstance(self.inputs, list):
            _fail("model.inputs", "must be a list of objects.")
        for i, x in enumerate(self.inputs):
            if not isinstance(x, dict) or not {"name", "role", "dtype", "shape"} <= set(x):
                _fail(f"model.inputs[{i}]", "must be an object with name, role, dtype and shape.")
            _check_str(f"model.inputs[{i}].name", x["name"])
            if x["role"] not in INPUT_ROLES:
                _fail(f"model.inputs[{i}].role", f"must be one of {', '.join(INPUT_ROLES)}, got {x['role']!r}.")
            _check_int(f"model.inputs[{i}].vocab", x.get("vocab", 0), 0)
        if not isinstance(self.attention, dict):
            _fail("model.attention", "must be an object.")
        if self.attention and not {"mask", "window", "density"} <= set(self.attention):
            _fail("model.attention", "must hold mask, window and density.")
        self._check_moe()

    def _check_moe(self) -> None:
        if not isinstance(self.moe, dict):
            _fail("model.moe", "must be an object.")
        if not self.moe:
            return
        missing = [k for k in MOE_KEYS if k not in self.moe]
        if missing:
            _fail("model.moe", f"is missing {missing}.")
        if not isinstance(self.moe["layers"], list):
            _fail("model.moe.layers", "must be a list of layer-table rows.")
        for i, row in enumerate(self.moe["layers"]):
            _check_int(f"model.moe.layers[{i}]", row, 0)
        _check_int("model.moe.experts", self.moe["experts"], 1)
        _check_int("model.moe.top_k", self.moe["top_k"], 1)
        _check_int("model.moe.shared_experts", self.moe["shared_experts"], 0)
        if self.moe["capacity_factor"] is not None:
            _check_num("model.moe.capacity_factor", self.moe["capacity_factor"])
            if self.moe["capacity_factor"] <= 0:
                _fail("model.moe.capacity_factor", "must be positive, or null for dropless routing.")


@dataclass
class HardwareInfo:
    """The cluster planned for."""

    name: str
    """Hardware kind (``a100-80gb`` ...) or the path of a profile JSON."""
    gpus: int
    """Total devices."""
    gpus_per_node: int
    """Devices per node; tensor-parallel groups stay inside a node by default."""

    def __post_init__(self):
        _check_str("hardware.name", self.name)
        _check_int("hardware.gpus", self.gpus, 1)
        _check_int("hardware.gpus_per_node", self.gpus_per_node, 1)


@dataclass
class Predicted:
    """The cost model's prediction for the chosen strategy (per device, per step)."""

    step_time_s: float
    peak_memory_bytes: int
    """Bytes on the most loaded device; equals ``memory['total']``."""
    tflops_per_device: float
    mfu: float
    """Model FLOPs utilization: model FLOPs per second per device / peak FLOP/s."""
    comm_bytes_per_device: float
    """Bytes one device sends per step (ring convention)."""
    bubble_fraction: float
    """Idle fraction of the 1F1B schedule: (sum_k T_k - T) / (m T + sum_k T_k - T) for stage
    micro-steps T_k, T their maximum; (p - 1) / (m + p - 1) when the stages are equal."""
    memory: dict
    """Bytes by kind on the most loaded device: params, grads, optimizer, activations, total (the
    device peak); and per node: host (host memory for offloaded state and its pinned buffers),
    nvme (bytes in NVMe files)."""
    time: dict
    """Seconds by part: compute, recompute, tp_comm, pp_bubble, dp_comm, optimizer (the AdamW step
    wherever it runs: on the host's cores when the optimizer is offloaded), offload (transfers to
    and from host memory and NVMe that no compute hides)."""
    cost: dict | None = None
    """What the whole training run costs (``plan --tokens N``; absent otherwise): ``tokens``,
    ``days``, ``gpu_hours``, ``money`` (``None`` without ``--price-per-gpu-hour``) and ``by_part``
    (the money, or the GPU-hours without a price, of each ``time`` part); see
    ``cost_models.run_cost``. With 1-bit Adam its ``compression_warmup`` steps are priced at
    ``compression.warmup_step_time_s``, the others at ``step_time_s``."""
    compression: dict | None = None
    """With ``dp_compression`` other than none (absent otherwise): the full-precision warm-up step,
    ``warmup_step_time_s`` and its ``warmup_time`` by part (the step fields above are the steady,
    compressed step after the warm-up), ``warmup_comm_bytes_per_device`` (what the exchange sends in
    full precision; ``comm_bytes_per_device`` is the compressed exchange's), and the compressed
    step's ``exchange_bytes_per_device``, ``exchange_s`` (its collectives), ``compute_s`` (the
    compression's passes) and ``error_buffer_bytes`` (in ``memory.optimizer``), on the tail stage;
    ``warmup_peak_memory_bytes``, the peak before the first compressed step allocates the error
    buffers (absent from plans written before it)."""
    hidden: dict = field(default_factory=dict)
    """Seconds of communication hidden under compute, by ``time`` part (``tp_comm``, ``dp_comm``):
    what the plan's ``overlap`` hides (``cost_models.overlap_cost``); ``time`` holds only the
    exposed rest, so the ``time`` parts still sum to the step. Plans written before it load as ``{}``."""

    def __post_init__(self):
        # plans written before offload existed: no host / NVMe bytes, no offload time
        if isinstance(self.memory, dict):
            self.memory = {**self.memory, **{k: self.memory.get(k, 0) for k in HOST_MEMORY_KEYS}}
        if isinstance(self.time, dict):
            self.time = {**self.time, **{k: self.time.get(k, 0.0) for k in LATER_TIME_KEYS}}
        if isinstance(self.cost, dict) and isinstance(self.cost.get("by_part"), dict):
            by_part = self.cost["by_part"]
            self.cost = {**self.cost, "by_part": {**by_part, **{k: by_part.get(k, 0.0) for k in LATER_TIME_KEYS}}}
        for k in ("step_time_s", "tflops_per_device", "mfu", "comm_bytes_per_device", "bubble_fraction"):
            _check_num(f"predicted.{k}", getattr(self, k))
        _check_int("predicted.peak_memory_bytes", self.peak_memory_bytes, 0)
        for name, keys in (("memory", MEMORY_KEYS), ("time", TIME_KEYS)):
            parts = getattr(self, name)
            if not isinstance(parts, dict):
                _fail(f"predicted.{name}", "must be an object.")
            missing = [k for k in keys if k not in parts]
            if missing:
                _fail(f"predicted.{name}", f"is missing {missing}.")
            for k, amount in parts.items():
                _check_num(f"predicted.{name}.{k}", amount)
        if self.cost is not None:
            _check_run_cost(self.cost)
        if not isinstance(self.hidden, dict):
            _fail("predicted.hidden", "must be an object of seconds by time part.")
        for k, amount in self.hidden.items():
            if k not in TIME_KEYS:
                _fail("predicted.hidden", f"has unknown part {k!r}; parts are {list(TIME_KEYS)}.")
            _check_num(f"predicted.hidden.{k}", amount)
        if self.compression is not None:
            if not isinstance(self.compression, dict):
                _fail("predicted.compression", "must be an object.")
            _check_num("predicted.compression.warmup_step_time_s", self.compression.get("warmup_step_time_s"))
        if self.memory["total"] != self.peak_memory_bytes:
            _fail(
                "predicted.memory.total",
                f"({self.memory['total']}) must equal predicted.peak_memory_bytes ({self.peak_memory_bytes}).",
            )


def _check_run_cost(cost: Any) -> None:
    if not isinstance(cost, dict):
        _fail("predicted.cost", "must be an object.")
    missing = [k for k in COST_KEYS if k not in cost]
    if missing:
        _fail("predicted.cost", f"is missing {missing}.")
    for k in ("tokens", "days", "gpu_hours"):
        _check_num(f"predicted.cost.{k}", cost[k])
    if cost["money"] is not None:
        _check_num("predicted.cost.money", cost["money"])
    parts = cost["by_part"]
    if not isinstance(parts, dict) or [k for k in TIME_KEYS if k not in parts]:
        _fail("predicted.cost.by_part", f"must be an object with the keys of predicted.time {list(TIME_KEYS)}.")
    for k, amount in parts.items():
        _check_num(f"predicted.cost.by_part.{k}", amount)


@dataclass
class SolverInfo:
    name: str
    """Solver used (``enumerate``, ``pulp-cbc``, ``pulp-highs``)."""
    seconds: float
    status: str
    candidates: int
    """Strategies evaluated."""

    def __post_init__(self):
        _check_str("solver.name", self.name)
        _check_num("solver.seconds", self.seconds)
        _check_str("solver.status", self.status)
        _check_int("solver.candidates", self.candidates, 0)


@dataclass
class Alternative:
    """A runner-up strategy and why it lost."""

    dp: int
    tp: int
    pp: int
    zero_stage: int
    micro_batch_size: int
    step_time_s: float
    reason: str
    offload: dict = field(default_factory=lambda: dict(NO_OFFLOAD))
    """Where the runner-up keeps its state (as the plan's ``offload``); written only when some state
    is off the device, so absent means none/none."""
    sequence_parallel: bool = False
    """The runner-up uses sequence parallelism; written only when true."""
    dp_compression: str = "none"
    """The runner-up's data-parallel exchange (as the plan's); written only when not none."""
    schedule: str = "1f1b"
    """The runner-up's pipeline schedule (as the plan's); written only when not 1F1B."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank of an interleaved runner-up; written only when above 1."""
    expert_parallel: int = 1
    """The runner-up's expert-parallel degree (as the plan's); written only when above 1."""
    context_parallel: dict = field(default_factory=lambda: dict(NO_CONTEXT_PARALLEL))
    """The runner-up's context parallelism (as the plan's); written only when its degree is above 1."""

    def __post_init__(self):
        for k in ("dp", "tp", "pp", "micro_batch_size", "virtual_stages", "expert_parallel"):
            _check_int(f"alternatives[].{k}", getattr(self, k), 1)
        _check_int("alternatives[].zero_stage", self.zero_stage, 0)
        _check_offload(self.offload, self.zero_stage)
        self.offload = {k: self.offload[k] for k in OFFLOAD_KINDS}
        _check_num("alternatives[].step_time_s", self.step_time_s)
        if self.dp_compression not in COMPRESSIONS:
            _fail(
                "alternatives[].dp_compression",
                f"must be one of {', '.join(COMPRESSIONS)}, got {self.dp_compression!r}.",
            )
        _check_str("alternatives[].reason", self.reason)
        self.context_parallel = _checked_context_parallel("alternatives[].context_parallel", self.context_parallel)
        if self.schedule not in SCHEDULES:
            _fail("alternatives[].schedule", f"must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}.")


@dataclass
class Plan:
    """A complete parallelization strategy (the contents of plan.json)."""

    model: ModelInfo
    hardware: HardwareInfo
    global_batch: int
    """Sequences per optimizer step, over all data-parallel ranks and micro-batches."""
    seq_len: int
    dtype: str
    """Compute dtype: bf16, fp16 (with a dynamic loss scaler) or fp32."""
    dp: int
    """Data-parallel degree."""
    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline-parallel degree (number of stages)."""
    zero_stage: int
    """0: replicated; 1: shard optimizer state; 2: + gradients; 3: + parameters."""
    micro_batch_size: int
    """Sequences per micro-batch on one data-parallel rank."""
    num_micro_batches: int
    """Micro-batches per step per data-parallel rank (gradient accumulation / pipeline depth)."""
    stages: list
    """``[[first, last], ...]``: inclusive layer-table indices of each pipeline stage."""
    checkpoint_layers: list
    """Layer-table indices whose activations are recomputed in backward."""
    predicted: Predicted
    solver: SolverInfo
    alternatives: list = field(default_factory=list)
    compile: bool = False
    """Run each generated layer class under ``torch.compile`` (``runtime.stages.compile_layers``): chosen
    by the search when the per-step saving it prices (operator overhead, fused memory-bound ops)
    repays the compile time over the run, or pinned by ``planner plan --compile on|off``. A plan
    written before the field existed loads as ``false``. Not part of ``plan_hash``: the compiled
    source and its math are the same either way, so checkpoints resume across it."""
    offload: dict = field(default_factory=lambda: dict(NO_OFFLOAD))
    """Where state lives off the device: ``{"optimizer": tier, "params": tier}``, each tier ``none``
    (on the device), ``cpu`` (host memory) or ``nvme`` (files under ``train --nvme-path``). An
    offloaded optimizer keeps the fp32 master weights, the Adam moments and the gradient
    accumulator of the rank's shard off the device and runs AdamW on the host (needs ZeRO 1, 2 or
    3); offloaded parameters keep the rank's parameter shard off the device, fetched layer by layer
    (needs ZeRO 3). Chosen by the search where it pays (``cost_models.offload_cost``), or pinned by
    ``--offload-optimizer`` / ``--offload-params``. A plan without the key loads as none/none."""
    schedule: str = "1f1b"
    """The pipeline schedule (``runtime.contract.schedule_ir``): ``1f1b``; ``interleaved`` (Megatron's
    interleaved 1F1B over ``virtual_stages`` model chunks per pipeline rank); ``zero-bubble``
    (ZB-H1: backward split into input- and weight-gradient work, the weight gradients filling the
    bubble). A plan without the key loads as ``1f1b``."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (``v``): 1 unless ``schedule`` is ``interleaved``. With v > 1,
    ``stages`` lists the ``pp * v`` chunks in model order and chunk ``c`` runs on pipeline rank
    ``c % pp``."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism in the tensor-parallel regions (needs tp >= 2): the work outside
    the column/row-parallel matmuls (norms, residual adds, dropout, the embedding's output) runs on
    ``seq_len / tp`` of the sequence on each tp rank; the all-reduce that ends a row-parallel matmul
    becomes a reduce-scatter along the sequence and the input of a column-parallel matmul is
    all-gathered (the same bytes), so those activations shrink by tp. A plan without the key loads
    as ``false``."""
    selective_layers: list = field(default_factory=list)
    """Layer-table indices whose attention core (``q k^T``, softmax, dropout, ``@ v``) is
    recomputed in backward while the rest of the layer keeps its activations (selective recompute);
    disjoint from ``checkpoint_layers``, the layers recomputed whole. A plan without the key loads
    as ``[]``."""
    dp_compression: str = "none"
    """How the data-parallel exchange is encoded: ``none`` (gradients all-reduced in full precision)
    or ``onebit-adam`` (1-bit Adam: after ``compression_warmup`` full-precision steps, each rank's
    momentum exchanged as packed signs and scales, ``runtime.contract.compressed_exchange``; needs
    dp > 1, ZeRO 0 or 1 and no offload). Chosen by the search where it shortens the run, or pinned
    by ``planner plan --dp-compression``. A plan without the key loads as ``none``."""
    compression_warmup: int = 0
    """Full-precision AdamW steps before compression starts: ``default_warmup`` (15%) of the run's
    steps (``--tokens``, else 1,000) when compressed; 0 without compression (``planner train
    --compression-warmup N`` overrides it). A plan without the key loads as 0."""
    expert_parallel: int = 1
    """Ranks of each data-parallel group that share one layer's routed experts (EP): each holds
    ``experts / expert_parallel`` of them and tokens reach their experts by all-to-all; 1 = every
    rank holds every expert. Divides ``dp`` and ``model.moe.experts``; the expert-data-parallel
    group (the ranks holding the same experts, ``dp / expert_parallel`` of them) reduces the
    experts' gradients (``runtime.contract.rank_layout.expert_ranks``). A plan without the key loads as 1."""
    context_parallel: dict = field(default_factory=lambda: dict(NO_CONTEXT_PARALLEL))
    """Context parallelism, ``{"degree": cp, "method": m}``: every sequence split over ``cp`` ranks
    (its own mesh axis, between tp and dp: ``gpus = dp * cp * tp * pp``), each holding chunks ``i``
    and ``2cp-1-i`` of ``2cp`` (balanced causal work, ``runtime.context_parallel.layout``); attention
    by ``method`` (``ring``, ``all-gather`` or ``ulysses``: ``runtime.contract.choices.ContextMethod``),
    everything else on the rank's own positions. Gradients are reduced (and ZeRO state sharded) over
    the ``dp * cp`` ranks holding the same weights. ``seq_len`` divides into ``2 cp`` chunks. A plan
    without the key loads as ``{"degree": 1, "method": "ring"}``."""
    overlap: dict = field(default_factory=OVERLAP_ALL.to_json)
    """What the run overlaps with compute and the prediction assumed, ``{"dp", "tp", "pp"}``
    booleans (``runtime.contract.overlap``): all true by default; ``planner plan --overlap off``
    prices a run launched with ``train --overlap off``. A plan without the key loads as all true."""
    measured: dict | None = None
    """What ``planner tune`` measured running this plan (absent from other plans):
    ``step_time_s`` and ``peak_memory_bytes`` (medians / max over ranks, as ``validate``), and
    ``trials``, one object per candidate tune ran (its degrees, what it measured or why it failed)."""
    request: dict | None = None
    """The request the plan was made from (``planner.search.request.PlanRequest.to_record``: the
    model spec and sizes, batch, sequence length, dtype, hardware, devices per node and every pin),
    enough to plan again for another device count (``planner train --elastic``). Absent from
    hand-made plans and plans written before it existed: those cannot be re-planned."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        self._check_version()
        self._check_degrees_and_batch()
        self._check_schedule()
        self._check_stages()
        self._check_recompute()
        if not isinstance(self.compile, bool):
            _fail("compile", f"must be true or false, got {self.compile!r}.")
        _check_offload(self.offload, self.zero_stage)
        try:
            self.overlap = Overlap.from_json(self.overlap).to_json()
        except ConfigError as e:
            _fail("overlap", str(e))
        self.offload = {kind: self.offload[kind] for kind in OFFLOAD_KINDS}
        self._check_compression()
        self._check_expert_parallel()
        self.context_parallel = _checked_context_parallel("context_parallel", self.context_parallel)
        self._check_context_parallel()
        self._check_measured()
        if self.request is not None and not (isinstance(self.request, dict) and "spec" in self.request):
            _fail("request", "must be an object holding the planning request (spec, gpus, ...).")
        if self.pp > 1 and self.num_micro_batches < self.pp:
            _fail(
                "num_micro_batches",
                f"({self.num_micro_batches}) must be >= pp ({self.pp}) for a 1F1B "
                "pipeline; use more micro-batches or fewer stages.",
            )

    @property
    def _layer_rows(self) -> int:
        """Rows of the layer table: pre, the L blocks, post."""
        return self.model.layers + 2

    def _check_version(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            _fail(
                "schema_version",
                f"is {self.schema_version!r}; this planner reads {SCHEMA_VERSION}. "
                "Re-run `planner plan` to produce a current plan.",
            )

    def _check_degrees_and_batch(self) -> None:
        """The sizes are positive, the ZeRO stage and dtype known, ``dp*tp*pp == gpus`` and
        ``global_batch == dp * micro_batch_size * num_micro_batches``."""
        for name in ("global_batch", "seq_len", "dp", "tp", "pp", "micro_batch_size", "num_micro_batches"):
            _check_int(name, getattr(self, name), 1)
        _check_int("zero_stage", self.zero_stage, 0)
        if self.zero_stage not in ZERO_STAGES:
            _fail("zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}.")
        if self.dtype not in DTYPES:
            _fail("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        cp = _checked_context_parallel("context_parallel", self.context_parallel)["degree"]
        if self.dp * cp * self.tp * self.pp != self.hardware.gpus:
            name, sizes = (
                ("dp*tp*pp", f"{self.dp}*{self.tp}*{self.pp}")
                if cp == 1
                else ("dp*cp*tp*pp", f"{self.dp}*{cp}*{self.tp}*{self.pp}")
            )
            _fail(
                name, f"= {sizes} = {self.dp * cp * self.tp * self.pp} must equal hardware.gpus = {self.hardware.gpus}."
            )
        if self.dp * self.micro_batch_size * self.num_micro_batches != self.global_batch:
            _fail(
                "global_batch",
                f"({self.global_batch}) must equal dp * micro_batch_size * "
                f"num_micro_batches = {self.dp}*{self.micro_batch_size}*{self.num_micro_batches}.",
            )

    def _check_schedule(self) -> None:
        """A known schedule; model chunks only on an interleaved pipeline, whose micro-batches go
        round the ranks in groups of pp."""
        if self.schedule not in SCHEDULES:
            _fail("schedule", f"must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}.")
        _check_int("virtual_stages", self.virtual_stages, 1)
        if self.virtual_stages > 1 and (self.schedule != ScheduleName.INTERLEAVED or self.pp < 2):
            _fail(
                "virtual_stages",
                f"is {self.virtual_stages}: more than one model chunk per rank needs "
                f"the interleaved schedule and pp >= 2 (schedule {self.schedule!r}, pp {self.pp}).",
            )
        if self.schedule == ScheduleName.INTERLEAVED and self.num_micro_batches % self.pp:
            _fail(
                "num_micro_batches",
                f"({self.num_micro_batches}) must be a multiple of pp ({self.pp}) for "
                "the interleaved schedule (its micro-batches go round the ranks in groups of pp).",
            )

    def _check_stages(self) -> None:
        """One ``[first, last]`` pair per model chunk, contiguous, covering the layer table."""
        chunks = self.pp * self.virtual_stages
        if not isinstance(self.stages, list) or len(self.stages) != chunks:
            _fail(
                "stages",
                f"must list one [first, last] pair per pipeline stage ({self.pp})"
                + (f" and model chunk: pp * virtual_stages = {chunks}." if self.virtual_stages > 1 else "."),
            )
        expect = 0
        for i, stage in enumerate(self.stages):
            if not (isinstance(stage, (list, tuple)) and len(stage) == 2):
                _fail(f"stages[{i}]", f"must be a [first, last] pair, got {stage!r}.")
            first, last = stage
            _check_int(f"stages[{i}][0]", first, 0)
            _check_int(f"stages[{i}][1]", last, 0)
            if first != expect or last < first:
                _fail(
                    f"stages[{i}]",
                    f"= {list(stage)} must start at layer {expect} and not end before it "
                    "(stages are contiguous and cover the layer table).",
                )
            expect = last + 1
        if expect != self._layer_rows:
            _fail("stages", f"cover layers 0..{expect - 1} but the layer table has rows 0..{self._layer_rows - 1}.")
        self.stages = [list(stage) for stage in self.stages]

    def _check_recompute(self) -> None:
        """The recomputed layers, whole or selective (disjoint), and sequence parallelism."""
        _check_layer_list("checkpoint_layers", self.checkpoint_layers, self._layer_rows)
        if not isinstance(self.sequence_parallel, bool):
            _fail("sequence_parallel", f"must be true or false, got {self.sequence_parallel!r}.")
        if self.sequence_parallel and self.tp < 2:
            _fail(
                "sequence_parallel",
                f"is true but tp is {self.tp}: sequence parallelism splits the "
                "tensor-parallel regions' sequence over tp >= 2 ranks.",
            )
        if self.sequence_parallel and self.seq_len % self.tp:
            _fail(
                "sequence_parallel",
                f"is true but seq_len {self.seq_len} is not a multiple of tp "
                f"({self.tp}): every tp rank holds seq_len / tp positions.",
            )
        _check_layer_list("selective_layers", self.selective_layers, self._layer_rows)
        both = sorted(set(self.selective_layers) & set(self.checkpoint_layers))
        if both:
            _fail(
                "selective_layers",
                f"and checkpoint_layers both hold {both}: a layer is recomputed "
                "whole (checkpoint_layers) or only its attention core (selective_layers), not both.",
            )

    def _check_expert_parallel(self) -> None:
        """``expert_parallel`` divides dp and the routed experts; more than 1 only for a mixture of experts."""
        _check_int("expert_parallel", self.expert_parallel, 1)
        if self.expert_parallel == 1:
            return
        if not self.model.moe:
            _fail(
                "expert_parallel",
                f"is {self.expert_parallel} but the model has no routed experts (model.moe is empty).",
            )
        if self.dp % self.expert_parallel:
            _fail(
                "expert_parallel",
                f"({self.expert_parallel}) must divide dp ({self.dp}): expert groups are carved out of the data-parallel ranks.",
            )
        if self.model.moe["experts"] % self.expert_parallel:
            _fail(
                "expert_parallel",
                f"({self.expert_parallel}) must divide the routed experts ({self.model.moe['experts']}): every rank of a group holds the same number.",
            )

    def in_warmup(self, steps: int) -> bool:
        """Whether a run of ``steps`` steps ends inside the full-precision warm-up of a compressed
        plan (``compression_warmup``): then every step it times ran the warm-up's exchange."""
        return self.predicted.compression is not None and steps <= self.compression_warmup

    def time_of_run(self, steps: int) -> dict[str, float]:
        """``predicted.time`` of a run of ``steps`` steps: the warm-up's (``predicted.compression``)
        when the run ends inside it (:meth:`in_warmup`), else the steady step's."""
        if self.in_warmup(steps):
            assert self.predicted.compression is not None
            return dict(self.predicted.compression["warmup_time"])
        return dict(self.predicted.time)

    @property
    def cp(self) -> int:
        """The context-parallel degree (``context_parallel.degree``)."""
        return self.context_parallel["degree"]

    def _check_context_parallel(self) -> None:
        """A sequence splits into ``2 cp`` equal chunks (the balanced causal layout)."""
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            _fail(
                "context_parallel.degree",
                f"({self.cp}) needs seq_len ({self.seq_len}) divisible by 2*cp = {2 * self.cp}: each rank holds "
                "two equal chunks of every sequence.",
            )

    def _check_compression(self) -> None:
        if self.dp_compression not in COMPRESSIONS:
            _fail("dp_compression", f"must be one of {', '.join(COMPRESSIONS)}, got {self.dp_compression!r}.")
        _check_int("compression_warmup", self.compression_warmup, 0)
        if self.dp_compression == GradCompression.NONE:
            return
        if self.dp < 2 or self.zero_stage > 1 or self.offload != NO_OFFLOAD:
            _fail(
                "dp_compression",
                f"is {self.dp_compression!r}, which needs dp > 1, zero_stage 0 or 1 and no offload "
                f"(got dp {self.dp}, zero_stage {self.zero_stage}, offload {self.offload}).",
            )

    def _check_measured(self) -> None:
        if self.measured is None:
            return
        if not isinstance(self.measured, dict) or not {"step_time_s", "peak_memory_bytes", "trials"} <= set(
            self.measured
        ):
            _fail("measured", "must be an object with step_time_s, peak_memory_bytes and trials.")
        _check_num("measured.step_time_s", self.measured["step_time_s"])
        _check_int("measured.peak_memory_bytes", self.measured["peak_memory_bytes"], 0)
        if not isinstance(self.measured["trials"], list):
            _fail("measured.trials", "must be a list.")

    # ---- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        full = asdict(self)
        order = [
            "schema_version",
            "model",
            "hardware",
            "global_batch",
            "seq_len",
            "dtype",
            "dp",
            "tp",
            "pp",
            "zero_stage",
            "micro_batch_size",
            "num_micro_batches",
            "schedule",
            "virtual_stages",
            "stages",
            "checkpoint_layers",
            "selective_layers",
            "sequence_parallel",
            "compile",
            "offload",
            "dp_compression",
            "compression_warmup",
            "expert_parallel",
            "context_parallel",
            "overlap",
            "predicted",
            "solver",
            "alternatives",
        ]
        out = {k: full[k] for k in order}
        for alt in out["alternatives"]:  # a runner-up names its offload only when it has one
            if alt["offload"] == NO_OFFLOAD:
                del alt["offload"]
            if not alt["sequence_parallel"]:
                del alt["sequence_parallel"]
            if alt["dp_compression"] == GradCompression.NONE:
                del alt["dp_compression"]
            if alt["schedule"] == ScheduleName.ONE_F_ONE_B:
                del alt["schedule"]
            if alt["virtual_stages"] == 1:
                del alt["virtual_stages"]
            if alt["expert_parallel"] == 1:
                del alt["expert_parallel"]
            if alt["context_parallel"]["degree"] == 1:
                del alt["context_parallel"]
        for key in ("cost", "compression"):
            if out["predicted"].get(key) is None:
                out["predicted"].pop(key, None)
        if self.measured is not None:
            out["measured"] = full["measured"]
        if self.request is not None:
            out["request"] = full["request"]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        if not isinstance(data, dict):
            _fail("file", "must hold a JSON object.")
        data = dict(data)
        subs = {"model": ModelInfo, "hardware": HardwareInfo, "predicted": Predicted, "solver": SolverInfo}
        for key, sub in subs.items():
            if key not in data:
                _fail("plan", f"is missing the field {key!r} (a plan.json written by `planner plan` has it).")
            data[key] = _build(sub, data[key], key)
        alts = data.get("alternatives", [])
        if not isinstance(alts, list):
            _fail("alternatives", "must be a list.")
        data["alternatives"] = [
            _build(Alternative, alternative, f"alternatives[{i}]") for i, alternative in enumerate(alts)
        ]
        return _build(cls, data, "plan")


def _check_layer_list(name: str, layers: Any, n_rows: int) -> None:
    """``layers`` is a list of distinct layer-table indices (``checkpoint_layers``, ``selective_layers``)."""
    if not isinstance(layers, list):
        _fail(name, "must be a list of layer indices.")
    for i in layers:
        _check_int(f"{name}[]", i, 0)
        if i >= n_rows:
            _fail(f"{name}[]", f"index {i} is outside the layer table (0..{n_rows - 1}).")
    if len(set(layers)) != len(layers):
        _fail(name, "has duplicates.")


def _checked_context_parallel(where: str, value: Any) -> dict:
    """``value`` as ``{"degree", "method"}`` (both keys, in that order), or a ``PlanError``."""
    if not isinstance(value, dict) or set(value) != {"degree", "method"}:
        _fail(where, f'must be an object {{"degree": int, "method": one of {", ".join(CP_METHODS)}}}, got {value!r}.')
    _check_int(f"{where}.degree", value["degree"], 1)
    if value["method"] not in CP_METHODS:
        _fail(f"{where}.method", f"must be one of {', '.join(CP_METHODS)}, got {value['method']!r}.")
    return {"degree": value["degree"], "method": str(value["method"])}


def _check_offload(offload: Any, zero_stage: int) -> None:
    if not isinstance(offload, dict) or set(offload) != set(OFFLOAD_KINDS):
        _fail("offload", f'must be an object with exactly "optimizer" and "params", got {offload!r}.')
    for kind in OFFLOAD_KINDS:
        if offload[kind] not in OFFLOAD_TIERS:
            _fail(f"offload.{kind}", f"must be one of {', '.join(OFFLOAD_TIERS)}, got {offload[kind]!r}.")
    if offload["params"] != OffloadTier.NONE and zero_stage != 3:
        _fail(
            "offload.params",
            f"is {offload['params']!r}, but offloading parameters needs zero_stage 3 "
            f"(got {zero_stage}): only ZeRO-3 shards the parameters it could keep off the device.",
        )
    if offload["optimizer"] != OffloadTier.NONE and zero_stage not in (1, 2, 3):
        _fail(
            "offload.optimizer",
            f"is {offload['optimizer']!r}, but offloading the optimizer needs "
            f"zero_stage 1, 2 or 3 (got {zero_stage}): the runtime offloads each rank's optimizer shard.",
        )


def _build(cls, data: Any, where: str):
    if not isinstance(data, dict):
        _fail(where, f"must be a JSON object, got {type(data).__name__}.")
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is f.default_factory is MISSING}
    missing = sorted(required - set(data))
    if missing:
        _fail(where, f"is missing the field(s) {missing}.")
    return cls(**{k: value for k, value in data.items() if k in names})


def load_plan(path: str) -> Plan:
    """Read and validate a plan.json; every problem becomes a ``PlanError``."""
    if not os.path.exists(path):
        raise PlanError(f"Plan file {path!r} does not exist. Create one with `planner plan ... --out {path}`.")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise PlanError(f"Plan file {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}).") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"Cannot read plan file {path}: {e}.") from None
    try:
        return Plan.from_dict(data)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None
    except TypeError as e:  # an unexpected structure that slipped past the field checks
        raise PlanError(f"{path}: malformed plan ({e}).") from None


def output_problem(path: str, folder: bool = False) -> str | None:
    """Why ``path`` cannot be written as a file (or, with ``folder``, used as a folder that is created
    when missing), in words that follow the path: "is a directory", "cannot be created: /x is a file,
    not a directory" ...; None when it can. Cheap (it writes nothing), so commands check their outputs
    with it before the long work; a race or a full disk still fails at the write itself."""
    full = os.path.abspath(path)
    if os.path.islink(full) and not os.path.exists(full):
        return "is a broken symbolic link"
    if os.path.isdir(full):
        if not folder:
            return "is a directory, not a file"
        return None if os.access(full, os.W_OK | os.X_OK) else "is a directory this user cannot write in"
    if os.path.lexists(full):
        if folder:
            return "is an existing file, not a directory"
        return None if os.access(full, os.W_OK) else "is read-only"
    parent = os.path.dirname(full)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is {'a file, ' if os.path.isfile(parent) else ''}not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: this user cannot write in {parent}"
    return None


def check_plan_out(path: str, flag: str = "--out") -> None:
    """A ``PlanError`` when a plan cannot be written to ``path`` (``output_problem``), naming the flag."""
    problem = output_problem(path)
    if problem is None:
        return
    if os.path.isdir(path):
        hint = f"give the path of the plan file to write in it, such as {os.path.join(path, 'plan.json')}"
    else:
        hint = "give a path where the plan file can be written"
    raise PlanError(f"{flag} {path} {problem}; {hint}.")


def save_plan(plan: Plan, path: str) -> None:
    """Write atomically: a crash mid-write never leaves a truncated plan.json behind. A path that cannot
    be written (a directory, a read-only file, a parent that is a file) is a ``PlanError`` before anything
    is written; a failure of the write itself (a full disk) raises its ``OSError``, the old file kept."""
    check_plan_out(path)
    tmp = f"{path}.tmp{os.getpid()}"
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(plan.to_json())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def plan_hash(plan: Plan) -> str:
    """Stable hash of the decisions (not the predictions) of a plan."""
    data = plan.to_dict()
    keep = {
        k: data[k]
        for k in (
            "model",
            "hardware",
            "global_batch",
            "seq_len",
            "dtype",
            "dp",
            "tp",
            "pp",
            "zero_stage",
            "micro_batch_size",
            "num_micro_batches",
            "stages",
            "checkpoint_layers",
        )
    }
    if not keep["model"].get("moe"):  # a dense model's hash as before model.moe existed
        keep["model"] = {k: v for k, v in keep["model"].items() if k != "moe"}
    # added by the second milestone: part of the hash only when used, so older plans keep theirs
    for k in ("selective_layers", "sequence_parallel"):
        if data[k]:
            keep[k] = data[k]
    if data["context_parallel"]["degree"] > 1:  # added by the third milestone, hashed when used
        keep["context_parallel"] = data["context_parallel"]
    if data["dp_compression"] != GradCompression.NONE:  # another optimizer: its state differs
        keep["dp_compression"] = data["dp_compression"]
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]
