"""``planner calibrate``: measure this machine and write a hardware profile for it.

What is measured, with ``nproc`` local gloo processes each standing for one device (each gets
``cpu_count // nproc`` intra-op threads, as ``runtime.distributed.launch.launch_local`` sets for training):

- **Matmul throughput** per dtype (fp32, bf16, fp16; a dtype whose matmul fails is skipped) at a
  few square sizes, all ranks at once so that they share the cores as they do in training.
  ``peak_flops[dtype]`` is the best per-rank rate seen (``2 n^3`` FLOPs per ``n x n`` product),
  and ``compute_efficiency`` is the ratio of a real training step's FLOP/s (a small built-in GPT,
  forward + backward, every rank at once) to that peak.
- **Memory bandwidth**: a tensor copy on every rank at once (read + write bytes / time), its
  source and destination past the last-level cache (32 MB each, quick or not: an 8 MB copy
  measured the cache here, 50-66 GB/s against 17-21), timed between the rounds of training steps.
- **Optimizer step** (``optimizer_bytes_per_s``): the runtime's step over a flat fp32 shard past
  the last-level cache (the gradient's square sums, ``flat_shards.adamw_step_``, ``zero_grad``'s
  fill), every rank at once after a barrier per step, in the bytes ``cost_models.compute.
  adam_step_bytes`` counts; it replaces the roofline, for a CPU's fused AdamW runs at neither
  its copy bandwidth nor its FLOP rate (``calibrate_gpu.measure_optimizer_step``, also the CUDA
  path's).
- **Recomputation**: two exported blocks timed plain, checkpointed and forward-only;
  ``recompute_ratio`` is what checkpointing adds over the forward (``_time_recompute``).
- **Overlap contention** (``overlap_slowdown``, ``overlap_comm_rate``): a few matmuls timed alone
  and beside a chain of asynchronous all-reduces between the ranks, and how much of the chain
  completes meanwhile (``calibrate_gpu.measure_overlap_slowdown``, the code the CUDA path runs
  over NCCL).
- **Collectives**: all-reduce, all-gather and reduce-scatter over all ranks, and send/recv
  ping-pong between rank pairs, for message sizes from 4 KB to 64 MB (the largest past the
  last-level cache, as a gradient bucket is). Each time is the fastest of up to three rounds of
  back-to-back calls, a round's time its slowest rank's mean (``time_collective``).
- **Offload** (``calibrate_common.measure_offload``, in the parent process once the ranks are
  done, every core free): NVMe write and read bandwidth of a temporary file in ``--nvme-path``
  (fsync'd write, page cache dropped before the read), the host's AdamW throughput with
  ``runtime.data_parallel.flat_shards.adamw_step_`` (``cpu_adam_params_per_s``), and a memory copy as the host-device
  link (on a CPU the host is the device). ``host_memory_bytes`` is physical RAM, ``nvme_bytes`` the
  free space of that directory's file system.
- **GEMM table** (small): every ``(m, n, k)`` of ``gemm_sizes ** 3`` per dtype, all ranks at once,
  the fraction of ``peak_flops`` each reached (``gemm_efficiency``, which ``cost_models.compute``
  interpolates), then scaled by one factor so that the training steps' own products, priced by
  the table, take the time the steps gave them (``fit_gemm_tables_to_steps``: a product alone
  runs faster than inside a step). The same measurement code as the CUDA path
  (``calibrate_gpu.measure_gemm_table``), so CI runs it.

``--device cuda`` (the default where ``torch.cuda.is_available()``) measures GPUs instead:
``planner.commands.calibrate_gpu``.

Compute and memory figures are the machine *undisturbed*: the lower quartile of repeated calls
(``_timed_reps``), the training steps and copies in rounds spread over their budget. On a shared
host another tenant slows every call for seconds at a time and never speeds one up.

Fitting alpha and beta. ``cost_models.comm_cost`` models a collective of ``S`` bytes over ``n`` ranks
as ``steps(n) * alpha + link_bytes(S, n) / B`` (``cost_models.comm_cost.ring_terms``). Every
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

import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import socket
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean
from typing import Any, Sequence, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cost_models.gemm_cost import gemm_flops, layer_gemm_time
from cost_models.hardware import HardwareProfile, load_hardware
from planner.commands.calibrate_common import (
    KB,
    MB,
    MEASURED_KINDS,
    MIN_EFFICIENCY,
    CalibrationError,
    collective_links,
    drain_progress,
    finite,
    fit_alpha_beta,
    fit_collectives,
    fmt_bytes,
    gemm_tables,
    lower_quartile,
    measure_offload,
    offload_source,
    physical_memory,
    positive_rate,
)
from planner.commands.calibrate_gpu import (
    DeviceTimer,
    measure_gemm_table,
    measure_optimizer_step,
    measure_overlap_slowdown,
    overlap_fields,
    run_gpu_calibration,
    time_collective,
)
from planner.frontend.gpt import GPT
from planner.frontend.model_analysis import build_layer_table
from planner.frontend.zoo import ModelSizes, build_model
from runtime import checkpoint
from runtime.distributed.launch import LaunchError, launch_local
from runtime.dtypes import to_torch

__all__ = [
    "CALIBRATION_METHOD",
    "CalibrationError",
    "CalibrationSpec",
    "run_calibration",
    "run_calibrate",
    "fit_alpha_beta",
    "build_profile",
    "fit_gemm_tables_to_steps",
    "lower_quartile",
    "KB",
    "MB",
    "MEASURED_KINDS",
    "sync_overhead",
]


#: How the figures are derived from the measurements, recorded in the profile's ``calibration``
#: (``method``): raised when a change makes older profiles price differently (2: the GEMM table
#: scaled to the training steps), so that a tool keeping a profile (``planner.demo``) measures again.
CALIBRATION_METHOD = 2


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
    sync_iters: int = 8
    """Calls per round of the compute + all-reduce loop that measures ``sync_overhead_s``."""
    sync_rounds: int = 10
    """Rounds of that loop (and of the all-reduce alone), spread over about a second."""
    overlap_rounds: int = 12
    """Rounds of compute alone and beside all-reduces (``overlap_slowdown``,
    ``calibrate_gpu.measure_overlap_slowdown``)."""
    copy_bytes: int = 32 * MB
    """Size of the tensor copied to measure memory bandwidth."""
    copy_budget_s: float = 0.4
    """Seconds of copies in all, spread over the rounds of training steps."""
    optimizer_params: int = 1 << 23
    """Elements of the flat shard each rank times the optimizer step on (four fp32 buffers, 128
    MiB per rank, past a CPU's last-level cache), every rank at once."""
    optimizer_reps: int = 12
    """Timed optimizer steps per rank (``optimizer_bytes_per_s``)."""
    message_sizes: tuple[int, ...] = (4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB)
    """Collective sizes in bytes (full size: the reduced tensor or the gathered output). The
    largest lies past a CPU's last-level cache, as a gradient bucket does, and weighs most in the
    least-squares fit of the times."""
    max_reps: int = 20
    """Most repetitions of one collective at one size."""
    bytes_per_size: int = 48 * MB
    """Repetitions at size ``S`` are ``clamp(bytes_per_size // S, 2, max_reps)``."""
    gemm_sizes: tuple[int, ...] = (32, 128, 512)
    """Sizes on each axis of the GEMM table (``len ** 3`` products per dtype); empty: no table."""
    gemm_target_s: float = 0.01
    """Seconds of repetitions per GEMM shape of the table."""

    @classmethod
    def quick(cls) -> "CalibrationSpec":
        """A few seconds of measurement (tests, smoke runs)."""
        return cls(
            matmul_sizes=(128, 256),
            matmul_budget_s=0.05,
            copy_bytes=32 * MB,  # source and copy past the last-level cache, as in the full spec
            train_batches=(1, 4),
            train_budget_s=0.1,
            copy_budget_s=0.05,
            recompute_budget_s=0.1,
            sync_iters=6,
            sync_rounds=5,
            overlap_rounds=3,
            message_sizes=(4 * KB, 256 * KB, 4 * MB, 32 * MB),
            max_reps=5,
            bytes_per_size=8 * MB,
            gemm_sizes=(32, 128),
            gemm_target_s=0.003,
        )

    def reps(self, size: int) -> int:
        return max(2, min(self.max_reps, self.bytes_per_size // max(size, 1)))

    def num_ticks(self) -> int:
        """Progress-bar steps: one per (dtype, size), the training steps (and copies), the recomputation,
        the optimizer step, one per (kind, size), the sync loop, the overlap loop, one per (dtype, m) of the GEMM table."""
        return (
            len(self.dtypes) * (len(self.matmul_sizes) + len(self.gemm_sizes))
            + 5
            + len(MEASURED_KINDS) * len(self.message_sizes)
        )


# ----------------------------------------------------------------------------------------------
# Worker (runs in every spawned rank)
# ----------------------------------------------------------------------------------------------
def _rep_times(fn, budget_s: float, min_reps: int, max_reps: int = 10_000) -> list[float]:
    """Seconds of each ``fn()`` call, repeating for ``budget_s`` (at least ``min_reps`` calls)."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps:
        call_start = time.perf_counter()
        fn()
        call_end = time.perf_counter()
        times.append(call_end - call_start)
        if len(times) >= min_reps and call_end - start >= budget_s:
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
    dtype = to_torch(dtype_name)
    left = torch.randn(n, n).to(dtype)
    right = torch.randn(n, n).to(dtype)
    torch.mm(left, right)  # warm-up (and the place an unsupported dtype fails)
    return 2.0 * n**3 / _timed_reps(lambda: torch.mm(left, right), budget_s, min_reps=3)


def _time_training(
    batches: Sequence[int], budget_s: float, copy_bytes: int, copy_budget_s: float, rounds: int = 4
) -> tuple[float, float, float, list[list[float]]]:
    """``(FLOP/s, seconds per operator, memory bytes/s, products)`` of real training steps, all
    ranks at once; ``products`` lists the layer table's matmuls of every fitted step as
    ``[m, n, k, batch, count]`` (``build_profile`` prices them with the GEMM table).

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

    def timed(sizes: dict, table, batch: int, seq_len: int) -> tuple[Any, float, float, int]:
        """``(step function, FLOPs, memory-bound bytes, operator count)`` of one model size."""
        real = build_model("gpt", ModelSizes(seq_len=seq_len, **sizes), batch=batch, seed=0)
        # Timed as the runtime runs it: the exported ATen graph, one Python call per operator
        # (what `planner compile` emits), not the eager module, whose fused calls cost less per op.
        module = torch.export.export(real.model, tuple(real.example_inputs)).module()

        def step(model=module, inputs=real.example_inputs):
            model.zero_grad(set_to_none=True)
            model(*inputs).backward()

        step()  # warm-up: first-touch allocations and lazy initialization
        flops = table.total("fwd_flops", batch, seq_len) + table.total("bwd_flops", batch, seq_len)
        moved = table.total("fwd_bytes", batch, seq_len) + table.total("bwd_bytes", batch, seq_len)
        return step, flops, moved, sum(lay.num_ops for lay in table.layers)

    tiny: dict[str, Any] = dict(layers=2, hidden=16, heads=2, vocab=16)
    full: dict[str, Any] = dict(layers=2, hidden=256, heads=4, vocab=4096)
    small = timed(tiny, build_layer_table("gpt", batch=1, seq_len=8, dtype="fp32", **tiny), 1, 8)
    table = build_layer_table("gpt", batch=1, seq_len=128, dtype="fp32", **full)  # symbolic in b: one trace
    steps = [small] + [timed(full, table, batch, 128) for batch in batches]
    products = [
        [float(x) for x in gemm[:5]]
        for batch in batches
        for row in table.numeric(batch, 128)
        for gemm in (*row["fwd_gemms"], *row["bwd_gemms"])
    ]
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
    tiny_s = lower_quartile(times[0])
    _, _, tiny_bytes, n_ops = steps[0]
    overhead = max(0.0, tiny_s - tiny_bytes / memory_bandwidth) / (3 * n_ops)
    num = den = 0.0
    for step_times, (_, flops, moved, n) in zip(times[1:], steps[1:]):
        step_s = lower_quartile(step_times)
        flop_s = step_s - 3 * n * overhead - moved / memory_bandwidth  # the FLOP time
        num, den = num + flops * flops, den + flops * flop_s
    if den <= 0:  # too noisy to separate the terms: all of the largest step is FLOP time
        return flops / max(step_s, 1e-9), 0.0, memory_bandwidth, products
    return num / den, overhead, memory_bandwidth, products


def _time_recompute(batch: int, budget_s: float, rounds: int = 4) -> float:
    """What recomputing a checkpointed layer costs, relative to its first forward.

    Two exported blocks of the full-size calibration GPT at micro-batch ``batch`` are timed three
    ways, interleaved in ``rounds`` turns (each its lower quartile): a plain forward + backward
    ``P``, the same with every block under the runtime's checkpoint ``C``, and the forward alone
    ``F``. The recomputation is what ``C`` adds, so the ratio is ``(C - P) / F``: 1 where a
    recomputed forward runs like the first one (GPUs), below 1 on a CPU, whose first forward
    writes the saved activations into cache-cold memory.
    """
    real = build_model("gpt", ModelSizes(seq_len=128, layers=2, hidden=256, heads=4, vocab=4096), batch=batch, seed=0)
    gpt = cast(GPT, real.model)
    with torch.no_grad():
        embedded = gpt.embed(real.example_inputs[0])
    blocks = [torch.export.export(block, (embedded,)).module() for block in gpt.blocks]
    x = embedded.clone().requires_grad_(True)

    def forward(ckpt: bool = False):
        hidden = x
        for block in blocks:
            hidden = checkpoint(block, hidden) if ckpt else block(hidden)
        return hidden

    def step(ckpt: bool):
        forward(ckpt).sum().backward()
        x.grad = None
        for block in blocks:
            for param in block.parameters():
                param.grad = None

    fns = [lambda: step(False), lambda: step(True), forward]
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            _barrier()
            times[i] += _rep_times(fn, budget_s / rounds, min_reps=2)
    plain, ckpt, fwd = (lower_quartile(fn_times) for fn_times in times)
    return (ckpt - plain) / max(fwd, 1e-9)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _mean_over_ranks(value: float) -> float:
    """Mean of a per-rank float; NaN on any rank (a failed measurement) gives NaN."""
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total.item()) / dist.get_world_size()


def _all_ranks(value: float) -> list[float]:
    """A per-rank float from every rank, in rank order."""
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value], dtype=torch.float64))
    return [float(v.item()) for v in values]


