"""``planner calibrate`` on CUDA: measure one node's GPUs and write a hardware profile for them.

Its logic is unit-tested with injected timings (``tests/planner/commands/test_calibrate_gpu.py``),
every measurement function running on the CPU there (``torch.device("cpu")``).

What is measured, on ``cuda:0`` unless said otherwise (``collect_single_device``):

- **GEMM efficiency by shape**: the device seconds of an ``m x k`` by ``k x n`` product for every
  ``(m, n, k)`` of a grid (``GpuCalibrationSpec.gemm_sizes`` on each axis), per dtype: bf16, fp16,
  fp32 with TF32 off and ``tf32`` (fp32 with TF32 on). CUDA events time each call; the host first
  queues the calls behind a short device-side sleep (``torch.cuda._sleep``) so that a small GEMM's
  time is the device's, not the host's launch rate. Each figure is the lower quartile of its
  repetitions (as many as fit ``gemm_target_s``, 3 to ``gemm_max_reps``), after a warm-up call and
  a few seconds of large GEMMs that bring the clocks up. The profile stores the fraction of peak
  (``gemm_efficiency``); ``compute_efficiency`` is the bf16 table's largest GEMM.
- **Misaligned products**: the grid's largest bf16 cube against the same with ``n - 1``
  (``gemm_misaligned_efficiency``: what a size that breaks the tensor cores' 16-byte alignment keeps).
- **Memory bandwidth**: a large device-to-device tensor copy (read + write bytes / time).
- **Per-operator host overhead**: the built-in GPT shrunk until its FLOPs are nothing (width 16,
  8 tokens), exported as the runtime runs it and trained on the device; a step's wall time over
  ``3 x`` its operator count (``op_overhead_s``, the cost model's unit: forward + twice in backward).
  A chain of tiny in-place adds gives the raw host cost and device cost per operator beside it.
- **Host-device copies**: pinned host memory to the device and back, a few sizes, alpha-beta fit
  per direction; ``host_device_bandwidth`` is the slower direction.
- **NCCL collectives inside the node**: all-reduce, all-gather, reduce-scatter and send/recv
  ping-pong over ``nproc`` local GPUs (default all), one process per GPU, sizes from 64 KB to
  256 MB; the alpha-beta fit (``calibrate_common.fit_collectives``) gives the intra-node link and
  ``intra_node_collectives``. With one GPU this section is skipped and the profile says so.

Not measured (kept from the datasheet profile of the same GPU, ``base``): the inter-node link
(one node has no network), ``sync_overhead_s`` and ``recompute_ratio`` (1 on GPUs). ``peak_flops``
are the datasheet's when the GPU is a known kind (so MFU stays relative to the vendor's peak) and
the best measured rate where that is higher or the GPU is unknown. ``ops_async`` is true.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import re
import socket
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cost_models.hardware import KNOWN_KINDS, HardwareProfile, load_hardware
from planner.commands.calibrate_common import (
    GB,
    KB,
    MB,
    MEASURED_KINDS,
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
    median,
    offload_source,
    physical_memory,
    positive_rate,
)
from planner.frontend.model_analysis import build_layer_table
from planner.frontend.zoo import ModelSizes, build_model
from runtime.distributed.launch import LaunchError, launch_local
from runtime.dtypes import to_torch

__all__ = [
    "GpuCalibrationSpec",
    "DeviceTimer",
    "time_gemm",
    "measure_gemm_table",
    "measure_copy_bandwidth",
    "measure_op_chain",
    "measure_model_op_overhead",
    "measure_host_copies",
    "time_collective",
    "collect_single_device",
    "build_gpu_profile",
    "datasheet_kind",
    "run_gpu_calibration",
]

#: GEMM dtypes of the table: ``fp32`` is TF32 off, ``tf32`` fp32 with TF32 on.
GEMM_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32", "tf32")


@dataclass(frozen=True)
class GpuCalibrationSpec:
    """What the CUDA calibration measures and how long it spends (picklable: sent to every rank)."""

    gemm_sizes: tuple[int, ...] = (64, 256, 1024, 4096, 16384)
    """Sizes on each GEMM axis (m, n and k): the table has ``len ** 3`` cells per dtype."""
    gemm_dtypes: tuple[str, ...] = GEMM_DTYPES
    """GEMM dtypes to time (``tf32``: fp32 matmuls with TF32 allowed)."""
    gemm_target_s: float = 0.02
    """Device seconds of repetitions per GEMM shape."""
    gemm_max_reps: int = 50
    """Most repetitions of one GEMM shape."""
    warmup_s: float = 3.0
    """Seconds of large bf16 GEMMs before any timing (clocks and power state up)."""
    copy_bytes: int = 1 << 30
    """Size of the device tensor copied to measure memory bandwidth."""
    copy_reps: int = 20
    """Repetitions of the device copy (and of the optimizer step)."""
    optimizer_params: int = 1 << 26
    """Elements of the flat shard the optimizer step is timed on (``measure_optimizer_step``: four
    fp32 buffers, 1 GiB, far past the L2)."""
    op_chain: int = 2000
    """Tiny operators per chain (per-operator host and device cost)."""
    op_rounds: int = 5
    """Chains timed (lower quartile)."""
    model_budget_s: float = 2.0
    """Seconds of tiny-GPT training steps (``op_overhead_s``)."""
    host_copy_sizes: tuple[int, ...] = (1 * MB, 16 * MB, 256 * MB)
    """Host <-> device copy sizes in bytes (pinned host memory)."""
    host_copy_reps: int = 10
    """Repetitions of each host <-> device copy."""
    message_sizes: tuple[int, ...] = (64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB)
    """NCCL collective sizes in bytes (full size: the reduced tensor or the gathered output)."""
    max_reps: int = 50
    """Most repetitions of one collective at one size."""
    bytes_per_size: int = 4 * GB
    """Repetitions at size ``S`` are ``clamp(bytes_per_size // S, 5, max_reps)``."""
    overlap_rounds: int = 10
    """Rounds of compute alone and beside all-reduces (``measure_overlap_slowdown``)."""

    @classmethod
    def quick(cls) -> "GpuCalibrationSpec":
        """A short run (``--quick``): three sizes per GEMM axis, fewer messages and repetitions."""
        return cls(
            gemm_sizes=(128, 1024, 8192),
            gemm_target_s=0.01,
            gemm_max_reps=20,
            warmup_s=1.0,
            copy_bytes=256 * MB,
            copy_reps=10,
            op_chain=500,
            op_rounds=3,
            model_budget_s=0.5,
            host_copy_sizes=(1 * MB, 64 * MB),
            host_copy_reps=5,
            message_sizes=(256 * KB, 4 * MB, 64 * MB),
            max_reps=20,
            bytes_per_size=1 * GB,
            overlap_rounds=5,
        )

    def reps(self, size: int) -> int:
        return max(5, min(self.max_reps, self.bytes_per_size // max(size, 1)))

    def num_ticks(self, nproc: int) -> int:
        """Progress-bar steps: one per (dtype, m), the single-device parts, one per (kind, size)."""
        colls = len(MEASURED_KINDS) * len(self.message_sizes) if nproc >= 2 else 0
        return 1 + len(self.gemm_dtypes) * len(self.gemm_sizes) + 3 + colls


# ----------------------------------------------------------------------------------------------
# Timing on a device (CUDA events on a GPU, perf_counter on a CPU: the tests run the CPU side)
# ----------------------------------------------------------------------------------------------
class DeviceTimer:
    """Times calls on one device: CUDA events on a GPU, ``time.perf_counter`` on the CPU."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def hold(self, seconds: float) -> None:
        """Keep the device busy for about ``seconds`` (a spin kernel) so that the calls queued
        next run back to back on the device, whatever the host's launch rate. No-op on a CPU."""
        sleep = getattr(torch.cuda, "_sleep", None)
        if self.cuda and sleep is not None and seconds > 0:
            sleep(int(min(seconds, 0.5) * 2e9))  # cycles at <= 2 GHz: at least `seconds`

    def per_call(self, fn: Callable[[], Any], reps: int, queue_ahead: bool = True) -> list[float]:
        """Device seconds of each of ``reps`` calls of ``fn`` (the caller has warmed it up)."""
        if not self.cuda:
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return times
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        self.sync()
        if queue_ahead:  # about 30 us of host work per call queued, with margin
            self.hold(1e-3 + 60e-6 * reps)
        for start_event, end_event in zip(starts, ends):
            start_event.record()
            fn()
            end_event.record()
        ends[-1].synchronize()
        return [start_event.elapsed_time(end_event) / 1e3 for start_event, end_event in zip(starts, ends)]


@contextlib.contextmanager
def _tf32(enabled: bool):
    """fp32 matmuls with (``tf32``) or without TF32 on CUDA; restores the previous setting."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9: the legacy flag must not be mixed in
        before = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = before
    else:  # pragma: no cover - older torch
        before = matmul.allow_tf32
        matmul.allow_tf32 = enabled
        try:
            yield
        finally:
            matmul.allow_tf32 = before


def time_gemm(m: int, n: int, k: int, dtype: str, timer: DeviceTimer, target_s: float, max_reps: int) -> float:
    """Device seconds of one ``m x k`` by ``k x n`` product in ``dtype`` (lower quartile of as many
    repetitions as fit ``target_s``, 3 to ``max_reps``, after a warm-up call)."""
    torch_dtype = to_torch("fp32" if dtype == "tf32" else dtype)
    device = timer.device
    left = torch.randn(m, k, device=device).to(torch_dtype)
    right = torch.randn(k, n, device=device).to(torch_dtype)
    out = torch.empty(m, n, device=device, dtype=torch_dtype)

    def fn():
        torch.mm(left, right, out=out)

    with _tf32(dtype == "tf32"):
        fn()  # warm-up: library heuristics, workspace (and the place an unsupported dtype fails)
        timer.sync()
        est = lower_quartile(timer.per_call(fn, 3))
        reps = max(3, min(max_reps, int(target_s / max(est, 1e-7))))
        return lower_quartile(timer.per_call(fn, reps))


def measure_misaligned_gemm(timer: DeviceTimer, size: int, target_s: float, max_reps: int) -> dict[str, float]:
    """bf16 seconds of a ``size`` cube (the GEMM grid's largest) and of the same with ``n = size - 1``
    (not a multiple of 8 elements, which tensor-core kernels need), and the rate the second keeps
    of the first (``HardwareProfile.gemm_misaligned_efficiency``)."""
    m, n, k = size, size, size
    aligned = time_gemm(m, n, k, "bf16", timer, target_s, max_reps)
    odd = time_gemm(m, n - 1, k, "bf16", timer, target_s, max_reps)
    kept = (n - 1) / n * aligned / odd if odd > 0 else 1.0
    return {"aligned_s": aligned, "misaligned_s": odd, "efficiency": min(1.0, max(kept, 1e-3))}


def measure_gemm_table(
    sizes: Sequence[int],
    dtypes: Sequence[str],
    timer: DeviceTimer,
    target_s: float,
    max_reps: int,
    tick: Callable[[str], None] = lambda _: None,
    reduce: Callable[[float], float] = lambda x: x,
) -> dict[str, Any]:
    """Seconds of every ``(m, n, k)`` of ``sizes ** 3`` per dtype, as ``gemm_tables`` reads them:
    ``{"sizes": {"m": [...], "n": [...], "k": [...]}, "seconds": {dtype: [[[s]]]}}``; a dtype the
    device cannot multiply gets ``NaN`` cells. ``reduce`` combines ranks (CPU calibration)."""
    axes = [int(size) for size in sizes]
    seconds: dict[str, list] = {}
    for dtype in dtypes:
        grid = []
        for m in axes:
            plane = []
            for n in axes:
                row = []
                for k in axes:
                    try:
                        cell_s = time_gemm(m, n, k, dtype, timer, target_s, max_reps)
                    except (RuntimeError, TypeError, NotImplementedError):
                        cell_s = float("nan")
                    row.append(reduce(cell_s))
                plane.append(row)
            grid.append(plane)
            tick(f"gemm {dtype} m={m}")
        seconds[dtype] = grid
    return {"sizes": {"m": axes, "n": list(axes), "k": list(axes)}, "seconds": seconds}


def measure_copy_bandwidth(timer: DeviceTimer, nbytes: int, reps: int) -> float:
    """Bytes/s of a device tensor copy: read + write bytes over its lower-quartile time."""
    src = torch.ones(max(1, nbytes // 4), device=timer.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    timer.sync()
    return 2.0 * src.numel() * 4 / lower_quartile(timer.per_call(lambda: dst.copy_(src), reps))


def measure_optimizer_step(
    timer: DeviceTimer, num_params: int, reps: int, before: Callable[[], Any] = lambda: None
) -> float:
    """Bytes/s, counted as ``cost_models.compute.adam_step_bytes(num_params, "fp32")``, of the
    runtime's optimizer step over one flat fp32 shard of ``num_params`` on the timer's device:
    the gradient's two square sums (``ZeroEngine``'s norm and overflow check), the fused AdamW
    with a clip factor (``runtime.data_parallel.flat_shards.adamw_step_``) and ``zero_grad``'s
    fill; lower quartile of ``reps`` steps after one, each timed alone after ``before()`` (a
    barrier, so that the ranks sharing a memory bus step at once, as after training's last
    collective). The profile's ``optimizer_bytes_per_s``."""
    from cost_models.compute import adam_step_bytes
    from runtime.data_parallel.engine_config import OptimizerConfig
    from runtime.data_parallel.flat_shards import adamw_step_

    device = timer.device
    param, grad = torch.randn(num_params, device=device), torch.randn(num_params, device=device)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    config = OptimizerConfig(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    count = [0]

    def step() -> None:
        count[0] += 1
        torch.stack([torch.dot(grad, grad), torch.dot(grad, grad)]).double()
        adamw_step_(param, grad, exp_avg, exp_avg_sq, step=count[0], config=config, grad_scale=0.5)
        grad.zero_()

    step()
    timer.sync()
    times: list[float] = []
    for _ in range(reps):
        before()
        times += timer.per_call(step, 1, queue_ahead=False)
    return float(adam_step_bytes(num_params, "fp32")) / lower_quartile(times)


def measure_op_chain(timer: DeviceTimer, length: int, rounds: int) -> dict[str, float]:
    """Seconds per operator of a chain of tiny in-place adds: ``host_s`` (issuing them),
    ``device_s`` (running them back to back, the chain queued ahead) and ``wall_s`` (both)."""
    x = torch.zeros(16, device=timer.device)

    def chain():
        for _ in range(length):
            x.add_(1.0)

    chain()
    timer.sync()
    host, wall = [], []
    for _ in range(rounds):
        timer.sync()
        start = time.perf_counter()
        chain()
        issued = time.perf_counter()
        timer.sync()
        host.append((issued - start) / length)
        wall.append((time.perf_counter() - start) / length)
    device = wall  # a CPU issues and runs each operator on the same core
    if timer.cuda:  # queue the whole chain behind a spin kernel: the events then time the device
        timer.sync()
        timer.hold(1.5 * lower_quartile(host) * length + 1e-3)
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_event.record()
        chain()
        end_event.record()
        end_event.synchronize()
        device = [start_event.elapsed_time(end_event) / 1e3 / length]
    return {"host_s": lower_quartile(host), "device_s": lower_quartile(device), "wall_s": lower_quartile(wall)}


def measure_model_op_overhead(timer: DeviceTimer, budget_s: float) -> dict[str, Any]:
    """Seconds per operator call of a training step, as ``op_overhead_s`` counts them.

    The built-in GPT shrunk until its FLOPs and bytes are nothing (2 blocks of width 16, 8 tokens),
    exported and trained on the device the way the runtime runs it (one Python call per ATen
    operator); its step's wall time, synchronized, over ``3 x`` the layer table's operator count
    (forward + twice in backward) is the fixed cost of one operator call. On a GPU each of these
    operators is a few microseconds of device work, so the wall time is the host's issue rate: the
    bound that ``ops_async`` compares a layer's device time against.
    """
    sizes: dict[str, Any] = dict(layers=2, hidden=16, heads=2, vocab=16)
    table = build_layer_table("gpt", batch=1, seq_len=8, dtype="fp32", **sizes)
    n_ops = sum(lay.num_ops for lay in table.layers)
    real = build_model("gpt", ModelSizes(seq_len=8, **sizes), batch=1, seed=0)
    model = real.model.to(timer.device)
    inputs = tuple(t.to(timer.device) for t in real.example_inputs)
    module = torch.export.export(model, inputs).module()

    def step():
        module.zero_grad(set_to_none=True)
        module(*inputs).backward()
        timer.sync()

    step()  # warm-up: lazy initialization, allocator
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 1000):
        step_start = time.perf_counter()
        step()
        times.append(time.perf_counter() - step_start)
    step_s = lower_quartile(times)
    return {"step_s": step_s, "num_ops": n_ops, "per_op_s": step_s / (3 * n_ops)}


def measure_host_copies(timer: DeviceTimer, sizes: Sequence[int], reps: int) -> list[dict[str, Any]]:
    """``[{direction, size_bytes, seconds}]`` of host -> device (``h2d``) and device -> host
    (``d2h``) copies from pinned host memory (pageable on a CPU-only run, where both are copies)."""
    out = []
    for size in sizes:
        host = torch.empty(size, dtype=torch.uint8, pin_memory=timer.cuda)
        host.fill_(1)
        on_device = torch.empty(size, dtype=torch.uint8, device=timer.device)
        for direction, fn in (
            ("h2d", lambda dst=on_device, src=host: dst.copy_(src, non_blocking=True)),
            ("d2h", lambda src=on_device, dst=host: dst.copy_(src, non_blocking=True)),
        ):
            fn()
            timer.sync()
            secs = lower_quartile(timer.per_call(fn, reps))
            out.append({"direction": direction, "size_bytes": int(size), "seconds": secs})
    return out


def time_collective(
    kind: str, size: int, rank: int, world: int, reps: int, device: torch.device | None = None, rounds: int = 3
) -> tuple[int, int, float]:
    """``(actual_size_bytes, n, seconds)`` of one collective over the default group on ``device``
    (CPU tensors over gloo, CUDA tensors over NCCL): ``reps`` calls back to back in up to
    ``rounds`` rounds, each round's time the slowest rank's mean, the fastest round kept (the
    device synchronized around each). ``send`` is a ping-pong between rank pairs and returns one
    way (``n = 2``)."""
    device = torch.device(device or "cpu")
    timer = DeviceTimer(device)
    numel = max(world, (size // 4) // world * world)  # fp32, divisible by world
    nbytes = numel * 4
    if kind == "all_reduce":
        buf = torch.ones(numel, device=device)

        def op():
            dist.all_reduce(buf)
    elif kind == "all_gather":
        out, shard = torch.empty(numel, device=device), torch.ones(numel // world, device=device)
        # torch 2.13 renamed the flat-tensor collectives (*_single); older ones have *_tensor.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def op():
            gather(out, shard)
    elif kind == "reduce_scatter":
        full, shard = torch.ones(numel, device=device), torch.empty(numel // world, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def op():
            scatter(shard, full)
    elif kind == "send":
        buf = torch.ones(numel, device=device)
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
    else:
        raise ValueError(f"unknown collective kind {kind!r} (measured: {', '.join(MEASURED_KINDS)})")
    op()  # warm-up (NCCL builds its communicator on the first call)
    timer.sync()
    # Every rank runs the same number of reps (a collective count must match across ranks). A
    # round's mean, not its median: a training step pays for every collective of a burst, the slow
    # ones included. The fastest round: on a shared host another tenant slows a round for a while
    # and never speeds one up (the compute figures keep their lower quartile for the same reason);
    # a gloo all-reduce of 4 MB here measured 2.8-9.4 ms from one calibration to the next.
    count = max(1, min(rounds, reps))
    per_round = max(1, reps // count)
    means = []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(per_round):
            op()
        timer.sync()
        means.append((time.perf_counter() - start) / per_round)
    slowest = torch.tensor(means, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # each round at its slowest rank
    secs = float(slowest.min().item())
    if kind == "send":
        return nbytes, 2, secs / 2  # one way of a round trip
    return nbytes, world, secs


#: Most slowdown a calibration reports (``HardwareProfile.overlap_slowdown`` must stay below 1):
#: beyond it the timing was disturbed.
MAX_OVERLAP_SLOWDOWN = 0.9

#: Least comm rate a calibration reports (``HardwareProfile.overlap_comm_rate`` must stay above 0).
MIN_OVERLAP_COMM_RATE = 0.05


def measure_overlap_slowdown(
    timer: DeviceTimer, rounds: int, size: int = 512, matmuls: int = 8, comm_bytes: int = 8 * MB
) -> dict[str, float]:
    """How much slower compute runs beside a collective (``HardwareProfile.overlap_slowdown``) and
    how much of its speed the collective keeps beside compute (``overlap_comm_rate``), over the
    default group on ``timer``'s device (gloo on CPUs, NCCL on GPUs; every rank calls it).

    The compute is ``matmuls`` products of ``size x size`` matrices (fp32 on a CPU, bf16 on a GPU),
    timed alone and then while a chain of all-reduces of ``comm_bytes`` runs beside it, long
    enough to outlast it (launched asynchronously first, waited after), in ``rounds`` pairs. The
    slowdown is the median over the pairs of ``beside / alone - 1`` (pairing cancels a shared
    machine's slower drifts). The rate: the chain alone takes ``C`` (timed in the same round),
    beside the compute's ``T_c`` seconds it takes ``T``; the chain ran at rate
    ``r`` for ``T_c`` and alone after, so ``T = T_c + C - r T_c``, ``r = (T_c + C - T) / T_c``
    (median over the rounds). Both are means over ranks, kept to ``[0, MAX_OVERLAP_SLOWDOWN]`` and
    ``[MIN_OVERLAP_COMM_RATE, 1]``; the lower quartiles of both compute times are recorded beside."""
    device = timer.device
    dtype = torch.bfloat16 if timer.cuda else torch.float32
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    buf = torch.ones(max(comm_bytes // 4, 1), device=device)

    def compute() -> None:
        for _ in range(matmuls):
            torch.mm(a, b, out=out)

    def one_collective() -> None:
        dist.all_reduce(buf)

    compute()  # warm-up
    one_collective()
    timer.sync()
    alone_s = lower_quartile([timer.per_call(compute, 1, queue_ahead=False)[0] for _ in range(3)])
    dist.barrier()
    comm_s = lower_quartile(timer.per_call(one_collective, 3, queue_ahead=False))
    # long enough to outlast the compute even when it runs at full speed beside a slowed compute
    chain = torch.tensor([math.ceil(2.5 * alone_s / max(comm_s, 1e-9))], dtype=torch.float64, device=device)
    dist.all_reduce(chain, op=dist.ReduceOp.MAX)  # every rank issues the same collectives
    links = int(min(max(chain.item(), 1), 64))

    def run_chain(beside_compute: bool) -> tuple[float, float]:
        """The chain launched, the compute beside it (or nothing), all waited: (whole, compute) s."""
        dist.barrier()
        started = time.perf_counter()
        works = [dist.all_reduce(buf, async_op=True) for _ in range(links)]
        compute_s = timer.per_call(compute, 1, queue_ahead=False)[0] if beside_compute else 0.0
        for work in works:
            work.wait()
        timer.sync()
        return time.perf_counter() - started, compute_s

    alone, beside, rates = [], [], []
    for _ in range(rounds):  # paired rounds: a neighbour's load drifts slower than one round
        dist.barrier()
        alone.append(timer.per_call(compute, 1, queue_ahead=False)[0])
        chain_s, _ = run_chain(False)
        whole, compute_s = run_chain(True)
        beside.append(compute_s)
        if compute_s > 0:
            rates.append((compute_s + chain_s - whole) / compute_s)
    alone_s, beside_s = lower_quartile(alone), lower_quartile(beside)
    ratio = median([b / a for a, b in zip(alone, beside) if a > 0]) if any(a > 0 for a in alone) else 1.0
    means = torch.tensor([ratio - 1, median(rates) if rates else 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(means)
    slowdown, rate = (float(value) / dist.get_world_size() for value in means.tolist())
    return {
        "compute_alone_s": alone_s,
        "compute_beside_s": beside_s,
        "collective_s": comm_s,
        "collectives_beside": links,
        "overlap_slowdown": min(max(slowdown, 0.0), MAX_OVERLAP_SLOWDOWN),
        "overlap_comm_rate": min(max(rate, MIN_OVERLAP_COMM_RATE), 1.0),
    }


# ----------------------------------------------------------------------------------------------
# Collecting: one device in this process, the collectives in one process per GPU
# ----------------------------------------------------------------------------------------------
def _warm_up(timer: DeviceTimer, seconds: float) -> None:
    """Large bf16 GEMMs for ``seconds``: GPU clocks and power state reach their working level."""
    if not timer.cuda or seconds <= 0:
        return
    square = torch.randn(8192, 8192, device=timer.device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            square @ square
        timer.sync()


def collect_single_device(
    spec: GpuCalibrationSpec, device: torch.device, tick: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Every single-device measurement of the spec on ``device`` (raw, JSON-able)."""
    timer = DeviceTimer(device)
    _warm_up(timer, spec.warmup_s)
    tick("warm-up")
    raw: dict[str, Any] = {
        "gemm": measure_gemm_table(
            spec.gemm_sizes, spec.gemm_dtypes, timer, spec.gemm_target_s, spec.gemm_max_reps, tick
        )
    }
    raw["misaligned_gemm"] = measure_misaligned_gemm(
        timer, max(spec.gemm_sizes), spec.gemm_target_s, spec.gemm_max_reps
    )
    raw["memory_bandwidth"] = measure_copy_bandwidth(timer, spec.copy_bytes, spec.copy_reps)
    raw["optimizer_bytes_per_s"] = measure_optimizer_step(timer, spec.optimizer_params, spec.copy_reps)
    tick("device copy and optimizer step")
    raw["op_chain"] = measure_op_chain(timer, spec.op_chain, spec.op_rounds)
    try:
        raw["model_op_overhead"] = measure_model_op_overhead(timer, spec.model_budget_s)
    except Exception as e:  # the chain still gives a per-operator figure
        raw["model_op_overhead"] = {"error": f"{type(e).__name__}: {e}"}
    tick("operator overhead")
    raw["host_device"] = measure_host_copies(timer, spec.host_copy_sizes, spec.host_copy_reps)
    tick("host <-> device copies")
    if timer.cuda:
        torch.cuda.empty_cache()  # give the memory back before the collective processes start
    return raw


def _collectives_worker(rank: int, world: int, spec: GpuCalibrationSpec, out_file: str, progress_q) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    out = []
    for kind in MEASURED_KINDS:
        for size in spec.message_sizes:
            nbytes, ranks, secs = time_collective(kind, size, rank, world, spec.reps(size), device)
            out.append({"kind": kind, "size_bytes": nbytes, "n": ranks, "seconds": secs})
            if rank == 0 and progress_q is not None:
                progress_q.put(f"{kind} {fmt_bytes(nbytes)}")
    # GEMMs large enough to fill the GPU beside NCCL's kernels, all-reduces as large as a bucket
    overlap = measure_overlap_slowdown(DeviceTimer(device), spec.overlap_rounds, size=4096, comm_bytes=64 * MB)
    if rank == 0:
        Path(out_file).write_text(json.dumps({"collectives": out, "overlap": overlap}))


def _device_info(device: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "count": torch.cuda.device_count(),
        "sm_count": int(props.multi_processor_count),
        "memory_bytes": int(props.total_memory),
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
    }


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        return None
    return ".".join(str(x) for x in version) if isinstance(version, tuple) else str(version)


# ----------------------------------------------------------------------------------------------
# The profile
# ----------------------------------------------------------------------------------------------
def datasheet_kind(name: str, memory_bytes: int) -> str | None:
    """The built-in kind of a CUDA device name (``torch.cuda.get_device_properties().name``), or
    ``None``: only the SXM parts the datasheet profiles describe (a PCIe H100 has other peaks)."""
    upper = name.upper()
    if "H200" in upper:
        return "h200"
    if "H100" in upper and ("SXM" in upper or "HBM3" in upper):
        return "h100-sxm"
    if "A100" in upper and "PCIE" not in upper:
        return "a100-80gb" if memory_bytes > 60 * 2**30 else "a100-40gb"
    if "V100" in upper and "PCIE" not in upper and memory_bytes > 24 * 2**30:
        return "v100-32gb"
    return None


def overlap_fields(overlap: dict[str, float] | None, base: HardwareProfile) -> dict[str, Any]:
    """The profile's contention fields from ``measure_overlap_slowdown``'s result (``base``'s when
    not measured)."""
    measured = overlap or {}
    return {
        "overlap_slowdown": measured.get("overlap_slowdown", base.overlap_slowdown),
        "overlap_comm_rate": measured.get("overlap_comm_rate", base.overlap_comm_rate),
    }


_RAW_RECORDED = (
    "memory_bandwidth",
    "optimizer_bytes_per_s",
    "misaligned_gemm",
    "host_device",
    "collectives_skipped",
    "overlap",
)
"""Raw measurements the profile's ``calibration`` record keeps as they were measured."""


def build_gpu_profile(
    raw: dict[str, Any], base: HardwareProfile, spec: GpuCalibrationSpec, datasheet: bool, nproc: int
) -> HardwareProfile:
    """Turn the raw CUDA measurements into a validated ``HardwareProfile``.

    ``raw`` holds ``device`` (``_device_info``), ``gemm`` (``measure_gemm_table``),
    ``memory_bandwidth``, ``op_chain``, ``model_op_overhead``, ``host_device`` and either
    ``collectives`` (``[{kind, size_bytes, n, seconds}]``) or ``collectives_skipped`` (why).
    ``base`` supplies what one node cannot measure; ``datasheet`` says it is this GPU's own
    datasheet profile (its peaks are used), not a stand-in for an unknown GPU.
    """
    device_info = raw["device"]
    gemm = raw["gemm"]
    peaks = _gemm_peaks(gemm, base, datasheet, device_info["name"])
    tables, skipped = gemm_tables(gemm["sizes"], gemm["seconds"], peaks)
    efficiency = base.compute_efficiency
    for dtype in ("bf16", "fp16", "fp32"):  # the largest GEMM of the training dtypes' tables
        if dtype in tables:
            efficiency = tables[dtype]["efficiency"][-1][-1][-1]
            break
    chain = raw.get("op_chain") or {}
    model = raw.get("model_op_overhead") or {}
    host_fits = _host_device_fits(raw.get("host_device", ()))
    host_bandwidth = min((fit["bandwidth_Bps"] for fit in host_fits.values()), default=None)
    collectives = raw.get("collectives") or []
    per_kind, (alpha, bandwidth), links = _intra_node_fit(collectives, base)
    offload = raw.get("offload") or {}
    nvme = offload.get("nvme") or {}
    calibration = {
        "device": "cuda",
        "nproc": nproc,
        "spec": asdict(spec),
        "gpu": device_info,
        "gemm": gemm,
        "gemm_skipped": skipped,
        **{name: raw.get(name) for name in _RAW_RECORDED},
        "op_chain": chain,
        "model_op_overhead": model,
        "host_device_fit": host_fits,
        "collectives": collectives,
        "fit_by_kind": per_kind,
        "fit": {"alpha_s": alpha, "bandwidth_Bps": bandwidth} if collectives else None,
        "base": base.name,
        "offload": offload or None,
    }
    return HardwareProfile(
        name=_profile_name(device_info["name"]),
        peak_flops=peaks,
        memory_bytes=int(device_info["memory_bytes"]),
        memory_bandwidth=float(raw["memory_bandwidth"]),
        intra_node_bandwidth=bandwidth,
        intra_node_latency=alpha,
        inter_node_bandwidth=base.inter_node_bandwidth,
        inter_node_latency=base.inter_node_latency,
        gpus_per_node=int(device_info["count"]),
        compute_efficiency=efficiency,
        op_overhead_s=_op_overhead(chain, model, base),
        sync_overhead_s=base.sync_overhead_s,
        ops_async=True,
        recompute_ratio=1.0,
        **overlap_fields(raw.get("overlap"), base),
        gemm_misaligned_efficiency=(raw.get("misaligned_gemm") or {}).get(
            "efficiency", base.gemm_misaligned_efficiency
        ),
        intra_node_collectives=links,
        sm_count=int(device_info["sm_count"]),
        gemm_efficiency=tables or None,
        host_device_bandwidth=host_bandwidth,
        host_memory_bytes=physical_memory() if offload else base.host_memory_bytes,
        nvme_bytes=nvme.get("free_bytes") or base.nvme_bytes,
        nvme_read_bandwidth=nvme.get("read_Bps") or base.nvme_read_bandwidth,
        nvme_write_bandwidth=nvme.get("write_Bps") or base.nvme_write_bandwidth,
        cpu_adam_params_per_s=offload.get("cpu_adam_params_per_s") or base.cpu_adam_params_per_s,
        optimizer_bytes_per_s=positive_rate(raw.get("optimizer_bytes_per_s")) or base.optimizer_bytes_per_s,
        source=_gpu_source(raw, base, datasheet, nproc),
        calibration=finite(calibration),
    )


def _gemm_peaks(gemm: dict[str, Any], base: HardwareProfile, datasheet: bool, device_name: str) -> dict[str, float]:
    """Peak FLOP/s per dtype: the datasheet's (when it is this GPU's), raised to the best measured
    GEMM rate where that is higher. ``CalibrationError`` when a training dtype has neither."""
    best: dict[str, float] = {}
    for dtype, grid in gemm["seconds"].items():
        rates = [
            2.0 * m * n * k / cell_s
            for m, plane in zip(gemm["sizes"]["m"], grid)
            for n, row in zip(gemm["sizes"]["n"], plane)
            for k, cell_s in zip(gemm["sizes"]["k"], row)
            if isinstance(cell_s, (int, float)) and math.isfinite(cell_s) and cell_s > 0
        ]
        if rates:
            best[dtype] = max(rates)
    peaks = dict(base.peak_flops) if datasheet else {}
    for dtype, rate in best.items():  # a measured rate above the datasheet's means the peak is higher
        peaks[dtype] = max(peaks.get(dtype, 0.0), rate)
    missing = [dtype for dtype in ("fp32", "bf16", "fp16") if dtype not in peaks]
    if missing:
        raise CalibrationError(
            f"could not time a {', '.join(missing)} GEMM on {device_name} and it is not a "
            f"GPU with a datasheet profile ({', '.join(KNOWN_KINDS)})"
        )
    return peaks


def _op_overhead(chain: dict[str, Any], model: dict[str, Any], base: HardwareProfile) -> float:
    """Seconds per operator call: the tiny GPT's step, else the op chain's host cost, else ``base``'s."""
    per_op = model.get("per_op_s") if isinstance(model.get("per_op_s"), (int, float)) else chain.get("host_s")
    if not isinstance(per_op, (int, float)) or not math.isfinite(per_op) or per_op < 0:
        per_op = base.op_overhead_s
    return float(per_op)


def _host_device_fits(copies: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Alpha-beta fit of the pinned host <-> device copies per direction (``h2d``, ``d2h``);
    a direction that cannot be fitted is left out."""
    host_fits: dict[str, dict[str, float]] = {}
    for direction in ("h2d", "d2h"):
        samples = [(1, copy["size_bytes"], copy["seconds"]) for copy in copies if copy["direction"] == direction]
        try:
            latency, bandwidth = fit_alpha_beta(samples)
            host_fits[direction] = {"latency_s": latency, "bandwidth_Bps": bandwidth}
        except CalibrationError:
            pass
    return host_fits


def _intra_node_fit(
    collectives: Sequence[dict[str, Any]], base: HardwareProfile
) -> tuple[dict[str, dict[str, float]], tuple[float, float], dict[str, dict[str, float]] | None]:
    """``(per_kind, (alpha, bandwidth), intra_node_collectives)`` of the NCCL timings, or
    ``base``'s intra-node link when none were measured."""
    if not collectives:
        return {}, (base.intra_node_latency, base.intra_node_bandwidth), None
    per_kind, (alpha, bandwidth) = fit_collectives(collectives)
    return per_kind, (alpha, bandwidth), collective_links(per_kind)


def _profile_name(device_name: str) -> str:
    """``calibrated-<gpu>-<host>``, both reduced to file-name characters."""
    gpu = re.sub(r"[^A-Za-z0-9_.-]+", "-", device_name).strip("-").lower() or "gpu"
    return f"calibrated-{gpu}-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", socket.gethostname()).strip("-") or "host")


def _gpu_source(raw: dict[str, Any], base: HardwareProfile, datasheet: bool, nproc: int) -> str:
    """The profile's ``source``: where each figure came from, on which machine and software."""
    device_info = raw["device"]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    collectives_text = (
        f"intra-node alpha/beta = least-squares fit of NCCL all-reduce, all-gather, reduce-scatter and "
        f"send/recv over {nproc} GPUs (mean of back-to-back reps), each kind alone in "
        f"intra_node_collectives"
        if raw.get("collectives")
        else f"intra-node link from {base.name} (collectives not measured: {raw.get('collectives_skipped')})"
    )
    peaks_text = (
        "the " + base.name + " datasheet, raised to the best measured rate where that is higher"
        if datasheet
        else "best measured GEMM rate (no datasheet profile for this GPU)"
    )
    source = (
        f"Measured by `planner calibrate --device cuda` on {socket.gethostname()} "
        f"({device_info['count']} x {device_info['name']}, "
        f"{device_info['sm_count']} SMs, compute capability {device_info.get('capability')}, "
        f"torch {device_info.get('torch')}, CUDA {device_info.get('cuda')}, NCCL {device_info.get('nccl')}), "
        f"{now}. gemm_efficiency = device time of each "
        f"(m, n, k) product per dtype (CUDA events, lower quartile) over peak_flops; peak_flops = "
        f"{peaks_text}; "
        f"compute_efficiency = the largest GEMM of the table; memory_bandwidth = device tensor copy; "
        f"op_overhead_s = a tiny exported GPT's training step per operator call; host_device_bandwidth = "
        f"pinned copies, slower direction; {collectives_text}; inter-node link, sync_overhead_s and recompute_ratio "
        f"from {base.name} (not measured on one node)."
    )
    offload = raw.get("offload") or {}
    if offload:
        source += offload_source(offload, host_is_device=False)
    return source


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------
def run_gpu_calibration(
    out_path: str | os.PathLike,
    nproc: int | None = None,
    quick: bool = False,
    progress: bool = True,
    timeout_s: float = 600.0,
    spec: GpuCalibrationSpec | None = None,
    base_kind: str | None = None,
    nvme_path: str | None = None,
) -> HardwareProfile:
    """Measure this node's GPUs and write a profile to ``out_path`` (see the module docstring).

    ``nproc`` GPUs (default: all visible) run the NCCL collectives; ``base_kind`` overrides the
    datasheet profile matched from the device name (it supplies the inter-node link and, for a
    known GPU, the peaks). Raises ``CalibrationError`` when no CUDA device is visible.
    """
    if not torch.cuda.is_available():
        raise CalibrationError(
            f"calibrate --device cuda: no CUDA device is visible (torch {torch.__version__}, "
            f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU-only build'}); "
            f"use --device cpu to measure CPU processes"
        )
    count = torch.cuda.device_count()
    nproc = count if nproc is None else nproc
    if not isinstance(nproc, int) or isinstance(nproc, bool) or not 1 <= nproc <= count:
        raise CalibrationError(f"--nproc {nproc!r}: this node has {count} visible GPU(s); use 1 to {count}")
    spec = spec or (GpuCalibrationSpec.quick() if quick else GpuCalibrationSpec())
    device = torch.device("cuda", 0)
    info = _device_info(device)
    kind = base_kind or datasheet_kind(info["name"], info["memory_bytes"])
    base = load_hardware(kind or "h100-sxm")
    labels = mp.get_context("spawn").Queue()
    stop = threading.Event()
    drain = threading.Thread(target=drain_progress, args=(labels, stop, spec.num_ticks(nproc), progress), daemon=True)
    drain.start()
    try:
        raw = collect_single_device(spec, device, tick=labels.put)
        raw["device"] = info
        if nproc >= 2:
            with tempfile.TemporaryDirectory(prefix="planner-calibrate-gpu-") as tmp:
                out_file = os.path.join(tmp, "collectives.json")
                try:
                    launch_local(
                        _collectives_worker,
                        nproc,
                        (spec, out_file, labels),
                        timeout_s=timeout_s,
                        collective_timeout_s=min(timeout_s, 120.0),
                    )
                except LaunchError as e:
                    raise CalibrationError(f"NCCL collective processes failed: {e}") from None
                measured = json.loads(Path(out_file).read_text())
                raw["collectives"], raw["overlap"] = measured["collectives"], measured["overlap"]
        else:
            raw["collectives"] = []
            raw["collectives_skipped"] = (
                "one GPU: no collective inside the node to time; the intra-node link keeps the datasheet figures"
            )
    finally:
        stop.set()
        drain.join(timeout=5)
    raw["offload"] = measure_offload(nvme_path, quick, host_copy=False)  # the link: pinned copies above
    profile = build_gpu_profile(raw, base, spec, datasheet=kind is not None, nproc=nproc)
    profile.save(out_path)
    return profile
