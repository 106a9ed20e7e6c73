"""Mixture-of-experts at run time: the expert dispatch and combine over the expert-parallel group
(``dispatch``), the step's routing counts for the metrics (``load_stats``) and where an expert
parameter's rows live (``expert_shards``)."""

from runtime.moe.exchange import Routing, combine, dispatch, expert_slice, local_expert_ids
from runtime.moe.load_stats import LOAD, ExpertLoad, expert_load, reduce_over

__all__ = [
    "Routing",
    "dispatch",
    "combine",
    "local_expert_ids",
    "expert_slice",
    "LOAD",
    "ExpertLoad",
    "expert_load",
    "reduce_over",
    "EAGER_ONLY",
]

#: What a ``torch.compile``'d layer calls eagerly (``runtime.stages.compile_layers.prepare`` wraps
#: them in ``torch.compiler.disable``): they read the expert counts on the host and exchange rows
#: through ``runtime.distributed.comm`` (or, for the local expert ids, make as many rows as the
#: counts say), so each call is a clean graph break.
EAGER_ONLY: tuple[str, ...] = ("dispatch", "combine", "local_expert_ids")