def _max_over_ranks(value: float) -> float:
    largest = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return float(largest.item())


#: Matmuls (1024 x 256 by 256 x 256, about 0.9 ms each on one core here) between two calls of the
#: loop that measures ``sync_overhead_s``: a transformer layer's forward on one rank, the compute a
#: tensor-parallel all-reduce follows in training. The wait grows with the compute before it (the
#: ranks drift further apart): measured here at 1, 4 and 16 matmuls, about 0.15, 0.9 and 1.4 ms.
SYNC_MATMULS = 12


def _time_sync_overhead(iters: int, rounds: int) -> float:
    """Seconds a blocking all-reduce costs in a compute loop beyond the same all-reduce run back
    to back (``sync_overhead_s``): ranks arrive at slightly different moments and the one that
    waits must wake up. Each of ``rounds`` rounds times ``iters`` calls each way; a round's loop
    figure is the rank that waited least (the critical rank, whose waits the runtime's step
    breakdown reports: ``runtime.training.trainer.critical_breakdown``), its back-to-back figure
    the ranks' mean. The result is the difference of the two means over the rounds.

    Means, not medians: on shared cores a call either returns at once or a scheduler tick later
    (measured here: a 1 MiB all-reduce took about 0.8 ms or about 4 ms, seldom between), and
    the median of such a sample jumps between the modes from one run to the next (0.1 to 1.8
    ms in three runs of 150 calls), where the mean, what a step's many calls add up to, stays
    within about 20%."""
    weight, x = torch.randn(256, 256), torch.randn(1024, 256)
    buf = torch.ones(256 * 1024)  # 1 MiB, a tensor-parallel activation of a small model

    def blocked_per_call(compute: bool) -> float:
        dist.barrier()
        blocked = 0.0
        for _ in range(iters):
            if compute:
                hidden = x
                for _ in range(SYNC_MATMULS):
                    hidden = hidden @ weight
            start = time.perf_counter()
            dist.all_reduce(buf)
            blocked += time.perf_counter() - start
        return blocked / iters

    blocked_per_call(True)  # warm-up
    in_loop, alone = [], []
    for _ in range(rounds):
        in_loop.append(_all_ranks(blocked_per_call(True)))
        alone.append(_all_ranks(blocked_per_call(False)))
    return sync_overhead(in_loop, alone)


