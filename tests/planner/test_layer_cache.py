"""planner.frontend.cache: the layer table of a spec is traced once and read back while nothing it
depends on changes; a bad entry or cache folder costs the speed-up, never the plan.

Tiny models only (GPT 2 x 64, vocabulary 128, sequence 16; a two-factory file of width 8).
"""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import sympy

from passes import tabulate
from passes.compiled_table import CompiledTable, function_source
from passes.layer_table import EXPR_FIELDS
from planner.cli import main
from planner.frontend import cache, trace
from planner.frontend.frontend_errors import ModelError
from planner.frontend.model_analysis import build_layer_table
from planner.frontend.zoo import ModelSizes, build_model

ROOT = Path(__file__).resolve().parents[2]
GPT = dict(batch=1, seq_len=16, dtype="fp32", layers=2, hidden=64, heads=2, vocab=128)

FACTORY = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.emb = nn.Embedding(32, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.out = nn.Linear(width, 32)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return nn.functional.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


def make():
    return Net(WIDTH), (torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long))


def make_wide():
    return Net(2 * WIDTH), (torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long))
"""


class Traces:
    """Counts the traces ``build_layer_table`` runs (a hit runs none). With ``table`` it also
    stands in for the trace and the passes, returning a fresh copy of that table: the cache's
    logic is the same, and the tests stay fast."""

    def __init__(self, monkeypatch, table=None):
        self.calls = 0
        real = trace.trace_model

        def counting(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs) if table is None else None

        # build_layer_table looks both up in their modules on a miss (they import torch).
        monkeypatch.setattr(trace, "trace_model", counting)
        if table is not None:
            monkeypatch.setattr(tabulate, "table_from_traced", lambda traced: pickle.loads(pickle.dumps(table)))


def _use_cache(monkeypatch, folder: Path) -> None:
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(folder))
    monkeypatch.delenv("PLANNER_CACHE", raising=False)


@pytest.fixture(scope="module")
def gpt_table():
    """The tiny GPT's table, traced once for the module (the cache off)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE", "off")
        return build_layer_table("gpt", **GPT)


@pytest.fixture
def traces(monkeypatch, tmp_path, gpt_table):
    """A fresh, enabled cache in ``tmp_path/cache``; traces counted and stood in for."""
    _use_cache(monkeypatch, tmp_path / "cache")
    return Traces(monkeypatch, gpt_table)


@pytest.fixture
def real_traces(monkeypatch, tmp_path):
    """A fresh, enabled cache in ``tmp_path/cache``; real traces, counted."""
    _use_cache(monkeypatch, tmp_path / "cache")
    return Traces(monkeypatch)


def entries(tmp_path) -> list[Path]:
    folder = tmp_path / "cache" / "layer-tables"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def factory(tmp_path, width=8) -> Path:
    path = tmp_path / "net.py"
    path.write_text(FACTORY.replace("WIDTH", str(width)))
    return path


# --------------------------------------------------------------------------------------------
# Hits


def test_second_build_comes_from_the_cache_and_equals_the_first(real_traces, tmp_path):
    traces = real_traces
    first = build_layer_table("gpt", **GPT)
    assert traces.calls == 1 and len(entries(tmp_path)) == 1
    hits = cache.stats["hit"]
    second = build_layer_table("gpt", **GPT)
    assert traces.calls == 1 and cache.stats["hit"] == hits + 1
    assert second == first and second.to_json() == first.to_json()
    assert second is not first  # each caller gets its own copy to mutate
    assert second.numeric(2, 16) == first.numeric(2, 16)  # and a working one (its lambdify is fresh)
    for row in second.layers:  # expressions come back unevaluated: they must be canonical as they are
        for f in EXPR_FIELDS:
            _assert_canonical(getattr(row, f))


def _assert_canonical(e: sympy.Basic) -> None:
    if not e.is_Atom:
        assert e.func(*e.args) == e, e
        for a in e.args:
            _assert_canonical(a)


