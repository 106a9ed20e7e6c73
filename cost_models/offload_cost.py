"""The price of offload (ZeRO-Offload, ZeRO-Infinity): transfers, the CPU AdamW step, NVMe IO, overlap.

Offload is a decision per state kind (plan.json ``offload``):

- ``optimizer``: ``none`` (AdamW on the device), ``cpu`` (ZeRO-Offload: the fp32 master weights,
  both Adam moments and an fp32 gradient accumulator of each rank's shard live in host memory and
  the AdamW step runs on the host's cores) or ``nvme`` (ZeRO-Infinity: master weights and moments
  in files, swapped through host buffers group by group; the gradient accumulator stays in host
  memory). Needs ZeRO 1, 2 or 3.
- ``params``: ``none``, ``cpu`` (each rank's training-dtype parameter shard lives in host memory
  and is fetched layer by layer ahead of use, freed after) or ``nvme`` (the shard lives in a file
  and is read into a host buffer, then copied). Needs ZeRO 3.

Notation (per device, one layer after the tensor-parallel split): ``P`` parameters, ``S =
ceil(P / dp)`` the rank's shard (``P`` at ZeRO 0), ``b`` bytes of the training dtype, ``B`` the
host-device link (``hw.host_device_bandwidth``, pinned, per device and direction), and the node's
shared resources divided by the ``g`` ranks of a node that use them at once (``g = min(gpus per
node, gpus)``): NVMe read ``R_r = nvme_read_bandwidth / g``, write ``R_w = nvme_write_bandwidth /
g``, CPU AdamW ``A = cpu_adam_params_per_s / g`` parameters per second. On a CPU profile (``not
hw.ops_async``: the host is the device) a rank's offloaded step runs on the same cores its
device step would: ``A`` is at most the rank's own AdamW rate (``cost_models.compute.
optimizer_step_time``), so moving the step to the "host" never makes it faster there
(:func:`adam_rate_per_rank`).

Device memory: offload removes what moved from ``cost_models.memory.model_state_bytes`` (that
module's docstring: the gradient buckets in flight, the gathered layers in flight).

Host and NVMe bytes (:func:`host_state_bytes`, :func:`offload_buffer_bytes`)
--------------------------------------------------------------------------
Per rank and layer: optimizer ``cpu`` ``16 S`` on the host (master, m, v and the gradient
accumulator, fp32; in fp32 training the master is the host's copy of the weights), ``nvme``
``4 S`` on the host and ``12 S`` in files; params ``cpu`` ``b S`` on the host, ``nvme`` ``b S``
in files. Pinned buffers per rank, sized by the largest layer shard ``S*`` of the model:
``(REDUCTIONS_IN_FLIGHT + 1) b S*`` for gradients on their way out, ``2 b S*`` for parameters
being fetched (double buffering), and ``2 x 12 S*`` for the optimizer state being swapped at the
NVMe tier (one group read while the previous is written); on a CPU profile, whose host is the
device, only the NVMe slots (``offload_buffer_bytes(staged=False)``). Per node: ``g`` times the rank's figure
(the most loaded stage), checked against ``host_memory_bytes`` and ``nvme_bytes`` times the
request's headroom.

Time (:func:`layer_offload`)
----------------------------
Every transfer overlaps something; only what outlasts it is exposed (plan.json
``predicted.time.offload``), the CPU step itself is the ``optimizer`` part:

- gradients out, ``b S / B`` per layer: at ZeRO 2/3 once per micro-batch, overlapped with the
  layer's backward (the next layer down computes while this bucket copies): exposed
  ``max(0, b S / B - t_bwd)`` per micro-batch; at ZeRO 1 once per step after the all-reduce, all
  exposed.
- the CPU AdamW step, ``S / A``: the ``optimizer`` part.
- updated parameters back, ``b S / B`` (unless the parameters are offloaded: the next use fetches
  them), and at the NVMe tier the state read ``12 S / R_r`` and written ``12 S / R_w`` (parameters
  offloaded to NVMe: their write ``b S / R_w`` too) run group by group alongside the CPU step (a
  pipeline: its time is the slowest stream's), exposed ``max(S / A, copy, NVMe IO) - S / A``.
- parameter fetches (``params`` offloaded): ``b S / B`` before the layer's forward and again before
  its backward, every micro-batch, prefetched during the previous layer's compute: exposed
  ``max(0, fetch - t_fwd) + max(0, fetch - t_bwd)``; at the NVMe tier the read from the file and
  the copy pipeline through the buffers, ``fetch = max(b S / R_r, b S / B)``.
- with the optimizer on the device but the parameters offloaded, the updated shard goes back to
  the host (and its file) after the step, exposed.

Each layer's exposure is priced against its own compute, so the sums stay per-layer (the ILP adds
them like every other cost); for identical blocks this is the pipeline's steady state.

Sources: ZeRO-Offload (Ren et al., USENIX ATC 2021: fp32 state and the Adam step on the CPU,
overlapped transfers) and ZeRO-Infinity (Rajbhandari et al., SC 2021: NVMe for optimizer state and
parameters); the hardware figures are the profile's (``cost_models.hardware``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.compute import optimizer_step_time
from cost_models.hardware import HardwareProfile
from cost_models.memory import bytes_per_param
from runtime.contract.choices import OffloadTier, names
from runtime.contract.limits import REDUCTIONS_IN_FLIGHT

__all__ = [
    "TIERS",
    "STATE_BYTES",
    "GRAD_ACCUMULATOR_BYTES",
    "LayerOffload",
    "check_offload",
    "offload_missing",
    "ranks_per_node",
    "adam_rate_per_rank",
    "OffloadedLayer",
    "layer_offload",
    "offload_breakdown",
    "host_state_bytes",
    "offload_buffer_bytes",
]

#: Where a state kind may live: on the device, in host memory, in NVMe files.
TIERS: tuple[str, ...] = names(OffloadTier)

#: Bytes per parameter of the offloaded optimizer state: fp32 master weights and two fp32 moments.
STATE_BYTES = 12

#: Bytes per parameter of the host's gradient accumulator (fp32, every micro-batch added into it).
GRAD_ACCUMULATOR_BYTES = 4


def check_offload(optimizer: str, params: str, zero_stage: int) -> str | None:
    """Why this offload setting is invalid (``None`` when it is valid)."""
    for kind, tier in (("optimizer", optimizer), ("params", params)):
        if tier not in TIERS:
            return f"offload of {kind} must be one of {', '.join(TIERS)} (got {tier!r})"
    if params != OffloadTier.NONE and zero_stage != 3:
        return (
            f"offloading parameters ({params}) needs ZeRO stage 3, which shards them (got ZeRO "
            f"{zero_stage}); use --zero-stage 3 or --offload-params none"
        )
    if optimizer != OffloadTier.NONE and zero_stage not in (1, 2, 3):
        return (
            f"offloading the optimizer ({optimizer}) needs ZeRO stage 1, 2 or 3 (got ZeRO {zero_stage}); "
            "use --zero-stage 1, 2 or 3 or --offload-optimizer none"
        )
    return None


def offload_missing(hw: HardwareProfile, optimizer: str, params: str) -> list[str]:
    """The profile fields an offload setting needs and ``hw`` lacks (empty: it can be priced)."""
    need: list[str] = []
    if optimizer != OffloadTier.NONE or params != OffloadTier.NONE:
        need += ["host_device_bandwidth", "host_memory_bytes"]
    if optimizer != OffloadTier.NONE:
        need.append("cpu_adam_params_per_s")
    if OffloadTier.NVME in (optimizer, params):
        need += ["nvme_bytes", "nvme_read_bandwidth", "nvme_write_bandwidth"]
    return [f for f in dict.fromkeys(need) if getattr(hw, f) is None]


def ranks_per_node(gpus: int, gpus_per_node: int) -> int:
    """Ranks of one node that share its host memory, drives and cores: ``min(gpus per node, gpus)``."""
    return max(1, min(gpus_per_node, gpus))


def adam_rate_per_rank(hw: HardwareProfile, ranks: int, dtype: str) -> float:
    """Parameters per second one rank's offloaded AdamW step updates: the node's rate shared by
    its ``ranks``; on a CPU profile no more than the rank's own step on its device, which is the
    same cores (module docstring)."""
    if hw.cpu_adam_params_per_s is None:
        raise ValueError(f"hardware {hw.name!r} has no cpu_adam_params_per_s")
    rate = hw.cpu_adam_params_per_s / ranks
    return rate if hw.ops_async else min(rate, 1.0 / float(optimizer_step_time(1, hw, dtype)))


@dataclass(frozen=True)
class LayerOffload:
    """One layer's offload costs on one device (all zero without offload)."""

    mb_s: float = 0.0
    """Exposed transfer seconds per micro-batch (parameter fetches, gradients out at ZeRO 2/3)."""
    step_s: float = 0.0
    """Exposed transfer seconds per step (gradients out at ZeRO 1, the updated parameters and NVMe
    traffic the CPU step does not hide)."""
    optimizer_s: float | None = None
    """Seconds of the CPU AdamW step of this layer's shard (``None``: the optimizer is on the device)."""
    host_b: int = 0
    """Host bytes of this layer's offloaded state on one rank (buffers apart)."""
    nvme_b: int = 0
    """NVMe bytes of this layer's offloaded state on one rank."""


