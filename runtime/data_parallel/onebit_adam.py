"""1-bit Adam (Tang et al. 2021): the ZeRO engine's data-parallel exchange after a warm-up, one
sign per element and one scale per block of 256 instead of a 16-bit gradient all-reduce.

The method
----------
For ``warmup_steps`` steps the engine runs plain AdamW (gradients all-reduced during backward).
Then the variance ``v`` is frozen, and each step, on every data-parallel rank ``w``:

    m_w = beta1 m + (1 - beta1) c g_w          # g_w: this rank's own gradient, never reduced
    m   = compressed_average(m_w)              # the same on every rank afterwards
    w  <- w (1 - lr wd) - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^T)) + eps)

with ``c`` the clipping coefficient and ``T = warmup_steps`` (the variance's bias correction
frozen with it). ``compressed_average`` is ``runtime.contract.compressed_exchange``'s exchange:
worker compression with error feedback, an all-to-all of packed signs, the server's average of
its chunk compressed again with its own error feedback, an all-gather of the result. The error
buffers carry what each compression lost into the next step, which is what keeps the method
close to Adam (the paper's convergence argument).

Stages: the exchange replaces the all-reduce of ZeRO 0 and 1. Each worker adds its own gradient
to the *whole* momentum and, to avoid a 16-bit parameter all-gather that would cost more than the
compression saves, updates the whole model from the whole frozen variance: so at stage 1 the
engine gathers its sharded masters and moments once, at the switch, and from then on holds stage
0's optimizer memory (the shard views stay, so checkpoints are written as at stage 1). Stages 2
and 3 reduce-scatter gradients before any rank has a whole momentum: they have no such exchange
(``ZeroEngine`` refuses them, and an offloaded optimizer, with compression).

Clipping: the averaged gradient is never formed, so the norm that clips is the root mean square
of the ranks' local gradient norms, ``sqrt(mean_w |g_w|^2)`` (one scalar all-reduce), an upper
bound of the averaged gradient's norm. inf/nan on any rank skips the step as before.

Segments: the momentum is exchanged in segments whose ranks must agree bit for bit: a weight tied
across pipeline stages is its own segment (both stages then compress the same numbers the same
way), as are parameters replicated across tensor-parallel ranks (e.g. norms): a block's scale
never mixes values that other ranks hold differently.

Checkpoints: the error buffers are per rank (``state_dict``); a resume under the same plan
restores them and continues bit for bit; under another plan they restart at zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from runtime.contract.compressed_exchange import BLOCK, SIGNS_PER_BYTE, exchange_numel
from runtime.data_parallel.engine_config import CompressionConfig, OptimizerConfig
from runtime.data_parallel.flat_shards import FlatGroup
from runtime.distributed import comm

__all__ = [
    "CompressionConfig",
    "CompressedAverage",
    "OneBitAdam",
    "pack_signs",
    "unpack_signs",
    "compress_",
    "decode",
]


_SHIFTS = torch.arange(SIGNS_PER_BYTE - 1, -1, -1, dtype=torch.uint8)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per element (1: ``>= 0``), 8 to a byte, most significant first; ``values.numel()``
    must be a multiple of 8."""
    bits = (values >= 0).view(-1, SIGNS_PER_BYTE).to(torch.uint8)
    return (bits << _SHIFTS.to(values.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """``pack_signs``'s inverse as fp32 ``+1``/``-1``."""
    bits = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1
    return bits.view(-1).float().mul_(2).sub_(1)


def decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packed signs of ``k = scales.numel()`` equal chunks, each times its scale, as one fp32 vector."""
    signs = unpack_signs(packed).view(scales.numel(), -1)
    return signs.mul_(scales.view(-1, 1)).view(-1)


def compress_(vector: torch.Tensor, error: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Error-compensated sign compression in blocks of ``block`` elements: ``error += vector``;
    return the packed signs of that and one scale per block, ``|block| / sqrt(block)`` (fp32);
    ``error`` keeps what the compression lost (``error - scale sign(error)``)."""
    error.add_(vector)
    scales = torch.linalg.vector_norm(error.view(-1, block), dim=1).div_(math.sqrt(block))
    packed = pack_signs(error)
    error.sub_(decode(packed, scales))
    return packed, scales


class CompressedAverage:
    """The compressed average of one fp32 vector of ``numel`` elements over ``dp_group``
    (``runtime.contract.compressed_exchange``), with this rank's worker and server errors."""

    def __init__(self, numel: int, dp_group: Any, device: torch.device):
        self.numel, self.dp_group = numel, dp_group
        self.dp = comm.group_size(dp_group)
        self.padded = exchange_numel(numel, self.dp)
        self.chunk = self.padded // self.dp
        self.worker_error = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(self.chunk, dtype=torch.float32, device=device)

    def average_(self, vector: torch.Tensor) -> None:
        """Replace ``vector`` (``padded`` elements) by the decoded compressed average of every
        rank's ``vector``; collective over the group."""
        packed, scales = compress_(vector, self.worker_error, BLOCK)
        received = torch.empty_like(packed)
        comm.all_to_all_into(received, packed, self.dp_group)
        received_scales = torch.empty_like(scales)
        comm.all_to_all_into(received_scales, scales, self.dp_group)
        chunk_sum = decode(received, received_scales).view(self.dp, self.chunk).sum(dim=0)
        server_packed, server_scales = compress_(chunk_sum.div_(self.dp), self.server_error, BLOCK)
        comm.all_gather_into(packed, server_packed, self.dp_group)
        comm.all_gather_into(scales, server_scales, self.dp_group)
        vector.copy_(decode(packed, scales))


@dataclass
class _Segment:
    """Element ranges of the groups' full vectors exchanged together, and their exchange."""

    ranges: list[tuple[int, int, int]]
    """``(group index, start, end)`` in the group's padded full vector."""
    exchange: CompressedAverage


@dataclass
class _FullState:
    """The whole fp32 master, momentum and frozen variance of one group (stage 0's buffers, or
    what stage 1 gathered at the switch)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class OneBitAdam:
    """The compressed phase of one ``ZeroEngine`` (see the module docstring).

    ``segment_of(group, name)`` names the segment of a parameter; ``full_ranges`` gives each
    group's ``(norm_ranges, decay_ranges)`` over its whole padded vector, as stage 0 counts them
    on a dp rank that owns the norm (every rank counts its own gradient here)."""

    def __init__(
        self,
        config: CompressionConfig,
        groups: Sequence[FlatGroup],
        dp_group: Any,
        segment_of: Callable[[FlatGroup, str], Hashable],
        full_ranges: Sequence[tuple[Any, Any]],
    ):
        self.config, self.groups, self.dp_group = config, list(groups), dp_group
        self.dp = comm.group_size(dp_group)
        self.full_ranges = list(full_ranges)
        self._segment_of = segment_of
        self._segments: list[_Segment] | None = None
        self._full: list[_FullState] | None = None

    def compressing(self, step_count: int) -> bool:
        """Whether the step after ``step_count`` finished steps exchanges compressed momentum."""
        return self.config.enabled and step_count >= self.config.warmup_steps

    # ------------------------------------------------------------------ layout
    def segments(self, device: torch.device) -> list[_Segment]:
        """The segments in a fixed order (first appearance), built on first use."""
        if self._segments is None:
            by_key: dict[Hashable, list[tuple[int, int, int]]] = {}
            for group in self.groups:
                for entry in group.entries:
                    ranges = by_key.setdefault(self._segment_of(group, entry.name), [])
                    if ranges and ranges[-1][0] == group.index and ranges[-1][2] == entry.offset:
                        ranges[-1] = (group.index, ranges[-1][1], entry.offset + entry.numel)
                    else:
                        ranges.append((group.index, entry.offset, entry.offset + entry.numel))
            self._segments = [
                _Segment(ranges, CompressedAverage(sum(end - start for _, start, end in ranges), self.dp_group, device))
                for ranges in by_key.values()
            ]
        return self._segments

    def full_state(self, stage: int, dp_rank: int, compute: Callable[[FlatGroup], torch.Tensor]) -> list[_FullState]:
        """Each group's whole master and moments; at stage 1 gathered once (``compute(group)``: the
        group's compute-dtype full parameters, which are the master when fp32)."""
        if self._full is None:
            self._full = [self._whole(group, stage, dp_rank, compute(group)) for group in self.groups]
        return self._full

    def _whole(self, group: FlatGroup, stage: int, dp_rank: int, params: torch.Tensor) -> _FullState:
        assert group.master is not None and group.exp_avg is not None and group.exp_avg_sq is not None
        if stage == 0:
            return _FullState(group.master, group.exp_avg, group.exp_avg_sq)
        own = slice(dp_rank * group.shard, (dp_rank + 1) * group.shard)
        if params.dtype == torch.float32 and group.master.data_ptr() == params[own].data_ptr():
            master = params  # the master shard is a view of the fp32 parameters, already whole
        else:
            master = self._gathered(group.master, group.padded)
        whole = _FullState(
            master, self._gathered(group.exp_avg, group.padded), self._gathered(group.exp_avg_sq, group.padded)
        )
        # the shard views stay the engine's (checkpoints read them), now backed by the whole buffers
        group.master, group.exp_avg, group.exp_avg_sq = whole.master[own], whole.exp_avg[own], whole.exp_avg_sq[own]
        return whole

    def _gathered(self, shard: torch.Tensor, padded: int) -> torch.Tensor:
        whole = torch.empty(padded, dtype=torch.float32, device=shard.device)
        comm.all_gather_into(whole, shard, self.dp_group)
        return whole

    def forget_full_state(self) -> None:
        """The engine loaded a state into the shard views: gather again before the next update."""
        self._full = None

    # ------------------------------------------------------------------ the step
    def square_sums(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """fp64 ``[sum of g^2 over the counted elements, sum over all]`` of this rank's own gradients."""
        sums = torch.zeros(2, dtype=torch.float64, device=grads[0].device if grads else None)
        for grad, (norm_ranges, _) in zip(grads, self.full_ranges):
            full_sq = torch.dot(grad, grad).double()
            sums[1] += full_sq
            if norm_ranges is None:
                sums[0] += full_sq
            else:
                for start, end in norm_ranges:
                    sums[0] += torch.dot(grad[start:end], grad[start:end]).double()
        return sums

    @torch.no_grad()
    def update(
        self,
        full: Sequence[_FullState],
        grads: Sequence[torch.Tensor],
        step: int,
        config: OptimizerConfig,
        coefficient: float,
    ) -> None:
        """One 1-bit Adam step of every group (collective over dp): momentum from the local
        gradient, compressed average, update with the frozen variance."""
        beta1, beta2 = config.betas
        for state, grad in zip(full, grads):
            state.exp_avg.mul_(beta1).add_(grad, alpha=(1.0 - beta1) * coefficient)
        self._exchange(full)
        step_size = config.lr / (1.0 - beta1**step)
        variance_correction = math.sqrt(1.0 - beta2**self.config.warmup_steps)
        for state, (_, decay_ranges) in zip(full, self.full_ranges):
            if config.weight_decay != 0.0:
                factor = 1.0 - config.lr * config.weight_decay
                for start, end in [(0, state.master.numel())] if decay_ranges is None else decay_ranges:
                    state.master[start:end].mul_(factor)
            denominator = state.exp_avg_sq.sqrt().div_(variance_correction).add_(config.eps)
            state.master.addcdiv_(state.exp_avg, denominator, value=-step_size)

    def _exchange(self, full: Sequence[_FullState]) -> None:
        """Replace every momentum by its compressed average, one segment at a time."""
        device = full[0].exp_avg.device
        for segment in self.segments(device):
            vector = torch.zeros(segment.exchange.padded, dtype=torch.float32, device=device)
            position = 0
            for index, start, end in segment.ranges:
                vector[position : position + end - start].copy_(full[index].exp_avg[start:end])
                position += end - start
            segment.exchange.average_(vector)
            position = 0
            for index, start, end in segment.ranges:
                full[index].exp_avg[start:end].copy_(vector[position : position + end - start])
                position += end - start

    def error_buffers(self) -> list[torch.Tensor]:
        """The worker and server errors (the memory 1-bit Adam adds to stage 0's)."""
        return [t for seg in self._segments or [] for t in (seg.exchange.worker_error, seg.exchange.server_error)]

    def whole_state(self) -> list[torch.Tensor]:
        """The whole masters and moments (stage 1 holds them once gathered; at stage 0 they are the
        engine's own)."""
        return [t for state in self._full or [] for t in (state.master, state.exp_avg, state.exp_avg_sq)]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's error buffers (``worker/<k>``, ``server/<k>`` per segment ``k``); empty
        before the first compressed step."""
        out: dict[str, torch.Tensor] = {}
        for k, segment in enumerate(self._segments or []):
            out[f"worker/{k}"] = segment.exchange.worker_error.clone()
            out[f"server/{k}"] = segment.exchange.server_error.clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        """Restore ``state_dict``'s error buffers (shapes must match this engine's segments)."""
        if not state:
            return
        for k, segment in enumerate(self.segments(device)):
            for kind, buffer in (("worker", segment.exchange.worker_error), ("server", segment.exchange.server_error)):
                saved = state.get(f"{kind}/{k}")
                if saved is None or saved.shape != buffer.shape:
                    raise ValueError(
                        f"1-bit Adam error buffer {kind}/{k} of shape {None if saved is None else tuple(saved.shape)} "
                        f"does not fit this plan's {tuple(buffer.shape)}"
                    )
                buffer.copy_(saved)
