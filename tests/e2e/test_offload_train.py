"""The trainer with offloaded state: a two-stage pipeline plan (ZeRO-1 in each stage) with its
optimizer on the host equals the same plan without offload, and checkpoints resume across offload
settings (saved offloaded and resumed resident; saved resident and resumed on the NVMe tier) with
the losses of the uninterrupted resident run. One launch of 2 gloo ranks runs every configuration
through ``runtime.training.trainer.train_worker`` (what ``planner train`` runs on each rank), from one
compiled plan whose manifest is copied with each ``offload`` setting."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from planner.cli import build_parser, main
from planner.commands.compile import compile_plan
from planner.commands.train import original_state, train_options_from_args
from runtime.checkpointing.checkpoint_io import list_checkpoints
from runtime.distributed.launch import launch_local
from runtime.training.train_config import TrainOptions
from runtime.training.trainer import train_worker
from tests.helpers import TINY_GPT, make_plan, write_plan

STEPS = 4


def _compiled_variants(plan, root: str) -> dict[str, str]:
    """The plan compiled once, and a copy per optimizer tier with ``offload`` set in its manifest."""
    base = os.path.join(root, "none")
    compile_plan(plan, base)
    dirs = {"none": base}
    for tier in ("cpu", "nvme"):
        d = os.path.join(root, tier)
        shutil.copytree(base, d)
        path = os.path.join(d, "manifest.json")
        with open(path, encoding="utf-8") as f:
            man = json.load(f)
        man["plan"]["offload"] = {"optimizer": tier, "params": "none"}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(man, f)
        dirs[tier] = d
    return dirs


def _worker(rank: int, world: int, root: str, dirs: dict[str, str], model: tuple) -> None:
    def state():
        return original_state(*model, 0)

    def train(tier: str, steps: int, track_memory: bool = False, **kw) -> list[dict]:
        # A constant learning rate (a floor above the peak is lowered to it): a run of 2 steps and
        # its resumption to 4 follow the schedule of one run of 4.
        opts = TrainOptions(
            steps=steps,
            lr=1e-3,
            min_lr=1.0,
            timeout_s=60,
            progress=False,
            track_memory=track_memory,
            memory_steps=1,
            **kw,
        )
        return [dataclasses.asdict(m) for m in train_worker(rank, world, dirs[tier], opts, state)]

    ck = {k: os.path.join(root, f"ck_{k}") for k in ("resident", "cpu", "nvme")}
    out = {"resident": train("none", STEPS, True, checkpoint_dir=ck["resident"], save_every=2)}
    out["cpu"] = train("cpu", 2, True, checkpoint_dir=ck["cpu"], save_every=2)
    out["cpu_resumed_resident"] = train("none", STEPS, checkpoint_dir=ck["cpu"], resume=True)
    if rank == 0:  # the resident run's step-2 checkpoint, alone in a folder
        step2 = dict(list_checkpoints(ck["resident"]))[2]
        shutil.copytree(step2, os.path.join(ck["nvme"], os.path.basename(step2)))
    dist.barrier()
    nvme = os.path.join(root, "nvme_tier")
    out["resident_resumed_nvme"] = train("nvme", STEPS, checkpoint_dir=ck["nvme"], resume=True, nvme_path=nvme)
    dist.barrier()  # every rank has closed its tier (each deletes its own folder) before we look
    out["nvme_left"] = os.listdir(nvme)
    if rank == 0:
        torch.save(out, os.path.join(root, "runs.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload_train")
    plan = make_plan("gpt", dict(TINY_GPT), pp=2, zero=1, mbs=2, m=2)
    dirs = _compiled_variants(plan, str(root))
    launch_local(
        _worker, 2, args=(str(root), dirs, (plan.model.spec, dict(plan.model.sizes), plan.seq_len)), timeout_s=240
    )
    return torch.load(root / "runs.pt", weights_only=False)


def _losses(rows: list[dict]) -> torch.Tensor:
    return torch.tensor([m["loss"] for m in rows], dtype=torch.float64)


def test_pipeline_with_optimizer_offload_equals_resident(runs):
    ref, got = runs["resident"], runs["cpu"]
    torch.testing.assert_close(_losses(got), _losses(ref[:2]), rtol=1e-6, atol=0)
    for g, r in zip(got, ref):
        # Moments and gradient shards are host memory now: device memory falls, the host tier is
        # reported apart.
        assert g["host_memory_bytes"] > 0 and r["host_memory_bytes"] == 0
        assert g["peak_memory_bytes"] < r["peak_memory_bytes"]
        assert g["nvme_bytes"] == 0 and g["time"]["offload"] >= 0


def test_offloaded_checkpoint_resumes_resident(runs):
    rows = runs["cpu_resumed_resident"]
    assert [m["step"] for m in rows] == [3, 4]
    torch.testing.assert_close(_losses(rows), _losses(runs["resident"][2:]), rtol=1e-6, atol=0)


def test_resident_checkpoint_resumes_on_the_nvme_tier(runs):
    rows = runs["resident_resumed_nvme"]
    assert [m["step"] for m in rows] == [3, 4]
    torch.testing.assert_close(_losses(rows), _losses(runs["resident"][2:]), rtol=1e-6, atol=0)
    assert all(m["nvme_bytes"] > 0 for m in rows)
    assert runs["nvme_left"] == []  # each rank deleted its files and folder at the end


def test_offload_flags_reach_the_options():
    args = build_parser().parse_args(
        ["train", "plan.json", "--steps", "1", "--nvme-path", "/fast/disk", "--delayed-update"]
    )
    opts = train_options_from_args(args)
    assert (opts.nvme_path, opts.delayed_update) == ("/fast/disk", True)
    plain = train_options_from_args(build_parser().parse_args(["train", "plan.json", "--steps", "1"]))
    assert (plain.nvme_path, plain.delayed_update) == (None, False)


@pytest.mark.parametrize(
    "offload, flags, message",
    [
        ({"optimizer": "nvme", "params": "none"}, [], "--nvme-path DIR"),
        ({"optimizer": "none", "params": "none"}, ["--delayed-update"], "--offload-optimizer cpu|nvme"),
    ],
)
def test_train_refuses_offload_settings_it_cannot_run_before_any_process_starts(
    tmp_path, capsys, offload, flags, message
):
    plan = dataclasses.replace(make_plan(zero=1), offload=offload)
    path = write_plan(tmp_path / "plan.json", plan)
    rc = main(["train", path, "--nproc", "1", "--steps", "1", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "plan.compiled").exists()  # refused before compiling
