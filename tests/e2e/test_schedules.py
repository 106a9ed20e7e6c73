"""Interleaved 1F1B and ZB-H1 over gloo against a single-process reference (losses, gradients),
ZB-H1 under the ZeRO engine, whose gradient hooks must fire when ``W`` runs, not at ``B``, and
the engine's reductions per step at dp2: with the engine as the stage's backward scope a split
``B``/``W`` schedule reduces exactly as often as 1F1B (without it, every ``W`` call was a pass)."""

from __future__ import annotations

import os

import pytest
import torch

import runtime.pipeline.executor as pipeline
from runtime.contract.schedule_ir import interleaved_one_f_one_b, one_f_one_b, zero_bubble_h1
from runtime.data_parallel.zero_engine import OptimizerConfig, ShardingConfig, ZeroEngine
from runtime.distributed import comm
from runtime.distributed.launch import launch_local
from runtime.distributed.mesh import get_mesh, setup_mesh
from runtime.pipeline.executor import PipelineStage
from tests.runtime.pipeline_harness import RECV_META, StageModule, make_data, make_layers, reference

M = 4  # micro-batches
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
OPT = OptimizerConfig(**HP)


def chunk_bounds(num_layers: int, chunks: int) -> list[tuple[int, int]]:
    per = num_layers // chunks
    return [(c * per, num_layers if c == chunks - 1 else (c + 1) * per) for c in range(chunks)]


def chunk_inputs(c: int, chunks: int, d) -> tuple:
    """Model chunk ``c``'s own inputs for one micro-batch ``d = (x, mask, y)``."""
    return (d[0], d[1]) if c == 0 else (d[2],) if c == chunks - 1 else ()


def _interleaved(rank: int, p: int, v: int, blocks: int) -> dict:
    bounds = chunk_bounds(blocks + 2, p * v)
    mine = [rank + j * p for j in range(v)]
    modules = [StageModule(make_layers(blocks), *bounds[c]) for c in mine]
    stage = PipelineStage.from_mesh(modules, [RECV_META if c > 0 else () for c in mine], virtual_stages=v)
    data = make_data(M)
    loss = stage.run(interleaved_one_f_one_b(p, M, v)[rank], [[chunk_inputs(c, p * v, d) for c in mine] for d in data])
    grads = {k: g for mod in modules for k, g in mod.named_grads().items()}
    return dict(loss=loss, grads=grads)


def _zb_stage(rank: int, p: int, blocks: int) -> tuple[StageModule, PipelineStage, list]:
    lo, hi = chunk_bounds(blocks + 2, p)[rank]
    module = StageModule(make_layers(blocks), lo, hi)
    stage = PipelineStage.from_mesh(module, recv_meta=RECV_META if rank > 0 else ())
    return module, stage, [chunk_inputs(rank, p, d) for d in make_data(M)]


def _zero_bubble(rank: int, p: int, blocks: int) -> dict:
    module, stage, inputs = _zb_stage(rank, p, blocks)
    loss = stage.run(zero_bubble_h1(p, M)[rank], inputs)
    return dict(loss=loss, grads=module.named_grads())


def _zero_bubble_with_zero(rank: int, p: int, blocks: int) -> dict:
    """ZB-H1 with a ZeRO-1 engine (dp 1) around each stage: record whether every gradient hook
    fired inside a ``W``; then one optimizer step."""
    module, stage, inputs = _zb_stage(rank, p, blocks)
    engine = ZeroEngine(module, sharding=ShardingConfig(zero_stage=1, micro_batches_per_step=M), optimizer=OPT)
    in_w, fired = [False], []
    real_w = pipeline.backward_weight

    def traced_w(work, prepare=None):
        in_w[0] = True
        try:
            real_w(work, prepare)
        finally:
            in_w[0] = False

    for prm in module.parameters():
        prm.register_post_accumulate_grad_hook(lambda _p: fired.append(in_w[0]))
    pipeline.backward_weight = traced_w
    try:
        loss = stage.run(zero_bubble_h1(p, M)[rank], inputs)
    finally:
        pipeline.backward_weight = real_w
    grads = module.named_grads()
    flat = all(
        prm.grad.untyped_storage().data_ptr() == g.grad_full.untyped_storage().data_ptr()
        for g in engine.groups
        for prm in (e.param for e in g.entries)
    )
    engine.step()
    params = {
        f"{module.lo + k}.{n}": prm.detach().clone()
        for k, lay in enumerate(module.layers)
        for n, prm in lay.named_parameters()
    }
    return dict(loss=loss, grads=grads, fired=fired, flat=flat, params=params)


