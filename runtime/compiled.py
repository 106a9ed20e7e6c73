"""Loading what ``planner compile`` wrote: the manifest and the per-stage modules.

A compiled directory holds ``manifest.json`` and ``stage_<k>.py`` files. The manifest records
the plan (degrees, micro-batching, ZeRO stage, dtype), which layer-table rows each stage runs,
what it receives and sends, and for every parameter of a stage module the original model's name
and how tensor parallelism shards it. Nothing here imports the planner.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from typing import Mapping

import torch

import runtime
from runtime.sharding import TensorShard

__all__ = ["CompiledError", "read_manifest", "load_stage_module", "load_weights", "param_groups",
           "MANIFEST", "FORMAT"]

MANIFEST = "manifest.json"
FORMAT = 1


class CompiledError(ValueError):
    """The compiled directory is missing, stale or does not match this runtime."""


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise CompiledError(f"{directory} holds no {MANIFEST}; run `planner compile plan.json --out {directory}`")
    try:
        with open(path, encoding="utf-8") as f:
            man = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CompiledError(f"cannot read {path}: {e}") from None
    if man.get("format") != FORMAT:
        raise CompiledError(f"{path} has format {man.get('format')!r}; this runtime reads format {FORMAT}. "
                            "Re-run `planner compile`.")
    need = man.get("runtime_version")
    if need != runtime.__version__:
        raise CompiledError(f"{directory} was compiled for runtime {need}, this is {runtime.__version__}; "
                            "re-run `planner compile`.")
    for st in man["stages"]:
        src = os.path.join(directory, st["file"])
        if not os.path.isfile(src):
            raise CompiledError(f"{src} is missing; re-run `planner compile`.")
        with open(src, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != st["sha256"]:
            raise CompiledError(f"{src} was modified after compilation (hash mismatch); re-run `planner compile` "
                                "or restore the file.")
    return man


def load_stage_module(directory: str, stage: dict, device: torch.device | str = "cpu") -> torch.nn.Module:
    """Import ``stage['file']`` and instantiate its stage class on ``device`` (uninitialized)."""
    path = os.path.join(directory, stage["file"])
    name = f"planner_compiled_{hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:12]}_{stage['index']}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    cls = getattr(mod, stage["class"])
    return cls(device=torch.device(device))


@torch.no_grad()
def load_weights(module: torch.nn.Module, stage: dict, state: Mapping[str, torch.Tensor],
                 tp_index: int = 0, tp: int = 1) -> None:
    """Copy the original model's tensors (by original name) into a stage module, sharding for tp."""
    own = dict(module.named_parameters())
    own.update(dict(module.named_buffers()))
    missing = [e["fqn"] for e in stage["params"].values() if e["fqn"] not in state]
    if missing:
        raise CompiledError(f"the state dict lacks {len(missing)} tensor(s) this stage needs, e.g. {missing[:3]}")
    for attr, entry in stage["params"].items():
        try:
            shard = TensorShard.from_dict(entry.get("shard"))
        except (ValueError, KeyError, TypeError) as e:
            raise CompiledError(f"{entry['fqn']}: the manifest's shard entry {entry.get('shard')!r} is "
                                f"malformed ({e}); compile the plan again") from None
        src = state[entry["fqn"]] if shard is None else shard.cut(state[entry["fqn"]], tp_index, tp)
        dst = own[attr]
        if tuple(src.shape) != tuple(dst.shape):
            raise CompiledError(f"{entry['fqn']}: shape {tuple(src.shape)} does not fit {attr} {tuple(dst.shape)}")
        dst.copy_(src.to(dst.dtype))


def param_groups(module: torch.nn.Module) -> list[list[str]]:
    """Parameter names grouped per layer (each ``layer_<i>`` child), in forward order."""
    groups: dict[str, list[str]] = {}
    for name, p in module.named_parameters():
        head = name.split(".", 1)[0] if "." in name else "__stage__"
        groups.setdefault(head, []).append(name)
    return list(groups.values())
