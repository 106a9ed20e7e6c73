"""ZeRO 0-3 over gloo against a single-process AdamW reference: losses, parameters, bytes, memory, resharding."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from runtime.data_parallel.flat_shards import consolidate_shards, padded_numel
from runtime.data_parallel.precision import DynamicLossScaler
from runtime.data_parallel.zero_engine import OptimizerConfig, ParallelContext, ShardingConfig, ZeroEngine
from runtime.distributed import comm
from runtime.distributed.launch import launch_local
from tests.runtime.zero_harness import (
    BATCH,
    MAX_NORM,
    MICRO,
    OPT_CLIPPED,
    STEPS,
    data,
    layer_groups,
    make_net,
    reference,
    run_engine,
)

BUCKET = 20_000  # bytes: a bucket never exceeds it: [head, b2], [b1], [b0, inp]


# ---------------------------------------------------------------------------- multi-process
#: "2ns": stage 2 with no_sync on the first micro-batch; "<z>off": stage z with overlap off
FP32_CASES = (0, 1, 2, 3, "2ns", "0off", "1off", "2off", "3off")


def _fp32_worker(rank: int, world: int, out: str) -> None:
    results = {}
    for stage in FP32_CASES:
        net = make_net()
        zero_stage = int(str(stage)[0])
        engine = ZeroEngine(
            net,
            layer_groups(net),
            dp_group=dist.group.WORLD,
            sharding=ShardingConfig(
                zero_stage=zero_stage,
                bucket_bytes=BUCKET,
                micro_batches_per_step=MICRO if zero_stage == 1 else None,  # stage 1: reduce from hooks
                overlap="off" not in str(stage),
            ),
            optimizer=OPT_CLIPPED,
        )
        comm.STATS.reset()
        losses, infos = run_engine(engine, STEPS, rank, world, no_sync=stage == "2ns")
        stats = (dict(comm.STATS.bytes_by_kind), dict(comm.STATS.calls_by_kind))
        in_flight = engine.gathers_in_flight  # the last step's parameter gathers (ZeRO 1/2, overlap on)
        sd = engine.state_dict()  # what a checkpoint save reads: it must wait for them first
        results[stage] = dict(
            in_flight=(in_flight, engine.gathers_in_flight),
            # ZeRO-3 releases the parameters' storage between passes: nothing to read there
            module_params={n: p.detach().clone() for n, p in net.named_parameters()} if zero_stage < 3 else {},
            losses=losses,
            norms=[i.grad_norm for i in infos],
            params=engine.full_state_dict(),
            memory=engine.last_memory,
            memory_after_zero_grad=engine.memory_report(),
            stats=stats,
            state=sd,
            counters=dict(engine.counters),
        )
    torch.save(results, f"{out}/fp32_{rank}.pt")


def _mixed_worker(rank: int, world: int, out: str) -> None:
    results = {}
    # fp16 at stage 2: at steps 1 and 2 rank 1 adds inf to the gradient of head.bias, whose
    # element lies in rank 1's shard only, so rank 0's own gradients stay finite; growth after 3
    # good steps.
    net = make_net()
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    engine = ZeroEngine(
        net,
        layer_groups(net),
        dp_group=dist.group.WORLD,
        sharding=ShardingConfig(zero_stage=2, param_dtype=torch.float16),
        optimizer=replace(OPT_CLIPPED, loss_scaler=scaler),
    )
    inject = {"on": False}
    net.head.bias.register_hook(lambda g: g + float("inf") if inject["on"] else g)
    snaps, infos, local_bad = [], [], []
    per, mb = BATCH // world, BATCH // world // MICRO
    for s in range(7):
        x, y = data(s)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        inject["on"] = rank == 1 and s in (1, 2)
        for i in range(MICRO):
            loss = engine.module(x[i * mb : (i + 1) * mb], y[i * mb : (i + 1) * mb])
            engine.scale_loss(loss / MICRO).backward()
        local_bad.append(any(not torch.isfinite(g.grad_shard).all() for g in engine.groups))
        infos.append(engine.step())
        engine.zero_grad()
        snaps.append(engine.full_state_dict())
    results["fp16"] = dict(
        infos=[(i.skipped, i.loss_scale, i.grad_norm) for i in infos], snaps=snaps, local_bad=local_bad
    )
    for stage in (0, 3):
        net = make_net()
        engine = ZeroEngine(
            net,
            layer_groups(net),
            dp_group=dist.group.WORLD,
            sharding=ShardingConfig(zero_stage=stage, param_dtype=torch.bfloat16, bucket_bytes=BUCKET),
            optimizer=OPT_CLIPPED,
        )
        losses, _ = run_engine(engine, STEPS, rank, world)
        results[f"bf16_{stage}"] = dict(losses=losses, params=engine.full_state_dict())
    results["norm"] = _norm_group_case(rank)
    torch.save(results, f"{out}/mixed_{rank}.pt")


class _TpShard(nn.Module):
    """One 'tensor-parallel' rank's part: its own slice ``w`` and a replicated ``ln`` weight."""

    def __init__(self, rank: int):
        super().__init__()
        self.w = nn.Parameter(torch.full((3,), float(rank + 1)))
        self.ln = nn.Parameter(torch.ones(2))

    def forward(self, c_w, c_ln):
        return (self.w * c_w).sum() + (self.ln * c_ln).sum()  # gradients are exactly c_w, c_ln


