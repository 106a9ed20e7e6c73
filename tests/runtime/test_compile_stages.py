"""runtime.stages.compile_layers: one torch.compile per layer class, hooks outside, warm-up without traces.

These run the ``aot_eager`` backend (the same Dynamo capture and autograd split as inductor,
without code generation: seconds instead of a minute); ``tests/e2e/test_compiled_stages.py``
trains with inductor."""

import pytest
import torch
import torch._dynamo

import runtime.tensor_parallel as tp
from planner.commands.compile import compile_plan
from runtime import moe
from runtime.stages.compile_layers import compile_counts, compile_stage, prepare, warm_up
from runtime.stages.compiled_stages import load_stage_module, read_manifest
from runtime.training.memtrack import MemoryTracker
from tests.helpers import make_plan

SIZES = {"layers": 3, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16}


@pytest.fixture(scope="module")
def stage_dir(tmp_path_factory):
    """A one-stage GPT of three identical blocks, the middle one recomputed."""
    out = tmp_path_factory.mktemp("compiled")
    compile_plan(make_plan("gpt", SIZES, checkpoint=(2,)), str(out))
    return str(out)


def _load(directory: str, seed: int = 0) -> torch.nn.Module:
    man = read_manifest(directory)
    module = load_stage_module(directory, man["stages"][0])
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    return module


def _step(module, ids, labels):
    module.zero_grad(set_to_none=True)
    loss = module(ids, labels)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.parameters()]


def test_identical_blocks_compile_once_and_match_eager(stage_dir):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ref, mod = _load(stage_dir), _load(stage_dir)
    info = compile_stage(mod, backend_name="aot_eager")
    assert info.classes == ["Pre", "Block", "Post"]
    assert list(info.layers) == [f"layer_{i}" for i in range(5)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # the same graphs every step: no recompilation
        ids = torch.randint(0, 64, (2, 16), generator=g)
        labels = torch.randint(0, 64, (2, 16), generator=g)
        loss, grads = _step(mod, ids, labels)
        ref_loss, ref_grads = _step(ref, ids, labels)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # three classes, three frames and graphs: the three blocks (one of them recomputed in
    # backward) share one compiled graph
    assert compile_counts() == {"frames": 3, "graphs": 3, "graph_breaks": 0}


def test_hooks_run_outside_the_compiled_region(stage_dir):
    mod = _load(stage_dir)
    compile_stage(mod, backend_name="aot_eager")
    calls = []
    for name, layer in mod.named_children():
        layer.register_forward_pre_hook(lambda m, a, name=name: calls.append(("pre", name)))
        # always_call: a recomputation stops early (non-reentrant checkpoint raises inside forward)
        layer.register_forward_hook(lambda m, a, o, name=name: calls.append(("post", name)), always_call=True)
    ids = torch.zeros((2, 16), dtype=torch.long)
    mod(ids, ids).backward()
    mod(ids, ids).backward()
    # every call of every layer, and the recomputed block once more inside each backward
    per_step = [(k, f"layer_{i}") for i in range(5) for k in ("pre", "post")] + [
        ("pre", "layer_2"),
        ("post", "layer_2"),
    ]
    assert sorted(calls) == sorted(per_step * 2)


def test_layers_run_eagerly_under_the_memory_tracker_and_compiled_after(stage_dir):
    """Dynamo would mark a frame it meets under a dispatch mode as eager for good: the layers call
    their plain forward while the tracker runs, and the compiled one again after it."""
    mod = _load(stage_dir)
    compile_stage(mod, backend_name="aot_eager")
    ids = torch.zeros((2, 16), dtype=torch.long)
    warm_up(mod, [ids, ids])

    def compiled() -> bool:
        return type(mod.layer_0(ids).grad_fn).__name__ == "CompiledFunctionBackward"

    assert compiled()
    tracker = MemoryTracker(device=torch.device("cpu"))
    with tracker:
        assert not compiled()
        mod(ids, ids).backward()
    assert tracker.peak_bytes > 0
    assert compiled()


def test_warm_up_keeps_random_state_and_gradients():
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    compile_stage(lin, backend_name="aot_eager")
    torch.manual_seed(3)
    before = torch.get_rng_state()
    seconds = warm_up(lin, [torch.ones(2, 4)])
    assert seconds >= 0
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.grad is None for p in lin.parameters())


def test_tensor_parallel_entry_points_become_graph_breaks():
    prepare()
    prepare()  # idempotent: wrapped once
    for name in tp.EAGER_ONLY:
        fn = getattr(tp, name)
        assert getattr(fn, "_torchdynamo_disable", False), name
        assert not getattr(getattr(fn, "__wrapped__", None), "_torchdynamo_disable", False), name
    x = torch.ones(3)
    assert tp.copy_to_tp(x) is x and tp.tp_rank() == 0  # no group: the plain operation
    for name in moe.EAGER_ONLY:  # the expert dispatch and combine too
        assert getattr(getattr(moe, name), "_torchdynamo_disable", False), name
