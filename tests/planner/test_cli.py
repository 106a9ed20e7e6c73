"""The CLI contract: round trips, --json, and one clear message (exit 2) for each bad input."""

import json

import pytest

from planner.cli import main
from planner.plan import load_plan
from tests.helpers import SMALL_GPT_FLAGS, USER_MODELS, plan_args


def test_plan_json_prints_only_the_plan(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json")) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    plan = load_plan(str(out))
    assert plan.dp * plan.tp * plan.pp == 2
    assert plan.global_batch == plan.dp * plan.micro_batch_size * plan.num_micro_batches
    assert len(plan.alternatives) <= 3 and plan.solver.candidates >= 1


def test_plan_overlap_off_prices_every_collective_as_waited(tmp_path, capsys):
    plans = {}
    for toggle in ("on", "off"):
        out = tmp_path / f"{toggle}.json"
        pins = ("--dp", "2", "--zero-stage", "2", "--micro-batch", "2")
        assert main(plan_args(out, "--json", *pins, "--overlap", toggle)) == 0
        plans[toggle] = load_plan(str(out))
    on, off = plans["on"], plans["off"]
    assert on.overlap == {"dp": True, "tp": True, "pp": True}
    assert off.overlap == {"dp": False, "tp": False, "pp": False}
    assert off.predicted.hidden["dp_comm"] == 0 < on.predicted.hidden["dp_comm"]
    # the same traffic: the overlapped plan exposes what it does not hide
    total = on.predicted.time["dp_comm"] + on.predicted.hidden["dp_comm"]
    assert total == pytest.approx(off.predicted.time["dp_comm"], rel=1e-9)
    assert on.predicted.step_time_s < off.predicted.step_time_s
    assert on.request["overlap"] == "on" and off.request["overlap"] == "off"


def test_pins_are_respected(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json", "--pp", "2", "--zero-stage", "0", "--micro-batch", "1")) == 0
    plan = load_plan(str(out))
    assert (plan.pp, plan.zero_stage, plan.micro_batch_size) == (2, 0, 1)


@pytest.mark.parametrize(
    "model, seq",
    [
        (["--model", "hf:gpt2", "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64"], 16),
        (SMALL_GPT_FLAGS, 256),  # longer than the preset's 128 positions: the table grows
    ],
)
def test_plan_sizes_the_position_table_from_seq_len(tmp_path, capsys, model, seq):
    """``--seq-len`` both sets the traced length and, where the model is too short for it, its
    position table; the two must not collide (this used to be a TypeError at the CLI)."""
    out = tmp_path / "p.json"
    argv = [
        "plan",
        *model,
        "--gpus",
        "2",
        "--gpus-per-node",
        "2",
        "--hardware",
        "cpu",
        "--global-batch",
        "4",
        "--seq-len",
        str(seq),
        "--dtype",
        "fp32",
        "--out",
        str(out),
        "--json",
    ]
    assert main(argv) == 0
    plan = load_plan(str(out))
    assert plan.seq_len == seq and plan.model.sizes["seq_len"] >= seq
    assert main(["compile", str(out), "--out", str(tmp_path / "c")]) == 0


def test_tied_weights_plan_with_pipeline_stages(tmp_path, capsys):
    """GPT-2 reads its token embedding again as the LM head: with --pp 2 each end holds a copy."""
    gpt2 = ["--model", "hf:gpt2", "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64"]
    out = tmp_path / "p.json"
    base = [
        "plan",
        *gpt2,
        "--gpus",
        "2",
        "--gpus-per-node",
        "2",
        "--hardware",
        "cpu",
        "--global-batch",
        "4",
        "--seq-len",
        "16",
        "--dtype",
        "fp32",
        "--out",
        str(out),
    ]
    assert main([*base, "--pp", "2"]) == 0
    printed = capsys.readouterr().out
    plan = load_plan(str(out))
    assert plan.pp == 2 and plan.stages[0][0] == 0 and plan.stages[-1][1] == plan.model.layers + 1
    assert "tied weights" in printed and "ruled out" not in printed


BAD = [
    (
        ["plan", "--model", "gpt5", "--gpus", "8", "--hardware", "h100-sxm", "--global-batch", "8", "--seq-len", "128"],
        "Unknown model spec 'gpt5'",
    ),
    (
        ["plan", *SMALL_GPT_FLAGS, "--gpus", "8", "--hardware", "tpu-v9", "--global-batch", "8", "--seq-len", "16"],
        "tpu-v9",
    ),
    (
        ["plan", *SMALL_GPT_FLAGS, "--gpus", "0", "--hardware", "cpu", "--global-batch", "8", "--seq-len", "16"],
        "--gpus: must be a positive integer",
    ),
    (
        ["plan", *SMALL_GPT_FLAGS, "--gpus", "two", "--hardware", "cpu", "--global-batch", "8", "--seq-len", "16"],
        "--gpus: must be a positive integer",
    ),
    (
        [
            "plan",
            *SMALL_GPT_FLAGS,
            "--gpus",
            "4",
            "--hardware",
            "cpu",
            "--global-batch",
            "6",
            "--seq-len",
            "16",
            "--dp",
            "4",
        ],
        "--global-batch 6 is not divisible by --dp 4",
    ),
    (
        [
            "plan",
            *SMALL_GPT_FLAGS,
            "--gpus",
            "4",
            "--hardware",
            "cpu",
            "--global-batch",
            "8",
            "--seq-len",
            "16",
            "--dp",
            "2",
            "--tp",
            "1",
            "--pp",
            "1",
        ],
        "must multiply to the number of devices",
    ),
    (
        [
            "plan",
            *SMALL_GPT_FLAGS,
            "--gpus",
            "8",
            "--hardware",
            "cpu",
            "--global-batch",
            "8",
            "--seq-len",
            "16",
            "--tp",
            "8",
        ],
        "tp",
    ),
    (
        [
            "plan",
            "--model",
            f"{USER_MODELS}:raises",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--global-batch",
            "2",
            "--seq-len",
            "8",
        ],
        "raised RuntimeError: weights not found",
    ),
    (
        [
            "plan",
            "--model",
            f"{USER_MODELS}:not_a_tuple",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--global-batch",
            "2",
            "--seq-len",
            "8",
        ],
        "must return (model, example_inputs)",
    ),
    (
        [
            "plan",
            "--model",
            f"{USER_MODELS}:missing",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--global-batch",
            "2",
            "--seq-len",
            "8",
        ],
        "defines no function 'missing'",
    ),
    (
        [
            "plan",
            "--model",
            "nope/model.py:make",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--global-batch",
            "2",
            "--seq-len",
            "8",
        ],
        "does not exist",
    ),
    (["compile", "/nonexistent/plan.json", "--out", "/tmp/x"], "does not exist"),
    (["train", "/nonexistent/plan.json", "--steps", "2"], "does not exist"),
    (
        [
            "plan",
            *SMALL_GPT_FLAGS,
            "--gpus",
            "4",
            "--gpus-per-node",
            "3",
            "--hardware",
            "cpu",
            "--global-batch",
            "8",
            "--seq-len",
            "16",
        ],
        "--gpus 4 is not a whole number of nodes of 3 devices",
    ),
    (
        [
            "plan",
            *SMALL_GPT_FLAGS,
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--global-batch",
            "8",
            "--seq-len",
            "16",
            "--moe-imbalance",
            "1.2",
        ],
        "--moe-imbalance describes a mixture of experts' routing, but this model has no routed experts",
    ),
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
    rc = main(
        [
            "plan",
            "--model",
            f"{USER_MODELS}:unexportable",
            "--gpus",
            "1",
            "--hardware",
            "cpu",
            "--global-batch",
            "2",
            "--seq-len",
            "8",
        ]
    )
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


def test_export_deepspeed_writes_the_nvme_path_of_an_offloaded_plan(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert (
        main(plan_args(out, "--json", "--zero-stage", "3", "--offload-optimizer", "nvme", "--offload-params", "cpu"))
        == 0
    )
    capsys.readouterr()
    ds = tmp_path / "ds.json"
    assert main(["export", "deepspeed", str(out), "--out", str(ds), "--nvme-path", "/mnt/nvme0"]) == 0
    zero = json.loads(ds.read_text())["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/mnt/nvme0", "pin_memory": True}
    assert zero["offload_param"]["device"] == "cpu"
    assert not any("nvme_path" in w for w in json.loads(ds.read_text())["planner"]["warnings"])


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_old_plan(tmp_path, capsys, monkeypatch):
    """A disk that fills up while plan.json is written: one line naming the file and what to do,
    exit 1, no traceback, and the plan saved before is untouched."""
    import errno

    from planner.plan import Plan

    out = tmp_path / "plan.json"
    assert main(plan_args(out)) == 0
    before = out.read_text()
    capsys.readouterr()

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device", str(out) + ".tmp")

    monkeypatch.setattr(Plan, "to_json", full)
    assert main(plan_args(out)) == 1
    err = capsys.readouterr().err
    assert err.startswith("planner plan: error: no space left on device writing ")
    assert "free some space" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert out.read_text() == before
