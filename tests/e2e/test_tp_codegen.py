"""Tensor-parallel codegen: compiled tp stages on gloo reproduce the original model's loss and gradients,
with and without sequence parallelism, tensor-parallel overlap on and off (the same bytes either way)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.testing import assert_close

from passes.analyze import analyze
from passes.tabulate import table_from_traced
from planner.commands.compile import compile_plan
from planner.commands.train import original_state
from planner.frontend.trace import trace_model
from planner.frontend.zoo import ModelSizes, build_model
from planner.plan import Plan
from runtime.contract.schedule_ir import one_f_one_b
from runtime.distributed import comm
from runtime.distributed.launch import launch_local
from runtime.distributed.mesh import setup_mesh
from runtime.pipeline.executor import PipelineStage, TensorMeta
from runtime.stages.compiled_stages import load_stage_module, load_weights, read_manifest
from runtime.tensor_parallel import set_overlap
from tests.helpers import manual_plan

GPT = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 51, "seq_len": 8}
LLAMA = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 48, "vocab": 64, "seq_len": 8}
GPT2 = {"layers": 1, "hidden": 32, "heads": 4, "vocab": 50, "seq_len": 8}
GPT_PP = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 8}
MBS, SEED, WORLD = 2, 7, 4


def _plan(spec: str, sizes: dict, tp: int, pp: int = 1, m: int = 1, sp: bool = False) -> Plan:
    L = sizes["layers"]
    stages = [[0, L + 1]] if pp == 1 else [[0, L // 2], [L // 2 + 1, L + 1]]
    plan = manual_plan(spec, sizes, tp=tp, pp=pp, mbs=MBS, m=m, stages=stages)
    return dataclasses.replace(plan, sequence_parallel=True) if sp else plan


def _batch(vocab: int, rows: int, seq: int):
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    labels[0, 0] = -100  # an ignored token exercises ignore_index
    return ids, labels


def _qkv_order(spec: dict, tp: int) -> torch.Tensor:
    """Index of the fused ``[q; k; v]`` rows in rank-major order ``[q_0; k_0; v_0; q_1; ...]``."""
    starts = [sum(spec["parts"][:i]) for i in range(len(spec["parts"]))]
    return torch.cat(
        [
            torch.arange(s + r * (p // tp), s + (r + 1) * (p // tp))
            for r in range(tp)
            for s, p in zip(starts, spec["parts"])
        ]
    )


def _worker(rank: int, world: int, jobs: list, out_dir: str) -> None:
    for name, cdir, spec, sizes, m, overlap in jobs:
        set_overlap(overlap)
        comm.STATS.reset()
        man = read_manifest(cdir)
        tp, pp = man["plan"]["tp"], man["plan"]["pp"]
        mesh = setup_mesh(pp, world // (pp * tp), tp)  # spare ranks: dp replicas of the same batch
        stage = man["stages"][mesh.pp_index]
        module = load_stage_module(cdir, stage)
        state = original_state(spec, sizes, sizes["seq_len"], SEED)
        load_weights(module, stage, state, mesh.tp_index, tp)
        ids, labels = _batch(sizes["vocab"], MBS * m, sizes["seq_len"])
        src = {"input_ids": ids, "labels": labels}
        if pp == 1:
            loss = module(*[src[n] for n in stage["data_inputs"]])
            loss.backward()
            loss = loss.item()
        else:
            recv = [
                TensorMeta(tuple(r["shape"]), getattr(torch, r["dtype"]), r["requires_grad"]) for r in stage["recv"]
            ]
            ps = PipelineStage.from_mesh(module, recv_meta=recv, mesh=mesh)
            micro = [tuple(src[n][i * MBS : (i + 1) * MBS] for n in stage["data_inputs"]) for i in range(m)]
            loss = ps.run(one_f_one_b(pp, m)[mesh.pp_index], micro)
        grads = {k: p.grad.detach().clone() for k, p in module.named_parameters()}
        sent = dict(comm.STATS.bytes_by_kind)
        saved = _block_saved_bytes(module, ids[:MBS]) if pp == 1 and spec == "gpt" else None
        result = {"loss": loss, "grads": grads, "sent": sent, "block_saved": saved}
        torch.save(result, os.path.join(out_dir, f"{name}_{rank}.pt"))


def _block_saved_bytes(module, ids: torch.Tensor) -> int:
    """Bytes autograd keeps for one block's backward (``layer_1``, one micro-batch): the distinct
    storages its forward saves, parameters excluded (the block's input counts when it is saved)."""
    x = module.layer_0(ids).detach().requires_grad_(True)
    params = {StorageWeakRef(p.untyped_storage()).cdata for p in module.parameters()}
    seen: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(t.untyped_storage()).cdata
        if key not in params:
            seen.setdefault(key, (t.untyped_storage().nbytes(), t))  # keep it alive: ids stay unique
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module.layer_1(x)
    return sum(n for n, _ in seen.values())


def _reference(spec: str, sizes: dict, m: int):
    """Mean of the micro-batch losses of the original model and its gradients."""
    model = build_model(spec, ModelSizes(**sizes), seed=SEED).model
    ids, labels = _batch(sizes["vocab"], MBS * m, sizes["seq_len"])
    loss = sum(model(ids[i * MBS : (i + 1) * MBS], labels[i * MBS : (i + 1) * MBS]) for i in range(m)) / m
    loss.backward()
    named = dict(model.named_parameters(remove_duplicate=False))
    return loss.item(), {n: p.grad for n, p in named.items()}, {n: id(p) for n, p in named.items()}


def _join(pieces: list[torch.Tensor], spec: dict | None) -> torch.Tensor:
    """Re-assemble tp shards: cat along the shard dim, trim the vocabulary padding."""
    if not spec:
        return pieces[0]
    full = torch.cat(pieces, dim=spec["dim"])
    if spec["kind"] == "qkv":
        inv = torch.argsort(_qkv_order(spec, len(pieces)))
        return full.index_select(spec["dim"], inv)
    return full.narrow(spec["dim"], 0, spec["size"])


def _check(name: str, cdir: str, out_dir: str, spec: str, sizes: dict, m: int) -> None:
    with open(os.path.join(cdir, "manifest.json")) as f:
        man = json.load(f)
    tp, pp = man["plan"]["tp"], man["plan"]["pp"]
    dp = WORLD // (tp * pp)
    ref_loss, ref_grads, ref_ids = _reference(spec, sizes, m)
    res = {r: torch.load(os.path.join(out_dir, f"{name}_{r}.pt")) for r in range(WORLD)}
    checked = set()
    for r in range(WORLD):
        assert res[r]["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), (name, r)
    for s, stage in enumerate(man["stages"]):
        ranks = [s * dp * tp + t for t in range(tp)]  # dp index 0 of pipeline stage s
        for attr, e in stage["params"].items():
            if not e["trainable"]:
                continue
            pieces = [res[r]["grads"][attr] for r in ranks]
            if e["shard"]:
                got = _join(pieces, e["shard"])
                assert list(pieces[0].shape) == e["shape"]
            else:  # replicated: every tp rank must hold the full, identical gradient
                for p in pieces[1:]:
                    assert_close(p, pieces[0], rtol=1e-5, atol=1e-6)
                got = pieces[0]
            assert_close(got, ref_grads[e["fqn"]], rtol=1e-4, atol=1e-6, msg=lambda s_: f"{name} {e['fqn']}: {s_}")
            checked.add(e["fqn"])
    covered = {ref_ids[n] for n in checked}  # a tied weight is checked once, under any name
    missing = [n for n, i in ref_ids.items() if i not in covered]
    assert not missing, f"{name}: parameters not covered: {missing}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Compile every case, then run them all in one 4-rank launch (spawning is the slow part)."""
    root = tmp_path_factory.mktemp("tp")
    cases = (  # name, spec, sizes, tp, pp, micro-batches, sequence parallel, tp overlap
        ("gpt", "gpt", GPT, 2, 1, 1, False, True),
        ("gpt-off", "gpt", GPT, 2, 1, 1, False, False),
        ("gpt-sp", "gpt", GPT, 2, 1, 1, True, True),
        ("gpt-sp-off", "gpt", GPT, 2, 1, 1, True, False),
        ("llama", "hf:llama", LLAMA, 2, 1, 1, False, True),
        ("gpt2", "hf:gpt2", GPT2, 2, 1, 1, False, True),
        ("pp", "gpt", GPT_PP, 2, 2, 2, False, True),
        ("tp4", "gpt", GPT, 4, 1, 1, False, True),
    )
    jobs = {}
    for name, spec, sizes, tp, pp, m, sp, overlap in cases:
        cdir = str(root / name)
        compile_plan(_plan(spec, sizes, tp=tp, pp=pp, m=m, sp=sp), cdir)
        jobs[name] = (name, cdir, spec, sizes, m, overlap)
    launch_local(_worker, WORLD, (list(jobs.values()), str(root)), timeout_s=150)
    return root, jobs


def _run_check(runs, name):
    root, jobs = runs
    n, cdir, spec, sizes, m, _ = jobs[name]
    _check(n, cdir, str(root), spec, sizes, m)


@pytest.mark.dist
def test_gpt_tp2_matches_original(runs):
    _run_check(runs, "gpt")  # vocab 51 over 2 ranks: 26 rows each, one padding row


@pytest.mark.dist
def test_llama_gqa_tp2_matches_original(runs):
    _run_check(runs, "llama")  # 4 query heads, 2 kv heads: 2 and 1 per rank


@pytest.mark.dist
def test_gpt2_fused_qkv_conv1d_tp2_matches_original(runs):
    _run_check(runs, "gpt2")  # Conv1D (addmm), fused c_attn split, tied embedding / LM head


@pytest.mark.dist
def test_gpt_tp2_pp2_pipeline_matches_original(runs):
    _run_check(runs, "pp")  # 1F1B over 2 stages, 2 micro-batches


@pytest.mark.dist
def test_gpt_tp4_padded_vocab_matches_original(runs):
    _run_check(runs, "tp4")  # vocab 51 over 4 ranks: 13 rows each, one padding row


@pytest.mark.dist
@pytest.mark.parametrize("name", ["gpt-off", "gpt-sp", "gpt-sp-off"])
def test_gpt_tp2_overlap_and_sequence_parallel_match_original(runs, name):
    _run_check(runs, name)  # overlap on/off over the same compiled code; with SP, its fused calls


@pytest.mark.dist
@pytest.mark.parametrize("sp", ["", "-sp"])
def test_tp_overlap_sends_the_same_bytes(runs, sp):
    """Overlap changes when the tensor-parallel collectives are waited for, not what they move:
    every rank counts exactly the bytes of each kind it counts without it."""
    root, _ = runs
    for r in range(WORLD):
        on = torch.load(os.path.join(root, f"gpt{sp}_{r}.pt"))["sent"]
        off = torch.load(os.path.join(root, f"gpt{sp}-off_{r}.pt"))["sent"]
        assert on == off and on["all_reduce"] > 0
        assert ("all_gather" in on) == bool(sp) and ("reduce_scatter" in on) == bool(sp)


@pytest.mark.dist
def test_sequence_parallel_block_saves_what_is_priced(runs):
    """One GPT block's saved tensors at tp 2 (``saved_tensors_hooks`` on the compiled block):
    exactly the bytes the layer table prices per device, with sequence parallelism (whose
    column-parallel linears keep only their positions and gather them again in backward) and
    without. Under SP every saved byte of the block is divided by tp (Korthikanti et al. 2022:
    ``34 s b h / t`` without the attention scores), the gathered inputs of the linears included."""
    root, _ = runs
    tr = trace_model("gpt", batch=MBS, seq_len=GPT["seq_len"], dtype="fp32", **_sizes(GPT))
    analyze(tr)
    row = table_from_traced(tr, analyzed=True).numeric(MBS, GPT["seq_len"])[1]
    tp = 2
    plain = row["saved_bytes"] - row["saved_bytes_tp"] + row["saved_bytes_tp"] / tp
    priced = {"gpt": plain, "gpt-sp": plain - row["saved_bytes_sp"] * (1 - 1 / tp)}
    priced["gpt-sp-off"] = priced["gpt-sp"]
    for name, want in priced.items():
        for r in range(tp):
            got = torch.load(os.path.join(root, f"{name}_{r}.pt"))["block_saved"]
            assert got == want, (name, r, got, want)
    assert priced["gpt-sp"] == row["saved_bytes"] / tp < priced["gpt"]


def _sizes(sizes: dict) -> dict:
    return {k: v for k, v in sizes.items() if k != "seq_len"}


@pytest.mark.dist
def test_tensor_parallel_bytes_are_priced_exactly(runs):
    """The bytes each rank counts in one forward and backward at tp 2 (no data-parallel traffic in
    these runs) are those the cost model prices for the plan's layers, with sequence parallelism
    (its backward gathers each column-parallel input again) and without."""
    from cost_models.hardware import load_hardware
    from cost_models.strategy import Candidate, NumericTable, candidate_costs
    from planner.frontend.model_analysis import build_layer_table

    root, _ = runs
    hw = load_hardware("cpu", WORLD)
    table = NumericTable(build_layer_table("gpt", dtype="fp32", **GPT))
    for name, sp in (("gpt", False), ("gpt-sp", True), ("gpt-sp-off", True)):
        cand = Candidate(WORLD // 2, 2, 1, 0, MBS, 1, sequence_parallel=sp)
        costs = candidate_costs(table, hw, "fp32", GPT["seq_len"], cand, WORLD, hw.memory_bytes)
        priced = sum(layer.tp_sent_b + layer.tp_bwd_sent_b for layer in costs.layers)
        for r in range(WORLD):
            sent = torch.load(os.path.join(root, f"{name}_{r}.pt"))["sent"]
            assert sum(sent.values()) == priced, (name, r, sent, priced)