def host_state_bytes(shard: int, dtype: str, optimizer: str, params: str) -> tuple[int, int]:
    """``(host, nvme)`` bytes of one rank's offloaded state for a shard of ``shard`` parameters."""
    weight_bytes = bytes_per_param(dtype)["weights"]
    host = nvme = 0
    if optimizer == OffloadTier.CPU:
        host += shard * (STATE_BYTES + GRAD_ACCUMULATOR_BYTES)
    elif optimizer == OffloadTier.NVME:
        host += shard * GRAD_ACCUMULATOR_BYTES
        nvme += shard * STATE_BYTES
    if params == OffloadTier.CPU:
        host += shard * weight_bytes
    elif params == OffloadTier.NVME:
        nvme += shard * weight_bytes
    return int(host), int(nvme)


def offload_breakdown(
    layer_params: list[int], dp: int, zero_stage: int, dtype: str, optimizer: str, params: str, buffers: int
) -> dict:
    """Bytes one rank keeps off the device, by state kind, for a stage's layers (``layer_params``
    per device): ``{"host": {"optimizer", "params", "buffers"}, "nvme": {"optimizer", "params"}}``."""
    breakdown = {"host": {"optimizer": 0, "params": 0, "buffers": int(buffers)}, "nvme": {"optimizer": 0, "params": 0}}
    for num_params in layer_params:
        shard = math.ceil(num_params / dp) if zero_stage >= 1 and num_params else int(num_params)
        for kind, (optimizer_tier, params_tier) in (
            ("optimizer", (optimizer, OffloadTier.NONE)),
            ("params", (OffloadTier.NONE, params)),
        ):
            host_bytes, nvme_bytes = host_state_bytes(shard, dtype, optimizer_tier, params_tier)
            breakdown["host"][kind] += host_bytes
            breakdown["nvme"][kind] += nvme_bytes
    return breakdown


