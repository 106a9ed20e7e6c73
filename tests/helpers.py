"""Shared test utilities: hand-built plans and the single-process training reference."""

from __future__ import annotations

import json

import torch

from planner.frontend.zoo import build_model
from planner.plan import MEMORY_KEYS, SCHEMA_VERSION, TIME_KEYS, Plan, save_plan
from runtime.config import TrainOptions
from runtime.data import open_data
from runtime.trainer import lr_at

TINY_GPT = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16}
TINY_LLAMA = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 64, "seq_len": 16}


def even_stages(layers: int, pp: int) -> list[list[int]]:
    """``pp`` contiguous ``[first, last]`` ranges of equal size over the L + 2 layer-table rows."""
    rows = layers + 2
    cuts = [round(i * rows / pp) for i in range(pp + 1)]
    return [[cuts[i], cuts[i + 1] - 1] for i in range(pp)]


def manual_plan(spec: str, sizes: dict, *, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0,
                mbs: int = 1, m: int = 1, dtype: str = "fp32", checkpoint=(), stages=None,
                hardware: str = "cpu", seq_len: int | None = None) -> Plan:
    """A plan whose decisions are given by hand and that predicts nothing (every predicted
    number is 0): a fixed layout for tests and benchmarks, valid for ``compile`` and ``train``.
    ``sizes`` must contain ``layers``; ``seq_len`` defaults to ``sizes['seq_len']`` (else 16)."""
    sizes = dict(sizes)
    n = dp * tp * pp
    zero_mem = {k: 0 for k in MEMORY_KEYS}
    return Plan.from_dict({
        "schema_version": SCHEMA_VERSION,
        "model": {"spec": spec, "params": 0, "layers": sizes["layers"], "flops_per_step": 0.0,
                  "sizes": sizes, "layer_names": []},
        "hardware": {"name": hardware, "gpus": n, "gpus_per_node": n},
        "global_batch": mbs * m * dp, "seq_len": seq_len or sizes.get("seq_len", 16), "dtype": dtype,
        "dp": dp, "tp": tp, "pp": pp, "zero_stage": zero, "micro_batch_size": mbs, "num_micro_batches": m,
        "stages": stages if stages is not None else even_stages(sizes["layers"], pp),
        "checkpoint_layers": list(checkpoint),
        "predicted": {"step_time_s": 0.0, "peak_memory_bytes": 0, "tflops_per_device": 0.0, "mfu": 0.0,
                      "comm_bytes_per_device": 0.0, "bubble_fraction": 0.0, "memory": zero_mem,
                      "time": {k: 0.0 for k in TIME_KEYS}},
        "solver": {"name": "manual", "seconds": 0.0, "status": "given", "candidates": 1},
        "alternatives": [],
    })


def make_plan(spec: str = "gpt", sizes: dict | None = None, *, mbs=2, m=2, **decisions) -> Plan:
    """A hand-made plan (``manual_plan``) of a tiny model, 2 micro-batches of 2."""
    return manual_plan(spec, sizes or TINY_GPT, mbs=mbs, m=m, **decisions)


def write_plan(path, plan: Plan) -> str:
    save_plan(plan, str(path))
    return str(path)


def reference_run(plan: Plan, steps: int, **settings):
    """Single process, plain torch AdamW on the whole global batch: (losses, final params).

    ``settings`` override ``TrainOptions`` fields (``seed``, ``lr``, ``min_lr``, ``warmup_steps``,
    ``weight_decay``, ``eps``, ``beta1``, ``beta2``, ``max_grad_norm``, ``data_path``); every
    other value is the trainer's default."""
    o = TrainOptions(steps=steps, **settings)
    b = build_model(plan.model.spec, seed=o.seed, **plan.model.sizes)
    model = b.model
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    data = open_data(o.data_path, b.vocab, plan.seq_len, o.seed)
    losses = []
    for step in range(steps):
        ids, labels = data.rows(step, 0, plan.global_batch, plan.global_batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o)
        opt.zero_grad()
        loss = model(ids, labels)
        loss.backward()
        if o.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def read_metrics(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(ln) for ln in f if ln.strip()]
