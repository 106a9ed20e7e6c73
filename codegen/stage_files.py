"""``planner compile``'s back half: an exported model + plan.json -> ``stage_<k>.py`` + ``manifest.json``.

One file per entry of the plan's ``stages``: a pipeline stage, or with ``virtual_stages = v > 1``
a model chunk (``p * v`` of them in model order, chunk ``k`` run by pipeline rank ``k % p``; the
manifest's ``chunks_of_rank`` lists each rank's chunks and each chunk entry its ``pp_rank``). A
plan with one chunk per rank compiles exactly as before (no new manifest keys).

The front end (``planner.frontend.trace.export_training_module``) rebuilds the plan's model on the
meta device at the plan's micro-batch shape and exports it; codegen receives that graph as an
``ExportedModel``. ``passes`` assign nodes to layer-table rows; ``codegen.tp_rewrite``
rewrites the graph for the plan's tp degree; ``codegen.lower`` cuts it into stages and prints the
source. Compiling the same plan twice writes byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

import runtime
from codegen.codegen_errors import CodegenError
from codegen.context_rewrite import rewrite_context
from codegen.expert_rewrite import ExpertRewrite, rewrite_experts
from codegen.lower import LayerGraph, StageOptions, StageSpec, emit_stage_source, get_tensor, partition_graph
from codegen.tp_rewrite import plan_tp_rewrite
from passes.causal_rewrite import by_verdicts, causal_at_length, rewrite_causal
from passes.layers import assign_layers, layer_names
from passes.op_class import classify_ops
from planner.plan import Plan, output_problem, plan_hash
from runtime.contract.rank_layout import crosses_nodes

__all__ = ["ExportedModel", "compile_exported", "check_out_dir"]


@dataclass
class ExportedModel:
    """What codegen receives: the plan's model exported at one micro-batch."""

    module: fx.GraphModule
    """``ExportedProgram.module()``: parameters are ``get_attr`` nodes named by their original
    FQN, shapes are static (the plan's micro-batch size and sequence length)."""
    block_paths: list[str]
    """Module paths of the repeated blocks, in order (layer-table rows 1..L)."""
    vocab: int
    """Vocabulary size (0 when the model has none), recorded in the manifest."""
    dims: dict[str, int] = field(default_factory=dict)
    """The model's sizes tensor parallelism must divide: hidden, heads, kv_heads, vocab, ffn."""
    causal_cores: list[bool] | None = None
    """Which SDPA cores, in order, get ``is_causal`` in place of their explicit mask, read from an
    export at the planner's probe length (``passes.causal_rewrite.causal_verdicts``); None: probe
    this export's masks at its own length."""
    windows: list[int | None] | None = None
    """The sliding window the model's config states for each block (None where it has none; None
    for a model without windows): what context parallelism keeps of an explicit mask."""


def _layered(model: ExportedModel, plan: Plan):
    """Assign every node of the exported module to its layer-table row; return the graph module,
    the row of a node and the rows' names."""
    gm = model.module
    roles = {n.name: "input" for n in gm.graph.nodes if n.op == "placeholder"}
    probe = causal_at_length if model.causal_cores is None else by_verdicts(gm, model.causal_cores)
    rewrite_causal(gm, roles, probe)  # an explicit causal mask -> is_causal, as the planner priced it
    assign_layers(gm, model.block_paths, roles)
    classify_ops(gm)
    names = layer_names(gm, len(model.block_paths), model.block_paths)
    if len(names) != plan.model.layers + 2:
        raise CodegenError(
            f"the model traced to {len(names) - 2} blocks but the plan was made for "
            f"{plan.model.layers}; re-run `planner plan`."
        )
    params = sum(parameter.numel() for _, parameter in gm.named_parameters())
    if plan.model.params and params != plan.model.params:
        raise CodegenError(
            f"the model traced to {params:,} parameters but the plan was made for {plan.model.params:,} "
            f"({plan.model.spec} changed since it was planned, or the plan was edited); re-run `planner plan`."
        )
    return gm, (lambda n: n.meta["layer"]), names


