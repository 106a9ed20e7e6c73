"""The training loop that runs compiled stages on the (pp, dp, tp) mesh.

One process per rank calls ``train_worker``. It builds the rank's ``Run`` (``setup``: mesh,
device, stage module and its weights, its layers compiled when the plan says ``compile``
(``runtime.stages.compile_layers``: one ``torch.compile`` per layer class, compiled here by a warm-up
pass rather than in the first step), ZeRO engine, pipeline stage, data, ``resume`` from the
newest checkpoint when asked, the step probes of ``runtime.training.profiling``), then for each step
``t`` from the first not yet done up to ``TrainOptions.steps``:

1. calls the caller's ``on_step_start(rank, t)`` hook, if any (``t`` counts from 0);
2. ``run_step``: reads rows ``[d * B/dp, (d + 1) * B/dp)`` of step ``t``'s global batch
   (``runtime.training.data``), split into ``num_micro_batches`` micro-batches; walks this rank's action
   list for the plan's schedule (``runtime.contract.schedule_ir``/``runtime.pipeline.executor``: 1F1B, interleaved
   1F1B over the rank's ``virtual_stages`` model chunks, or ZB-H1 whose ``B`` computes input
   gradients and ``W`` weight gradients later; with one stage 1F1B is forward, backward per
   micro-batch) accumulating gradients (under ZB-H1 a checkpointed layer, plan.json
   ``checkpoint_layers``, recomputes its forward in ``B`` and again in ``W``, each its own
   autograd pass: one forward more than under 1F1B, counted in ``recompute``); lets the ZeRO
   engine (one per rank, over all its chunks) reduce gradients over dp, clip by the global norm
   and step AdamW with the learning rate of the warmup + cosine schedule (``lr_at``) -- timed,
   and split into the parts of ``runtime.timing`` (compute, recompute, tp_comm, pp_bubble,
   dp_comm, optimizer, offload), under the memory tracker and profiler that apply;
3. ``aggregate_metrics``: ``loss`` is the mean over the dp ranks (so over the global batch),
   ``peak_memory_bytes`` (device memory), ``host_memory_bytes`` and ``nvme_bytes`` (the offload
   tiers, ``runtime.data_parallel.offload_engine``), ``comm_bytes``, the step time and the collective wait time the max
   over all ranks; ``time``, the breakdown of the critical rank (``critical_breakdown``: the one that
   worked longest, whose waits are communication, not a faster peer waiting for it), made to sum
   to the step time;
4. ``write_metrics``: rank 0 appends one metrics line (``step, loss, step_time_s, tokens_per_s,
   peak_memory_bytes, comm_bytes, lr, host_memory_bytes, nvme_bytes, time`` and ``loss_scale`` in
   fp16) and calls ``on_metrics``;
   with ``TrainOptions.tensorboard_dir`` it also writes them as TensorBoard scalars;
5. ``maybe_checkpoint`` (``runtime.training.saving.Saver``): every ``save_every`` steps and at
   the last one, saves everything a bit-identical resume needs (``runtime.checkpointing.checkpoint_io``),
   and every ``snapshot_every`` steps a snapshot; with ``async_checkpoint`` on the step waits
   only for the copy to host memory (and the previous write), the write runs in the background.
   It runs right after ``run_step``, before the metrics are aggregated: the seconds it waited are
   the step's ``checkpoint_s``.
6. with a checkpoint folder, rank 0 rewrites its heartbeat (``runtime.training.recovery``). The
   first step of a resumed run carries the event line of the restart (``resume``, or the
   caller's ``replan``) with what the recovery cost; every step line has the ``data_checksum``
   of the global batch it read (``runtime.training.data.batch_checksum``, summed over dp).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

import runtime
from runtime import context_parallel, moe, tensor_parallel, timing
from runtime.checkpointing import checkpoint_io
from runtime.contract.choices import GradCompression, ScheduleName
from runtime.contract.compressed_exchange import default_warmup
from runtime.contract.data_roles import LEGACY_INPUTS
from runtime.contract.schedule_ir import interleaved_one_f_one_b, one_f_one_b, zero_bubble_h1
from runtime.data_parallel.engine_config import CompressionConfig
from runtime.data_parallel.offload_engine import OffloadConfig
from runtime.data_parallel.tied_weights import holder_ranks, isolate_tied, tied_params, tied_stage_sets
from runtime.data_parallel.zero_engine import OptimizerConfig, ParallelContext, ShardingConfig, StepInfo, ZeroEngine
from runtime.distributed import comm
from runtime.distributed.mesh import Mesh, setup_mesh
from runtime.dtypes import to_torch
from runtime.moe.expert_shards import expert_attrs, expert_degree, num_experts
from runtime.pipeline.executor import PipelineStage, TensorMeta
from runtime.stages.compile_layers import TRACKED_STEPS, CompiledLayers, compile_stage, warm_up_in_turn
from runtime.stages.compiled_stages import (
    CompiledError,
    load_stage_module,
    load_weights,
    param_groups,
    rank_chunks,
    read_manifest,
)
from runtime.training.data import CHECKSUM_MODULUS, batch_checksum, data_vocab, model_inputs, open_data, rank_slice
from runtime.training.events import write_event
from runtime.training.profiling import StepProbes
from runtime.training.recovery import RecoveryClock, describe_recovery, kill_hook, write_heartbeat
from runtime.training.saving import Saver, describe, resume_point
from runtime.training.train_config import TrainOptions

__all__ = [
    "Run",
    "StepHook",
    "StepMetrics",
    "StepResult",
    "aggregate_metrics",
    "critical_breakdown",
    "lr_at",
    "maybe_checkpoint",
    "open_tensorboard",
    "resume",
    "run_step",
    "schedule_actions",
    "schedule_of",
    "setup",
    "train_worker",
    "write_metrics",
    "write_tensorboard",
]

StepHook = Callable[[int, int], None]
"""``on_step_start(rank, step)``: called on every rank before each step (``step`` counts from 0,
the number of steps done). An extension point for instrumentation and fault-injection tests."""


def schedule_of(options: TrainOptions) -> dict:
    """What fixes the learning rate of every step; each checkpoint records it, so a resume under
    another schedule can say so."""
    return {"steps": options.steps, "lr": options.lr, "min_lr": options.min_lr, "warmup": options.warmup_steps}


def lr_at(step: int, options: TrainOptions) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``."""
    if options.warmup_steps > 0 and step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    span = max(1, options.steps - options.warmup_steps)
    progress = min(1.0, (step - options.warmup_steps) / span)
    return options.min_lr + 0.5 * (options.lr - options.min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass
class StepMetrics:
    """One line of the metrics JSONL (``to_json``), the same on every rank."""

    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    peak_memory_bytes: int
    comm_bytes: float
    lr: float
    host_memory_bytes: int = 0
    """Bytes of state the run holds in the host tier (offloaded masters, moments, gradient shards,
    transfer buffers; ``runtime.data_parallel.offload_engine``), the max over ranks; 0 without offload."""
    nvme_bytes: int = 0
    """Bytes of the NVMe tier's files, the max over ranks; 0 without an nvme tier."""
    loss_scale: float | None = None
    grad_norm: float | None = None
    comm_wait_s: float = 0.0
    """Seconds the slowest rank spent blocked in collectives this step (unhidden communication)."""
    time: dict[str, float] | None = None
    """Seconds of the step by part (``runtime.timing.PARTS``, the keys of plan.json's
    ``predicted.time``), measured on the critical rank (``critical_breakdown``): they sum to
    ``step_time_s``."""
    data_checksum: int | None = None
    """A checksum of the token rows the step consumed, over the whole global batch
    (``runtime.training.data.batch_checksum``): equal for every plan of the same seed and global
    batch, so a resumed or re-planned run can be checked to read each sample once."""
    events: list[dict] = field(default_factory=list)
    """What happened with this step (a recovery, a re-plan), each the arguments of
    ``runtime.training.events.write_event`` (``kind``, ``message``, fields): rank 0 writes them as
    event lines before the step's line; not part of the step line."""
    checkpoint_s: float = 0.0
    """Seconds the step waited for checkpointing after its optimizer step (staging the state in host
    memory, waiting for the previous write, or the whole write with ``--async-checkpoint off``),
    the max over ranks; 0.0 when nothing was saved. Not part of ``step_time_s``."""
    tokens_dropped: int | None = None
    """Routed token rows refused by the experts' capacity this step, over the global batch and
    every MoE layer (``runtime.moe.load_stats``); None for a model without routed experts."""
    expert_load: float | None = None
    """max / mean tokens per expert over the global batch and every MoE layer (1.0: balanced);
    None for a model without routed experts, or whose compiled code routes without
    ``runtime.moe`` (nothing counted)."""

    def to_json(self) -> str:
        fields = asdict(self)
        fields.pop("events")
        for optional in ("loss_scale", "grad_norm", "time", "data_checksum", "tokens_dropped", "expert_load"):
            if fields[optional] is None:
                fields.pop(optional)
        return json.dumps(fields)


@dataclass
class Run:
    """One rank's training run, built by ``setup``; the loop's steps read and update it."""

    rank: int
    world: int
    opts: TrainOptions
    manifest: dict
    """The compiled plan's ``manifest.json`` (``plan``, ``model``, ``stages``)."""
    mesh: Mesh
    device: torch.device
    engine: ZeroEngine
    pstage: PipelineStage
    actions: list
    """This rank's action list for the plan's schedule (``schedule_actions``)."""
    data: Any
    """The token source (``runtime.training.data.open_data``)."""
    rows: tuple[int, int]
    """This dp rank's rows ``[lo, hi)`` of every global batch."""
    stage_inputs: list[list[str]]
    """The data inputs each of this rank's chunks takes (one list: its stage), by graph input name."""
    graph_inputs: list[str]
    """The model's inputs in order, by the name the graph gives them."""
    input_specs: list[dict]
    """What feeds each of them (plan.json ``model.inputs``; ``runtime.training.data.model_inputs``)."""
    start_step: int
    resumed_from: tuple[int, str, str] | None
    """The checkpoint or snapshot the run resumed from, ``(step, path, source)``; None: a fresh start."""
    """Steps already done when this run started (``resume``)."""
    probes: StepProbes
    """Peak-memory tracking and profiling around each step."""
    tensorboard: Any = None
    """Rank 0's ``SummaryWriter`` when ``opts.tensorboard_dir`` is set (``open_tensorboard``)."""
    compiled: CompiledLayers | None = None
    """The stage's compiled layer classes and their set-up time when the plan compiles its stages
    (plan.json ``compile``); None otherwise."""
    saver: Saver | None = None
    """Checkpoints and snapshots (``runtime.training.saving``)."""

    @property
    def plan(self) -> dict:
        return self.manifest["plan"]


@dataclass
class StepResult:
    """What one rank measured in one step, before aggregation over ranks."""

    loss: float
    info: StepInfo
    lr: float
    seconds: float
    comm_bytes: float
    comm_wait_s: float
    peak_bytes: int
    parts: dict[str, float]
    """``seconds`` split over ``runtime.timing.PARTS``."""
    host_bytes: int = 0
    """Host-tier bytes of this rank (``ZeroEngine.host_bytes``)."""
    nvme_bytes: int = 0
    """NVMe-tier bytes of this rank (``ZeroEngine.nvme_bytes``)."""
    data_checksum: int = 0
    """``batch_checksum`` of this rank's rows of the step's global batch."""
    checkpoint_s: float = 0.0
    """Seconds this rank waited for checkpointing after the step (``maybe_checkpoint``)."""


def _recv_meta(stage: dict) -> list[TensorMeta]:
    """What this stage receives, from the manifest."""
    metas = []
    for received in stage["recv"]:
        dtype = getattr(torch, received["dtype"])
        split = bool(received.get("tp_split", False))  # absent in manifests older than it: whole
        metas.append(TensorMeta(tuple(received["shape"]), dtype, bool(received["requires_grad"]), split))
    return metas


@dataclass(frozen=True)
class _ModelInputs:
    """How the plan's data feeds the model: enough to build a stage's warm-up micro-batch."""

    plan: dict
    """The compiled plan (``micro_batch_size``, ``seq_len``)."""
    graph_inputs: list[str]
    """The model's inputs in order, by the name the graph gives them."""
    input_specs: list[dict]
    """What feeds each of them (``runtime.training.data.model_inputs``)."""
    device: torch.device
    """Where the stage runs."""

    def warm_up(self, stage: dict) -> list[torch.Tensor]:
        """A micro-batch of zeros in the stage's call order: what it receives (as the pipeline hands
        it over), then its data inputs (token ids 0, and whatever ``model_inputs`` derives from them)."""
        device = self.device
        received = [
            torch.zeros(meta.shape, dtype=meta.dtype, device=device).requires_grad_(bool(meta.requires_grad))
            for meta in _recv_meta(stage)
        ]
        ids = torch.zeros((self.plan["micro_batch_size"], self.plan["seq_len"]), dtype=torch.long, device=device)
        by_name = dict(zip(self.graph_inputs, model_inputs(self.input_specs, ids, ids.clone())))
        return received + [by_name[name] for name in stage["data_inputs"]]


def schedule_actions(plan: dict, pp_index: int) -> list:
    """This rank's action list for the plan's pipeline schedule (plan.json ``schedule``): 1F1B,
    Megatron's interleaved 1F1B over ``virtual_stages`` chunks, or ZB-H1 (split ``B``/``W``)."""
    pp, micro_batch_count, chunks = plan["pp"], plan["num_micro_batches"], plan.get("virtual_stages", 1)
    kind = plan.get("schedule", ScheduleName.ONE_F_ONE_B)
    if kind == ScheduleName.ONE_F_ONE_B:
        return one_f_one_b(pp, micro_batch_count)[pp_index]
    if kind == ScheduleName.INTERLEAVED:
        return interleaved_one_f_one_b(pp, micro_batch_count, chunks)[pp_index]
    if kind == ScheduleName.ZERO_BUBBLE:
        return zero_bubble_h1(pp, micro_batch_count)[pp_index]
    raise ValueError(
        f"the plan names the pipeline schedule {kind!r}; this runtime runs 1f1b, interleaved and "
        "zero-bubble: re-plan, or update the runtime"
    )


def _load_chunks(
    compiled_dir: str, chunks: list[dict], state: Mapping[str, torch.Tensor], mesh: Mesh, device: torch.device
) -> list[torch.nn.Module]:
    """This rank's stage module(s) with their shard of the original weights (read once)."""
    modules = []
    for stage in chunks:
        module = load_stage_module(compiled_dir, stage, device)
        load_weights(module, stage, state, mesh.tp_index, mesh.tp, mesh.ep_index, mesh.ep)
        modules.append(module)
    return modules


def _compile_chunks(
    modules: list[torch.nn.Module],
    chunks: list[dict],
    inputs: _ModelInputs,
    mesh: Mesh,
    rank: int,
    opts: TrainOptions,
) -> CompiledLayers | None:
    """Compile each chunk's layers (one ``torch.compile`` per layer class) and warm them up."""
    compiled = None
    for j, (module, stage) in enumerate(zip(modules, chunks)):
        # Before the ZeRO engine: the warm-up's collectives are tensor-parallel ones only, so the
        # data-parallel replicas can take turns (runtime.stages.compile_layers.warm_up_in_turn).
        info = compile_stage(module)
        warm_up_in_turn(module, inputs.warm_up(stage), info, first=mesh.dp_index == 0)
        if compiled is None:
            compiled = info
        else:  # one record for the rank: every chunk's classes and layers, the total time
            compiled.functions.update(info.functions)
            compiled.layers.update({f"{j}.{k}": layer for k, layer in info.layers.items()})
            compiled.seconds += info.seconds
    if rank == 0 and opts.progress and compiled is not None:
        print(
            f"[planner] compiled stage 0: {compiled.describe()} in {compiled.seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return compiled


def _make_engine(module, modules, chunks, man, mesh, opts, offload, rank) -> ZeroEngine:
    """One ZeRO engine over the rank's chunks (``module`` is the one stage module, or the
    ``ModuleList`` of the chunks, each a root of its own): one gradient norm, clip and step."""
    plan = man["plan"]
    v = len(chunks)
    prefix = [""] if v == 1 else [f"{j}." for j in range(v)]
    layers, tied, replicated, experts = [], {}, set(), set()
    tied_keys: dict[str, str] = {}  # a weight read by several of this rank's chunks: one key for its copies
    for pre, sub, st in zip(prefix, modules, chunks):
        own_tied = tied_params(st)  # weights held by several stages: summed over their tied group
        layers += [[pre + n for n in grp] for grp in isolate_tied(param_groups(sub), own_tied)]
        tied.update(
            {pre + a: (mesh.tied_groups.get(holder_ranks(man, h)), st["index"] == h[0]) for a, h in own_tied.items()}
        )
        tied_keys.update({pre + a: a for a in own_tied})
        replicated |= {pre + attr for attr, e in st["params"].items() if not e.get("shard")}
        if mesh.ep > 1:  # routed experts: this rank's rows, reduced over the expert-data-parallel group
            experts |= {pre + attr for attr in expert_attrs(st)}
    return ZeroEngine(
        module,
        layers=layers,
        dp_group=mesh.dp_cp_group,  # the ranks holding these weights: dp * cp of them
        sharding=ShardingConfig(
            zero_stage=plan["zero_stage"],
            param_dtype=to_torch(plan["dtype"]),
            # one backward pass per (chunk, micro-batch): a split B/W pair counts once
            micro_batches_per_step=plan["num_micro_batches"] * v,
            overlap=opts.overlap_settings.dp,  # --overlap: reductions, ZeRO 1/2 gathers, ZeRO-3 prefetch
        ),
        optimizer=OptimizerConfig(
            lr=opts.lr,
            betas=(opts.beta1, opts.beta2),
            eps=opts.eps,
            weight_decay=opts.weight_decay,
            max_grad_norm=opts.max_grad_norm,
            compression=compression_of(plan, opts),
        ),
        parallel=ParallelContext(
            norm_groups=[g for g in (mesh.tp_group, mesh.pp_group) if g is not None],
            replicated_param_filter=(lambda name: name in replicated) if plan["tp"] > 1 else None,
            tied=tied,
            tied_keys=tied_keys,
            rank=rank,
            expert_params=frozenset(experts),
        ),
        offload=replace(offload, delayed_update=opts.delayed_update),
        roots=None if v == 1 else [str(j) for j in range(v)],
    )


def compression_of(plan: dict, opts: TrainOptions) -> CompressionConfig:
    """The plan's data-parallel compression (plan.json ``dp_compression``), warmed up for
    ``--compression-warmup`` steps, else the plan's ``compression_warmup``, else the default share
    of this run (``runtime.contract.compressed_exchange.default_warmup``)."""
    method = plan.get("dp_compression") or GradCompression.NONE
    warmup = opts.compression_warmup
    if warmup is None:
        warmup = plan.get("compression_warmup") or default_warmup(opts.steps)
    return CompressionConfig(method=method, warmup_steps=warmup if method != GradCompression.NONE else 0)


def context_degree(manifest: Mapping[str, Any], offload: OffloadConfig, compression: CompressionConfig) -> int:
    """The plan's context-parallel degree, its method set for the compiled stages
    (``runtime.context_parallel.set_method``); a ``CompiledError`` for stages compiled without it or a
    plan combining it with what it does not support (expert parallelism, offload, compression)."""
    plan = manifest["plan"]
    entry = plan.get("context_parallel") or {}
    cp = int(entry.get("degree", 1))
    if cp == 1:
        return 1
    if manifest.get("context_parallel", {}).get("degree") != cp:
        raise CompiledError(
            f"the plan asks for context parallelism over {cp} ranks but its stages were compiled without it; "
            "recompile the plan (planner compile)"
        )
    refused = [
        (expert_degree(manifest) > 1, "expert parallelism", "plan with --ep 1"),
        (offload.optimizer != "none" or offload.params != "none", "offload", "plan without offload"),
        (compression.method != GradCompression.NONE, f"{compression.method} compression", "--dp-compression none"),
    ]
    for bad, what, fix in refused:
        if bad:
            raise CompiledError(f"context parallelism (cp={cp}) with {what} is not supported; {fix}")
    context_parallel.set_method(manifest["context_parallel"]["method"])
    return cp


def _sequence_part(x: torch.Tensor, mesh: Mesh, seq_len: int) -> torch.Tensor:
    """This rank's chunks of ``x`` along dim 1 when it is sequence-long (token ids, labels, masks,
    positions), else ``x``."""
    if x.dim() < 2 or x.shape[1] != seq_len:
        return x
    return context_parallel.shard_sequence(x, 1, mesh.cp_index, mesh.cp).contiguous()


def _rank_device() -> torch.device:
    """This rank's device (its CUDA device under nccl, else the CPU), made the runtime's."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.is_initialized() and dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    runtime.set_device(device)
    return device


def _model_inputs(manifest: Mapping[str, Any], plan: Mapping[str, Any]) -> tuple[list[str], list]:
    """The compiled graph's input names and the plan's input specs, which must pair up."""
    graph_inputs = manifest["model"].get("inputs", ["input_ids", "labels"])
    input_specs = plan["model"].get("inputs") or LEGACY_INPUTS
    if len(graph_inputs) != len(input_specs):
        raise ValueError(
            f"the compiled model takes {len(graph_inputs)} inputs {graph_inputs}, the plan describes "
            f"{len(input_specs)}: recompile the plan"
        )
    return graph_inputs, input_specs


def setup(
    rank: int, world: int, compiled_dir: str, opts: TrainOptions, state_fn: Callable[[], Mapping[str, torch.Tensor]]
) -> Run:
    """Build this rank's run: the mesh and device, the stage module (or, with ``virtual_stages``
    v > 1, its v model chunks, ``runtime.stages.compiled_stages.rank_chunks``) with its shard of the original
    weights (``state_fn`` returns the original model's tensors by name; the seed is set first),
    its layers compiled and warmed up when the plan says ``compile``, one ZeRO engine over the
    chunks, the pipeline stage walking the plan's schedule (``schedule_actions``; the engine is its
    backward scope, so a ``B``/``W`` pair is one backward pass), the data source; then ``resume``
    and the step probes (which count the tensors alive after the resume)."""
    manifest = read_manifest(compiled_dir)
    plan = manifest["plan"]
    offload = OffloadConfig.from_plan(plan, opts.nvme_path)  # bad placement: fail before any work
    pp, dp, tp = plan["pp"], plan["dp"], plan["tp"]
    cp = context_degree(manifest, offload, compression_of(plan, opts))
    mesh = setup_mesh(pp, dp, tp, tied_stage_sets(manifest), ep=expert_degree(manifest), cp=cp)
    tensor_parallel.set_overlap(opts.overlap_settings.tp)
    device = _rank_device()
    chunks = rank_chunks(manifest, mesh.pp_index)
    chunk_count = len(chunks)
    actions = schedule_actions(plan, mesh.pp_index)
    torch.manual_seed(opts.seed)
    modules = _load_chunks(compiled_dir, chunks, state_fn(), mesh, device)
    module = modules[0] if chunk_count == 1 else torch.nn.ModuleList(modules)
    graph_inputs, input_specs = _model_inputs(manifest, plan)
    compiled = None
    if plan.get("compile"):
        compiled = _compile_chunks(
            modules, chunks, _ModelInputs(plan, graph_inputs, input_specs, device), mesh, rank, opts
        )
    for sub in modules:
        timing.time_recomputation(sub)
    # On a GPU, part boundaries wait for the device (runtime.timing explains the cost).
    timing.TIMER.sync = torch.cuda.synchronize if device.type == "cuda" else None
    engine = _make_engine(module, modules, chunks, manifest, mesh, opts, offload, rank)
    received = [_recv_meta(stage) for stage in chunks]
    pstage = PipelineStage.from_mesh(
        modules[0] if chunk_count == 1 else modules,
        recv_meta=received[0] if chunk_count == 1 else received,
        mesh=mesh,
        device=device,
        virtual_stages=chunk_count,
        backward_scope=engine,
        overlap=opts.overlap_settings.pp,  # --overlap: receives posted ahead
    )
    data = open_data(opts.data_path, data_vocab(input_specs, manifest["model"]["vocab"]), plan["seq_len"], opts.seed)
    resumed_from = resume(opts, engine, manifest, mesh)
    saver = Saver(opts, engine, manifest, mesh, rank, schedule_of(opts))  # its gloo groups: every rank, here
    # Tracked steps run eagerly (runtime.stages.compile_layers): a compiled run tracks its first few only.
    memory_steps = TRACKED_STEPS if compiled is not None and opts.memory_steps is None else opts.memory_steps
    probes = StepProbes(
        rank, device, opts.track_memory, memory_steps, resident=engine.tracked_tensors(), host=engine.host_tensors()
    )
    tensorboard = open_tensorboard(opts.tensorboard_dir) if rank == 0 and opts.tensorboard_dir else None
    return Run(
        rank=rank,
        world=world,
        opts=opts,
        manifest=manifest,
        mesh=mesh,
        device=device,
        engine=engine,
        pstage=pstage,
        actions=actions,
        data=data,
        rows=rank_slice(plan["global_batch"], dp, mesh.dp_index),
        stage_inputs=[stage["data_inputs"] for stage in chunks],
        graph_inputs=graph_inputs,
        input_specs=input_specs,
        start_step=resumed_from[0] if resumed_from is not None else 0,
        resumed_from=resumed_from,
        probes=probes,
        tensorboard=tensorboard,
        compiled=compiled,
        saver=saver,
    )


def open_tensorboard(directory: str):
    """A TensorBoard ``SummaryWriter`` on ``directory``. tensorboard is an optional package,
    imported only when a run asks for it (``planner train`` checks it is installed before any
    process starts)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "TrainOptions.tensorboard_dir needs the tensorboard package: "
            "pip install tensorboard (or the project's `tensorboard` extra)"
        ) from None
    return SummaryWriter(log_dir=directory)


