"""Mixture-of-experts at run time: the expert dispatch and combine over the expert-parallel group
(``dispatch``), the step's routing counts for the metrics (``load_stats``) and where an expert
parameter's rows live (``expert_shards``)."""

from runtime.moe.dispatch import Routing, combine, dispatch, expert_slice
from runtime.moe.load_stats import LOAD, ExpertLoad, expert_load, reduce_over

__all__ = ["Routing", "dispatch", "combine", "expert_slice", "LOAD", "ExpertLoad", "expert_load", "reduce_over"]
