"""Shared test utilities: hand-built plans and the single-process training reference."""

from __future__ import annotations

import json

import torch

from planner.plan import Plan, manual_plan, save_plan

TINY_GPT = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16}
TINY_LLAMA = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 64, "seq_len": 16}


def make_plan(spec: str = "gpt", sizes: dict | None = None, *, mbs=2, m=2, **decisions) -> Plan:
    """A hand-made plan (``planner.plan.manual_plan``) of a tiny model, 2 micro-batches of 2."""
    return manual_plan(spec, sizes or TINY_GPT, mbs=mbs, m=m, **decisions)


def write_plan(path, plan: Plan) -> str:
    save_plan(plan, str(path))
    return str(path)


def reference_run(plan: Plan, steps: int, *, seed=0, lr=3e-4, min_lr=3e-5, weight_decay=0.1, clip=1.0,
                  data_path=None, eps=1e-8):
    """Single process, plain torch AdamW on the whole global batch: (losses, final params)."""
    from planner.frontend.zoo import build_model
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
