"""Tensor and sequence parallelism read from the graph: which matmuls split by columns or rows
(``tp_analysis``), where the sequence dim can stay split between them (``sp_analysis``), the
vocabulary both walks share (``tp_common``), and what divides by tp in the layer table
(``tp_costs``). Codegen applies the same decisions the cost pass prices."""
