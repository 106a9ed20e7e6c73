"""``planner export weights CKPT --out model.safetensors``: one consolidated state dict.

Reads a training checkpoint written by ``planner train --checkpoint-dir`` (a ``step-N`` folder,
or the checkpoint directory itself, whose newest checkpoint is taken) without any process group,
and writes the fp32 weights under the original model's parameter names, loadable with
``model.load_state_dict(safetensors.torch.load_file(...), strict=False)``.
"""

from __future__ import annotations

import os

from planner.errors import UserError

__all__ = ["export_weights"]


def _resolve(path: str) -> str:
    from runtime.checkpoint_io import list_checkpoints

    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    found = list_checkpoints(path)
    if not found:
        raise UserError(f"{path} is neither a checkpoint (step-N folder with meta.json) nor a directory "
                        "holding finished checkpoints.")
    return found[-1][1]


def export_weights(checkpoint: str, out: str) -> int:
    from runtime.checkpoint_io import CheckpointError, load_model_tensors

    if not os.path.exists(checkpoint):
        raise UserError(f"checkpoint {checkpoint!r} does not exist.")
    path = _resolve(checkpoint)
    try:
        tensors = load_model_tensors(path)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("export weights needs the safetensors package: pip install safetensors") from None
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
