"""Tensor parallelism read from the graph: each tiny HF architecture of ``tests/fixtures/hf_archs.py``,
given as a ``file.py:factory`` (no head counts from flags), compiled at tp 2, reproduces the
original model's loss and gradients on gloo ranks (Phi-3: q, k and v sliced from one fused
projection, split as its parts; MPT: its ALiBi bias cut by heads with the scores; OLMo 2: q and
k normalized over all their features, the sums of squares all-reduced; BitNet: its sub-norms
before the row-parallel projections alike; Apertus: its xIELU's elementwise min). Also at tp 4: llama (its 2 key/value heads
replicated, each rank keeping its query heads' share), gemma (one key/value head) and falcon
(fused qkv, one head per rank); and llama with eager matmul-softmax-matmul attention. DeepSeek-V3's
latent attention: q and the keys and values expanded per head from replicated low-rank latents,
the one rotary key broadcast to the local heads. GPT-OSS: its attention sinks (a logit per head,
concatenated to the scores) cut by heads with them."""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
import torch
from torch.testing import assert_close

from planner.commands.compile import compile_plan
from runtime.distributed.launch import launch_local
from runtime.distributed.mesh import setup_mesh
from runtime.stages.compiled_stages import load_stage_module, load_weights, read_manifest
from runtime.tensor_parallel.sharding import TensorShard
from tests.fixtures.hf_archs import ARCHS
from tests.helpers import TESTS, manual_plan

ARCHS_FILE = os.path.join(TESTS, "fixtures", "hf_archs.py")
EAGER_FILE = os.path.join(TESTS, "fixtures", "tp_models.py")
CASES = [(a, 2) for a in ARCHS] + [
    ("llama", 4),
    ("gemma", 4),
    ("falcon", 4),
    ("llama_eager", 2),
    ("opt_proj", 2),
    ("deepseek_mla", 2),
    ("gpt_oss", 2),
]
WORLD, MBS, SEQ = 4, 2, 16
#: Per architecture, attention weights of its blocks and the shard each must get (their attention
#: stayed whole before): q, k, v sliced from one projection (Phi-3), chunked with ALiBi added to
#: the scores (MPT), normalized over all features, the norm's scale cut with them (OLMo 2).
SPLIT = {
    "phi3": {"qkv_proj.weight": {"kind": "qkv", "parts": [32, 16, 16]}},
    "mpt": {"Wqkv.weight": {"kind": "qkv", "parts": [32, 32, 32]}},
    "olmo2": {"q_proj.weight": {"kind": "heads"}, "q_norm.weight": {"kind": "column"}},
    "bitnet": {"o_proj.weight": {"kind": "row"}, "attn_sub_norm.weight": {"kind": "column"}},
    "apertus": {"mlp.up_proj.weight": {"kind": "column"}, "mlp.down_proj.weight": {"kind": "row"}},
    "opt_proj": {"self_attn.q_proj.weight": {"kind": "heads"}, "fc1.weight": {"kind": "column"}},
    # GPT-OSS's attention sinks, one logit per head concatenated to the scores: cut by heads
    "gpt_oss": {"self_attn.sinks": {"dim": 0, "size": 4}, "self_attn.o_proj.weight": {"kind": "row"}},
    # DeepSeek-V3's latent attention: the low-rank projections whole, their expansions by heads
    "deepseek_mla": {
        "self_attn.q_b_proj.weight": {"kind": "heads"},
        "self_attn.kv_b_proj.weight": {"kind": "heads"},
        "self_attn.o_proj.weight": {"kind": "row"},
    },
}
#: Per architecture, weights outside the blocks and the shard each must get: OPT-350m's head, behind
#: a projection out of the blocks and tied to the embedding, keeps the vocabulary split.
SPLIT_ONCE = {"opt_proj": {"lm_head.weight": {"dim": 0, "kind": "vocab"}}}


def _file(arch: str) -> str:
    return EAGER_FILE if arch.endswith("_eager") else ARCHS_FILE