#: (schedule, engine as the backward scope) of the reduction counts
VARIANTS = {"1f1b": (one_f_one_b, True), "zb": (zero_bubble_h1, True), "zb-unscoped": (zero_bubble_h1, False)}


def _global_names(params: dict, bounds: list[tuple[int, int]], chunks: list[int]) -> dict:
    """``full_state_dict`` names (``layers.k.x``, or ``j.layers.k.x`` over model chunks) as
    ``<model layer>.x``, so that runs cut differently compare."""
    out = {}
    for name, p in params.items():
        parts = name.split(".")
        j = int(parts.pop(0)) if len(chunks) > 1 else 0
        out[".".join([str(bounds[chunks[j]][0] + int(parts[1]))] + parts[2:])] = p
    return out


def _overlap_runs(zero_stage: int) -> dict:
    """One step of this rank's part of a pp2 x dp2 mesh under 1F1B, ZB-H1 and interleaved (v 2)
    with ``overlap`` on and off (the engine as the backward scope): parameters by model layer,
    the engine's counters, and when each reduction launch happened (``(where, counted passes so
    far, root)``)."""
    out = {}
    mesh = get_mesh()
    s = mesh.pp_index
    for name, v in (("1f1b", 1), ("zb", 1), ("interleaved", 2)):
        for overlap in (True, False):
            torch.manual_seed(0)
            bounds = chunk_bounds(4, 2 * v)
            mine = [s + j * 2 for j in range(v)]
            modules = [StageModule(make_layers(2), *bounds[c]) for c in mine]
            module = modules[0] if v == 1 else torch.nn.ModuleList(modules)
            engine = ZeroEngine(
                module,
                dp_group=mesh.dp_group,
                sharding=ShardingConfig(zero_stage=zero_stage, micro_batches_per_step=M * v, overlap=overlap),
                optimizer=OPT,
                roots=None if v == 1 else [str(j) for j in range(v)],
            )
            launches: list = []
            real_launch = engine._launch

            def logged(where, only_ready, root=None, engine=engine, real_launch=real_launch, launches=launches):
                before = engine.counters[where]
                real_launch(where, only_ready, root)
                if engine.counters[where] > before:
                    launches.append((where, engine._backwards, root))

            engine._launch = logged  # type: ignore[method-assign]
            stage = PipelineStage.from_mesh(
                modules[0] if v == 1 else modules,
                recv_meta=(RECV_META if s > 0 else ()) if v == 1 else [RECV_META if c > 0 else () for c in mine],
                virtual_stages=v,
                backward_scope=engine,
                overlap=overlap,
            )
            sched = {"1f1b": one_f_one_b(2, M), "zb": zero_bubble_h1(2, M), "interleaved": None}[name]
            actions = interleaved_one_f_one_b(2, M, v)[s] if sched is None else sched[s]
            inputs = [
                chunk_inputs(mine[0], 2 * v, d) if v == 1 else [chunk_inputs(c, 2 * v, d) for c in mine]
                for d in make_data(M)
            ]
            loss = stage.run(actions, inputs)
            engine.step()
            out[(name, overlap)] = dict(
                loss=loss,
                params=_global_names(engine.full_state_dict(), bounds, mine),
                counters=dict(engine.counters),
                buckets=len(engine._reducer.buckets),
                launches=launches,
            )
            engine.close()
    return out


