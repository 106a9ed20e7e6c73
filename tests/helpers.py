"""Shared test utilities: hand-built plans and the single-process training reference."""

from __future__ import annotations

import json

import torch

from planner.plan import Plan, save_plan

TINY_GPT = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16}
TINY_LLAMA = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 64, "seq_len": 16}


def make_plan(spec: str = "gpt", sizes: dict | None = None, *, dp=1, tp=1, pp=1, zero=0, mbs=2, m=2,
              dtype="fp32", checkpoint=(), stages=None) -> Plan:
    """A valid plan with placeholder predictions (the runtime ignores them)."""
    sizes = dict(sizes or TINY_GPT)
    L = sizes["layers"]
    if stages is None:
        if pp == 1:
            stages = [[0, L + 1]]
        else:
            cuts = [round(i * (L + 2) / pp) for i in range(pp + 1)]
            stages = [[cuts[i], cuts[i + 1] - 1] for i in range(pp)]
    d = {
        "schema_version": 1,
        "model": {"spec": spec, "params": 1, "layers": L, "flops_per_step": 1.0, "sizes": sizes,
                  "layer_names": []},
        "hardware": {"name": "cpu", "gpus": dp * tp * pp, "gpus_per_node": dp * tp * pp},
        "global_batch": mbs * m * dp, "seq_len": sizes.get("seq_len", 16), "dtype": dtype,
        "dp": dp, "tp": tp, "pp": pp, "zero_stage": zero, "micro_batch_size": mbs, "num_micro_batches": m,
        "stages": stages, "checkpoint_layers": list(checkpoint),
        "predicted": {"step_time_s": 0.5, "peak_memory_bytes": 100, "tflops_per_device": 0.1, "mfu": 0.2,
                      "comm_bytes_per_device": 10.0, "bubble_fraction": 0.0,
                      "memory": {"params": 10, "grads": 10, "optimizer": 30, "activations": 50, "total": 100},
                      "time": {"compute": 0.3, "recompute": 0.0, "tp_comm": 0.0, "pp_bubble": 0.0,
                               "dp_comm": 0.0, "optimizer": 0.0}},
        "solver": {"name": "hand", "seconds": 0.0, "status": "Optimal", "candidates": 1},
        "alternatives": [],
    }
    return Plan.from_dict(d)


def write_plan(path, plan: Plan) -> str:
    save_plan(plan, str(path))
    return str(path)


def reference_run(plan: Plan, steps: int, *, seed=0, lr=3e-4, min_lr=3e-5, weight_decay=0.1, clip=1.0,
                  data_path=None, eps=1e-8):
    """Single process, plain torch AdamW on the whole global batch: (losses, final params)."""
    from planner.models import build_model
    from runtime.data import open_data
    from runtime.trainer import TrainOptions, lr_at

    b = build_model(plan.model.spec, seed=seed, **plan.model.sizes)
    model = b.model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=eps, weight_decay=weight_decay)
    opts = TrainOptions(steps=steps, lr=lr, min_lr=min_lr)
    data = open_data(data_path, b.vocab, plan.seq_len, seed)
    losses = []
    for step in range(steps):
        ids, labels = data.rows(step, 0, plan.global_batch, plan.global_batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, opts)
        opt.zero_grad()
        loss = model(ids, labels)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def read_metrics(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(ln) for ln in f if ln.strip()]