def sync_overhead(in_loop: Sequence[Sequence[float]], alone: Sequence[Sequence[float]]) -> float:
    """``sync_overhead_s`` from per-round, per-rank mean waits (``_time_sync_overhead``): each
    round's loop figure is its least-waiting rank's, its back-to-back figure the ranks' mean; the
    result is the difference of the two means over the rounds, never below zero."""
    loop_s = fmean(min(ranks) for ranks in in_loop)
    alone_s = fmean(fmean(ranks) for ranks in alone)
    return max(0.0, loop_s - alone_s)


def _calibrate_worker(rank: int, world: int, spec: CalibrationSpec, out_file: str, progress_q) -> None:
    # Deprecation notices from torch.distributed internals would only clutter the progress bar.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

    def tick(label: str) -> None:
        if rank == 0 and progress_q is not None:
            progress_q.put(label)

    result: dict[str, Any] = {"matmul": {}, "memory_bandwidth": None, "collectives": []}
    for dtype in spec.dtypes:
        rates = {}
        for n in spec.matmul_sizes:
            dist.barrier()
            try:
                rate = _time_matmul(n, dtype, spec.matmul_budget_s)
            except (RuntimeError, TypeError, NotImplementedError):
                rate = float("nan")
            rates[str(n)] = _mean_over_ranks(rate)
            tick(f"matmul {dtype} {n}x{n}")
        result["matmul"][dtype] = rates
    if spec.gemm_sizes:  # every rank at once, as they share the cores in training
        dist.barrier()
        result["gemm"] = measure_gemm_table(
            spec.gemm_sizes,
            spec.dtypes,
            DeviceTimer(torch.device("cpu")),
            spec.gemm_target_s,
            max_reps=10,
            tick=tick,
            reduce=_mean_over_ranks,
        )
    dist.barrier()
    rate, overhead, bandwidth, products = _time_training(
        spec.train_batches, spec.train_budget_s, spec.copy_bytes, spec.copy_budget_s
    )
    result["train_products"] = products
    result["memory_bandwidth"] = _mean_over_ranks(bandwidth)
    result["train_step_flops"] = _mean_over_ranks(rate)
    result["op_overhead_s"] = _mean_over_ranks(overhead)
    tick("training steps and copies")
    step_rate = measure_optimizer_step(
        DeviceTimer(torch.device("cpu")), spec.optimizer_params, spec.optimizer_reps, before=dist.barrier
    )
    result["optimizer_bytes_per_s"] = _mean_over_ranks(step_rate)
    tick("optimizer step")
    result["recompute_ratio"] = _mean_over_ranks(_time_recompute(max(spec.train_batches), spec.recompute_budget_s))
    tick("recomputation")
    for kind in MEASURED_KINDS:
        for size in spec.message_sizes:
            nbytes, ranks, secs = time_collective(kind, size, rank, world, spec.reps(size))
            result["collectives"].append({"kind": kind, "size_bytes": nbytes, "n": ranks, "seconds": secs})
            tick(f"{kind} {fmt_bytes(nbytes)}")
    result["sync_overhead_s"] = _max_over_ranks(_time_sync_overhead(spec.sync_iters, spec.sync_rounds))
    tick("collective in a compute loop")
    result["overlap"] = measure_overlap_slowdown(DeviceTimer(torch.device("cpu")), spec.overlap_rounds)
    tick("compute beside collectives")
    if rank == 0:
        Path(out_file).write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------
