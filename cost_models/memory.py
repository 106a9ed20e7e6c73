"""Memory per device: model state under each ZeRO stage, and activations under 1F1B.

Model state. Training with AdamW keeps, per parameter:

===========  =======  =====  ===========  ==========  ==========  =====
dtype        weights  grads  fp32 master  Adam m      Adam v      total
===========  =======  =====  ===========  ==========  ==========  =====
bf16, fp16   2        2      4            4           4           16
fp32         4        4      (none)       4           4           16
===========  =======  =====  ===========  ==========  ==========  =====

reported as ``params`` (training-dtype weights), ``grads`` and ``optimizer`` (master + moments).
ZeRO over ``dp`` ranks shards, in flat buffers padded to a multiple of ``dp`` (``ceil(P / dp)``
elements per rank): stage 1 the optimizer state, stage 2 also the gradients, stage 3 also the
weights. A sharded gradient is an fp32 accumulator (``FP32_GRAD_SHARD`` = 4 bytes per element:
each micro-batch's reduce-scattered gradient is added into it, ``runtime.data_parallel.zero_engine``).
Transient full-size buffers (with ``largest_layer_params`` and ``dp > 1``): stage 3 gathers one
layer's weights, two with prefetch; stages 2 and 3 hold up to ``REDUCTIONS_IN_FLIGHT + 1``
consecutive layers' full gradients and reduced shards. Offload (``cost_models.offload_cost``)
removes the master copy and moments and, at ZeRO 2/3, the gradient shard (``buckets_leave``);
offloaded parameters leave only the gathered layers in flight (``gathers_params``).
``model_state_bytes`` bounds these with the largest layer standing for every layer;
``zero_transient_bytes`` takes the stage's layers in order. ``num_params`` is one device's
replica, after the tensor-parallel and pipeline splits.

Activations under 1F1B. With ``p`` stages and ``M`` micro-batches stage ``i`` holds up to
``inflight = min(p - i, M)`` micro-batches; a recomputed layer keeps only its input and
re-materializes its saved activations for one micro-batch at a time in backward::

    inflight * sum_l (input_l if recompute_l else saved_l) + max_{l recomputed} saved_l

Backward transients. While a layer runs backward, autograd holds the gradient arriving at its
largest intermediate and the one computed from it; its backward also creates each weight's
gradient afresh before adding it to the buffer: ``backward_transient_bytes = max(2 x largest
activation, largest activation + largest weight's gradient)`` (the second wins at an embedding
with a large vocabulary and small micro-batches). The stage's transient is its largest layer's;
it competes with a recomputed layer's re-materialized activations (``transient_peak``).

The stage's peak is the largest of the moments of its backward, in backward order, one per layer
``j``: the micro-batches in flight hold every activation they saved, but the one running backward
holds only what layers ``0..j`` saved (autograd released the later layers' as their backward ran)
and ``j``'s transient, so a large transient early in the stage (an attention's score tiles under
context parallelism) does not meet the later layers' activations. Each moment is taken (a) before
any reduction and (b) with the reductions of ``j`` and the ``REDUCTIONS_IN_FLIGHT`` layers after it
in flight; under ZeRO-2/3 with one micro-batch per step a gradient shard exists only once its
layer's backward ran. This backward order is applied to a single stage (``pp = 1``), where it was
measured (``benchmarks/bench_context.py``: cp2 within 5%, from +9.5% with every activation alive).
A pipeline stage keeps the earlier moment, the largest transient with every activation alive: a
zero-bubble ``W`` keeps the weight products' inputs until it runs, and a 1F1B stage 0 (4 GPT
blocks, pp2 on CPU) measured 2.7% above the backward order's peak, for a reason not yet found.
The ILP's memory rows keep the simpler bound, every saved activation beside the largest transient
(``memory_bound``), never below the peak.

Loss backward. The loss layer saves the vocabulary-wide log-probabilities (``b s V`` elements,
``V / tp`` under a vocabulary-parallel head); its backward holds two more tensors of that size
(the gradients of the log-probabilities and of the logits) while every saved activation is
alive: ``loss_backward_bytes = 2 x logits``, the head's transient and, for a language model, the
largest of the step.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

from cost_models.compute import smax
from runtime.contract.choices import OffloadTier
from runtime.contract.dtype_table import DTYPES
from runtime.contract.limits import REDUCTIONS_IN_FLIGHT

__all__ = [
    "BYTES_PER_PARAM",
    "bytes_per_param",
    "shard_elements",
    "model_state_bytes",
    "inflight_microbatches",
    "activation_bytes",
    "stage_activation_bytes",
    "split_by_tp",
    "memory_breakdown",
    "loss_backward_bytes",
    "backward_transient_bytes",
    "zero_transient_bytes",
    "reduction_bytes",
    "gathers_params",
    "buckets_leave",
]


#: Bytes per parameter of each state component, by training dtype (the table above).
BYTES_PER_PARAM: dict[str, dict[str, int]] = {
    "fp32": {"weights": 4, "grads": 4, "master": 0, "adam_m": 4, "adam_v": 4},
    "bf16": {"weights": 2, "grads": 2, "master": 4, "adam_m": 4, "adam_v": 4},
    "fp16": {"weights": 2, "grads": 2, "master": 4, "adam_m": 4, "adam_v": 4},
}


#: Bytes per element of a sharded (ZeRO-2/3) gradient accumulator: always fp32.
FP32_GRAD_SHARD = 4


def bytes_per_param(dtype: str) -> dict[str, int]:
    """The row of ``BYTES_PER_PARAM`` for ``dtype`` (a copy)."""
    try:
        return dict(BYTES_PER_PARAM[dtype])
    except KeyError:
        raise ValueError(f"unknown training dtype {dtype!r}: expected one of {', '.join(DTYPES)}") from None


def _check_int(name: str, value: Any, lowest: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ValueError(f"{name} must be an integer >= {lowest} (got {value!r})")


def shard_elements(num_params: int, dp: int) -> int:
    """Elements each rank holds of a flat buffer of ``num_params`` padded to a multiple of ``dp``."""
    _check_int("num_params", num_params, 0)
    _check_int("dp", dp, 1)
    return math.ceil(num_params / dp) if num_params else 0


def model_state_bytes(
    num_params: int,
    dtype: str,
    zero_stage: int,
    dp: int,
    largest_layer_params: int = 0,
    prefetch: bool = False,
    offload_optimizer: str = "none",
    offload_params: str = "none",
) -> dict[str, int]:
    """Per-device bytes of ``params``, ``grads`` and ``optimizer`` state (see the module table).

    Exact integers: replicated buckets are ``P * bytes``, sharded ones ``ceil(P / dp) * bytes``,
    plus the transient layer buffers of stages 2 and 3 when ``largest_layer_params`` is given.
    Offload (``cost_models.offload_cost``, "Device memory"): an offloaded optimizer (``cpu`` or
    ``nvme``) leaves no optimizer state on the device and, at ZeRO 2/3, no gradient shard, only
    the buckets in flight; offloaded parameters (ZeRO 3) leave only the gathered layers in flight.
    """
    _check_int("num_params", num_params, 0)
    _check_int("dp", dp, 1)
    _check_int("largest_layer_params", largest_layer_params, 0)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3 (got {zero_stage!r})")
    if largest_layer_params > num_params:
        raise ValueError(f"largest_layer_params ({largest_layer_params}) cannot exceed num_params ({num_params})")
    sizes = bytes_per_param(dtype)
    shard = shard_elements(num_params, dp)
    opt_off, par_off = offload_optimizer != OffloadTier.NONE, offload_params != OffloadTier.NONE
    opt_elems = 0 if opt_off else shard if zero_stage >= 1 else num_params
    grad_elems = 0 if opt_off and zero_stage >= 2 else shard if zero_stage >= 2 else num_params
    weight_elems = 0 if par_off else shard if zero_stage >= 3 else num_params
    params = weight_elems * sizes["weights"]
    grads = grad_elems * (FP32_GRAD_SHARD if zero_stage >= 2 else sizes["grads"])
    if gathers_params(zero_stage, dp, offload_params):
        params += (2 if prefetch else 1) * largest_layer_params * sizes["weights"]
    if buckets_leave(zero_stage, dp, offload_optimizer):
        grads += (REDUCTIONS_IN_FLIGHT + 1) * reduction_bytes(largest_layer_params, dtype, dp)
    optimizer = opt_elems * (sizes["master"] + sizes["adam_m"] + sizes["adam_v"])
    return {"params": int(params), "grads": int(grads), "optimizer": int(optimizer)}


def gathers_params(zero_stage: int, dp: int, offload_params: str = "none") -> bool:
    """Whether layers' full weights are materialized just before use: ZeRO-3 all-gathers them over
    ``dp > 1`` ranks, and offloaded parameters are fetched from the host even at ``dp = 1``."""
    return (zero_stage == 3 and dp > 1) or offload_params != OffloadTier.NONE


def buckets_leave(zero_stage: int, dp: int, offload_optimizer: str = "none") -> bool:
    """Whether each layer's gradient leaves in its own bucket as backward produces it: ZeRO-2/3's
    reduce-scatter over ``dp > 1`` ranks, and an offloaded optimizer's copy to the host at ZeRO 2/3."""
    return zero_stage >= 2 and (dp > 1 or offload_optimizer != OffloadTier.NONE)


