"""The NVMe tier frees resident memory: the same ~17M-parameter run (ZeRO-2, one process, fp32) with
its optimizer state in memory and on the NVMe tier, each in its own process reading its
resident-memory high-water mark (``VmHWM``), loses what moved to files, within 10%.

What should go: the AdamW moments (``8 P`` bytes; in fp32 the master of a resident run is a view of
the parameters, so the file's masters free nothing), less the two transfer slots the NVMe tier
keeps in memory. The gradient shard is held in both runs (on the device, or in host memory).

The module is also the script each measurement runs: ``python -m tests.runtime.test_offload_memory
TIER [NVME_DIR]`` prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from runtime.data_parallel.offload_engine import OffloadConfig
from runtime.data_parallel.zero_engine import OptimizerConfig, ShardingConfig, ZeroEngine
from tests.helpers import ROOT

pytestmark = pytest.mark.dist  # each measurement runs in its own process

WIDTH, DEPTH, STEPS = 1024, 16, 1


def vm_hwm() -> int:
    """This process's peak resident set size in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_hwm() -> None:
    """Restart ``VmHWM`` from the current resident size (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def measure(tier: str, nvme_path: str | None) -> dict:
    """Train ``STEPS`` steps with the optimizer state on ``tier``; what the engine and the OS say."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    engine = ZeroEngine(
        net,
        None,
        sharding=ShardingConfig(zero_stage=2, micro_batches_per_step=1),
        optimizer=OptimizerConfig(lr=1e-3),
        offload=OffloadConfig(optimizer=tier, nvme_path=nvme_path),
    )
    x = torch.randn(4, WIDTH)
    reset_hwm()  # measure training, not the set-up (where the module's own weights meet the flat buffer)
    seconds = 0.0
    for _ in range(STEPS):
        t = time.perf_counter()
        net(x).square().mean().backward()
        engine.step()
        engine.zero_grad()
        seconds = time.perf_counter() - t
    slots = sum(t.untyped_storage().nbytes() for t in engine.host_tensors()) - 4 * sum(g.shard for g in engine.groups)
    out = {
        "vm_hwm": vm_hwm(),
        "nvme_bytes": engine.nvme_bytes(),
        "slot_bytes": slots if tier == "nvme" else 0,
        "params": sum(p.numel() for p in net.parameters()),
        "step_s": seconds,
    }
    engine.close()
    return out


def _start(*args: str) -> subprocess.Popen:
    # Every allocation of 64 KiB or more gets its own mapping, returned to the system when freed, so
    # the resident size follows the live tensors (glibc's heap would keep freed blocks resident).
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.test_offload_memory", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_nvme_tier_frees_the_optimizer_state(tmp_path):
    runs = _start("none"), _start("nvme", str(tmp_path))  # side by side: each reads its own peak
    resident, nvme = (_result(p) for p in runs)
    params = resident["params"]
    assert nvme["nvme_bytes"] >= 12 * params  # masters and both moments are in the file
    expected = 8 * params - nvme["slot_bytes"]
    saved = resident["vm_hwm"] - nvme["vm_hwm"]
    print(
        f"VmHWM resident {resident['vm_hwm'] / 2**20:.1f} MiB, nvme {nvme['vm_hwm'] / 2**20:.1f} MiB: "
        f"saved {saved / 2**20:.1f} MiB, expected {expected / 2**20:.1f} MiB"
    )
    assert abs(saved - expected) <= 0.1 * expected
    assert os.listdir(tmp_path) == []  # the files and the rank folder are gone


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)))
