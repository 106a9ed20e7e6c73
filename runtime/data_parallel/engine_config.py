"""The ZeRO engine's settings, grouped by concern (as Megatron-Core passes ``DistributedDataParallelConfig``
and ``OptimizerConfig``): how state is sharded and gradients are reduced (``ShardingConfig``), the
optimizer's hyper-parameters (``OptimizerConfig``, also what ``flat_shards.adamw_step_`` reads, with
its compressed exchange, ``CompressionConfig``) and
the ranks beyond the data-parallel group that share the gradient norm and the expert parameters
reduced over the expert-data-parallel group (``ParallelContext``). Where
the optimizer state and parameter shards live is ``offload_engine.OffloadConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from runtime.contract.choices import GradCompression, names
from runtime.contract.input_errors import ConfigError
from runtime.contract.limits import GRAD_BUCKET_BYTES
from runtime.data_parallel.precision import DynamicLossScaler, check_compute_dtype

__all__ = ["ShardingConfig", "OptimizerConfig", "CompressionConfig", "ParallelContext", "DEFAULT_BUCKET_BYTES"]

#: Default target size of one gradient reduction (DDP's default bucket, 25 MiB).
DEFAULT_BUCKET_BYTES = GRAD_BUCKET_BYTES


@dataclass(frozen=True)
class ShardingConfig:
    """What the engine shards and how it schedules the gradient reductions."""

    zero_stage: int = 0
    """0, 1, 2 or 3 (the table in ``runtime.data_parallel.zero_engine``)."""
    param_dtype: torch.dtype = torch.float32
    """Compute dtype of parameters, gradients and collectives (``torch.float32``, ``torch.bfloat16``,
    ``torch.float16``); floating-point module buffers and forward inputs are cast to it; masters,
    AdamW state and stage-2/3 gradient shards stay fp32."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Target size of one gradient reduction (consecutive groups are merged up to it, stages 0/1)."""
    prefetch: bool = True
    """Stage 3 only: gather the next layer asynchronously while this one computes (forward,
    backward and a split schedule's ``W``); ignored when ``overlap`` is off."""
    overlap: bool = True
    """Overlap the data-parallel collectives with compute (``runtime.contract.overlap``'s ``dp``):
    bucket reductions launched from the gradient hooks while backward runs, ZeRO 1/2 parameter
    all-gathers left in flight after ``step()`` and waited at each group's first use in the next
    forward, ZeRO-3 prefetch. False: each pass's reductions launched at its end and waited there,
    the all-gathers waited in ``step()``, no prefetch. The numbers are the same either way."""
    micro_batches_per_step: int | None = None
    """Backward passes per step (with ``roots``, the passes of all roots together: ``v * m`` for ``v``
    model chunks and ``m`` micro-batches); when set, stages 0/1 reduce gradients from the hooks of
    the last one (overlapped with backward) instead of in ``step()``."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {self.bucket_bytes}")
        if self.micro_batches_per_step is not None and self.micro_batches_per_step < 1:
            raise ValueError(f"micro_batches_per_step must be >= 1, got {self.micro_batches_per_step}")
        check_compute_dtype(self.param_dtype)
        object.__setattr__(self, "bucket_bytes", int(self.bucket_bytes))
        object.__setattr__(self, "prefetch", bool(self.prefetch))
        object.__setattr__(self, "overlap", bool(self.overlap))


@dataclass(frozen=True)
class CompressionConfig:
    """The data-parallel exchange's encoding (plan.json ``dp_compression``, ``compression_warmup``)."""

    method: str = GradCompression.NONE
    """``none`` or ``onebit-adam`` (``runtime.contract.choices.GradCompression``)."""
    warmup_steps: int = 0
    """Optimizer steps of full-precision AdamW before the variance is frozen and the exchange is
    compressed (at least 1 with compression: a frozen variance must have seen gradients)."""

    def __post_init__(self) -> None:
        if self.method not in names(GradCompression):
            raise ConfigError(f"dp_compression must be one of {', '.join(names(GradCompression))}, got {self.method!r}")
        warmup = self.warmup_steps
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ConfigError(
                f"compression_warmup (--compression-warmup) must be a non-negative integer, got {warmup!r}"
            )
        if self.enabled and warmup < 1:
            raise ConfigError(
                "compression_warmup (--compression-warmup) must be at least 1 with 1-bit Adam: the variance it "
                "freezes must first be estimated by full-precision steps"
            )

    @property
    def enabled(self) -> bool:
        return self.method != GradCompression.NONE


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (decoupled weight decay), gradient clipping and fp16 loss scaling."""

    lr: float = 1e-3
    """Learning rate (``ZeroEngine.step(lr=...)`` overrides it per step)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """``(beta1, beta2)``: decay rates of the first and second moments."""
    eps: float = 1e-8
    """Added to the denominator's square root."""
    weight_decay: float = 0.0
    """Decoupled weight decay coefficient."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm to this (``None``: no clipping)."""
    weight_decay_filter: Callable[[str], bool] | None = None
    """``name -> bool``; False exempts a parameter from weight decay (``None``: every parameter decays)."""
    loss_scaler: DynamicLossScaler | None = None
    """Loss scaler for fp16 (``None``: a ``DynamicLossScaler()`` for fp16); must be ``None`` for
    other compute dtypes."""
    compression: CompressionConfig = CompressionConfig()
    """The data-parallel exchange after a warm-up: none, or 1-bit Adam
    (``runtime.data_parallel.onebit_adam``)."""

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        object.__setattr__(self, "lr", float(self.lr))
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        object.__setattr__(self, "eps", float(self.eps))
        object.__setattr__(self, "weight_decay", float(self.weight_decay))

    @property
    def beta1(self) -> float:
        return self.betas[0]

    @property
    def beta2(self) -> float:
        return self.betas[1]


