"""``planner export deepspeed plan.json``: the equivalent DeepSpeed configuration and launch line.

Mapping (DeepSpeed's names on the left):

- ``train_batch_size`` = ``global_batch`` = ``train_micro_batch_size_per_gpu`` (the plan's
  micro-batch size) x ``gradient_accumulation_steps`` (the plan's micro-batch count) x the
  data-parallel degree. DeepSpeed checks this identity, so it holds by construction.
- ``zero_optimization.stage`` = the plan's ZeRO stage, with communication overlap and contiguous
  gradients on (what our runtime does with its per-layer buffers).
- ``bf16`` / ``fp16`` from the dtype; fp16 gets the dynamic loss scaler our runtime uses (initial
  scale 2^16, window 1000, hysteresis 2, minimum 1).
- ``activation_checkpointing``: DeepSpeed's settings for ``deepspeed.checkpointing``; which
  layers to wrap is the model code's choice, so the layer list is given in ``planner``.
- ``pipeline.stages`` = ``pp``. DeepSpeed's partitioner cannot take explicit boundaries, so
  ``pipeline.partition`` is ``uniform`` when the plan's stages hold equal numbers of layers (to
  within one) and ``parameters`` otherwise, and the exact boundaries are listed in
  ``planner.stage_boundaries`` for a custom ``PipelineModule``. The tensor-parallel degree goes to
  Megatron-DeepSpeed's ``--tensor-model-parallel-size``.

Offload (plan.json ``offload``) maps to ``zero_optimization.offload_optimizer`` (the optimizer
state and the AdamW step; DeepSpeed's CPU Adam runs it) and ``offload_param`` (ZeRO-3 parameter
shards), each ``{"device": "cpu"|"nvme", "pin_memory": true}`` plus ``"nvme_path"`` for the NVMe
tier: the mount of the node-local drive (``DEFAULT_NVME_PATH`` unless given; a warning says to set
it). A state kind the plan keeps on the device has no section.

A plan that compiles its stages (``compile: true``) says so in ``planner.compile``; with DeepSpeed
that is the training script's choice (``torch.compile`` of its model or layers), not a config key.

1-bit Adam (``dp_compression: onebit-adam``) maps to DeepSpeed's ``OneBitAdam`` optimizer block:
the trainer's AdamW settings (``lr``, ``betas``, ``eps``, ``weight_decay``: ``planner train``'s
defaults, ``TrainOptions``), ``freeze_step`` = ``compression_warmup`` (the full-precision steps
before the variance freezes and compression starts), ``cuda_aware: false`` and the NCCL backend.
Without compression the config names no optimizer (the training script's AdamW).

A mixture of experts (plan.json ``model.moe``) is built in DeepSpeed by the model code, one
``deepspeed.moe.layer.MoE`` per MoE layer, not by a config key: ``planner.moe`` lists that
layer's arguments, ``num_experts`` (the routed experts), ``ep_size`` = ``expert_parallel``, ``k`` =
``top_k``, ``capacity_factor`` / ``eval_capacity_factor`` (the plan's, or DeepSpeed's default 1.0
when dropless), ``drop_tokens`` (False: dropless, as the plan without a capacity factor),
``min_capacity`` (0 under dropless routing, DeepSpeed's 4 otherwise) and ``use_residual`` (a
layer with one shared expert is DeepSpeed's residual MoE; more than one shared expert has no
DeepSpeed argument and gets a warning). DeepSpeed needs the MoE parameter groups split for ZeRO
(``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer``): a warning says so.
Megatron-DeepSpeed's launch line gains ``--num-experts`` and ``--moe-expert-parallel-size``.

Context parallelism (plan.json ``context_parallel``) exists in DeepSpeed only as DeepSpeed-Ulysses:
a ``ulysses`` plan's launch line gains Megatron-DeepSpeed's ``--ds-sequence-parallel-size`` = cp
(the data-parallel degree DeepSpeed derives then excludes those ranks, as the plan's ``dp`` does);
a ``ring`` or ``all-gather`` plan gets a warning naming Megatron-Core's equivalent
(``--context-parallel-size`` with ``--cp-comm-type p2p`` or ``allgather``) and the pin that
makes a DeepSpeed plan (``--cp-method ulysses``). ``planner.context_parallel`` records it.

DeepSpeed's pipeline engine runs only ZeRO stages 0 and 1; a plan with ``pp > 1`` and ZeRO 2 or
3 is exported with ``planner.warnings`` saying so. The ``planner`` block is provenance for the
reader (DeepSpeed ignores keys it does not know).
"""