def _norm_group_case(rank: int) -> dict:
    """dp 1, the world as a tp group: the norm sums both ranks' slices and counts ``ln`` once."""
    mod = _TpShard(rank)
    engine = ZeroEngine(
        mod,
        None,
        sharding=ShardingConfig(zero_stage=0),
        optimizer=OptimizerConfig(lr=0.1, betas=(0.0, 0.0), eps=1e-12, max_grad_norm=1.0),
        parallel=ParallelContext(
            norm_groups=[dist.group.WORLD],
            replicated_param_filter=lambda n: n == "ln",
            replicated_group=dist.group.WORLD,
        ),
    )
    c_w = torch.tensor([3.0, 0.0, 4.0]) * (rank + 1)  # |c_w| = 5 and 10
    engine.module(c_w, torch.tensor([2.0, 0.0])).backward()  # the same ln gradient on both ranks
    info = engine.step()
    return dict(norm=info.grad_norm, w=mod.w.detach().clone(), ln=mod.ln.detach().clone())


def _worker(rank: int, world: int, out: str) -> None:
    """Everything multi-process in one launch (spawning processes dominates the test time)."""
    _fp32_worker(rank, world, out)
    _mixed_worker(rank, world, out)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero")
    launch_local(_worker, 2, args=(str(out),), timeout_s=150)
    return out


