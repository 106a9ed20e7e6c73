"""Collective communication: alpha-beta time models and the contract's byte counts.

Alpha-beta model
----------------
Sending a message of ``b`` bytes over one link costs ``alpha + b / B``: a start-up latency
``alpha`` and a bandwidth term. A collective over ``n`` ranks run as a ring takes a number of
synchronous *steps*, each sending one chunk over every link at once, so its time is::

    t = steps * alpha + link_bytes / B

with ``S`` the collective's full size in bytes (the reduced tensor, or the gathered output):

==================  ===========  ======================  =====================================
collective          steps        link_bytes              notes
==================  ===========  ======================  =====================================
all_reduce          2 (n - 1)    2 (n - 1) / n * S       reduce-scatter then all-gather
all_gather          n - 1        (n - 1) / n * S         S = gathered output
reduce_scatter      n - 1        (n - 1) / n * S         S = full input
broadcast           n - 1        S                       pipelined chain: every hop carries S
all_to_all          n - 1        (n - 1) / n * S         pairwise exchange, S = local buffer
send (p2p)          1            S                       one message between two ranks
==================  ===========  ======================  =====================================

Which link? The profile gives an intra-node link (NVLink: ``intra_node_bandwidth``,
``intra_node_latency``) and an inter-node link (the device's NIC). A group whose ranks all live
on one node uses NVLink. A flat ring over several nodes is paced by its slowest hop, the network,
so every step costs the inter-node alpha and chunk time. A profile may also give the intra-node
link per collective kind (``intra_node_collectives``, which ``planner calibrate`` measures): a
library's all-gather or reduce-scatter need not reach its all-reduce's bandwidth, so each kind, and each intra-node phase of a
hierarchical algorithm, is priced with its own link when the profile has one.

Hierarchical algorithms (groups over ``m`` nodes with ``p`` ranks on each)
----------------------------------------------------------------------------
- all_reduce: reduce-scatter inside each node (``p``, NVLink, size ``S``); then each local rank
  all-reduces its ``S / p`` shard with its peers on the other nodes (``m``, network, in parallel
  over the ``p`` NICs); then all-gather inside the node::

      2 [(p-1) a_i + (p-1)/p S / B_i] + 2 (m-1) a_e + 2 (m-1)/m (S/p) / B_e

- all_gather: all-gather across nodes among same-local-index ranks (output ``S / p`` each), then
  inside the node: ``(m-1) a_e + (m-1)/m (S/p)/B_e + (p-1) a_i + (p-1)/p S/B_i``.
  reduce_scatter is the mirror image with the same cost.
- broadcast: a chain over the node leaders, then a chain inside each node:
  ``(m-1) a_e + S/B_e + (p-1) a_i + S/B_i``.
- all_to_all: the ``(p-1)/n`` share of the buffer bound for the same node goes over NVLink while
  the ``(n-p)/n`` share bound for other nodes goes over the NIC, concurrently: the max of both.

When ``p = 1`` the hierarchical algorithms reduce to the flat ring over the network. With uneven
groups (a different number of ranks on each node) the model uses the largest ``p`` for the
intra-node phases and the smallest for the inter-node shard, which bounds the slowest node.
``algorithm="auto"`` takes the faster of ring and hierarchical, as NCCL's tuner would.

Bytes sent (the contract)
-------------------------
``runtime.contract.collective_bytes.ring_bytes`` is what one device sends under the ring
convention that the runtime counts and plan.json's ``comm_bytes_per_device`` reports. It does not
depend on the algorithm: it is an accounting convention, not a time model.

Placement
---------
Global ranks live on nodes by blocks: rank ``r`` is on node ``r // gpus_per_node``. With the
mesh layout ``rank = (pp_i * dp + dp_i) * tp + tp_i`` a TP group is a run of consecutive ranks, a
DP group has stride ``tp`` and a PP group stride ``dp * tp``; ``axis_placement`` gives the
placement of the worst group of an axis (the one spanning the most nodes).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

from cost_models.compute import dtype_bytes, smax, smin
from cost_models.hardware import HardwareProfile
from runtime.contract.collective_bytes import COLLECTIVES, ring_bytes
from runtime.contract.rank_layout import axis_pattern

__all__ = [
    "ALGORITHMS",
    "GroupPlacement",
    "group_placement",
    "axis_placement",
    "ring_terms",
    "collective_time",
    "ring_time",
    "hierarchical_time",
    "zero_dp_collectives",
    "step_control_bytes",
    "total_bytes_sent",
]

ALGORITHMS: tuple[str, ...] = ("auto", "ring", "hierarchical")
_P2P = ("send", "p2p", "recv")


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective kind {kind!r}: expected one of {', '.join(COLLECTIVES)}")


# ----------------------------------------------------------------------------------------------
# Placement of a group on nodes
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupPlacement:
    """How a process group sits on nodes: all the time model needs to pick links."""

    size: int
    """Number of ranks in the group."""
    nodes: int
    """Number of distinct nodes the group's ranks live on."""
    ranks_per_node: int
    """Most ranks of the group on any one node (the intra-node phase's ``p``)."""
    min_ranks_per_node: int | None = None
    """Fewest ranks of the group on a node it uses; ``None`` means even (= ``ranks_per_node``)."""

    def __post_init__(self) -> None:
        if self.min_ranks_per_node is None:
            object.__setattr__(self, "min_ranks_per_node", self.ranks_per_node)
        for name in ("size", "nodes", "ranks_per_node", "min_ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GroupPlacement.{name} must be a positive integer (got {value!r})")
        fewest, most = self.fewest_per_node, self.ranks_per_node
        if fewest > most:
            raise ValueError(f"GroupPlacement: min_ranks_per_node {fewest} > ranks_per_node {most}")
        if not (most + (self.nodes - 1) * fewest <= self.size <= fewest + (self.nodes - 1) * most):
            raise ValueError(
                f"GroupPlacement: {self.size} ranks cannot sit on {self.nodes} nodes with {fewest}..{most} ranks per node"
            )

    @property
    def fewest_per_node(self) -> int:
        """``min_ranks_per_node``, resolved (``ranks_per_node`` when even)."""
        return self.ranks_per_node if self.min_ranks_per_node is None else self.min_ranks_per_node

    @property
    def intra_node(self) -> bool:
        """True when the whole group is inside one node (NVLink only)."""
        return self.nodes == 1

    @property
    def even(self) -> bool:
        return self.min_ranks_per_node == self.ranks_per_node


