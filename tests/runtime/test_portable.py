"""runtime.portable: the operators codegen writes in place of ones a device cannot run as traced."""

from __future__ import annotations

import torch

from runtime.portable import grouped_mm, histc


def test_histc_counts_integer_input_on_cpu():
    ids = torch.tensor([0, 2, 2, 3, 3, 3], dtype=torch.int32)
    torch.testing.assert_close(histc(ids, bins=4, min=0, max=3), torch.tensor([1.0, 0.0, 2.0, 3.0]))


def test_grouped_mm_is_each_groups_product_with_its_gradients():
    torch.manual_seed(0)
    x = torch.randn(7, 4, requires_grad=True)
    w = torch.randn(3, 4, 5, requires_grad=True)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)  # group 1 empty, row 6 past the last group
    out = grouped_mm(x, w, offs)
    ref = torch.cat([x[:2] @ w[0], x[2:6] @ w[2], torch.zeros(1, 5)])
    torch.testing.assert_close(out, ref)
    g = torch.randn(7, 5)
    dx, dw = torch.autograd.grad(out, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g, allow_unused=True)
    torch.testing.assert_close(dx, rx)
    torch.testing.assert_close(dw, rw)
    assert dw[1].abs().sum() == 0 and dx[6].abs().sum() == 0
