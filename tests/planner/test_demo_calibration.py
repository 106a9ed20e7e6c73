"""`make demo` keeps its quick calibration between runs only while the method that made it stands."""

from __future__ import annotations

import dataclasses

from cost_models.hardware import load_hardware
from planner import demo
from planner.commands.calibrate import CALIBRATION_METHOD


def _keep(tmp_path, calibration):
    profile = dataclasses.replace(load_hardware("cpu"), calibration=calibration)
    profile.save(tmp_path / "cpu_profile.json")


def test_the_demo_reuses_a_calibration_of_the_current_method_and_measures_again_otherwise(tmp_path, monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(demo, "run", calls.append)
    _keep(tmp_path, {"method": CALIBRATION_METHOD})
    assert demo._calibrate(str(tmp_path)) == f"{tmp_path}/cpu_profile.json" and calls == []
    # a profile from before the GEMM table was scaled to the steps (no method) prices compute 20% fast
    _keep(tmp_path, {"nproc": 2})
    demo._calibrate(str(tmp_path))
    assert calls == [["calibrate", "--nproc", "2", "--quick", "--out", f"{tmp_path}/cpu_profile.json"]]
