"""Where an expert parameter's rows live under expert parallelism, read from the compiled manifest.

A routed expert parameter is one ``[E, ...]`` tensor in the original model (transformers' grouped
``mlp.experts.gate_up_proj``, ``down_proj``). Under expert parallelism of degree ``ep`` the rank
with expert-parallel index ``r`` holds rows ``[r E/ep, (r+1) E/ep)`` of dim 0: a shard of the full
tensor along dim 0 over the expert-parallel group, as a tensor-parallel piece is a shard over
the tp group (``runtime.tensor_parallel.sharding.TensorShard``). Loading weights cuts the rows
(``cut``), a checkpoint joins the ep ranks' rows back into the full tensor (``join``) so that it is
saved once, whole, and loads at any other ep degree.

The manifest (written by ``planner compile``) says which parameters are routed experts:
``manifest["expert_parallel"] = {"degree": ep, "experts": E, "capacity_factor": F | null}`` and, per
stage parameter entry, ``"expert": true`` (its ``shape`` is the full ``[E, ...]``), or a list of the
routed parameters' names in ``expert_parallel["params"]`` (``mark_listed`` turns it into the
flags); an older or dense manifest has neither, and every parameter is then replicated as before.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from runtime.contract.input_errors import ConfigError
from runtime.moe.exchange import expert_slice

__all__ = ["is_expert", "expert_degree", "num_experts", "expert_attrs", "mark_listed", "cut", "join"]


def is_expert(entry: Mapping) -> bool:
    """Whether a manifest parameter entry is a routed expert parameter (sharded over ep)."""
    return bool(entry.get("expert", False))


def expert_degree(man: Mapping) -> int:
    """The plan's expert-parallel degree (1: experts replicated); the manifest's record must agree,
    and a degree above 1 needs routed expert parameters to cut."""
    planned = int(man["plan"].get("expert_parallel", 1) or 1)
    record = man.get("expert_parallel") or {}
    if record and int(record.get("degree", planned)) != planned:
        raise ConfigError(
            f"the compiled manifest shards experts over {record['degree']} ranks but the plan says expert_parallel "
            f"{planned}; compile the plan again"
        )
    if planned > 1 and not any(expert_attrs(stage) for stage in man.get("stages", ())):
        raise ConfigError(
            f"the plan says expert_parallel {planned} but the compiled manifest marks no parameter as a routed "
            "expert ('expert': true); compile the plan again with this planner"
        )
    return planned


def num_experts(man: Mapping) -> int | None:
    """Routed experts per MoE layer (None for a model without them)."""
    record = man.get("expert_parallel") or {}
    if record.get("experts"):
        return int(record["experts"])
    moe = (man["plan"].get("model") or {}).get("moe") or {}
    return int(moe["experts"]) if moe.get("experts") else None


def mark_listed(man: dict) -> dict:
    """Mark ``"expert": true`` every parameter entry that ``manifest["expert_parallel"]["params"]``
    names (by original name or attribute), the other way a manifest may list its routed experts;
    returns ``man``."""
    listed = set((man.get("expert_parallel") or {}).get("params") or ())
    if listed:
        for stage in man["stages"]:
            for attr, entry in stage["params"].items():
                if entry.get("fqn") in listed or attr in listed:
                    entry["expert"] = True
    return man


def expert_attrs(stage: Mapping) -> frozenset[str]:
    """The attribute names of a compiled stage's routed expert parameters."""
    return frozenset(attr for attr, entry in stage["params"].items() if is_expert(entry))


def cut(full: torch.Tensor, ep_index: int, ep: int, name: str = "an expert parameter") -> torch.Tensor:
    """Rank ``ep_index``'s rows of a full ``[E, ...]`` expert tensor (a view; ``ep == 1``: all of it)."""
    if ep == 1:
        return full
    if full.dim() == 0 or full.shape[0] % ep:
        raise ConfigError(
            f"{name} of shape {tuple(full.shape)} cannot be split over {ep} expert-parallel ranks along dim 0"
        )
    return full[expert_slice(full.shape[0], ep, ep_index)]


def join(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full ``[E, ...]`` tensor from every expert-parallel rank's rows, in ``ep_index`` order."""
    if not pieces:
        raise ValueError("join needs the rows of at least one expert-parallel rank")
    shapes = {tuple(piece.shape[1:]) for piece in pieces}
    if len(shapes) != 1 or len({piece.shape[0] for piece in pieces}) != 1:
        raise ValueError(f"expert slices of different shapes cannot be joined: {[tuple(p.shape) for p in pieces]}")
    return pieces[0] if len(pieces) == 1 else torch.cat(list(pieces), 0)
