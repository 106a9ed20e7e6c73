"""Loading what ``planner compile`` wrote: the manifest and the per-stage modules.

A compiled directory holds ``manifest.json`` and ``stage_<k>.py`` files. The manifest records
the plan (degrees, micro-batching, ZeRO stage, dtype), which layer-table rows each stage runs,
what it receives and sends, and for every parameter of a stage module the original model's name
and how tensor parallelism shards it. Nothing here imports the planner.

Model chunks. A plan with ``virtual_stages = v > 1`` compiles one file per model chunk (the
manifest's ``stages`` are then the ``p * v`` chunks in model order, chunk ``k`` on pipeline rank
``k % p``, recorded as its ``pp_rank``). A rank runs its chunks ``r, r + p, ...`` (``rank_chunks``)
under one ZeRO engine whose module is an ``nn.ModuleList`` of them: a parameter's engine name is
then ``"<j>.<attr>"`` for local chunk ``j`` (``rank_params``), its bare ``attr`` when ``v = 1``.
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
from runtime.moe import expert_shards
from runtime.tensor_parallel.sharding import TensorShard

__all__ = [
    "CompiledError",
    "read_manifest",
    "load_stage_module",
    "load_weights",
    "param_groups",
    "rank_chunks",
    "rank_params",
    "MANIFEST",
    "FORMAT",
]

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
        raise CompiledError(
            f"{path} has format {man.get('format')!r}; this runtime reads format {FORMAT}. Re-run `planner compile`."
        )
    need = man.get("runtime_version")
    if need != runtime.__version__:
        raise CompiledError(
            f"{directory} was compiled for runtime {need}, this is {runtime.__version__}; re-run `planner compile`."
        )
    for stage in man["stages"]:
        src = os.path.join(directory, stage["file"])
        if not os.path.isfile(src):
            raise CompiledError(f"{src} is missing; re-run `planner compile`.")
        with open(src, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != stage["sha256"]:
            raise CompiledError(
                f"{src} was modified after compilation (hash mismatch); re-run `planner compile` or restore the file."
            )
    expert_shards.mark_listed(man)
    return man


def load_stage_module(directory: str, stage: dict, device: torch.device | str = "cpu") -> torch.nn.Module:
    """Import ``stage['file']`` and instantiate its stage class on ``device`` (uninitialized)."""
    path = os.path.join(directory, stage["file"])
    name = f"planner_compiled_{hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:12]}_{stage['index']}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CompiledError(f"cannot import the stage file {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    cls = getattr(mod, stage["class"])
    return cls(device=torch.device(device))


def _shard_ranges(shard: TensorShard, n: int, tp_index: int, tp: int) -> tuple[list[tuple[int, int]], int]:
    """Where rank ``tp_index``'s piece lies in the original tensor: the ``[start, stop)`` ranges of
    ``shard.dim`` (of ``n`` entries) to read and concatenate, and the zero rows to append (a padded
    vocabulary's last rank); the same piece as ``shard.cut``."""
    if shard.kind == "qkv":
        ranges, off = [], 0
        for part in shard.part_sizes:
            if part % tp:
                raise CompiledError(f"cannot shard a fused part of {part} entries over {tp} tensor-parallel ranks")
            k = part // tp
            ranges.append((off + tp_index * k, off + (tp_index + 1) * k))
            off += part
        return ranges, 0
    if shard.padded is not None and shard.padded != n:
        k = shard.padded // tp
        start, stop = min(tp_index * k, n), min((tp_index + 1) * k, n)
        return [(start, stop)], k - (stop - start)
    if n % tp:
        raise CompiledError(f"cannot shard {n} entries over {tp} tensor-parallel ranks: {n} is not divisible by {tp}")
    k = n // tp
    return [(tp_index * k, (tp_index + 1) * k)], 0


def _read_shard(source, shard: TensorShard, tp_index: int, tp: int) -> torch.Tensor:
    """This rank's piece read from a lazy ``source`` (``source[idx]`` reads a tuple of slices,
    ``source.get_shape()`` the full shape: safetensors' slice API) without reading the rest."""
    shape = list(source.get_shape())
    dim = shard.dim % len(shape)
    ranges, pad = _shard_ranges(shard, shape[dim], tp_index, tp)
    lead = (slice(None),) * dim
    pieces = [source[lead + (slice(begin, stop),)] for begin, stop in ranges if stop > begin]
    if pad:
        pad_shape = list(shape)
        pad_shape[dim] = pad
        dtype = pieces[0].dtype if pieces else torch.float32
        pieces.append(torch.zeros(pad_shape, dtype=dtype))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


@torch.no_grad()
def load_weights(
    module: torch.nn.Module,
    stage: dict,
    state: Mapping[str, torch.Tensor],
    tp_index: int = 0,
    tp: int = 1,
    ep_index: int = 0,
    ep: int = 1,
) -> None:
    """Copy the original model's tensors (by original name) into a stage module, sharding for tp
    and, for a routed expert parameter (``"expert": true``), keeping this expert-parallel rank's
    rows of dim 0 (``runtime.moe.expert_shards``) before any tp cut.

    ``state`` maps original names to tensors. When it also has ``get_slice(name)`` (a lazy
    reader, e.g. of safetensors files), each tensor-parallel shard is read as just the
    rows/columns of this rank's piece: ``get_slice(name)[idx]`` for a tuple of slices ``idx``,
    ``get_slice(name).get_shape()`` the full shape (``KeyError``: read it whole instead).
    """
    own: dict[str, torch.Tensor] = dict(module.named_parameters())
    own.update(dict(module.named_buffers()))
    missing = [e["fqn"] for e in stage["params"].values() if e["fqn"] not in state]
    if missing:
        raise CompiledError(f"the state dict lacks {len(missing)} tensor(s) this stage needs, e.g. {missing[:3]}")
    lazy = getattr(state, "get_slice", None)
    for attr, entry in stage["params"].items():
        try:
            shard = TensorShard.from_dict(entry.get("shard"))
        except (ValueError, KeyError, TypeError) as e:
            raise CompiledError(
                f"{entry['fqn']}: the manifest's shard entry {entry.get('shard')!r} is "
                f"malformed ({e}); compile the plan again"
            ) from None
        if expert_shards.is_expert(entry) and ep > 1:
            src = _expert_rows(state, entry["fqn"], ep_index, ep)
            src = src if shard is None else shard.cut(src, tp_index, tp)
            _copy_into(own[attr], src, entry["fqn"], attr)
            continue
        source = None
        if shard is not None and tp > 1 and lazy is not None:
            try:
                source = lazy(entry["fqn"])
            except KeyError:
                source = None
        if source is not None and shard is not None:
            src = _read_shard(source, shard, tp_index, tp)
        else:
            src = state[entry["fqn"]] if shard is None else shard.cut(state[entry["fqn"]], tp_index, tp)
        _copy_into(own[attr], src, entry["fqn"], attr)


def _copy_into(dst: torch.Tensor, src: torch.Tensor, fqn: str, attr: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise CompiledError(f"{fqn}: shape {tuple(src.shape)} does not fit {attr} {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def _expert_rows(state: Mapping[str, torch.Tensor], fqn: str, ep_index: int, ep: int) -> torch.Tensor:
    """Rank ``ep_index``'s rows of the expert tensor ``fqn``: read alone through a lazy reader's
    ``get_slice`` when there is one, else cut from the whole tensor."""
    lazy = getattr(state, "get_slice", None)
    if lazy is not None:
        try:
            source = lazy(fqn)
            experts = list(source.get_shape())[0]
        except KeyError:
            source = None
        if source is not None:
            if experts % ep:
                raise CompiledError(f"{fqn}: {experts} experts cannot be split over {ep} expert-parallel ranks")
            rows = experts // ep
            return source[(slice(ep_index * rows, (ep_index + 1) * rows),)]
    try:
        return expert_shards.cut(state[fqn], ep_index, ep, fqn)
    except ValueError as e:
        raise CompiledError(str(e)) from None


def param_groups(module: torch.nn.Module) -> list[list[str]]:
    """Parameter names grouped per layer (each ``layer_<i>`` child), in forward order."""
    groups: dict[str, list[str]] = {}
    for name, _param in module.named_parameters():
        head = name.split(".", 1)[0] if "." in name else "__stage__"
        groups.setdefault(head, []).append(name)
    return list(groups.values())


def virtual_stages(man: dict) -> int:
    """Model chunks per pipeline rank of a compiled plan (1 for manifests without chunks)."""
    return int(man["plan"].get("virtual_stages", 1))


def rank_chunks(man: dict, pp_index: int) -> list[dict]:
    """The manifest entries pipeline rank ``pp_index`` runs, in model order: its stage, or with
    ``v > 1`` model chunks its chunks ``pp_index, pp_index + p, ...``."""
    pp, chunk_count = man["plan"]["pp"], virtual_stages(man)
    if len(man["stages"]) != pp * chunk_count:
        raise CompiledError(
            f"the manifest lists {len(man['stages'])} stage files for pp={pp} x virtual_stages={chunk_count}; "
            "re-run `planner compile`."
        )
    return [man["stages"][chunk] for chunk in range(pp_index, pp * chunk_count, pp)]


def rank_params(man: dict, pp_index: int) -> dict[str, tuple[int, dict]]:
    """Every parameter of rank ``pp_index``'s module by its engine name (module docstring), with the
    index of the manifest entry (stage or model chunk) that holds it and its manifest entry."""
    chunks = rank_chunks(man, pp_index)
    if len(chunks) == 1:
        return {attr: (chunks[0]["index"], e) for attr, e in chunks[0]["params"].items()}
    return {f"{j}.{attr}": (stage["index"], e) for j, stage in enumerate(chunks) for attr, e in stage["params"].items()}
