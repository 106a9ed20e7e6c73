"""Our interleaved and zero-bubble pipelines against torch.distributed.pipelining's.

One gloo world of 2 processes (1 torch thread each) trains the same model with every side: a
stack of pre-norm residual MLP blocks (LayerNorm, Linear h -> 4h, GELU, Linear 4h -> h) cut into
``p v`` chunks of equal size, chunk ``c`` on rank ``c % p``, the last chunk ending in a mean
squared error against a target. A step is one forward and backward of all ``m`` micro-batches
(no optimizer: both sides would add the same AdamW), then ``.grad = None``.

======================================  =================================================
PyTorch side                            our side (``runtime.pipeline.executor.PipelineStage``)
======================================  =================================================
``ScheduleInterleaved1F1B`` (v chunks)  ``interleaved_one_f_one_b(p, m, v)``
``ScheduleInterleavedZeroBubble``       ``interleaved_zero_bubble(p, m, v)``
======================================  =================================================

and, for context, ours ``one_f_one_b`` and ``zero_bubble_h1`` with one chunk per rank (the
rank's chunks run as one stage). Sides run interleaved step by step, the order alternating, a
barrier before every step; a step's time is the max over ranks, a side's time the median over
the steps after the warm-up. Peak memory: one extra untimed step per side under
``runtime.training.memtrack.MemoryTracker`` (live tensor storage, parameters registered first), max over
ranks. Every side must give the same mean loss (exit 1 otherwise); the ratios ours / torch of
time and memory are printed with the issue's target (<= 1.0), and beside the time ratio the
*paired* ratio, the median over steps of ``ours_t / torch_t`` (two steps that ran back to back),
which cancels load that drifts over the run on the shared cores.

``python benchmarks/bench_schedules.py [--hidden 512 --blocks 8 --micro-batches 8 --mb 4
--seq 64 --virtual 2 --steps 8 --warmup 2]``; importable as ``run_benchmark(BenchConfig())``.
"""

from __future__ import annotations

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

from benchmarks.bench_cli import bench_main  # noqa: E402

__all__ = ["BenchConfig", "run_benchmark", "format_report", "main"]

#: (torch side, our side) pairs whose ratios are the benchmark's result.
PAIRS = [("torch Interleaved1F1B", "ours interleaved"), ("torch InterleavedZeroBubble", "ours interleaved ZB")]


