"""What both ``planner calibrate`` paths share: statistics, the alpha-beta fit, GEMM tables, progress.

``planner.commands.calibrate`` (CPU processes over gloo) and ``planner.commands.calibrate_gpu``
(CUDA devices over NCCL) both turn repeated timings into a profile the same way:

- a figure is the *lower quartile* of its repetitions (``lower_quartile``): a shared machine only
  ever slows a call down, so the fast end of the distribution is the machine itself;
- a collective of ``S`` bytes over ``n`` ranks costs ``steps(n) * alpha + link_bytes(S, n) / B``
  (``cost_models.comm_cost.ring_terms``), and ``fit_alpha_beta`` solves ``alpha`` and ``B`` by least
  squares on relative residuals, per kind and for all kinds together (``fit_collectives``);
- a GEMM table is the seconds of each ``(m, n, k)`` of a grid, turned into the fraction of the
  dtype's peak that ``cost_models.compute.gemm_efficiency`` reads (``gemm_tables``);
- the offload figures (``measure_offload``, ``cost_models.offload_cost``): NVMe write and read
  bandwidth of a temporary file in ``--nvme-path`` (default the system's temporary directory), and
  the host's AdamW throughput with the runtime's kernel (``runtime.data_parallel.flat_shards.adamw_step_``) on a large
  flat buffer, every core at work; on the CPU path also the host-device "link", a memory copy.

The NVMe write is timed up to its ``fsync`` (the bytes are on the drive, not in the page cache),
and the page cache is dropped for the file (``os.posix_fadvise(POSIX_FADV_DONTNEED)``) before the
read, so the read comes from the drive. A directory on a RAM-backed file system (tmpfs) measures
memory instead: the profile's ``source`` names the directory so the reader can tell.
"""

from __future__ import annotations

import math
import os
import queue as queue_mod
import shutil
import tempfile
import threading
import time
from typing import Any, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cost_models.comm_cost import ring_terms
from planner.errors import UserError

__all__ = [
    "CalibrationError",
    "KB",
    "MB",
    "GB",
    "MEASURED_KINDS",
    "MIN_EFFICIENCY",
    "lower_quartile",
    "median",
    "positive_rate",
    "fit_alpha_beta",
    "fit_collectives",
    "collective_links",
    "gemm_tables",
    "finite",
    "fmt_bytes",
    "drain_progress",
    "measure_nvme",
    "offload_source",
    "measure_cpu_adam",
    "measure_host_copy",
    "measure_offload",
    "physical_memory",
]

KB = 1 << 10
MB = 1 << 20
GB = 1 << 30
#: Collective kinds measured (``send`` = ping-pong between rank pairs).
MEASURED_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send")


def physical_memory() -> int | None:
    """This machine's physical memory in bytes, ``None`` where the system does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


#: Smallest efficiency a GEMM table stores (a profile needs values in (0, 1]).
MIN_EFFICIENCY = 1e-6


class CalibrationError(UserError):
    """Calibration could not run or its measurements could not be fitted."""


def positive_rate(value: Any) -> float | None:
    """A measured rate, or None where it is missing, NaN, infinite or not positive (the profile
    then keeps its default)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    k = len(ordered) // 2
    return ordered[k] if len(ordered) % 2 else 0.5 * (ordered[k - 1] + ordered[k])


def lower_quartile(values: Sequence[float]) -> float:
    """The 25th percentile (linear interpolation between order statistics)."""
    ordered = sorted(values)
    pos = 0.25 * (len(ordered) - 1)
    below = int(pos)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (pos - below)