def test_a_factory_file_is_keyed_by_its_content(real_traces, tmp_path):
    traces = real_traces
    path = factory(tmp_path, width=8)
    narrow = build_layer_table(f"{path}:make")
    assert build_layer_table(f"{path}:make") == narrow and traces.calls == 1
    factory(tmp_path, width=16)  # same path, new content: traced again
    wide = build_layer_table(f"{path}:make")
    assert traces.calls == 2 and wide.model["params"] > narrow.model["params"]
    other = build_layer_table(f"{path}:make_wide")  # another spec of the same file
    assert traces.calls == 3 and other.model["params"] > wide.model["params"]


@pytest.mark.parametrize(
    "change",
    [
        dict(layers=3),
        dict(hidden=32),
        dict(heads=4),
        dict(vocab=96),
        dict(seq_len=8),
        dict(batch=2),
        dict(dtype="bf16"),
        dict(positions=64),
        dict(dynamic=False),
        dict(shallow=False),
    ],
    ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()),
)
def test_any_change_of_an_argument_misses(change, traces):
    build_layer_table("gpt", **GPT)
    build_layer_table("gpt", **{**GPT, **change})
    assert traces.calls == 2
    build_layer_table("gpt", **{**GPT, **change})
    build_layer_table("gpt", **GPT)
    assert traces.calls == 2


def test_new_planner_code_or_torch_misses(traces, monkeypatch):
    build_layer_table("gpt", **GPT)
    monkeypatch.setattr(cache, "_code_digest", "0" * 64)  # as if passes/ or the front end changed
    build_layer_table("gpt", **GPT)
    assert traces.calls == 2
    real = cache._version  # the installed packages' versions, read without importing them
    monkeypatch.setattr(cache, "_version", lambda package: "0.0.0" if package == "torch" else real(package))
    build_layer_table("gpt", **GPT)
    assert traces.calls == 3


def test_code_digest_covers_the_passes_and_the_front_end():
    import passes.autograd_costs
    import passes.tensor_parallel.tp_costs
    import planner.frontend.trace
    import runtime.contract.dtype_table

    hashed = set(cache.source_paths())
    for module in (
        passes.autograd_costs,
        planner.frontend.trace,
        passes.tensor_parallel.tp_costs,
        runtime.contract.dtype_table,
    ):
        assert Path(module.__file__) in hashed  # sub-packages included
    assert Path(ROOT / "runtime" / "dtypes.py") in hashed
    assert len(cache.code_digest()) == 64


def test_an_hf_directory_is_keyed_by_its_config_and_weight_files(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    key = lambda: cache.table_key(f"hf:{d}", dict(batch=1, sizes={}))  # noqa: E731
    first = key()
    assert first is not None and key() == first
    (d / "README.md").write_text("notes")  # not a model file
    assert key() == first
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 32}')
    second = key()
    assert second != first
    (d / "model.safetensors").write_bytes(b"x" * 10)  # weights appear: the trace checks them
    third = key()
    assert third != second
    (d / "model.safetensors").write_bytes(b"x" * 11)
    assert key() != third


def test_a_bundle_is_not_cached(traces, tmp_path):
    bundle = build_model("gpt", ModelSizes(layers=2, hidden=64, heads=2, vocab=128), device="meta")
    build_layer_table(bundle, batch=1, seq_len=16)
    build_layer_table(bundle, batch=1, seq_len=16)
    assert traces.calls == 2 and entries(tmp_path) == []


def test_a_spec_without_a_key_reports_the_tracers_error(real_traces, tmp_path):
    spec = f"{tmp_path}/missing.py:make"
    assert cache.table_key(spec, {}) is None
    with pytest.raises(ModelError, match="does not exist"):  # the trace's own message, not the cache's
        build_layer_table(spec)
    assert real_traces.calls == 1 and entries(tmp_path) == []


# --------------------------------------------------------------------------------------------
# Bad entries and folders


def _corrupt_truncated(path: Path, key: str):
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _corrupt_garbage(path: Path, key: str):
    path.write_bytes(os.urandom(256))