def group_placement(ranks: Sequence[int], gpus_per_node: int) -> GroupPlacement:
    """Placement of a group given its global ranks; rank ``r`` lives on node ``r // gpus_per_node``."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1 (got {gpus_per_node})")
    rank_list = list(ranks)
    if not rank_list:
        raise ValueError("a process group needs at least one rank")
    for rank in rank_list:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"ranks must be non-negative integers (got {rank!r} in {rank_list})")
    if len(set(rank_list)) != len(rank_list):
        raise ValueError(f"ranks of a group must be distinct (got {rank_list})")
    per_node: dict[int, int] = {}
    for rank in rank_list:
        per_node[rank // gpus_per_node] = per_node.get(rank // gpus_per_node, 0) + 1
    counts = per_node.values()
    return GroupPlacement(len(rank_list), len(per_node), max(counts), min(counts))


@functools.lru_cache(maxsize=4096)
def axis_placement(axis: str, dp: int, tp: int, pp: int, gpus_per_node: int, cp: int = 1) -> GroupPlacement:
    """Placement of the worst group of ``axis`` in the (pp, dp, cp, tp) mesh
    (``runtime.contract.rank_layout``; ``cp`` 1 without context parallelism).

    Groups of one axis differ only when ``gpus_per_node`` does not align with the layout (e.g.
    ``tp = 3`` on 8-device nodes); the one spanning the most nodes, then with the thinnest node,
    sets the pace of a step, so that is the one returned.
    """
    offsets, bases = axis_pattern(axis, dp, tp, pp, cp)
    # a group shifted by whole nodes sits the same way: one group per base residue is enough
    shifts = {base % gpus_per_node: base for base in reversed(bases)}
    worst = None
    key = None
    for base in sorted(shifts.values()):
        placement = group_placement([base + offset for offset in offsets], gpus_per_node)
        rank_key = (placement.nodes, -placement.fewest_per_node, placement.ranks_per_node)
        if key is None or rank_key > key:
            worst, key = placement, rank_key
    assert worst is not None
    return worst


# ----------------------------------------------------------------------------------------------
# Bytes (the contract) and ring terms (the time model)
# ----------------------------------------------------------------------------------------------
def ring_terms(kind: str, size_bytes: Any, n: int) -> tuple[int, Any]:
    """``(steps, link_bytes)`` of the flat algorithm: time is ``steps * alpha + link_bytes / B``.

    See the module docstring's table. ``planner.commands.calibrate`` fits alpha and B with these same
    terms, so a calibrated profile reproduces the measured times under this model.
    """
    _check_kind(kind)
    if n <= 1:
        return 0, 0.0
    if kind == "all_reduce":
        return 2 * (n - 1), 2.0 * (n - 1) / n * size_bytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n * size_bytes
    if kind == "broadcast":
        return n - 1, 1.0 * size_bytes
    return 1, 1.0 * size_bytes  # send / p2p / recv


def _placement(group: GroupPlacement | Sequence[int], hw: HardwareProfile) -> GroupPlacement:
    if isinstance(group, GroupPlacement):
        return group
    if isinstance(group, int):
        raise TypeError(
            "group must be a GroupPlacement or a sequence of global ranks, not an int; "
            "use axis_placement(...) or group_placement(range(n), gpus_per_node)"
        )
    return group_placement(group, hw.gpus_per_node)


def _check_size(size_bytes: Any) -> None:
    if not type(size_bytes).__module__.startswith("sympy") and size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0 (got {size_bytes!r})")


def ring_time(kind: str, size_bytes: Any, group: GroupPlacement | Sequence[int], hw: HardwareProfile) -> Any:
    """Flat ring (or pairwise / chain) time; the network paces it when the group spans nodes."""
    _check_kind(kind)
    _check_size(size_bytes)
    placement = _placement(group, hw)
    if placement.size <= 1:
        return 0.0
    if kind in _P2P and placement.size != 2:
        raise ValueError(f"a point-to-point transfer is between 2 ranks (got a group of {placement.size})")
    steps, link_bytes = ring_terms(kind, size_bytes, placement.size)
    alpha, bandwidth = hw.link(kind, placement.intra_node)
    return steps * alpha + link_bytes / bandwidth


def hierarchical_time(kind: str, size_bytes: Any, group: GroupPlacement | Sequence[int], hw: HardwareProfile) -> Any:
    """Two-level time (intra-node then inter-node); equal to ``ring_time`` inside one node."""
    _check_kind(kind)
    _check_size(size_bytes)
    placement = _placement(group, hw)
    if placement.size <= 1:
        return 0.0
    if placement.intra_node or kind in _P2P:
        return ring_time(kind, size_bytes, placement, hw)
    n, nodes, per_node, fewest_per_node = (
        placement.size,
        placement.nodes,
        placement.ranks_per_node,
        placement.fewest_per_node,
    )
    full = size_bytes
    inter_alpha, inter_bandwidth = hw.link(kind, False)

    def intra(phase: str) -> Any:  # one reduce-scatter or all-gather of S inside a node
        intra_alpha, intra_bandwidth = hw.link(phase, True)
        return (per_node - 1) * intra_alpha + (per_node - 1) / per_node * full / intra_bandwidth

    shard = full / fewest_per_node  # what each device carries across the network
    if kind == "all_reduce":
        return (
            intra("reduce_scatter")
            + intra("all_gather")
            + 2 * (nodes - 1) * inter_alpha
            + 2.0 * (nodes - 1) / nodes * shard / inter_bandwidth
        )
    if kind in ("all_gather", "reduce_scatter"):
        return intra(kind) + (nodes - 1) * inter_alpha + (nodes - 1) / nodes * shard / inter_bandwidth
    if kind == "broadcast":
        intra_alpha, intra_bandwidth = hw.link("send", True)
        return (
            (nodes - 1) * inter_alpha
            + full / inter_bandwidth
            + (per_node - 1) * intra_alpha
            + (full / intra_bandwidth if per_node > 1 else 0.0)
        )
    # all_to_all: on-node share over NVLink, off-node share over the NIC, concurrently.
    intra_alpha, intra_bandwidth = hw.link(kind, True)
    on_node = (per_node - 1) * intra_alpha + (per_node - 1) / n * full / intra_bandwidth
    off_node = (n - fewest_per_node) * inter_alpha + (n - fewest_per_node) / n * full / inter_bandwidth
    return smax(on_node, off_node)


def collective_time(
    kind: str,
    size_bytes: Any,
    group: GroupPlacement | Sequence[int],
    hw: HardwareProfile,
    algorithm: str = "auto",
) -> Any:
    """Seconds for one collective of ``size_bytes`` over ``group`` on ``hw``.

    ``group`` is a ``GroupPlacement`` (e.g. from ``axis_placement``) or the group's global ranks
    (placed with ``hw.gpus_per_node``). ``size_bytes`` is the full size (see the module table).
    ``algorithm``: ``ring``, ``hierarchical`` or ``auto`` (the faster of the two).
    A group of one rank costs nothing.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
    placement = _placement(group, hw)
    if algorithm == "ring":
        return ring_time(kind, size_bytes, placement, hw)
    if algorithm == "hierarchical":
        return hierarchical_time(kind, size_bytes, placement, hw)
    flat = ring_time(kind, size_bytes, placement, hw)
    if placement.intra_node or kind in _P2P or placement.size <= 1:
        return flat
    return smin(flat, hierarchical_time(kind, size_bytes, placement, hw))


