"""The price of expert parallelism: what changes in a mixture-of-experts row when ``ep`` ranks of
each data-parallel group share its routed experts.

Pure functions of the layer-table row (``passes.moe`` fills its expert fields), the setting and
the hardware profile; ``cost_models.layer_work`` calls them for a row's work and
``cost_models.strategy`` for its state, so the ILP (which sums ``LayerCost`` fields) prices the
same thing as ``evaluate``. With ``ep = 1`` and a load of 1 nothing here changes a row's price:
the experts stay priced as the trace counted them (the tokens shared evenly).

Under ``ep`` (``runtime.contract.rank_layout.expert_ranks``: ``ep`` consecutive dp ranks, ``tp``
apart, form an expert group; the ``dp / ep`` ranks holding the same experts an expert-data group):

- **state**: each rank holds ``experts / ep`` of every MoE layer's routed experts, so their
  parameters, gradients and optimizer state divide by ``ep``; ZeRO shards that expert state over
  the expert-data group (``dp / ep`` ranks) and the rest over dp, and the experts' gradients are
  reduced over the expert-data group (``expert_state_split``).
- **all-to-all**: per MoE layer and pass a dispatch and a combine, each rank sending
  ``tokens x top_k x hidden x bytes x (ep - 1) / ep`` (``ring_bytes("all_to_all", ...)``) times
  the load (below), by alpha-beta on the links the expert group spans (``expert_placements``: the
  group is inside a node when ``tp x ep`` ranks fit on one, else it crosses the network);
  backward the same two, and a recomputed forward runs them again. Each is a blocking call (the
  tokens are needed right after), charged ``sync_overhead_s`` as the tp all-reduces are.
- **expert products**: a rank's ``experts / ep`` local experts get ``tokens x top_k x ep /
  experts`` rows each per micro-batch (the rank's own tokens' share of its experts, from all
  ``ep`` ranks), so a product's rows dim grows by ``ep`` and its batch of experts shrinks by ``ep``:
  the same FLOPs at a larger ``m``, which a GPU runs closer to its peak (``cost_models.gemm_cost``).
- **load** (``expert_load``): with routing imbalance ``X`` (``--moe-imbalance``, >= 1) the busiest
  rank's experts get ``X`` times the mean, and the step waits for that rank: its products and its
  all-to-all bytes scale by ``X``. A rank that holds every expert (``ep = 1``) gets exactly the
  mean in all (the imbalance only moves tokens between its own experts), so ``X`` applies only at
  ``ep > 1``. With a capacity factor ``F`` (``--moe-capacity-factor``) an expert takes at most
  ``F`` times its even share and drops the rest, so the load is ``min(X, F)`` (``min(1, F)`` at
  ``ep = 1``). Under a load the busiest expert's rows are priced rounded up to a multiple of
  ``LOADED_ROWS_MULTIPLE``: ``X`` times a mean is rarely a whole count, and the token rows are
  never a product's leading dimension (its rows, or its contraction in the weight gradient), so
  a real count of any size runs at the aligned rate; the rounding keeps the tensor cores'
  alignment rule (``cost_models.compute.misaligned``) from reading a fractional mean as a
  misaligned size (it did: ``--moe-imbalance 1.1`` priced Mixtral's steps 4.5 times 1.0's).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from cost_models.comm_cost import GroupPlacement, collective_time, group_placement
from cost_models.gemm_cost import gemm_flops, layer_gemm_time, layer_matmul_time
from cost_models.hardware import HardwareProfile
from runtime.contract.collective_bytes import ring_bytes
from runtime.contract.rank_layout import expert_ranks

#: Under a routing imbalance, the busiest expert's token rows are priced rounded up to a multiple
#: of this (16 rows: 16 bytes of the narrowest tensor-core type, fp8, and a tile's row step).
LOADED_ROWS_MULTIPLE = 16

__all__ = [
    "LOADED_ROWS_MULTIPLE",
    "ExpertSetting",
    "AllToAll",
    "expert_load",
    "expert_placements",
    "local_expert_gemms",
    "matmul_seconds",
    "all_to_all_times",
    "expert_state_split",
    "valid_expert_degrees",
]


@dataclass(frozen=True)
class ExpertSetting:
    """What a row's expert work depends on under one candidate (part of ``WorkSetting``)."""

    ep: int = 1
    """Expert-parallel degree: ranks sharing each MoE layer's routed experts."""
    load: float = 1.0
    """The busiest rank's expert tokens over the even share (``expert_load``)."""
    placement: GroupPlacement | None = None
    """Where the expert group's ranks live (prices the all-to-alls; None at ep = 1)."""


