"""Where expert parameters live: runtime.moe.expert_shards and the expert cut of ``load_weights``
(an expert parameter's rows per expert-parallel rank, cut at load from a whole tensor or through a
lazy reader, joined back into the full ``[E, ...]`` tensor, for every ep degree dividing E; the
manifest's expert records read and checked) and the ZeRO engine's expert groups (a layer split
into a dense and an expert group, sharded over other degrees; 1-bit Adam refused). One process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.contract.input_errors import ConfigError
from runtime.data_parallel.engine_config import CompressionConfig
from runtime.data_parallel.flat_shards import build_groups
from runtime.data_parallel.zero_engine import OptimizerConfig, ParallelContext, ZeroEngine
from runtime.distributed.mesh import Mesh, set_mesh
from runtime.moe.expert_shards import cut, expert_attrs, expert_degree, join, mark_listed, num_experts
from runtime.stages.compiled_stages import CompiledError, load_weights

E, H, FF = 4, 3, 2


class Stage(nn.Module):
    """A compiled stage's shape: a dense weight and a local slice of the experts."""

    def __init__(self, local: int):
        super().__init__()
        self.router = nn.Parameter(torch.zeros(H, E))
        self.gate_up = nn.Parameter(torch.zeros(local, H, FF))


STAGE = {
    "params": {
        "router": {"fqn": "mlp.gate.weight", "shape": [H, E]},
        "gate_up": {"fqn": "mlp.experts.gate_up_proj", "shape": [E, H, FF], "expert": True},
    }
}


def _state() -> dict[str, torch.Tensor]:
    return {
        "mlp.gate.weight": torch.randn(H, E),
        "mlp.experts.gate_up_proj": torch.arange(E * H * FF, dtype=torch.float32).view(E, H, FF),
    }


