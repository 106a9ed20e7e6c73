"""``planner compile``: export the plan's model (front end) and lower it into stage files (codegen)."""

from __future__ import annotations

from torch import fx

from codegen.stage_files import ExportedModel, check_out_dir, compile_exported
from passes.attention import attention_facts
from passes.causal_rewrite import causal_verdicts, explicit_causal_mask, probe_length, sdpa_cores
from planner.frontend.bundle import ModelBundle
from planner.frontend.frontend_errors import ModelError
from planner.frontend.hf import config_windows
from planner.frontend.trace import export_training_module
from planner.plan import Plan, load_plan
from runtime.training.data import data_vocab

__all__ = ["compile_plan", "model_dims", "run_compile"]


def model_dims(bundle: ModelBundle, sizes: dict, gm: fx.GraphModule | None = None) -> dict[str, int]:
    """The sizes tensor parallelism must divide: the bundle's hidden, heads, kv_heads, vocab and
    the ``ffn`` size flag, where known (non-zero); heads, kv_heads and head_dim the bundle does not
    state are read from the attention of the exported graph ``gm`` (``passes.attention``)."""
    dims = {"hidden": bundle.hidden, "heads": bundle.heads, "kv_heads": bundle.kv_heads, "vocab": bundle.vocab}
    dims.update({k: size for k, size in (sizes or {}).items() if k == "ffn"})
    if gm is not None:
        facts = attention_facts(gm)
        for k in ("heads", "kv_heads", "head_dim"):
            if facts.get(k) and not dims.get(k):
                dims[k] = facts[k]
    return {k: size for k, size in dims.items() if size}


def causal_cores(plan: Plan, bundle: ModelBundle, gm: fx.GraphModule) -> list[bool] | None:
    """Which SDPA cores of ``gm`` get ``is_causal``, decided as the planner decided
    (``passes.analyze``): each mask read from an export at batch 1 and the planner's probe length
    (past every window the config states), not at the plan's length, whose ``b s^2`` mask could
    be too large to build. None when no core has an explicit mask it could apply to."""
    cores = sdpa_cores(gm)
    if not any(explicit_causal_mask(core, {}) is not None for core in cores):
        return None
    s = probe_length([w for w in config_windows(bundle.model, plan.model.layers) or () if w])
    if s is None:
        return [False] * len(cores)
    sizes = dict(plan.model.sizes)
    if "seq_len" in sizes:  # positions for the probe's length (the mask does not depend on them)
        sizes["seq_len"] = max(int(sizes["seq_len"]), s)
    try:
        short, _, _ = export_training_module(plan.model.spec, sizes, dtype=plan.dtype, batch=1, seq_len=s)
    except ModelError:
        if plan.seq_len >= s:
            raise
        # positions fixed by a model directory's weights below the probe's length: the plan's own
        # (shorter) length, at which the compiled mask is exactly what is read
        short, _, _ = export_training_module(
            plan.model.spec, plan.model.sizes, dtype=plan.dtype, batch=1, seq_len=plan.seq_len
        )
    return causal_verdicts(short)


def compile_plan(plan: Plan, out_dir: str) -> dict:
    """Write ``stage_<k>.py`` per pipeline stage and ``manifest.json`` into ``out_dir``; return
    the manifest. A context-parallel plan is exported at the length one rank holds, ``seq_len / cp``
    (``codegen.context_rewrite``). An ``out_dir`` that cannot be a folder is refused before the
    model is exported (``codegen.stage_files.check_out_dir``)."""
    check_out_dir(out_dir)
    gm, block_paths, bundle = export_training_module(
        plan.model.spec,
        plan.model.sizes,
        dtype=plan.dtype,
        batch=plan.micro_batch_size,
        seq_len=plan.seq_len // plan.cp,
    )
    vocab = bundle.vocab or data_vocab(plan.model.inputs, 0)  # a user's model: what its token inputs index
    model = ExportedModel(
        module=gm,
        block_paths=block_paths,
        vocab=vocab,
        dims=model_dims(bundle, plan.model.sizes, gm),
        causal_cores=causal_cores(plan, bundle, gm),
        windows=config_windows(bundle.model, plan.model.layers),
    )
    return compile_exported(plan, model, out_dir)


def run_compile(args) -> int:
    """``planner compile plan.json --out DIR``."""
    manifest = compile_plan(load_plan(args.plan), args.out)
    files = ", ".join(stage["file"] for stage in manifest["stages"])
    print(f"Compiled {args.plan} into {args.out}: {files} + manifest.json (plan {manifest['plan_hash']}).")
    return 0
