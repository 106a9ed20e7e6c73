"""Weights tied across pipeline stages (Megatron's embedding group).

A weight read by layers of several stages (a tied token embedding and LM head) is compiled as a
parameter of every stage that reads it; the manifest marks each copy with ``"tied": [stages]``.
All copies start from the same original tensor. After backward every copy holds only its own
stage's gradient; the ZeRO engine sums them over the *tied group* (the ranks of those stages with
the same dp and tp coordinates, ``runtime.distributed.mesh``) before clipping and the optimizer step, so the
copies receive the same update and stay identical. At tp > 1 each rank holds the same vocabulary
shard on every stage and sums only that shard. With model chunks (``virtual_stages > 1``) the
holders are chunks and the group is made of the ranks that run them (``holder_ranks``). Two
chunks of one rank may both read the weight (Zamba's attention block, shared by every hybrid
layer, under an interleaved schedule): the rank's engine then holds two copies, sums their
gradients locally, all-reduces the sum over the group once and gives it back to every copy
(``tied_flat_groups`` pairs each copy with its weight's key). The gradient norm counts the
weight on the first holder only, and a checkpoint stores it once (the first holder writes it,
``runtime.checkpointing.checkpoint_io``).
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

from runtime.data_parallel.flat_shards import FlatGroup, ZeroError
from runtime.distributed import comm

__all__ = ["tied_params", "tied_stage_sets", "holder_ranks", "isolate_tied", "tied_flat_groups"]


def tied_params(stage: dict) -> dict[str, tuple[int, ...]]:
    """``attr -> holder stages`` for the trainable tied weights of one manifest stage entry (a
    buffer read in several stages is only copied: it has no gradient to sum)."""
    return {
        attr: tuple(int(k) for k in e["tied"])
        for attr, e in stage["params"].items()
        if len(e.get("tied") or ()) > 1 and e.get("trainable", True)
    }


def holder_ranks(manifest: dict, holders: Sequence[int]) -> tuple[int, ...]:
    """The pipeline ranks of a tied weight's holders (manifest entries: stages, or model chunks whose
    ``pp_rank`` says where they run), each once and in order: the members of its tied group (a
    rank running two holders sums their copies first, ``tied_flat_groups``)."""
    return tuple(sorted({int(manifest["stages"][k].get("pp_rank", k)) for k in holders}))


def tied_stage_sets(manifest: dict) -> list[tuple[int, ...]]:
    """The distinct holder sets (pipeline ranks) of all tied weights, in a fixed order (every rank
    computes the same list, so every rank creates the same process groups in the same order)."""
    sets = {holder_ranks(manifest, holders) for stage in manifest["stages"] for holders in tied_params(stage).values()}
    return sorted(sets)


def isolate_tied(groups: Sequence[Sequence[str]], tied: Mapping[str, object]) -> list[list[str]]:
    """``groups`` with each tied parameter moved into a group of its own (placed first), so that its
    flat buffer, padding and dp shards are the same on every stage that holds it."""
    out = [[name] for name in tied]
    out += [[n for n in group if n not in tied] for group in groups]
    return [group for group in out if group]


def tied_flat_groups(
    groups: Sequence[FlatGroup], tied: Mapping[str, tuple[object, bool]], keys: Mapping[str, str] | None = None
) -> list[tuple[FlatGroup, object, str]]:
    """The ZeRO groups of the tied parameters ``name -> (tied group, counted in the norm)``, each
    with its process group (None when the group has one rank) and its weight's key (``keys``:
    the same key for the copies of one weight that this rank holds, one per model chunk reading
    it; the name itself by default). A copy that another holder counts gets empty
    ``norm_ranges``, so the gradient norm counts the weight once. Left out: a copy with nothing
    to sum, alone on its rank in a group of one."""
    keys = keys or {}
    copies = Counter(keys.get(name, name) for name in tied)
    out = []
    for name, (process_group, counted) in tied.items():
        group = next((group for group in groups if any(e.name == name for e in group.entries)), None)
        if group is None or len(group.entries) != 1:
            raise ZeroError(f"tied parameter {name!r} must form a parameter group of its own")
        if not counted:
            group.norm_ranges = []
        across = process_group if process_group is not None and comm.group_size(process_group) > 1 else None
        key = keys.get(name, name)
        if across is not None or copies[key] > 1:
            out.append((group, across, key))
    return out
