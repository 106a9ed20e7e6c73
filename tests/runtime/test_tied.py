"""The bookkeeping of weights tied across pipeline stages (``runtime.data_parallel.tied_weights``), without processes."""

import pytest
import torch
from torch import nn

from runtime.data_parallel.flat_shards import ZeroError
from runtime.data_parallel.tied_weights import isolate_tied, tied_params, tied_stage_sets
from runtime.data_parallel.zero_engine import OptimizerConfig, ParallelContext, ZeroEngine

MAN = {
    "stages": [
        {"index": 0, "params": {"w": {"fqn": "lm_head.weight", "tied": [0, 2]}, "a": {"fqn": "a"}}},
        {"index": 1, "params": {"b": {"fqn": "b"}}},
        {"index": 2, "params": {"w": {"fqn": "lm_head.weight", "tied": [0, 2]}, "c": {"fqn": "c"}}},
    ]
}


def test_holders_and_groups():
    assert tied_params(MAN["stages"][0]) == {"w": (0, 2)} and tied_params(MAN["stages"][1]) == {}
    assert tied_params({"params": {"m": {"fqn": "mask", "tied": [0, 1], "trainable": False}}}) == {}
    assert tied_stage_sets(MAN) == [(0, 2)]
    assert isolate_tied([["a", "w"], ["c"]], {"w": (0, 2)}) == [["w"], ["a"], ["c"]]


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 3))
        self.lin = nn.Linear(3, 3)


def test_a_copy_counted_elsewhere_leaves_the_norm():
    m = Two()
    eng = ZeroEngine(
        m,
        layers=isolate_tied([["w", "lin.weight", "lin.bias"]], {"w": ()}),
        optimizer=OptimizerConfig(max_grad_norm=1.0),
        parallel=ParallelContext(tied={"w": (None, False)}),
    )
    (m.w.sum() * 3 + m.lin.weight.sum()).backward()
    info = eng.step(lr=0.0)
    assert info.grad_norm == pytest.approx(3.0)  # only lin.weight's 9 ones: the copy is not counted
    with pytest.raises(ZeroError, match="group of its own"):
        ZeroEngine(Two(), layers=[["w", "lin.weight", "lin.bias"]], parallel=ParallelContext(tied={"w": (None, True)}))