from __future__ import annotations

import dataclasses
import math
import shlex

from runtime.contract.choices import GradCompression, OffloadTier
from runtime.training.train_config import TrainOptions

__all__ = [
    "to_deepspeed",
    "launcher_command",
    "offload_sections",
    "onebit_adam_section",
    "moe_section",
    "DEFAULT_NVME_PATH",
]

#: Where the NVMe tier's files go when the export is not told: DeepSpeed's documentation's example mount.
DEFAULT_NVME_PATH = "/local_nvme"


def offload_sections(offload: dict, nvme_path: str | None = None) -> dict:
    """``{"offload_optimizer": {...}, "offload_param": {...}}`` for plan.json's ``offload`` (only
    the state kinds it moves off the device)."""
    out = {}
    for kind, key in (("optimizer", "offload_optimizer"), ("params", "offload_param")):
        tier = (offload or {}).get(kind, OffloadTier.NONE)
        if tier == OffloadTier.NONE:
            continue
        section = {"device": tier, "pin_memory": True}
        if tier == OffloadTier.NVME:
            section["nvme_path"] = nvme_path or DEFAULT_NVME_PATH
        out[key] = section
    return out


def to_deepspeed(plan, nvme_path: str | None = None) -> dict:
    """The ds_config dictionary equivalent to ``plan`` (see the module docstring); ``nvme_path``:
    the NVMe tier's directory when the plan offloads to NVMe."""
    checkpointed = list(plan.checkpoint_layers)
    sizes = [last - first + 1 for first, last in plan.stages]
    offload = getattr(plan, "offload", None) or {}
    config = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "gradient_clipping": 1.0,
        "zero_optimization": _zero_section(plan, offload, nvme_path),
        "bf16": {"enabled": plan.dtype == "bf16"},
        "fp16": {
            "enabled": plan.dtype == "fp16",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "activation_checkpointing": {
            "partition_activations": plan.tp > 1 and bool(checkpointed),
            "contiguous_memory_optimization": False,
            "number_checkpoints": len(checkpointed),
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        },
        "pipeline": {
            "stages": plan.pp,
            "partition": "uniform" if max(sizes) - min(sizes) <= 1 else "parameters",
            "seed_layers": False,
            "activation_checkpoint_interval": 1 if checkpointed else 0,
        },
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "planner": _provenance(plan, offload, _warnings(plan, offload, nvme_path)),
    }
    moe = moe_section(plan)
    if moe is not None:
        config["planner"]["moe"] = moe
    if getattr(plan, "dp_compression", GradCompression.NONE) == GradCompression.ONEBIT_ADAM:
        config["optimizer"] = onebit_adam_section(plan.compression_warmup)
    dp_world = plan.dp
    assert (
        config["train_batch_size"]
        == config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * dp_world
    ), "plan invariant broken"
    return config


def moe_section(plan) -> dict | None:
    """The arguments of ``deepspeed.moe.layer.MoE`` for the plan's MoE layers (module docstring);
    None for a dense model."""
    moe = getattr(plan.model, "moe", None) or {}
    if not moe:
        return None
    factor = moe["capacity_factor"]
    return {
        "num_experts": moe["experts"],
        "ep_size": getattr(plan, "expert_parallel", 1),
        "k": moe["top_k"],
        "capacity_factor": 1.0 if factor is None else factor,
        "eval_capacity_factor": 1.0 if factor is None else factor,
        "min_capacity": 0 if factor is None else 4,
        "drop_tokens": factor is not None,
        "use_residual": moe["shared_experts"] == 1,
        "layers": list(moe["layers"]),
    }