def resume(opts: TrainOptions, engine: ZeroEngine, manifest: dict, mesh: Mesh) -> tuple[int, str, str] | None:
    """Load the newest complete checkpoint or snapshot (``opts.checkpoint_dir``, ``opts.snapshot_dir``,
    by step) into ``engine`` when ``opts.resume`` asks for it; what was loaded, ``(step, path,
    source)`` (None: nothing, the run starts at step 0). The first step reports it
    (``_restart_events``)."""
    point = resume_point(opts) if opts.resume else None
    if point is not None:
        checkpoint_io.load(point[1], engine, manifest, mesh)
    return point


def micro_batches(run: Run, step: int) -> tuple[list, int]:
    """This rank's rows of step ``step``'s global batch, on the device, split into micro-batches
    of the stage's data inputs (with model chunks, a tuple of inputs per chunk); and the rows'
    ``batch_checksum``."""
    plan = run.plan
    micro_size, micro_batch_count = plan["micro_batch_size"], plan["num_micro_batches"]
    row_start, row_end = run.rows
    ids, labels = run.data.rows(step, row_start, row_end, plan["global_batch"])
    checksum = batch_checksum(ids, row_start)
    ids, labels = ids.to(run.device), labels.to(run.device)
    by_name = dict(zip(run.graph_inputs, model_inputs(run.input_specs, ids, labels)))
    if run.mesh.cp > 1:  # this rank's two chunks of every sequence-long input (the loss shifts at full length)
        by_name = {name: _sequence_part(x, run.mesh, plan["seq_len"]) for name, x in by_name.items()}
    per_chunk = [
        [tuple(by_name[name][i * micro_size : (i + 1) * micro_size] for name in names) for names in run.stage_inputs]
        for i in range(micro_batch_count)
    ]
    return ([micro_batch[0] for micro_batch in per_chunk] if len(run.stage_inputs) == 1 else per_chunk), checksum


