"""The (pp, dp, cp, tp) device mesh.

Ranks are laid out with tp innermost, then cp, then dp, then pp
(``runtime.contract.rank_layout``)::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

so a tensor-parallel group is a run of consecutive ranks (inside one node when tp divides the
devices per node) and pipeline stages are the outermost blocks of ranks. Without context
parallelism (``cp == 1``) this is ``(pp_index * dp + dp_index) * tp + tp_index``.

Context parallelism (``cp > 1``) adds the cp groups (the ranks sharing one sequence: attention
exchanges keys and values over them, ``runtime.context_parallel``) and the dp_cp groups (the
``dp * cp`` ranks holding the same weights: gradients are reduced and ZeRO state sharded over
them, which is ``dp_cp_group``'s role). With ``cp == 1`` no group is created for either:
``cp_group`` is None and ``dp_cp_group`` is the dp group itself, so every group and collective is
what it was before cp existed.

``setup_mesh`` builds one process group per axis for this rank and remembers the mesh, so that
compiled stage code can ask ``get_mesh().tp_group`` without threading groups through every call.
Every axis gets a real process group, a size-1 group included (``runtime.distributed.comm`` skips collectives
over one rank), because ``None`` means "the whole world" to torch.distributed. Only without a
process group (a single process) is every group ``None``, and then the world is one rank too.

``setup_mesh`` also tells ``runtime.timing`` what each of this rank's groups is for (tp, dp, pp,
tied, ep, cp), so that the time blocked in a collective lands in the right part of the step's measured
breakdown (``tp_comm``, ``dp_comm``, ``pp_bubble``, ``ep_comm``, ``cp_comm``; a tied weight's all-reduce and an
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
from runtime.contract.rank_layout import axis_ranks, coords_of, cp_index_of, expert_ranks, rank_of
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
    cp: int = 1
    """Context-parallel degree: each sequence's positions are spread over ``cp`` ranks."""
    cp_group: object | None = None
    """This rank's context-parallel group (None when ``cp == 1`` or without a process group)."""
    cp_ranks: tuple[int, ...] = (0,)
    """Global ranks of the context-parallel group, by ``cp_index``."""
    dp_cp_group: object | None = None
    """The ``dp * cp`` ranks holding this rank's weights (same pp and tp index): gradients are
    reduced and ZeRO state sharded over it. The dp group itself when ``cp == 1``."""
    dp_cp_ranks: tuple[int, ...] = (0,)
    """Global ranks of the dp_cp group in rank order (dp index major, cp index minor)."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def pp_index(self) -> int:
        return coords_of(self.rank, self.dp, self.tp, self.cp)[0]

    @property
    def dp_index(self) -> int:
        return coords_of(self.rank, self.dp, self.tp, self.cp)[1]

    @property
    def tp_index(self) -> int:
        return coords_of(self.rank, self.dp, self.tp, self.cp)[2]

    @property
    def cp_index(self) -> int:
        """Position in the context-parallel group: this rank holds chunks ``cp_index`` and
        ``2 cp - 1 - cp_index`` of every sequence (``runtime.context_parallel.layout``)."""
        return cp_index_of(self.rank, self.tp, self.cp)

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


def setup_mesh(pp: int, dp: int, tp: int, tied_stages: Sequence[Sequence[int]] = (), ep: int = 1, cp: int = 1) -> Mesh:
    """Create the axis groups, one group per (holder set, dp, cp, tp) of ``tied_stages`` (the
    stages holding a copy of a tied weight), with ``ep > 1`` the expert-parallel and
    expert-data-parallel groups and with ``cp > 1`` the context-parallel and dp_cp groups;
    collective: every rank calls it with the same arguments. Sets and returns the mesh."""
    for name, degree in (("pp", pp), ("dp", dp), ("tp", tp), ("ep", ep), ("cp", cp)):
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"mesh degree {name}={degree!r} must be an integer >= 1")
    if dp % ep:
        raise ValueError(f"the expert-parallel degree ep={ep} must divide dp={dp}")
    if cp > 1 and ep > 1:
        raise ValueError(
            f"context parallelism (cp={cp}) with expert parallelism (ep={ep}) is not supported; plan with --ep 1"
        )
    world = pp * dp * cp * tp
    if not dist.is_initialized():
        if world != 1:
            raise RuntimeError(f"a mesh of {world} ranks needs an initialized process group")
        return set_mesh(Mesh(1, 1, 1))
    if dist.get_world_size() != world:
        raise ValueError(
            f"the plan needs pp*dp*cp*tp = {pp}*{dp}*{cp}*{tp} = {world} processes, "
            f"but the job has {dist.get_world_size()}"
        )
    rank = dist.get_rank()
    # new_group is collective over the world: every rank creates every group in the same order.
    axes = ("pp", "dp", "tp") + (("cp", "dp_cp") if cp > 1 else ())
    groups = {axis: _axis_group(rank, axis, dp, tp, pp, cp) for axis in axes}
    if cp == 1:
        groups["dp_cp"] = groups["dp"]
    tied = _tied_groups(rank, tied_stages, pp, dp, tp, cp)
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
        cp=cp,
        cp_group=groups["cp"][0] if cp > 1 else None,
        cp_ranks=groups["cp"][1] if cp > 1 else (rank,),
        dp_cp_group=groups["dp_cp"][0],
        dp_cp_ranks=groups["dp_cp"][1],
    )
    timing.forget_groups()
    for axis in ("pp", "dp", "tp") + (("cp",) if cp > 1 else ()):
        timing.register_group(groups[axis][0], axis)
    if cp > 1:  # the gradient reduction over dp * cp ranks is data-parallel traffic
        timing.register_group(groups["dp_cp"][0], "dp")
    for group in tied.values():
        timing.register_group(group, "tied")
    timing.register_group(ep_group, "ep")
    timing.register_group(edp_group, "dp")
    return set_mesh(mesh)


def _axis_group(rank: int, axis: str, dp: int, tp: int, pp: int, cp: int) -> tuple[object, tuple[int, ...]]:
    """Create every group of ``axis`` (``runtime.contract.rank_layout.axis_ranks``); return this
    rank's group and its members."""
    mine: tuple[object, tuple[int, ...]] | None = None
    for members in axis_ranks(axis, dp, tp, pp, cp):
        members_t = tuple(members) if axis == "dp_cp" else tuple(sorted(members))
        group = dist.new_group(sorted(members_t), timeout=_dist.COLLECTIVE_TIMEOUT)
        if rank in members_t:
            mine = (group, members_t)
    assert mine is not None, f"rank {rank} is in no {axis} group"
    return mine


def _tied_groups(rank: int, tied_stages: Sequence[Sequence[int]], pp: int, dp: int, tp: int, cp: int) -> dict:
    """One group per holder set and (dp, cp, tp) coordinates: the ranks of those stages holding
    the same shard of the tied weight; this rank's group of each holder set it belongs to."""
    tied = {}
    for holders in tied_stages:
        holders = tuple(sorted(int(k) for k in holders))
        if any(not 0 <= k < pp for k in holders):
            raise ValueError(f"tied stages {holders} outside 0..{pp - 1}")
        for dp_coord in range(dp):
            for cp_coord in range(cp):
                for tp_coord in range(tp):
                    members_t = tuple(rank_of(k, dp_coord, tp_coord, dp, tp, cp, cp_coord) for k in holders)
                    group = dist.new_group(list(members_t), timeout=_dist.COLLECTIVE_TIMEOUT)
                    if rank in members_t:
                        tied[holders] = group
    return tied


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