def offload_buffer_bytes(largest_shard: int, dtype: str, optimizer: str, params: str, staged: bool = True) -> int:
    """Pinned host buffers of one rank (see "Host and NVMe bytes"), for its largest layer shard.

    ``staged``: the device is a GPU, whose gradients and parameter shards cross the link through
    pinned staging buffers; on a CPU profile (``not hw.ops_async``) the host is the device, the
    runtime copies straight into (and gathers straight from) the host tier, and only the NVMe
    tier's read/write slots exist."""
    sizes = bytes_per_param(dtype)
    out = 0
    if optimizer != OffloadTier.NONE and staged:
        out += (REDUCTIONS_IN_FLIGHT + 1) * largest_shard * sizes["grads"]
    if params == OffloadTier.NVME or (params == OffloadTier.CPU and staged):
        out += 2 * largest_shard * sizes["weights"]
    if optimizer == OffloadTier.NVME:
        out += 2 * largest_shard * STATE_BYTES
    return int(out)


@dataclass(frozen=True)
class OffloadedLayer:
    """One layer's parameters on one device and where its state lives: what :func:`layer_offload` prices."""

    num_params: int
    """Parameters of the layer on one device (after the tensor-parallel split)."""
    dtype: str
    """Training dtype."""
    zero_stage: int
    dp: int
    optimizer: str
    """Where the optimizer state lives (``OffloadTier``)."""
    params: str
    """Where the parameter shard lives (``OffloadTier``)."""

    @property
    def shard(self) -> int:
        """The rank's shard of the layer's parameters (all of them at ZeRO 0)."""
        return (
            math.ceil(self.num_params / self.dp) if self.zero_stage >= 1 and self.num_params else int(self.num_params)
        )


