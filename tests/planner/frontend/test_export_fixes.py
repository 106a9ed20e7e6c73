"""The export stand-ins (``planner.frontend.export_fixes``) have their originals' value and
gradient, so a compiled model trains with the model's own estimators."""

from __future__ import annotations

import pytest
import torch

from planner.frontend.export_fixes import exportable

tf = pytest.importorskip("transformers")


def test_recurrent_gemma_sqrt_keeps_its_clipped_gradient():
    """RecurrentGemma's ``SqrtBoundDerivative``: ``sqrt`` forward, derivative clipped at
    ``_MAX_SQRT_GRADIENT``; the stand-in export traces gives both, near 0 too (where plain
    ``sqrt``'s derivative is 10^4 to infinity)."""
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as module

    x = torch.tensor([0.0, 1e-12, 1e-8, 2.5e-7, 1e-3, 0.25, 0.9], dtype=torch.float64)
    original, stand_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    function = module.SqrtBoundDerivative
    want = function.apply(original)
    want.backward(torch.arange(1.0, 8.0, dtype=torch.float64))
    with exportable():
        assert module.SqrtBoundDerivative is not function  # swapped in while exporting
        got = module.SqrtBoundDerivative.apply(stand_in)
    got.backward(torch.arange(1.0, 8.0, dtype=torch.float64))
    assert module.SqrtBoundDerivative is function  # and restored
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(stand_in.grad, original.grad, rtol=1e-15, atol=0)
    # the clip is real: below 4 x = 1 / max^2 the derivative is max itself
    torch.testing.assert_close(stand_in.grad[:4], torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64) * 1000.0)
