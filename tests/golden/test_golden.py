"""Golden corpus: recorded plans and compiled files that guard the cost models and codegen.

Each request below was planned (and, where small enough, compiled) once and the outputs recorded
under ``tests/golden/corpus/<name>/``. The test plans and compiles again and requires every
``plan.json`` to be identical but for the solver's wall-clock seconds, every compiled file to be
identical byte for byte, and the infeasible request to fail with the recorded message.

Compiled stage files are recorded as ``stage_<k>.py.golden``: recorded output, not source that
tools should lint, import or count as duplicated code.

A deliberate change to costs or codegen updates the corpus in the same commit, and the commit
message says why::

    .venv/bin/python -m tests.golden.test_golden --update
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile

import pytest

from planner.cli import main

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join("tests", "fixtures")
"""Relative to ``ROOT``, where every request runs: a model file's spec (and so the plan hash) must
not depend on where the repository is checked out."""

_SMALL_GPT = [
    "--model",
    "gpt",
    "--layers",
    "4",
    "--hidden",
    "256",
    "--heads",
    "4",
    "--vocab",
    "8192",
    "--global-batch",
    "16",
    "--seq-len",
    "128",
]

REQUESTS: dict[str, tuple[list[str], bool]] = {
    # name: (plan flags, compile it too)
    # a mixture of experts (8 experts, top 2) from its config, its experts sharded over 4 ranks
    "hf-mixtral-ep4-h100-16": (
        [
            "--model",
            "hf:" + os.path.join(FIXTURES, "tiny_mixtral"),
            "--gpus",
            "16",
            "--gpus-per-node",
            "8",
            "--hardware",
            "h100-sxm",
            "--global-batch",
            "64",
            "--seq-len",
            "512",
            "--ep",
            "4",
        ],
        False,
    ),
    "gpt2-a100-8": (
        [
            "--model",
            "gpt2",
            "--gpus",
            "8",
            "--gpus-per-node",
            "8",
            "--hardware",
            "a100-80gb",
            "--global-batch",
            "64",
            "--seq-len",
            "1024",
        ],
        True,
    ),
    "gpt2-xl-h100-16": (
        [
            "--model",
            "gpt2-xl",
            "--gpus",
            "16",
            "--gpus-per-node",
            "8",
            "--hardware",
            "h100-sxm",
            "--global-batch",
            "128",
            "--seq-len",
            "1024",
        ],
        False,
    ),
    "gpt2-xl-v100-partial-recompute": (
        [
            "--model",
            "gpt2-xl",
            "--gpus",
            "8",
            "--hardware",
            "v100-32gb",
            "--global-batch",
            "256",
            "--seq-len",
            "1024",
            "--micro-batch",
            "16",
            "--dp",
            "8",
            "--zero-stage",
            "1",
        ],
        False,
    ),
    "gpt3-175b-a100-1024": (
        [
            "--model",
            "gpt3-175b",
            "--gpus",
            "1024",
            "--gpus-per-node",
            "8",
            "--hardware",
            "a100-80gb",
            "--global-batch",
            "1536",
            "--seq-len",
            "2048",
        ],
        False,
    ),
    "hf-gpt2": (
        [
            "--model",
            "hf:gpt2",
            "--layers",
            "4",
            "--hidden",
            "256",
            "--heads",
            "4",
            "--vocab",
            "8192",
            "--gpus",
            "4",
            "--hardware",
            "a100-40gb",
            "--global-batch",
            "32",
            "--seq-len",
            "256",
        ],
        True,
    ),
    "hf-llama-gqa-tp2": (
        [
            "--model",
            "hf:llama",
            "--layers",
            "4",
            "--hidden",
            "256",
            "--heads",
            "8",
            "--kv-heads",
            "2",
            "--ffn",
            "688",
            "--vocab",
            "8192",
            "--gpus",
            "8",
            "--hardware",
            "h100-sxm",
            "--global-batch",
            "32",
            "--seq-len",
            "512",
            "--tp",
            "2",
        ],
        True,
    ),
    "hf-llama-8b-h200-64": (
        [
            "--model",
            "hf:llama",
            "--layers",
            "32",
            "--hidden",
            "4096",
            "--heads",
            "32",
            "--kv-heads",
            "8",
            "--ffn",
            "14336",
            "--vocab",
            "128256",
            "--gpus",
            "64",
            "--hardware",
            "h200",
            "--global-batch",
            "512",
            "--seq-len",
            "4096",
        ],
        False,
    ),
    "hf-bert": (
        [
            "--model",
            "hf:bert",
            "--layers",
            "4",
            "--hidden",
            "256",
            "--heads",
            "4",
            "--vocab",
            "8192",
            "--gpus",
            "2",
            "--hardware",
            "v100-32gb",
            "--global-batch",
            "16",
            "--seq-len",
            "128",
        ],
        True,
    ),
    "gpt-cpu-tp2": (_SMALL_GPT + ["--gpus", "4", "--hardware", "cpu", "--tp", "2", "--sequence-parallel", "on"], True),
    "gpt-cpu-pp2": (_SMALL_GPT + ["--gpus", "2", "--hardware", "cpu", "--pp", "2", "--dtype", "fp32"], True),
    "gpt-zero3-dp4": (_SMALL_GPT + ["--gpus", "4", "--hardware", "a100-40gb", "--dp", "4", "--zero-stage", "3"], True),
    "gpt-ckpt-all": (
        _SMALL_GPT
        + ["--gpus", "2", "--hardware", "a100-40gb", "--checkpoint", "all", "--micro-batch", "2", "--dtype", "fp16"],
        True,
    ),
    "gpt-3d": (
        _SMALL_GPT
        + ["--gpus", "8", "--hardware", "h100-sxm", "--dp", "2", "--tp", "2", "--pp", "2", "--zero-stage", "1"],
        True,
    ),
    "file-factory": (
        [
            "--model",
            os.path.join(FIXTURES, "user_models.py") + ":good",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--global-batch",
            "8",
            "--seq-len",
            "16",
            "--dtype",
            "fp32",
        ],
        True,
    ),
}

INFEASIBLE: dict[str, list[str]] = {
    "gpt3-175b-one-v100": [
        "--model",
        "gpt3-175b",
        "--gpus",
        "1",
        "--hardware",
        "v100-32gb",
        "--global-batch",
        "8",
        "--seq-len",
        "2048",
    ],
}

_TIMING_KEYS = ("seconds",)
_RECORDED_SUFFIX = ".golden"  # appended to recorded .py files


def _recorded_name(rel: str) -> str:
    return rel + _RECORDED_SUFFIX if rel.endswith(".py") else rel


def _produced_name(rel: str) -> str:
    return rel[: -len(_RECORDED_SUFFIX)] if rel.endswith(".py" + _RECORDED_SUFFIX) else rel


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    finally:
        os.chdir(cwd)
    return rc, out.getvalue(), err.getvalue()


def _strip_timing(doc):
    """``doc`` without wall-clock fields (the solver's seconds), wherever they are nested."""
    if isinstance(doc, dict):
        return {k: _strip_timing(v) for k, v in doc.items() if k not in _TIMING_KEYS}
    if isinstance(doc, list):
        return [_strip_timing(v) for v in doc]
    return doc


def produce(name: str, workdir: str) -> dict[str, str]:
    """Plan (and compile) one request; return ``{relative path: file text}``."""
    flags, compile_it = REQUESTS[name]
    plan_path = os.path.join(workdir, "plan.json")
    rc, _, err = _run_cli(["plan", *flags, "--out", plan_path, "--json"])
    assert rc == 0, f"{name}: plan failed: {err}"
    with open(plan_path, encoding="utf-8") as f:
        plan = _strip_timing(json.load(f))
    files = {"plan.json": json.dumps(plan, indent=2, sort_keys=True) + "\n"}
    if compile_it:
        out = os.path.join(workdir, "compiled")
        rc, _, err = _run_cli(["compile", plan_path, "--out", out])
        assert rc == 0, f"{name}: compile failed: {err}"
        for fn in sorted(os.listdir(out)):
            with open(os.path.join(out, fn), encoding="utf-8") as f:
                text = f.read()
            if fn.endswith(".json"):  # the manifest embeds the plan, solver seconds included
                text = json.dumps(_strip_timing(json.loads(text)), indent=2, sort_keys=True) + "\n"
            files[f"compiled/{fn}"] = text
    return files


def produce_error(name: str, workdir: str) -> str:
    rc, _, err = _run_cli(["plan", *INFEASIBLE[name], "--out", os.path.join(workdir, "plan.json")])
    assert rc == 2, f"{name}: expected exit 2, got {rc}"
    return err


def _recorded(folder: str) -> dict[str, str]:
    files = {}
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]  # a compiled stage someone imported
        for fn in names:
            path = os.path.join(root, fn)
            with open(path, encoding="utf-8") as f:
                files[_produced_name(os.path.relpath(path, folder).replace(os.sep, "/"))] = f.read()
    return files


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_plan_and_compiled_files_match_the_corpus(name, tmp_path):
    want = _recorded(os.path.join(CORPUS, name))
    assert want, f"no recorded corpus for {name}; run `python -m tests.golden.test_golden --update`"
    got = produce(name, str(tmp_path))
    assert sorted(got) == sorted(want), f"{name}: the set of files changed"
    for rel in sorted(want):
        assert got[rel] == want[rel], f"{name}/{rel} differs from the golden corpus"


@pytest.mark.parametrize("name", sorted(INFEASIBLE))
def test_infeasible_request_keeps_its_message(name, tmp_path):
    with open(os.path.join(CORPUS, name, "stderr.txt"), encoding="utf-8") as f:
        want = f.read()
    assert produce_error(name, str(tmp_path)) == want


def update(names: list[str] | None = None) -> None:
    """Re-record the corpus (all requests, or the named ones)."""
    for name in names or sorted(REQUESTS) + sorted(INFEASIBLE):
        folder = os.path.join(CORPUS, name)
        with tempfile.TemporaryDirectory() as tmp:
            files = produce(name, tmp) if name in REQUESTS else {"stderr.txt": produce_error(name, tmp)}
        shutil.rmtree(folder, ignore_errors=True)
        for rel, text in files.items():
            path = os.path.join(folder, _recorded_name(rel))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        print(f"recorded {name}: {len(files)} file(s)")


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "--update":
        sys.exit("usage: python -m tests.golden.test_golden --update [NAME ...]")
    update(args[1:])