def run_step(run: Run, step: int) -> StepResult:
    """Forward and backward of every micro-batch, then the optimizer step; timed from after the
    data is on the device to the end of the device's work, with this step's probes around it.

    ``runtime.timing.TIMER`` splits the time: the optimizer step (and ``zero_grad``) is the part
    ``optimizer``; collectives and recomputed layers enter their own parts from ``runtime.distributed.comm``
    and the stage's forward hooks; the rest is ``compute``."""
    micro, checksum = micro_batches(run, step)
    lr = lr_at(step, run.opts)
    index = step - run.start_step
    comm.STATS.reset()
    moe.LOAD.reset()
    timing.TIMER.start()
    try:
        with run.probes.around(index, step, settle=run.engine.wait_params):
            loss = run.pstage.run(run.actions, micro, loss_scale=run.engine.loss_scale)
            with timing.part("optimizer"):
                info = run.engine.step(lr=lr)
                run.engine.zero_grad()
        if run.device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        seconds, parts = timing.TIMER.stop()
    sent = comm.STATS.total
    peak = run.probes.peak_after(index, step)
    return StepResult(
        loss=loss,
        info=info,
        lr=lr,
        seconds=seconds,
        comm_bytes=sent,
        comm_wait_s=comm.STATS.wait_s,
        peak_bytes=peak,
        parts=parts,
        host_bytes=run.engine.host_bytes(),
        nvme_bytes=run.engine.nvme_bytes(),
        data_checksum=checksum,
    )