# Fitting and the profile
# ----------------------------------------------------------------------------------------------
def _clamp_ratio(ratio: Any) -> float:
    """A measured recompute ratio, kept to (0.25, 1.5]: outside it the timing was disturbed
    (a difference of two noisy step times); an unmeasured one is 1."""
    if not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
        return 1.0
    return min(1.5, max(0.25, float(ratio)))


def build_profile(raw: dict[str, Any], nproc: int, base: HardwareProfile, spec: CalibrationSpec) -> HardwareProfile:
    """Turn the workers' raw measurements into a validated ``HardwareProfile``."""
    peaks = _matmul_peaks(raw["matmul"], base)
    per_kind, (alpha, bandwidth) = fit_collectives(raw["collectives"])
    gemm = raw.get("gemm")
    tables, skipped = gemm_tables(gemm["sizes"], gemm["seconds"], peaks) if gemm else ({}, {})

    # What a real training step achieves relative to the matmul peak (see _time_train_step).
    step_rate = raw.get("train_step_flops")
    efficiency = 1.0
    if step_rate and step_rate == step_rate and step_rate > 0:
        efficiency = max(0.01, min(1.0, step_rate / peaks["fp32"]))
    ram = physical_memory()
    memory_bytes = ram // nproc if ram else base.memory_bytes
    calibration = {
        "method": CALIBRATION_METHOD,
        "nproc": nproc,
        "spec": asdict(spec),
        "matmul_flops": raw["matmul"],
        "collectives": raw["collectives"],
        "fit_by_kind": per_kind,
        "fit": {"alpha_s": alpha, "bandwidth_Bps": bandwidth},
        "train_step_flops": step_rate,
        "op_overhead_s": raw.get("op_overhead_s"),
        "sync_overhead_s": raw.get("sync_overhead_s"),
        "recompute_ratio": raw.get("recompute_ratio"),
        "optimizer_bytes_per_s": raw.get("optimizer_bytes_per_s"),
        "overlap": raw.get("overlap"),
        "gemm": gemm,
        "gemm_skipped": skipped,
        "offload": raw.get("offload"),
    }
    offload = raw.get("offload") or {}
    nvme = offload.get("nvme") or {}
    profile = HardwareProfile(
        name="calibrated-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", socket.gethostname()).strip("-") or "host"),
        peak_flops=peaks,
        memory_bytes=int(memory_bytes),
        memory_bandwidth=float(raw["memory_bandwidth"]),
        intra_node_bandwidth=bandwidth,
        intra_node_latency=alpha,
        inter_node_bandwidth=bandwidth,
        inter_node_latency=alpha,
        gpus_per_node=nproc,
        compute_efficiency=efficiency,
        op_overhead_s=float(raw.get("op_overhead_s") or 0.0),
        sync_overhead_s=float(raw.get("sync_overhead_s") or 0.0),
        recompute_ratio=_clamp_ratio(raw.get("recompute_ratio")),
        **overlap_fields(raw.get("overlap"), base),
        intra_node_collectives=collective_links(per_kind),
        gemm_efficiency=tables or None,
        host_device_bandwidth=offload.get("host_copy_Bps"),
        host_memory_bytes=ram if offload else None,
        nvme_bytes=nvme.get("free_bytes") or None,
        nvme_read_bandwidth=nvme.get("read_Bps"),
        nvme_write_bandwidth=nvme.get("write_Bps"),
        cpu_adam_params_per_s=offload.get("cpu_adam_params_per_s"),
        optimizer_bytes_per_s=positive_rate(raw.get("optimizer_bytes_per_s")),
        source=_cpu_source(nproc, base, offload),
        calibration=finite(calibration),
    )
    return fit_gemm_tables_to_steps(profile, raw.get("train_products"))


