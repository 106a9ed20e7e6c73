"""Compiled code runs with torch and ``runtime`` alone: no planner, no analysis libraries."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import runtime.dtypes as dtypes
from planner.commands.compile import compile_plan
from runtime.contract.dtype_table import canonical
from tests.helpers import ROOT, TINY_GPT, make_plan

# Importing any of these fails in the child: the runtime and a compiled stage must not need them.
_BLOCKED = (
    "planner",
    "passes",
    "codegen",
    "cost_models",
    "sympy",
    "networkx",
    "pulp",
    "rich",
    "matplotlib",
    "transformers",
    "safetensors",
    "numpy",
)

_CHILD = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
import torch
import runtime, runtime.stages.compiled_stages, runtime.tensor_parallel, runtime.pipeline.executor, runtime.data_parallel.zero_engine, runtime.distributed.mesh
from runtime.stages.compiled_stages import load_stage_module, read_manifest
man = read_manifest({out!r})
module = load_stage_module({out!r}, man["stages"][0], torch.device("cpu"))
print(type(module).__name__, sum(p.numel() for p in module.parameters()))
"""


@pytest.mark.dist
def test_runtime_and_a_compiled_stage_import_without_the_compiler(tmp_path):
    out = str(tmp_path / "compiled")
    compile_plan(make_plan("gpt", TINY_GPT, tp=2), out)
    code = _CHILD.format(blocked=_BLOCKED, out=out)
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert res.returncode == 0, res.stderr
    name, params = res.stdout.split()
    assert name == "Stage0" and int(params) > 0


@pytest.mark.parametrize("name, torch_name", [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")])
def test_the_dtype_table_maps_names_both_ways(name, torch_name):
    dt = getattr(torch, torch_name)
    assert dtypes.to_torch(name) is dt and dtypes.to_torch(torch_name) is dt and dtypes.to_torch(dt) is dt
    assert dtypes.name_of(dt) == name and canonical(name.upper()) == name
    assert dtypes.itemsize(name) == dt.itemsize


def test_the_dtype_table_names_the_choices_for_an_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'int8'; use bf16, fp16, fp32"):
        dtypes.to_torch("int8")
    with pytest.raises(ValueError, match="not a compute dtype"):
        dtypes.name_of(torch.float64)
