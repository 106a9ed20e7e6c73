"""``planner calibrate``: measure this machine and write a hardware profile for it.

What is measured, with ``nproc`` local gloo processes each standing for one device (each gets
``cpu_count // nproc`` intra-op threads, as ``runtime.dist.launch_local`` sets for training):

- **Matmul throughput** per dtype (fp32, bf16, fp16; a dtype whose matmul fails is skipped) at a
  few square sizes, all ranks at once so that they share the cores as they do in training.
  ``peak_flops[dtype]`` is the best per-rank rate seen (``2 n^3`` FLOPs per ``n x n`` product),
  and ``compute_efficiency`` is the ratio of a real training step's FLOP/s (a small built-in GPT,
  forward + backward, every rank at once) to that peak.
- **Memory bandwidth**: a large tensor copy on every rank at once (read + write bytes / time),
  timed between the rounds of training steps.
- **Recomputation**: two exported blocks timed plain, checkpointed and forward-only;
  ``recompute_ratio`` is what checkpointing adds over the forward (``_time_recompute``).
- **Collectives**: all-reduce, all-gather and reduce-scatter over all ranks, and send/recv
  ping-pong between rank pairs, for message sizes from 4 KB to 16 MB. Each time is the slowest
  rank's mean over a few repetitions after a warm-up.

Compute and memory figures are the machine *undisturbed*: the lower quartile of repeated calls
(``_timed_reps``), the training steps and copies in rounds spread over their budget. On a shared
host another tenant slows every call for seconds at a time and never speeds one up.

Fitting alpha and beta. ``cost_models.comm`` models a collective of ``S`` bytes over ``n`` ranks
as ``steps(n) * alpha + link_bytes(S, n) / B`` (``cost_models.comm.ring_terms``). Every
measurement is one equation in the unknowns ``alpha`` and ``c = 1 / B``; we solve them jointly by
least squares on *relative* residuals ``(steps*alpha + bytes*c - t) / t`` so that 4 KB latencies
weigh as much as 16 MB transfers. If the fit makes ``alpha`` negative it is clamped to 0 and
``c`` refit. The profile's intra-node latency and bandwidth are that fit; per-kind fits are kept
in the profile's ``calibration`` section for inspection.

A single machine has no network, so the inter-node link copies the intra-node one and
``gpus_per_node`` is ``nproc`` (all ranks on one node). ``memory_bytes`` is physical RAM divided
by ``nproc``. The result is written as JSON that ``cost_models.load_hardware(path)`` (and
``planner plan --hardware profile.json``) accepts.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import queue as queue_mod
import re
import socket
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cost_models.comm import ring_terms
from cost_models.hardware import HardwareProfile, load_hardware
from planner.errors import UserError
from planner.frontend.analyze import build_layer_table
from planner.frontend.zoo import build_model
from runtime import checkpoint
from runtime.dist import LaunchError, launch_local
from runtime.dtypes import to_torch

__all__ = ["CalibrationError", "CalibrationSpec", "run_calibration", "run_calibrate", "fit_alpha_beta", "build_profile",
           "lower_quartile"]

KB = 1 << 10
MB = 1 << 20
#: Collective kinds measured (``send`` = ping-pong between rank pairs).
MEASURED_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send")


class CalibrationError(UserError):
    """Calibration could not run or its measurements could not be fitted."""


@dataclass(frozen=True)
class CalibrationSpec:
    """What to measure and how long to spend on it (picklable: sent to every rank)."""

    matmul_sizes: tuple[int, ...] = (256, 512, 1024)
    """Square matmul sizes ``n`` (each product is ``n x n`` by ``n x n``)."""
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    """Matmul dtypes to time."""
    matmul_budget_s: float = 0.15
    """Seconds of repetitions per (dtype, size), after one warm-up product."""
    train_batches: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes of the timed training steps (the FLOP-rate and op-overhead fit)."""
    train_budget_s: float = 1.0
    """Seconds of repeated training steps per micro-batch size."""
    recompute_budget_s: float = 1.5
    """Seconds of plain, checkpointed and forward-only block steps (``recompute_ratio``)."""
    sync_iters: int = 30
    """Iterations of the compute + all-reduce loop that measures ``sync_overhead_s``."""
    copy_bytes: int = 32 * MB
    """Size of the tensor copied to measure memory bandwidth."""
    copy_budget_s: float = 0.4
    """Seconds of copies in all, spread over the rounds of training steps."""
    message_sizes: tuple[int, ...] = (4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB)
    """Collective sizes in bytes (full size: the reduced tensor or the gathered output)."""
    max_reps: int = 20
    """Most repetitions of one collective at one size."""
    bytes_per_size: int = 48 * MB
    """Repetitions at size ``S`` are ``clamp(bytes_per_size // S, 2, max_reps)``."""

    @classmethod
    def quick(cls) -> "CalibrationSpec":
        """A few seconds of measurement (tests, smoke runs)."""
        return cls(
            matmul_sizes=(128, 256), matmul_budget_s=0.05, copy_bytes=8 * MB,
            train_batches=(1, 4), train_budget_s=0.1, copy_budget_s=0.05, recompute_budget_s=0.1, sync_iters=3,
            message_sizes=(4 * KB, 256 * KB, 4 * MB), max_reps=5, bytes_per_size=8 * MB,
        )

    def reps(self, size: int) -> int:
        return max(2, min(self.max_reps, self.bytes_per_size // max(size, 1)))

    def num_ticks(self) -> int:
        """Progress-bar steps: one per (dtype, size), the training steps (and copies), the recomputation, one per (kind, size), the sync loop."""
        return len(self.dtypes) * len(self.matmul_sizes) + 3 + len(MEASURED_KINDS) * len(self.message_sizes)


# ----------------------------------------------------------------------------------------------
# Worker (runs in every spawned rank)
# ----------------------------------------------------------------------------------------------
def _median(xs: Sequence[float]) -> float:
    ys = sorted(xs)
    k = len(ys) // 2
    return ys[k] if len(ys) % 2 else 0.5 * (ys[k - 1] + ys[k])


def lower_quartile(xs: Sequence[float]) -> float:
    """The 25th percentile (linear interpolation between order statistics)."""
    ys = sorted(xs)
    pos = 0.25 * (len(ys) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def _rep_times(fn, budget_s: float, min_reps: int, max_reps: int = 10_000) -> list[float]:
    """Seconds of each ``fn()`` call, repeating for ``budget_s`` (at least ``min_reps`` calls)."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if len(times) >= min_reps and t1 - start >= budget_s:
            break
    return times


def _timed_reps(fn, budget_s: float, min_reps: int, max_reps: int = 10_000) -> float:
    """Seconds of one undisturbed ``fn()`` call: the lower quartile of repeats over ``budget_s``.

    A shared machine only ever slows a call down (another tenant takes the core, the cache or
    the memory bus for a few seconds), so the fast end of the distribution is the machine itself;
    the lower quartile rather than the minimum keeps one lucky call from setting the figure.
    ``planner validate``'s benchmark reads measured step times the same way.
    """
    return lower_quartile(_rep_times(fn, budget_s, min_reps, max_reps))


def _time_matmul(n: int, dtype_name: str, budget_s: float) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` product in ``dtype_name`` (median rep)."""
    dt = to_torch(dtype_name)
    a = torch.randn(n, n).to(dt)
    b = torch.randn(n, n).to(dt)
    torch.mm(a, b)  # warm-up (and the place an unsupported dtype fails)
    return 2.0 * n**3 / _timed_reps(lambda: torch.mm(a, b), budget_s, min_reps=3)


def _time_training(batches: Sequence[int], budget_s: float, copy_bytes: int, copy_budget_s: float,
                   rounds: int = 4) -> tuple[float, float, float]:
    """``(FLOP/s, seconds per operator, memory bytes/s)`` of real training steps, all ranks at once.

    The planner prices a forward + backward as ``T = 3 N c + F / R + Q / W``: ``N`` operator
    calls (backward makes about two per forward op), ``F`` FLOPs, ``Q`` memory-bound bytes, all
    from the layer table, and ``W`` the measured copy bandwidth. Two measurements of a small
    built-in GPT (fp32) give the unknowns: the same architecture shrunk until its FLOPs and bytes
    are negligible (width 16, 8 tokens) costs ``3 N c`` alone, which gives ``c`` (``op_overhead_s``);
    then each micro-batch size ``b`` of ``batches`` at full size gives ``F(b) / R =
    T(b) - 3 N c - Q(b) / W``, and ``R`` (its ratio to the matmul peak is ``compute_efficiency``)
    is the least-squares rate through those points. Every size, and the tensor copy that gives
    ``W`` (``copy_bytes``, ``copy_budget_s`` in all), is timed in ``rounds`` turns spread over the
    whole budget, and each time is its lower quartile (see ``_timed_reps``).
    """

    def timed(sizes: dict, table, b: int, seq: int) -> tuple[Any, float, float, int]:
        """``(step function, FLOPs, memory-bound bytes, operator count)`` of one model size."""
        real = build_model("gpt", batch=b, seed=0, seq_len=seq, **sizes)
        # Timed as the runtime runs it: the exported ATen graph, one Python call per operator
        # (what `planner compile` emits), not the eager module, whose fused calls cost less per op
        # (on the width-16 GPT here the eager step took 2.1 ms, the exported one 3.4 ms).
        module = torch.export.export(real.model, tuple(real.example_inputs)).module()

        def step(model=module, inputs=real.example_inputs):
            model.zero_grad(set_to_none=True)
            model(*inputs).backward()

        step()  # warm-up: first-touch allocations and lazy initialization
        flops = table.total("fwd_flops", b, seq) + table.total("bwd_flops", b, seq)
        moved = table.total("fwd_bytes", b, seq) + table.total("bwd_bytes", b, seq)
        return step, flops, moved, sum(lay.num_ops for lay in table.layers)

    tiny, full = dict(layers=2, hidden=16, heads=2, vocab=16), dict(layers=2, hidden=256, heads=4, vocab=4096)
    small = timed(tiny, build_layer_table("gpt", batch=1, seq_len=8, dtype="fp32", **tiny), 1, 8)
    table = build_layer_table("gpt", batch=1, seq_len=128, dtype="fp32", **full)  # symbolic in b: one trace
    steps = [small] + [timed(full, table, b, 128) for b in batches]
    src = torch.ones(copy_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    # Rounds over all sizes, so that a few seconds of a busy machine slow some reps of every size
    # rather than every rep of one (which would bend the fit); each size keeps its lower quartile.
    # Every rank times the same thing at the same moment (a barrier before each turn): a rank
    # whose peer runs the tiny model, or waits, has the memory bus to itself and runs faster than
    # it ever will in training, where all ranks compute the same step at once.
    times: list[list[float]] = [[] for _ in steps]
    copies: list[float] = []
    for _ in range(rounds):
        _barrier()
        copies += _rep_times(lambda: dst.copy_(src), copy_budget_s / rounds, min_reps=3)
        for i, (step, *_costs) in enumerate(steps):
            _barrier()
            times[i] += _rep_times(step, budget_s / rounds, min_reps=2)
    memory_bandwidth = 2.0 * src.numel() * 4 / lower_quartile(copies)
    t0 = lower_quartile(times[0])
    _, f0, q0, n_ops = steps[0]
    overhead = max(0.0, t0 - q0 / memory_bandwidth) / (3 * n_ops)
    num = den = 0.0
    for ts, (_, f, q, n) in zip(times[1:], steps[1:]):
        t = lower_quartile(ts)
        y = t - 3 * n * overhead - q / memory_bandwidth  # the FLOP time
        num, den = num + f * f, den + f * y
    if den <= 0:  # too noisy to separate the terms: all of the largest step is FLOP time
        return f / max(t, 1e-9), 0.0, memory_bandwidth
    return num / den, overhead, memory_bandwidth


def _time_recompute(batch: int, budget_s: float, rounds: int = 4) -> float:
    """What recomputing a checkpointed layer costs, relative to its first forward.

    Two exported blocks of the full-size calibration GPT at micro-batch ``batch`` are timed three
    ways, interleaved in ``rounds`` turns (each its lower quartile): a plain forward + backward
    ``P``, the same with every block under the runtime's checkpoint ``C``, and the forward alone
    ``F``. The recomputation is what ``C`` adds, so the ratio is ``(C - P) / F``: 1 where a
    recomputed forward runs like the first one (GPUs), below 1 on a CPU, whose first forward
    writes the saved activations into cache-cold memory.
    """
    real = build_model("gpt", batch=batch, seed=0, seq_len=128, layers=2, hidden=256, heads=4, vocab=4096)
    with torch.no_grad():
        x0 = real.model.embed(real.example_inputs[0])
    blocks = [torch.export.export(b, (x0,)).module() for b in real.model.blocks]
    x = x0.clone().requires_grad_(True)

    def forward(ckpt: bool = False):
        y = x
        for b in blocks:
            y = checkpoint(b, y) if ckpt else b(y)
        return y

    def step(ckpt: bool):
        forward(ckpt).sum().backward()
        x.grad = None
        for b in blocks:
            for p in b.parameters():
                p.grad = None

    fns = [lambda: step(False), lambda: step(True), forward]
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            _barrier()
            times[i] += _rep_times(fn, budget_s / rounds, min_reps=2)
    plain, ckpt, fwd = (lower_quartile(t) for t in times)
    return (ckpt - plain) / max(fwd, 1e-9)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _mean_over_ranks(value: float) -> float:
    """Mean of a per-rank float; NaN on any rank (a failed measurement) gives NaN."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _time_collective(kind: str, size: int, rank: int, world: int, reps: int) -> tuple[int, int, float]:
    """``(actual_size_bytes, n, seconds)`` for one collective: the slowest rank's median of ``reps``."""
    numel = max(world, (size // 4) // world * world)  # fp32, divisible by world
    nbytes = numel * 4
    if kind == "all_reduce":
        buf = torch.ones(numel)

        def op():
            dist.all_reduce(buf)
    elif kind == "all_gather":
        out, shard = torch.empty(numel), torch.ones(numel // world)
        # torch 2.13 renamed the flat-tensor collectives (*_single); older ones have *_tensor.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def op():
            gather(out, shard)
    elif kind == "reduce_scatter":
        full, shard = torch.ones(numel), torch.empty(numel // world)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def op():
            scatter(shard, full)
    elif kind == "send":
        buf = torch.ones(numel)
        peer = rank ^ 1  # pairs (0,1), (2,3), ...; with an odd world the last rank sits out
        active = peer < world

        def op():
            if not active:
                return
            if rank % 2 == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
    else:  # pragma: no cover - MEASURED_KINDS is closed
        raise ValueError(kind)
    op()  # warm-up
    dist.barrier()
    # Every rank runs the same number of reps (a collective count must match across ranks). The
    # mean, not the median: a training step pays for every collective, the slow ones included.
    t0 = time.perf_counter()
    for _ in range(reps):
        op()
    secs = _max_over_ranks((time.perf_counter() - t0) / reps)
    if kind == "send":
        return nbytes, 2, secs / 2  # one way of a round trip
    return nbytes, world, secs


def _time_sync_overhead(iters: int, repeats: int = 5) -> float:
    """Seconds a blocking all-reduce costs in a compute loop beyond compute and the all-reduce
    alone (``sync_overhead_s``): ranks arrive at slightly different moments and the one that
    waits must wake up. Median over ``repeats`` of ``(both - compute - comm) / iters``."""
    a, x = torch.randn(256, 256), torch.randn(1024, 256)
    buf = torch.ones(256 * 1024)  # 1 MiB, a tensor-parallel activation of a small model

    def loop(comp: bool, comm: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            if comp:
                y = x
                for _ in range(4):  # a few milliseconds of matmuls, like a layer's share of work
                    y = y @ a
            if comm:
                dist.all_reduce(buf)
        return (time.perf_counter() - t0) / iters

    loop(True, True)  # warm-up
    out = []
    for _ in range(repeats):
        both, comp, comm = loop(True, True), loop(True, False), loop(False, True)
        out.append(both - comp - comm)
    return max(0.0, _median(out))


def _calibrate_worker(rank: int, world: int, spec: CalibrationSpec, out_file: str, progress_q) -> None:
    # Deprecation notices from torch.distributed internals would only clutter the progress bar.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

    def tick(label: str) -> None:
        if rank == 0 and progress_q is not None:
            progress_q.put(label)

    result: dict[str, Any] = {"matmul": {}, "memory_bandwidth": None, "collectives": []}
    for dt in spec.dtypes:
        rates = {}
        for n in spec.matmul_sizes:
            dist.barrier()
            try:
                rate = _time_matmul(n, dt, spec.matmul_budget_s)
            except (RuntimeError, TypeError, NotImplementedError):
                rate = float("nan")
            rates[str(n)] = _mean_over_ranks(rate)
            tick(f"matmul {dt} {n}x{n}")
        result["matmul"][dt] = rates
    dist.barrier()
    rate, overhead, bandwidth = _time_training(spec.train_batches, spec.train_budget_s, spec.copy_bytes,
                                               spec.copy_budget_s)
    result["memory_bandwidth"] = _mean_over_ranks(bandwidth)
    result["train_step_flops"] = _mean_over_ranks(rate)
    result["op_overhead_s"] = _mean_over_ranks(overhead)
    tick("training steps and copies")
    result["recompute_ratio"] = _mean_over_ranks(_time_recompute(max(spec.train_batches), spec.recompute_budget_s))
    tick("recomputation")
    for kind in MEASURED_KINDS:
        for size in spec.message_sizes:
            nbytes, n, secs = _time_collective(kind, size, rank, world, spec.reps(size))
            result["collectives"].append({"kind": kind, "size_bytes": nbytes, "n": n, "seconds": secs})
            tick(f"{kind} {_fmt_bytes(nbytes)}")
    result["sync_overhead_s"] = _max_over_ranks(_time_sync_overhead(spec.sync_iters))
    tick("collective in a compute loop")
    if rank == 0:
        Path(out_file).write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------
# Fitting and the profile
# ----------------------------------------------------------------------------------------------
def fit_alpha_beta(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Least-squares ``(alpha, bandwidth)`` from ``(steps, link_bytes, seconds)`` samples.

    Minimizes ``sum(((steps * alpha + link_bytes * c) - t) / t)^2`` over ``alpha >= 0`` and
    ``c = 1 / bandwidth > 0`` by the 2 x 2 normal equations (clamping ``alpha`` to 0 and refitting
    ``c`` alone if needed). Raises ``CalibrationError`` if no positive bandwidth fits, e.g. when
    times do not grow with size.
    """
    rows = [(s / t, b / t) for s, b, t in samples if t > 0]
    if len(rows) < 2:
        raise CalibrationError(f"need at least 2 timed messages to fit alpha and beta (got {len(rows)})")
    # Residual r_i = x_i . (alpha, c) - 1 with x_i = (steps/t, bytes/t).
    s11 = sum(x * x for x, _ in rows)
    s12 = sum(x * y for x, y in rows)
    s22 = sum(y * y for _, y in rows)
    r1 = sum(x for x, _ in rows)
    r2 = sum(y for _, y in rows)
    det = s11 * s22 - s12 * s12
    if det > 1e-12 * max(s11 * s22, 1e-300):
        alpha = (r1 * s22 - r2 * s12) / det
        c = (s11 * r2 - s12 * r1) / det
    else:  # every sample has the same steps/bytes ratio: only the bandwidth is identifiable
        alpha, c = -1.0, 1.0
    if c > 0 and alpha < 0:
        alpha = 0.0
        c = r2 / s22 if s22 > 0 else 0.0
    if c <= 0:
        raise CalibrationError(
            "could not fit a bandwidth: collective times do not grow with message size; "
            "rerun on a quieter machine or with larger --message sizes"
        )
    return alpha, 1.0 / c


def _fmt_bytes(n: float) -> str:
    for unit, f in (("MB", MB), ("KB", KB)):
        if n >= f:
            return f"{n / f:g} {unit}"
    return f"{n:g} B"


def _finite(obj: Any) -> Any:
    """A copy with NaN / inf floats replaced by ``None`` (strict JSON has no NaN)."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not (obj == obj and abs(obj) != float("inf")):
        return None
    return obj


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _clamp_ratio(r: Any) -> float:
    """A measured recompute ratio, kept to (0.25, 1.5]: outside it the timing was disturbed
    (a difference of two noisy step times); an unmeasured one is 1."""
    if not isinstance(r, (int, float)) or not math.isfinite(r):
        return 1.0
    return min(1.5, max(0.25, float(r)))


def build_profile(raw: dict[str, Any], nproc: int, base: HardwareProfile, spec: CalibrationSpec) -> HardwareProfile:
    """Turn the workers' raw measurements into a validated ``HardwareProfile``."""
    peaks: dict[str, float] = {}
    for dt, rates in raw["matmul"].items():
        good = [r for r in rates.values() if r == r and r > 0]  # drop NaN (failed dtype)
        if good:
            peaks[dt] = max(good)
    if "fp32" not in peaks:
        raise CalibrationError("fp32 matmul could not be timed on this machine")
    for dt in ("bf16", "fp16"):
        if dt not in peaks:  # not measurable here: keep the base profile's ratio to fp32
            peaks[dt] = peaks["fp32"] * base.peak(dt) / base.peak("fp32")

    samples = []
    per_kind: dict[str, dict[str, float]] = {}
    for kind in MEASURED_KINDS:
        ks = []
        for m in raw["collectives"]:
            if m["kind"] == kind:
                steps, link_bytes = ring_terms(kind, m["size_bytes"], m["n"])
                ks.append((steps, link_bytes, m["seconds"]))
        samples += ks
        try:
            a, bw = fit_alpha_beta(ks)
            per_kind[kind] = {"alpha_s": a, "bandwidth_Bps": bw}
        except CalibrationError:
            per_kind[kind] = {"alpha_s": float("nan"), "bandwidth_Bps": float("nan")}
    alpha, bw = fit_alpha_beta(samples)

    # What a real training step achieves relative to the matmul peak (see _time_train_step).
    step_rate = raw.get("train_step_flops")
    efficiency = 1.0
    if step_rate and step_rate == step_rate and step_rate > 0:
        efficiency = max(0.01, min(1.0, step_rate / peaks["fp32"]))
    ram = _physical_memory()
    memory_bytes = ram // nproc if ram else base.memory_bytes
    host = socket.gethostname()
    name = "calibrated-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", host).strip("-") or "host")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (
        f"Measured by `planner calibrate` on {host} ({platform.machine()}, {os.cpu_count()} logical "
        f"CPUs, torch {torch.__version__}) with {nproc} gloo processes, {now}. peak_flops = best "
        f"per-process matmul rate; compute_efficiency = FLOP/s of a real GPT training step (net of op_overhead_s, the measured fixed cost per operator call) / that peak; memory_bandwidth = tensor copy; "
        f"intra-node alpha/beta = least-squares fit of all-reduce, all-gather, reduce-scatter and "
        f"send/recv times (mean of back-to-back reps) together, and of each kind alone (intra_node_collectives); sync_overhead_s = what a blocking all-reduce costs in a compute loop beyond both parts; recompute_ratio = (checkpointed - plain step) / forward of two blocks; inter-node numbers copy the intra-node ones (one machine, no network); "
        f"memory_bytes = physical RAM / nproc. Base for unmeasured values: {base.name}."
    )
    calibration = {
        "nproc": nproc,
        "spec": asdict(spec),
        "matmul_flops": raw["matmul"],
        "collectives": raw["collectives"],
        "fit_by_kind": per_kind,
        "fit": {"alpha_s": alpha, "bandwidth_Bps": bw},
        "train_step_flops": step_rate,
        "op_overhead_s": raw.get("op_overhead_s"),
        "sync_overhead_s": raw.get("sync_overhead_s"),
        "recompute_ratio": raw.get("recompute_ratio"),
    }
    return HardwareProfile(
        name=name,
        peak_flops=peaks,
        memory_bytes=int(memory_bytes),
        memory_bandwidth=float(raw["memory_bandwidth"]),
        intra_node_bandwidth=bw,
        intra_node_latency=alpha,
        inter_node_bandwidth=bw,
        inter_node_latency=alpha,
        gpus_per_node=nproc,
        compute_efficiency=efficiency,
        op_overhead_s=float(raw.get("op_overhead_s") or 0.0),
        sync_overhead_s=float(raw.get("sync_overhead_s") or 0.0),
        recompute_ratio=_clamp_ratio(raw.get("recompute_ratio")),
        intra_node_collectives={k: {"latency": v["alpha_s"], "bandwidth": v["bandwidth_Bps"]}
                                for k, v in per_kind.items() if v["bandwidth_Bps"] == v["bandwidth_Bps"]} or None,
        source=source,
        calibration=_finite(calibration),
    )


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------
def _drain_progress(q, stop: threading.Event, total: int, enabled: bool) -> None:
    if not enabled:
        while not stop.is_set():
            try:
                q.get(timeout=0.1)
            except queue_mod.Empty:
                pass
        return
    cols = (TextColumn("[bold]calibrate[/]"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*cols, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("starting processes", total=total)
        while not stop.is_set() or not q.empty():
            try:
                label = q.get(timeout=0.1)
            except queue_mod.Empty:
                continue
            except (EOFError, OSError):
                break
            bar.update(task, advance=1, description=label)


def run_calibration(
    nproc: int,
    out_path: str | os.PathLike,
    base_kind: str = "cpu",
    progress: bool = True,
    quick: bool = False,
    timeout_s: float = 300.0,
    spec: CalibrationSpec | None = None,
) -> HardwareProfile:
    """Measure this machine with ``nproc`` local gloo processes and write a profile to ``out_path``.

    ``base_kind`` supplies values that cannot be measured (a dtype whose matmul fails); ``quick``
    trades accuracy for a few seconds of measurement; ``progress`` shows a rich progress bar on
    stderr. Returns the profile (also saved as JSON that ``load_hardware(out_path)`` accepts).
    """
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 2:
        raise CalibrationError(
            f"calibrate needs --nproc >= 2 to time collectives between processes (got {nproc!r})"
        )
    cores = os.cpu_count() or 1
    if nproc > 4 * cores:
        raise CalibrationError(
            f"--nproc {nproc} is more than 4 processes per CPU core ({cores} cores): the timings "
            f"would measure the scheduler, not the machine; use at most {4 * cores}"
        )
    base = load_hardware(base_kind)
    spec = spec or (CalibrationSpec.quick() if quick else CalibrationSpec())
    q = mp.get_context("spawn").Queue()
    stop = threading.Event()
    drain = threading.Thread(target=_drain_progress, args=(q, stop, spec.num_ticks(), progress), daemon=True)
    drain.start()
    with tempfile.TemporaryDirectory(prefix="planner-calibrate-") as tmp:
        raw_file = os.path.join(tmp, "raw.json")
        try:
            launch_local(_calibrate_worker, nproc, (spec, raw_file, q), timeout_s=timeout_s,
                         collective_timeout_s=min(timeout_s, 120.0))
        except LaunchError as e:
            raise CalibrationError(f"calibration processes failed: {e}") from None
        finally:
            stop.set()
            drain.join(timeout=5)
        raw = json.loads(Path(raw_file).read_text())
    profile = build_profile(raw, nproc, base, spec)
    profile.save(out_path)
    return profile


def run_calibrate(args) -> int:
    """``planner calibrate [--nproc N] --out profile.json [--quick]``."""
    run_calibration(args.nproc, args.out, quick=args.quick)
    print(f"Wrote {args.out}; use it with --hardware {args.out}.")
    return 0
