"""The (pp, dp, cp, tp) rank layout: tp innermost, then cp, then dp, then pp::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

so a tp group is ``tp`` consecutive ranks (one node when ``tp`` divides the devices per node), a
context-parallel group the ``cp`` ranks ``tp`` apart next to it (inside a node when ``tp * cp``
divides the devices per node: Megatron-Core's tp-cp-dp-pp order), which is what both the
runtime's process groups and the cost models' placement assume. Without context parallelism
(``cp == 1``, the default everywhere) this is ``(pp_index * dp + dp_index) * tp + tp_index``.

The ranks holding the same weights (same ``pp_index`` and ``tp_index``) are the ``dp * cp`` ranks
of a ``dp_cp`` group: gradients are reduced, and ZeRO state sharded, over it.

Expert parallelism (``ep`` dividing ``dp``) splits the data-parallel index once more, ep innermost::

    dp_index = edp_index * ep + ep_index

An expert-parallel group is ``ep`` consecutive dp ranks (ranks ``tp * cp`` apart: inside a node
when ``tp * cp * ep`` divides the devices per node), sharing one layer's routed experts; an
expert-data-parallel group is the ``dp / ep`` ranks with the same ``ep_index``, holding the same
experts (their gradients are reduced over it), as Megatron-Core carves them."""

from __future__ import annotations

__all__ = [
    "AXES",
    "coords_of",
    "cp_index_of",
    "rank_of",
    "axis_ranks",
    "axis_pattern",
    "expert_ranks",
    "crosses_nodes",
]

AXES: tuple[str, ...] = ("tp", "cp", "dp", "pp", "dp_cp")
"""The mesh axes, innermost first, and ``dp_cp`` (the dp and cp axes together: the ranks
holding the same weights)."""


def coords_of(rank: int, dp: int, tp: int, cp: int = 1) -> tuple[int, int, int]:
    """``(pp_index, dp_index, tp_index)`` of a global rank (``cp_index_of`` gives the fourth)."""
    return rank // (dp * cp * tp), (rank // (tp * cp)) % dp, rank % tp


def cp_index_of(rank: int, tp: int, cp: int) -> int:
    """The position of a global rank in its context-parallel group."""
    return (rank // tp) % cp


def rank_of(pp_index: int, dp_index: int, tp_index: int, dp: int, tp: int, cp: int = 1, cp_index: int = 0) -> int:
    """The global rank at mesh coordinates ``(pp_index, dp_index, cp_index, tp_index)``."""
    return ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index


def axis_ranks(axis: str, dp: int, tp: int, pp: int, cp: int = 1) -> list[list[int]]:
    """Every group of one mesh axis (``AXES``), as lists of global ranks in the axis's order (a
    ``dp_cp`` group in rank order: dp index major, cp index minor)."""
    _check_axis(axis, dp, tp, pp, cp)
    varying = {"tp": ("t",), "cp": ("c",), "dp": ("d",), "pp": ("p",), "dp_cp": ("d", "c")}[axis]
    groups: dict[tuple[int, ...], list[int]] = {}
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    cell = {"p": p, "d": d, "c": c, "t": t}
                    fixed = tuple(value for key, value in cell.items() if key not in varying)
                    groups.setdefault(fixed, []).append(rank_of(p, d, t, dp, tp, cp, c))
    return list(groups.values())


def _check_axis(axis: str, dp: int, tp: int, pp: int, cp: int) -> None:
    for name, degree in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"mesh degree {name} must be a positive integer (got {degree!r})")
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}: expected one of {', '.join(AXES)}")


def axis_pattern(axis: str, dp: int, tp: int, pp: int, cp: int = 1) -> tuple[list[int], list[int]]:
    """The groups of one mesh axis as ``(offsets, bases)``: group ``g`` is ``[bases[g] + o for o in
    offsets]``, exactly ``axis_ranks`` (the rank is linear in the coordinates, so every group of an
    axis is the first one shifted). Cheap at any world size: the cost models place groups from it."""
    _check_axis(axis, dp, tp, pp, cp)
    strides = {"t": (1, tp), "c": (tp, cp), "d": (tp * cp, dp), "p": (tp * cp * dp, pp)}
    varying = {"tp": "t", "cp": "c", "dp": "d", "pp": "p", "dp_cp": "dc"}[axis]
    offsets, bases = [0], [0]
    for key, (stride, size) in strides.items():
        if key in varying:
            offsets = [offset + i * stride for i in range(size) for offset in offsets]
        else:
            bases = [base + i * stride for i in range(size) for base in bases]
    return sorted(offsets), sorted(bases)


def expert_ranks(dp: int, tp: int, pp: int, ep: int, cp: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """Every expert-parallel group and every expert-data-parallel group, as lists of global ranks
    (``ep_index`` order, then ``edp_index`` order): each dp group split into ``dp / ep`` runs of
    ``ep`` consecutive dp indices, and the ranks with the same position in those runs."""
    if not isinstance(ep, int) or ep < 1 or dp % ep:
        raise ValueError(f"expert-parallel degree {ep!r} must be a positive integer dividing dp ({dp})")
    expert_groups: list[list[int]] = []
    expert_data_groups: list[list[int]] = []
    for group in axis_ranks("dp", dp, tp, pp, cp):
        runs = [group[start : start + ep] for start in range(0, dp, ep)]
        expert_groups += runs
        expert_data_groups += [list(column) for column in zip(*runs)]
    return expert_groups, expert_data_groups


def crosses_nodes(sender: int, receiver: int, width: int, gpus_per_node: int) -> bool:
    """Whether some rank of pipeline stage ``sender`` and its peer in stage ``receiver`` (the rank
    ``(receiver - sender) * width`` away, ``width = dp * cp * tp`` ranks per stage) sit on two
    nodes of ``gpus_per_node`` devices: the pipeline's messages between them then cross the
    network. Interleaved schedules' last stage sends to stage 0 (``receiver < sender``)."""
    if width >= gpus_per_node:
        return True
    return any((sender * width + i) // gpus_per_node != (receiver * width + i) // gpus_per_node for i in range(width))
