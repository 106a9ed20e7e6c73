"""Shared test utilities: hand-built plans, closed-form layer tables and the single-process
training reference."""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from passes.common import B, S
from passes.layer_table import LayerCosts, LayerTable
from planner.frontend.zoo import ModelSizes, build_model
from planner.plan import MEMORY_KEYS, SCHEMA_VERSION, TIME_KEYS, Plan, save_plan
from runtime.contract.data_roles import LEGACY_INPUTS
from runtime.stages.compiled_stages import load_stage_module, load_weights
from runtime.training.data import data_vocab, model_inputs, open_data
from runtime.training.events import read_lines, step_lines
from runtime.training.train_config import TrainOptions
from runtime.training.trainer import lr_at

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
"""The repository root."""
USER_MODELS = os.path.join(TESTS, "fixtures", "user_models.py")
"""The ``file.py:factory`` models of ``tests/fixtures`` (``USER_MODELS + ":good"``)."""

SMALL_GPT_FLAGS = ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64"]
"""``planner plan`` flags of a small built-in GPT."""

TINY_GPT = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16}
TINY_LLAMA = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 64, "seq_len": 16}


def plan_args(out, *extra) -> list[str]:
    """``planner plan`` arguments of the small GPT on 2 CPU processes, written to ``out``."""
    return [
        "plan",
        *SMALL_GPT_FLAGS,
        "--gpus",
        "2",
        "--gpus-per-node",
        "2",
        "--hardware",
        "cpu",
        "--global-batch",
        "8",
        "--seq-len",
        "16",
        "--dtype",
        "fp32",
        "--out",
        str(out),
        *extra,
    ]


def two_rank_plan(spec: str, table, seq_len: int, global_batch: int, **pins) -> Plan:
    """The real search's plan of ``spec`` (its layer table ``table``) on 2 CPU ranks, fp32,
    micro-batch 1, every degree 1 unless pinned."""
    from cost_models.hardware import load_hardware
    from planner.search.request import PlanRequest
    from planner.search.solve import solve

    req = PlanRequest(
        spec=spec,
        gpus=2,
        gpus_per_node=2,
        hardware="cpu",
        global_batch=global_batch,
        seq_len=seq_len,
        dtype="fp32",
        micro_batch=1,
        **{"dp": 1, "tp": 1, "pp": 1, **pins},
    )
    return solve(req, table, load_hardware("cpu", gpus_per_node=2)).plan


def even_stages(layers: int, pp: int) -> list[list[int]]:
    """``pp`` contiguous ``[first, last]`` ranges of equal size over the L + 2 layer-table rows."""
    rows = layers + 2
    cuts = [round(i * rows / pp) for i in range(pp + 1)]
    return [[cuts[i], cuts[i + 1] - 1] for i in range(pp)]


def manual_plan(
    spec: str,
    sizes: dict,
    *,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    zero: int = 0,
    mbs: int = 1,
    m: int = 1,
    dtype: str = "fp32",
    checkpoint=(),
    stages=None,
    hardware: str = "cpu",
    seq_len: int | None = None,
    selective=(),
    sequence_parallel: bool = False,
    gpus_per_node: int | None = None,
) -> Plan:
    """A plan whose decisions are given by hand and that predicts nothing (every predicted
    number is 0): a fixed layout for tests and benchmarks, valid for ``compile`` and ``train``.
    ``sizes`` must contain ``layers``; ``seq_len`` defaults to ``sizes['seq_len']`` (else 16);
    ``gpus_per_node`` defaults to every device on one node."""
    sizes = dict(sizes)
    n = dp * tp * pp
    zero_mem = {k: 0 for k in MEMORY_KEYS}
    return Plan.from_dict(
        {
            "schema_version": SCHEMA_VERSION,
            "model": {
                "spec": spec,
                "params": 0,
                "layers": sizes["layers"],
                "flops_per_step": 0.0,
                "sizes": sizes,
                "layer_names": [],
            },
            "hardware": {"name": hardware, "gpus": n, "gpus_per_node": gpus_per_node or n},
            "global_batch": mbs * m * dp,
            "seq_len": seq_len or sizes.get("seq_len", 16),
            "dtype": dtype,
            "dp": dp,
            "tp": tp,
            "pp": pp,
            "zero_stage": zero,
            "micro_batch_size": mbs,
            "num_micro_batches": m,
            "stages": stages if stages is not None else even_stages(sizes["layers"], pp),
            "checkpoint_layers": list(checkpoint),
            "selective_layers": list(selective),
            "sequence_parallel": sequence_parallel,
            "predicted": {
                "step_time_s": 0.0,
                "peak_memory_bytes": 0,
                "tflops_per_device": 0.0,
                "mfu": 0.0,
                "comm_bytes_per_device": 0.0,
                "bubble_fraction": 0.0,
                "memory": zero_mem,
                "time": {k: 0.0 for k in TIME_KEYS},
            },
            "solver": {"name": "manual", "seconds": 0.0, "status": "given", "candidates": 1},
            "alternatives": [],
        }
    )