def _requires_grad(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Which values carry gradients: float outputs of ops that read a trainable parameter (by any
    of its names: a tied embedding's reads name the table, which ``named_parameters`` lists once,
    under the head's name)."""
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    carries_grad: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        is_float = isinstance(val, torch.Tensor) and val.is_floating_point()
        if n.op == "get_attr":
            carries_grad[n] = n.target in params
        elif n.op == "placeholder":
            carries_grad[n] = False
        else:
            carries_grad[n] = is_float and any(carries_grad.get(arg, False) for arg in n.all_input_nodes)
    return carries_grad


def _meta(n: fx.Node, requires_grad: dict, seq: dict | None = None, tp: int = 1, split: bool = False) -> dict:
    """What a stage sends or receives; ``seq`` maps the sequence-sharded values to their sequence
    dim (each tp rank holds ``1/tp`` of it: sequence parallelism). Across a ``split`` boundary (two
    nodes, ``_splits``) a value every tp rank holds whole is marked ``tp_split``: each sends its
    ``1/tp`` slice and the next stage's tp ranks all-gather them (``runtime.pipeline.transport``)."""
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"value {n.name} crossing a stage boundary is not a tensor")
    shape = [int(seq_dim) for seq_dim in val.shape]
    seq_dim = (seq or {}).get(n.name)
    if isinstance(seq_dim, int):
        shape[seq_dim] //= tp
    meta = {
        "name": n.name,
        "shape": shape,
        "dtype": str(val.dtype).replace("torch.", ""),
        "requires_grad": bool(requires_grad[n]),
    }
    if split and tp > 1 and not isinstance(seq_dim, int) and math.prod(shape) % tp == 0:
        meta["tp_split"] = True  # every tp rank holds it whole: sent as 1/tp slices, gathered
    return meta


def _splits(plan: Plan, sender: int, receiver: int) -> bool:
    """Whether model chunk ``sender``'s messages to chunk ``receiver`` travel split over the
    tensor-parallel group: they cross two nodes (``cost_models.strategy.CandidateCosts.send_s``
    prices the same) without sequence parallelism."""
    if plan.tp == 1 or plan.sequence_parallel:
        return False
    width = plan.dp * plan.cp * plan.tp
    return crosses_nodes(sender % plan.pp, receiver % plan.pp, width, plan.hardware.gpus_per_node)


def _write(path: str, text: str) -> None:
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _stage_where(plan: Plan, spec: StageSpec) -> str:
    """Where the stage runs: ``stage k of pp``, or with v > 1 its model chunk and pipeline rank
    (``plan.stages`` in model order, chunk k on pp rank k % pp)."""
    if plan.virtual_stages == 1:
        return f"stage {spec.index} of {plan.pp}"
    return f"model chunk {spec.index} of {len(plan.stages)} (pipeline rank {spec.index % plan.pp})"


def _stage_header(plan: Plan, spec: StageSpec, plan_digest: str, where: str) -> str:
    """The comment lines at the top of a stage file."""
    header = (
        f"# Generated by `planner compile` from plan {plan_digest} -- do not edit.\n"
        f"# Model {plan.model.spec!r}: {where}, layer-table rows "
        f"{spec.layers[0]}..{spec.layers[-1]}; dp={plan.dp} tp={plan.tp} pp={plan.pp} "
        f"zero={plan.zero_stage} micro-batch={plan.micro_batch_size} dtype={plan.dtype}"
        + (" sequence-parallel." if plan.sequence_parallel else ".")
        + (
            f"\n# Context parallel: cp={plan.cp} ({plan.context_parallel['method']}), "
            f"{plan.seq_len // plan.cp} of {plan.seq_len} positions per rank."
            if plan.cp > 1
            else ""
        )
    )
    return "\n".join("# " + line.lstrip("# ").replace("\r", " ") for line in header.splitlines())


def _stage_params(
    gm: fx.GraphModule, spec: StageSpec, param_map: dict[str, str], shard_info: dict, experts: dict[str, list[int]]
) -> dict:
    """The manifest's ``params`` of one stage: each attribute's FQN, shape, trainability, tp
    shard, (for a weight several stages read) the stages holding a copy and (for a routed expert
    weight, ``[E, ...]`` in full) ``"expert": true``."""
    params = {}
    for attr, fqn in param_map.items():
        tensor = get_tensor(gm, fqn)
        params[attr] = {
            "fqn": fqn,
            "shape": [int(size) for size in tensor.shape],
            "trainable": isinstance(tensor, torch.nn.Parameter),
            "shard": shard_info.get(fqn),
        }
        if attr in spec.tied:  # a copy per stage in this list; gradients summed over them
            params[attr]["tied"] = spec.tied[attr]
        if fqn in experts:  # the runtime keeps rows [r E/ep, (r+1) E/ep) on expert-parallel rank r
            params[attr]["expert"] = True
            params[attr]["shape"] = experts[fqn]  # the whole [E, ...] (the stage allocates its rows)
    return params


@dataclass
class _StageContext:
    """What every stage file of one compile shares."""

    gm: fx.GraphModule
    names: list[str]
    """The layer-table rows' names."""
    layers: list[LayerGraph]
    plan_digest: str
    tp_rewrite: Any
    shard_info: dict
    requires_grad: dict[fx.Node, bool]
    sequence_sharded: dict | None
    """Values sharded along the sequence (sequence parallelism) -> their sequence dim."""
    experts: ExpertRewrite | None = None
    """The routed-expert rewrite (expert parallelism or capacity), None when the graph runs as traced."""


def _compile_stage(plan: Plan, spec: StageSpec, context: _StageContext, out_dir: str) -> dict:
    """Write one stage file; return its manifest entry."""
    where = _stage_where(plan, spec)
    options = StageOptions(
        num_stages=len(plan.stages),
        header=_stage_header(plan, spec, context.plan_digest, where),
        checkpoint_layers=frozenset(plan.checkpoint_layers),
        selective_layers=frozenset(plan.selective_layers),
        doc=None if plan.virtual_stages == 1 else where[0].upper() + where[1:],
    )
    src, param_map = emit_stage_source(context.gm, context.layers, spec, options, rewrite=context.tp_rewrite)
    file_name = f"stage_{spec.index}.py"
    _write(os.path.join(out_dir, file_name), src)
    crossing = (context.requires_grad, context.sequence_sharded, plan.tp)
    index = spec.index
    entry = {
        "index": spec.index,
        "file": file_name,
        "class": f"Stage{spec.index}",
        "layers": spec.layers,
        "layer_names": [context.names[i] for i in spec.layers],
        "data_inputs": list(spec.data_inputs),
        "recv": [_meta(n, *crossing, _splits(plan, index - 1, index)) for n in spec.recv],
        "send": [_meta(n, *crossing, _splits(plan, index, index + 1)) for n in spec.send],
        "params": _stage_params(
            context.gm, spec, param_map, context.shard_info, context.experts.params if context.experts else {}
        ),
        "sha256": hashlib.sha256(src.encode()).hexdigest(),
    }
    if plan.virtual_stages > 1:
        entry["pp_rank"] = spec.index % plan.pp
    return entry


def check_out_dir(out_dir: str) -> None:
    """A ``CodegenError`` when ``out_dir`` cannot hold the stage files: an existing file (left as it
    is), a path under a file, a folder this user cannot write in. A missing folder is created."""
    problem = output_problem(out_dir, folder=True)
    if problem is not None:
        raise CodegenError(
            f"cannot compile into {out_dir}: it {problem}. The stage files go into a folder: give "
            "--out (or train's --compiled) a new or existing folder."
        )


def _make_out_dir(out_dir: str) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise CodegenError(f"cannot create the folder {out_dir} for the stage files: {e.strerror or e}.") from None


def compile_exported(plan: Plan, model: ExportedModel, out_dir: str) -> dict:
    """Write one module per pipeline stage and the manifest; return the manifest. An ``out_dir``
    that cannot be a folder is a ``CodegenError`` (``check_out_dir``), whatever is there kept."""
    check_out_dir(out_dir)
    gm, layer_of, names = _layered(model, plan)
    tp_rewrite, shard_info = plan_tp_rewrite(gm, layer_of, plan, model.vocab, model.dims)
    sequence_sharded = getattr(tp_rewrite, "sequence_sharded", None)  # sequence parallelism: S/tp positions
    experts = rewrite_experts(gm, plan)  # after the tp analysis, which reads the graph as traced
    # context parallelism: traced at seq_len / cp; attention, positions and the loss over the cp group
    context_parallel = rewrite_context(gm, plan, plan.seq_len // plan.cp, model.windows)
    layers, specs, _ = partition_graph(gm, layer_of, names, plan.stages)
    context = _StageContext(
        gm, names, layers, plan_hash(plan), tp_rewrite, shard_info, _requires_grad(gm), sequence_sharded, experts
    )
    _make_out_dir(out_dir)
    stages = [_compile_stage(plan, spec, context, out_dir) for spec in specs]
    chunks = len(plan.stages)
    manifest = {
        "format": 1,
        "runtime_version": runtime.__version__,
        "plan_hash": context.plan_digest,
        "plan": plan.to_dict(),
        "model": {
            "spec": plan.model.spec,
            "sizes": plan.model.sizes,
            "vocab": model.vocab,
            "layer_names": names,
            "inputs": [n.name for n in gm.graph.nodes if n.op == "placeholder"],
        },
        "stages": stages,
    }
    if context_parallel is not None:  # the trainer shards the sequences and sets the method from it
        manifest["context_parallel"] = context_parallel
    if experts is not None:  # runtime.stages keeps each rank's experts of the "expert": true weights
        manifest["expert_parallel"] = experts.manifest()
    if plan.virtual_stages > 1:  # which rank runs which chunks (runtime.stages.compiled_stages.rank_chunks reads it)
        manifest["chunks_of_rank"] = [list(range(rank, chunks, plan.pp)) for rank in range(plan.pp)]
    _write(os.path.join(out_dir, "manifest.json"), json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _remove_stale_stages(out_dir, {stage["file"] for stage in stages})
    return manifest


def _remove_stale_stages(out_dir: str, written: set[str]) -> None:
    """Delete the ``stage_<k>.py`` an earlier compile of another plan left in ``out_dir`` (a pp=2
    compile's ``stage_1.py`` under a pp=1 one): the folder holds what its manifest names."""
    for name in os.listdir(out_dir):
        if re.fullmatch(r"stage_\d+\.py", name) and name not in written:
            try:
                os.remove(os.path.join(out_dir, name))
            except OSError:
                pass  # a file that cannot go is still not in the manifest, which is what runs
