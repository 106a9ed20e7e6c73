"""The layer table's schema: its fields by kind and the ``Gemm`` record of its matrix products.

Shared by the symbolic table (``passes.layer_table``), its compiled numeric form
(``passes.compiled_table``) and their readers (``cost_models.layer_row``); imports neither torch
nor sympy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["EXPR_FIELDS", "INT_FIELDS", "GEMM_FIELDS", "GEMM_TP_DIMS", "Gemm"]

EXPR_FIELDS = (
    "fwd_flops",
    "bwd_flops",
    "fwd_flops_tp",
    "bwd_flops_tp",
    "saved_bytes",
    "saved_bytes_tp",
    "input_bytes",
    "boundary_bytes",
    "tp_allreduce_bytes",
    "tp_allreduce_bwd_bytes",
    "fwd_bytes",
    "bwd_bytes",
    "fwd_bytes_tp",
    "bwd_bytes_tp",
    "peak_act_bytes",
    "peak_act_bytes_tp",
    "tp_loss_fwd_bytes",
    "tp_loss_bwd_bytes",
    "core_fwd_flops",
    "core_fwd_flops_tp",
    "core_fwd_bytes",
    "core_fwd_bytes_tp",
    "core_saved_bytes",
    "core_saved_bytes_tp",
    "saved_bytes_sp",
    "fwd_bytes_sp",
    "bwd_bytes_sp",
    "input_bytes_sp",
    "boundary_bytes_sp",
    "tail_saved_bytes",
    "tail_saved_bytes_tp",
    "tail_saved_bytes_sp",
    "frontier_out_bytes",
    "frontier_out_bytes_tp",
    "frontier_out_bytes_sp",
    "sp_reduce_scatter_bytes",
    "sp_all_gather_bytes",
    "sp_grad_all_reduce_bytes",
    "sp_split_bytes",
    "expert_dispatch_bytes",
    "expert_tokens",
)
INT_FIELDS = (
    "param_count",
    "param_count_tp",
    "param_bytes",
    "buffer_bytes",
    "num_ops",
    "tp_allreduce_calls",
    "tp_allreduce_bwd_calls",
    "largest_param",
    "largest_param_tp",
    "core_num_ops",
    "sp_reduce_scatter_calls",
    "sp_all_gather_calls",
    "expert_param_count",
    "expert_param_count_tp",
    "experts",
    "top_k",
    "shared_experts",
    "moe_layers",
)
GEMM_FIELDS = ("fwd_gemms", "bwd_gemms", "core_gemms", "expert_fwd_gemms", "expert_bwd_gemms")
GEMM_TP_DIMS = (None, "m", "n", "k", "batch")


class Gemm(NamedTuple):
    """``count`` identical products of ``batch`` ``m x k`` by ``k x n`` matrices in one pass of a
    layer (sympy sizes in ``b`` and ``s`` in the table, floats from ``LayerTable.numeric``)."""

    m: Any
    n: Any
    k: Any
    batch: Any
    count: int = 1  # type: ignore[assignment]  # the schema's field shadows tuple.count, which no reader calls
    tp_dim: str | None = None
    """The dim tensor parallelism divides (``m``, ``n``, ``k``, ``batch``), or None."""

    @property
    def flops(self) -> Any:
        """FLOPs of all ``count`` products at tp = 1: ``2 m n k batch count``."""
        return 2 * self.m * self.n * self.k * self.batch * self.count
