"""The pipeline executor's test harness: a tiny embedding / blocks / head model cut into stage
modules, its micro-batches and the single-process reference. Shared by the in-process tests
(``tests/runtime/test_pipeline.py``) and the gloo runs (``tests/e2e/test_pipeline.py``)."""

from __future__ import annotations

import torch
import torch.nn as nn

IN, H, OUT, T, MB = 5, 8, 4, 3, 2  # input, hidden, output widths; tokens; micro-batch size
SEED = 1234


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(IN, H)

    def forward(self, x, mask):
        return self.proj(x), mask


class Block(nn.Module):
    """Pre-norm residual MLP; the integer ``mask`` zeroes the update of padded tokens."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, 2 * H)
        self.fc2 = nn.Linear(2 * H, H)

    def forward(self, h, mask):
        upd = self.fc2(nn.functional.gelu(self.fc1(self.norm(h))))
        return h + upd * mask.unsqueeze(-1).to(h.dtype), mask


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.out = nn.Linear(H, OUT)

    def forward(self, h, mask, y):
        err = (self.out(self.norm(h)) - y) ** 2 * mask.unsqueeze(-1).to(h.dtype)
        return err.sum() / (mask.sum() * OUT)


def make_layers(num_blocks: int) -> list[nn.Module]:
    torch.manual_seed(SEED)
    return [Embed()] + [Block() for _ in range(num_blocks)] + [Head()]


class StageModule(nn.Module):
    """Layers ``lo .. hi-1`` of the full model; the head's stage returns the loss."""

    def __init__(self, layers: list[nn.Module], lo: int, hi: int):
        super().__init__()
        self.lo = lo
        self.layers = nn.ModuleList(layers[lo:hi])
        self.has_head = isinstance(self.layers[-1], Head)

    def forward(self, *args):
        if self.has_head:
            *args, y = args
        h, mask = args
        for layer in self.layers[:-1] if self.has_head else self.layers:
            h, mask = layer(h, mask)
        return self.layers[-1](h, mask, y) if self.has_head else (h, mask)

    def named_grads(self) -> dict[str, torch.Tensor]:
        return {
            f"{self.lo + k}.{n}": p.grad.clone() for k, l in enumerate(self.layers) for n, p in l.named_parameters()
        }


def make_data(m: int, seed: int = 7, mb: int = MB):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, mb, T, IN, generator=g)
    mask = (torch.rand(m, mb, T, generator=g) > 0.3).long()
    mask[:, :, 0] = 1
    y = torch.randn(m, mb, T, OUT, generator=g)
    return [(x[i], mask[i], y[i]) for i in range(m)]


def reference(num_blocks: int, data) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, whole model: mean of micro-batch losses and its parameter gradients."""
    full = StageModule(make_layers(num_blocks), 0, num_blocks + 2)
    losses = [full(*d) for d in data]
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.item(), full.named_grads()


RECV_META = [((MB, T, H), torch.float32), ((MB, T), torch.int64, False)]
