"""ZeRO-Offload / ZeRO-Infinity in the engine, 2 gloo ranks: every offload placement equals the same
engine without offload (losses, parameters and optimizer state to rtol 1e-6), bf16 included, the
NVMe files are gone after ``close``, and the host tier is what the engine reports."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from runtime.data_parallel.offload_engine import OffloadConfig
from runtime.data_parallel.tied_weights import isolate_tied
from runtime.data_parallel.zero_engine import ParallelContext, ShardingConfig, ZeroEngine
from runtime.distributed.launch import launch_local
from tests.runtime.zero_harness import MAX_NORM, MICRO, OPT_CLIPPED, layer_groups, make_net, run_engine

STEPS = 3

#: (ZeRO stage, optimizer tier, params tier); each is compared with (stage, none, none).
CASES = [
    (1, "cpu", "none"),
    (1, "nvme", "none"),
    (2, "cpu", "none"),
    (2, "nvme", "none"),
    (3, "cpu", "none"),
    (3, "nvme", "none"),
    (3, "none", "cpu"),
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
]


def _run(
    stage: int, opt: str, params: str, rank: int, world: int, nvme: str, dtype=torch.float32, tied: bool = False
) -> dict:
    """``tied``: dp 1 on each rank, ``head.weight`` tied across the two ranks (as a weight two
    pipeline stages hold), its gradient summed over them and counted in the norm on rank 0."""
    net = make_net()
    dp_group, parallel = dist.group.WORLD, ParallelContext()
    if tied:
        dp_group = None
        parallel = ParallelContext(tied={"head.weight": (dist.group.WORLD, rank == 0)}, norm_groups=[dist.group.WORLD])
    engine = ZeroEngine(
        net,
        isolate_tied(layer_groups(net), {"head.weight": 0}) if tied else layer_groups(net),
        dp_group,
        sharding=ShardingConfig(zero_stage=stage, param_dtype=dtype, micro_batches_per_step=MICRO),
        optimizer=OPT_CLIPPED,
        parallel=parallel,
        offload=OffloadConfig(opt, params, nvme),
    )
    losses, infos = run_engine(engine, STEPS, rank, world)
    out = dict(
        losses=losses,
        norms=[i.grad_norm for i in infos],
        params=engine.full_state_dict(),
        state=engine.state_dict(),
        host_bytes=engine.host_bytes(),
        nvme_bytes=engine.nvme_bytes(),
        files=sorted(os.listdir(os.path.join(nvme, f"rank{rank}")))
        if os.path.isdir(os.path.join(nvme, f"rank{rank}"))
        else [],
    )
    engine.close()
    out["left"] = os.listdir(nvme)
    return out


def _worker(rank: int, world: int, out: str) -> None:
    nvme = os.path.join(out, "nvme")
    os.makedirs(nvme, exist_ok=True)
    open(os.path.join(nvme, "user-file.txt"), "w").close()  # something of the user's: must survive
    results = {}
    for stage in (1, 2, 3):
        results[(stage, "none", "none")] = _run(stage, "none", "none", rank, world, nvme)
    for case in CASES:
        results[case] = _run(*case, rank, world, nvme)
    for opt in ("none", "cpu"):
        results[("bf16", opt)] = _run(2, opt, "none", rank, world, nvme, dtype=torch.bfloat16)
        results[("fp16", opt)] = _run(2, opt, "none", rank, world, nvme, dtype=torch.float16)
    for opt in ("none", "cpu", "nvme"):
        results[("tied", opt)] = _run(1, opt, "none", rank, world, nvme, tied=True)
    torch.save(results, os.path.join(out, f"offload_{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("offload")
    launch_local(_worker, 2, args=(str(out),), timeout_s=180)
    return [torch.load(out / f"offload_{r}.pt", weights_only=False) for r in range(2)]


def _same(a, b):
    """Equal losses and parameters, to rtol 1e-6."""
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-6, atol=0)
    for name, t in b["params"].items():
        torch.testing.assert_close(a["params"][name], t, rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"zero{c[0]}-opt_{c[1]}-params_{c[2]}")
def test_offload_equals_resident(runs, case):
    for rank in range(2):
        got, ref = runs[rank][case], runs[rank][(case[0], "none", "none")]
        _same(got, ref)
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-6)
        assert max(ref["norms"]) > MAX_NORM  # clipping was active
        for key in ("master", "exp_avg", "exp_avg_sq"):
            for a, b in zip(got["state"][key], ref["state"][key]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_nvme_files_and_host_tier(runs):
    for rank in range(2):
        r = runs[rank]
        opt_nvme, both = r[(2, "nvme", "none")], r[(3, "nvme", "nvme")]
        assert [f.split("-")[0] for f in opt_nvme["files"]] == ["optimizer"]
        assert sorted(f.split("-")[0] for f in both["files"]) == ["optimizer", "params"]
        shard_numel = sum(t.numel() for t in r[(2, "none", "none")]["state"]["master"])
        assert opt_nvme["nvme_bytes"] == 3 * 4 * shard_numel  # masters + two moments, fp32
        assert both["nvme_bytes"] == 3 * 4 * shard_numel + 4 * shard_numel  # + the fp32 param shards
        # cpu tier: masters, moments and gradient shards on the host; nvme: gradients + 2 slots.
        assert r[(2, "cpu", "none")]["host_bytes"] == 4 * 4 * shard_numel
        assert 4 * shard_numel < opt_nvme["host_bytes"] < r[(2, "cpu", "none")]["host_bytes"]
        for res in r.values():  # close() removed this rank's files and folder, nothing of the user's
            assert "user-file.txt" in res["left"] and f"rank{rank}" not in res["left"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_offload_matches_resident(runs, dtype):
    for rank in range(2):
        got, ref = runs[rank][(dtype, "cpu")], runs[rank][(dtype, "none")]
        # The same fp32 gradient shards reach the same AdamW: the host tier changes where the
        # state lives, not the arithmetic (fp16 with its loss scaler).
        _same(got, ref)
        for a, b in zip(got["state"]["master"], ref["state"]["master"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        assert got["state"]["loss_scaler"] == ref["state"]["loss_scaler"]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_tied_weight_with_offload(runs, tier):
    for rank in range(2):
        _same(runs[rank][("tied", tier)], runs[rank][("tied", "none")])
    # The tied copies stay equal across the ranks that hold them.
    torch.testing.assert_close(
        runs[0][("tied", tier)]["params"]["head.weight"],
        runs[1][("tied", tier)]["params"]["head.weight"],
        rtol=0,
        atol=0,
    )
