"""The model facts the layer table gets from the graph itself: attention heads and whether tensor
parallelism can split the model.

The front end states ``heads`` / ``kv_heads`` for the models it builds (from flags or an HF
config); a ``file.py:factory`` model states none. ``merge_graph_facts`` fills them from the
attention cores found by ``passes.attention`` (and adds ``head_dim``), cross-checks them where
both exist (the graph is what will run, so it wins, with a note), and records ``tp_blocked``: why
tensor parallelism cannot split the model, naming the node (``passes.tensor_parallel.tp_costs``), so the
search plans without it, ``tp_divides``: each column-parallel output size tp must divide ->
the first node with it, and ``tp_replicated``: the modules tp keeps whole while it splits others
(the report names them under ``--tp``), each with why.
"""

from __future__ import annotations

from torch import fx

from passes.attention import attention_facts
from passes.tensor_parallel.tp_costs import tp_blocked, tp_replicated, tp_sizes

__all__ = ["merge_graph_facts"]

_KEYS = (("heads", "attention heads"), ("kv_heads", "key/value heads"), ("head_dim", "head size"))


def merge_graph_facts(gm: fx.GraphModule, model: dict) -> list[str]:
    """Update ``model`` (the layer table's model facts) from ``gm``; return notes for the table."""
    notes: list[str] = []
    facts = attention_facts(gm)
    if facts.get("mixed"):
        notes.append(
            f"attention cores differ (e.g. {facts['mixed']!r}); tensor parallelism must "
            f"divide {facts['heads']} heads and {facts['kv_heads']} key/value heads"
        )
    for key, what in _KEYS:
        found, given = facts.get(key), model.get(key)
        if not found:
            continue
        if given and given != found:
            notes.append(f"the model states {given} {what}, its graph's attention has {found}; using {found}")
        model[key] = found
    sizes = tp_sizes(gm)
    if sizes:
        model["tp_divides"] = {str(k): v for k, v in sorted(sizes.items())}
    why = tp_blocked(gm)
    if why:
        model["tp_blocked"] = why
        notes.append(f"tensor parallelism cannot split this model ({why}); planned without it")
    elif replicated := tp_replicated(gm):
        model["tp_replicated"] = replicated
    return notes
