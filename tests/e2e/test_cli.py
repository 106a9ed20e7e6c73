"""The CLI end to end: plan, compile and train round trip on local gloo processes, `python -m planner`."""

import json
import os
import subprocess
import sys

from planner.cli import main
from tests.helpers import plan_args


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


def test_nproc_must_match_plan(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json")) == 0
    capsys.readouterr()
    assert main(["train", str(out), "--nproc", "3", "--steps", "1"]) == 2
    assert "needs dp*tp*pp" in capsys.readouterr().err


def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "planner", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "plan" in r.stdout
