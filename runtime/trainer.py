"""The training loop that runs compiled stages on the (pp, dp, tp) mesh.

One process per rank calls ``train_worker``. Each step:

1. reads rows ``[d * B/dp, (d + 1) * B/dp)`` of step ``t``'s global batch (``runtime.data``),
   split into ``num_micro_batches`` micro-batches;
2. walks this rank's 1F1B action list (``runtime.schedule``/``runtime.pipeline``; with one stage
   that is forward, backward per micro-batch) accumulating gradients;
3. lets the ZeRO engine reduce gradients over dp, clip by the global norm, and step AdamW with
   the learning rate of the warmup + cosine schedule;
4. rank 0 appends one metrics line (``step, loss, step_time_s, tokens_per_s, peak_memory_bytes,
   comm_bytes, lr`` and ``loss_scale`` in fp16), where ``loss`` is the mean over the global batch,
   ``peak_memory_bytes`` and ``comm_bytes`` the max over ranks.

Checkpoints (``runtime.checkpoint_io``) save and restore everything a bit-identical resume needs.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist

import runtime
from runtime import comm
from runtime.compiled import load_stage_module, load_weights, param_groups, read_manifest
from runtime.data import open_data, rank_slice
from runtime.mesh import setup_mesh
from runtime.pipeline import PipelineStage, TensorMeta
from runtime.schedule import one_f_one_b

__all__ = ["TrainOptions", "lr_at", "schedule_of", "train_worker", "StepMetrics", "DTYPE_OF"]

DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainOptions:
    """Everything ``planner train`` passes to each rank."""

    steps: int
    """Total optimizer steps of the run (a resumed run continues up to this number)."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 0
    """Linear warmup steps from 0 to ``lr``."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    """Clip gradients to this global L2 norm (None: no clipping)."""
    seed: int = 0
    """Fixes initialization and data."""
    data_path: str | None = None
    """Token file or UTF-8 text; None for synthetic tokens."""
    metrics_path: str | None = None
    """Rank 0 appends one JSON object per step here."""
    checkpoint_dir: str | None = None
    save_every: int = 0
    """Save a checkpoint every K steps (and at the end) when ``checkpoint_dir`` is set."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    resume: bool = False
    """Continue from the newest checkpoint in ``checkpoint_dir``."""
    timeout_s: float = 300.0
    """Seconds any collective may wait before the run fails."""
    track_memory: bool = True
    """Measure peak live tensor bytes (slower on CPU)."""
    memory_steps: int | None = None
    """Track memory only in the first N steps of this run (later steps report that peak and run
    at full speed); None tracks every step."""
    progress: bool = True
    """Show a progress bar on rank 0."""


def schedule_of(o: TrainOptions) -> dict:
    """What fixes the learning rate of every step; each checkpoint records it, so a resume under
    another schedule can say so."""
    return {"steps": o.steps, "lr": o.lr, "min_lr": o.min_lr, "warmup": o.warmup_steps}


def lr_at(step: int, o: TrainOptions) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``."""
    if o.warmup_steps > 0 and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, o.steps - o.warmup_steps)
    t = min(1.0, (step - o.warmup_steps) / span)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + math.cos(math.pi * t))


@dataclass
class StepMetrics:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    peak_memory_bytes: int
    comm_bytes: float
    lr: float
    loss_scale: float | None = None
    grad_norm: float | None = None
    comm_wait_s: float = 0.0
    """Seconds the slowest rank spent blocked in collectives this step (unhidden communication)."""

    def to_json(self) -> str:
        d = asdict(self)
        if d["loss_scale"] is None:
            d.pop("loss_scale")
        if d["grad_norm"] is None:
            d.pop("grad_norm")
        return json.dumps(d)


def _recv_meta(stage: dict) -> list[TensorMeta]:
    """What this stage receives, from the manifest."""
    metas = []
    for r in stage["recv"]:
        dt = getattr(torch, r["dtype"])
        metas.append(TensorMeta(tuple(r["shape"]), dt, bool(r["requires_grad"])))
    return metas


#: The step (counted from the run's first) that ``PLANNER_PROFILE=DIR`` profiles: the first after
#: two warm-up steps, as ``planner validate`` times them.
PROFILE_STEP = 2


def _start_profiler(index: int):
    """A running ``torch.profiler`` for this step when ``PLANNER_PROFILE`` asks for it, else None."""
    if not os.environ.get("PLANNER_PROFILE") or index != PROFILE_STEP:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    prof.__enter__()
    return prof


def _write_profile(prof, rank: int, step: int) -> None:
    """Stop ``prof``; write this rank's operator table (by self time) and a Chrome trace."""
    prof.__exit__(None, None, None)
    out = os.environ["PLANNER_PROFILE"]
    os.makedirs(out, exist_ok=True)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(os.path.join(out, f"rank{rank}-step{step}.txt"), "w", encoding="utf-8") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=50))
    prof.export_chrome_trace(os.path.join(out, f"rank{rank}-step{step}.json"))


