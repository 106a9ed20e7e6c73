"""Codegen: generated source is safe, readable and runs like the original model."""

import ast
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen.codegen_errors import UnsafeNameError
from codegen.names import check_ident, safe_ident
from planner.commands.compile import compile_plan
from runtime.stages.compiled_stages import CompiledError, load_stage_module, load_weights, read_manifest
from tests.helpers import USER_MODELS, make_plan, run_stages_in_process


@given(st.text(max_size=40))
@settings(max_examples=300, deadline=None)
def test_safe_ident_is_always_a_plain_identifier(name):
    s = safe_ident(name)
    assert check_ident(s) == s
    ast.parse(f"{s} = 1")


@pytest.mark.parametrize("bad", ["a b", "__import__", "class", "x;y", "é", ""])
def test_check_ident_rejects(bad):
    with pytest.raises(UnsafeNameError):
        check_ident(bad)


def _compile_file_model(tmp_path, factory):
    plan = make_plan(f"{USER_MODELS}:{factory}", {"layers": 2}, mbs=2, m=1)
    out = tmp_path / "c"
    man = compile_plan(plan, str(out))
    return plan, out, man


def _assert_single_stage_matches(out, man, model_cls):
    """The one compiled stage, loaded with a fresh ``model_cls``'s weights, gives its loss."""
    module = load_stage_module(str(out), man["stages"][0])
    torch.manual_seed(0)
    model = model_cls()
    load_weights(module, man["stages"][0], dict(model.named_parameters()))
    ids, labels = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(module(ids, labels), model(ids, labels))


def test_hostile_module_names_are_refused_before_any_code_is_generated(tmp_path):
    from planner.errors import UserError

    marker = "/tmp/pwned"
    if os.path.exists(marker):
        os.remove(marker)
    with pytest.raises(UserError, match="names may contain only letters, digits and '_'"):
        _compile_file_model(tmp_path, "hostile")
    assert not os.path.exists(marker)
    assert not (tmp_path / "c").exists()


def test_awkward_names_compile_to_safe_identifiers(tmp_path):
    plan, out, man = _compile_file_model(tmp_path, "awkward")
    src = (out / "stage_0.py").read_text()
    tree = ast.parse(src)
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert all(m.split(".")[0] in ("torch", "runtime", "math") for m in modules)
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            check_ident(n.attr)
    from tests.fixtures.user_models import Awkward

    _assert_single_stage_matches(out, man, Awkward)


def test_tampered_stage_file_is_refused(tmp_path):
    plan = make_plan("gpt", {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16})
    compile_plan(plan, str(tmp_path))
    with open(tmp_path / "stage_0.py", "a", encoding="utf-8") as f:
        f.write("\nimport os\n")
    with pytest.raises(CompiledError, match="modified after compilation"):
        read_manifest(str(tmp_path))


@pytest.mark.parametrize(
    "spec, sizes",
    [
        ("gpt", {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16}),
        ("hf:llama", {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 64, "seq_len": 16}),
    ],
)
def test_compiled_stages_match_the_model(tmp_path, spec, sizes):
    """Two pipeline stages chained by hand: same loss and gradients as the uncompiled model."""
    from planner.commands.train import original_state
    from planner.frontend.zoo import ModelSizes, build_model

    plan = make_plan(spec, sizes, pp=2, checkpoint=(1,))
    compile_plan(plan, str(tmp_path))
    man = read_manifest(str(tmp_path))
    model = build_model(spec, ModelSizes(**sizes), seed=0).model
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    x, y = ids[:, :-1], ids[:, 1:]
    ref = model(x, y)
    ref.backward()
    state = original_state(spec, sizes, 16, 0)
    loss, mods = run_stages_in_process(str(tmp_path), man, state, {"input_ids": x, "labels": y})
    torch.testing.assert_close(loss, ref)
    grads = dict(model.named_parameters(remove_duplicate=False))
    for m, stage in zip(mods, man["stages"]):
        for attr, p in m.named_parameters():
            torch.testing.assert_close(p.grad, grads[stage["params"][attr]["fqn"]].grad)
    assert "runtime.checkpoint(self.layer_1" in (tmp_path / "stage_0.py").read_text()