# ----------------------------------------------------------------------------------------------
# The data-parallel collectives of one step under each ZeRO stage
# ----------------------------------------------------------------------------------------------
def zero_dp_collectives(num_params: int, dtype: str, zero_stage: int, dp: int) -> list[tuple[str, int]]:
    """``(kind, size_bytes)`` of the data-parallel collectives of one training step.

    ``num_params`` is what one device's replica holds (after TP and PP splits); gradients and
    gathered weights travel in the training dtype. ZeRO buffers are flat and padded to a
    multiple of ``dp`` elements (``ceil(P / dp) * dp``), so their sizes include the padding:

    - stage 0: one all-reduce of the gradients, ``P * b``;
    - stage 1: all-reduce of the gradients (every rank keeps full gradients anyway, and the
      runtime reduces the flat buffers in overlapped buckets), then all-gather of the updated
      weights after the optimizer step on the shard, each ``P_pad * b``;
    - stage 2: reduce-scatter of the gradients and all-gather of the updated weights;
    - stage 3: all-gather of the weights for the forward and again for the backward (they are
      freed in between), and reduce-scatter of the gradients: ``P_pad * b`` each.

    With ``dp = 1`` there is nothing to send and the list is empty.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3 (got {zero_stage!r})")
    if dp < 1:
        raise ValueError(f"dp must be >= 1 (got {dp})")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0 (got {num_params})")
    if dp == 1 or num_params == 0:
        return []
    element_bytes = dtype_bytes(dtype)
    padded = math.ceil(num_params / dp) * dp * element_bytes
    if zero_stage == 0:
        return [("all_reduce", num_params * element_bytes)]
    if zero_stage == 1:
        return [("all_reduce", padded), ("all_gather", padded)]
    if zero_stage == 2:
        return [("reduce_scatter", padded), ("all_gather", padded)]
    return [("all_gather", padded), ("all_gather", padded), ("reduce_scatter", padded)]


def total_bytes_sent(collectives: Sequence[tuple[str, Any]], n: int) -> Any:
    """Sum of ``ring_bytes`` over ``(kind, size_bytes)`` pairs issued in a group of ``n``."""
    return sum(ring_bytes(k, size, n) for k, size in collectives)


#: Per-step control collectives the runtime issues besides gradients and activations:
#: the gradient-norm all-reduce (sum of squares + overflow flag, 2 x float64) over dp, tp and pp;
#: the pipeline's pre-flight check (a ``pp x PREFLIGHT_ROW`` int64 table, all-reduced over pp)
#: and the loss broadcast (one float64, from the last stage over pp).
GRAD_NORM_BYTES = 16
PREFLIGHT_ROW = 77
LOSS_BROADCAST_BYTES = 8


def step_control_bytes(dp: int, tp: int, pp: int) -> float:
    """Bytes one device sends per step for control collectives (ring convention, tiny).

    ``sum_{n in (dp, tp, pp)} ring(all_reduce, 16, n)`` for the global gradient norm, plus, when
    ``pp > 1``, ``ring(all_reduce, 8 * 77 * pp, pp)`` for the pipeline's pre-flight table and
    ``ring(broadcast, 8, pp)`` for the step loss. ``runtime.data_parallel.zero_engine.ZeroEngine.step`` and
    ``runtime.pipeline.executor.PipelineStage.run`` issue exactly these; counting them makes the
    predicted bytes equal the runtime's counter rather than a few bytes short.
    """
    out = sum(float(ring_bytes("all_reduce", GRAD_NORM_BYTES, n)) for n in (dp, tp, pp))
    if pp > 1:
        out += float(ring_bytes("all_reduce", 8 * PREFLIGHT_ROW * pp, pp))
        out += float(ring_bytes("broadcast", LOSS_BROADCAST_BYTES, pp))
    return out
