"""``planner export``: a plan as a DeepSpeed config, or a checkpoint as one safetensors file.

``export deepspeed plan.json`` writes the equivalent ``ds_config.json`` (``planner.report.deepspeed``).
``export weights CKPT --out model.safetensors`` reads a training checkpoint written by
``planner train --checkpoint-dir`` (a ``step-N`` folder, or the checkpoint directory itself, whose
newest checkpoint is taken) without any process group, and writes the fp32 weights under the
original model's parameter names, loadable with
``model.load_state_dict(safetensors.torch.load_file(...), strict=False)``.
"""

from __future__ import annotations

import json
import os

from safetensors.torch import save_file

from planner.errors import UserError
from planner.plan import load_plan
from planner.report.deepspeed import launcher_command, to_deepspeed
from runtime.checkpoint_io import CheckpointError, list_checkpoints, load_model_tensors

__all__ = ["export_weights", "export_deepspeed", "run_export"]


def _resolve(path: str) -> str:
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    found = list_checkpoints(path)
    if not found:
        raise UserError(f"{path} is neither a checkpoint (step-N folder with meta.json) nor a directory "
                        "holding finished checkpoints.")
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
        save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, tmp,
                  metadata={"source": os.path.abspath(path), "format": "pt"})
        os.replace(tmp, out)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f"cannot write {out}: {e}") from None
    return len(tensors)


def export_deepspeed(plan_path: str, out: str) -> str:
    """Write the DeepSpeed config equivalent to a plan (atomically); return the launch command."""
    plan = load_plan(plan_path)
    cfg = to_deepspeed(plan)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    os.replace(tmp, out)
    return launcher_command(plan, out)


def run_export(args) -> int:
    """``planner export deepspeed|weights ...``."""
    if args.format == "deepspeed":
        command = export_deepspeed(args.plan, args.out)
        print(f"Wrote {args.out}. Launch with:\n  {command}")
        return 0
    n = export_weights(args.checkpoint, args.out)
    print(f"Wrote {args.out} ({n} tensors, original model names).")
    return 0
