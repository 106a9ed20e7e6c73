"""The trainer under expert parallelism, before any codegen: a compiled directory written by hand
(an embedding, one MoE layer calling ``runtime.moe``'s dispatch and combine around the local
experts' grouped products, a head with the loss; the manifest marks the routed expert weights
``"expert": true`` and records ``expert_parallel``), trained on 2 gloo ranks (dp2) in ONE launch:

- ep2 against ep1 (experts replicated), ZeRO 1 and 3: the same losses, final weights (the
  checkpoint holds each expert once, whole) and ``expert_load``; ``tokens_dropped`` 0 (dropless);
- capacity mode at ep2 and ep1: the same dropped count, > 0, and the same losses;
- a run saved at ep2 resumed at ep1 (and one saved at ep1 resumed at ep2): the losses of the
  uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from torch.testing import assert_close

from runtime.distributed.launch import launch_local
from runtime.training.trainer import train_worker
from tests.e2e.batched import options, run_result
from tests.helpers import read_metrics

E, TOP_K, H, FF, V, SEQ = 4, 2, 8, 6, 32, 8
STEPS = 4
LR = dict(lr=3e-3, min_lr=3e-3)  # constant: a run of 2 steps resumed to 4 follows the 4-step run's schedule

STAGE = """
import torch

from runtime.moe import combine, dispatch
from runtime.portable import grouped_mm

E, TOP_K, H, FF, V, EP, CAPACITY = {E}, {TOP_K}, {H}, {FF}, {V}, {EP}, {CAPACITY}


class Pre(torch.nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty((V, H), device=device))

    def forward(self, input_ids):
        return torch.nn.functional.embedding(input_ids, self.weight)