def layer_offload(layer: OffloadedLayer, hw: HardwareProfile, ranks: int, fwd_s: float, bwd_s: float) -> LayerOffload:
    """Offload costs of one layer per device (module docstring, "Time").

    ``ranks``: the node's ranks sharing its host (:func:`ranks_per_node`); ``fwd_s``, ``bwd_s``:
    the layer's forward and backward compute of one micro-batch, which the transfers overlap.
    """
    optimizer, params = layer.optimizer, layer.params
    if optimizer == OffloadTier.NONE and params == OffloadTier.NONE:
        return LayerOffload()
    missing = offload_missing(hw, optimizer, params)
    if missing:
        raise ValueError(
            f"hardware {hw.name!r} lacks {', '.join(missing)}: cannot price offload "
            f"(optimizer {optimizer}, params {params})"
        )
    shard = layer.shard
    sizes = bytes_per_param(layer.dtype)
    link = float(hw.host_device_bandwidth or 0.0)
    read = (hw.nvme_read_bandwidth or math.inf) / ranks
    write = (hw.nvme_write_bandwidth or math.inf) / ranks
    per_microbatch = per_step = 0.0
    optimizer_s = None
    if params != OffloadTier.NONE:
        fetch = shard * sizes["weights"] / link
        if params == OffloadTier.NVME:
            fetch = max(fetch, shard * sizes["weights"] / read)
        per_microbatch += max(0.0, fetch - fwd_s) + max(0.0, fetch - bwd_s)
    if optimizer != OffloadTier.NONE:
        grads_out = shard * sizes["grads"] / link
        if layer.zero_stage >= 2:
            per_microbatch += max(0.0, grads_out - bwd_s)
        else:
            per_step += grads_out
        optimizer_s = shard / adam_rate_per_rank(hw, ranks, layer.dtype)
        params_back = 0.0 if params != OffloadTier.NONE else shard * sizes["weights"] / link
        nvme_io = 0.0
        if optimizer == OffloadTier.NVME:
            nvme_io += shard * STATE_BYTES / read + shard * STATE_BYTES / write
        if params == OffloadTier.NVME:
            nvme_io += shard * sizes["weights"] / write
        per_step += max(optimizer_s, params_back, nvme_io) - optimizer_s
    else:  # the device's step wrote the shard: back to the host (and its file)
        per_step += shard * sizes["weights"] / link + (
            shard * sizes["weights"] / write if params == OffloadTier.NVME else 0.0
        )
    host, nvme = host_state_bytes(shard, layer.dtype, optimizer, params)
    return LayerOffload(mb_s=per_microbatch, step_s=per_step, optimizer_s=optimizer_s, host_b=host, nvme_b=nvme)