def _factory(arch: str):
    spec = importlib.util.spec_from_file_location("tp_archs_" + arch, _file(arch))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, arch)()


def _inputs(model, inputs) -> dict:
    names = list(inspect.signature(model.forward).parameters)
    return dict(zip(names, inputs))


def _worker(rank: int, world: int, jobs: list, out_dir: str) -> None:
    torch.set_num_threads(1)
    for name, cdir, tp in jobs:
        man = read_manifest(cdir)
        mesh = setup_mesh(1, world // tp, tp)  # spare ranks: dp replicas of the same batch
        stage = man["stages"][0]
        module = load_stage_module(cdir, stage)
        given = torch.load(os.path.join(out_dir, f"{name}_in.pt"))
        load_weights(module, stage, given["state"], mesh.tp_index, tp)
        # export folds identical example inputs into one (bert's ids are its labels)
        loss = module(*[given["inputs"][n] for n in stage["data_inputs"]])
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in module.named_parameters() if p.grad is not None}
        torch.save({"loss": loss.item(), "grads": grads}, os.path.join(out_dir, f"{name}_{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Compile every case and compute its single-process reference, then run them all in one
    launch (spawning is the slow part; the ranks read the weights and inputs from files)."""
    root = tmp_path_factory.mktemp("tp_archs")
    jobs, refs = [], {}
    for arch, tp in CASES:
        name = f"{arch}_tp{tp}"
        cdir = str(root / name)
        compile_plan(manual_plan(f"{_file(arch)}:{arch}", {"layers": 2}, tp=tp, mbs=MBS, seq_len=SEQ), cdir)
        model, inputs = _factory(arch)
        state = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
        state.update(dict(model.named_buffers(remove_duplicate=False)))
        torch.save({"state": state, "inputs": _inputs(model, inputs)}, str(root / f"{name}_in.pt"))
        loss = model(*inputs)
        loss.backward()
        refs[name] = (loss.item(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)})
        jobs.append((name, cdir, tp))
    launch_local(_worker, WORLD, (jobs, str(root)), timeout_s=170)
    return root, refs


@pytest.mark.parametrize("arch,tp", CASES, ids=[f"{a}-tp{t}" for a, t in CASES])
def test_arch_tp_matches_original(runs, arch, tp):
    root, refs = runs
    name = f"{arch}_tp{tp}"
    stage = read_manifest(str(root / name))["stages"][0]
    ref_loss, ref_grads = refs[name]
    res = [torch.load(os.path.join(root, f"{name}_{r}.pt")) for r in range(WORLD)]
    for r in range(WORLD):
        assert res[r]["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), (name, r)
    sharded = 0
    for attr, e in stage["params"].items():
        if not e["trainable"]:
            continue
        pieces = [res[r]["grads"][attr] for r in range(tp)]
        if e["shard"]:
            sharded += 1
            shard = TensorShard.from_dict(e["shard"])
            got = shard.join(pieces)
            got = got.narrow(e["shard"]["dim"], 0, e["shard"]["size"])
        else:
            for p in pieces[1:]:
                assert_close(p, pieces[0], rtol=1e-5, atol=1e-6)
            got = pieces[0]
        assert_close(got, ref_grads[e["fqn"]], rtol=1e-5, atol=1e-6, msg=lambda s_: f"{name} {e['fqn']}: {s_}")
    # per block at least the query (or fused qkv), attention output and two MLP weights are
    # sharded: the split was not silently given up
    assert sharded >= 2 * 3, f"{name}: only {sharded} sharded parameters"
    for suffix, want in SPLIT.get(arch, {}).items():  # once per block, sharded as it must be
        shards = [e["shard"] for e in stage["params"].values() if e["fqn"].endswith(suffix)]
        assert len(shards) == 2 and all(shard and shard.items() >= want.items() for shard in shards), shards
    for suffix, want in SPLIT_ONCE.get(arch, {}).items():
        shards = [e["shard"] for e in stage["params"].values() if e["fqn"].endswith(suffix)]
        assert len(shards) == 1 and shards[0] and shards[0].items() >= want.items(), shards