def onebit_adam_section(freeze_step: int) -> dict:
    """DeepSpeed's ``OneBitAdam`` optimizer block: the trainer's AdamW defaults, compression after
    ``freeze_step`` full-precision steps."""
    defaults = {field.name: field.default for field in dataclasses.fields(TrainOptions) if field.init}
    return {
        "type": "OneBitAdam",
        "params": {
            "lr": defaults["lr"],
            "betas": [defaults["beta1"], defaults["beta2"]],
            "eps": defaults["eps"],
            "weight_decay": defaults["weight_decay"],
            "freeze_step": int(freeze_step),
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    }


def _warnings(plan, offload: dict, nvme_path: str | None) -> list[str]:
    """What of ``plan`` DeepSpeed cannot run as planned, and what to set by hand."""
    warnings: list[str] = []
    if plan.selective_layers:
        warnings.append(
            f"{len(plan.selective_layers)} layers recompute only their attention core (selective "
            "recompute), which DeepSpeed's activation checkpointing does not express: it checkpoints "
            "whole layers. Use --checkpoint all or none when planning for DeepSpeed, or run it on "
            "planner's runtime."
        )
    if plan.sequence_parallel:
        warnings.append(
            "the plan uses sequence parallelism in its tensor-parallel regions, which DeepSpeed's "
            "engine does not provide (Megatron-DeepSpeed does); run it on planner's runtime."
        )
    if plan.pp > 1 and plan.zero_stage >= 2:
        warnings.append(
            f"DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only; this plan uses "
            f"ZeRO-{plan.zero_stage} with pp={plan.pp}. Use --zero-stage 1 when planning for "
            "DeepSpeed, or run it on planner's runtime."
        )
    if plan.tp > 1:
        warnings.append(
            f"Tensor parallelism (tp={plan.tp}) needs Megatron-DeepSpeed "
            f"(--tensor-model-parallel-size {plan.tp}); plain DeepSpeed has no TP for training."
        )
    moe = getattr(plan.model, "moe", None) or {}
    if moe:
        warnings.append(
            f"the model's {len(moe['layers'])} MoE layers must be deepspeed.moe.layer.MoE modules with "
            "planner.moe's arguments, and the optimizer's parameter groups split with "
            "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer (expert "
            f"gradients reduce over dp/ep = {plan.dp // max(getattr(plan, 'expert_parallel', 1), 1)} ranks)."
        )
        if moe["shared_experts"] > 1:
            warnings.append(
                f"{moe['shared_experts']} shared experts per layer: DeepSpeed's residual MoE has one; "
                "build the others as a dense MLP beside the MoE layer."
            )
    warnings += _context_warnings(plan)
    if OffloadTier.NVME in offload.values() and nvme_path is None:
        warnings.append(
            f"The plan offloads to NVMe: set zero_optimization's nvme_path (now {DEFAULT_NVME_PATH!r}) "
            "to a directory on each node's local NVMe drive."
        )
    return warnings


#: Megatron-Core's ``--cp-comm-type`` of each context-parallel method.
MEGATRON_CP_COMM = {"ring": "p2p", "all-gather": "allgather", "ulysses": "a2a"}


def _context_warnings(plan) -> list[str]:
    """What of the plan's context parallelism DeepSpeed cannot express (none without it)."""
    context = getattr(plan, "context_parallel", None) or {"degree": 1, "method": "ring"}
    cp, method = context["degree"], context["method"]
    if cp == 1:
        return []
    if method != "ulysses":
        return [
            f"the plan splits sequences over cp={cp} ranks with {method} attention, which DeepSpeed does not "
            f"run (its sequence parallelism is Ulysses); Megatron-Core runs it as --context-parallel-size {cp} "
            f"--cp-comm-type {MEGATRON_CP_COMM[method]}. Plan with --cp-method ulysses for DeepSpeed, or run "
            "it on planner's runtime."
        ]
    if plan.sequence_parallel:
        return [
            "Megatron-DeepSpeed's --ds-sequence-parallel-size cannot be combined with Megatron's "
            "--sequence-parallel, which this plan also uses; plan with --sequence-parallel off for DeepSpeed."
        ]
    return []


def _zero_section(plan, offload: dict, nvme_path: str | None) -> dict:
    """``zero_optimization``: the stage, overlap, and the offload sections."""
    zero: dict = {"stage": plan.zero_stage, "overlap_comm": True, "contiguous_gradients": True}
    if plan.zero_stage >= 2:
        zero["reduce_scatter"] = True
    if plan.zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = "auto"
    zero.update(offload_sections(offload, nvme_path))
    return zero


def _provenance(plan, offload: dict, warnings: list[str]) -> dict:
    """The ``planner`` block: what DeepSpeed cannot take (exact stage boundaries, the recomputed
    layers by name, ...) and the warnings, for the reader (DeepSpeed ignores it)."""
    names = plan.model.layer_names or []
    checkpointed = list(plan.checkpoint_layers)

    def name_of(row: int) -> str:
        return names[row] if row < len(names) else str(row)

    return {
        "dp": plan.dp,
        "tp": plan.tp,
        "pp": plan.pp,
        "stage_boundaries": [list(stage) for stage in plan.stages],
        "stage_layers": [[name_of(first), name_of(last)] for first, last in plan.stages],
        "checkpoint_layers": checkpointed,
        "checkpoint_layer_names": [names[i] for i in checkpointed if i < len(names)],
        "selective_layers": list(plan.selective_layers),
        "sequence_parallel": plan.sequence_parallel,
        "context_parallel": dict(getattr(plan, "context_parallel", None) or {"degree": 1, "method": "ring"}),
        "compile": plan.compile,
        "offload": dict(offload) if offload else {"optimizer": "none", "params": "none"},
        "predicted_step_time_s": plan.predicted.step_time_s,
        "warnings": warnings,
    }


def launcher_command(plan, config_path: str = "ds_config.json", script: str = "train.py") -> str:
    """The ``deepspeed`` launch line for ``plan`` (``script`` is the user's training script).

    One process per device: ``--num_nodes`` nodes of ``--num_gpus`` devices (a hostfile names
    the nodes when there are several); Megatron-DeepSpeed's parallel sizes are appended when
    the plan uses tensor or pipeline parallelism.
    """
    gpus_per_node = plan.hardware.gpus_per_node
    nodes = math.ceil(plan.hardware.gpus / gpus_per_node)
    per_node = min(gpus_per_node, plan.hardware.gpus)
    parts = ["deepspeed"]
    if nodes > 1:
        parts += ["--hostfile", "hostfile"]
    parts += [
        "--num_nodes",
        str(nodes),
        "--num_gpus",
        str(per_node),
        script,
        "--deepspeed",
        "--deepspeed_config",
        config_path,
    ]
    context = getattr(plan, "context_parallel", None) or {"degree": 1, "method": "ring"}
    ulysses = context["degree"] > 1 and context["method"] == "ulysses"
    if plan.tp > 1 or plan.pp > 1 or ulysses:
        parts += ["--tensor-model-parallel-size", str(plan.tp), "--pipeline-model-parallel-size", str(plan.pp)]
    if ulysses:
        parts += ["--ds-sequence-parallel-size", str(context["degree"])]
    moe = getattr(plan.model, "moe", None) or {}
    if moe:
        parts += ["--num-experts", str(moe["experts"]), "--moe-expert-parallel-size", str(plan.expert_parallel)]
    return " ".join(shlex.quote(part) for part in parts)