def test_model_without_blocks_compiles_and_matches(tmp_path):
    """The empty head row of a model with no blocks is called, not assigned (no broken source)."""
    from planner.commands.plan_command import plan_from_request
    from planner.search.request import PlanRequest

    req = PlanRequest(
        spec=f"{USER_MODELS}:no_blocks",
        gpus=1,
        gpus_per_node=1,
        hardware="cpu",
        global_batch=2,
        seq_len=8,
        dtype="fp32",
    )
    plan = plan_from_request(req)[0].plan
    assert plan.model.layers == 0
    out = tmp_path / "c"
    man = compile_plan(plan, str(out))
    from tests.fixtures.user_models import NoBlocks

    _assert_single_stage_matches(out, man, NoBlocks)


def test_a_repeated_compile_reuses_the_export_and_writes_the_same_files(tmp_path, monkeypatch):
    """One model under several plans (``planner tune``, the equivalence matrices) is exported once:
    a tp rewrite of the first plan's copy does not leak into the next, and a changed factory file
    is exported again."""
    import filecmp
    import shutil

    import planner.frontend.trace as trace

    calls = []
    export = trace._export_training_module
    monkeypatch.setattr(trace, "_export_training_module", lambda *a, **k: calls.append(a) or export(*a, **k))
    monkeypatch.setattr(trace, "_EXPORTS", type(trace._EXPORTS)())
    tp = make_plan("gpt", {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64}, tp=2, sequence_parallel=True)
    pp = make_plan("gpt", {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64}, pp=2)
    for name, plan in [("tp1", tp), ("pp", pp), ("tp2", tp)]:
        compile_plan(plan, str(tmp_path / name))
    assert len(calls) == 1
    same = filecmp.dircmp(tmp_path / "tp1", tmp_path / "tp2")
    assert not (same.diff_files or same.left_only or same.right_only)
    source = tmp_path / "models.py"
    shutil.copy(USER_MODELS, source)
    user = make_plan(f"{source}:good", {"layers": 3}, mbs=2, m=1)
    compile_plan(user, str(tmp_path / "user1"))
    source.write_text(source.read_text() + "\n# edited\n")
    compile_plan(user, str(tmp_path / "user2"))
    assert len(calls) == 3


def test_a_plan_of_another_model_size_is_refused(tmp_path):
    """A model that changed since it was planned (same blocks, other widths) is not compiled under
    the old plan's prices: the parameter count must be the plan's."""
    import dataclasses

    from codegen.codegen_errors import CodegenError

    plan = make_plan()  # a hand-made plan states no parameter count (0): nothing to compare
    stale = dataclasses.replace(plan, model=dataclasses.replace(plan.model, params=12_345))
    with pytest.raises(CodegenError, match=r"parameters but the plan was made for .*re-run `planner plan`"):
        compile_plan(stale, str(tmp_path / "c"))
    assert compile_plan(plan, str(tmp_path / "ok"))["stages"]  # the plan's own count compiles


def test_a_compile_leaves_only_the_stages_of_its_plan(tmp_path):
    """Compiling a one-stage plan into the folder of a two-stage one removes ``stage_1.py``."""
    out = str(tmp_path / "c")
    assert [stage["file"] for stage in compile_plan(make_plan(pp=2), out)["stages"]] == ["stage_0.py", "stage_1.py"]
    (tmp_path / "c" / "notes.txt").write_text("kept")
    assert [stage["file"] for stage in compile_plan(make_plan(), out)["stages"]] == ["stage_0.py"]
    assert sorted(os.listdir(out)) == ["manifest.json", "notes.txt", "stage_0.py"]
