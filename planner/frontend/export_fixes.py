"""Exportable stand-ins for model code whose training semantics ``torch.export`` would lose.

``torch.export`` traces a custom ``torch.autograd.Function`` through its ``forward`` and drops its
``backward``: the exported graph (and so every compiled stage) differentiates the forward's ops
instead. Where that backward is the forward's derivative (Bloom's GeLU) nothing changes; where
it is a deliberate estimator, the compiled model would silently train with other gradients than
the model's own code. ``exportable()`` is the context the front end exports under: each
known such Function is swapped, in its module, for plain torch ops whose value *and* gradient
are the original's, so the exported graph keeps both and compiled code needs nothing but ATen.

- PhiMoE's ``PhimoeMultiplier`` (SparseMixer, transformers' ``modeling_phimoe``): the forward is
  ``multiplier * mask_for_one`` (``mask_for_one`` is 1 or 1/3, Heun's midpoint) and the backward
  hands ``scores`` the gradient of ``multiplier`` alone (``multiplier`` is the softmax of the
  masked scores at the selected expert, so that is ``p_sel (delta - p)`` times the incoming
  gradient). ``(multiplier * mask_for_one).detach() + (multiplier - multiplier.detach())`` has the
  forward's exact value and, through the softmax that computed ``multiplier`` from ``scores``,
  exactly that gradient.

- RecurrentGemma's ``SqrtBoundDerivative`` (its RG-LRU's ``sqrt(1 - a^2)``): the forward is
  ``sqrt(x)``, the backward clips the derivative at ``_MAX_SQRT_GRADIENT`` (``1 / sqrt(max(4 x,
  1 / max^2))``, where plain ``sqrt`` would reach infinity at 0). ``sqrt(x).detach() + (x / c -
  (x / c).detach())`` with ``c`` that clipped ``sqrt(4 x)``, detached, has the value ``sqrt(x)``
  exactly and the gradient ``1 / c``.

A stand-in is installed only while exporting, and only in a module the model has imported.
"""

from __future__ import annotations

import contextlib
import sys

import torch

__all__ = ["exportable"]


class _PhimoeMultiplier:
    """``PhimoeMultiplier`` as differentiable torch ops (see the module docstring)."""

    @staticmethod
    def apply(
        scores: torch.Tensor,
        multiplier: torch.Tensor,
        selected_experts: torch.Tensor,
        masked_gates: torch.Tensor,
        mask_for_one: torch.Tensor,
    ) -> torch.Tensor:
        del scores, selected_experts, masked_gates  # the gradient reaches scores through multiplier
        return (multiplier * mask_for_one).detach() + (multiplier - multiplier.detach())


_RECURRENT_GEMMA = "transformers.models.recurrent_gemma.modeling_recurrent_gemma"


class _SqrtBoundDerivative:
    """``SqrtBoundDerivative`` as differentiable torch ops (see the module docstring)."""

    @staticmethod
    def apply(x: torch.Tensor) -> torch.Tensor:
        largest = float(getattr(sys.modules.get(_RECURRENT_GEMMA), "_MAX_SQRT_GRADIENT", 1000.0))
        clipped = torch.sqrt(torch.clamp(4.0 * x, min=1.0 / largest**2)).detach()
        scaled = x / clipped
        return torch.sqrt(x).detach() + (scaled - scaled.detach())


#: module -> {attribute: its exportable stand-in}
_STAND_INS = {
    "transformers.models.phimoe.modeling_phimoe": {"PhimoeMultiplier": _PhimoeMultiplier},
    _RECURRENT_GEMMA: {"SqrtBoundDerivative": _SqrtBoundDerivative},
}


@contextlib.contextmanager
def exportable():
    """Install every stand-in whose module is imported; restore the originals on exit."""
    saved = []
    try:
        for module_name, attrs in _STAND_INS.items():
            module = sys.modules.get(module_name)
            if module is None:
                continue
            for attr, stand_in in attrs.items():
                if hasattr(module, attr):
                    saved.append((module, attr, getattr(module, attr)))
                    setattr(module, attr, stand_in)
        yield
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)