class LazyState(dict):
    """A safetensors-like reader: ``get_slice(name)[idx]`` reads rows; records what was read."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.reads: list[tuple] = []

    def get_slice(self, name):
        state, reads = self, self.reads

        class Slice:
            def get_shape(self):
                return list(state[name].shape)

            def __getitem__(self, index):
                reads.append((name, index))
                return state[name][index]

        return Slice()


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_cut_then_join_is_the_full_tensor(ep):
    full = torch.randn(E, H, FF)
    pieces = [cut(full, r, ep) for r in range(ep)]
    assert all(p.shape == (E // ep, H, FF) for p in pieces)
    assert torch.equal(pieces[-1][-1], full[-1]) and torch.equal(join(pieces), full)
    assert cut(full, 0, 1) is full


def test_cut_and_join_refuse_what_does_not_split():
    with pytest.raises(ConfigError, match=r"shape \(6, 3\) cannot be split over 4 expert-parallel ranks"):
        cut(torch.zeros(6, 3), 0, 4)
    with pytest.raises(ValueError, match="different shapes"):
        join([torch.zeros(2, 3), torch.zeros(1, 3)])


@pytest.mark.parametrize("lazy", [False, True])
def test_load_weights_keeps_this_ranks_experts(lazy):
    state = _state()
    source = LazyState(state) if lazy else state
    for ep_index in range(2):
        module = Stage(E // 2)
        load_weights(module, STAGE, source, ep_index=ep_index, ep=2)
        rows = slice(2 * ep_index, 2 * ep_index + 2)
        assert torch.equal(module.gate_up.data, state["mlp.experts.gate_up_proj"][rows])
        assert torch.equal(module.router.data, state["mlp.gate.weight"])  # dense: whole
    if lazy:  # only the rows were read
        assert [index for name, index in source.reads] == [(slice(0, 2),), (slice(2, 4),)]
    module = Stage(E)  # ep 1: the whole tensor
    load_weights(module, STAGE, source)
    assert torch.equal(module.gate_up.data, state["mlp.experts.gate_up_proj"])


def test_load_weights_names_a_module_of_the_wrong_expert_count():
    with pytest.raises(CompiledError, match=r"mlp.experts.gate_up_proj: shape \(2, 3, 2\) does not fit gate_up"):
        load_weights(Stage(E), STAGE, _state(), ep_index=0, ep=2)
    with pytest.raises(CompiledError, match="cannot be split over 3 expert-parallel ranks"):
        load_weights(Stage(1), STAGE, _state(), ep_index=0, ep=3)


def test_manifest_records():
    man = {"plan": {"expert_parallel": 2, "model": {"moe": {"experts": 8}}}, "stages": [STAGE]}
    assert expert_degree(man) == 2 and num_experts(man) == 8 and expert_attrs(STAGE) == {"gate_up"}
    man["expert_parallel"] = {"degree": 2, "experts": 4, "capacity_factor": None}
    assert num_experts(man) == 4
    man["expert_parallel"]["degree"] = 4
    with pytest.raises(ConfigError, match="shards experts over 4 ranks but the plan says expert_parallel 2"):
        expert_degree(man)
    dense = {"plan": {"model": {}}}
    assert expert_degree(dense) == 1 and num_experts(dense) is None
    unmarked = {"plan": {"expert_parallel": 2}, "stages": [{"params": {"w": {"fqn": "w"}}}]}
    with pytest.raises(ConfigError, match="marks no parameter as a routed expert"):
        expert_degree(unmarked)


def test_a_list_of_expert_names_marks_the_entries():
    stage = {"params": {"a": {"fqn": "mlp.experts.down_proj"}, "b": {"fqn": "mlp.gate.weight"}, "c": {"fqn": "x"}}}
    man = {"expert_parallel": {"degree": 2, "params": ["mlp.experts.down_proj", "c"]}, "stages": [stage]}
    assert expert_attrs(mark_listed(man)["stages"][0]) == {"a", "c"}
    assert expert_attrs(mark_listed({"stages": [STAGE]})["stages"][0]) == {"gate_up"}


# ---------------------------------------------------------------------- the engine's expert groups


def _moe_net():
    from tests.runtime import moe_engine_checks as checks

    return checks, checks.make_net()


def test_a_layer_with_experts_becomes_a_dense_and_an_expert_group():
    checks, net = _moe_net()
    groups = build_groups(net, checks.layers(net), 4, checks.EXPERTS, 2)
    assert [(g.names, g.expert, g.ways) for g in groups] == [
        (["inp.weight", "inp.bias"], False, 4),
        (["moe.ln.weight", "moe.ln.bias", "moe.router.weight"], False, 4),
        (["moe.w1", "moe.w2"], True, 2),
        (["head.weight", "head.bias"], False, 4),
    ]
    expert = groups[2]
    assert (
        expert.numel == 2 * checks.E * checks.H * checks.FF
        and expert.padded % 2 == 0
        and expert.shard == expert.padded // 2
    )
    assert [g.index for g in groups] == [0, 1, 2, 3] and expert.hook_modules == ["moe"]


def test_one_process_with_expert_groups_trains_like_without():
    checks, _ = _moe_net()
    set_mesh(Mesh(1, 1, 1))
    results = []
    for experts in (checks.EXPERTS, frozenset()):
        torch.manual_seed(0)
        net = checks.make_net()
        engine = ZeroEngine(net, checks.layers(net), parallel=ParallelContext(expert_params=experts))
        assert sum(g.expert for g in engine.groups) == (1 if experts else 0)
        for step in range(2):
            x, y = checks.data(step)
            engine.module(x, y).backward()
            engine.step()
            engine.zero_grad()
        results.append(engine.full_state_dict())
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name


def test_engine_refuses_one_bit_adam_with_experts():
    checks, net = _moe_net()
    set_mesh(Mesh(1, 1, 1))
    onebit = OptimizerConfig(compression=CompressionConfig(method="onebit-adam", warmup_steps=1))
    with pytest.raises(ConfigError, match="does not run with 1-bit Adam"):
        ZeroEngine(net, checks.layers(net), optimizer=onebit, parallel=ParallelContext(expert_params=checks.EXPERTS))