def fit_gemm_tables_to_steps(profile: HardwareProfile, products: Sequence[Sequence[float]] | None) -> HardwareProfile:
    """``profile`` with its GEMM tables scaled to what the products achieve inside a training step.

    The grid times each product alone, back to back, its operands warm in cache; in a step the
    same product follows norms, softmaxes and other products that evict them, and reaches less
    (here the grid read 0.95-1.0 of the peak where the steps' FLOPs ran at 0.78). ``compute_efficiency``
    is fitted to the steps with every FLOP at one rate; priced by the raw grid instead, the
    calibration GPT's own products would take 20% less than its measured steps give them, and so
    would every plan's (``bench_validate``'s steps were all predicted 18-28% fast). Every cell is
    multiplied by one factor, ``gemm_in_step_scale`` in the calibration record: the calibration
    steps' ``products`` priced by shape over their FLOPs at ``peak * compute_efficiency``, so that
    those products priced by the scaled table take exactly the flat fit's time, while other shapes
    keep their measured standing relative to them (a small product of a tensor-parallel split
    still reaches less than a large one). The fp32 steps give the factor; every dtype's table takes
    it (the same cores and caches run them). Unchanged without a table or products.
    """
    tables = profile.gemm_efficiency
    if not tables or "fp32" not in tables or not products:
        return profile
    by_shape = layer_gemm_time(products, profile, "fp32")
    flat = gemm_flops(products) / (profile.peak("fp32") * profile.compute_efficiency)
    if not (by_shape > 0 and flat > 0):
        return profile
    scale = by_shape / flat
    scaled = {
        dtype: dict(
            table,
            efficiency=[
                [[max(MIN_EFFICIENCY, min(1.0, cell * scale)) for cell in row] for row in plane]
                for plane in table["efficiency"]
            ],
        )
        for dtype, table in tables.items()
    }
    calibration = dict(profile.calibration or {}, gemm_in_step_scale=scale)
    return dataclasses.replace(profile, gemm_efficiency=scaled, calibration=calibration)


