"""Speed and memory of our runtime against the PyTorch engines users would otherwise pick.

Three pairs run side by side in one gloo world of ``world`` processes (2 by default), on the same
built-in GPT (``planner.frontend.zoo.build_model("gpt", ...)``, fp32, AdamW, clipping at norm 1.0) and
the same data: step ``t`` of every side trains on the same global batch of ``world x per_rank``
sequences (``runtime.training.data.SyntheticTokens``), so all six sides must report the same losses.

====== ======================================== =============================================
pair   PyTorch side                             our side (what ``planner train`` runs)
====== ======================================== =============================================
zero0  ``DistributedDataParallel`` (dp=world)   compiled plan dp=world, ZeRO 0
zero3  FSDP2: ``fully_shard`` per block + root  compiled plan dp=world, ZeRO 3
pp     ``pipelining.Schedule1F1B`` (pp=world)   compiled plan pp=world: ``PipelineStage`` +
                                                ``one_f_one_b``, each stage stepped by its own
                                                ZeRO-0 ``ZeroEngine`` with dp=1
====== ======================================== =============================================

Our side uses the compiled path: a ``Plan`` is written for each pair, compiled with
``planner.commands.compile.compile_plan`` (``stage_<k>.py`` + manifest) in the parent process, and every
rank loads it with ``runtime.stages.compiled_stages.load_stage_module``/``load_weights`` and wires
``ZeroEngine`` and ``PipelineStage`` exactly as ``runtime.training.trainer.train_worker`` does. The
PyTorch side wraps the original eager ``nn.Module`` (for ``pp`` it is cut at the same layer-table
rows as the plan: stage 0 = embedding + first blocks, the last stage ends with the head, whose
loss is ``Schedule1F1B``'s ``loss_fn``). Both optimizers are fp32 AdamW with the same
hyper-parameters; torch's runs with its defaults (``foreach`` on CPU is off by default).

Measurement
-----------
- Sides are *interleaved step by step* (step ``t`` of every side before step ``t + 1`` of any),
  and inside a pair the order alternates between steps, so a noisy neighbour on the shared cores
  slows both sides of a pair alike. A barrier precedes every step; a rank's step time is
  ``perf_counter`` around forward, backward, gradient reduction, clipping, optimizer step and
  ``zero_grad``; the step time is the max over ranks; a side's time is the median over the steps
  after ``warmup``. ``--repeats R`` launches the world ``R`` times and reports the median of the
  per-launch medians.
- Peak memory is measured in one extra step per side (the first launch only) under
  ``runtime.training.memtrack.MemoryTracker`` (live tensor storage bytes, the tracker behind the
  ``peak_memory_bytes`` metric), with each side's parameters, gradients and optimizer state
  registered first (our side: ``engine.tracked_tensors()``, torch: module + optimizer; buffers
  an engine keeps privately are counted once an ATen op reads or writes them); the max over
  ranks. The tracker slows ops down, so this step is not timed.
- Ratios: ours/DDP time (target <= 1.05), ours/FSDP2 time (<= 0.9) and memory (<= 1.0),
  ours/Schedule1F1B time (<= 1.0), each the ratio of the two medians. Next to it the *paired*
  ratio: the median over all timed steps of ``ours_t / torch_t``, two steps that ran back to back,
  which cancels load that drifts over a launch.
- DDP keeps a flat copy of all gradients in its reducer buckets (``gradient_as_bucket_view=False``
  by default), allocated in C++ where the tracker cannot see it; its size is added to DDP's peak.

Run ``python benchmarks/bench_runtime.py --help``; importable as ``run_benchmark(BenchConfig())``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

__all__ = ["BenchConfig", "PAIRS", "run_benchmark", "format_report", "main"]

#: pair -> (PyTorch side, our side, [(ratio name, metric, target)])
PAIRS = {
    "zero0": ("DDP", "ours ZeRO-0", [("ours/DDP time", "time", 1.05)]),
    "zero3": ("FSDP2", "ours ZeRO-3", [("ours/FSDP2 time", "time", 0.9), ("ours/FSDP2 memory", "memory", 1.0)]),
    "pp": ("Schedule1F1B", "ours 1F1B", [("ours/Schedule1F1B time", "time", 1.0)]),
}


@dataclass
class BenchConfig:
    """What to benchmark; every field has a command-line flag of the same name."""

    layers: int = 4
    """Transformer blocks of the built-in GPT."""
    hidden: int = 256
    heads: int = 4
    vocab: int = 8192
    seq_len: int = 128
    per_rank: int = 8
    """Sequences per rank per step (the global batch is ``world x per_rank`` for every pair)."""
    dp_micro_batches: int = 1
    """Micro-batches per step on each rank of the zero0/zero3 pairs (gradient accumulation)."""
    pp_micro_batches: int = 4
    """Micro-batches of the global batch in the pp pair (>= world)."""
    steps: int = 8
    """Timed steps per side and launch (the first ``warmup`` are not counted)."""
    warmup: int = 2
    repeats: int = 3
    """Launches of the world; the report gives the median of the per-launch medians."""
    world: int = 2
    pairs: tuple = ("zero0", "zero3", "pp")
    lr: float = 3e-4
    weight_decay: float = 0.1
    clip: float = 1.0
    """Global gradient-norm clipping on every side (0 disables it)."""
    seed: int = 0
    threads: int = 0
    """torch intra-op threads per process; 0: cores / world (at least 1)."""
    bucket_mb: float = 0.0
    """Our ``ShardingConfig.bucket_bytes`` in MiB; 0 keeps the engine default (what ``planner train``
    uses)."""
    memory: bool = True
    """Measure peak memory (one extra, untimed, tracked step per side in the first launch)."""
    timeout_s: float = 1200.0
    """Bound on one launch."""
    loss_rtol: float = 1e-4
    """Relative loss difference above which a pair is flagged as a mismatch."""

    def __post_init__(self):
        self.pairs = tuple(self.pairs)
        bad = [p for p in self.pairs if p not in PAIRS]
        if bad or not self.pairs:
            raise ValueError(f"unknown pair(s) {bad}; choose from {list(PAIRS)}")
        if self.steps <= self.warmup:
            raise ValueError(f"steps ({self.steps}) must exceed warmup ({self.warmup})")
        if self.per_rank % self.dp_micro_batches:
            raise ValueError(
                f"per_rank ({self.per_rank}) must be divisible by dp_micro_batches ({self.dp_micro_batches})"
            )
        if "pp" in self.pairs:
            if self.pp_micro_batches < self.world:
                raise ValueError(f"pp_micro_batches ({self.pp_micro_batches}) must be >= world ({self.world})")
            if (self.world * self.per_rank) % self.pp_micro_batches:
                raise ValueError(
                    f"the global batch {self.world * self.per_rank} is not divisible by "
                    f"pp_micro_batches ({self.pp_micro_batches})"
                )
            if self.layers + 2 < self.world:
                raise ValueError(f"{self.layers} blocks cannot be cut into {self.world} pipeline stages")

    @property
    def global_batch(self) -> int:
        return self.world * self.per_rank

    @property
    def sizes(self) -> dict:
        return dict(layers=self.layers, hidden=self.hidden, heads=self.heads, vocab=self.vocab, seq_len=self.seq_len)


# --------------------------------------------------------------------------- plans (parent)


def make_plan(cfg: BenchConfig, pair: str):
    """The plan our side of ``pair`` runs (predictions are placeholders: the runtime ignores them)."""
    from tests.helpers import manual_plan

    w = cfg.world
    if pair == "pp":
        dp, pp, zero = 1, w, 0
        mbs, m = cfg.global_batch // cfg.pp_micro_batches, cfg.pp_micro_batches
    else:
        dp, pp, zero = w, 1, (0 if pair == "zero0" else 3)
        mbs, m = cfg.per_rank // cfg.dp_micro_batches, cfg.dp_micro_batches
    return manual_plan("gpt", cfg.sizes, dp=dp, pp=pp, zero=zero, mbs=mbs, m=m, seq_len=cfg.seq_len)


def compile_pairs(cfg: BenchConfig, out_dir: str) -> dict[str, str]:
    """Compile the plan of each pair into ``out_dir/<pair>``; returns pair -> directory."""
    from planner.commands.compile import compile_plan

    dirs = {}
    for pair in cfg.pairs:
        d = os.path.join(out_dir, pair)
        compile_plan(make_plan(cfg, pair), d)
        dirs[pair] = d
    return dirs


# --------------------------------------------------------------------------- sides (ranks)


def _build_gpt(cfg: BenchConfig) -> nn.Module:
    from planner.frontend.zoo import ModelSizes, build_model

    return build_model("gpt", ModelSizes(**cfg.sizes), seed=cfg.seed).model


def _adamw(cfg: BenchConfig, params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay)


class Side:
    """One engine on this rank: ``step(t)`` trains on step ``t``'s batch and returns this rank's
    loss for it (``None`` where the rank does not see the loss); ``tracked()`` lists what the
    memory tracker must register before a tracked step."""

    name = ""

    def __init__(self, cfg: BenchConfig, rank: int, world: int):
        from runtime.training.data import SyntheticTokens

        self.cfg, self.rank, self.world = cfg, rank, world
        self.data = SyntheticTokens(cfg.vocab, cfg.seq_len, cfg.seed)

    def local_rows(self, step: int):
        c = self.cfg
        lo = self.rank * c.per_rank
        return self.data.rows(step, lo, lo + c.per_rank, c.global_batch)

    def step(self, step: int) -> float | None:
        raise NotImplementedError

    def tracked(self) -> list:
        raise NotImplementedError

    def untracked_bytes(self) -> int:
        """Bytes the engine holds where the tracker cannot see them (added to its peak)."""
        return 0

    def torch_step(self, step: int, forward, params, no_sync=None) -> float:
        """Gradient accumulation over ``dp_micro_batches``, clipping and a torch AdamW step
        (the DDP and FSDP2 sides); ``no_sync`` skips the reduction of all but the last."""
        ids, labels = self.local_rows(step)
        m = self.cfg.dp_micro_batches
        total = 0.0
        for i, (x, y) in enumerate(zip(ids.chunk(m), labels.chunk(m))):
            ctx = no_sync() if no_sync is not None and i < m - 1 else contextlib.nullcontext()
            with ctx:
                loss = forward(x, y)
                (loss / m).backward()
            total += loss.item() / m
        if self.cfg.clip:
            torch.nn.utils.clip_grad_norm_(params, self.cfg.clip)
        self.opt.step()
        self.opt.zero_grad()
        return total


class DDPSide(Side):
    name = "DDP"

    def __init__(self, cfg, rank, world):
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().__init__(cfg, rank, world)
        self.model = _build_gpt(cfg)
        self.ddp = DDP(self.model, process_group=dist.new_group(list(range(world))))
        self.opt = _adamw(cfg, self.model.parameters())

    def step(self, step):
        return self.torch_step(step, self.ddp, list(self.model.parameters()), no_sync=self.ddp.no_sync)

    def tracked(self):
        return [self.model, self.opt]

    def untracked_bytes(self):
        """DDP's reducer keeps one flat gradient bucket per bucket, together the size of all
        gradients (``gradient_as_bucket_view=False``, the default), allocated in C++ at
        construction and copied into by the reducer outside the dispatcher's Python modes."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)