def inflight_microbatches(stage_index: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage_index`` holds at once under 1F1B.

    ``min(num_stages - stage_index, num_microbatches)``: the warm-up of stage ``i`` runs
    ``p - i - 1`` forwards, then one more before the first backward frees anything.
    """
    _check_int("num_stages", num_stages, 1)
    _check_int("num_microbatches", num_microbatches, 1)
    if not isinstance(stage_index, int) or not (0 <= stage_index < num_stages):
        raise ValueError(f"stage_index must be in 0..{num_stages - 1} (got {stage_index!r})")
    return min(num_stages - stage_index, num_microbatches)


def activation_bytes(
    per_microbatch_saved_bytes: Any,
    stage_index: int,
    num_stages: int,
    num_microbatches: int,
    recompute_peak_bytes: Any = 0,
) -> Any:
    """Peak activation bytes of a stage: ``inflight * per_microbatch + recompute_peak``.

    ``per_microbatch_saved_bytes`` is what the stage keeps for backward per micro-batch (with
    recomputing layers counted by their boundary input only); ``recompute_peak_bytes`` is the
    largest set of activations re-materialized at once during backward (0 without recompute).
    Accepts sympy expressions.
    """
    k = inflight_microbatches(stage_index, num_stages, num_microbatches)
    return k * per_microbatch_saved_bytes + recompute_peak_bytes


def stage_activation_bytes(
    saved_bytes: Sequence[Any],
    boundary_bytes: Sequence[Any],
    recompute: Sequence[bool],
    stage_index: int,
    num_stages: int,
    num_microbatches: int,
    transient_peak: Any = 0,
    inflight: Any = None,
) -> Any:
    """Peak activation bytes of one stage from its layers (see the module docstring's formula).

    ``inflight`` overrides 1F1B's ``min(p - k, m)`` micro-batches held at once, in units of the
    stage's activations of one micro-batch: another pipeline schedule holds more
    (``cost_models.schedule_cost``: interleaved ranks, zero-bubble ``W`` pending).

    ``transient_peak`` is another short-lived buffer that competes with the recompute peak for
    the same moment of backward (the loss backward's ``2 x logits`` on the last stage).

    For each layer of the stage: ``saved_bytes[i]`` is what autograd keeps for one micro-batch,
    ``boundary_bytes[i]`` the layer's input activation (what a checkpoint keeps), and
    ``recompute[i]`` whether the layer recomputes. All per device, after the TP split.
    """
    if not (len(saved_bytes) == len(boundary_bytes) == len(recompute)):
        raise ValueError(
            f"saved_bytes, boundary_bytes and recompute must have one entry per layer "
            f"(got {len(saved_bytes)}, {len(boundary_bytes)}, {len(recompute)})"
        )
    per_mb: Any = 0
    peak: Any = transient_peak
    for saved, boundary, recomputed in zip(saved_bytes, boundary_bytes, recompute):
        if recomputed:
            per_mb = per_mb + boundary
            peak = smax(peak, saved)
        else:
            per_mb = per_mb + saved
    if inflight is not None:
        return inflight * per_mb + peak
    return activation_bytes(per_mb, stage_index, num_stages, num_microbatches, peak)


def split_by_tp(sharded_bytes: Any, replicated_bytes: Any, tp: int) -> Any:
    """Per-device bytes under tensor parallelism: TP divides what it shards, not the rest.

    Column- and row-parallel matmuls split their weights and the activations between them
    (``sharded_bytes / tp``); layer norms, residual streams and biases of row-parallel layers
    stay whole on every TP rank (``replicated_bytes``).
    """
    _check_int("tp", tp, 1)
    if isinstance(sharded_bytes, int) and not isinstance(sharded_bytes, bool):
        return -(-sharded_bytes // tp) + replicated_bytes
    return sharded_bytes / tp + replicated_bytes


def memory_breakdown(
    num_params: int,
    dtype: str,
    zero_stage: int,
    dp: int,
    activations: Any,
    largest_layer_params: int = 0,
    prefetch: bool = False,
) -> dict[str, Any]:
    """plan.json's ``predicted.memory``: ``params, grads, optimizer, activations, total``."""
    state = model_state_bytes(num_params, dtype, zero_stage, dp, largest_layer_params, prefetch)
    out: dict[str, Any] = dict(state)
    out["activations"] = activations
    out["total"] = state["params"] + state["grads"] + state["optimizer"] + activations
    return out


def loss_backward_bytes(logits_bytes: Any) -> Any:
    """Transient bytes of the loss backward: the log-probability and logit gradients, ``2 x logits``.

    ``logits_bytes`` is one micro-batch's logits on one device (after the TP split). See the
    module docstring's "Loss backward"; accepts sympy expressions.
    """
    return 2 * logits_bytes


def backward_transient_bytes(largest_activation: Any, weight_grad: Any = 0) -> Any:
    """Bytes a layer's backward holds beyond saved activations (see "Backward transients"):
    ``2 x`` its largest activation, or the gradient arriving at it plus the fresh gradient of the
    layer's largest weight (``weight_grad`` bytes), whichever is larger; accepts sympy
    expressions."""
    return smax(2 * largest_activation, largest_activation + weight_grad)


def zero_transient_bytes(
    layer_params: Sequence[int],
    dtype: str,
    zero_stage: int,
    dp: int,
    offload_optimizer: str = "none",
    offload_params: str = "none",
) -> dict[str, int]:
    """Full-size ZeRO buffers that coexist at most, for a stage's layers in forward order.

    ``params``: ZeRO-3's gathered weights of a layer and the next (prefetched) one, the largest
    over consecutive pairs. ``grads``: ZeRO-2/3's full gradients and reduced shards of
    ``REDUCTIONS_IN_FLIGHT + 1`` consecutive layers, the largest over such windows. Both 0 when
    nothing is gathered or reduced (``gathers_params``, ``buckets_leave``: ``dp == 1`` without
    offload, or a stage that does not shard them). Exact integers; remembered per stage (every
    strategy of a candidate asks again for the same layers).
    """
    params, grads = _zero_transients(
        tuple(int(x) for x in layer_params), dtype, zero_stage, dp, offload_optimizer, offload_params
    )
    return {"params": params, "grads": grads}


@functools.lru_cache(maxsize=4096)
def _zero_transients(
    layer_params: tuple[int, ...], dtype: str, zero_stage: int, dp: int, offload_optimizer: str, offload_params: str
) -> tuple[int, int]:
    """:func:`zero_transient_bytes`' two figures."""
    _check_int("dp", dp, 1)
    sizes = bytes_per_param(dtype)
    for x in layer_params:
        _check_int("layer params", x, 0)

    def window(n: int, per: Any) -> int:
        vals = [per(x) for x in layer_params]
        if not vals:
            return 0
        n = min(n, len(vals))
        return max(sum(vals[i : i + n]) for i in range(len(vals) - n + 1))

    params = window(2, lambda x: x * sizes["weights"]) if gathers_params(zero_stage, dp, offload_params) else 0
    grads = (
        window(REDUCTIONS_IN_FLIGHT + 1, lambda x: reduction_bytes(x, dtype, dp))
        if buckets_leave(zero_stage, dp, offload_optimizer)
        else 0
    )
    return int(params), int(grads)


@functools.lru_cache(maxsize=4096)
def reduction_bytes(layer_params: int, dtype: str, dp: int) -> int:
    """One ZeRO-2/3 gradient reduction's buffers: the layer's full gradient and its reduced
    shard, in the training dtype (at ``dp = 1``, an offloaded optimizer's bucket: the gradient
    alone, which is its own shard)."""
    shard = shard_elements(int(layer_params), dp) if dp > 1 else 0
    return (int(layer_params) + shard) * bytes_per_param(dtype)["grads"]