#: The parts in which a rank waits for its peers (``runtime.timing.AXIS_PARTS``).
_WAIT_PARTS = frozenset(timing.AXIS_PARTS.values())


def critical_breakdown(rows: list[list[float]]) -> tuple[float, dict[str, float]]:
    """The step time (the longest rank's) and the breakdown of the *critical* rank, from one row
    ``[seconds, *parts]`` per rank (``runtime.timing.PARTS`` order).

    The critical rank is the one that worked longest (its seconds less its waits on its peers:
    the collectives' and the pipeline's parts): the rank the others wait for. Its waits are the
    communication itself, where a faster rank's also hold the time it waited for the slow one
    to arrive (ranks drift apart by milliseconds between two collectives; with two processes on
    two shared cores one rank's ZeRO waits read 101 ms in a step whose critical rank waited 22 ms).
    The prediction prices identical ranks, so the critical rank's parts are what it compares with.
    Whatever the critical rank's step is short of the longest goes to the residual part, so the
    parts sum to the step time."""
    waits = [index for index, part in enumerate(timing.PARTS) if part in _WAIT_PARTS]
    critical = max(rows, key=lambda row: row[0] - sum(row[1 + index] for index in waits))
    step_time = max(row[0] for row in rows)
    parts = dict(zip(timing.PARTS, critical[1:]))
    parts[timing.RESIDUAL] += step_time - critical[0]
    return step_time, parts


