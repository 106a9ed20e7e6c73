"""``planner export``: a plan as a DeepSpeed config, a checkpoint as one safetensors file or as an
HF model directory.

``export deepspeed plan.json`` writes the equivalent ``ds_config.json`` (``planner.report.deepspeed``).
``export weights CKPT --out model.safetensors`` reads a training checkpoint written by
``planner train --checkpoint-dir`` (a ``step-N`` folder, or the checkpoint directory itself, whose
newest checkpoint is taken) without any process group, and writes the fp32 weights under the
original model's parameter names, loadable with
``model.load_state_dict(safetensors.torch.load_file(...), strict=False)``.
``export hf CKPT --out DIR`` writes the checkpoint of an ``hf:`` model (a built-in or a model
directory) as ``config.json`` + ``model.safetensors`` (tied weights stored once, as transformers
does), loadable with ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``
(``AutoModelForMaskedLM`` for ``hf:bert``); a source directory's tokenizer files are copied along.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from safetensors.torch import save_file

from planner.errors import UserError
from planner.frontend.bundle import parse_spec
from planner.frontend.checkpoint import PREFIX
from planner.frontend.frontend_errors import ModelError
from planner.frontend.hf import hf_directory, load_hf_config
from planner.frontend.zoo import ModelSizes, build_model
from planner.plan import load_plan
from planner.report.deepspeed import launcher_command, to_deepspeed
from runtime.checkpointing.checkpoint_io import CheckpointError, list_checkpoints, load_model_tensors, read_meta

__all__ = ["export_weights", "export_deepspeed", "export_hf", "run_export"]


def _resolve(path: str) -> str:
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    found = list_checkpoints(path)
    if not found:
        raise UserError(
            f"{path} is neither a checkpoint (step-N folder with meta.json) nor a directory "
            "holding finished checkpoints."
        )
    return found[-1][1]


def export_weights(checkpoint: str, out: str) -> int:
    if not os.path.exists(checkpoint):
        raise UserError(f"checkpoint {checkpoint!r} does not exist.")
    path = _resolve(checkpoint)
    try:
        tensors = load_model_tensors(path)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    tmp = out + ".tmp"
    try:
        save_file(
            {k: tensor.contiguous() for k, tensor in sorted(tensors.items())},
            tmp,
            metadata={"source": os.path.abspath(path), "format": "pt"},
        )
        os.replace(tmp, out)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f"cannot write {out}: {e}") from None
    return len(tensors)


#: Files of a source model directory copied into an export (the tokenizer travels with the model).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def _read_checkpoint(checkpoint: str) -> tuple[str, dict]:
    if not os.path.exists(checkpoint):
        raise UserError(f"checkpoint {checkpoint!r} does not exist.")
    path = _resolve(checkpoint)
    try:
        return path, read_meta(path)
    except CheckpointError as e:
        raise UserError(str(e)) from None


def export_hf(checkpoint: str, out: str) -> str:
    """Write a checkpoint of an ``hf:`` model as an HF model directory ``out``; return the
    architecture's class name. The config is the plan's model config (for a model directory: its
    own config.json with the plan's size overrides; the dropout, cache and (in-vocabulary)
    special-token settings that training overrides are restored)."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UserError(f"{out} already exists and is not an empty directory; choose another --out or remove it.")
    path, meta = _read_checkpoint(checkpoint)
    spec, sizes = meta.get("model", {}).get("spec", ""), dict(meta.get("model", {}).get("sizes") or {})
    try:
        kind, name = parse_spec(spec)
    except ModelError:
        kind, name = "", ""
    if kind != "hf":
        raise UserError(
            f"checkpoint {path} is of model {spec!r}; `export hf` writes hf: models only "
            "(use `planner export weights` for a safetensors file of any model)."
        )
    try:
        directory = hf_directory(name)
    except ModelError:
        raise UserError(
            f"checkpoint {path} was trained from the model directory {name!r}, which does not "
            "exist here; its config.json is needed to export. Restore it, or run from the "
            "directory the plan was made in."
        ) from None
    try:
        tensors = load_model_tensors(path)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    state = {k[len(PREFIX) :]: tensor for k, tensor in tensors.items() if k.startswith(PREFIX)}
    inner: Any = build_model(
        spec, ModelSizes(**sizes)
    ).model.inner  # an HF PreTrainedModel; fresh, then overwritten; real buffers (inv_freq)
    groups: dict[int, list[str]] = {}
    for param_name, param in inner.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(param_name)
    weights = {}
    for aliases in groups.values():  # a tied weight was saved under one of its names
        found = next((alias for alias in aliases if alias in state), None)
        if found is None:
            raise UserError(
                f"checkpoint {path} has no tensor {PREFIX + aliases[0]!r}; it was not saved from {spec!r} {sizes}."
            )
        weights[aliases[0]] = state[found]
    try:
        inner.load_state_dict(weights, strict=False)
    except RuntimeError as e:
        raise UserError(f"checkpoint {path} does not fit {spec!r} {sizes}: {str(e).splitlines()[-1]}") from None
    if directory is not None:  # the user's settings the planner overrode for training
        original = load_hf_config(directory).to_dict()
        for attr, value in original.items():
            if ("dropout" in attr or attr.endswith("pdrop") or attr == "use_cache") and hasattr(inner.config, attr):
                setattr(inner.config, attr, value)
            elif attr in ("bos_token_id", "eos_token_id", "pad_token_id") and (
                not isinstance(value, int) or value < inner.config.vocab_size
            ):
                setattr(inner.config, attr, value)
    else:
        inner.config.use_cache = True
    inner.config.architectures = [type(inner).__name__]
    tmp = out.rstrip(os.sep) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        inner.save_pretrained(tmp, safe_serialization=True)
        if directory is not None:
            for f in _TOKENIZER_FILES:
                if os.path.isfile(os.path.join(directory, f)):
                    shutil.copy2(os.path.join(directory, f), os.path.join(tmp, f))
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write {out}: {e}") from None
    return type(inner).__name__


def export_deepspeed(plan_path: str, out: str, nvme_path: str | None = None) -> str:
    """Write the DeepSpeed config equivalent to a plan (atomically); return the launch command.
    ``nvme_path``: the node-local drive of a plan that offloads to NVMe."""
    plan = load_plan(plan_path)
    cfg = to_deepspeed(plan, nvme_path)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    os.replace(tmp, out)
    return launcher_command(plan, out)


def run_export(args) -> int:
    """``planner export deepspeed|weights|hf ...``."""
    if args.format == "deepspeed":
        command = export_deepspeed(args.plan, args.out, getattr(args, "nvme_path", None))
        print(f"Wrote {args.out}. Launch with:\n  {command}")
        return 0
    if args.format == "hf":
        cls = export_hf(args.checkpoint, args.out)
        print(
            f"Wrote {args.out} ({cls}: config.json + model.safetensors); load it with "
            f"transformers' from_pretrained({args.out!r})."
        )
        return 0
    count = export_weights(args.checkpoint, args.out)
    print(f"Wrote {args.out} ({count} tensors, original model names).")
    return 0