def make_plan(spec: str = "gpt", sizes: dict | None = None, *, mbs=2, m=2, **decisions) -> Plan:
    """A hand-made plan (``manual_plan``) of a tiny model, 2 micro-batches of 2."""
    return manual_plan(spec, sizes or TINY_GPT, mbs=mbs, m=m, **decisions)


def write_plan(path, plan: Plan) -> str:
    save_plan(plan, str(path))
    return str(path)


#: Reference runs already computed in this test process, by what determines them (many plans of
#: one tiny model share a reference: the parallel layout does not change it).
_REFERENCES: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}


def reference_run(plan: Plan, steps: int, **settings):
    """Single process, plain torch AdamW on the whole global batch: (losses, final params).

    ``settings`` override ``TrainOptions`` fields (``seed``, ``lr``, ``min_lr``, ``warmup_steps``,
    ``weight_decay``, ``eps``, ``beta1``, ``beta2``, ``max_grad_norm``, ``data_path``); every
    other value is the trainer's default. The result depends only on the model, the global
    batch, the sequence length, the inputs, the steps and the settings, so it is computed once per
    process for each of those and handed out as copies."""
    key = json.dumps(
        [plan.model.spec, plan.model.sizes, plan.model.inputs, plan.global_batch, plan.seq_len, steps, settings],
        sort_keys=True,
        default=repr,
    )
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference_run(plan, steps, **settings)
    losses, params = _REFERENCES[key]
    return list(losses), {name: tensor.clone() for name, tensor in params.items()}


def _reference_run(plan: Plan, steps: int, **settings):
    o = TrainOptions(steps=steps, **settings)
    b = build_model(plan.model.spec, ModelSizes(**plan.model.sizes), seed=o.seed)
    model = b.model
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
    )
    specs = plan.model.inputs or LEGACY_INPUTS
    data = open_data(o.data_path, data_vocab(specs, b.vocab), plan.seq_len, o.seed)
    losses = []
    for step in range(steps):
        ids, labels = data.rows(step, 0, plan.global_batch, plan.global_batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o)
        opt.zero_grad()
        loss = model(*model_inputs(specs, ids, labels))
        loss.backward()
        if o.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def read_metrics(path) -> list[dict]:
    """The per-step lines of a metrics JSONL (event lines left out)."""
    return step_lines(read_lines(str(path)))


# ------------------------------------------------------------------ closed-form layer tables


def _row(index: int, name: str, kind: str, **costs) -> LayerCosts:
    """One row; the backward all-reduces what the forward does unless given."""
    costs.setdefault("tp_allreduce_bwd_bytes", costs.get("tp_allreduce_bytes", 0))
    return LayerCosts(index=index, name=name, kind=kind, **costs)