def aggregate_metrics(run: Run, step: int, result: StepResult) -> StepMetrics:
    """The step's metrics over all ranks: the loss is the mean over dp ranks; peak memory, bytes
    sent, step time and collective wait time the max over all ranks; the time breakdown that of
    the critical rank (:func:`critical_breakdown`; each rank fills its row of a table of every
    rank's time and parts, which one sum all-reduce gives to all)."""
    plan, device = run.plan, run.device
    # the loss and the data checksum, averaged over dp (the checksum's sum is that mean times dp)
    mean_loss = torch.tensor([result.loss, float(result.data_checksum), 0.0], dtype=torch.float64, device=device)
    maxima = torch.tensor(
        [
            float(result.peak_bytes),
            result.comm_bytes,
            result.comm_wait_s,
            float(result.host_bytes),
            float(result.nvme_bytes),
            result.checkpoint_s,
        ],
        dtype=torch.float64,
        device=device,
    )
    times = torch.zeros(run.world, 1 + len(timing.PARTS), dtype=torch.float64, device=device)
    times[run.rank] = torch.tensor([result.seconds] + [result.parts[k] for k in timing.PARTS], dtype=torch.float64)
    averaged_over = 1
    if dist.is_initialized() and run.world > 1:
        if run.mesh.dp_group is not None:
            dist.all_reduce(mean_loss, group=run.mesh.dp_group)
            mean_loss /= plan["dp"]
            averaged_over = plan["dp"]
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        dist.all_reduce(times)
    step_time, parts = critical_breakdown(times.tolist())
    experts = num_experts(run.manifest)
    dropped, load = (None, None)
    if experts is not None:  # every rank alike: summed over the world, once per tp group
        dropped, load = moe.reduce_over(moe.LOAD, [experts], counted=run.mesh.tp_index == 0, device=device)
    tokens = plan["global_batch"] * plan["seq_len"]
    return StepMetrics(
        step=step + 1,
        loss=float(mean_loss[0]),
        step_time_s=step_time,
        tokens_per_s=tokens / step_time if step_time > 0 else 0.0,
        peak_memory_bytes=int(maxima[0]),
        comm_bytes=float(maxima[1]),
        lr=result.lr,
        host_memory_bytes=int(maxima[3]),
        nvme_bytes=int(maxima[4]),
        loss_scale=result.info.loss_scale if plan["dtype"] == "fp16" else None,
        grad_norm=result.info.grad_norm,
        comm_wait_s=float(maxima[2]),
        time=parts,
        data_checksum=round(float(mean_loss[1]) * averaged_over) % CHECKSUM_MODULUS,
        checkpoint_s=float(maxima[5]),
        tokens_dropped=dropped,
        expert_load=load,
    )