def _reductions(zero_stage: int) -> dict:
    """One step of this rank's stage of a pp2 x dp2 mesh per variant: the collectives it issued (by
    kind) and its parameters after the step."""
    out = {}
    for name, (sched, scoped) in VARIANTS.items():
        if zero_stage == 3 and not scoped:
            continue  # ZeRO-3's W needs the scope, which gathers its weights (else PipelineError)
        torch.manual_seed(0)
        mesh = get_mesh()
        s = mesh.pp_index
        module = StageModule(make_layers(2), *chunk_bounds(4, 2)[s])
        engine = ZeroEngine(
            module,
            dp_group=mesh.dp_group,
            sharding=ShardingConfig(zero_stage=zero_stage, micro_batches_per_step=M),
            optimizer=OPT,
        )
        stage = PipelineStage.from_mesh(
            module, recv_meta=RECV_META if s > 0 else (), backward_scope=engine if scoped else None
        )
        comm.STATS.reset()
        stage.run(sched(2, M)[s], [chunk_inputs(s, 2, d) for d in make_data(M)])
        engine.step()
        out[name] = dict(
            calls=dict(comm.STATS.calls_by_kind),
            params=engine.full_state_dict(),
            regathers=M * len(engine.groups) if s > 0 else 0,
        )
        engine.close()
    return out