def gpt_table(
    layers=4,
    hidden=256,
    heads=4,
    vocab=8192,
    max_seq=2048,
    dtype_bytes=2,
    kv_heads=None,
    block_scale=None,
    tail_boundary=None,
    attention_core=False,
) -> LayerTable:
    """A GPT layer table in closed form; ``block_scale`` (list) makes blocks differ and
    ``tail_boundary`` scales what the last block hands the head (as in HF models, where blocks
    pass masks and positions along but the last block sends only the hidden state).
    ``attention_core`` gives the blocks a materialized attention core (Korthikanti et al.: the
    scores, softmax and dropout mask, ``5 a s^2 b`` bytes, and the ``4 b s^2 h`` FLOPs of its two
    products), which selective recompute can drop."""
    h, a, V, e = hidden, heads, vocab, dtype_bytes
    bsh = B * S * h
    rows = [
        _row(
            0,
            "embed",
            "pre",
            fwd_flops=2 * bsh,
            bwd_flops=2 * bsh,
            fwd_flops_tp=0,
            bwd_flops_tp=0,
            saved_bytes=8 * B * S,
            saved_bytes_tp=0,
            input_bytes=8 * B * S,
            boundary_bytes=e * bsh,
            tp_allreduce_bytes=e * bsh,
            param_count=V * h + max_seq * h,
            param_count_tp=V * h,
            peak_act_bytes=e * bsh,
        )
    ]
    for j in range(layers):
        k = 1 if block_scale is None else block_scale[j]
        mm = 24 * bsh * h + 4 * B * S * S * h
        rows.append(
            _row(
                j + 1,
                f"blocks.{j}",
                "block",
                fwd_flops=k * (mm + 20 * bsh),
                bwd_flops=k * 2 * (mm + 20 * bsh),
                fwd_flops_tp=k * mm,
                bwd_flops_tp=k * 2 * mm,
                saved_bytes=k * (34 * bsh + 5 * a * B * S * S),
                saved_bytes_tp=k * (24 * bsh + 5 * a * B * S * S),
                input_bytes=e * bsh,
                boundary_bytes=e * bsh,
                tp_allreduce_bytes=2 * e * bsh,
                param_count=k * (12 * h * h + 13 * h),
                param_count_tp=k * (12 * h * h + 7 * h),
                signature="blk",
                peak_act_bytes=e * bsh,
                peak_act_bytes_tp=k * 4 * e * bsh,
            )
        )
        if attention_core:
            core = dict(
                core_fwd_flops=k * 4 * B * S * S * h,
                core_fwd_flops_tp=k * 4 * B * S * S * h,
                core_fwd_bytes=0,
                core_fwd_bytes_tp=0,
                core_saved_bytes=k * 5 * a * B * S * S,
                core_saved_bytes_tp=k * 5 * a * B * S * S,
                core_num_ops=5,
            )
            rows[-1] = dataclasses.replace(rows[-1], **core)
    if tail_boundary is not None and layers:
        rows[-1].boundary_bytes = tail_boundary * e * bsh
    rows.append(
        _row(
            layers + 1,
            "head",
            "post",
            fwd_flops=2 * bsh * V,
            bwd_flops=4 * bsh * V,
            fwd_flops_tp=2 * bsh * V,
            bwd_flops_tp=4 * bsh * V,
            saved_bytes=4 * B * S * V + 2 * e * bsh,
            saved_bytes_tp=4 * B * S * V,
            input_bytes=e * bsh,
            boundary_bytes=4,
            tp_allreduce_bytes=12 * B * S,
            param_count=h * V + 2 * h,
            param_count_tp=h * V,
            peak_act_bytes=e * bsh,
            peak_act_bytes_tp=4 * B * S * V,
        )
    )
    params = sum(r.param_count for r in rows)
    return LayerTable(
        layers=rows,
        dtype="bfloat16",
        model=dict(spec="gpt", params=params, layers=layers, hidden=h, heads=a, kv_heads=kv_heads or a, vocab=V),
    )


def run_stages_in_process(folder: str, manifest: dict, state, inputs: dict):
    """Run a compiled pipeline's stages one after another in this process (weights from
    ``state``, data inputs by name from ``inputs``) and backward from the loss: (loss, stage modules)."""
    carry, mods = (), []
    for stage in manifest["stages"]:
        module = load_stage_module(folder, stage)
        load_weights(module, stage, state)
        out = module(*carry, *[inputs[name] for name in stage["data_inputs"]])
        carry = out if isinstance(out, tuple) else (out,)
        mods.append(module)
    carry[0].backward()
    return carry[0], mods