def write_metrics(run: Run, metrics: StepMetrics, on_metrics: Callable[[StepMetrics], None] | None) -> None:
    """On rank 0: append ``metrics`` to ``opts.metrics_path`` (if set), write it to TensorBoard (if
    asked) and pass it to ``on_metrics``."""
    if run.rank != 0:
        return
    if run.opts.metrics_path:
        for event in metrics.events:
            fields = dict(event)
            write_event(run.opts.metrics_path, fields.pop("kind"), fields.pop("message"), **fields)
        with open(run.opts.metrics_path, "a", encoding="utf-8") as out:
            out.write(metrics.to_json() + "\n")
    if run.tensorboard is not None:
        write_tensorboard(run.tensorboard, metrics)
    if on_metrics is not None:
        on_metrics(metrics)


def write_tensorboard(writer, metrics: StepMetrics) -> None:
    """One step's scalars: ``train/`` loss, tokens/s, step time, peak memory; ``time/<part>``
    the breakdown."""
    scalars = {
        "train/loss": metrics.loss,
        "train/tokens_per_s": metrics.tokens_per_s,
        "train/step_time_s": metrics.step_time_s,
        "train/peak_memory_bytes": metrics.peak_memory_bytes,
    }
    scalars.update({f"time/{part}": seconds for part, seconds in (metrics.time or {}).items()})
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, metrics.step)


