"""1-bit Adam written out plainly in one process, as the reference the engine's runs are held to:
the compressed exchange of ``dp`` simulated ranks (``simulate_average``) and the whole training
loop of ``tests.runtime.zero_harness``'s net (``reference_onebit``): torch AdamW for the warm-up,
then each rank's own gradient into the momentum, the simulated exchange, the frozen variance."""

from __future__ import annotations

import math

import torch

from runtime.contract.compressed_exchange import BLOCK, exchange_numel
from runtime.data_parallel.onebit_adam import compress_, decode
from tests.runtime.zero_harness import BATCH, HP, MICRO, data, layer_groups, make_net


class SimulatedExchange:
    """The worker and server errors of ``dp`` simulated ranks for one vector of ``numel`` elements."""

    def __init__(self, numel: int, dp: int):
        self.dp, self.padded = dp, exchange_numel(numel, dp)
        self.chunk = self.padded // dp
        self.workers = [torch.zeros(self.padded) for _ in range(dp)]
        self.servers = [torch.zeros(self.chunk) for _ in range(dp)]

    def average(self, vectors: list[torch.Tensor]) -> torch.Tensor:
        """What every rank holds after the exchange of ``vectors`` (one per rank, ``padded`` long)."""
        compressed = [compress_(vector.clone(), error, BLOCK) for vector, error in zip(vectors, self.workers)]
        chunk_bytes, chunk_blocks = self.chunk // 8, self.chunk // BLOCK
        result = []
        for j in range(self.dp):
            pieces = [
                decode(
                    packed[j * chunk_bytes : (j + 1) * chunk_bytes], scales[j * chunk_blocks : (j + 1) * chunk_blocks]
                )
                for packed, scales in compressed
            ]
            mean = torch.stack(pieces).sum(dim=0).div_(self.dp)
            packed, scales = compress_(mean, self.servers[j], BLOCK)
            result.append(decode(packed, scales))
        return torch.cat(result)


def _flat(tensors: list[torch.Tensor], padded: int) -> torch.Tensor:
    out = torch.zeros(padded)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    out[: flat.numel()] = flat
    return out


def reference_onebit(steps: int, warmup: int, dp: int, max_norm: float | None):
    """Losses (mean over ranks) and final parameters of 1-bit Adam on the harness's net."""
    net = make_net()
    names = [name for group in layer_groups(net) for name in group]
    params = dict(net.named_parameters())
    ordered = [params[name] for name in names]
    opt = torch.optim.AdamW(net.parameters(), **HP)
    beta1, beta2 = HP["betas"]
    numel = sum(p.numel() for p in ordered)
    exchange = SimulatedExchange(numel, dp)
    losses = []
    per = BATCH // dp
    for step in range(steps):
        x, y = data(step)
        if step < warmup:  # full precision: the whole batch, torch's AdamW
            opt.zero_grad()
            loss = net(x, y)
            loss.backward()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
            opt.step()
            losses.append(loss.item())
            continue
        local_grads, local_losses = [], []
        for rank in range(dp):
            xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            micro = per // MICRO
            net.zero_grad()
            total = 0.0
            for i in range(MICRO):
                loss = net(xs[i * micro : (i + 1) * micro], ys[i * micro : (i + 1) * micro])
                (loss / MICRO).backward()
                total += loss.item() / MICRO
            local_grads.append(_flat([p.grad for p in ordered], exchange.padded))
            local_losses.append(total)
        losses.append(sum(local_losses) / dp)
        norm = math.sqrt(sum(float(torch.dot(g, g)) for g in local_grads) / dp)
        coefficient = 1.0 if max_norm is None else min(1.0, max_norm / (norm + 1e-6))
        momentum = _flat([opt.state[p]["exp_avg"] for p in ordered], exchange.padded)
        variance = _flat([opt.state[p]["exp_avg_sq"] for p in ordered], exchange.padded)
        averaged = exchange.average([momentum.mul(beta1).add_(g, alpha=(1 - beta1) * coefficient) for g in local_grads])
        with torch.no_grad():
            weights = _flat(ordered, exchange.padded)
            weights.mul_(1 - HP["lr"] * HP["weight_decay"])
            denominator = variance.sqrt().div_(math.sqrt(1 - beta2**warmup)).add_(HP["eps"])
            weights.addcdiv_(averaged, denominator, value=-HP["lr"] / (1 - beta1 ** (step + 1)))
            offset = 0
            for p in ordered:
                p.copy_(weights[offset : offset + p.numel()].view_as(p))
                opt.state[p]["exp_avg"].copy_(averaged[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
    return losses, {name: p.detach().clone() for name, p in net.named_parameters()}
