"""The weight-gradient half of a layer's backward (``W`` of the zero-bubble schedules).

A split backward (``runtime.pipeline.executor``) runs the input gradients (``B``) first and the weight
gradients (``W``) when the schedule says; ``cost_models.schedule_cost`` prices the schedule with
``W``'s time and what a micro-batch keeps from ``B`` to ``W``, both per layer from the layer
table's listed products (``fwd_gemms`` / ``bwd_gemms``):

- a *weight-gradient product* contracts over the micro-batch's tokens (``dW = X^T dY``: batch 1,
  ``k = b s``, ``m != b s``); an input-gradient product has the tokens as ``m`` and attention's
  core products are batched. A table without listed products takes half of the backward's
  matmul FLOPs (a linear layer's backward is one input-gradient and one weight-gradient product
  of equal size);
- what ``W`` needs from ``B`` beyond the activations is the gradient of each weight product's
  output (the runtime restarts autograd at those edges): per forward product that multiplies the
  tokens by a weight (batch 1, ``m = b s``), its ``m x n`` output, per device.
"""

from __future__ import annotations

from cost_models.gemm_cost import gemm_flops, layer_matmul_time, per_device_gemms
from cost_models.hardware import HardwareProfile
from cost_models.layer_row import LayerRow
from cost_models.memory import bytes_per_param

__all__ = ["wgrad_device_time", "wgrad_kept_bytes", "fused_weight_elements"]


def _weight_products(row: LayerRow, tokens: float) -> list:
    """The row's listed weight-gradient products (module docstring)."""
    return [
        gemm for gemm in row.bwd_gemms if gemm.batch == 1 and abs(gemm.k - tokens) < 0.5 and abs(gemm.m - tokens) >= 0.5
    ]


def fused_weight_elements(row: LayerRow, tp: int, tokens: float, column: bool, row_parallel: bool) -> float:
    """Elements per device of the weights whose gradient the runtime's tensor-parallel linears add
    into the gradient buffer with the product itself (``runtime.tensor_parallel.overlapped``,
    gradient-accumulation fusion), so that backward makes no separate accumulation pass over
    them: with ``column``, the column-parallel weights (their weight-gradient product's output
    rows are what tp splits, ``tp_dim`` m: QKV, the first MLP linear, the LM head); with
    ``row_parallel``, the row-parallel ones too (``tp_dim`` n: the output projection, the second
    MLP linear). The callers say when each runs fused (``layer_work._pass_times``)."""
    if tp == 1 or not (column or row_parallel):
        return 0.0
    fused = [
        gemm
        for gemm in _weight_products(row, tokens)
        if (gemm.tp_dim == "m" and column) or (gemm.tp_dim == "n" and row_parallel)
    ]
    return float(sum(m * n * batch * count for m, n, _k, batch, count in per_device_gemms(fused, tp)))


def wgrad_device_time(
    row: LayerRow, bwd_flops: float, hw: HardwareProfile, dtype: str, tp: int, tokens: float
) -> float:
    """Device seconds of a layer's weight-gradient products at degree ``tp`` (``bwd_flops``: the
    backward's FLOPs at that degree, for the fallback without listed products)."""
    if not row.bwd_gemms:
        return float(layer_matmul_time(bwd_flops / 2, (), hw, dtype, tp))
    weight_products = _weight_products(row, tokens)
    if not weight_products:
        return 0.0
    return float(layer_matmul_time(gemm_flops(weight_products, tp), weight_products, hw, dtype, tp))


def wgrad_kept_bytes(row: LayerRow, dtype: str, tp: int, tokens: float, sequence_parallel: bool = False) -> float:
    """Bytes per device of the output gradients ``W`` needs, for one micro-batch of the layer:
    those of every node that reads a weight (``frontier_out_bytes``: products and norms), else
    (a table without that field) of the listed products that multiply the tokens by a weight."""
    if row.frontier_out_bytes.whole > 0:
        return float(row.frontier_out_bytes.per_device(tp, sequence_parallel))
    token_products = [gemm for gemm in row.fwd_gemms if gemm.batch == 1 and abs(gemm.m - tokens) < 0.5]
    return float(
        sum(rows * cols * batch * count for rows, cols, _inner, batch, count in per_device_gemms(token_products, tp))
        * bytes_per_param(dtype)["weights"]
    )
