"""The CLI contract: round trips, --json, and one clear message (exit 2) for each bad input."""

import json
import os
import subprocess
import sys

import pytest

from planner.cli import main
from planner.plan import load_plan

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "user_models.py")
SMALL = ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64"]


def plan_args(out, *extra):
    return ["plan", *SMALL, "--gpus", "2", "--gpus-per-node", "2", "--hardware", "cpu",
            "--global-batch", "8", "--seq-len", "16", "--dtype", "fp32", "--out", str(out), *extra]


def test_plan_json_prints_only_the_plan(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json")) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    plan = load_plan(str(out))
    assert plan.dp * plan.tp * plan.pp == 2
    assert plan.global_batch == plan.dp * plan.micro_batch_size * plan.num_micro_batches
    assert len(plan.alternatives) <= 3 and plan.solver.candidates >= 1


def test_pins_are_respected(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json", "--pp", "2", "--zero-stage", "0", "--micro-batch", "1")) == 0
    plan = load_plan(str(out))
    assert (plan.pp, plan.zero_stage, plan.micro_batch_size) == (2, 0, 1)


@pytest.mark.parametrize("model, seq", [
    (["--model", "hf:gpt2", "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64"], 16),
    (SMALL, 256),  # longer than the preset's 128 positions: the table grows
])
def test_plan_sizes_the_position_table_from_seq_len(tmp_path, capsys, model, seq):
    """``--seq-len`` both sets the traced length and, where the model is too short for it, its
    position table; the two must not collide (this used to be a TypeError at the CLI)."""
    out = tmp_path / "p.json"
    argv = ["plan", *model, "--gpus", "2", "--gpus-per-node", "2", "--hardware", "cpu",
            "--global-batch", "4", "--seq-len", str(seq), "--dtype", "fp32", "--out", str(out), "--json"]
    assert main(argv) == 0
    plan = load_plan(str(out))
    assert plan.seq_len == seq and plan.model.sizes["seq_len"] >= seq
    assert main(["compile", str(out), "--out", str(tmp_path / "c")]) == 0


def test_tied_weights_keep_one_pipeline_stage(tmp_path, capsys):
    """GPT-2 reads its token embedding again as the LM head: no stage cut may separate them."""
    gpt2 = ["--model", "hf:gpt2", "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64"]
    out = tmp_path / "p.json"
    base = ["plan", *gpt2, "--gpus", "2", "--gpus-per-node", "2", "--hardware", "cpu", "--global-batch", "4",
            "--seq-len", "16", "--dtype", "fp32", "--out", str(out)]
    assert main(base) == 0
    printed = capsys.readouterr().out
    assert load_plan(str(out)).pp == 1 and "pipeline parallelism ruled out" in printed
    assert main([*base, "--pp", "2"]) == 2
    err = capsys.readouterr().err
    assert "--pp 2 would cut the model between layers that share a weight" in err
    assert "Use --pp 1, or untie" in err and "Traceback" not in err


def test_plan_compile_train_round_trip(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json", "--dp", "2")) == 0
    assert main(["compile", str(out), "--out", str(tmp_path / "c")]) == 0
    first = {f: (tmp_path / "c" / f).read_bytes() for f in os.listdir(tmp_path / "c")}
    assert main(["compile", str(out), "--out", str(tmp_path / "c2")]) == 0
    second = {f: (tmp_path / "c2" / f).read_bytes() for f in os.listdir(tmp_path / "c2")}
    assert first == second  # byte-identical
    src = first["stage_0.py"].decode()
    assert "import torch" in src and "import runtime" in src
    assert not any(ln.startswith(("import planner", "from planner", "from passes", "from codegen"))
                   for ln in src.splitlines())
    m = tmp_path / "m.jsonl"
    assert main(["train", str(out), "--nproc", "2", "--steps", "2", "--metrics", str(m),
                 "--compiled", str(tmp_path / "c")]) == 0
    rows = [json.loads(ln) for ln in m.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r) >= {"step", "loss", "step_time_s", "tokens_per_s", "peak_memory_bytes", "comm_bytes", "lr"}
        assert r["peak_memory_bytes"] > 0 and r["comm_bytes"] > 0


BAD = [
    (["plan", "--model", "gpt5", "--gpus", "8", "--hardware", "h100-sxm", "--global-batch", "8",
      "--seq-len", "128"], "Unknown model spec 'gpt5'"),
    (["plan", *SMALL, "--gpus", "8", "--hardware", "tpu-v9", "--global-batch", "8", "--seq-len", "16"],
     "tpu-v9"),
    (["plan", *SMALL, "--gpus", "0", "--hardware", "cpu", "--global-batch", "8", "--seq-len", "16"],
     "--gpus: must be a positive integer"),
    (["plan", *SMALL, "--gpus", "two", "--hardware", "cpu", "--global-batch", "8", "--seq-len", "16"],
     "--gpus: must be a positive integer"),
    (["plan", *SMALL, "--gpus", "4", "--hardware", "cpu", "--global-batch", "6", "--seq-len", "16",
      "--dp", "4"], "--global-batch 6 is not divisible by --dp 4"),
    (["plan", *SMALL, "--gpus", "4", "--hardware", "cpu", "--global-batch", "8", "--seq-len", "16",
      "--dp", "2", "--tp", "1", "--pp", "1"], "must multiply to the number of devices"),
    (["plan", *SMALL, "--gpus", "8", "--hardware", "cpu", "--global-batch", "8", "--seq-len", "16",
      "--tp", "8"], "tp"),
    (["plan", "--model", f"{FIX}:raises", "--gpus", "2", "--hardware", "cpu", "--global-batch", "2",
      "--seq-len", "8"], "raised RuntimeError: weights not found"),
    (["plan", "--model", f"{FIX}:not_a_tuple", "--gpus", "2", "--hardware", "cpu", "--global-batch", "2",
      "--seq-len", "8"], "must return (model, example_inputs)"),
    (["plan", "--model", f"{FIX}:missing", "--gpus", "2", "--hardware", "cpu", "--global-batch", "2",
      "--seq-len", "8"], "defines no function 'missing'"),
    (["plan", "--model", "nope/model.py:make", "--gpus", "2", "--hardware", "cpu", "--global-batch", "2",
      "--seq-len", "8"], "does not exist"),
    (["compile", "/nonexistent/plan.json", "--out", "/tmp/x"], "does not exist"),
    (["train", "/nonexistent/plan.json", "--steps", "2"], "does not exist"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a[:3]) + f"#{i}" for i, (a, _) in enumerate(BAD)])
def test_bad_input_is_one_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) if message.startswith("--gpus:") else _nothing():
        rc = main(argv)
        assert rc == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_unexportable_model_names_the_source_line(capsys):
    rc = main(["plan", "--model", f"{FIX}:unexportable", "--gpus", "1", "--hardware", "cpu",
               "--global-batch", "2", "--seq-len", "8"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "user_models.py:" in err and "if x.sum() > 0" in err
    assert "Traceback" not in err


def test_malformed_plan_file(tmp_path, capsys):
    p = tmp_path / "plan.json"
    p.write_text('{"schema_version": 1, "dp": ')
    assert main(["compile", str(p), "--out", str(tmp_path / "c")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    p.write_text('{"schema_version": 1, "dp": 1}')
    assert main(["compile", str(p), "--out", str(tmp_path / "c")]) == 2
    assert "plan: plan is missing the field 'model'" in capsys.readouterr().err


def test_nproc_must_match_plan(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json")) == 0
    capsys.readouterr()
    assert main(["train", str(out), "--nproc", "3", "--steps", "1"]) == 2
    assert "needs dp*tp*pp" in capsys.readouterr().err


def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "planner", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "plan" in r.stdout


def test_export_deepspeed(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json")) == 0
    capsys.readouterr()
    ds = tmp_path / "ds.json"
    assert main(["export", "deepspeed", str(out), "--out", str(ds)]) == 0
    cfg = json.loads(ds.read_text())
    plan = load_plan(str(out))
    assert cfg["train_batch_size"] == plan.global_batch
    assert cfg["train_micro_batch_size_per_gpu"] == plan.micro_batch_size
    assert cfg["zero_optimization"]["stage"] == plan.zero_stage
    assert "deepspeed" in capsys.readouterr().out
