"""``passes.grad_regions``: a ``torch.no_grad()`` region, which ``torch.export`` keeps as a nested
graph, becomes flat ATen ops whose returned values carry no gradient, as in the eager model; a
region of another kind stays, and codegen refuses it by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from codegen.codegen_errors import LoweringError
from codegen.lower import partition_graph
from passes.grad_regions import inline_grad_regions


class _NoGradScale(nn.Module):
    """A scale computed from an activation under ``no_grad`` (no gradient may flow through it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.lin(x)
        with torch.no_grad():
            scale = h.abs().amax(-1, keepdim=True) + 1.0
            keep = h > 0
        return F.mse_loss(torch.where(keep, h, 0.5 * h) / scale, y)


class _Autocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        with torch.autocast("cpu", enabled=False):
            h = self.lin(x) * 2
        return F.mse_loss(h, y)


def _nested(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]


def test_a_no_grad_region_is_inlined_with_its_outputs_detached():
    torch.manual_seed(0)
    model = _NoGradScale()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm = torch.export.export(copy.deepcopy(model), (x, y), strict=False).module()  # its own parameters
    assert len(_nested(gm)) == 1
    assert inline_grad_regions(gm) == 1
    assert not _nested(gm) and not any(isinstance(m, torch.fx.GraphModule) for m in gm.children())
    assert inline_grad_regions(gm) == 0
    ref = model(x, y)
    ref.backward()
    loss = gm(x, y)
    loss.backward()
    torch.testing.assert_close(loss, ref)
    for (name, p), q in zip(model.named_parameters(), gm.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{name}: {m}")


def test_another_nested_region_stays_and_codegen_refuses_it_by_name():
    gm = torch.export.export(_Autocast(), (torch.randn(2, 8), torch.randn(2, 8)), strict=False).module()
    assert inline_grad_regions(gm) == 0 and len(_nested(gm)) == 1
    with pytest.raises(LoweringError, match="wrap_with_autocast.*nested graph"):
        partition_graph(gm, lambda n: 0, ["all"], [[0, 0]])