class AllToAll(NamedTuple):
    """Seconds and bytes one device sends of a row's all-to-alls in one micro-batch."""

    fwd_s: float
    bwd_s: float
    fwd_sent_b: float
    bwd_sent_b: float

    @property
    def rec_s(self) -> float:
        """A recomputed forward routes its tokens again."""
        return self.fwd_s

    @property
    def rec_sent_b(self) -> float:
        return self.fwd_sent_b


def expert_load(ep: int, imbalance: float = 1.0, capacity_factor: float | None = None) -> float:
    """The busiest rank's expert rows over the even share (module docstring, "load")."""
    if imbalance < 1.0:
        raise ValueError(f"the routing imbalance must be >= 1.0 (got {imbalance})")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"the capacity factor must be positive (got {capacity_factor})")
    load = imbalance if ep > 1 else 1.0
    return min(load, capacity_factor) if capacity_factor is not None else load


def valid_expert_degrees(dp: int, experts: int) -> list[int]:
    """Expert-parallel degrees of a data-parallel degree: the divisors of ``gcd(dp, experts)``
    (``[1]`` for a dense model)."""
    if experts <= 0:
        return [1]
    g = math.gcd(dp, experts)
    return [d for d in range(1, g + 1) if g % d == 0]


@functools.lru_cache(maxsize=1024)
def expert_placements(dp: int, tp: int, pp: int, ep: int, gpus_per_node: int) -> tuple[GroupPlacement, GroupPlacement]:
    """Placements of the worst expert group and the worst expert-data group (the one spanning the
    most nodes, then with the thinnest node, as ``comm_cost.axis_placement`` picks)."""
    groups, data_groups = expert_ranks(dp, tp, pp, ep)

    def worst(ranks: Sequence[Sequence[int]]) -> GroupPlacement:
        placements = [group_placement(list(group), gpus_per_node) for group in ranks]
        return max(placements, key=lambda p: (p.nodes, -p.fewest_per_node, p.ranks_per_node))

    return worst(groups), worst(data_groups)


def _token_dim(gemm: Sequence[Any], tokens: float) -> int | None:
    """Which of a listed expert product's dims holds the token rows: ``m`` for the forward and the
    input gradient, ``k`` for the weight gradient (the contraction over tokens); None when neither
    does (a table whose batch the model fixed scales its products' batch instead)."""
    if math.isclose(float(gemm[0]), tokens, rel_tol=1e-9):
        return 0
    if math.isclose(float(gemm[2]), tokens, rel_tol=1e-9):
        return 2
    return None


def local_expert_gemms(gemms: Sequence[Sequence[Any]], tokens: float, ep: int, load: float) -> list[tuple]:
    """The row's expert products as one rank runs them: ``experts / ep`` local experts (the batch
    dim) each with ``tokens x ep x load`` rows (``tokens``: the even share at ep = 1,
    ``expert_tokens``). The same FLOPs times ``load`` (under a load, to within the rows' rounding up
    to ``LOADED_ROWS_MULTIPLE``)."""
    out = []
    for gemm in gemms:
        dims = [float(x) for x in gemm[:4]]
        rows = _token_dim(gemm, tokens)
        if rows is None:  # the rows dim is not known: the same FLOPs, at the listed shape
            dims[3] *= load
        else:
            dims[rows] *= ep * load
            if load != 1.0:  # whole rows, in a multiple no alignment rule breaks (module docstring)
                dims[rows] = math.ceil(dims[rows] / LOADED_ROWS_MULTIPLE - 1e-9) * LOADED_ROWS_MULTIPLE
            dims[3] /= ep
        out.append((dims[0], dims[1], dims[2], dims[3], int(gemm[4]), gemm[5] if len(gemm) > 5 else None))
    return out


