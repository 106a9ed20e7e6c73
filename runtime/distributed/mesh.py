"""The (pp, dp, tp) device mesh.

Ranks are laid out with tp innermost, then dp, then pp::

    rank = (pp_index * dp + dp_index) * tp + tp_index

so a tensor-parallel group is a run of consecutive ranks (inside one node when tp divides the
devices per node) and pipeline stages are the outermost blocks of ranks.

``setup_mesh`` builds one process group per axis for this rank and remembers the mesh, so that
compiled stage code can ask ``get_mesh().tp_group`` without threading groups through every call.
Every axis gets a real process group, a size-1 group included (``runtime.distributed.comm`` skips collectives
over one rank), because ``None`` means "the whole world" to torch.distributed. Only without a
process group (a single process) is every group ``None``, and then the world is one rank too.

``setup_mesh`` also tells ``runtime.timing`` what each of this rank's groups is for (tp, dp, pp,
tied, ep), so that the time blocked in a collective lands in the right part of the step's measured
breakdown (``tp_comm``, ``dp_comm``, ``pp_bubble``, ``ep_comm``; a tied weight's all-reduce and an
expert gradient's reduction over the expert-data-parallel group are ``dp_comm``).

Expert parallelism (``ep`` dividing ``dp``) splits each dp group into ``dp / ep`` expert-parallel
groups of ``ep`` consecutive dp indices (the routed experts of a layer are spread over one, the
tokens exchanged by all-to-all inside it: ``runtime.moe``) and ``ep`` expert-data-parallel groups
(the ranks holding the same experts, whose expert gradients are reduced together), as
``runtime.contract.rank_layout.expert_ranks`` lays them out. With ``ep == 1`` no group is created:
``ep_group`` is None (there is nothing to exchange) and ``edp_group`` is the dp group itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch.distributed as dist

from runtime import timing
from runtime.contract.rank_layout import coords_of, expert_ranks, rank_of
from runtime.distributed import launch as _dist

__all__ = ["Mesh", "setup_mesh", "get_mesh", "set_mesh"]


@dataclass
class Mesh:
    """Degrees, this rank's coordinates and the process group of each axis.

    Groups are never ``None`` in a distributed job (a size-1 axis has a one-rank group), but for
    ``ep_group`` when ``ep == 1`` (nothing is exchanged; ``edp_group`` is then the dp group).
    """

    pp: int
    dp: int
    tp: int
    rank: int = 0
    pp_group: object | None = None
    dp_group: object | None = None
    tp_group: object | None = None
    pp_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's pipeline group, by stage index."""
    dp_ranks: tuple[int, ...] = (0,)
    tp_ranks: tuple[int, ...] = (0,)
    tied_groups: dict = field(default_factory=dict)
    """Holder stages -> this rank's tied group: the ranks of those stages with this rank's dp and
    tp coordinates (Megatron's embedding group), for each holder set that includes this stage."""
    ep: int = 1
    """Expert-parallel degree (divides ``dp``): the routed experts of a layer are spread over ``ep`` ranks."""
    ep_group: object | None = None
    """This rank's expert-parallel group (None when ``ep == 1`` or without a process group)."""
    edp_group: object | None = None
    """This rank's expert-data-parallel group: the ``dp / ep`` ranks holding the same experts (the
    dp group when ``ep == 1``)."""
    ep_ranks: tuple[int, ...] = (0,)
    """Global ranks of the expert-parallel group, by ``ep_index``."""
    edp_ranks: tuple[int, ...] = (0,)
    """Global ranks of the expert-data-parallel group, by ``edp_index``."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def pp_index(self) -> int:
        return coords_of(self.rank, self.dp, self.tp)[0]

    @property
    def dp_index(self) -> int:
        return coords_of(self.rank, self.dp, self.tp)[1]

    @property
    def tp_index(self) -> int:
        return coords_of(self.rank, self.dp, self.tp)[2]

    @property
    def ep_index(self) -> int:
        """Position in the expert-parallel group: this rank holds experts
        ``[ep_index * E / ep, (ep_index + 1) * E / ep)`` of each routed layer."""
        return self.dp_index % self.ep

    @property
    def edp_index(self) -> int:
        return self.dp_index // self.ep


_MESH: Mesh = Mesh(1, 1, 1)


def get_mesh() -> Mesh:
    return _MESH


def set_mesh(mesh: Mesh) -> Mesh:
    global _MESH
    _MESH = mesh
    return mesh


def setup_mesh(pp: int, dp: int, tp: int, tied_stages: Sequence[Sequence[int]] = (), ep: int = 1) -> Mesh:
    """Create the axis groups, one group per (holder set, dp, tp) of ``tied_stages`` (the
    stages holding a copy of a tied weight) and, with ``ep > 1``, the expert-parallel and
    expert-data-parallel groups; collective: every rank calls it with the same arguments. Sets and
    returns the mesh."""
    for name, degree in (("pp", pp), ("dp", dp), ("tp", tp), ("ep", ep)):
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"mesh degree {name}={degree!r} must be an integer >= 1")
    if dp % ep:
        raise ValueError(f"the expert-parallel degree ep={ep} must divide dp={dp}")
    world = pp * dp * tp
    if not dist.is_initialized():
        if world != 1:
            raise RuntimeError(f"a mesh of {world} ranks needs an initialized process group")
        return set_mesh(Mesh(1, 1, 1))
    if dist.get_world_size() != world:
        raise ValueError(
            f"the plan needs pp*dp*tp = {pp}*{dp}*{tp} = {world} processes, but the job has {dist.get_world_size()}"
        )
    rank = dist.get_rank()
    mine = coords_of(rank, dp, tp)
    groups: dict[str, tuple[object | None, tuple[int, ...]]] = {}
    # new_group is collective over the world: every rank creates every group in the same order.
    for axis in ("pp", "dp", "tp"):
        size = {"pp": pp, "dp": dp, "tp": tp}[axis]
        for group_index in range(world // size):
            # Enumerate the groups of this axis: fix the other two coordinates.
            members = []
            for other in range(world):
                coords = coords_of(other, dp, tp)
                others = tuple(x for i, x in enumerate(coords) if i != "pp dp tp".split().index(axis))
                if others == _others_key(group_index, axis, pp, dp, tp):
                    members.append(other)
            members_t = tuple(sorted(members))
            group = dist.new_group(list(members_t), timeout=_dist.COLLECTIVE_TIMEOUT)
            if rank in members_t:
                groups[axis] = (group, members_t)
    tied = {}
    for holders in tied_stages:
        holders = tuple(sorted(int(k) for k in holders))
        if any(not 0 <= k < pp for k in holders):
            raise ValueError(f"tied stages {holders} outside 0..{pp - 1}")
        for dp_coord in range(dp):
            for tp_coord in range(tp):
                members_t = tuple(rank_of(k, dp_coord, tp_coord, dp, tp) for k in holders)
                group = dist.new_group(list(members_t), timeout=_dist.COLLECTIVE_TIMEOUT)
                if rank in members_t:
                    tied[holders] = group
    ep_group, ep_members, edp_group, edp_members = _expert_groups(rank, pp, dp, tp, ep)
    if ep == 1:
        edp_group, edp_members = groups["dp"]
    mesh = Mesh(
        pp,
        dp,
        tp,
        rank,
        pp_group=groups["pp"][0],
        dp_group=groups["dp"][0],
        tp_group=groups["tp"][0],
        pp_ranks=groups["pp"][1],
        dp_ranks=groups["dp"][1],
        tp_ranks=groups["tp"][1],
        tied_groups=tied,
        ep=ep,
        ep_group=ep_group,
        edp_group=edp_group,
        ep_ranks=ep_members,
        edp_ranks=edp_members,
    )
    assert coords_of(rank, dp, tp) == mine
    timing.forget_groups()
    for axis in ("pp", "dp", "tp"):
        timing.register_group(groups[axis][0], axis)
    for group in tied.values():
        timing.register_group(group, "tied")
    timing.register_group(ep_group, "ep")
    timing.register_group(edp_group, "dp")
    return set_mesh(mesh)


def _expert_groups(
    rank: int, pp: int, dp: int, tp: int, ep: int
) -> tuple[object, tuple[int, ...], object, tuple[int, ...]]:
    """This rank's expert-parallel and expert-data-parallel groups and their ranks (collective:
    every rank creates every group in the same order); ``(None, (rank,), None, ())`` for ``ep == 1``,
    which needs no group of its own."""
    if ep == 1:
        return None, (rank,), None, ()
    mine: dict[str, tuple[object, tuple[int, ...]]] = {}
    for kind, group_list in zip(("ep", "edp"), expert_ranks(dp, tp, pp, ep)):
        for members in group_list:
            group = dist.new_group(list(members), timeout=_dist.COLLECTIVE_TIMEOUT)
            if rank in members:
                mine[kind] = (group, tuple(members))
    return mine["ep"][0], mine["ep"][1], mine["edp"][0], mine["edp"][1]


def _others_key(index: int, axis: str, pp: int, dp: int, tp: int) -> tuple[int, int]:
    """The ``index``-th combination of the two coordinates other than ``axis``, in row-major order."""
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    other = [x for x in ("pp", "dp", "tp") if x != axis]
    return index // sizes[other[1]], index % sizes[other[1]]