class Block(torch.nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.router = torch.nn.Parameter(torch.empty((E, H), device=device))
        self.gate_up_proj = torch.nn.Parameter(torch.empty((E // EP, H, 2 * FF), device=device))
        self.down_proj = torch.nn.Parameter(torch.empty((E // EP, FF, H), device=device))

    def forward(self, x):
        tokens = x.reshape(-1, H)
        top_w, top_i = torch.topk(torch.softmax(tokens @ self.router.t(), -1), TOP_K, dim=-1)
        sorted_ids, perm = torch.sort(top_i.reshape(-1), stable=True)
        rows = tokens[perm // TOP_K]
        local, offs, routing = dispatch(rows, runtime_histc(sorted_ids), E, CAPACITY)
        gate, up = grouped_mm(local, self.gate_up_proj, offs).chunk(2, dim=-1)
        out = combine(grouped_mm(torch.nn.functional.silu(gate) * up, self.down_proj, offs), routing)
        weighted = out * top_w.reshape(-1)[perm].unsqueeze(-1)
        mixed = tokens.new_zeros(tokens.shape[0] * TOP_K, H).index_copy(0, perm, weighted)
        return x + mixed.view(-1, TOP_K, H).sum(1).view(x.shape)


def runtime_histc(ids):
    return torch.histc(ids.float(), E, 0, E - 1)


class Post(torch.nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty((V, H), device=device))

    def forward(self, x, labels):
        logits = x @ self.weight.t()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


class Stage0(torch.nn.Module):
    DATA_INPUTS = ("input_ids", "labels")
    RECV = ()
    SEND = ("cross_entropy_loss",)

    def __init__(self, device=None):
        super().__init__()
        self.layer_0 = Pre(device)
        self.layer_1 = Block(device)
        self.layer_2 = Post(device)

    def forward(self, input_ids, labels):
        return self.layer_2(self.layer_1(self.layer_0(input_ids)), labels)
"""

PARAMS = {
    "layer_0.weight": ("embed.weight", [V, H], False),
    "layer_1.router": ("layers.0.mlp.gate.weight", [E, H], False),
    "layer_1.gate_up_proj": ("layers.0.mlp.experts.gate_up_proj", [E, H, 2 * FF], True),
    "layer_1.down_proj": ("layers.0.mlp.experts.down_proj", [E, FF, H], True),
    "layer_2.weight": ("head.weight", [V, H], False),
}


def original_state() -> dict[str, torch.Tensor]:
    """The original model's weights by name (the same for every plan)."""
    g = torch.Generator().manual_seed(7)
    return {fqn: torch.randn(*shape, generator=g) / 2 for fqn, shape, _ in PARAMS.values()}


def plan(ep: int, zero_stage: int, capacity: float | None) -> dict:
    inputs = [
        {"dtype": "int64", "name": "input_ids", "role": "tokens", "shape": ["b", "s"], "vocab": V},
        {"dtype": "int64", "name": "labels", "role": "targets", "shape": ["b", "s"], "vocab": V},
    ]
    moe = {"layers": 1, "experts": E, "top_k": TOP_K, "shared_experts": 0, "capacity_factor": capacity}
    return {
        "schema_version": 1,
        "model": {"spec": "hand-moe", "sizes": {}, "inputs": inputs, "moe": moe, "layers": 1, "params": 0},
        "dp": 2,
        "tp": 1,
        "pp": 1,
        "expert_parallel": ep,
        "zero_stage": zero_stage,
        "dtype": "fp32",
        "global_batch": 8,
        "micro_batch_size": 2,
        "num_micro_batches": 2,
        "seq_len": SEQ,
        "schedule": "1f1b",
        "virtual_stages": 1,
        "stages": [[0, 2]],
        "checkpoint_layers": [],
        "selective_layers": [],
        "sequence_parallel": False,
        "offload": {"optimizer": "none", "params": "none"},
        "compile": False,
        "dp_compression": "none",
        "compression_warmup": 0,
    }


def compile_by_hand(folder: str, ep: int, zero_stage: int = 1, capacity: float | None = None) -> str:
    """What ``planner compile`` would write for this plan: the stage file and its manifest."""
    os.makedirs(folder, exist_ok=True)
    source = STAGE.format(E=E, TOP_K=TOP_K, H=H, FF=FF, V=V, EP=ep, CAPACITY=capacity)
    with open(os.path.join(folder, "stage_0.py"), "w", encoding="utf-8") as f:
        f.write(source)
    params = {
        attr: {"fqn": fqn, "shape": shape, "shard": None, "trainable": True, **({"expert": True} if expert else {})}
        for attr, (fqn, shape, expert) in PARAMS.items()
    }
    stage = {
        "class": "Stage0",
        "data_inputs": ["input_ids", "labels"],
        "file": "stage_0.py",
        "index": 0,
        "layer_names": ["embed", "layers.0", "head"],
        "layers": [0, 1, 2],
        "params": params,
        "recv": [],
        "send": [{"dtype": "float32", "name": "cross_entropy_loss", "requires_grad": True, "shape": []}],
        "sha256": hashlib.sha256(source.encode()).hexdigest(),
    }
    manifest = {
        "format": 1,
        "runtime_version": "0.1.0",
        "plan_hash": f"hand-moe-ep{ep}-z{zero_stage}-c{capacity}",
        "plan": plan(ep, zero_stage, capacity),
        "model": {
            "inputs": ["input_ids", "labels"],
            "layer_names": ["embed", "layers.0", "head"],
            "sizes": {},
            "spec": "hand-moe",
            "vocab": V,
        },
        "expert_parallel": {"degree": ep, "experts": E, "capacity_factor": capacity},
        "stages": [stage],
    }
    with open(os.path.join(folder, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    return folder


def _train_all(rank: int, world: int, runs: list) -> None:
    for name, compiled, opts in runs:
        try:
            train_worker(rank, world, compiled, opts, original_state)
        except Exception as e:
            raise RuntimeError(f"case {name}: {type(e).__name__}: {e}") from e


CASES = {  # name: (ep, zero stage, capacity factor)
    "ep1_z1": (1, 1, None),
    "ep2_z1": (2, 1, None),
    "ep2_z3": (2, 3, None),
    "ep1_cap": (1, 0, 0.5),
    "ep2_cap": (2, 0, 0.5),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_train")
    runs, folders = [], {}
    for name, (ep, zero_stage, capacity) in CASES.items():
        folder = folders[name] = str(root / name)
        runs.append(
            (
                name,
                compile_by_hand(os.path.join(folder, "compiled"), ep, zero_stage, capacity),
                options(folder, STEPS, **LR),
            )
        )
    # resumes across ep degrees: 2 steps at one degree, continued to STEPS at the other
    for first, then in (("ep2_z1", "ep1_z1"), ("ep1_z1", "ep2_z1")):
        name = f"resume_{first}_to_{then}"
        folder = folders[name] = str(root / name)
        os.makedirs(folder)
        ck = os.path.join(folder, "ck")
        runs.append(
            (
                f"{name}/a",
                os.path.join(folders[first], "compiled"),
                options(folder, 2, checkpoint_dir=ck, save_every=2, **LR),
            )
        )
        runs.append(
            (
                f"{name}/b",
                os.path.join(folders[then], "compiled"),
                options(folder, STEPS, checkpoint_dir=ck, save_every=STEPS, resume=True, **LR),
            )
        )
    launch_local(_train_all, 2, (runs,), timeout_s=400, collective_timeout_s=60)
    return folders


@pytest.mark.dist
@pytest.mark.parametrize("name", ["ep2_z1", "ep2_z3"])
def test_expert_parallel_trains_like_replicated_experts(trained, name):
    ref_losses, ref_params = run_result(trained["ep1_z1"], STEPS)
    losses, params = run_result(trained[name], STEPS)
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert params["layers.0.mlp.experts.gate_up_proj"].shape == (E, H, 2 * FF)  # saved once, whole
    for key, value in ref_params.items():
        assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)
    rows, ref_rows = (
        read_metrics(os.path.join(trained[name], "m.jsonl")),
        read_metrics(os.path.join(trained["ep1_z1"], "m.jsonl")),
    )
    assert [r["tokens_dropped"] for r in rows] == [0] * STEPS
    assert all(r["expert_load"] >= 1.0 for r in rows)
    assert [r["expert_load"] for r in rows] == pytest.approx([r["expert_load"] for r in ref_rows], rel=1e-9)
    assert all(r["time"]["ep_comm"] > 0 for r in rows) and all(r["time"]["ep_comm"] == 0 for r in ref_rows)


@pytest.mark.dist
def test_capacity_drops_the_same_tokens_at_either_degree(trained):
    ep1, ep2 = (read_metrics(os.path.join(trained[n], "m.jsonl")) for n in ("ep1_cap", "ep2_cap"))
    assert [r["tokens_dropped"] for r in ep2] == [r["tokens_dropped"] for r in ep1]
    assert all(r["tokens_dropped"] > 0 for r in ep2)
    assert_close(torch.tensor([r["loss"] for r in ep2]), torch.tensor([r["loss"] for r in ep1]), rtol=1e-5, atol=1e-6)


@pytest.mark.dist
@pytest.mark.parametrize("first,then", [("ep2_z1", "ep1_z1"), ("ep1_z1", "ep2_z1")])
def test_a_checkpoint_resumes_at_another_expert_parallel_degree(trained, first, then):
    ref_losses, ref_params = run_result(trained["ep1_z1"], STEPS)
    losses, params = run_result(trained[f"resume_{first}_to_{then}"], STEPS)
    assert_close(torch.tensor(losses[-2:]), torch.tensor(ref_losses[-2:]), rtol=1e-5, atol=1e-6)
    for key, value in ref_params.items():
        assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)
