"""One layer-table row in numbers, as typed records: what a candidate's per-layer costs read.

``passes.layer_table.LayerTable.numeric`` gives each row at one ``(b, s)`` as a mapping keyed by
the ``LayerCosts`` field names, where an amount that tensor or sequence parallelism divides comes
as three keys: ``<name>`` (the whole, at tp = 1), ``<name>_tp`` (the part tp divides) and
``<name>_sp`` (the part sequence parallelism divides). :meth:`LayerRow.from_numbers` reads that
mapping once, in one place, into :class:`Sharded` amounts and a few groups, so that the cost
model reads ``row.saved_bytes.per_device(tp, sp)`` rather than concatenated keys.

Per device at degree ``tp`` (sequence parallel or not)::

    per_device = whole - tp_part + tp_part / tp - (sp_part (1 - 1 / tp) if sp else 0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from passes.table_fields import EXPR_FIELDS, GEMM_FIELDS, INT_FIELDS, Gemm

if TYPE_CHECKING:
    from passes.compiled_table import CompiledTable
    from passes.layer_table import LayerTable

__all__ = ["Sharded", "Largest", "TensorParallelTraffic", "AttentionCore", "RoutedExperts", "LayerRow", "NumericTable"]


@dataclass(frozen=True)
class Sharded:
    """A per-layer amount at tp = 1 and the parts of it that tensor and sequence parallelism divide."""

    whole: float
    """The amount at tp = 1 (``<name>`` in the layer table)."""
    tp_part: float = 0.0
    """Of ``whole``, what tensor parallelism divides (``<name>_tp``)."""
    sp_part: float = 0.0
    """Of ``whole``, what sequence parallelism divides (``<name>_sp``; a part of the replicated rest)."""

    def sp_removed(self, tp: int, sequence_parallel: bool) -> float:
        """What sequence parallelism removes from the per-device amount."""
        return self.sp_part * (1 - 1 / tp) if sequence_parallel else 0.0

    def per_device(self, tp: int, sequence_parallel: bool = False) -> float:
        """The amount on one device: the part tp divides, divided; the rest whole; less SP's share."""
        return self.whole - self.tp_part + self.tp_part / tp - self.sp_removed(tp, sequence_parallel)


@dataclass(frozen=True)
class Largest:
    """The largest single tensor of a kind: the largest one tp leaves whole and the largest one it shards."""

    replicated: float
    """The largest that tensor parallelism does not shard (``<name>``)."""
    sharded: float
    """The largest held in tp shards, its full size (``<name>_tp``)."""

    def per_device(self, tp: int) -> float:
        """The larger of the two on one device (the sharded one divided by tp)."""
        return max(self.replicated, self.sharded / tp)

    def per_device_elements(self, tp: int) -> int:
        """As :meth:`per_device`, counting whole elements (the sharded one rounded up)."""
        return max(int(self.replicated), math.ceil(self.sharded / tp))


@dataclass(frozen=True)
class TensorParallelTraffic:
    """What one layer sends over the tensor-parallel group in one pass of one micro-batch (bytes of
    the whole tensors) and in how many calls."""

    allreduce_fwd_bytes: float
    """``tp_allreduce_bytes``: all-reduced per forward (row-parallel outputs)."""
    allreduce_bwd_bytes: float
    """``tp_allreduce_bwd_bytes``: all-reduced per backward (column-parallel inputs)."""
    allreduce_fwd_calls: int
    """``tp_allreduce_calls``."""
    allreduce_bwd_calls: int
    """``tp_allreduce_bwd_calls``."""
    sp_reduce_scatter_bytes: float
    """Reduce-scattered per forward under SP in place of all-reduced."""
    sp_all_gather_bytes: float
    """All-gathered per forward under SP before the column-parallel products."""
    sp_grad_all_reduce_bytes: float
    """Gradients of replicated weights used on sequence shards, all-reduced per backward under SP."""
    sp_split_bytes: float
    """Replicated full-length values each rank keeps its positions of under SP."""
    sp_reduce_scatter_calls: int
    sp_all_gather_calls: int


@dataclass(frozen=True)
class AttentionCore:
    """The layer's attention cores' forward: what selective recompute runs again."""

    fwd_flops: Sharded
    fwd_bytes: Sharded
    saved_bytes: Sharded
    """What only the cores keep for backward: what selective recompute frees."""
    num_ops: int
    gemms: tuple[Gemm, ...]


@dataclass(frozen=True)
class RoutedExperts:
    """The row's routed experts (``passes.moe``): what expert parallelism re-prices
    (``cost_models.expert_cost``). All 0 / empty for a dense row."""

    param_count: Sharded
    """Their parameters (``expert_param_count``; the part tp shards)."""
    experts: int
    top_k: int
    moe_layers: int
    dispatch_bytes: Sharded
    """Routed token rows of one forward's dispatch, all layers (``expert_dispatch_bytes``; under
    sequence parallelism each tp rank routes its own positions: the sp part is all of it)."""
    tokens: float
    """Rows per expert at the even share (``expert_tokens``)."""
    fwd_gemms: tuple[Gemm, ...]
    bwd_gemms: tuple[Gemm, ...]

    @property
    def present(self) -> bool:
        return self.experts > 0 and self.moe_layers > 0


