"""``passes.inputs``: the role and vocabulary of each model input, read from the graph."""

from __future__ import annotations

import pytest
import torch

from passes.inputs import infer_inputs
from runtime.training.data import model_inputs
from tests.fixtures import user_models


def _facts(factory, lifted=True):
    model, inputs = factory()
    ep = torch.export.export(model, inputs, strict=False)
    if lifted:
        return {f.name: f for f in infer_inputs(ep.graph_module, ep.graph_signature.user_inputs)}
    return {f.name: f for f in infer_inputs(ep.module())}


@pytest.mark.parametrize("lifted", [True, False])
def test_tokens_and_in_place_targets(lifted):
    f = _facts(user_models.good, lifted)
    assert (f["ids"].role, f["ids"].vocab) == ("tokens", 32)
    assert (f["labels"].role, f["labels"].vocab) == ("targets", 32)


def test_shifted_labels_mask_and_positions():
    f = _facts(user_models.masked)
    assert (f["input_ids"].role, f["input_ids"].vocab) == ("tokens", 40)
    # the model slices labels[:, 1:] before the loss: it shifts them itself, so it gets the tokens
    assert (f["labels"].role, f["labels"].vocab) == ("labels", 30)
    assert f["attention_mask"].role == "ones"
    assert f["position_ids"].role == "positions"


def test_unexplained_float_input_has_no_role():
    f = _facts(user_models.mystery_input)
    assert f["temperature"].role is None
    assert f["temperature"].dtype == "float32" and f["temperature"].shape == [2, 8, 1]


def test_model_inputs_fill_each_role():
    tokens = torch.tensor([[3, 4, 5], [6, 7, 8]])
    targets = tokens + 1
    specs = [
        {"name": n, "role": r, "dtype": d, "shape": s}
        for n, r, d, s in [
            ("a", "tokens", "int64", ["b", "s"]),
            ("b", "labels", "int32", ["b", "s"]),
            ("c", "targets", "int64", ["b", "s"]),
            ("d", "ones", "float32", ["b", 1, "s"]),
            ("e", "zeros", "int64", [4, 7]),
            ("f", "positions", "int64", ["b", "s"]),
        ]
    ]
    a, b, c, d, e, f = model_inputs(specs, tokens, targets)
    assert torch.equal(a, tokens) and torch.equal(b, tokens.int()) and b.dtype == torch.int32
    assert torch.equal(c, targets)
    assert d.shape == (2, 1, 3) and d.dtype == torch.float32 and bool((d == 1).all())
    assert e.shape == (2, 7) and not e.any()  # a static trace: the first size follows the rows
    assert torch.equal(f, torch.tensor([[0, 1, 2], [0, 1, 2]]))
