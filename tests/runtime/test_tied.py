"""The bookkeeping of weights tied across pipeline stages (``runtime.data_parallel.tied_weights``), without processes."""

import pytest
import torch
from torch import nn

from runtime.data_parallel.flat_shards import ZeroError
from runtime.data_parallel.tied_weights import (
    holder_ranks,
    isolate_tied,
    tied_flat_groups,
    tied_params,
    tied_stage_sets,
)
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


def test_a_rank_running_two_readers_holds_two_copies_summed_under_one_key():
    """Chunks 0 and 2 run on rank 0, 1 and 3 on rank 1 (pp2 x v2): a weight read by all four has
    one tied group of the two ranks, and each rank's two copies share a key (summed there first)."""
    man = {"stages": [{"index": k, "pp_rank": k % 2, "params": {}} for k in range(4)]}
    assert holder_ranks(man, (0, 1, 2, 3)) == (0, 1) and holder_ranks(man, (0, 2)) == (0,)
    m = torch.nn.ModuleList([Two(), Two()])
    eng_layers = isolate_tied(
        [["0.w", "0.lin.weight", "0.lin.bias", "1.w", "1.lin.weight", "1.lin.bias"]], {"0.w": (), "1.w": ()}
    )
    eng = ZeroEngine(m, layers=eng_layers, parallel=ParallelContext())
    tied = {"0.w": (None, True), "1.w": (None, False)}
    got = tied_flat_groups(eng.groups, tied, {"0.w": "w", "1.w": "w"})
    assert [(key, process_group) for _, process_group, key in got] == [("w", None), ("w", None)]
    # one copy alone on its rank with no other holder: nothing to sum, left out
    assert tied_flat_groups(eng.groups, {"0.w": (None, True)}) == []


def test_two_copies_on_one_rank_get_the_sum_of_their_gradients():
    m = torch.nn.ModuleList([Two(), Two()])
    eng = ZeroEngine(
        m,
        layers=isolate_tied([["0.lin.weight", "0.lin.bias", "1.lin.weight", "1.lin.bias"]], {"0.w": (), "1.w": ()}),
        optimizer=OptimizerConfig(lr=0.0),
        parallel=ParallelContext(tied={"0.w": (None, True), "1.w": (None, False)}, tied_keys={"0.w": "w", "1.w": "w"}),
    )
    (m[0].w.sum() * 2 + m[1].w.sum() * 5).backward()
    info = eng.step(lr=0.0)
    for copy in (m[0].w, m[1].w):
        torch.testing.assert_close(copy.grad, torch.full((4, 3), 7.0))
    assert info.grad_norm == pytest.approx(7.0 * 12**0.5)  # the weight counted once
