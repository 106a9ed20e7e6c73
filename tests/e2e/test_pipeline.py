"""The 1F1B executor over gloo against a single-process reference (losses, gradients, bytes, errors)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from runtime.contract.schedule_ir import gpipe, one_f_one_b
from runtime.distributed import comm
from runtime.distributed.launch import launch_local
from runtime.distributed.mesh import setup_mesh
from runtime.pipeline.executor import META_ROW, PipelineError, PipelineStage
from tests.runtime.pipeline_harness import MB, RECV_META, H, StageModule, T, make_data, make_layers, reference


def split(num_layers: int, pp: int) -> list[tuple[int, int]]:
    per = num_layers // pp
    return [(s * per, num_layers if s == pp - 1 else (s + 1) * per) for s in range(pp)]


def stage_inputs(s: int, pp: int, data):
    if s == 0:
        return [(x, mask) for x, mask, _ in data]
    if s == pp - 1:
        return [(y,) for _, _, y in data]
    return [() for _ in data]


def _pp_worker(rank, world, num_blocks, m, out_dir):
    torch.manual_seed(0)
    mesh = setup_mesh(world, 1, 1)
    s = mesh.pp_index
    lo, hi = split(num_blocks + 2, world)[s]
    module = StageModule(make_layers(num_blocks), lo, hi)
    stage = PipelineStage.from_mesh(module, recv_meta=RECV_META if s > 0 else ())
    data = make_data(m)
    comm.STATS.reset()
    loss_a = stage.run(one_f_one_b(world, m)[s], stage_inputs(s, world, data))
    sent_a = dict(comm.STATS.bytes_by_kind)
    grads_a = module.named_grads()
    # No zeroing: GPipe with loss_scale 2 accumulates 2x the gradient on top.
    loss_b = stage.run(gpipe(world, m)[s], stage_inputs(s, world, data), loss_scale=2.0)
    torch.save(
        {"loss_a": loss_a, "loss_b": loss_b, "sent_a": sent_a, "grads_a": grads_a, "grads_b": module.named_grads()},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


@pytest.mark.dist
@pytest.mark.parametrize("pp, num_blocks, m", [(2, 2, 4), (4, 6, 6)])
def test_pipeline_matches_single_process(tmp_path, pp, num_blocks, m):
    launch_local(_pp_worker, pp, (num_blocks, m, str(tmp_path)), timeout_s=120, collective_timeout_s=30)
    ref_loss, ref_grads = reference(num_blocks, make_data(m))
    seen = set()
    for r in range(pp):
        got = torch.load(tmp_path / f"rank{r}.pt")
        # Every stage returns the (broadcast) mean loss, unscaled.
        torch.testing.assert_close(got["loss_a"], ref_loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["loss_b"], ref_loss, rtol=1e-6, atol=1e-7)
        for name, g in got["grads_a"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["grads_b"][name], 3 * ref_grads[name], rtol=1e-5, atol=1e-6)
            seen.add(name)
        # Exact bytes: activations (fp32 hidden + int64 mask) forward, fp32 hidden-grad backward,
        # one pre-flight all-reduce of the stage table, one 8-byte loss broadcast.
        act, mask, grad = MB * T * H * 4, MB * T * 8, MB * T * H * 4
        sends = m * ((act + mask if r < pp - 1 else 0) + (grad if r > 0 else 0))
        assert got["sent_a"].get("send", 0) == sends
        assert got["sent_a"]["all_reduce"] == pytest.approx(2 * (pp - 1) / pp * pp * META_ROW * 8)
        assert got["sent_a"]["broadcast"] == pytest.approx((pp - 1) / pp * 8)
    assert seen == set(ref_grads)  # every parameter lives on exactly one stage and was checked


def _error_worker(rank, world, out_dir):
    setup_mesh(world, 1, 1)
    s = rank
    module = StageModule(make_layers(2), *split(4, world)[s])
    stage = PipelineStage.from_mesh(module, recv_meta=RECV_META if s > 0 else ())
    msgs = {}
    cases = {
        # Micro-batch 2 holds 3 samples instead of 2: stage 0's inputs and stage 1's labels differ.
        "shapes": [
            d if i != 2 else tuple(t.repeat(2, *[1] * (t.dim() - 1))[:3] for t in d) for i, d in enumerate(make_data(4))
        ],
        "few": make_data(1),
    }
    for name, data in cases.items():
        t0 = time.monotonic()
        try:
            stage.run(one_f_one_b(world, len(data), strict=False)[s], stage_inputs(s, world, data))
            msgs[name] = "no error"
        except PipelineError as e:
            msgs[name] = str(e)
        msgs[name + "_s"] = time.monotonic() - t0
    msgs["sent"] = comm.STATS.bytes_by_kind.get("send", 0)
    # The group is still in step after refused runs: a good run succeeds.
    msgs["ok_loss"] = stage.run(one_f_one_b(world, 4)[s], stage_inputs(s, world, make_data(4)))
    # A stage whose output does not match its successor's recv_meta fails before sending it.
    bad = PipelineStage.from_mesh(module, recv_meta=[((MB, T, H + 1), torch.float32), RECV_META[1]] if s > 0 else ())
    try:
        bad.run(one_f_one_b(world, 4)[s], stage_inputs(s, world, make_data(4)))
        msgs["meta"] = "no error"
    except PipelineError as e:
        msgs["meta"] = str(e)
    except Exception as e:  # the receiver: its peer gave up, it must not hang
        msgs["meta"] = f"{type(e).__name__}: {e}"
    torch.save(msgs, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.dist
def test_pipeline_refuses_bad_input_on_every_rank(tmp_path):
    t0 = time.monotonic()
    launch_local(_error_worker, 2, (str(tmp_path),), timeout_s=60, collective_timeout_s=8)
    assert time.monotonic() - t0 < 60
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for got in (r0, r1):
        assert "pipeline refused to start (nothing was sent)" in got["shapes"]
        assert "stage 0" in got["shapes"] and "stage 1" in got["shapes"]
        assert "1 micro-batch for 2 stages" in got["few"]
        assert got["shapes_s"] < 5 and got["few_s"] < 5  # raised at once, not by a timeout
        assert got["sent"] == 0
    # The rank that found the problem gives details; the other names the stage and micro-batch.
    assert "input 0 of micro-batch 2 is (3, 3, 5) float32 but micro-batch 0's is (2, 3, 5) float32" in r0["shapes"]
    assert "stage 0: input 0 of micro-batch 2 differs in shape or dtype" in r1["shapes"]
    assert r0["ok_loss"] == r1["ok_loss"] == pytest.approx(reference(2, make_data(4))[0], rel=1e-6)
    assert (
        "stage 0 output 0 for micro-batch 0 is (2, 3, 8) float32 but stage 1's recv_meta expects (2, 3, 9) float32"
        in r0["meta"]
    )
    assert r1["meta"] != "no error"