def fit_alpha_beta(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Least-squares ``(alpha, bandwidth)`` from ``(steps, link_bytes, seconds)`` samples.

    Minimizes ``sum(((steps * alpha + link_bytes * c) - t) / t)^2`` over ``alpha >= 0`` and
    ``c = 1 / bandwidth > 0`` by the 2 x 2 normal equations (clamping ``alpha`` to 0 and refitting
    ``c`` alone if needed). Raises ``CalibrationError`` if no positive bandwidth fits, e.g. when
    times do not grow with size.
    """
    rows = [(steps / seconds, link_bytes / seconds) for steps, link_bytes, seconds in samples if seconds > 0]
    if len(rows) < 2:
        raise CalibrationError(f"need at least 2 timed messages to fit alpha and beta (got {len(rows)})")
    # Residual r_i = x_i . (alpha, c) - 1 with x_i = (steps/t, bytes/t) = (per_step, per_byte).
    s11 = sum(per_step * per_step for per_step, _ in rows)
    s12 = sum(per_step * per_byte for per_step, per_byte in rows)
    s22 = sum(per_byte * per_byte for _, per_byte in rows)
    sum_step = sum(per_step for per_step, _ in rows)
    sum_byte = sum(per_byte for _, per_byte in rows)
    det = s11 * s22 - s12 * s12
    if det > 1e-12 * max(s11 * s22, 1e-300):
        alpha = (sum_step * s22 - sum_byte * s12) / det
        seconds_per_byte = (s11 * sum_byte - s12 * sum_step) / det  # c
    else:  # every sample has the same steps/bytes ratio: only the bandwidth is identifiable
        alpha, seconds_per_byte = -1.0, 1.0
    if seconds_per_byte > 0 and alpha < 0:
        alpha = 0.0
        seconds_per_byte = sum_byte / s22 if s22 > 0 else 0.0
    if seconds_per_byte <= 0:
        raise CalibrationError(
            "could not fit a bandwidth: collective times do not grow with message size; "
            "rerun on a quieter machine or with larger --message sizes"
        )
    return alpha, 1.0 / seconds_per_byte


def fit_collectives(measurements: Sequence[dict[str, Any]]) -> tuple[dict[str, dict[str, float]], tuple[float, float]]:
    """Per-kind and joint alpha-beta fits of ``[{kind, size_bytes, n, seconds}, ...]``.

    Returns ``(per_kind, (alpha, bandwidth))``: ``per_kind[kind] = {"alpha_s", "bandwidth_Bps"}``
    (NaN for a kind whose times do not grow with size) and the fit of every sample together.
    Raises ``CalibrationError`` when even the joint fit fails.
    """
    samples = []
    per_kind: dict[str, dict[str, float]] = {}
    for kind in MEASURED_KINDS:
        kind_samples = []
        for measurement in measurements:
            if measurement["kind"] == kind:
                steps, link_bytes = ring_terms(kind, measurement["size_bytes"], measurement["n"])
                kind_samples.append((steps, link_bytes, measurement["seconds"]))
        samples += kind_samples
        try:
            alpha, bandwidth = fit_alpha_beta(kind_samples)
            per_kind[kind] = {"alpha_s": alpha, "bandwidth_Bps": bandwidth}
        except CalibrationError:
            per_kind[kind] = {"alpha_s": float("nan"), "bandwidth_Bps": float("nan")}
    return per_kind, fit_alpha_beta(samples)


def collective_links(per_kind: dict[str, dict[str, float]]) -> dict[str, dict[str, float]] | None:
    """The profile's ``intra_node_collectives`` from ``fit_collectives``'s per-kind fits: each
    kind's ``{latency, bandwidth}``, the kinds that could not be fitted (NaN) left out; ``None``
    when none could."""
    return {
        kind: {"latency": fit["alpha_s"], "bandwidth": fit["bandwidth_Bps"]}
        for kind, fit in per_kind.items()
        if fit["bandwidth_Bps"] == fit["bandwidth_Bps"]
    } or None


def gemm_tables(
    sizes: dict[str, list[int]], seconds: dict[str, Any], peaks: dict[str, float]
) -> tuple[dict[str, dict[str, list]], dict[str, str]]:
    """Turn timed GEMM grids into the profile's ``gemm_efficiency`` tables.

    ``sizes`` holds the axes ``{"m": [...], "n": [...], "k": [...]}``; ``seconds[dtype][i][j][l]``
    the time of one ``m[i] x k[l]`` by ``k[l] x n[j]`` product (``None`` or NaN where it failed).
    Each cell becomes ``2 m n k / seconds / peaks[dtype]``, kept to ``(0, 1]`` (a shape faster than
    the peak, possible only when the peak is itself a measured best, counts as 1). Returns
    ``(tables, skipped)``: a dtype with a failed cell or no peak has no table, and ``skipped``
    says why.
    """
    tables: dict[str, dict[str, list]] = {}
    skipped: dict[str, str] = {}
    for dtype, grid in seconds.items():
        if dtype not in peaks:
            skipped[dtype] = "no peak FLOP/s for this dtype"
            continue
        efficiency = []
        complete = True
        for i, m_rows in enumerate(sizes["m"]):
            plane = []
            for j, n in enumerate(sizes["n"]):
                row = []
                for k_index, k in enumerate(sizes["k"]):
                    cell_s = grid[i][j][k_index]
                    if not isinstance(cell_s, (int, float)) or not math.isfinite(cell_s) or cell_s <= 0:
                        complete = False
                        break
                    row.append(min(1.0, max(MIN_EFFICIENCY, 2.0 * m_rows * n * k / cell_s / peaks[dtype])))
                plane.append(row)
            efficiency.append(plane)
        if complete:
            tables[dtype] = {
                "m": list(sizes["m"]),
                "n": list(sizes["n"]),
                "k": list(sizes["k"]),
                "efficiency": efficiency,
            }
        else:
            skipped[dtype] = "a GEMM of the grid could not be timed"
    return tables, skipped


def offload_source(offload: dict, host_is_device: bool) -> str:
    """The profile's ``source`` sentence on how the offload fields were measured (``offload``: the
    ``offload`` measurements; CPU runs copy host memory for the host-device link)."""
    nvme = offload.get("nvme") or {}
    link = "host_device_bandwidth = a host memory copy (the host is the device); " if host_is_device else ""
    return (
        f" Offload: {link}nvme_* = a {fmt_bytes(nvme.get('bytes', 0))} temporary file in {nvme.get('dir')} "
        f"(write to its fsync, read after dropping its page cache), nvme_bytes = that file system's free "
        f"space; cpu_adam_params_per_s = runtime.data_parallel.flat_shards.adamw_step_ on a flat fp32 buffer on the host, all "
        f"cores; host_memory_bytes = physical RAM."
    )


def fmt_bytes(n: float) -> str:
    for unit, f in (("GB", GB), ("MB", MB), ("KB", KB)):
        if n >= f:
            return f"{n / f:g} {unit}"
    return f"{n:g} B"


def finite(obj: Any) -> Any:
    """A copy with NaN / inf floats replaced by ``None`` (strict JSON has no NaN)."""
    if isinstance(obj, dict):
        return {k: finite(item) for k, item in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(item) for item in obj]
    if isinstance(obj, float) and not (obj == obj and abs(obj) != float("inf")):
        return None
    return obj


def drain_progress(labels, stop: threading.Event, total: int, enabled: bool) -> None:
    """Show a rich progress bar on stderr, one step per label put on the queue ``labels``, until ``stop``."""
    if not enabled:
        while not stop.is_set():
            try:
                labels.get(timeout=0.1)
            except queue_mod.Empty:
                pass
        return
    cols = (
        TextColumn("[bold]calibrate[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*cols, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("starting", total=total)
        while not stop.is_set() or not labels.empty():
            try:
                label = labels.get(timeout=0.1)
            except queue_mod.Empty:
                continue
            except (EOFError, OSError):
                break
            bar.update(task, advance=1, description=label)


# ---------------------------------------------------------------------------------------- offload
def _lq_seconds(fn, reps: int) -> float:
    """Lower quartile of ``reps`` timed calls of ``fn`` (after one warm-up call)."""
    fn()
    times = []
    for _ in range(max(1, reps)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return lower_quartile(times)


def measure_nvme(directory: str | None, nbytes: int, reps: int = 2) -> dict[str, Any]:
    """Write then read ``nbytes`` through a temporary file in ``directory`` (default: the system's
    temporary directory): ``{"dir", "bytes", "write_Bps", "read_Bps"}``, each the best of ``reps``.
    The write includes its ``fsync``; the read follows ``POSIX_FADV_DONTNEED`` on the file."""
    directory = directory or tempfile.gettempdir()
    if not os.path.isdir(directory):
        raise CalibrationError(
            f"--nvme-path {directory!r} is not a directory: give a directory on the drive "
            "to measure (the NVMe offload tier's files go there in training)"
        )
    chunk = min(nbytes, 8 * MB)
    block = os.urandom(chunk)  # incompressible, so a compressing file system cannot cheat
    writes, reads = [], []
    try:
        descriptor, path = tempfile.mkstemp(prefix="planner-nvme-", suffix=".bin", dir=directory)
    except OSError as e:
        raise CalibrationError(f"cannot create a file in --nvme-path {directory!r}: {e}") from None
    try:
        for _ in range(max(1, reps)):
            os.lseek(descriptor, 0, os.SEEK_SET)
            start = time.perf_counter()
            done = 0
            while done < nbytes:
                done += os.write(descriptor, block[: min(chunk, nbytes - done)])
            os.fsync(descriptor)
            writes.append(nbytes / (time.perf_counter() - start))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            os.lseek(descriptor, 0, os.SEEK_SET)
            start = time.perf_counter()
            got = 0
            while got < nbytes:
                data = os.read(descriptor, min(chunk, nbytes - got))
                if not data:
                    break
                got += len(data)
            reads.append(got / (time.perf_counter() - start))
    finally:
        os.close(descriptor)
        os.unlink(path)
    free = shutil.disk_usage(directory).free
    return {
        "dir": os.path.abspath(directory),
        "bytes": int(nbytes),
        "write_Bps": max(writes),
        "read_Bps": max(reads),
        "free_bytes": int(free),
    }


def measure_cpu_adam(num_params: int, reps: int = 3) -> float:
    """Parameters per second ``runtime.data_parallel.flat_shards.adamw_step_`` updates on the host (fp32 master,
    moments and gradient of ``num_params`` elements, torch's intra-op threads: every core)."""
    import torch  # heavy: only the measurements need it, not the statistics the planner shares

    from runtime.data_parallel.engine_config import OptimizerConfig
    from runtime.data_parallel.flat_shards import adamw_step_

    param = torch.randn(num_params)
    grad, exp_avg, exp_avg_sq = torch.randn(num_params), torch.zeros(num_params), torch.zeros(num_params)
    step = [0]
    config = OptimizerConfig(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def run():
        step[0] += 1
        adamw_step_(param, grad, exp_avg, exp_avg_sq, step=step[0], config=config)

    return num_params / _lq_seconds(run, reps)


def measure_host_copy(nbytes: int, reps: int = 5) -> float:
    """Bytes per second of a host memory copy (the ``cpu`` profile's host-device link)."""
    import torch  # heavy: see measure_cpu_adam

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return nbytes / _lq_seconds(lambda: dst.copy_(src), reps)


def measure_offload(nvme_path: str | None, quick: bool, host_copy: bool) -> dict[str, Any]:
    """The offload figures of this machine (module docstring): ``nvme`` (``measure_nvme``),
    ``cpu_adam_params_per_s`` and, with ``host_copy``, ``host_copy_Bps``."""
    out: dict[str, Any] = {
        "nvme": measure_nvme(nvme_path, (16 if quick else 512) * MB, reps=1 if quick else 2),
        # buffers well past the last-level cache, or the figures measure the cache
        "cpu_adam_params_per_s": measure_cpu_adam(1 << (22 if quick else 25), reps=2 if quick else 5),
    }
    if host_copy:
        out["host_copy_Bps"] = measure_host_copy((64 if quick else 256) * MB)
    return out