def maybe_checkpoint(run: Run, step: int) -> float:
    """After step ``step`` (0-based): the checkpoint or snapshot due (``runtime.training.saving``);
    the seconds the step waited for it."""
    if run.saver is None:
        run.saver = Saver(run.opts, run.engine, run.manifest, run.mesh, run.rank, schedule_of(run.opts))
    return run.saver.after_step(step)


def train_worker(
    rank: int,
    world: int,
    compiled_dir: str,
    opts: TrainOptions,
    state_fn: Callable[[], Mapping[str, torch.Tensor]],
    on_metrics: Callable[[StepMetrics], None] | None = None,
    on_step_start: StepHook | None = None,
    restart_note: dict | None = None,
) -> list[StepMetrics]:
    """Train on this rank (see the module docstring); every step's metrics, the same on every rank.

    ``state_fn`` returns the original model's tensors by name; ``on_metrics`` receives each
    step's metrics on rank 0; ``on_step_start`` (a ``StepHook``) runs before each step on every
    rank, after the ``PLANNER_FAULT_KILL`` hook (``runtime.training.recovery.kill_hook``).
    ``restart_note``: the event the caller has to report with the first step (``kind``,
    ``message``, ``fields``: a re-plan), to which a resumed run adds what the recovery cost.
    With a checkpoint folder rank 0 keeps a heartbeat there (``runtime.training.recovery``).
    """
    run = setup(rank, world, compiled_dir, opts, state_fn)
    clock = _recovery_clock(run)
    hooks = [hook for hook in (kill_hook(), on_step_start) if hook is not None]
    history: list[StepMetrics] = []
    try:
        for step in range(run.start_step, opts.steps):
            for hook in hooks:
                hook(rank, step)
            result = run_step(run, step)
            result.checkpoint_s = maybe_checkpoint(run, step)
            metrics = aggregate_metrics(run, step, result)
            if step == run.start_step:
                metrics.events = _restart_events(run, restart_note, clock)
            history.append(metrics)
            write_metrics(run, metrics, on_metrics)
            if rank == 0 and opts.checkpoint_dir:
                write_heartbeat(opts.checkpoint_dir, step + 1)
        if run.saver is not None:
            run.saver.finish()
        if rank == 0 and opts.checkpoint_dir:
            write_heartbeat(opts.checkpoint_dir, opts.steps, finished=True)
    finally:
        if run.tensorboard is not None:
            run.tensorboard.close()
        run.engine.close()  # deletes the NVMe tier's files
    return history