@dataclass
class BenchConfig:
    """Sizes and measurement of one benchmark run."""

    hidden: int = 512
    """Width h of the blocks (the MLP is h -> 4h -> h)."""
    blocks: int = 8
    """Blocks in the model; must split into p v equal chunks."""
    micro_batches: int = 8
    """m per step; a multiple of the world size (interleaving needs it)."""
    mb: int = 4
    """Sequences per micro-batch."""
    seq: int = 64
    """Tokens per sequence."""
    virtual: int = 2
    """v: chunks per rank of the interleaved sides."""
    steps: int = 8
    """Timed steps per side (the first ``warmup`` are not counted)."""
    warmup: int = 2
    world: int = 2
    memory: bool = True
    """Run one extra tracked step per side for the peak memory."""
    timeout_s: float = 900.0

    def __post_init__(self):
        if self.blocks % (self.world * self.virtual):
            raise ValueError(f"{self.blocks} blocks do not split into {self.world} x {self.virtual} equal chunks")
        if self.micro_batches % self.world:
            raise ValueError(f"micro_batches must be a multiple of the world size {self.world}")
        if self.steps <= self.warmup:
            raise ValueError("steps must exceed warmup")


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Chunk(nn.Module):
    """Consecutive blocks; with ``target`` (our last chunk) it returns the loss."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x, target=None):
        for b in self.blocks:
            x = b(x)
        return x if target is None else F.mse_loss(x, target)


def make_chunks(cfg: BenchConfig, n: int) -> list[Chunk]:
    """The model (same weights on every side: fixed seed) cut into ``n`` equal chunks."""
    torch.manual_seed(0)
    blocks = [Block(cfg.hidden) for _ in range(cfg.blocks)]
    per = cfg.blocks // n
    return [Chunk(blocks[c * per : (c + 1) * per]) for c in range(n)]


def batch(cfg: BenchConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    shape = (cfg.micro_batches * cfg.mb, cfg.seq, cfg.hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


class TorchSide:
    """torch.distributed.pipelining with ``v`` stages per rank (``stage_index = c``)."""

    def __init__(self, cfg: BenchConfig, rank: int, kind: str, group):
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

        p, v = cfg.world, cfg.virtual
        self.name = f"torch {kind}"
        self.cfg, self.rank = cfg, rank
        chunks = make_chunks(cfg, p * v)
        self.modules = [chunks[rank + j * p] for j in range(v)]
        stages = [
            PipelineStage(mod, rank + j * p, p * v, torch.device("cpu"), group=group)
            for j, mod in enumerate(self.modules)
        ]
        cls = ScheduleInterleaved1F1B if kind == "Interleaved1F1B" else ScheduleInterleavedZeroBubble
        self.sched = cls(stages, cfg.micro_batches, loss_fn=F.mse_loss)

    def step(self, step: int) -> float | None:
        x, y = batch(self.cfg, step)
        if self.rank == 0:
            self.sched.step(x)
            loss = None
        else:
            losses: list = []
            self.sched.step(target=y, losses=losses)
            loss = float(torch.stack([t.detach().double() for t in losses]).mean())
        for mod in self.modules:
            mod.zero_grad(set_to_none=True)
        return loss


class OursSide:
    """``runtime.pipeline.executor.PipelineStage`` walking one of our schedules."""

    def __init__(self, cfg: BenchConfig, rank: int, name: str, schedule, v: int, group):
        from runtime.pipeline.executor import PipelineStage, StagePlacement, TensorMeta

        p = cfg.world
        self.name, self.cfg, self.rank, self.v = name, cfg, rank, v
        chunks = make_chunks(cfg, p * v)
        self.modules = [chunks[rank + j * p] for j in range(v)]
        meta = TensorMeta((cfg.mb, cfg.seq, cfg.hidden), torch.float32)
        recv = [[meta] if rank + j * p > 0 else [] for j in range(v)]
        self.stage = PipelineStage(
            self.modules if v > 1 else self.modules[0],
            StagePlacement(
                rank, p, v, prev_rank=(rank - 1) % p, next_rank=(rank + 1) % p, last_rank=p - 1, pp_group=group
            ),
            recv_meta=recv if v > 1 else recv[0],
        )
        self.actions = schedule[rank]

    def step(self, step: int) -> float | None:
        c, p = self.cfg, self.cfg.world
        x, y = batch(c, step)
        xs, ys = x.split(c.mb), y.split(c.mb)
        micro = []
        for i in range(c.micro_batches):
            own = [
                ((xs[i],) if self.rank + j * p == 0 else (ys[i],) if self.rank + j * p == p * self.v - 1 else ())
                for j in range(self.v)
            ]
            micro.append(own if self.v > 1 else own[0])
        loss = self.stage.run(self.actions, micro)
        for mod in self.modules:
            mod.zero_grad(set_to_none=True)
        return loss if self.rank == p - 1 else None


def _sides(cfg: BenchConfig, rank: int, group) -> list:
    from runtime.contract.schedule_ir import (
        interleaved_one_f_one_b,
        interleaved_zero_bubble,
        one_f_one_b,
        zero_bubble_h1,
    )

    p, m, v = cfg.world, cfg.micro_batches, cfg.virtual
    return [
        TorchSide(cfg, rank, "Interleaved1F1B", group),
        OursSide(cfg, rank, "ours interleaved", interleaved_one_f_one_b(p, m, v), v, group),
        TorchSide(cfg, rank, "InterleavedZeroBubble", group),
        OursSide(cfg, rank, "ours interleaved ZB", interleaved_zero_bubble(p, m, v), v, group),
        OursSide(cfg, rank, "ours 1F1B (v=1)", one_f_one_b(p, m), 1, group),
        OursSide(cfg, rank, "ours ZB-H1 (v=1)", zero_bubble_h1(p, m), 1, group),
    ]


def _worker(rank: int, world: int, cfg: BenchConfig, out_path: str) -> None:
    from runtime.training.memtrack import MemoryTracker

    torch.set_num_threads(1)
    group = dist.new_group(list(range(world)))
    sides = _sides(cfg, rank, group)
    n = cfg.steps + (1 if cfg.memory else 0)
    times = torch.zeros(len(sides), cfg.steps, dtype=torch.float64)
    losses = torch.zeros(len(sides), n, dtype=torch.float64)
    peaks = torch.zeros(len(sides), dtype=torch.float64)
    for t in range(n):
        order = list(range(len(sides)))
        for i in order if t % 2 == 0 else order[::-1]:
            side = sides[i]
            dist.barrier()
            if t < cfg.steps:
                t0 = time.perf_counter()
                loss = side.step(t)
                times[i, t] = time.perf_counter() - t0
            else:
                tracker = MemoryTracker(device="cpu", backend="storage")
                tracker.track_existing(side.modules)
                tracker.reset_peak()
                with tracker:
                    loss = side.step(t)
                peaks[i] = tracker.peak_bytes
            if loss is not None:
                losses[i, t] = loss
    for tensor in (times, peaks):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    dist.all_reduce(losses)  # only the last rank reports a loss
    if rank == 0:
        out = {
            s.name: {
                "times": times[i].tolist(),
                "losses": losses[i].tolist(),
                "peak_bytes": int(peaks[i]) if cfg.memory else None,
            }
            for i, s in enumerate(sides)
        }
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(out, f)


def run_benchmark(cfg: BenchConfig, log=print) -> dict:
    """Launch the world, aggregate. Result: ``{"config", "sides": {name: {median_s, peak_bytes,
    losses}}, "ratios": [{pair, time, memory}], "losses_match"}``."""
    from runtime.distributed.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="bench-schedules-") as tmp:
        path = os.path.join(tmp, "out.json")
        log(f"launching {cfg.world} processes ...")
        launch_local(_worker, cfg.world, (cfg, path), timeout_s=cfg.timeout_s, collective_timeout_s=cfg.timeout_s)
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    sides = {
        name: {
            "median_s": statistics.median(r["times"][cfg.warmup :]),
            "peak_bytes": r["peak_bytes"],
            "losses": r["losses"][: cfg.steps],
        }
        for name, r in raw.items()
    }
    ref = next(iter(sides.values()))["losses"]
    diff = max(abs(a - b) / max(abs(b), 1e-12) for s in sides.values() for a, b in zip(s["losses"], ref))
    ratios = []
    for torch_name, ours in PAIRS:
        t, o = sides[torch_name], sides[ours]
        mem = o["peak_bytes"] / t["peak_bytes"] if cfg.memory and t["peak_bytes"] else math.nan
        paired = statistics.median(
            a / b for a, b in zip(raw[ours]["times"][cfg.warmup :], raw[torch_name]["times"][cfg.warmup :])
        )
        ratios.append(
            {"pair": f"{ours} / {torch_name}", "time": o["median_s"] / t["median_s"], "paired": paired, "memory": mem}
        )
    return {
        "config": asdict(cfg),
        "sides": sides,
        "ratios": ratios,
        "loss_max_rel_diff": diff,
        "losses_match": diff < 1e-5,
    }


def format_report(res: dict) -> str:
    c = res["config"]
    lines = [
        f"model: {c['blocks']} blocks of width {c['hidden']}, m={c['micro_batches']} micro-batches of "
        f"{c['mb']} x {c['seq']}, p={c['world']}, v={c['virtual']}; gloo, 1 thread per rank",
        f"{'side':32s} {'median step s':>14s} {'peak MiB':>10s}",
    ]
    for name, s in res["sides"].items():
        mem = f"{s['peak_bytes'] / 2**20:10.1f}" if s["peak_bytes"] is not None else f"{'-':>10s}"
        lines.append(f"{name:32s} {s['median_s']:14.4f} {mem}")
    for r in res["ratios"]:
        lines.append(
            f"{r['pair']:58s} time {r['time']:.3f} (paired {r['paired']:.3f})  memory {r['memory']:.3f}"
            "  (target <= 1.0)"
        )
    lines.append(f"losses agree across sides: {res['losses_match']} (max rel diff {res['loss_max_rel_diff']:.1e})")
    return "\n".join(lines)


def main(argv=None) -> int:
    return bench_main(argv, BenchConfig, __doc__, run_benchmark, format_report, lambda res: res["losses_match"])


try:
    import pytest
except ImportError:  # the script itself does not need pytest
    pytest = None

if pytest is not None:

    @pytest.mark.slow
    @pytest.mark.dist
    def test_benchmark_runs_and_sides_agree():
        """A small run: every side reports a time and memory, and the same losses."""
        res = run_benchmark(
            BenchConfig(hidden=64, blocks=4, micro_batches=4, mb=2, seq=8, steps=3, warmup=1), log=lambda s: None
        )
        print(format_report(res))
        assert res["losses_match"], res["loss_max_rel_diff"]
        assert all(r["time"] > 0 and r["memory"] > 0 for r in res["ratios"])


if __name__ == "__main__":
    sys.exit(main())