@dataclass(frozen=True)
class ParallelContext:
    """The engine's stage among the ranks beyond its data-parallel group (tensor and pipeline
    parallel), which share one gradient norm, one overflow decision and tied weights."""

    norm_groups: Sequence[Any] = ()
    """Process groups whose ranks hold other parts of the model; squared norms and the overflow
    flag are summed over them (``None`` entries and groups of one rank are skipped)."""
    replicated_param_filter: Callable[[str], bool] | None = None
    """``name -> bool``; True for parameters duplicated on every rank of ``replicated_group`` (e.g.
    LayerNorm weights under tensor parallelism): they count once in the gradient norm, on rank 0
    of that group only."""
    replicated_group: Any = None
    """The group those parameters are duplicated across (default: the tensor-parallel group of
    ``runtime.distributed.mesh.get_mesh()``)."""
    tied: Mapping[str, tuple[Any, bool]] = field(default_factory=dict)
    """``name -> (group, counted)`` for parameters tied across pipeline stages
    (``runtime.data_parallel.tied_weights``): each forms a group of its own in ``layers``; after the
    dp reduction its gradient is summed over ``group``, and it counts in the norm only where ``counted``."""
    tied_keys: Mapping[str, str] = field(default_factory=dict)
    """``name -> weight`` for tied parameters of which this rank holds several copies (one per
    model chunk reading the weight): the copies of one weight are summed here before ``group``'s
    sum, and all get the result (unlisted names are their own weight)."""
    rank: int | None = None
    """This process's global rank, naming its NVMe folder (default: ``dist.get_rank()``)."""
    expert_params: frozenset[str] = frozenset()
    """Engine names of the routed expert parameters this rank holds a slice of under expert
    parallelism (``runtime.moe``): sharded and reduced over ``expert_data_group`` instead of dp."""
    expert_data_group: Any = None
    """The ranks holding the same experts (default: ``get_mesh().edp_group``, the dp group when
    ``ep == 1``); only read when ``expert_params`` is not empty."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "expert_params", frozenset(self.expert_params))
