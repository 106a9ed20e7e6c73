"""Errors of code generation: a plan that cannot be lowered into stage files as asked."""

from __future__ import annotations

__all__ = ["CodegenError", "LoweringError", "UnsafeNameError", "TPRewriteError"]


class CodegenError(ValueError):
    """The plan cannot be compiled as asked; the message says why and what to do."""


class LoweringError(CodegenError):
    """The graph cannot be cut into the plan's layers and stages."""


class UnsafeNameError(CodegenError):
    """A name that would not be a plain identifier in generated code."""


class TPRewriteError(CodegenError):
    """The graph cannot be made tensor parallel as the plan asks (the message names the node)."""
