"""The (pp, dp, tp) rank layout: tp innermost, then dp, then pp::

    rank = (pp_index * dp + dp_index) * tp + tp_index

so a tp group is ``tp`` consecutive ranks (one node when ``tp`` divides the devices per node),
which is what both the runtime's process groups and the cost models' placement assume.

Expert parallelism (``ep`` dividing ``dp``) splits the data-parallel index once more, ep innermost::

    dp_index = edp_index * ep + ep_index

An expert-parallel group is ``ep`` consecutive dp ranks (ranks ``tp`` apart: inside a node when
``tp * ep`` divides the devices per node), sharing one layer's routed experts; an
expert-data-parallel group is the ``dp / ep`` ranks with the same ``ep_index``, holding the same
experts (their gradients are reduced over it), as Megatron-Core carves them."""

from __future__ import annotations

__all__ = ["AXES", "coords_of", "rank_of", "axis_ranks", "expert_ranks"]

AXES: tuple[str, ...] = ("tp", "dp", "pp")
"""The mesh axes, innermost first."""


def coords_of(rank: int, dp: int, tp: int) -> tuple[int, int, int]:
    """``(pp_index, dp_index, tp_index)`` of a global rank."""
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def rank_of(pp_index: int, dp_index: int, tp_index: int, dp: int, tp: int) -> int:
    """The global rank at mesh coordinates ``(pp_index, dp_index, tp_index)``."""
    return (pp_index * dp + dp_index) * tp + tp_index


def axis_ranks(axis: str, dp: int, tp: int, pp: int) -> list[list[int]]:
    """Every group of one mesh axis, as lists of global ranks in the axis's order."""
    for name, degree in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"mesh degree {name} must be a positive integer (got {degree!r})")
    cells = [(p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)]
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}: expected 'tp', 'dp' or 'pp'")
    position = {"pp": 0, "dp": 1, "tp": 2}[axis]
    groups: dict[tuple[int, ...], list[int]] = {}
    for cell in cells:
        others = cell[:position] + cell[position + 1 :]
        groups.setdefault(others, []).append(rank_of(*cell, dp=dp, tp=tp))
    return list(groups.values())


def expert_ranks(dp: int, tp: int, pp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """Every expert-parallel group and every expert-data-parallel group, as lists of global ranks
    (``ep_index`` order, then ``edp_index`` order): each dp group split into ``dp / ep`` runs of
    ``ep`` consecutive dp indices, and the ranks with the same position in those runs."""
    if not isinstance(ep, int) or ep < 1 or dp % ep:
        raise ValueError(f"expert-parallel degree {ep!r} must be a positive integer dividing dp ({dp})")
    expert_groups: list[list[int]] = []
    expert_data_groups: list[list[int]] = []
    for group in axis_ranks("dp", dp, tp, pp):
        runs = [group[start : start + ep] for start in range(0, dp, ep)]
        expert_groups += runs
        expert_data_groups += [list(column) for column in zip(*runs)]
    return expert_groups, expert_data_groups