def _corrupt_empty(path: Path, key: str):
    path.write_bytes(b"")


def _wrong_type(path: Path, key: str):
    path.write_bytes(pickle.dumps(["not", "a", "table"]))


def _with_symbolic(path: Path, change) -> None:
    """Apply ``change`` to the entry's symbolic table (pickled apart inside the entry)."""
    payload = pickle.loads(path.read_bytes())
    table = pickle.loads(payload["table"])
    change(table)
    payload["table"] = pickle.dumps(table)
    path.write_bytes(pickle.dumps(payload))


def _wrong_table(path: Path, key: str):
    _with_symbolic(path, lambda table: table.update(layers=[{"index": 0}]))


def _wrong_field_type(path: Path, key: str):
    _with_symbolic(path, lambda table: setattr(table["layers"][1], "param_count", "many"))


def _symbolic_garbage(path: Path, key: str):
    payload = pickle.loads(path.read_bytes())
    payload["table"] = os.urandom(64)
    path.write_bytes(pickle.dumps(payload))


def _wrong_record(path: Path, key: str):
    payload = pickle.loads(path.read_bytes())
    payload["compiled"]["rows"][0]["ints"]["param_count"] = "many"
    path.write_bytes(pickle.dumps(payload))


def _other_key(path: Path, key: str):
    payload = pickle.loads(path.read_bytes())
    payload["key"] = key.replace('"layers": 2', '"layers": 3')
    path.write_bytes(pickle.dumps(payload))


def _old_format(path: Path, key: str):
    payload = pickle.loads(path.read_bytes())
    payload["format"] = cache.FORMAT - 1
    path.write_bytes(pickle.dumps(payload))


def _missing_class(path: Path, key: str):
    path.write_bytes(b"cplanner.frontend.cache\nNoSuchClass\n.")  # a global that does not exist