def _matmul_peaks(matmul: dict[str, dict[str, float]], base: HardwareProfile) -> dict[str, float]:
    """Best per-process matmul rate per dtype; a dtype not measurable here keeps ``base``'s ratio
    to fp32. ``CalibrationError`` when fp32 could not be timed."""
    peaks: dict[str, float] = {}
    for dtype, rates in matmul.items():
        good = [rate for rate in rates.values() if rate == rate and rate > 0]  # drop NaN (failed dtype)
        if good:
            peaks[dtype] = max(good)
    if "fp32" not in peaks:
        raise CalibrationError("fp32 matmul could not be timed on this machine")
    for dtype in ("bf16", "fp16"):
        if dtype not in peaks:  # not measurable here: keep the base profile's ratio to fp32
            peaks[dtype] = peaks["fp32"] * base.peak(dtype) / base.peak("fp32")
    return peaks


def _cpu_source(nproc: int, base: HardwareProfile, offload: dict[str, Any]) -> str:
    """The profile's ``source``: where each figure came from, on which machine and software."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (
        f"Measured by `planner calibrate` on {socket.gethostname()} ({platform.machine()}, {os.cpu_count()} logical "
        f"CPUs, torch {torch.__version__}) with {nproc} gloo processes, {now}. peak_flops = best "
        f"per-process matmul rate; compute_efficiency = FLOP/s of a real GPT training step (net of op_overhead_s, the measured fixed cost per operator call) / that peak; memory_bandwidth = tensor copy; optimizer_bytes_per_s = the runtime's optimizer step (square sums, fused AdamW, zero_grad) on a 2^23-element fp32 shard per process, every process at once; "
        f"intra-node alpha/beta = least-squares fit of all-reduce, all-gather, reduce-scatter and "
        f"send/recv times (the fastest of three rounds of back-to-back reps, each its slowest rank's mean) together, and of each kind alone (intra_node_collectives); sync_overhead_s = the mean wait of a blocking all-reduce in a compute loop on the rank that waits least, beyond the same call back to back; recompute_ratio = (checkpointed - plain step) / forward of two blocks; overlap_slowdown = matmuls beside a chain of async all-reduces over alone, minus 1; overlap_comm_rate = the share of the chain's speed it keeps beside the matmuls; inter-node numbers copy the intra-node ones (one machine, no network); "
        f"memory_bytes = physical RAM / nproc; gemm_efficiency = rate of each (m, n, k) product of a small grid "
        f"(every process at once) / peak_flops, times gemm_in_step_scale (calibration), which makes the training "
        f"steps' own products priced by the table take their time at compute_efficiency. "
        f"Base for unmeasured values: {base.name}."
    )
    if offload:
        source += offload_source(offload, host_is_device=True)
    return source


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------
def run_calibration(
    nproc: int,
    out_path: str | os.PathLike,
    base_kind: str = "cpu",
    progress: bool = True,
    quick: bool = False,
    timeout_s: float = 300.0,
    spec: CalibrationSpec | None = None,
    nvme_path: str | None = None,
) -> HardwareProfile:
    """Measure this machine with ``nproc`` local gloo processes and write a profile to ``out_path``.

    ``base_kind`` supplies values that cannot be measured (a dtype whose matmul fails); ``quick``
    trades accuracy for a few seconds of measurement; ``progress`` shows a rich progress bar on
    stderr; ``nvme_path`` is the directory whose drive the NVMe figures measure (default: the
    system's temporary directory). Returns the profile (also saved as JSON that ``load_hardware(out_path)`` accepts).
    """
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 2:
        raise CalibrationError(f"calibrate needs --nproc >= 2 to time collectives between processes (got {nproc!r})")
    cores = os.cpu_count() or 1
    if nproc > 4 * cores:
        raise CalibrationError(
            f"--nproc {nproc} is more than 4 processes per CPU core ({cores} cores): the timings "
            f"would measure the scheduler, not the machine; use at most {4 * cores}"
        )
    base = load_hardware(base_kind)
    spec = spec or (CalibrationSpec.quick() if quick else CalibrationSpec())
    labels = mp.get_context("spawn").Queue()
    stop = threading.Event()
    drain = threading.Thread(target=drain_progress, args=(labels, stop, spec.num_ticks(), progress), daemon=True)
    drain.start()
    with tempfile.TemporaryDirectory(prefix="planner-calibrate-") as tmp:
        raw_file = os.path.join(tmp, "raw.json")
        try:
            with _cuda_hidden():  # CPU processes over gloo, even on a GPU host
                launch_local(
                    _calibrate_worker,
                    nproc,
                    (spec, raw_file, labels),
                    timeout_s=timeout_s,
                    collective_timeout_s=min(timeout_s, 120.0),
                )
        except LaunchError as e:
            raise CalibrationError(f"calibration processes failed: {e}") from None
        finally:
            stop.set()
            drain.join(timeout=5)
        raw = json.loads(Path(raw_file).read_text())
    raw["offload"] = measure_offload(nvme_path, quick or spec.matmul_budget_s < 0.1, host_copy=True)
    profile = build_profile(raw, nproc, base, spec)
    profile.save(out_path)
    return profile


@contextlib.contextmanager
def _cuda_hidden():
    """Processes spawned inside see no CUDA device (``runtime.distributed.launch`` picks NCCL when they do)."""
    if not torch.cuda.is_available():
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def resolve_device(device: str | None) -> str:
    """``cpu`` or ``cuda`` for the ``--device`` choice (``auto`` or absent: CUDA when available)."""
    device = (device or "auto").lower()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise CalibrationError(f"--device {device!r}: expected auto, cpu or cuda")
    return device


def run_calibrate(args) -> int:
    """``planner calibrate [--device auto|cpu|cuda] [--nproc N] --out profile.json [--quick]``.

    On CUDA ``--nproc`` is the number of local GPUs the collectives run over (default all); on
    the CPU the number of processes (default 2).
    """
    nproc = getattr(args, "nproc", None)
    if resolve_device(getattr(args, "device", None)) == "cuda":
        profile = run_gpu_calibration(
            args.out, nproc=nproc, quick=args.quick, nvme_path=getattr(args, "nvme_path", None)
        )
        print(f"Wrote {args.out} ({profile.gpus_per_node} x GPU, measured on CUDA); use it with --hardware {args.out}.")
        return 0
    run_calibration(
        2 if nproc is None else nproc, args.out, quick=args.quick, nvme_path=getattr(args, "nvme_path", None)
    )
    print(f"Wrote {args.out}; use it with --hardware {args.out}.")
    return 0