def _recovery_clock(run: Run) -> RecoveryClock | None:
    """Rank 0 of a resumed run: what it knows of the failure it recovers from (None elsewhere)."""
    opts = run.opts
    if run.rank != 0 or not (opts.resume and opts.checkpoint_dir):
        return None
    found = checkpoint_io.list_checkpoints(opts.checkpoint_dir)
    return RecoveryClock.start(opts.checkpoint_dir, run.start_step, found[-1][1] if found else None)


def _restart_events(run: Run, note: dict | None, clock: RecoveryClock | None) -> list[dict]:
    """The one event line of a restart, once its first step is done (rank 0): the caller's
    ``note`` (a ``replan``), or a ``resume`` from the checkpoint or snapshot loaded (its step,
    source and path), either with what the recovery cost (``RecoveryClock.measure``: seconds and
    steps lost) when the last run failed; the recovery is also printed on stderr."""
    point = run.resumed_from
    if run.rank != 0 or (note is None and point is None):
        return []
    recovered = clock.measure() if clock is not None else {}
    where = {"source": point[2], "path": point[1]} if point is not None else {}
    event: dict[str, Any]
    if note is None:
        assert point is not None
        message = f"resumed at step {point[0]} from {describe(point)}"
        event = {"kind": "resume", "message": message, "step": point[0], **where}
    else:
        event = {"kind": note["kind"], "message": note["message"], **note.get("fields", {}), **where}
    if recovered:
        event["message"] += f"; {describe_recovery(recovered)}"
        event.update(recovered)
        print(f"[planner] {describe_recovery(recovered)}", file=sys.stderr, flush=True)
    return [event]