@dataclass(frozen=True, eq=False)
class LayerRow:
    """One layer-table row at one ``(b, s)``: every number a candidate's per-layer cost reads.

    Identity, not value, is its equality: ``NumericTable`` builds one per distinct row and the
    per-row work is cached by the row's identity."""

    fwd_flops: Sharded
    bwd_flops: Sharded
    fwd_bytes: Sharded
    """Memory-bound bytes of the forward (sharded by tp and SP)."""
    bwd_bytes: Sharded
    tp_loss_fwd_bytes: float
    """Change of the forward's bytes at tp > 1 under the vocab-parallel loss (whole; per device / tp)."""
    tp_loss_bwd_bytes: float
    saved_bytes: Sharded
    tail_saved_bytes: Sharded
    frontier_out_bytes: Sharded
    input_bytes: Sharded
    boundary_bytes: Sharded
    peak_act_bytes: Largest
    largest_param: Largest
    param_count: Sharded
    buffer_bytes: int
    num_ops: int
    fwd_gemms: tuple[Gemm, ...]
    bwd_gemms: tuple[Gemm, ...]
    tp_traffic: TensorParallelTraffic
    core: AttentionCore
    experts: RoutedExperts

    @classmethod
    def from_numbers(cls, numbers: Mapping[str, Any]) -> LayerRow:
        """The typed row of one ``LayerTable.numeric`` (or ``NumericTable.rows``) entry."""

        def sharded(name: str) -> Sharded:
            return Sharded(numbers[name], numbers.get(name + "_tp", 0.0), numbers.get(name + "_sp", 0.0))

        return cls(
            fwd_flops=sharded("fwd_flops"),
            bwd_flops=sharded("bwd_flops"),
            fwd_bytes=sharded("fwd_bytes"),
            bwd_bytes=sharded("bwd_bytes"),
            tp_loss_fwd_bytes=numbers["tp_loss_fwd_bytes"],
            tp_loss_bwd_bytes=numbers["tp_loss_bwd_bytes"],
            saved_bytes=sharded("saved_bytes"),
            tail_saved_bytes=sharded("tail_saved_bytes"),
            frontier_out_bytes=sharded("frontier_out_bytes"),
            input_bytes=sharded("input_bytes"),
            boundary_bytes=sharded("boundary_bytes"),
            peak_act_bytes=Largest(numbers["peak_act_bytes"], numbers["peak_act_bytes_tp"]),
            largest_param=Largest(numbers["largest_param"], numbers["largest_param_tp"]),
            param_count=sharded("param_count"),
            buffer_bytes=numbers["buffer_bytes"],
            num_ops=numbers["num_ops"],
            fwd_gemms=tuple(numbers.get("fwd_gemms", ())),
            bwd_gemms=tuple(numbers.get("bwd_gemms", ())),
            tp_traffic=TensorParallelTraffic(
                allreduce_fwd_bytes=numbers["tp_allreduce_bytes"],
                allreduce_bwd_bytes=numbers["tp_allreduce_bwd_bytes"],
                allreduce_fwd_calls=numbers["tp_allreduce_calls"],
                allreduce_bwd_calls=numbers["tp_allreduce_bwd_calls"],
                sp_reduce_scatter_bytes=numbers["sp_reduce_scatter_bytes"],
                sp_all_gather_bytes=numbers["sp_all_gather_bytes"],
                sp_grad_all_reduce_bytes=numbers["sp_grad_all_reduce_bytes"],
                sp_split_bytes=numbers["sp_split_bytes"],
                sp_reduce_scatter_calls=numbers["sp_reduce_scatter_calls"],
                sp_all_gather_calls=numbers["sp_all_gather_calls"],
            ),
            core=AttentionCore(
                fwd_flops=sharded("core_fwd_flops"),
                fwd_bytes=sharded("core_fwd_bytes"),
                saved_bytes=sharded("core_saved_bytes"),
                num_ops=numbers["core_num_ops"],
                gemms=tuple(numbers.get("core_gemms", ())),
            ),
            experts=RoutedExperts(
                param_count=Sharded(numbers.get("expert_param_count", 0), numbers.get("expert_param_count_tp", 0)),
                experts=int(numbers.get("experts", 0)),
                top_k=int(numbers.get("top_k", 0)),
                moe_layers=int(numbers.get("moe_layers", 0)),
                dispatch_bytes=Sharded(
                    numbers.get("expert_dispatch_bytes", 0.0), 0.0, numbers.get("expert_dispatch_bytes", 0.0)
                ),
                tokens=numbers.get("expert_tokens", 0.0),
                fwd_gemms=tuple(numbers.get("expert_fwd_gemms", ())),
                bwd_gemms=tuple(numbers.get("expert_bwd_gemms", ())),
            ),
        )