def _reduction_worker(rank: int, world: int, out_dir: str) -> None:
    setup_mesh(2, 2, 1)
    results = {z: _reductions(z) for z in (1, 2, 3)}
    results.update({("overlap", z): _overlap_runs(z) for z in (0, 1, 2, 3)})
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _worker(rank: int, world: int, out_dir: str) -> None:
    torch.manual_seed(0)
    setup_mesh(world, 1, 1)
    res = {
        "interleaved": _interleaved(rank, world, 2, 6),
        "zb": _zero_bubble(rank, world, 2),
        "zb_zero": _zero_bubble_with_zero(rank, world, 2),
    }

    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("schedules")
    launch_local(_worker, 2, (str(out),), timeout_s=120, collective_timeout_s=30)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _check(runs, case: str, blocks: int) -> None:
    ref_loss, ref_grads = reference(blocks, make_data(M))
    seen = set()
    for got in runs:
        torch.testing.assert_close(got[case]["loss"], ref_loss, rtol=1e-6, atol=1e-7)
        for name, g in got[case]["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6)
            seen.add(name)
    assert seen == set(ref_grads)  # every parameter lives in exactly one chunk and was checked


@pytest.mark.dist
def test_interleaved_pp2_v2_matches_single_process(runs):
    _check(runs, "interleaved", 6)


@pytest.mark.dist
def test_zero_bubble_pp2_matches_single_process(runs):
    _check(runs, "zb", 2)


@pytest.mark.dist
def test_zero_bubble_under_zero_engine_hooks_fire_at_w(runs):
    _check(runs, "zb_zero", 2)
    for got in runs:
        assert got["zb_zero"]["fired"] and all(got["zb_zero"]["fired"])  # every hook inside a W
        assert got["zb_zero"]["flat"]  # the engine took each gradient into its flat buffer
    # One AdamW step on the reference gradients gives the engine's parameters.
    full = StageModule(make_layers(2), 0, 4)
    _, ref_grads = reference(2, make_data(M))
    opt = torch.optim.AdamW(full.parameters(), **HP)
    for k, lay in enumerate(full.layers):
        for n, prm in lay.named_parameters():
            prm.grad = ref_grads[f"{k}.{n}"]
    opt.step()
    want = {f"{k}.{n}": prm.detach() for k, lay in enumerate(full.layers) for n, prm in lay.named_parameters()}
    for got in runs:
        for name, prm in got["zb_zero"]["params"].items():
            torch.testing.assert_close(prm, want[name], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def reductions(tmp_path_factory):
    out = tmp_path_factory.mktemp("reductions")
    launch_local(_reduction_worker, 4, (str(out),), timeout_s=120, collective_timeout_s=30)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.mark.dist
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_split_backward_reduces_as_often_as_one_f_one_b(reductions, zero_stage):
    """ZeRO-1: one all-reduce per bucket per step (+ the norm's); ZeRO-2/3: one reduce-scatter per
    group per micro-batch. ZB-H1 with the engine as backward scope issues exactly 1F1B's
    collectives and reaches the same parameters; without the scope each W call was a pass (ZeRO-1
    reduced mid-W and again in step(), ZeRO-2 issued 20 reduce-scatters instead of 8). ZeRO-3
    gathers each group once more per micro-batch where B and W are apart (runtime.data_parallel.zero3_lifetime)."""
    for got in reductions:
        red = got[zero_stage]
        calls = {name: dict(r["calls"]) for name, r in red.items()}
        calls["zb"]["all_gather"] -= red["zb"]["regathers"] if zero_stage == 3 else 0
        assert calls["zb"] == calls["1f1b"], calls
        if zero_stage < 3 and red["zb"]["regathers"]:  # a stage whose B and W are apart (not the first)
            kind = "all_reduce" if zero_stage == 1 else "reduce_scatter"
            assert calls["zb-unscoped"][kind] > calls["1f1b"][kind], calls
        for name, p in red["1f1b"]["params"].items():
            torch.testing.assert_close(red["zb"]["params"][name], p, rtol=1e-6, atol=1e-7)


def _union(runs, zero_stage: int, key) -> dict:
    """The whole model's parameters after the step: every pp rank's (dp rank 0's copy)."""
    out = {}
    for got in runs[::2]:  # ranks 0 and 2: dp rank 0 of pp ranks 0 and 1 (mesh order pp, dp, tp)
        out.update(got[("overlap", zero_stage)][key]["params"])
    return out


@pytest.mark.dist
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_schedules_overlap_reductions_with_backward_and_match_overlap_off(reductions, zero_stage):
    """pp2 x dp2, one step of 1F1B, ZB-H1 and interleaved (v 2), overlap on and off: the same loss
    and parameters, bit for bit, whatever the schedule (and 1F1B's). With overlap every bucket's
    reduction is launched from a gradient hook while backward runs (ZB-H1: in the W passes), none
    at a pass's end or in step(); off, none from a hook. Interleaved ZeRO 0/1 reduces each chunk in
    its own last pass: the chunk whose backward ends first launches before the step's last pass."""
    runs = reductions
    reference = _union(runs, zero_stage, ("1f1b", True))
    for name in ("1f1b", "zb", "interleaved"):
        on, off = _union(runs, zero_stage, (name, True)), _union(runs, zero_stage, (name, False))
        assert on.keys() == reference.keys() == off.keys()
        for n, p in reference.items():
            torch.testing.assert_close(on[n], p, rtol=1e-6, atol=1e-7)
            assert torch.equal(on[n], off[n]), (name, n)
        for got in runs:
            r_on, r_off = got[("overlap", zero_stage)][(name, True)], got[("overlap", zero_stage)][(name, False)]
            assert r_on["loss"] == r_off["loss"]
            c_on, c_off = r_on["counters"], r_off["counters"]
            passes = M * (2 if name == "interleaved" else 1)
            expected = r_on["buckets"] * (1 if zero_stage < 2 else M)  # 2/3: each chunk's M passes
            assert c_on["reduced_in_backward"] == expected, (name, c_on)
            assert c_on["reduced_at_backward_end"] == c_on["reduced_in_step"] == 0, (name, c_on)
            assert c_off["reduced_in_backward"] == 0
            if zero_stage == 3:  # gathers ahead of use in forward, backward and W; none off
                # (an interleaved chunk here is one layer, one group: prefetch stays inside a chunk)
                assert c_on["prefetches"] > 0 or name == "interleaved"
                assert c_off["prefetches"] == 0
            assert c_off["reduced_at_backward_end"] + c_off["reduced_in_step"] == expected
            if name == "interleaved" and zero_stage < 2:
                assert {root for _, _, root in r_on["launches"]} == {0, 1}
                assert min(count for _, count, _ in r_on["launches"]) < passes
