"""What overlapping the tensor-parallel collectives with the matmuls buys, on 2 gloo ranks.

A stack of ``--layers`` transformer-like blocks built from the runtime's functions (LayerNorm ->
``column_parallel_linears`` for q, k and v -> ``gelu(q) * k + v`` -> ``row_parallel_linear`` ->
LayerNorm -> column fc -> gelu -> row proj; no attention core, so the matmuls and collectives are
most of the step), fp32, batch x sequence x hidden ``--batch --seq --hidden``, ffn 4 x hidden, at
tp 2, without and with sequence parallelism, tensor-parallel overlap off and on
(``runtime.tensor_parallel.set_overlap``). The four settings alternate round by round in one
launch so a noisy machine slows each alike. Reported per setting: the median forward + backward
time, and the median time blocked in the tensor-parallel collectives (``comm.STATS.wait_s``, what
the step's ``tp_comm`` part measures), of rank 0. The bytes each setting counts are printed too:
overlap must not change them.

``python benchmarks/bench_tp_overlap.py [--layers 4 --batch 4 --seq 256 --hidden 512]
[--rounds 12] [--json out.json]``; importable as ``run_benchmark(BenchConfig())``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.distributed import comm
from runtime.distributed.launch import launch_local
from runtime.distributed.mesh import setup_mesh
from runtime.tensor_parallel import column_parallel_linears, row_parallel_linear, set_overlap, shard_dim

SETTINGS = [(sp, overlap) for sp in (False, True) for overlap in (False, True)]


@dataclass(frozen=True)
class BenchConfig:
    """The stack's sizes and how many timed rounds (each runs the four settings once)."""

    layers: int = 4
    batch: int = 4
    seq: int = 256
    hidden: int = 512
    rounds: int = 12


def _layers(count: int, hidden: int, rank: int, world: int) -> list[list[torch.Tensor]]:
    """Each layer's shards: q, k, v, attention out, fc, proj (with biases) and two norms."""
    torch.manual_seed(0)
    ffn, layers = 4 * hidden, []
    for _ in range(count):
        col = [shard_dim(torch.randn(o, hidden) / hidden**0.5, 0, rank, world) for o in (hidden,) * 3 + (ffn,)]
        col_b = [shard_dim(torch.zeros(w.shape[0] * world), 0, rank, world) for w in col]
        row = [shard_dim(torch.randn(hidden, i) / i**0.5, 1, rank, world) for i in (hidden, ffn)]
        params = col + col_b + row + [torch.zeros(hidden), torch.zeros(hidden), torch.ones(hidden), torch.ones(hidden)]
        layers.append([p.requires_grad_(True) for p in params])
    return layers


def _step(layers: list[list[torch.Tensor]], x: torch.Tensor, seq: int | None) -> None:
    """One forward and backward through the stack (the gradients accumulate; values do not matter)."""
    h = x
    for wq, wk, wv, wf, bq, bk, bv, bf, wo, wp, bo, bp, g1, g2 in layers:
        a = F.layer_norm(h, h.shape[-1:], g1)
        q, k, v = column_parallel_linears(a, [wq, wk, wv], [bq, bk, bv], sequence_dim=seq)
        h = h + row_parallel_linear(F.gelu(q) * k + v, wo, bo, sequence_dim=seq)
        m = column_parallel_linears(F.layer_norm(h, h.shape[-1:], g2), [wf], [bf], sequence_dim=seq)[0]
        h = h + row_parallel_linear(F.gelu(m), wp, bp, sequence_dim=seq)
    h.square().mean().backward()


def _worker(rank: int, world: int, cfg: dict, out: str) -> None:
    setup_mesh(1, 1, world)
    torch.set_num_threads(1)
    layers = _layers(cfg["layers"], cfg["hidden"], rank, world)
    full = torch.randn(cfg["batch"], cfg["seq"], cfg["hidden"], requires_grad=True)
    shard = shard_dim(full.detach(), 1, rank, world).requires_grad_(True)
    times: dict[str, dict[str, list]] = {f"sp={sp} overlap={ov}": {"step": [], "wait": []} for sp, ov in SETTINGS}
    sent: dict[str, dict] = {}
    for round_ in range(cfg["rounds"] + 1):  # round 0 warms up
        for sp, overlap in SETTINGS:
            set_overlap(overlap)
            comm.STATS.reset()
            started = time.perf_counter()
            _step(layers, shard if sp else full, 1 if sp else None)
            elapsed, key = time.perf_counter() - started, f"sp={sp} overlap={overlap}"
            sent[key] = dict(comm.STATS.bytes_by_kind)
            if round_:
                times[key]["step"].append(elapsed)
                times[key]["wait"].append(comm.STATS.wait_s)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "sent": sent}))


def run_benchmark(config: BenchConfig) -> dict:
    """Launch the 2 ranks and return ``{setting: {step_ms, tp_wait_ms, bytes}}`` of rank 0."""
    cfg = asdict(config)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        launch_local(_worker, 2, args=(cfg, out), timeout_s=600, collective_timeout_s=300)
        raw = json.loads(Path(out).read_text())
    return {
        key: {
            "step_ms": 1e3 * statistics.median(t["step"]),
            "tp_wait_ms": 1e3 * statistics.median(t["wait"]),
            "bytes": raw["sent"][key],
        }
        for key, t in raw["times"].items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(BenchConfig):
        ap.add_argument(f"--{f.name}", type=int, default=f.default)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    config = BenchConfig(**{f.name: getattr(args, f.name) for f in fields(BenchConfig)})
    result = run_benchmark(config)
    for key, r in result.items():
        print(f"{key:26s} step {r['step_ms']:8.1f} ms   blocked in tp collectives {r['tp_wait_ms']:7.1f} ms")
    for sp in (False, True):
        on, off = result[f"sp={sp} overlap=True"]["bytes"], result[f"sp={sp} overlap=False"]["bytes"]
        print(f"sp={sp}: bytes counted {'equal' if on == off else 'DIFFERENT'} with overlap on and off ({on})")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": asdict(config), "result": result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