class NumericTable:
    """A layer table with its symbolic costs turned into numbers, cached per ``(b, s)``.

    Reads the one layer-table schema (``passes.layer_table``: ``EXPR_FIELDS`` and ``INT_FIELDS``);
    ``LayerTable.numeric`` compiles each distinct expression once (identical blocks share
    expressions, so a 96-block table costs about as much as a 3-layer one) and rejects sizes the
    trace fixed. ``groups`` lists the distinct rows, which is what the per-candidate costs are
    computed from.
    """

    def __init__(self, table: LayerTable | CompiledTable):
        self.table = table
        self.layers: list[Any] = list(table.layers)
        if not self.layers:
            raise ValueError("the layer table is empty")
        self.names = [lay.name for lay in self.layers]
        self.kinds = [lay.kind for lay in self.layers]
        self.model = dict(table.model)
        self.num_blocks = sum(1 for kind in self.kinds if kind == "block")
        self.tied = [tie for tie in table.tied if tie["layers"][0] < tie["layers"][1]]
        """Weights read by several rows (``LayerTable.tied``): with pipeline stages each stage that
        reads one holds a copy (priced by ``cost_models.tied_cost``)."""
        self._rows: dict[tuple, Any] = {}
        self.work_memo: dict[tuple, Any] = {}
        """``_layer_cost``'s per-row work, shared by the candidates that agree on it."""
        self.cache: dict[tuple, Any] = {}
        """Rows other cost models derive from these (``cost_models.strategy.context_rows``), kept
        for the table's life: their identities key ``work_memo`` too."""
        self._nonzero: frozenset[str] | None = None
        self._shapes: list[int] | None = None

    def has_field(self, name: str) -> bool:
        """Whether some row's ``name`` (an ``EXPR_FIELDS`` entry) is not identically zero: what
        the model has at all (``saved_bytes_sp``: sequence-parallel activations)."""
        if self._nonzero is None:
            self._nonzero = frozenset(self.table.nonzero_fields())
        return name in self._nonzero

    def groups(self, micro_batch: int, seq_len: int) -> tuple[list[dict[str, Any]], list[int]]:
        """Distinct rows at ``(b, s)`` and, per layer, the index of its row (cached). Only one
        layer of each shape (``LayerTable.shapes``: equal numbers at every size) is evaluated;
        shapes whose numbers coincide at ``(b, s)`` share a row too."""
        key = ("groups", micro_batch, seq_len)
        if key not in self._rows:
            if self._shapes is None:
                self._shapes = self.table.shapes()
            # shapes are numbered in order of first appearance: their first layers, in layer order
            firsts = [self._shapes.index(shape) for shape in range(len(set(self._shapes)))]
            numbers = self.table.numeric_at(micro_batch, seq_len, firsts)
            distinct: dict[tuple, int] = {}
            representatives: list[dict[str, Any]] = []
            row_of_shape: dict[int, int] = {}
            for position, row in zip(firsts, numbers):
                row.update({name: int(row[name]) for name in INT_FIELDS})
                values = tuple(row[name] for name in EXPR_FIELDS + INT_FIELDS)
                values += tuple(row.get(name, ()) for name in GEMM_FIELDS)
                if values not in distinct:
                    distinct[values] = len(representatives)
                    representatives.append(row)
                row_of_shape[self._shapes[position]] = distinct[values]
            self._rows[key] = (representatives, [row_of_shape[shape] for shape in self._shapes])
        return self._rows[key]

    def layer_rows(self, micro_batch: int, seq_len: int) -> tuple[list[LayerRow], list[int]]:
        """:meth:`groups` as typed rows (cached: a row's identity keys ``work_memo``)."""
        key = ("layer_rows", micro_batch, seq_len)
        if key not in self._rows:
            representatives, row_of_layer = self.groups(micro_batch, seq_len)
            self._rows[key] = ([LayerRow.from_numbers(row) for row in representatives], row_of_layer)
        return self._rows[key]

    def rows(self, micro_batch: int, seq_len: int) -> list[dict[str, Any]]:
        """Per-layer numbers at micro-batch size ``b`` and sequence length ``s`` (cached): every
        ``EXPR_FIELDS`` entry as a float, every ``INT_FIELDS`` entry as an int."""
        key = (micro_batch, seq_len)
        if key not in self._rows:
            numbers = []
            for row in self.table.numeric(micro_batch, seq_len):
                row.update({name: int(row[name]) for name in INT_FIELDS})
                numbers.append(row)
            self._rows[key] = numbers
        return self._rows[key]

    def flops_per_sequence(self, seq_len: int) -> float:
        """Forward + backward FLOPs of one sequence through the whole model (no recompute)."""
        return sum(row["fwd_flops"] + row["bwd_flops"] for row in self.rows(1, seq_len))

    def total_params(self) -> int:
        return int(sum(lay.param_count for lay in self.layers))
