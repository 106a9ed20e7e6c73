"""The ZeRO engine's expert groups: which ranks shard and reduce a routed expert weight.

Under expert parallelism (``runtime.moe``) each rank holds a slice of a layer's routed experts
(``ep`` ranks of a dp group hold different slices), so an expert weight is not replicated over dp:
it is shared only by the ``dp / ep`` ranks holding the same experts, the expert-data-parallel group
(``runtime.distributed.mesh``). ``runtime.data_parallel.flat_shards.build_groups`` puts a layer's
expert weights (``ParallelContext.expert_params``) in a group of their own, sharded over
``dp / ep`` ranks; this module picks that group's process group, gives every group its shard index
and process group (``FlatGroup.way``, ``FlatGroup.comm_group``), splits the groups by kind for the
state dict, and refuses what expert parallelism does not run with yet (1-bit Adam). Offloaded
state works per group (each group's shard, whatever its ``ways``).

The scale: a rank's loss is its share of the global mean; the all-to-all's backward brings a local
expert the gradients of every rank of its expert-parallel group, so the sum over the
expert-data-parallel group covers every rank once, and the engine divides it by dp as it does
every reduced gradient (``runtime.data_parallel.grad_reduction``). The gradient norm counts each
expert once: the ranks of an expert-parallel group hold different experts, the norm's all-reduce
spans dp, and at ZeRO 0 (whole copies) only expert-data-parallel rank 0 counts them
(``flat_shards.set_owned_ranges`` with the group's ``way``).
"""

from __future__ import annotations

from typing import Any, Sequence

from runtime.contract.input_errors import ConfigError
from runtime.data_parallel.engine_config import OptimizerConfig, ParallelContext
from runtime.data_parallel.flat_shards import FlatGroup, ZeroError
from runtime.distributed import comm
from runtime.distributed.mesh import get_mesh

__all__ = ["expert_data_group", "place_groups", "check_experts", "by_kind"]


def expert_data_group(parallel: ParallelContext, dp: int) -> Any:
    """The group expert parameters are sharded and reduced over: ``parallel.expert_data_group``,
    else the mesh's (None: no expert parameters, or one process)."""
    if not parallel.expert_params:
        return None
    group = parallel.expert_data_group if parallel.expert_data_group is not None else get_mesh().edp_group
    if group is not None and dp % comm.group_size(group):
        raise ZeroError(
            f"the expert-data-parallel group has {comm.group_size(group)} ranks, which does not divide dp={dp}"
        )
    return group


def place_groups(groups: Sequence[FlatGroup], dense: tuple[int, int, Any], experts: tuple[int, int, Any]) -> None:
    """Each group's shard index and process group from ``(ranks, this rank's index, group)`` of dp
    (dense groups) or of expert data parallelism (expert groups); no group when one rank holds it."""
    for group in groups:
        ranks, index, process_group = experts if group.expert else dense
        group.way, group.comm_group = index, process_group if ranks > 1 else None


def check_experts(groups: Sequence[FlatGroup], optimizer: OptimizerConfig) -> None:
    """Refuse what expert parallelism does not run with yet: 1-bit Adam (whose compressed exchange
    spans the whole dp group)."""
    if not any(group.expert for group in groups):
        return
    if optimizer.compression.enabled:
        raise ConfigError("expert parallelism does not run with 1-bit Adam (--dp-compression): plan one or the other")


def by_kind(groups: Sequence[FlatGroup]) -> list[tuple[str | None, list[FlatGroup]]]:
    """The dense groups (key None: the state dict itself) and, when there are any, the expert
    groups (key ``"experts"``: a state dict of their own, sharded over expert data parallelism)."""
    dense = [group for group in groups if not group.expert]
    experts = [group for group in groups if group.expert]
    return [(None, dense)] + ([("experts", experts)] if experts else [])