@pytest.mark.parametrize(
    "damage",
    [
        _corrupt_truncated,
        _corrupt_garbage,
        _corrupt_empty,
        _wrong_type,
        _wrong_table,
        _wrong_field_type,
        _symbolic_garbage,
        _wrong_record,
        _other_key,
        _old_format,
        _missing_class,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_bad_entry_is_ignored_rebuilt_and_overwritten(damage, traces, tmp_path):
    first = build_layer_table("gpt", **GPT)
    [path] = entries(tmp_path)
    damage(path, pickle.loads(path.read_bytes())["key"])
    rejected = cache.stats["rejected"]
    again = build_layer_table("gpt", **GPT)
    # the comparison reads the symbolic table: where only that part is damaged, the compiled form
    # answered the hit and the damage is found (and the table traced again) on that first read
    assert again == first
    assert traces.calls == 2 and cache.stats["rejected"] == rejected + 1
    assert build_layer_table("gpt", **GPT) == first and traces.calls == 2  # overwritten with a good entry


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="chown needs root")
def test_an_entry_of_another_user_is_not_unpickled(traces, tmp_path):
    build_layer_table("gpt", **GPT)
    [path] = entries(tmp_path)
    os.chown(path, 12345, 12345)
    build_layer_table("gpt", **GPT)
    assert traces.calls == 2


def test_an_unwritable_cache_dir_still_plans(traces, monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(blocker / "cache"))  # under a file: nobody can create it
    unwritable = cache.stats["unwritable"]
    out = tmp_path / "plan.json"
    rc = main(
        [
            "plan",
            "--model",
            "gpt",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "2",
            "--vocab",
            "128",
            "--seq-len",
            "16",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--global-batch",
            "4",
            "--out",
            str(out),
        ]
    )
    assert rc == 0 and out.is_file() and traces.calls == 1
    assert cache.stats["unwritable"] == unwritable + 1
    assert "Traceback" not in capsys.readouterr().err


def test_a_failed_write_leaves_no_temporary_file(traces, tmp_path, monkeypatch):
    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(cache.os, "replace", fail)
    build_layer_table("gpt", **GPT)
    assert list((tmp_path / "cache" / "layer-tables").iterdir()) == []


@pytest.mark.parametrize("value", ["off", "0", "false", "NO"])
def test_planner_cache_off_bypasses_the_cache(value, traces, tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_CACHE", value)
    build_layer_table("gpt", **GPT)
    build_layer_table("gpt", **GPT)
    assert traces.calls == 2 and entries(tmp_path) == []


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "a"))
    assert cache.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("PLANNER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "planner"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "planner"


# --------------------------------------------------------------------------------------------
# What a hit costs


@pytest.mark.dist
def test_a_hit_imports_neither_transformers_nor_the_tracer(traces):
    """A re-plan is bound by import time: a cached ``hf:`` table must not import transformers
    (seconds) or ``torch._dynamo`` (what export needs)."""
    args = dict(batch=1, seq_len=16, dtype="fp32", layers=2, hidden=64, heads=2, kv_heads=1, ffn=96, vocab=128)
    table = build_layer_table("hf:llama", **args)  # stored under hf:llama's key (the stand-in's rows)
    code = (
        "import sys\n"
        "from planner.frontend import cache\n"
        "from planner.frontend.model_analysis import build_layer_table\n"
        f"t = build_layer_table('hf:llama', **{args!r})\n"
        "assert cache.stats['hit'] == 1, dict(cache.stats)\n"
        "print(len(t.layers), sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(maxsplit=1) == [str(len(table.layers)), "[]\n"]


# --------------------------------------------------------------------------------------------
# The compiled form a hit gives


def test_a_hit_is_the_compiled_form_with_the_symbolic_tables_numbers(traces, gpt_table):
    """``CompiledTable``: the same numbers at every (b, s), rows, integers and nonzero fields,
    without sympy; an expression (or ``to_json``) reads the symbolic table, once."""
    build_layer_table("gpt", **GPT)
    hit = build_layer_table("gpt", **GPT)
    assert isinstance(hit, CompiledTable) and hit._full is None
    for b, s in ((1, 16), (3, 16), (8, 16)):
        assert hit.numeric(b, s) == gpt_table.numeric(b, s)
    assert hit.total("fwd_flops", 2, 16) == gpt_table.total("fwd_flops", 2, 16)
    assert hit.nonzero_fields() == gpt_table.nonzero_fields() and "saved_bytes" in hit.nonzero_fields()
    assert [(row.index, row.name, row.kind, row.param_count) for row in hit.layers] == [
        (row.index, row.name, row.kind, row.param_count) for row in gpt_table.layers
    ]
    assert (hit.model, hit.fixed, hit.tied, hit.dtype) == (
        gpt_table.model,
        gpt_table.fixed,
        gpt_table.tied,
        gpt_table.dtype,
    )
    assert hit._full is None  # nothing above needed the symbolic table
    assert hit.layers[1].fwd_flops == gpt_table.layers[1].fwd_flops and hit._full is not None
    assert traces.calls == 1


def test_a_compiled_form_that_does_not_run_falls_back_to_the_symbolic_table(traces, tmp_path, gpt_table):
    build_layer_table("gpt", **GPT)
    [path] = entries(tmp_path)
    payload = pickle.loads(path.read_bytes())
    payload["compiled"]["source"] = "def _lambdifygenerated(b, s):\n    return ["  # a syntax error
    path.write_bytes(pickle.dumps(payload))
    hit = build_layer_table("gpt", **GPT)
    assert not isinstance(hit, CompiledTable) and hit == gpt_table and traces.calls == 1


def test_a_function_reading_more_than_math_is_not_compiled():
    """``function_source``: the generated code must mean the same when rebuilt from its text."""
    outside = {"scale": 3.0}

    def generated(b, s):
        return [b * s * scale]  # noqa: F821 - read from the namespace below

    reads_outside = type(generated)(generated.__code__, {**outside, "__builtins__": __builtins__}, "generated")
    assert function_source(reads_outside) is None

    def plain(b, s):
        return [max(b, s), math.floor(b / 2)]

    assert function_source(plain) is not None
