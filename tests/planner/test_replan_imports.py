"""A re-plan answered by the layer-table cache imports neither torch, transformers nor sympy.

``import torch`` alone is most of a cached re-plan's time (ARCHITECTURE.md, import rules), and
``import sympy`` a sixth of what is left, so the planning path keeps them out (a hit prices from
the table's compiled form, ``passes.compiled_table``): these tests run ``planner plan`` in fresh interpreters and look at
``sys.modules`` afterwards. The first run may trace (and fill the session's cache); the second
must be a hit and stay torch-free, with the same plan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.dist  # `planner plan` runs in fresh interpreters

_PROBE = """
import json, sys
from planner.cli import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers", "sympy") if m in sys.modules)
print(json.dumps({"rc": rc, "heavy": heavy}), file=sys.stderr)
"""


def _plan(args: list[str], env: dict, out) -> tuple[dict, dict]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, "plan", *args, "--json", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )
    probe = json.loads(proc.stderr.strip().splitlines()[-1])
    assert probe["rc"] == 0, proc.stderr
    return json.loads(proc.stdout), probe


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "gpt", "--gpus", "4", "--hardware", "a100-80gb", "--global-batch", "16", "--seq-len", "128"],
        [
            "--model",
            "hf:llama",
            "--layers",
            "4",
            "--hidden",
            "256",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--vocab",
            "1024",
            "--seq-len",
            "128",
            "--gpus",
            "8",
            "--hardware",
            "h100-sxm",
            "--global-batch",
            "32",
            "--tokens",
            "1e9",
            "--price-per-gpu-hour",
            "2",
        ],
    ],
    ids=["gpt", "hf-llama"],
)
def test_a_cached_replan_imports_no_torch_nor_sympy(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    first, _ = _plan(args, env, tmp_path / "first.json")
    again, probe = _plan(args, env, tmp_path / "again.json")
    assert probe["heavy"] == [], f"a cached re-plan imported {probe['heavy']}"
    first["solver"].pop("seconds"), again["solver"].pop("seconds")
    assert again == first
