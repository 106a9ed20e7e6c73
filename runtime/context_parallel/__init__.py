"""Context parallelism: one sequence's attention split over a group of ranks.

Each rank of a context-parallel group holds ``seq_len / cp`` positions of every sequence, two
chunks chosen so that causal work is balanced (``layout``). Everything outside attention is
position-wise and runs on those positions alone; attention needs every key a query sees, which
the three methods of plan.json's ``context_parallel.method`` bring in different ways:

- ``ring`` (``ring.RingAttention``): key/value blocks circulate round the group, each step's
  transfer overlapped with the previous block's compute; per layer each rank sends ``cp - 1``
  key/value blocks forward (and the same plus the gradients backward). Memory: two blocks.
- ``all-gather``: every rank gathers the whole sequence's keys and values once per layer (what
  Llama 3 used; its backward reduce-scatters their gradients) and attends its queries to them.
  Simple and one collective, at the cost of holding the full keys and values.
- ``ulysses`` (DeepSpeed-Ulysses): an all-to-all turns "all heads of my positions" into "my
  heads of all positions", attention runs whole per head, and a second all-to-all turns the
  output back. Four all-to-alls per layer (q, k, v, out); needs the query and key/value heads
  divisible by cp.

``context_attention`` takes the group and method explicitly. All three agree with single-process
attention to float32 rounding (``tests/runtime/test_context_parallel.py``) for causal,
sliding-window, block-sparse and full masks and grouped-query attention.

Compiled stages (``codegen.context_rewrite``) call the entry points of ``runtime.context_parallel.entry``,
re-exported here: ``attention`` (every attention core), ``positions`` (position ids built in the
graph), ``full_length``, ``targets`` and ``sequence_mean`` (the loss's targets at this rank's positions
and the whole sequence's mean of the loss). They read the mesh ``setup_mesh`` built and the method the trainer
set from the manifest (``set_method``); without context parallelism they are exactly the
single-process computation, so a stage file still runs on its own.
"""

from __future__ import annotations

from runtime.context_parallel.blocks import AttentionMask
from runtime.context_parallel.entry import (
    attention,
    full_length,
    get_method,
    positions,
    sequence_mean,
    set_method,
    targets,
)
from runtime.context_parallel.layout import chunk_indices, gather_sequence, local_positions, shard_sequence
from runtime.context_parallel.methods import METHODS, context_attention

__all__ = [
    "METHODS",
    "AttentionMask",
    "context_attention",
    "chunk_indices",
    "local_positions",
    "shard_sequence",
    "gather_sequence",
    "attention",
    "positions",
    "full_length",
    "targets",
    "sequence_mean",
    "set_method",
    "get_method",
]
