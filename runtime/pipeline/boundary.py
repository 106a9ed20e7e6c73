"""What crosses a stage boundary: the tensors' metadata (:class:`TensorMeta`), the check of a
stage's outputs against its successor's ``recv_meta``, and the error a user must fix
(:class:`PipelineError`).

Integer tensors (masks, positions) travel forward only; float tensors marked ``requires_grad``
get their gradient sent back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BOUNDARY_DTYPES", "TensorMeta", "PipelineError", "as_meta", "as_tuple", "describe", "check_outputs"]

#: The element types a pipeline boundary can carry (their index is their pre-flight code).
BOUNDARY_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


class PipelineError(ValueError):
    """A pipeline run was refused or failed in a way the user must fix (message says how)."""


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor that crosses a stage boundary."""

    shape: tuple[int, ...]
    """Full shape of the tensor for one micro-batch."""
    dtype: torch.dtype
    """Element type; integer and bool tensors never carry gradients."""
    requires_grad: bool | None = None
    """Whether the receiver sends a gradient back; defaults to ``dtype.is_floating_point``."""
    split: bool = False
    """Every rank of the tensor-parallel group holds the same tensor (and its gradient): each sends
    a ``1 / tp`` slice and the receivers all-gather it over their group
    (``runtime.pipeline.transport``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(size) for size in self.shape))
        if self.dtype not in BOUNDARY_DTYPES:
            raise ValueError(f"dtype {self.dtype} cannot cross a pipeline boundary; use one of {BOUNDARY_DTYPES}")
        if self.requires_grad is None:
            object.__setattr__(self, "requires_grad", self.dtype.is_floating_point)
        if self.requires_grad and not self.dtype.is_floating_point:
            raise ValueError(f"a {self.dtype} tensor cannot require grad; set requires_grad=False")

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls(tuple(tensor.shape), tensor.dtype, bool(tensor.requires_grad and tensor.dtype.is_floating_point))

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}" + (
            " (grad)" if self.requires_grad else ""
        )


def as_meta(described: Any) -> TensorMeta:
    """A :class:`TensorMeta` from itself, an example tensor, or its ``(shape, dtype[, requires_grad])``."""
    if isinstance(described, TensorMeta):
        return described
    if isinstance(described, torch.Tensor):
        return TensorMeta.of(described)
    return TensorMeta(*described)


def as_tuple(x: Any) -> tuple:
    """A tuple or list as a tuple; anything else as a 1-tuple."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def describe(x: Any) -> str:
    """A tensor's shape and dtype, or another value's type name (for error messages)."""
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}"
    return type(x).__name__


def check_outputs(
    outputs: tuple, expected: tuple[TensorMeta, ...], micro_batch: int, sender: str, receiver: str
) -> None:
    """Raise :class:`PipelineError` unless ``outputs`` (of ``sender`` for ``micro_batch``) match the
    ``recv_meta`` of ``receiver``, ``expected``: count, shapes, dtypes and ``requires_grad``."""
    if len(outputs) != len(expected):
        raise PipelineError(
            f"{sender} returned {len(outputs)} tensors for micro-batch {micro_batch} but {receiver} expects "
            f"{len(expected)} ({', '.join(map(str, expected))}); fix its recv_meta or the split"
        )
    for k, (output, meta) in enumerate(zip(outputs, expected)):
        if not isinstance(output, torch.Tensor):
            raise PipelineError(f"{sender} output {k} is a {type(output).__name__}, not a tensor")
        if tuple(output.shape) != meta.shape or output.dtype != meta.dtype:
            raise PipelineError(
                f"{sender} output {k} for micro-batch {micro_batch} is {describe(output)} but {receiver}'s "
                f"recv_meta expects {meta}; fix the recv_meta or the stage split"
            )
        has_grad = bool(output.requires_grad)
        if meta.requires_grad and not has_grad:
            raise PipelineError(
                f"{sender} output {k} does not require grad but {receiver} will send a gradient for it "
                f"(recv_meta requires_grad=True); set requires_grad=False there"
            )
        if has_grad and not meta.requires_grad:
            raise PipelineError(
                f"{sender} output {k} requires grad but {receiver}'s recv_meta has requires_grad=False, so its "
                f"gradient would be lost; mark it requires_grad=True"
            )