@pytest.fixture(scope="module")
def fp32_runs(runs_dir):
    return [torch.load(runs_dir / f"fp32_{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def mixed_runs(runs_dir):
    return [torch.load(runs_dir / f"mixed_{r}.pt", weights_only=False) for r in range(2)]


def _padded_bytes(world: int = 2) -> int:
    """Bytes of all flat buffers, each layer padded to a multiple of dp (fp32)."""
    net = make_net()
    return 4 * sum(padded_numel(sum(net.get_parameter(n).numel() for n in g), world) for g in layer_groups(net))


@pytest.mark.parametrize("stage", FP32_CASES)
def test_dp2_matches_single_process(fp32_runs, stage):
    ref_losses, ref_params = reference()
    r0, r1 = fp32_runs[0][stage], fp32_runs[1][stage]
    losses = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-7)
    assert r0["norms"] == r1["norms"]  # every rank sees the same global norm
    assert max(r0["norms"]) > MAX_NORM  # clipping was active
    for r in (r0, r1):
        assert r["params"].keys() == ref_params.keys()
        for n, p in ref_params.items():
            torch.testing.assert_close(r["params"][n], p, rtol=1e-5, atol=1e-6, msg=f"stage {stage} {n}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3, "2ns"])
def test_comm_bytes_follow_ring_formula(fp32_runs, stage):
    """Bytes per kind for STEPS steps at dp 2 (ring: all-reduce = size, gather/scatter = size/2)."""
    pb = _padded_bytes()
    norm = 16  # one fp64 [sum of squares, overflow flag] all-reduce per step
    per_step = {
        0: {"all_reduce": pb + norm},
        1: {"all_reduce": pb + norm, "all_gather": pb / 2},
        2: {"reduce_scatter": MICRO * pb / 2, "all_reduce": norm, "all_gather": pb / 2},
        # forward and backward gather every layer for each micro-batch
        3: {"all_gather": 2 * MICRO * pb / 2, "reduce_scatter": MICRO * pb / 2, "all_reduce": norm},
        "2ns": {"reduce_scatter": pb / 2, "all_reduce": norm, "all_gather": pb / 2},
    }[stage]
    buckets, groups = 3, 5  # stages 2/3 reduce-scatter each group (layer) on its own
    calls = {
        0: {"all_reduce": buckets + 1},
        1: {"all_reduce": buckets + 1, "all_gather": groups},
        2: {"reduce_scatter": MICRO * groups, "all_reduce": 1, "all_gather": groups},
        3: {"all_gather": 2 * MICRO * groups, "reduce_scatter": MICRO * groups, "all_reduce": 1},
        "2ns": {"reduce_scatter": groups, "all_reduce": 1, "all_gather": groups},
    }[stage]
    for run in fp32_runs:
        sent, n = run[stage]["stats"]
        assert sent == {k: STEPS * v for k, v in per_step.items()}
        assert n == {k: STEPS * v for k, v in calls.items()}


def test_reductions_overlap_backward(fp32_runs):
    """Stage 0 without micro_batches_per_step reduces in step(); the others from gradient hooks."""
    for run in fp32_runs:
        c = {s: r["counters"] for s, r in run.items()}
        nb, ng = 3, 5  # buckets (see BUCKET) of stages 0/1; groups, each its own bucket, of 2/3
        assert c[0]["reduced_in_step"] == nb * STEPS and c[0]["reduced_in_backward"] == 0
        assert c[1]["reduced_in_backward"] == nb * STEPS and c[1]["reduced_in_step"] == 0
        assert c["2ns"]["reduced_in_backward"] == ng * STEPS
        for s in (2, 3):
            assert c[s]["reduced_in_backward"] == ng * MICRO * STEPS
            assert c[s]["reduced_in_step"] == c[s]["reduced_at_backward_end"] == 0
        # every gather is issued ahead of use but the first of forward and the first of backward
        assert c[3]["prefetches"] == STEPS * MICRO * (2 * 5 - 2)
        assert c[2]["prefetches"] == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_off_is_the_same_run_waited_at_once(fp32_runs, stage):
    """Overlap changes when collectives are waited, never what they compute: overlap off gives
    bit-identical losses, norms and parameters, with the same collectives and bytes. Off, no
    reduction is launched from a gradient hook (each pass's are launched and waited at its end,
    stage 0 without micro_batches_per_step in step()), ZeRO-3 prefetches nothing, and the ZeRO 1/2
    parameter gathers are waited inside step()."""
    for run in fp32_runs:
        on, off = run[stage], run[f"{stage}off"]
        assert on["losses"] == off["losses"] and on["norms"] == off["norms"]
        for n, p in on["params"].items():
            assert torch.equal(p, off["params"][n]), n
        assert on["stats"] == off["stats"]
        c = off["counters"]
        assert c["reduced_in_backward"] == 0 and c["prefetches"] == 0 and c["params_waited_at_use"] == 0
        assert off["in_flight"] == (0, 0)
        nb, ng = 3, 5
        ends = {0: 0, 1: nb * STEPS, 2: ng * MICRO * STEPS, 3: ng * MICRO * STEPS}[stage]
        assert c["reduced_at_backward_end"] == ends and c["reduced_in_step"] == (nb * STEPS if stage == 0 else 0)


@pytest.mark.parametrize("stage", [1, 2])
def test_param_gathers_wait_at_first_use_and_before_a_checkpoint_reads(fp32_runs, stage):
    """ZeRO 1/2 with overlap: step() leaves one all-gather per group in flight; the next forward
    waits each at its group's first use (STEPS - 1 steps' worth), and the last step's are waited
    by state_dict() (a checkpoint save) before it reads anything: after it, nothing is in flight
    and the module's parameters are the gathered ones."""
    groups = 5
    for run in fp32_runs:
        r = run[stage]
        c = r["counters"]
        assert r["in_flight"] == (groups, 0)
        assert c["params_waited_at_use"] == groups * (STEPS - 1)
        assert c["params_waited_early"] == groups
        for n, p in r["params"].items():
            assert torch.equal(r["module_params"][n], p), n


def test_zero3_memory_matches_formula(fp32_runs):
    psi = sum(p.numel() for p in make_net().parameters())
    for run in fp32_runs:
        mem = run[3]["memory"]
        for key, expect in (("params", 4 * psi / 2), ("grads", 4 * psi / 2), ("optimizer", 8 * psi / 2)):
            assert abs(mem[key] - expect) / expect < 0.03, (key, mem[key], expect)
        assert run[3]["memory_after_zero_grad"]["grads"] == 0  # shards are released between steps
    mem0 = fp32_runs[0][0]["memory"]  # stage 0 keeps everything
    assert mem0["params"] >= 4 * psi and mem0["optimizer"] >= 8 * psi


def test_reshard_dp2_zero3_to_dp1_and_continue(fp32_runs):
    """Consolidate the dp-2 ZeRO-3 shards, load them at dp 1 (ZeRO 1) and train on: same as torch."""
    full = consolidate_shards([run[3]["state"] for run in fp32_runs])
    assert full["step"] == STEPS and full["num_shards"] == 1
    net = make_net()
    engine = ZeroEngine(net, layer_groups(net), sharding=ShardingConfig(zero_stage=1), optimizer=OPT_CLIPPED)
    engine.load_state_dict(full)
    losses, _ = run_engine(engine, 2, 0, 1, start=STEPS)
    ref_losses, ref_params = reference(STEPS + 2)
    torch.testing.assert_close(losses, ref_losses[STEPS:], rtol=1e-5, atol=1e-7)
    for n, p in engine.full_state_dict().items():
        torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-6)


def test_fp16_overflow_skips_on_every_rank(mixed_runs):
    r0, r1 = mixed_runs[0]["fp16"], mixed_runs[1]["fp16"]
    # only rank 1 holds a non-finite gradient; rank 0 learns it from the all-reduced flag
    assert r0["local_bad"] == [False] * 7
    assert r1["local_bad"] == [False, True, True, False, False, False, False]
    assert [i[:2] for i in r0["infos"]] == [i[:2] for i in r1["infos"]]
    skipped = [i[0] for i in r0["infos"]]
    scales = [i[1] for i in r0["infos"]]
    assert skipped == [False, True, True, False, False, False, False]
    # hysteresis 2: the first overflow keeps the scale, the second halves it; 3 good steps double it
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
    assert math.isinf(r0["infos"][1][2]) or math.isnan(r0["infos"][1][2])
    for s in (1, 2):  # skipped steps leave every parameter untouched, on both ranks
        for r in (r0, r1):
            for n, p in r["snaps"][s].items():
                assert torch.equal(p, r["snaps"][0][n]), n
    assert not torch.equal(r0["snaps"][3]["head.weight"], r0["snaps"][0]["head.weight"])


def test_bf16_trains_close_to_fp32(mixed_runs):
    ref_losses, ref_params = reference()
    for stage in (0, 3):
        runs = [m[f"bf16_{stage}"] for m in mixed_runs]
        losses = [(a + b) / 2 for a, b in zip(runs[0]["losses"], runs[1]["losses"])]
        torch.testing.assert_close(losses, ref_losses, rtol=3e-2, atol=3e-2)
        for n, p in ref_params.items():
            torch.testing.assert_close(runs[0]["params"][n], p, rtol=0, atol=3e-2)
            assert torch.equal(runs[0]["params"][n], runs[1]["params"][n])


def test_norm_over_tensor_parallel_group_counts_replicated_once(mixed_runs):
    expect = math.sqrt(5**2 + 10**2 + 2**2)
    for rank, run in enumerate(mixed_runs):
        assert run["norm"]["norm"] == pytest.approx(expect, rel=1e-12)
        # betas 0, eps ~0: AdamW moves every element with a nonzero gradient by exactly lr
        w0 = torch.full((3,), float(rank + 1))
        torch.testing.assert_close(run["norm"]["w"], w0 - 0.1 * torch.tensor([1.0, 0.0, 1.0]))
    assert torch.equal(mixed_runs[0]["norm"]["ln"], mixed_runs[1]["norm"]["ln"])
