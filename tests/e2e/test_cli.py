"""The CLI end to end: plan, compile and train round trip on local gloo processes, `python -m planner`."""

import json
import os
import subprocess
import sys

import pytest

from planner.cli import main
from planner.plan import TIME_KEYS
from tests.helpers import plan_args


def test_plan_compile_train_round_trip(tmp_path, capfd):
    # Two pipeline stages with every block recomputed, so that the measured time breakdown has a
    # pipeline bubble and a recomputation (tests/e2e/test_validate.py measures a dp run's).
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json", "--pp", "2", "--checkpoint", "all")) == 0
    assert main(["compile", str(out), "--out", str(tmp_path / "c")]) == 0
    first = {f: (tmp_path / "c" / f).read_bytes() for f in os.listdir(tmp_path / "c")}
    assert main(["compile", str(out), "--out", str(tmp_path / "c2")]) == 0
    second = {f: (tmp_path / "c2" / f).read_bytes() for f in os.listdir(tmp_path / "c2")}
    assert first == second  # byte-identical
    src = first["stage_0.py"].decode()
    assert "import torch" in src and "import runtime" in src
    assert not any(
        ln.startswith(("import planner", "from planner", "from passes", "from codegen")) for ln in src.splitlines()
    )
    m = tmp_path / "m.jsonl"
    tb = tmp_path / "tb"
    capfd.readouterr()
    assert (
        main(
            [
                "train",
                str(out),
                "--nproc",
                "2",
                "--steps",
                "2",
                "--metrics",
                str(m),
                "--compiled",
                str(tmp_path / "c"),
                "--tensorboard",
                str(tb),
            ]
        )
        == 0
    )
    rows = [json.loads(ln) for ln in m.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r) >= {
            "step",
            "loss",
            "step_time_s",
            "tokens_per_s",
            "peak_memory_bytes",
            "comm_bytes",
            "lr",
            "time",
        }
        assert r["peak_memory_bytes"] > 0 and r["comm_bytes"] > 0
        # The measured breakdown: every part of predicted.time, summing to the step time.
        t = r["time"]
        assert list(t) == list(TIME_KEYS) and all(v >= 0 for v in t.values()), t
        assert sum(t.values()) == pytest.approx(r["step_time_s"], rel=0.02), r
        assert t["pp_bubble"] > 0 and t["recompute"] > 0 and t["optimizer"] > 0 and t["compute"] > 0, t
        assert t["tp_comm"] == 0 and t["dp_comm"] == 0, t  # no tp or dp group with more than one rank
    assert [f for f in os.listdir(tb) if f.startswith("events.out.tfevents.")]
    printed = capfd.readouterr()  # rank 0 prints from its own process
    assert "step time by part" in printed.out and "pp_bubble" in printed.out, printed.out
    assert "Warning" not in printed.err and "Traceback" not in printed.err, printed.err


def test_tensorboard_missing_is_bad_input(tmp_path, capsys, monkeypatch):
    from planner.commands import train

    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json")) == 0
    monkeypatch.setattr(train, "_tensorboard_installed", lambda: False)
    capsys.readouterr()
    assert main(["train", str(out), "--nproc", "2", "--steps", "1", "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert "pip install tensorboard" in err and "Traceback" not in err
    assert not (tmp_path / "tb").exists()


def test_nproc_must_match_plan(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json")) == 0
    capsys.readouterr()
    assert main(["train", str(out), "--nproc", "3", "--steps", "1"]) == 2
    assert "needs dp*tp*pp" in capsys.readouterr().err


def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "planner", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "plan" in r.stdout