def _without(gemms: Sequence[Sequence[Any]], removed: Sequence[Sequence[Any]]) -> list[tuple]:
    """``gemms`` less ``removed`` (the same entries, by shape and count)."""
    left: dict[tuple, int] = {}
    order: list[tuple] = []
    for gemm in gemms:
        key = tuple(gemm[:4]) + (gemm[5] if len(gemm) > 5 else None,)
        if key not in left:
            order.append(key)
            left[key] = 0
        left[key] += int(gemm[4])
    for gemm in removed:
        key = tuple(gemm[:4]) + (gemm[5] if len(gemm) > 5 else None,)
        if left.get(key, 0) < int(gemm[4]):
            raise ValueError(f"expert product {tuple(gemm)} is not among the row's products")
        left[key] -= int(gemm[4])
    return [(*key[:4], left[key], key[4]) for key in order if left[key] > 0]


def matmul_seconds(
    flops: float,
    gemms: Sequence[Sequence[Any]],
    expert_gemms: Sequence[Sequence[Any]],
    tokens: float,
    expert: ExpertSetting,
    hw: HardwareProfile,
    dtype: str,
    tp: int,
) -> float:
    """A pass's matmul-class seconds on one device (``flops`` at degree ``tp``): as
    ``layer_matmul_time`` prices them, but for the expert products, priced as the rank runs them
    under ``expert`` (``local_expert_gemms``). Exactly ``layer_matmul_time`` at ep 1 and load 1."""
    if not expert_gemms or (expert.ep == 1 and expert.load == 1.0):
        return float(layer_matmul_time(flops, gemms, hw, dtype, tp))
    even = gemm_flops(expert_gemms, tp)
    rest = max(float(flops) - even, 0.0)
    local = local_expert_gemms(expert_gemms, tokens, expert.ep, expert.load)
    return float(layer_matmul_time(rest, _without(gemms, expert_gemms), hw, dtype, tp)) + float(
        layer_gemm_time(local, hw, dtype, tp)
    )


def all_to_all_times(dispatch_bytes: float, moe_layers: int, expert: ExpertSetting, hw: HardwareProfile) -> AllToAll:
    """The row's dispatches and combines of one micro-batch (module docstring, "all-to-all"):
    ``dispatch_bytes`` the whole routed rows of one forward (``expert_dispatch_bytes`` per device)."""
    if expert.ep == 1 or moe_layers == 0 or dispatch_bytes <= 0:
        return AllToAll(0.0, 0.0, 0.0, 0.0)
    assert expert.placement is not None
    size = dispatch_bytes * expert.load / moe_layers  # one layer's buffer
    calls = 2 * moe_layers  # a dispatch and a combine per layer
    seconds = calls * (float(collective_time("all_to_all", size, expert.placement, hw)) + hw.sync_overhead_s)
    sent = calls * float(ring_bytes("all_to_all", size, expert.ep))
    return AllToAll(seconds, seconds, sent, sent)


def expert_state_split(params: int, expert_params: int, ep: int) -> tuple[int, int]:
    """A row's parameters on one rank (``params`` at ep 1, of which ``expert_params`` are routed
    experts) as ``(dense, local experts)``: the experts divided by ``ep`` (whole experts: ``ep``
    divides their number, so it divides their parameters)."""
    if expert_params > params:
        raise ValueError(f"{expert_params} expert parameters of a row of {params}")
    return params - expert_params, expert_params // ep
