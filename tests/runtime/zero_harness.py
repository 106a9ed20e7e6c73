"""The ZeRO engine's test harness: a small residual MLP, its data, the single-process AdamW
reference and a loop that drives the engine the way the trainer does. Shared by the in-process
tests (``tests/runtime/test_zero.py``) and the gloo runs (``tests/e2e/test_zero.py``)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from runtime.data_parallel.zero_engine import OptimizerConfig, ZeroEngine

IN, H, BLOCKS = 8, 32, 3
BATCH, MICRO = 16, 2  # global batch; micro-batches per rank per step
STEPS = 6
# eps 1e-6, not 1e-8: Adam divides by sqrt(v) + eps, so for an element whose gradient is ~1e-8
# rounding differences of 1e-7 (summation order of dp-averaged vs full-batch gradients) grow into
# 1e-5 parameter differences. Plain torch emulating dp 2 shows the same with eps 1e-8.
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
MAX_NORM = 0.5
OPT = OptimizerConfig(**HP)
"""The engine's form of ``HP``."""
OPT_CLIPPED = OptimizerConfig(**HP, max_grad_norm=MAX_NORM)
"""``OPT`` clipping the gradient norm to ``MAX_NORM``."""


class Block(nn.Module):
    def __init__(self, h: int, ckpt: bool = False):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 2 * h)
        self.fc2 = nn.Linear(2 * h, h)
        self.ckpt = ckpt

    def _f(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))

    def forward(self, x):
        if self.ckpt and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._f, x, use_reentrant=False)
        return self._f(x)


class Net(nn.Module):
    """A tiny transformer-ish MLP stack: input projection, pre-norm residual blocks, scalar head."""

    def __init__(self, h: int = H, blocks: int = BLOCKS, ckpt: bool = False):
        super().__init__()
        self.inp = nn.Linear(IN, h)
        self.blocks = nn.ModuleList([Block(h, ckpt) for _ in range(blocks)])
        self.head = nn.Linear(h, 1)

    def forward(self, x, y):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return ((self.head(x).squeeze(-1) - y.to(x.dtype)) ** 2).mean()


def make_net(seed: int = 0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def layer_groups(net: Net) -> list[list[str]]:
    names = [n for n, _ in net.named_parameters()]
    groups = [[n for n in names if n.startswith("inp.")]]
    groups += [[n for n in names if n.startswith(f"blocks.{i}.")] for i in range(len(net.blocks))]
    return groups + [[n for n in names if n.startswith("head.")]]


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, generator=g)


def reference(steps: int = STEPS, h: int = H, blocks: int = BLOCKS, max_norm=MAX_NORM):
    """Plain torch: full batch, AdamW, clip_grad_norm_. Returns (losses, final params by name)."""
    net = make_net(h=h, blocks=blocks)
    opt = torch.optim.AdamW(net.parameters(), **HP)
    losses = []
    for s in range(steps):
        x, y = data(s)
        opt.zero_grad()
        loss = net(x, y)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def run_engine(engine: ZeroEngine, steps, rank: int, world: int, start: int = 0, no_sync: bool = False):
    """Train: this rank's slice of each global batch in MICRO micro-batches; rank-mean losses.

    ``no_sync``: all but the last micro-batch's backward run inside ``engine.no_sync()``."""
    losses, infos = [], []
    per = BATCH // world
    for s in range(start, start + steps):
        x, y = data(s)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        mb = per // MICRO
        total = 0.0
        for i in range(MICRO):
            ctx = engine.no_sync() if no_sync and i < MICRO - 1 else contextlib.nullcontext()
            with ctx:
                loss = engine.module(x[i * mb : (i + 1) * mb], y[i * mb : (i + 1) * mb])
                engine.scale_loss(loss / MICRO).backward()
            total += loss.item() / MICRO
        infos.append(engine.step())
        engine.last_memory = engine.memory_report()  # held during the step, before zero_grad frees
        engine.zero_grad()
        losses.append(total)
    return losses, infos