def _fault_injection(rank: int) -> int | None:
    """Test hook: ``PLANNER_FAULT_KILL=RANK:STEP`` SIGKILLs that rank before that step."""
    spec = os.environ.get("PLANNER_FAULT_KILL")
    if not spec:
        return None
    r, _, s = spec.partition(":")
    return int(s) if int(r) == rank else None


def _fault_hang(rank: int, step: int) -> None:
    """Test hook: ``PLANNER_FAULT_HANG=RANK:STEP`` makes that rank stop answering at that step."""
    spec = os.environ.get("PLANNER_FAULT_HANG")
    if spec:
        r, _, s = spec.partition(":")
        if int(r) == rank and int(s) == step:
            time.sleep(3600)


def train_worker(rank: int, world: int, compiled_dir: str, opts: TrainOptions,
                 state_fn: Callable[[], Mapping[str, torch.Tensor]],
                 on_metrics: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
    """Train on this rank. ``state_fn`` returns the original model's tensors by name."""
    from runtime.zero import ZeroEngine  # deferred: heavy and only needed here

    man = read_manifest(compiled_dir)
    plan = man["plan"]
    pp, dp, tp = plan["pp"], plan["dp"], plan["tp"]
    mesh = setup_mesh(pp, dp, tp)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.is_initialized() and \
        dist.get_backend() == "nccl" else torch.device("cpu")
    runtime.set_device(dev)
    stage = man["stages"][mesh.pp_index]
    dtype = DTYPE_OF[plan["dtype"]]
    torch.manual_seed(opts.seed)
    module = load_stage_module(compiled_dir, stage, dev)
    load_weights(module, stage, state_fn(), mesh.tp_index, tp)
    replicated = {attr for attr, e in stage["params"].items() if not e.get("shard")}
    engine = ZeroEngine(
        module,
        layers=param_groups(module),
        dp_group=mesh.dp_group,
        zero_stage=plan["zero_stage"],
        param_dtype=dtype,
        lr=opts.lr,
        betas=(opts.beta1, opts.beta2),
        eps=opts.eps,
        weight_decay=opts.weight_decay,
        max_grad_norm=opts.max_grad_norm,
        norm_groups=[g for g in (mesh.tp_group, mesh.pp_group) if g is not None],
        replicated_param_filter=(lambda name: name in replicated) if tp > 1 else None,
        micro_batches_per_step=plan["num_micro_batches"],
    )
    m = plan["num_micro_batches"]
    mbs = plan["micro_batch_size"]
    B = plan["global_batch"]
    seq = plan["seq_len"]
    actions = one_f_one_b(pp, m)[mesh.pp_index]
    pstage = PipelineStage.from_mesh(engine.module, recv_meta=_recv_meta(stage), mesh=mesh, device=dev)
    data = open_data(opts.data_path, man["model"]["vocab"], seq, opts.seed)
    lo, hi = rank_slice(B, dp, mesh.dp_index)
    start_step = 0
    ckpt = None
    if opts.checkpoint_dir:
        from runtime import checkpoint_io as ckpt
        if opts.resume:
            start_step = ckpt.load_latest(opts.checkpoint_dir, engine, man, mesh)
    tracker = None
    if opts.track_memory:
        from runtime.memtrack import MemoryTracker
        tracker = MemoryTracker(device=dev)
        tracker.track_existing(engine.tracked_tensors() if hasattr(engine, "tracked_tensors") else
                               list(engine.module.parameters()))
    history: list[StepMetrics] = []
    last_peak = 0
    names = stage["data_inputs"]
    graph_inputs = man["model"].get("inputs", ["input_ids", "labels"])
    if len(graph_inputs) != 2:
        raise ValueError(f"the trainer feeds (tokens, targets); this model takes {len(graph_inputs)} inputs "
                         f"{graph_inputs}")
    kill = _fault_injection(rank)
    for step in range(start_step, opts.steps):
        if kill is not None and step == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        _fault_hang(rank, step)
        ids, labels = data.rows(step, lo, hi, B)
        ids, labels = ids.to(dev), labels.to(dev)
        # The model's inputs in order are (tokens, targets), whatever the model calls them.
        src = dict(zip(graph_inputs, (ids, labels)))
        micro = [tuple(src[n][i * mbs:(i + 1) * mbs] for n in names) for i in range(m)]
        lr = lr_at(step, opts)
        comm.STATS.reset()
        t0 = time.perf_counter()
        tracking = tracker is not None and (opts.memory_steps is None or step - start_step < opts.memory_steps)
        if tracking:
            tracker.reset_peak()
            tracker.__enter__()
        prof = _start_profiler(step - start_step)
        try:
            loss = pstage.run(actions, micro, loss_scale=engine.loss_scale)
            info = engine.step(lr=lr)
            engine.zero_grad()
        finally:
            if prof is not None:
                _write_profile(prof, rank, step + 1)
            if tracking:
                tracker.__exit__(None, None, None)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        sent = comm.STATS.total
        if tracking:
            last_peak = max(last_peak, tracker.peak_bytes) if opts.memory_steps is not None else tracker.peak_bytes
            if os.environ.get("PLANNER_DEBUG_MEMORY"):
                print(f"[planner] rank {rank} step {step + 1}: peak {tracker.peak_bytes / 2**20:.2f} MiB after "
                      f"{tracker.peak_op or '(step start)'}; {tracker.current_bytes / 2**20:.2f} MiB live at the end",
                      file=sys.stderr, flush=True)
        peak = last_peak
        # Aggregate: loss is a mean over dp ranks; memory and bytes the max over all ranks.
        agg = torch.tensor([loss, 0.0, 0.0], dtype=torch.float64, device=dev)
        mx = torch.tensor([float(peak), sent, dt, comm.STATS.wait_s], dtype=torch.float64, device=dev)
        if dist.is_initialized() and world > 1:
            if mesh.dp_group is not None:
                dist.all_reduce(agg, group=mesh.dp_group)
                agg /= dp
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        step_time = float(mx[2])
        met = StepMetrics(
            step=step + 1, loss=float(agg[0]), step_time_s=step_time,
            tokens_per_s=B * seq / step_time if step_time > 0 else 0.0,
            peak_memory_bytes=int(mx[0]), comm_bytes=float(mx[1]), lr=lr,
            loss_scale=info.loss_scale if plan["dtype"] == "fp16" else None,
            grad_norm=info.grad_norm, comm_wait_s=float(mx[3]),
        )
        history.append(met)
        if rank == 0:
            if opts.metrics_path:
                with open(opts.metrics_path, "a", encoding="utf-8") as f:
                    f.write(met.to_json() + "\n")
            if on_metrics is not None:
                on_metrics(met)
        if ckpt is not None and opts.save_every and ((step + 1) % opts.save_every == 0 or step + 1 == opts.steps):
            ckpt.save(opts.checkpoint_dir, step + 1, engine, man, mesh, keep_last=opts.keep_last,
                      schedule=schedule_of(opts))
    return history
