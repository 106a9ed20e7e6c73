"""What the planner and the runtime agree on, importable without torch.

Every fact both sides of the planner/runtime line use has its one home here; the cost models,
the passes and the planner import these modules (``import-linter`` allows them ``runtime.contract``
and nothing else of the runtime), so a re-plan from the layer-table cache never imports torch:

- ``dtype_table``: the compute dtypes a plan may name and their sizes;
- ``data_roles``: what each model input is fed;
- ``input_errors``: the errors of a bad setting or data source (the CLI's exit status 2);
- ``collective_bytes``: bytes one device sends per collective (plan.json's ``comm_bytes``);
- ``rank_layout``: the (pp, dp, tp) rank layout and each axis's groups;
- ``choices``: the names of schedules, recompute modes, offload tiers and gradient compressions;
- ``compressed_exchange``: what 1-bit Adam's compressed exchange sends and holds, its warm-up;
- ``limits``: the runtime's buffering limits the memory model prices;
- ``overlap``: which communication a run overlaps with compute (plan.json ``overlap``, ``--overlap``);
- ``schedule_ir``: pipeline schedules as data, their validator and simulator.
"""
