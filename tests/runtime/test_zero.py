"""The ZeRO engine in one process: AdamW against torch, parameter freeing, state shards, loss scaling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.data_parallel.flat_shards import FREE, consolidate_shards, padded_numel, slice_shard
from runtime.data_parallel.precision import DynamicLossScaler
from runtime.data_parallel.zero_engine import OptimizerConfig, ShardingConfig, ZeroEngine, ZeroError
from runtime.pipeline.executor import backward_input, backward_weight
from tests.runtime.zero_harness import OPT, OPT_CLIPPED, data, layer_groups, make_net, reference, run_engine


# ---------------------------------------------------------------------------- single process
@settings(max_examples=8, deadline=None)
@given(
    stage=st.integers(0, 3),
    h=st.sampled_from([4, 6, 12]),
    blocks=st.integers(1, 3),
    bucket=st.sampled_from([1, 600, 10**8]),
    ckpt=st.booleans(),
    grouped=st.booleans(),
    prefetch=st.booleans(),
)
@example(stage=3, h=6, blocks=2, bucket=600, ckpt=True, grouped=True, prefetch=True)
@example(stage=3, h=4, blocks=3, bucket=1, ckpt=False, grouped=False, prefetch=False)
@example(stage=2, h=4, blocks=3, bucket=1, ckpt=True, grouped=False, prefetch=True)
def test_dp1_matches_torch_for_any_shape(stage, h, blocks, bucket, ckpt, grouped, prefetch):
    """dp 1, any stage, shapes, buckets, checkpointing, grouping and prefetch: equal to torch."""
    steps = 3
    ref_losses, ref_params = reference(steps, h=h, blocks=blocks)
    net = make_net(h=h, blocks=blocks, ckpt=ckpt)
    engine = ZeroEngine(
        net,
        layer_groups(net) if grouped else None,
        sharding=ShardingConfig(zero_stage=stage, bucket_bytes=bucket, prefetch=prefetch),
        optimizer=OPT_CLIPPED,
    )
    losses, _ = run_engine(engine, steps, 0, 1)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-7)
    for n, p in engine.full_state_dict().items():
        torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-6)


def test_zero3_frees_parameters_outside_forward_and_backward():
    net = make_net()
    engine = ZeroEngine(net, layer_groups(net), sharding=ShardingConfig(zero_stage=3), optimizer=OPT)
    sizes = lambda: [p.untyped_storage().nbytes() for p in net.parameters()]  # noqa: E731
    assert set(sizes()) == {0}
    seen = []
    net.blocks[1].register_forward_hook(lambda m, a, o: seen.append(sorted(set(sizes()))))
    x, y = data(0)
    engine.module(x, y).backward()
    assert set(sizes()) == {0}
    assert seen and seen[0] != [0]  # the block's own parameters were materialized during forward
    assert all(p.grad is None for p in net.parameters())  # gradients live in the fp32 shards
    assert engine.memory_report()["params"] == 4 * sum(p.numel() for p in net.parameters())


def test_state_shards_roundtrip():
    t = {
        "format": "planner.zero/1",
        "zero_stage": 2,
        "num_shards": 1,
        "shard_index": 0,
        "step": 3,
        "groups": [{"names": ["a"], "shapes": [[5]], "numel": 5}, {"names": ["b"], "shapes": [[2]], "numel": 2}],
    }
    for k in ("master", "exp_avg", "exp_avg_sq"):
        t[k] = [torch.arange(5.0) + 1, torch.tensor([7.0, 8.0])]
    for n in (1, 2, 3, 4, 7):
        shards = [slice_shard(t, n, i) for i in range(n)]
        assert all(s["master"][0].numel() == padded_numel(5, n) // n for s in shards)
        back = consolidate_shards(shards[::-1])
        for k in ("master", "exp_avg", "exp_avg_sq"):
            for a, b in zip(back[k], t[k]):
                assert torch.equal(a, b)
    with pytest.raises(ValueError, match="exactly one state per shard index"):
        consolidate_shards([slice_shard(t, 3, 0), slice_shard(t, 3, 2)])
    with pytest.raises(ValueError, match="consolidate_shards first"):
        slice_shard(slice_shard(t, 2, 0), 2, 1)


def test_loss_scaler_rules():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0)
    trace = []
    for overflow in [True, True, True, True, False, False, True, False]:
        s.update(overflow)
        trace.append(s.scale)
    # 1st overflow absorbed; then halve (floor 2); 2 good steps double and refill hysteresis;
    # the next overflow is absorbed again.
    assert trace == [8.0, 4.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0]
    d = DynamicLossScaler()
    assert (d.scale, d.growth_factor, d.backoff_factor, d.growth_interval, d.hysteresis, d.min_scale) == (
        2.0**16,
        2.0,
        0.5,
        1000,
        2,
        1.0,
    )
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)


def test_layer_group_errors():
    net = make_net()
    g = layer_groups(net)
    with pytest.raises(ZeroError, match="not a parameter"):
        ZeroEngine(make_net(), g[:-1] + [g[-1] + ["head.nope"]])
    with pytest.raises(ZeroError, match="twice"):
        ZeroEngine(make_net(), g + [["inp.weight"]])
    with pytest.raises(ZeroError, match="in no layer group"):
        ZeroEngine(make_net(), g[1:])
    with pytest.raises(ValueError, match="zero_stage"):
        ZeroEngine(make_net(), g, sharding=ShardingConfig(zero_stage=4))
    with pytest.raises(ValueError, match="only used with fp16"):
        ZeroEngine(make_net(), g, optimizer=OptimizerConfig(loss_scaler=DynamicLossScaler()))
    engine = ZeroEngine(make_net(), g, sharding=ShardingConfig(zero_stage=2), optimizer=OPT)
    other = ZeroEngine(make_net(blocks=2), None, sharding=ShardingConfig(zero_stage=2), optimizer=OPT)
    with pytest.raises(ZeroError, match="layout"):
        engine.load_state_dict(other.state_dict())


def test_reentrant_checkpointing_is_refused():
    net = make_net()
    for b in net.blocks:
        b.forward = (lambda f: lambda x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True))(b._f)
    engine = ZeroEngine(net, layer_groups(net), sharding=ShardingConfig(zero_stage=2), optimizer=OPT)
    with pytest.raises(ZeroError, match="use_reentrant=False"):
        engine.module(*data(0)).backward()


def test_weight_decay_filter_matches_torch_param_groups():
    """No decay on biases and LayerNorm: same as torch AdamW with two parameter groups."""
    no_decay = lambda n: n.endswith("bias") or ".ln." in n  # noqa: E731
    ref = make_net()
    groups = [
        {"params": [p for n, p in ref.named_parameters() if not no_decay(n)]},
        {"params": [p for n, p in ref.named_parameters() if no_decay(n)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay)
    net = make_net()
    engine = ZeroEngine(
        net,
        layer_groups(net),
        sharding=ShardingConfig(zero_stage=1),
        optimizer=replace(OPT, weight_decay_filter=lambda n: not no_decay(n)),
    )
    for s in range(3):
        x, y = data(s)
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
        engine.module(x, y).backward()
        engine.step()
        engine.zero_grad()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(net.get_parameter(n), p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ranges", [None, [(0, 40), (70, 100)]], ids=["decay-all", "decay-ranges"])
def test_adamw_step_fused_and_unfused_match_torch(ranges, monkeypatch):
    """``adamw_step_`` (torch's fused kernel when present, else eight elementwise passes) against
    ``torch.optim.AdamW`` on the same flat tensor; decay only on ``ranges`` (two optimizers there)."""
    import runtime.data_parallel.flat_shards as optim

    torch.manual_seed(0)
    w0, grads = torch.randn(100), [torch.randn(100) for _ in range(4)]
    hp = OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def ours(fused: bool, scale: float = 1.0) -> torch.Tensor:
        monkeypatch.setattr(optim, "_FUSED_ADAMW", getattr(torch, "_fused_adamw_", None) if fused else None)
        p, m, v = w0.clone(), torch.zeros(100), torch.zeros(100)
        for i, g in enumerate(grads, start=1):
            optim.adamw_step_(p, g / scale, m, v, step=i, config=hp, decay_ranges=ranges, grad_scale=scale)
        return p

    decayed = torch.zeros(100, dtype=torch.bool)
    for a, b in ranges or [(0, 100)]:
        decayed[a:b] = True
    ref = w0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=hp.lr, betas=(0.9, 0.95), eps=hp.eps, weight_decay=0.0)
    for g in grads:
        with torch.no_grad():  # decoupled decay of the decayed elements, then Adam (as AdamW does)
            ref[decayed] *= 1 - hp.lr * hp.weight_decay
        ref.grad = g.clone()
        opt.step()
    for fused in (True, False):
        torch.testing.assert_close(ours(fused), ref.detach(), rtol=1e-6, atol=1e-7)
        # the clip / loss-scale factor applied by the step (the fused kernel as it reads the gradient)
        torch.testing.assert_close(ours(fused, scale=0.25), ref.detach(), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------- split backward
def _split_run(engine: ZeroEngine, steps: int, split: bool) -> tuple[list[float], dict]:
    """``run_engine``'s loop, each micro-batch's backward split as a zero-bubble schedule does:
    ``B`` (input gradients, a pass that accumulates nothing) then ``W`` (one autograd call per
    group of weights), each in ``engine.backward_pass()``. Returns the losses and the counters."""
    from tests.runtime.zero_harness import BATCH, MICRO

    losses, mb = [], BATCH // MICRO
    for s in range(steps):
        x, y = data(s)
        total = 0.0
        for i in range(MICRO):
            xi = x[i * mb : (i + 1) * mb].clone().requires_grad_(True)
            loss = engine.module(xi, y[i * mb : (i + 1) * mb])
            if split:
                with engine.backward_pass(accumulates=False):
                    _, work = backward_input([loss / MICRO], [None], [xi])
                assert all(g.state == FREE for g in engine.groups) or engine.stage < 3  # nothing held to W
                with engine.backward_pass():
                    backward_weight(work, engine.prepare_weights)
            else:
                with engine.backward_pass():
                    (loss / MICRO).backward()
            assert engine.stage < 3 or all(g.state == FREE for g in engine.groups)
            total += loss.item() / MICRO
        engine.step()
        engine.zero_grad()
        losses.append(total)
    return losses, {k: v for k, v in engine.counters.items() if k.startswith("reduced")}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_split_backward_in_scopes_matches_torch_with_one_reduction_per_pass(stage):
    """B and W in ``backward_pass`` scopes: the same training as torch (ZeRO-3 re-gathers each
    group before W, a checkpointed block recomputes in both), and exactly the reductions of an
    unsplit backward per micro-batch (one per bucket and pass at stages 2/3)."""
    ref_losses, ref_params = reference(2)
    counts = {}
    for split in (False, True):
        net = make_net(ckpt=True)
        engine = ZeroEngine(
            net,
            layer_groups(net),
            sharding=ShardingConfig(zero_stage=stage, micro_batches_per_step=2),
            optimizer=OPT_CLIPPED,
        )
        losses, counts[split] = _split_run(engine, 2, split)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-7)
        for n, p in engine.full_state_dict().items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-6)
    assert counts[True] == counts[False]
    if stage >= 2:
        assert counts[True]["reduced_in_backward"] + counts[True]["reduced_at_backward_end"] == 2 * 2 * 5


def test_backward_pass_scopes_do_not_nest():
    net = make_net()
    engine = ZeroEngine(net, sharding=ShardingConfig(zero_stage=1), optimizer=OPT)
    with engine.backward_pass():
        with pytest.raises(ZeroError, match="does not nest"):
            with engine.backward_pass():
                pass


def test_roots_must_hold_whole_groups():
    """An engine over model chunks: each group inside one root (chunk), else a clear error."""
    chunks = torch.nn.ModuleList([make_net(blocks=1), make_net(blocks=1)])
    names = [n for n, _ in chunks.named_parameters()]
    with pytest.raises(ZeroError, match="lies in none of the roots"):
        ZeroEngine(chunks, [names], sharding=ShardingConfig(zero_stage=1), optimizer=OPT, roots=["0", "1"])
    engine = ZeroEngine(
        chunks,
        [[n for n in names if n.startswith(f"{k}.")] for k in "01"],
        sharding=ShardingConfig(zero_stage=1),
        optimizer=OPT,
        roots=["0", "1"],
    )
    assert engine._group_root == [0, 1]


# ---------------------------------------------------------------------------- deferred parameter gathers
class _LateGather:
    """A stand-in for an all-gather still in flight: its data lands (``group.full`` filled with
    ``value``) only when it is waited for, and the wait is logged."""

    def __init__(self, group, value: float, log: list):
        self.group, self.value, self.log = group, value, log

    def wait(self) -> None:
        self.log.append(self.group.index)
        self.group.full.fill_(self.value)

    def is_completed(self) -> bool:
        return False


@pytest.mark.parametrize("stage", [1, 2])
def test_deferred_param_gathers_wait_at_first_use_and_before_a_checkpoint_reads(stage):
    """ZeRO 1/2 leave each group's parameter all-gather in flight after step(): the forward waits
    for each just before the module holding it runs (in forward order, not all up front), and
    state_dict() (what a checkpoint save reads) / full_state_dict() (export) wait for every one
    before reading, so they see the gathered values, never the stale ones."""
    net = make_net()
    engine = ZeroEngine(net, layer_groups(net), sharding=ShardingConfig(zero_stage=stage), optimizer=OPT)
    log: list[int] = []
    seen: list[tuple[str, list[int]]] = []  # (module, gathers waited when it started)
    for name in ("inp", "blocks.0", "blocks.1", "blocks.2", "head"):
        net.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: seen.append((name, list(log))))
    for group in engine.groups:
        engine._gathers.defer(group, _LateGather(group, 0.0, log))
    assert engine.gathers_in_flight == 5
    net(*data(0))
    assert seen == [
        ("inp", [0]),
        ("blocks.0", [0, 1]),
        ("blocks.1", [0, 1, 2]),
        ("blocks.2", [0, 1, 2, 3]),
        ("head", [0, 1, 2, 3, 4]),
    ]
    assert engine.gathers_in_flight == 0 and engine.counters["params_waited_at_use"] == 5

    for reader in (engine.state_dict, engine.full_state_dict):
        log.clear()
        for group in engine.groups:
            engine._gathers.defer(group, _LateGather(group, 7.0, log))
        state = reader()
        assert log == [0, 1, 2, 3, 4]
        # the fp32 masters are the owned shard of the parameters (dp 1: all of them)
        values = state["master"] if reader == engine.state_dict else list(state.values())
        assert len(values) == 5 if reader == engine.state_dict else len(values) == len(list(net.parameters()))
        assert all(bool((t == 7.0).all()) for t in values)


def test_zero3_w_passes_prefetch_the_next_calls_groups_only_with_overlap():
    """ZeRO-3 under a split backward: before each W call the engine gathers that call's groups and,
    with overlap, starts the gather of the next call's (so W too runs a layer ahead); off, nothing
    is prefetched anywhere. The trained parameters are the same, bit for bit."""
    prefetched_in_w, params = {}, {}
    for overlap in (True, False):
        net = make_net()
        engine = ZeroEngine(
            net,
            layer_groups(net),
            sharding=ShardingConfig(zero_stage=3, micro_batches_per_step=2, overlap=overlap),
            optimizer=OPT_CLIPPED,
        )
        in_w = []
        real = engine.prepare_weights

        def counted(weights, upcoming=(), real=real, engine=engine, in_w=in_w):
            before = engine.counters["prefetches"]
            real(weights, upcoming)
            in_w.append(engine.counters["prefetches"] - before)

        engine.prepare_weights = counted  # type: ignore[method-assign]
        _split_run(engine, 2, split=True)
        prefetched_in_w[overlap] = (sum(in_w), engine.counters["prefetches"])
        params[overlap] = engine.full_state_dict()
    assert prefetched_in_w[True][0] > 0 and prefetched_in_w[False] == (0, 0)
    for name, p in params[True].items():
        assert torch.equal(p, params[False][name]), name
