"""Hardware profiles: the numbers every cost model reads, kept as data files.

A profile describes one *device* (a GPU, or one CPU process when training on CPU) and the links
around it. The built-in kinds live in ``cost_models/profiles/<kind>.json``; ``planner calibrate``
writes the same format for the machine it runs on, and ``load_hardware`` accepts either a kind
name or a path to such a file.

Units are SI throughout: FLOP/s, bytes, bytes per second, seconds. Bandwidths are *per device and
per direction*: NVLink's "600 GB/s" (A100, bidirectional total) is 300 GB/s here, and a 200 Gb/s
InfiniBand NIC per GPU is 25 GB/s. Latencies are the per-message (per ring step) start-up cost
``alpha`` of the alpha-beta model in ``cost_models.comm_cost``.

File format (JSON object; ``tf32``, ``calibration`` and the fields with a default in
``HardwareProfile`` optional, every other key required)::

    {"name": "a100-80gb",
     "peak_flops": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
     "memory_bytes": 85899345920, "memory_bandwidth": 2.039e12,
     "intra_node_bandwidth": 3e11, "intra_node_latency": 3e-6,
     "inter_node_bandwidth": 2.5e10, "inter_node_latency": 1e-5,
     "gpus_per_node": 8, "compute_efficiency": 0.7, "source": "where the numbers come from"}

Optional GEMM and host-link fields (``planner calibrate`` on CUDA writes all three)::

     "sm_count": 108,                       # streaming multiprocessors: the default GEMM curve
     "host_device_bandwidth": 2.5e10,       # bytes/s host <-> device (PCIe / C2C), pinned memory
     "gemm_efficiency": {"bf16": {"m": [256, 4096], "n": [256, 4096], "k": [256, 4096],
                                  "efficiency": [[[0.05, 0.2], [0.1, 0.5]], [[0.1, 0.5], [0.5, 0.75]]]}}

Optional offload fields (ZeRO-Offload / ZeRO-Infinity, priced by ``cost_models.offload_cost``; every
built-in profile carries datasheet figures, ``planner calibrate`` measures the last three)::

     "host_memory_bytes": 2199023255552,    # host DRAM per node, bytes
     "nvme_bytes": 30720000000000,          # NVMe capacity per node, bytes
     "nvme_read_bandwidth": 2.5e10,         # bytes/s per node, all drives (RAID 0) read at once
     "nvme_write_bandwidth": 1.2e10,        # bytes/s per node
     "cpu_adam_params_per_s": 6.5e9         # AdamW parameters updated per second per node

Optional optimizer field (``planner calibrate`` measures it; without it the step is the roofline)::

     "optimizer_bytes_per_s": 3.0e10        # the runtime's AdamW step, adam_step_bytes per second

Every offload field is *per node* except ``host_device_bandwidth`` (per device): the node's GPUs share the
host's memory, its drives and its cores, so the cost model divides the last four by the devices of
the node that use them at once. A profile without one of them cannot offload to the tier that
needs it (the search says so). On a ``cpu`` profile the host *is* the device: the host-device link
is the memory copy bandwidth, and host memory is the same RAM the ranks' tensors live in.

``gemm_efficiency[dtype].efficiency[i][j][l]`` is the achieved fraction of ``peak_flops[dtype]``
of an ``m[i] x k[l]`` by ``k[l] x n[j]`` product (``cost_models.compute.gemm_efficiency`` reads it).

Every problem with a profile raises ``ProfileError`` (a ``ValueError``) whose message names the
file and the field, and says what a valid value looks like.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "HardwareProfile",
    "ProfileError",
    "KNOWN_KINDS",
    "PEAK_DTYPES",
    "REQUIRED_PEAK_DTYPES",
    "PROFILE_DIR",
    "GEMM_AXES",
    "OFFLOAD_FIELDS",
    "load_hardware",
    "profile_path",
]

#: Folder of the built-in profiles shipped with the package.
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"

#: Built-in hardware kinds (file stems in ``PROFILE_DIR``), as the CLI contract names them.
#: ``v100-16gb-eth25`` and ``v100-32gb-eth100`` are Ethernet clusters (AWS p3.16xlarge and
#: p3dn.24xlarge: 25 and 100 Gb/s per node, shared by its 8 GPUs), the others InfiniBand or one host.
KNOWN_KINDS: tuple[str, ...] = (
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h200",
    "v100-32gb",
    "v100-16gb-eth25",
    "v100-32gb-eth100",
    "cpu",
)

#: Data types a profile may give a peak for; ``tf32`` is optional (only fp32 matmuls that opt in).
PEAK_DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")
REQUIRED_PEAK_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")


class ProfileError(ValueError):
    """A hardware profile could not be found, parsed or validated."""


def _is_number(value: Any) -> bool:
    # bool is an int subclass, but ``true`` is never a meaningful bandwidth.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_fraction(name: str, value: Any, upper: float, meaning: str) -> None:
    if not _is_number(value) or not (0 < value <= upper):
        raise ProfileError(f"field {name!r} must be a number in (0, {upper:g}], {meaning} (got {value!r})")


@dataclass(frozen=True)
class HardwareProfile:
    """One device type and its interconnect; every number is per device."""

    name: str
    """Identifier written into plan.json (``hardware.name``), e.g. ``a100-80gb``."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by dtype: ``fp32``, ``bf16``, ``fp16`` required, ``tf32`` optional."""
    memory_bytes: int
    """Device memory capacity in bytes (what the planner must fit model state and activations in)."""
    memory_bandwidth: float
    """Device memory (HBM / DRAM) bandwidth in bytes/s: the roofline's memory ceiling."""
    intra_node_bandwidth: float
    """Bytes/s one device can send in one direction to a peer in the same node (NVLink)."""
    intra_node_latency: float
    """Seconds of start-up cost per message (per ring step) inside a node."""
    inter_node_bandwidth: float
    """Bytes/s one device can send in one direction to another node (its share of the NICs)."""
    inter_node_latency: float
    """Seconds of start-up cost per message (per ring step) between nodes."""
    gpus_per_node: int
    """Devices per node: consecutive global ranks ``k*G .. k*G+G-1`` share node ``k``."""
    compute_efficiency: float
    """Achievable fraction of peak FLOP/s for large matmuls, in (0, 1]."""
    op_overhead_s: float = 0.0
    """Fixed seconds per operator call (dispatch and launch), charged per op of forward and
    backward on top of the FLOP time (or beside it, ``ops_async``); it is what makes many small
    micro-batches slower than few large ones. ``planner calibrate`` measures it on CPUs. The GPU
    profiles carry 28 us, what our runtime's eager per-operator dispatch cost on an H200 host
    (``planner validate``, 4 micro-batches of 4 against 1 of 16 sequences of a 12 x 1024 GPT, bf16:
    125 ms against 57 ms for the same FLOPs, over 3 x 822 extra operator calls)."""
    sync_overhead_s: float = 0.0
    """Seconds a *blocking* collective costs beyond its alpha-beta time inside a training step:
    the ranks reach it at slightly different moments (compute jitter) and the waiting one must
    wake up. Charged per tensor-parallel all-reduce and per pipeline transfer. ``planner
    calibrate`` measures it: the mean wait per call of the least-waiting rank in a loop of a
    layer's matmuls and a blocking all-reduce, beyond the same call back to back; 0 in datasheet
    profiles, where kernels queue asynchronously and the jitter is small."""
    ops_async: bool = False
    """The device runs operators asynchronously from the host that issues them (GPUs): a
    layer's pass costs ``max(device time, operators x op_overhead_s)``. False for CPU ranks,
    where issuing and running an operator happen on the same core and add up."""
    recompute_ratio: float = 1.0
    """What re-running a checkpointed layer's forward in backward costs, as a fraction of that
    forward in the forward pass. 1 on GPUs; on a CPU it is below 1 (about 0.8 measured here):
    the forward writes each saved activation into memory not touched since the last step, while
    the recomputation writes into the cache-warm buffers the backward has just freed. ``planner
    calibrate`` measures it (a checkpointed step against a plain one and a forward alone)."""
    overlap_slowdown: float = 0.0
    """How much slower compute runs while a collective runs beside it: compute of ``t`` seconds
    that overlaps a collective takes ``(1 + overlap_slowdown) t`` (the *contention* of an
    overlapped collective: it takes memory bandwidth and, on a GPU, the SMs its kernels occupy).
    ``cost_models.overlap_cost`` charges it for the time compute and communication run together
    (:attr:`overlap_contention`, with :attr:`overlap_comm_rate`). In ``[0, 1)``; 0 means free overlap. ``planner calibrate`` measures it (a compute
    loop alone against the same loop beside a loop of all-reduces between the calibrate processes).
    GPU defaults, a first-principles estimate until ``planner calibrate --device cuda`` measures one:
    NCCL runs each collective as one thread block per channel, and a large intra-node ring
    all-reduce typically runs on the order of 16 channels (an assumption; NCCL picks the count per
    topology), so a GEMM sharing the GPU loses about ``16 / sm_count`` of its SMs: 0.20 on a V100
    (80 SMs), 0.15 on an A100 (108), 0.12 on an H100/H200 (132); the HBM traffic of the reduction
    (a few bytes per byte sent) is small beside these GEMMs' needs and is not added. The ``cpu``
    profile's value is measured (``planner calibrate`` on the machine that wrote it)."""
    overlap_comm_rate: float = 1.0
    """The fraction of its own speed a collective keeps while compute runs beside it (the other
    side of the contention): a collective of ``c`` seconds alone progresses ``overlap_comm_rate``
    seconds of its work per second beside compute. In ``(0, 1]``. With the slowdown ``kappa`` and
    this rate ``rho``, a window of ``w`` seconds of compute lasts ``(1 + kappa) w`` beside a
    collective and hides up to ``rho (1 + kappa) w`` seconds of it (:attr:`overlap_window_gain`);
    each hidden second costs the compute ``kappa / (rho (1 + kappa))`` seconds
    (:attr:`overlap_contention`; ``cost_models.overlap_cost``). GPU defaults 1: NCCL's kernels keep
    the SMs they occupy and are bound by the link, which compute does not use. On a CPU the
    reduction threads share the cores with the matmuls: ``planner calibrate`` measures it (how much
    of a chain of all-reduces completes while the compute loop runs, against the chain alone); the
    ``cpu`` profile's value was measured on this project's development machine."""
    intra_node_collectives: dict[str, dict[str, float]] | None = None
    """Optional per-collective intra-node link, ``{kind: {"latency": s, "bandwidth": B/s}}`` for
    kinds among ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``send``: the alpha and
    bandwidth that kind was measured to reach (e.g. gloo's reduce-scatter reaches a third of its
    all-reduce bandwidth). A kind not listed uses ``intra_node_latency``/``intra_node_bandwidth``.
    ``planner calibrate`` fills it; datasheet profiles leave it out."""
    sm_count: int | None = None
    """Streaming multiprocessors of a GPU (datasheet figure, or what ``planner calibrate`` reads
    from the device). With it, a GEMM the ``gemm_efficiency`` table does not cover is priced by
    the default curve of ``cost_models.compute`` (output tiles spread over the SMs: small GEMMs
    leave SMs idle); without it (CPU profiles) a GEMM is priced by the plain roofline."""
    gemm_efficiency: dict[str, dict[str, list]] | None = None
    """Optional measured GEMM efficiency by dtype: ``{dtype: {"m": [...], "n": [...], "k": [...],
    "efficiency": [[[...]]]}}``, the axes strictly increasing sizes and ``efficiency[i][j][l]``
    the fraction of ``peak_flops[dtype]`` an ``m[i] x k[l]`` by ``k[l] x n[j]`` product reached.
    ``cost_models.compute.gemm_efficiency`` interpolates it in log space and clamps at its edges.
    ``planner calibrate`` fills it; datasheet profiles leave it out."""
    gemm_misaligned_efficiency: float = 1.0
    """What a 16-bit or TF32 product keeps of its tabled efficiency when a size is not a multiple
    of 16 bytes of its elements (8 bf16/fp16 values, 4 TF32): tensor-core kernels need aligned
    leading dimensions, and cuBLAS falls back to older, slower ones (a language-model head over
    GPT-2's 50,257-word vocabulary is the common case; Megatron-LM pads its vocabulary to a
    multiple of 128 for this). In ``(0, 1]``; 1 on CPUs. ``planner calibrate --device cuda``
    measures it (the GEMM grid's largest cube against the same with ``n`` one short). Hopper
    defaults: measured on an H200 here (2026-12-04, torch 2.11 + CUDA 13.0: the three products of
    that head at 16,384 tokens ran cuBLAS's ``cutlass_75`` fallback at 93-142 TFLOP/s against
    about 720 for their aligned neighbours in the calibrated table, 0.17 of it in the mean);
    other GPUs keep 1 until measured."""
    host_device_bandwidth: float | None = None
    """Bytes/s of a pinned-memory copy between host and device (PCIe or C2C), per device, the slower
    of the two directions; ``None`` when unknown. What offload's transfers run at
    (``cost_models.offload_cost``). ``planner calibrate`` measures it: pinned copies on CUDA, a memory
    copy on a CPU (where the host is the device)."""
    host_memory_bytes: int | None = None
    """Host DRAM per node in bytes: what offloaded optimizer state, parameter shards and their pinned
    buffers must fit in (``cost_models.offload_cost``), for all of the node's devices together."""
    nvme_bytes: int | None = None
    """NVMe capacity per node in bytes (the ZeRO-Infinity tier's files, all of the node's devices)."""
    nvme_read_bandwidth: float | None = None
    """Bytes/s the node's NVMe drives read together (RAID 0 or one file per drive), shared by the
    node's devices."""
    nvme_write_bandwidth: float | None = None
    """Bytes/s the node's NVMe drives write together (fsync'd), shared by the node's devices."""
    cpu_adam_params_per_s: float | None = None
    """Parameters per second the node's CPUs update with a fused, multi-threaded AdamW (all cores of
    the node, fp32 master, moments and gradient): shared by the node's devices whose optimizer runs
    on the host at once. ``planner calibrate`` times ``runtime.data_parallel.flat_shards.adamw_step_`` on a large flat
    buffer."""
    optimizer_bytes_per_s: float | None = None
    """Bytes per second, counted as ``cost_models.compute.adam_step_bytes`` counts them, at which
    the device runs the runtime's optimizer step (the gradient's square sums, the fused AdamW
    and ``zero_grad``) over a shard past its caches, every rank of a node at once; it replaces the
    roofline of ``memory_bandwidth`` and the fp32 peak (``None``: the roofline prices the step).
    ``planner calibrate`` measures it: on a CPU the fused AdamW runs at neither its copy bandwidth
    nor its FLOP rate (this machine, one thread per rank, both stepping at once: 25-26 GB/s
    against a 17-21 GB/s out-of-cache copy; with an in-cache copy the roofline predicted half the
    step's measured optimizer part)."""
    source: str = ""
    """Where the numbers come from (datasheet, calibration run, ...)."""
    calibration: dict[str, Any] | None = None
    """Raw measurements behind a calibrated profile (``planner calibrate``); ``None`` otherwise."""

    def __post_init__(self) -> None:
        self._check_peak_flops()
        self._check_sizes_and_links()
        self._check_overheads()
        self._check_optional_fields()
        self._check_tables_and_provenance()

    def _check_peak_flops(self) -> None:
        """The name, and a positive peak for every required dtype (kept as a private float copy)."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise ProfileError(f"field 'name' must be a non-empty string (got {self.name!r})")
        if not isinstance(self.peak_flops, dict):
            raise ProfileError(
                "field 'peak_flops' must be an object of FLOP/s by dtype, e.g. "
                f'{{"fp32": 1.95e13, "bf16": 3.12e14, "fp16": 3.12e14}} (got {self.peak_flops!r})'
            )
        for dtype in REQUIRED_PEAK_DTYPES:
            if dtype not in self.peak_flops:
                raise ProfileError(
                    f"field 'peak_flops' is missing dtype {dtype!r} "
                    f"(required: {', '.join(REQUIRED_PEAK_DTYPES)}; optional: tf32)"
                )
        for dtype, value in self.peak_flops.items():
            if dtype not in PEAK_DTYPES:
                raise ProfileError(
                    f"field 'peak_flops' has unknown dtype {dtype!r} (allowed: {', '.join(PEAK_DTYPES)})"
                )
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise ProfileError(f"field 'peak_flops.{dtype}' must be a positive number of FLOP/s (got {value!r})")
        # A private float copy: the caller's dict can change without changing the profile.
        object.__setattr__(self, "peak_flops", {dtype: float(value) for dtype, value in self.peak_flops.items()})

    def _check_sizes_and_links(self) -> None:
        """Memory, node size, bandwidths and latencies."""
        # JSON has one number type: accept an integral float for the integer fields.
        for name in ("memory_bytes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, name, int(value))
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ProfileError(f"field {name!r} must be a positive integer (got {value!r})")
        for name in ("memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise ProfileError(f"field {name!r} must be a positive number of bytes/s (got {value!r})")
        for name in ("intra_node_latency", "inter_node_latency"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise ProfileError(f"field {name!r} must be a non-negative number of seconds (got {value!r})")

    def _check_overheads(self) -> None:
        """Efficiency, per-call overheads, recompute ratio and per-collective links."""
        _check_fraction("compute_efficiency", self.compute_efficiency, 1, "the achievable fraction of peak")
        for name in ("op_overhead_s", "sync_overhead_s"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise ProfileError(f"field {name!r} must be a non-negative number of seconds (got {value!r})")
        if not isinstance(self.ops_async, bool):
            raise ProfileError(f"field 'ops_async' must be true or false (got {self.ops_async!r})")
        _check_fraction(
            "recompute_ratio", self.recompute_ratio, 2, "the cost of a recomputed forward relative to the first one"
        )
        value = self.overlap_slowdown
        if not _is_number(value) or not math.isfinite(value) or not 0 <= value < 1:
            raise ProfileError(
                "field 'overlap_slowdown' must be a number in [0, 1), how much slower compute runs beside "
                f"a collective (got {value!r})"
            )
        object.__setattr__(self, "overlap_slowdown", float(value))
        rate = self.overlap_comm_rate
        if not _is_number(rate) or not math.isfinite(rate) or not 0 < rate <= 1:
            raise ProfileError(
                "field 'overlap_comm_rate' must be a number in (0, 1], the fraction of its speed a "
                f"collective keeps beside compute (got {rate!r})"
            )
        object.__setattr__(self, "overlap_comm_rate", float(rate))
        if self.intra_node_collectives is not None:
            object.__setattr__(self, "intra_node_collectives", _check_collective_links(self.intra_node_collectives))

    def _check_optional_fields(self) -> None:
        """The GEMM, host-link and offload fields: absent, or valid."""
        if self.sm_count is not None:
            value: Any = self.sm_count
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, "sm_count", int(value))
            if not isinstance(self.sm_count, int) or isinstance(self.sm_count, bool) or self.sm_count < 1:
                raise ProfileError(
                    f"field 'sm_count' must be a positive integer (streaming multiprocessors) or absent (got {value!r})"
                )
        for name in ("host_memory_bytes", "nvme_bytes"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, name, int(value))
                value = int(value)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ProfileError(
                    f"field {name!r} must be a positive integer of bytes per node or absent (got {value!r})"
                )
        for name, unit in (
            ("host_device_bandwidth", "bytes/s"),
            ("nvme_read_bandwidth", "bytes/s per node"),
            ("nvme_write_bandwidth", "bytes/s per node"),
            ("cpu_adam_params_per_s", "parameters/s per node"),
            ("optimizer_bytes_per_s", "bytes/s per device"),
        ):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise ProfileError(f"field {name!r} must be a positive number of {unit} or absent (got {value!r})")
            object.__setattr__(self, name, float(value))

    def _check_tables_and_provenance(self) -> None:
        """The GEMM efficiency tables, the source and the calibration record."""
        if self.gemm_efficiency is not None:
            object.__setattr__(self, "gemm_efficiency", _check_gemm_tables(self.gemm_efficiency, self.peak_flops))
        _check_fraction(
            "gemm_misaligned_efficiency",
            self.gemm_misaligned_efficiency,
            1,
            "the share of its efficiency a product with a size not a multiple of 16 bytes keeps",
        )
        object.__setattr__(self, "gemm_misaligned_efficiency", float(self.gemm_misaligned_efficiency))
        if not isinstance(self.source, str):
            raise ProfileError(f"field 'source' must be a string (got {self.source!r})")
        if self.calibration is not None and not isinstance(self.calibration, dict):
            raise ProfileError(f"field 'calibration' must be an object or absent (got {self.calibration!r})")

    def __hash__(self) -> int:
        # Frozen but holds a dict: hash the numbers (equal profiles hash equal), so a profile
        # can key an lru_cache in the planner.
        return hash(
            (
                self.name,
                tuple(sorted(self.peak_flops.items())),
                self.memory_bytes,
                self.memory_bandwidth,
                self.intra_node_bandwidth,
                self.intra_node_latency,
                self.inter_node_bandwidth,
                self.inter_node_latency,
                self.gpus_per_node,
                self.compute_efficiency,
                self.op_overhead_s,
                self.sync_overhead_s,
                self.recompute_ratio,
                self.overlap_slowdown,
                self.overlap_comm_rate,
                self.ops_async,
                tuple(
                    sorted(
                        (k, link["latency"], link["bandwidth"])
                        for k, link in (self.intra_node_collectives or {}).items()
                    )
                ),
                self.sm_count,
                self.gemm_misaligned_efficiency,
                self.host_device_bandwidth,
                self.host_memory_bytes,
                self.nvme_bytes,
                self.nvme_read_bandwidth,
                self.nvme_write_bandwidth,
                self.cpu_adam_params_per_s,
                self.optimizer_bytes_per_s,
                tuple(
                    sorted(
                        (
                            dtype,
                            tuple(table["m"]),
                            tuple(table["n"]),
                            tuple(table["k"]),
                            tuple(x for plane in table["efficiency"] for row in plane for x in row),
                        )
                        for dtype, table in (self.gemm_efficiency or {}).items()
                    )
                ),
            )
        )

    # ----------------------------------------------------------------------------------------
    @property
    def overlap_window_gain(self) -> float:
        """Seconds of communication a second of compute can hide: the window stretches by the
        slowdown and the collective runs at its rate beside it, ``rho (1 + kappa)``."""
        return self.overlap_comm_rate * (1.0 + self.overlap_slowdown)

    @property
    def overlap_contention(self) -> float:
        """Seconds of compute lost per second of communication hidden: over the ``t`` seconds both
        run the compute loses ``kappa t / (1 + kappa)`` and the collective does ``rho t`` of its work."""
        return self.overlap_slowdown / self.overlap_window_gain

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (``fp32``, ``tf32``, ``bf16``, ``fp16``)."""
        try:
            return float(self.peak_flops[dtype])
        except KeyError:
            raise ProfileError(
                f"hardware {self.name!r} has no peak FLOP/s for dtype {dtype!r} "
                f"(it has: {', '.join(sorted(self.peak_flops))})"
            ) from None

    def achievable_flops(self, dtype: str) -> float:
        """``peak(dtype) * compute_efficiency``: the rate large matmuls actually reach."""
        return self.peak(dtype) * self.compute_efficiency

    def link(self, kind: str, intra_node: bool) -> tuple[float, float]:
        """``(latency, bandwidth)`` a collective of ``kind`` sees on the intra- or inter-node link."""
        if not intra_node:
            return self.inter_node_latency, self.inter_node_bandwidth
        own = (self.intra_node_collectives or {}).get("send" if kind in ("p2p", "recv") else kind)
        if own is not None:
            return own["latency"], own["bandwidth"]
        return self.intra_node_latency, self.intra_node_bandwidth

    def with_gpus_per_node(self, gpus_per_node: int) -> "HardwareProfile":
        """A copy with another node size (the CLI's ``--gpus-per-node``), validated."""
        return dataclasses.replace(self, gpus_per_node=gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``load_hardware`` reads back (``calibration`` only when present)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["peak_flops"] = dict(self.peak_flops)
        fields["gemm_efficiency"] = _copy_tables(self.gemm_efficiency) if self.gemm_efficiency is not None else None
        for opt in (
            "calibration",
            "intra_node_collectives",
            "sm_count",
            "gemm_efficiency",
            "host_device_bandwidth",
            *OFFLOAD_FIELDS,
        ):
            if fields[opt] is None:
                del fields[opt]
        return fields

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON to ``path`` (parent folders created) and return the path."""
        target = Path(path)
        if target.parent and not target.parent.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return target

    @classmethod
    def from_dict(cls, data: Any, origin: str = "<dict>") -> "HardwareProfile":
        """Validate a parsed JSON object; errors are prefixed with ``origin`` (the file)."""
        if not isinstance(data, dict):
            raise ProfileError(
                f"hardware profile {origin}: the top level must be a JSON object, got {type(data).__name__}"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        for key in data:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (allowed: {', '.join(names)})"
                raise ProfileError(f"hardware profile {origin}: unknown field {key!r}{hint}")
        missing = [k for k in required if k not in data]
        if missing:
            raise ProfileError(
                f"hardware profile {origin}: missing field{'s' if len(missing) > 1 else ''} "
                f"{', '.join(repr(name) for name in missing)} (required: {', '.join(required)})"
            )
        try:
            return cls(**data)
        except ProfileError as e:
            raise ProfileError(f"hardware profile {origin}: {e}") from None


#: The optional offload fields (besides ``host_device_bandwidth``), all per node.
OFFLOAD_FIELDS: tuple[str, ...] = (
    "host_memory_bytes",
    "nvme_bytes",
    "nvme_read_bandwidth",
    "nvme_write_bandwidth",
    "cpu_adam_params_per_s",
)

#: Collective kinds a profile's ``intra_node_collectives`` may describe.
LINK_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send")


def _check_collective_links(value: Any) -> dict[str, dict[str, float]]:
    example = '{"all_reduce": {"latency": 1e-4, "bandwidth": 1.1e9}}'
    if not isinstance(value, dict):
        raise ProfileError(f"field 'intra_node_collectives' must be an object like {example} (got {value!r})")
    out: dict[str, dict[str, float]] = {}
    for kind, link in value.items():
        if kind not in LINK_KINDS:
            raise ProfileError(
                f"field 'intra_node_collectives' has unknown collective {kind!r} (allowed: {', '.join(LINK_KINDS)})"
            )
        if not isinstance(link, dict) or set(link) != {"latency", "bandwidth"}:
            raise ProfileError(
                f"field 'intra_node_collectives.{kind}' must be an object with exactly "
                f"'latency' (s) and 'bandwidth' (bytes/s) (got {link!r})"
            )
        latency, bandwidth = link["latency"], link["bandwidth"]
        if not _is_number(latency) or not math.isfinite(latency) or latency < 0:
            raise ProfileError(
                f"field 'intra_node_collectives.{kind}.latency' must be a non-negative number of seconds (got {latency!r})"
            )
        if not _is_number(bandwidth) or not math.isfinite(bandwidth) or bandwidth <= 0:
            raise ProfileError(
                f"field 'intra_node_collectives.{kind}.bandwidth' must be a positive number of bytes/s (got {bandwidth!r})"
            )
        out[kind] = {"latency": float(latency), "bandwidth": float(bandwidth)}
    return out


#: Keys of one dtype's table in ``gemm_efficiency``: the three size axes and the grid.
GEMM_AXES: tuple[str, ...] = ("m", "n", "k")


def _copy_tables(tables: dict[str, dict[str, list]]) -> dict[str, dict[str, list]]:
    return {
        dtype: {
            "m": list(table["m"]),
            "n": list(table["n"]),
            "k": list(table["k"]),
            "efficiency": [[list(row) for row in plane] for plane in table["efficiency"]],
        }
        for dtype, table in tables.items()
    }


def _check_gemm_tables(value: Any, peak_flops: dict[str, float]) -> dict[str, dict[str, list]]:
    """Validate ``gemm_efficiency`` and return a private copy (ints for sizes, floats for values)."""
    example = (
        '{"bf16": {"m": [256, 4096], "n": [256, 4096], "k": [256, 4096], '
        '"efficiency": [[[0.05, 0.2], [0.1, 0.5]], [[0.1, 0.5], [0.5, 0.75]]]}}'
    )
    if not isinstance(value, dict) or not value:
        raise ProfileError(
            f"field 'gemm_efficiency' must be a non-empty object of tables by dtype, e.g. {example} (got {value!r})"
        )
    out: dict[str, dict[str, list]] = {}
    for dtype, table in value.items():
        where = f"gemm_efficiency.{dtype}"
        if dtype not in PEAK_DTYPES:
            raise ProfileError(
                f"field 'gemm_efficiency' has unknown dtype {dtype!r} (allowed: {', '.join(PEAK_DTYPES)})"
            )
        if dtype not in peak_flops:
            raise ProfileError(
                f"field '{where}' is a fraction of a peak the profile lacks: 'peak_flops' has no {dtype!r}"
            )
        if not isinstance(table, dict) or set(table) != {*GEMM_AXES, "efficiency"}:
            got = sorted(table) if isinstance(table, dict) else table
            raise ProfileError(
                f"field '{where}' must be an object with exactly 'm', 'n', 'k' (sizes) and "
                f"'efficiency' (a grid m by n by k), e.g. {example[9:-1]} (got {got!r})"
            )
        axes = {}
        for axis in GEMM_AXES:
            sizes = table[axis]
            valid = (
                isinstance(sizes, list)
                and sizes
                and all(_is_number(x) and math.isfinite(x) and float(x).is_integer() and x >= 1 for x in sizes)
            )
            if valid:
                sizes = [int(x) for x in sizes]
                valid = all(smaller < larger for smaller, larger in zip(sizes, sizes[1:]))
            if not valid:
                raise ProfileError(
                    f"field '{where}.{axis}' must be a non-empty list of strictly increasing "
                    f"positive integer sizes (got {table[axis]!r})"
                )
            axes[axis] = sizes
        shape = tuple(len(axes[axis]) for axis in GEMM_AXES)
        grid = table["efficiency"]
        shape_msg = (
            f"field '{where}.efficiency' must be a {shape[0]} x {shape[1]} x {shape[2]} nested list "
            f"(one value per m, then per n, then per k)"
        )
        if not isinstance(grid, list) or len(grid) != shape[0]:
            raise ProfileError(f"{shape_msg} (got {grid!r})")
        clean = []
        for i, plane in enumerate(grid):
            if not isinstance(plane, list) or len(plane) != shape[1]:
                raise ProfileError(f"{shape_msg}: entry [{i}] is {plane!r}")
            rows = []
            for j, row in enumerate(plane):
                if not isinstance(row, list) or len(row) != shape[2]:
                    raise ProfileError(f"{shape_msg}: entry [{i}][{j}] is {row!r}")
                for k, x in enumerate(row):
                    if not _is_number(x) or not math.isfinite(x) or not (0 < x <= 1):
                        raise ProfileError(
                            f"field '{where}.efficiency[{i}][{j}][{k}]' must be a number in (0, 1], the "
                            f"achieved fraction of peak_flops.{dtype} (got {x!r})"
                        )
                rows.append([float(x) for x in row])
            clean.append(rows)
        out[dtype] = {**axes, "efficiency": clean}
    return out


def profile_path(kind: str) -> Path:
    """Path of a built-in kind's JSON file."""
    return PROFILE_DIR / f"{kind}.json"


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProfileError(
            f"hardware profile file not found: {path} (pass a built-in kind "
            f"({', '.join(KNOWN_KINDS)}) or the path of a profile JSON, e.g. one written by "
            f"`planner calibrate --out profile.json`)"
        ) from None
    except IsADirectoryError:
        raise ProfileError(f"hardware profile {path} is a directory, not a JSON file") from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"hardware profile {path} is not UTF-8 text: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(
            f"hardware profile {path} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        ) from None


def load_hardware(kind_or_path: str | os.PathLike, gpus_per_node: int | None = None) -> HardwareProfile:
    """Load a built-in kind (``a100-80gb`` ...) or a profile JSON file.

    A string that is one of ``KNOWN_KINDS`` (any case) selects the packaged profile; anything that ends in
    ``.json``, contains a path separator or names an existing file is read as a file. Anything
    else is an unknown kind, and the error lists the known ones. ``gpus_per_node`` (the CLI's
    ``--gpus-per-node``) overrides the profile's node size.
    """
    spec = os.fspath(kind_or_path)
    if spec.strip().lower() in KNOWN_KINDS:
        path = profile_path(spec.strip().lower())
    elif spec.endswith(".json") or os.sep in spec or "/" in spec or os.path.exists(spec):
        path = Path(spec)
    else:
        key = spec.strip().lower()
        # A kind that starts with what was typed ("h100" -> "h100-sxm") beats spelling similarity.
        close = [k for k in KNOWN_KINDS if k.startswith(key)] or difflib.get_close_matches(key, KNOWN_KINDS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ProfileError(
            f"unknown hardware kind {spec!r}: known kinds are {', '.join(KNOWN_KINDS)}, "
            f"or pass the path of a profile JSON file.{hint}"
        )
    profile = HardwareProfile.from_dict(_read_json(path), origin=str(path))
    if gpus_per_node is not None:
        try:
            profile = profile.with_gpus_per_node(gpus_per_node)
        except ProfileError as e:
            raise ProfileError(f"--gpus-per-node override for {profile.name!r}: {e}") from None
    return profile