class FSDP2Side(Side):
    name = "FSDP2"

    def __init__(self, cfg, rank, world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        super().__init__(cfg, rank, world)
        self.model = _build_gpt(cfg)
        mesh = init_device_mesh("cpu", (world,))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = _adamw(cfg, self.model.parameters())

    def step(self, step):
        return self.torch_step(step, self.model, list(self.model.parameters()))

    def tracked(self):
        return [self.model, self.opt]


class _TorchStage(nn.Module):
    """Rows ``[first, last]`` of the eager GPT's layer table as one pipelining stage module."""

    def __init__(self, gpt: nn.Module, first: int, last: int):
        super().__init__()
        L = len(gpt.blocks)
        self.embed = gpt.embed if first == 0 else None
        self.blocks = nn.ModuleList(gpt.blocks[i - 1] for i in range(max(first, 1), min(last, L) + 1))
        self.head = gpt.head if last == L + 1 else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        if self.head is not None:  # logits; Schedule1F1B's loss_fn applies the cross-entropy
            x = self.head.lm_head(self.head.ln_f(x))
        return x


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The built-in GPT's loss (``planner.frontend.gpt.Head``) on the head's logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def clip_across_(params: list[torch.Tensor], max_norm: float, group) -> float:
    """Clip gradients held by all ranks of ``group`` (each holds different parameters) to one
    global L2 norm: ``sqrt(sum over ranks of the local sum of g^2)``, torch's coefficient."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq += g.double().pow(2).sum()
    dist.all_reduce(sq, group=group)
    norm = math.sqrt(float(sq))
    coef = min(1.0, max_norm / (norm + 1e-6))
    for g in grads:
        g.mul_(coef)
    return norm


class TorchPPSide(Side):
    name = "Schedule1F1B"

    def __init__(self, cfg, rank, world):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from tests.helpers import even_stages

        super().__init__(cfg, rank, world)
        first, last = even_stages(cfg.layers, world)[rank]
        self.module = _TorchStage(_build_gpt(cfg), first, last)  # the rest of the model is dropped
        self.group = dist.new_group(list(range(world)))
        stage = PipelineStage(self.module, rank, world, torch.device("cpu"), group=self.group)
        self.sched = Schedule1F1B(stage, cfg.pp_micro_batches, loss_fn=_lm_loss)
        self.opt = _adamw(cfg, self.module.parameters())

    def step(self, step):
        c = self.cfg
        ids, labels = self.data.rows(step, 0, c.global_batch, c.global_batch)
        loss = None
        if self.rank == 0:
            self.sched.step(ids)
        elif self.rank == self.world - 1:
            losses: list = []
            self.sched.step(target=labels, losses=losses)
            loss = float(torch.stack([l.detach().double() for l in losses]).mean())
        else:
            self.sched.step()
        if c.clip:
            clip_across_(list(self.module.parameters()), c.clip, self.group)
        self.opt.step()
        self.opt.zero_grad()
        return loss

    def tracked(self):
        return [self.module, self.opt]


class OursSide(Side):
    """A compiled plan run the way ``runtime.training.trainer.train_worker`` runs it."""

    def __init__(self, cfg, rank, world, compiled_dir: str, name: str):
        import runtime
        from runtime.contract.schedule_ir import one_f_one_b
        from runtime.data_parallel.zero_engine import OptimizerConfig, ParallelContext, ShardingConfig, ZeroEngine
        from runtime.pipeline.executor import PipelineStage, StagePlacement, TensorMeta
        from runtime.stages.compiled_stages import (
            load_stage_module,
            load_weights,
            param_groups,
            rank_chunks,
            read_manifest,
        )
        from runtime.training.data import rank_slice

        super().__init__(cfg, rank, world)
        self.name = name
        runtime.set_device(torch.device("cpu"))
        man = read_manifest(compiled_dir)
        plan = man["plan"]
        dp, pp = plan["dp"], plan["pp"]
        group = dist.new_group(list(range(world)))
        pp_index = rank if pp > 1 else 0
        chunks = rank_chunks(man, pp_index)
        if len(chunks) != 1:
            raise ValueError("bench_runtime compares one stage per rank; plan it without --virtual-stages")
        stage = chunks[0]
        self.module = load_stage_module(compiled_dir, stage, "cpu")
        load_weights(self.module, stage, _build_gpt(cfg).state_dict())
        self.m, self.mbs = plan["num_micro_batches"], plan["micro_batch_size"]
        self.engine = ZeroEngine(
            self.module,
            layers=param_groups(self.module),
            dp_group=group if dp > 1 else None,
            sharding=ShardingConfig(
                zero_stage=plan["zero_stage"],
                param_dtype=torch.float32,
                micro_batches_per_step=self.m,
                **({"bucket_bytes": int(cfg.bucket_mb * 2**20)} if cfg.bucket_mb else {}),
            ),
            optimizer=OptimizerConfig(
                lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay, max_grad_norm=cfg.clip or None
            ),
            parallel=ParallelContext(norm_groups=[group] if pp > 1 else []),
        )
        recv = [
            TensorMeta(tuple(r["shape"]), getattr(torch, r["dtype"]), bool(r["requires_grad"])) for r in stage["recv"]
        ]
        placement = StagePlacement(
            pp_index,
            pp,
            prev_rank=pp_index - 1 if pp_index > 0 else None,
            next_rank=pp_index + 1 if pp_index < pp - 1 else None,
            pp_group=group if pp > 1 else None,
            last_rank=pp - 1 if pp > 1 else None,
        )
        self.pstage = PipelineStage(self.module, placement, recv_meta=recv)
        self.actions = one_f_one_b(pp, self.m)[pp_index]
        self.names = stage["data_inputs"]
        self.lo, self.hi = rank_slice(plan["global_batch"], dp, rank if dp > 1 else 0)
        self.pp, self.B = pp, plan["global_batch"]

    def step(self, step):
        ids, labels = self.data.rows(step, self.lo, self.hi, self.B)
        src = {"input_ids": ids, "labels": labels}
        micro = [tuple(src[n][i * self.mbs : (i + 1) * self.mbs] for n in self.names) for i in range(self.m)]
        loss = self.pstage.run(self.actions, micro, loss_scale=self.engine.loss_scale)
        self.engine.step(lr=self.cfg.lr)
        self.engine.zero_grad()
        return loss if (self.pp == 1 or self.rank == self.pp - 1) else None

    def tracked(self):
        return [self.engine.tracked_tensors(), self.module]


# --------------------------------------------------------------------------- the rank worker


def _tolerate_non_tensor_inner_attrs() -> None:
    """Work around ``runtime.training.memtrack._storages_of`` failing on DTensor (FSDP2's parameters).

    torch 2.13's ``DTensor.__tensor_flatten__`` names ``["_local_tensor", "device_mesh"]``; the
    tracker recurses into every name and calls ``.layout`` on the ``DeviceMesh``. In this process
    only, inner attributes that are not tensors are skipped (harmless once memtrack does so).
    """
    import runtime.training.memtrack as mt

    orig = getattr(mt._storages_of, "__wrapped__", mt._storages_of)

    def storages_of(t):
        if not isinstance(t, torch.Tensor):
            return []
        if mt.is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            return [st for n in names for st in storages_of(getattr(t, n))]
        return orig(t)

    storages_of.__wrapped__ = orig
    mt._storages_of = storages_of


def _worker(rank: int, world: int, cfg: BenchConfig, dirs: dict[str, str], out_path: str, memory: bool):
    """Build every side, run the interleaved timed steps and the tracked steps, write results."""
    from runtime.training.memtrack import MemoryTracker

    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // world))
    if memory:
        _tolerate_non_tensor_inner_attrs()
    pairs: list[tuple[str, Side, Side]] = []
    for pair in cfg.pairs:
        torch_cls = {"zero0": DDPSide, "zero3": FSDP2Side, "pp": TorchPPSide}[pair]
        pairs.append((pair, torch_cls(cfg, rank, world), OursSide(cfg, rank, world, dirs[pair], PAIRS[pair][1])))
    sides = [s for _, a, b in pairs for s in (a, b)]
    n_steps = cfg.steps + (1 if memory else 0)
    times = torch.zeros(len(sides), cfg.steps, dtype=torch.float64)
    losses = torch.full((len(sides), n_steps), float("nan"), dtype=torch.float64)
    seen = torch.zeros(len(sides), n_steps, dtype=torch.float64)  # ranks that reported a loss
    peaks = torch.zeros(len(sides), dtype=torch.float64)
    for t in range(n_steps):
        for k, (pair, a, b) in enumerate(pairs):
            for side in (a, b) if (t + k) % 2 == 0 else (b, a):
                i = sides.index(side)
                dist.barrier()
                if t < cfg.steps:
                    t0 = time.perf_counter()
                    loss = side.step(t)
                    times[i, t] = time.perf_counter() - t0
                else:  # the untimed memory step
                    tracker = MemoryTracker(device="cpu", backend="storage")
                    tracker.track_existing(*side.tracked())
                    tracker.reset_peak()
                    with tracker:
                        loss = side.step(t)
                    peaks[i] = tracker.peak_bytes + side.untracked_bytes()
                if loss is not None:
                    losses[i, t] = 0.0 if math.isnan(losses[i, t]) else losses[i, t]
                    losses[i, t] += loss
                    seen[i, t] += 1
    # Aggregate over ranks: time and memory as the max, loss as the mean of reporting ranks.
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    lsum = torch.nan_to_num(losses, nan=0.0)
    dist.all_reduce(lsum)
    dist.all_reduce(seen)
    if rank == 0:
        out = {}
        for i, s in enumerate(sides):
            out[s.name] = {
                "times": times[i].tolist(),
                "losses": (lsum[i] / seen[i].clamp(min=1)).tolist(),
                "peak_bytes": int(peaks[i]) if memory else None,
            }
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(out, f)


# --------------------------------------------------------------------------- driver


def run_benchmark(cfg: BenchConfig, log=print) -> dict:
    """Compile, launch ``cfg.repeats`` worlds, aggregate; returns the result dict (see ``format_report``).

    Result: ``{"config": ..., "sides": {name: {"median_s", "medians_s", "peak_bytes", "losses"}},
    "pairs": {pair: {"torch", "ours", "ratios": [{name, value, target, ok}], "loss_max_rel_diff"}}}``.
    """
    from runtime.distributed.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp:
        t0 = time.perf_counter()
        dirs = compile_pairs(cfg, os.path.join(tmp, "compiled"))
        log(f"compiled {len(dirs)} plan(s) in {time.perf_counter() - t0:.1f} s")
        runs = []
        for r in range(cfg.repeats):
            out = os.path.join(tmp, f"run{r}.json")
            t0 = time.perf_counter()
            launch_local(_worker, cfg.world, (cfg, dirs, out, cfg.memory and r == 0), timeout_s=cfg.timeout_s)
            with open(out, encoding="utf-8") as f:
                runs.append(json.load(f))
            log(f"launch {r + 1}/{cfg.repeats} done in {time.perf_counter() - t0:.1f} s")
    return aggregate(cfg, runs)


def aggregate(cfg: BenchConfig, runs: list[dict]) -> dict:
    sides = {}
    for name in runs[0]:
        meds = [statistics.median(run[name]["times"][cfg.warmup :]) for run in runs]
        sides[name] = {
            "median_s": statistics.median(meds),
            "medians_s": meds,
            "peak_bytes": runs[0][name]["peak_bytes"],
            "losses": runs[0][name]["losses"],
        }
    pairs = {}
    for pair in cfg.pairs:
        tname, oname, targets = PAIRS[pair]
        ts, os_ = sides[tname], sides[oname]
        ratios = []
        # Paired: step t of both sides ran back to back, so their ratio cancels slow drifts.
        paired = [run[oname]["times"][t] / run[tname]["times"][t] for run in runs for t in range(cfg.warmup, cfg.steps)]
        for rname, metric, target in targets:
            if metric == "time":
                v, pv = os_["median_s"] / ts["median_s"], statistics.median(paired)
            elif ts["peak_bytes"]:
                v, pv = os_["peak_bytes"] / ts["peak_bytes"], None
            else:
                continue
            ratios.append({"name": rname, "value": v, "paired": pv, "target": target, "ok": v <= target})
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(os_["losses"], ts["losses"]))
        pairs[pair] = {
            "torch": tname,
            "ours": oname,
            "ratios": ratios,
            "loss_max_rel_diff": rel,
            "losses_match": rel <= cfg.loss_rtol,
        }
    return {"config": asdict(cfg), "sides": sides, "pairs": pairs}


def format_report(res: dict) -> str:
    """Losses per step, the table of medians and peaks, and the ratios against their targets."""
    cfg = res["config"]
    lines = [
        f"GPT {cfg['layers']} x {cfg['hidden']} (heads {cfg['heads']}, vocab {cfg['vocab']}, seq "
        f"{cfg['seq_len']}), fp32 AdamW, {cfg['per_rank']} sequences per rank, world {cfg['world']}, "
        f"{cfg['steps']} steps ({cfg['warmup']} warm-up), {cfg['repeats']} launch(es)",
        "",
        "losses per step (the last one is the tracked memory step):",
    ]
    for name, s in res["sides"].items():
        lines.append(f"  {name:<14} " + " ".join(f"{x:.5f}" for x in s["losses"]))
    lines += ["", f"{'pair':<6} {'side':<14} {'median step s':>13} {'per launch':>24} {'peak MiB':>9}"]
    for pair, p in res["pairs"].items():
        for name in (p["torch"], p["ours"]):
            s = res["sides"][name]
            per = ",".join(f"{x:.3f}" for x in s["medians_s"])
            mem = f"{s['peak_bytes'] / 2**20:9.1f}" if s["peak_bytes"] else f"{'-':>9}"
            lines.append(f"{pair:<6} {name:<14} {s['median_s']:13.4f} {per:>24} {mem}")
    lines += ["", f"{'ratio':<24} {'value':>7} {'paired':>7} {'target':>8}  result"]
    for pair, p in res["pairs"].items():
        for r in p["ratios"]:
            pv = f"{r['paired']:7.3f}" if r.get("paired") is not None else f"{'':>7}"
            lines.append(
                f"{r['name']:<24} {r['value']:7.3f} {pv} {'<= ' + format(r['target'], '.2f'):>8}  "
                f"{'ok' if r['ok'] else 'MISSED'}"
            )
        lines.append(
            f"{pair + ' losses max rel diff':<24} {p['loss_max_rel_diff']:7.1e} {'':>7} "
            f"{'':>8}  {'same' if p['losses_match'] else 'MISMATCH'}"
        )
    lines += [
        "",
        "value: ratio of the medians; paired: median over steps of the two sides' step-time "
        "ratio (adjacent steps); result judges value.",
        "DDP's peak includes its gradient buckets (the size of all gradients), which the tracker cannot see.",
    ]
    return "\n".join(lines)


def parse_args(argv=None) -> tuple[BenchConfig, argparse.Namespace]:
    d = BenchConfig()
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f_name in (
        "layers",
        "hidden",
        "heads",
        "vocab",
        "seq_len",
        "per_rank",
        "dp_micro_batches",
        "pp_micro_batches",
        "steps",
        "warmup",
        "repeats",
        "world",
        "seed",
        "threads",
    ):
        ap.add_argument("--" + f_name.replace("_", "-"), type=int, default=getattr(d, f_name))
    for f_name in ("lr", "weight_decay", "clip", "timeout_s", "loss_rtol", "bucket_mb"):
        ap.add_argument("--" + f_name.replace("_", "-"), type=float, default=getattr(d, f_name))
    ap.add_argument("--pairs", default=",".join(d.pairs), help=f"comma-separated subset of {','.join(PAIRS)}")
    ap.add_argument("--no-memory", action="store_true", help="skip the tracked memory step")
    ap.add_argument("--json", metavar="FILE", help="also write the result dict as JSON")
    a = ap.parse_args(argv)
    kw = {
        k: getattr(a, k)
        for k in (
            "layers",
            "hidden",
            "heads",
            "vocab",
            "seq_len",
            "per_rank",
            "dp_micro_batches",
            "pp_micro_batches",
            "steps",
            "warmup",
            "repeats",
            "world",
            "seed",
            "threads",
            "lr",
            "weight_decay",
            "clip",
            "timeout_s",
            "loss_rtol",
            "bucket_mb",
        )
    }
    try:
        cfg = BenchConfig(pairs=tuple(p for p in a.pairs.split(",") if p), memory=not a.no_memory, **kw)
    except ValueError as e:
        ap.error(str(e))
    return cfg, a


def main(argv=None) -> int:
    cfg, a = parse_args(argv)
    res = run_benchmark(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_report(res))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0 if all(p["losses_match"] for p in res["pairs"].values()) else 1


# --------------------------------------------------------------------------- pytest (make bench)

try:
    import pytest
except ImportError:  # the script itself does not need pytest
    pytest = None

if pytest is not None:

    @pytest.mark.slow
    @pytest.mark.dist
    def test_benchmark_runs_and_sides_agree():
        """A small run of all three pairs: every pair reports times, ratios and equal losses."""
        cfg = BenchConfig(
            layers=2,
            hidden=64,
            heads=4,
            vocab=256,
            seq_len=32,
            per_rank=4,
            pp_micro_batches=2,
            steps=4,
            warmup=2,
            timeout_s=300,
        )
        res = run_benchmark(cfg, log=lambda s: None)
        print(format_report(res))
        for pair, p in res["pairs"].items():
            assert p["losses_match"], (pair, p["loss_max_rel_diff"])
            assert all(math.isfinite(r["value"]) and r["value"] > 0 for r in p["ratios"])
        assert res["sides"]["FSDP2"]["peak_bytes"] > 0 and res["sides"]["ours ZeRO-3"]["peak_bytes"] > 0


if __name__ == "__main__":
    sys.exit(main())
