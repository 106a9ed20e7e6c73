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


#: module -> {attribute: its exportable stand-in}
_STAND_INS = {
    "transformers.models.phimoe.modeling_phimoe": {"PhimoeMultiplier": _PhimoeMultiplier},
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
