"""Every causal-LM architecture of the installed transformers, tiny, through the CLI as a user runs it.

Plain script (about 25 minutes to plan all of them on 2 shared cores, about 45 more to train them)::

    .venv/bin/python benchmarks/scan_transformers.py [--types llama,gpt_oss] [--pins "--tp 2"]
        [--train] [--out DIR]

For each model type with a causal-LM class (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), it saves a
tiny config (2 blocks of hidden 64, 4 heads, vocabulary 512, 4 experts where the config has
experts: every size the config class has, the rest at its defaults) with ``save_pretrained``,
then runs ``planner plan --model hf:DIR`` on 2 devices of an A100 node (global batch 4, sequence
32, plus ``--pins``) and, with ``--train``, ``planner train plan.json --nproc 2 --steps 2``. One
line per type: ``ok`` with the plan's degrees (and the final loss), ``ERR`` with the CLI's error
line, or ``TRACEBACK``: a defect (the CLI must answer bad input with one line and no traceback).

Tiny configs are careless input on purpose: some are inconsistent (a rotary width set apart from
the head size), and the answer to those is a clear error, not a plan. Encoder-decoder and
multimodal types are refused by name. The script exits 1 when any line is a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Sizes a tiny config gets, for each attribute its class has (names vary by family).
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    n_layer=2,
    n_embd=64,
    n_head=4,
    n_positions=256,
    max_position_embeddings=256,
    num_layers=2,
    d_model=64,
    ffn_dim=128,
    n_inner=128,
    num_heads=4,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=1,  # DeepSeek-style routing picks groups of experts first: 4 experts in 1 group
    topk_group=1,
)


def tiny_config(model_type: str, directory: str) -> str | None:
    """Save ``model_type``'s tiny config under ``directory``; the reason when its class refuses."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    try:
        defaults = cls()
    except Exception as e:  # noqa: BLE001 - any config class's own validation
        return _reason(e)
    sizes = {name: value for name, value in TINY.items() if _has(defaults, name)}
    if _has(defaults, "qk_rope_head_dim"):  # latent attention: one key/value head per query head
        sizes.pop("num_key_value_heads", None)  # and its head_dim is its rotary width, left as is
    elif _has(defaults, "head_dim") and defaults.head_dim is not None and _settable(cls, "head_dim"):
        sizes["head_dim"] = 16  # hidden / heads (Falcon derives it: a property without a setter)
    if _has(defaults, "expand") and _has(defaults, "n_groups") and getattr(defaults, "expand", None):
        # Mamba-2's mixer: heads x head size = expand x hidden, in groups that divide the heads
        sizes.update(num_heads=defaults.expand * TINY["hidden_size"] // 16, n_groups=1)
    # A class that checks its sizes against per-layer lists (GPT-Neo's attention types, hybrid
    # layouts) refuses a changed depth: then keep its depth, and at last its every size but the
    # vocabulary; one that routes each token to one expert (ZAYA) refuses two.
    depth = {"num_hidden_layers", "n_layer", "num_layers"}
    attempts = [
        sizes,
        {**sizes, "num_experts_per_tok": 1} if "num_experts_per_tok" in sizes else sizes,
        {k: v for k, v in sizes.items() if k not in depth},
        {"vocab_size": TINY["vocab_size"]},
    ]
    for attempt in attempts:
        try:
            cls(**attempt).save_pretrained(directory)
            return None
        except Exception as e:  # noqa: BLE001 - any config class's own validation
            refused = _reason(e)
    return refused


def _reason(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"


def _has(config, name: str) -> bool:
    """``hasattr`` that also says no where the attribute raises otherwise (Gemma-4's per-layer
    sizes refuse a global read)."""
    try:
        getattr(config, name)
    except Exception:  # noqa: BLE001 - AttributeError or a config's own refusal
        return False
    return True


def _settable(cls: type, name: str) -> bool:
    """Whether a config class takes ``name`` as a keyword (not a read-only property)."""
    attribute = getattr(cls, name, None)
    return not isinstance(attribute, property) or attribute.fset is not None


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    return done.returncode, done.stdout + done.stderr


def verdict(rc: int, out: str) -> str:
    """``ok``, ``ERR: <the error line>`` or ``TRACEBACK: <the exception>``."""
    if "Traceback (most recent call last)" in out:
        last = [line for line in out.splitlines() if line and not line.startswith(" ")]
        return "TRACEBACK: " + (last[-1][:200] if last else "")
    if rc != 0:
        errors = [line for line in out.splitlines() if "error" in line.lower()]
        return "ERR: " + (errors[0][:250] if errors else f"exit {rc}")
    return "ok"


def scan_one(model_type: str, out_dir: str, pins: list[str], train: bool) -> str:
    directory = os.path.join(out_dir, model_type)
    refused = tiny_config(model_type, directory)
    if refused is not None:
        return f"config refused ({refused})"
    plan = os.path.join(out_dir, f"{model_type}.plan.json")
    started = time.perf_counter()
    cmd = [PY, "-m", "planner", "plan", "--model", f"hf:{directory}", "--gpus", "2", "--gpus-per-node", "2"]
    cmd += ["--hardware", "a100-80gb", "--global-batch", "4", "--seq-len", "32", *pins, "--out", plan]
    rc, out = _run(cmd, timeout=300)
    line = f"plan {time.perf_counter() - started:.0f} s: {verdict(rc, out)}"
    if rc != 0:
        return line
    with open(plan) as f:
        got = json.load(f)
    line += f" dp{got['dp']} tp{got['tp']} pp{got['pp']} zero{got['zero_stage']}"
    if train:
        rc, out = _run([PY, "-m", "planner", "train", plan, "--nproc", "2", "--steps", "2"], timeout=600)
        losses = [line for line in out.splitlines() if line.startswith("done:")]
        line += f"; train: {verdict(rc, out)}" + (f" ({losses[-1]})" if rc == 0 and losses else "")
    return line


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", help="comma-separated model types (default: every causal-LM type)")
    ap.add_argument("--pins", default="", help='plan flags added to every plan, e.g. "--tp 2"')
    ap.add_argument("--train", action="store_true", help="train each plan 2 steps on 2 gloo ranks")
    ap.add_argument("--out", help="where the configs and plans go (default: a temporary folder)")
    args = ap.parse_args(argv)
    types = args.types.split(",") if args.types else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    out_dir = args.out or tempfile.mkdtemp(prefix="scan-transformers-")
    tracebacks = 0
    for model_type in types:
        line = scan_one(model_type, out_dir, args.pins.split(), args.train)
        tracebacks += "TRACEBACK" in line
        print(f"{model_type}: {line}", flush=True)
    print(f"{len(types)} types, {tracebacks} tracebacks; configs and plans in {out_dir}")
    return 1 if tracebacks else 0


if __name__ == "__main__":
    sys.exit(main())
