"""What the user asked ``planner plan`` for: the model, the cluster, the batch and the pins.

``PlanRequest`` is the one source of the planning options: each field has its default and its
documentation here, and a field that the command line sets carries a ``PlanFlag`` in its metadata
(the flag, its help, the kind of value it takes, its allowed values, how its value becomes the
setting), from which ``planner.cli`` builds the ``plan``, ``tune`` and sweep flags and
``planner.commands.plan_command.request_from_args`` reads them back (``cli_flags(PlanRequest)``).
The allowed values of each closed choice come from its enumeration in ``runtime.contract.choices``.

``__post_init__`` checks every field and raises ``SearchError`` naming the flag and the value.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from cost_models.hardware import KNOWN_KINDS
from planner.frontend.input_pins import parse_input_pins
from planner.search.search_errors import SearchError
from runtime.contract.choices import (
    ZERO_STAGES,
    ContextMethod,
    GradCompression,
    OffloadTier,
    RecomputeMode,
    ScheduleName,
    Toggle,
    names,
)
from runtime.contract.dtype_table import DTYPES
from runtime.contract.input_errors import ConfigError
from runtime.contract.overlap import Overlap
from runtime.training.train_config import CliFlag, cli_flags

__all__ = [
    "PlanRequest",
    "PlanFlag",
    "PLAN_FLAG_KINDS",
    "CHECKPOINT_MODES",
    "COMPILE_MODES",
    "DEFAULT_HORIZON_STEPS",
    "OFFLOAD_TIERS",
    "request_flag",
]

#: Where ``--offload-optimizer`` / ``--offload-params`` may put a state kind (``cost_models.offload_cost``).
OFFLOAD_TIERS = names(OffloadTier)
CHECKPOINT_MODES = names(RecomputeMode)
#: ``compile``: the search decides (``auto``, the default), or ``--compile on|off`` pins it.
COMPILE_AUTO = "auto"
COMPILE_MODES = (COMPILE_AUTO, *names(Toggle))

#: Steps a run is assumed to last when the request gives no ``tokens``: what compiling the stages
#: must pay back over (a short fine-tune; a pretraining run is far longer, and says so with --tokens).
DEFAULT_HORIZON_STEPS = 1000

#: What a plan flag's value may be (``planner.cli`` maps each to an argparse type): the kinds of
#: ``runtime.training.train_config.FLAG_KINDS``, plus ``int`` (any integer, with ``choices``),
#: ``gpu_counts`` (``64`` or ``64,128,256``), ``token_count`` (``300e9``, ``2T``) and
#: ``repeated`` (a string flag given any number of times: a list, None when absent).
PLAN_FLAG_KINDS: tuple[str, ...] = (
    "str",
    "int",
    "float",
    "positive_float",
    "positive_int",
    "switch",
    "gpu_counts",
    "token_count",
    "repeated",
)


@dataclass(frozen=True)
class PlanFlag(CliFlag):
    """How one planning option appears on the ``plan`` / ``tune`` command line (a ``CliFlag`` with
    the plan's kinds of value and an optional closed set of values).

    The flag's default is the field's when the flag has no ``to_setting``; a flag with one defaults
    to None (absent), which ``to_setting`` turns into the setting."""

    choices: tuple[Any, ...] | None = None
    """The values the flag accepts (argparse lists them in usage and errors); None: any of its kind."""

    def __post_init__(self) -> None:
        if self.kind not in PLAN_FLAG_KINDS:
            raise ValueError(f"flag {self.flag}: kind {self.kind!r} is not one of {', '.join(PLAN_FLAG_KINDS)}")


def _flag(flag: str, **options: Any) -> dict:
    """Field metadata exposing a planning option as ``flag`` (see ``PlanFlag``)."""
    return {"cli": PlanFlag(flag, **options)}


def _profile_node_size(value: int | None) -> int:
    """``--gpus-per-node`` absent: 0, the hardware profile's."""
    return value or 0


def _searched_unless_pinned(value: str | None) -> str:
    """``--compile`` absent: ``auto``, the search decides."""
    return value or COMPILE_AUTO


@dataclass
class PlanRequest:
    """One planning problem. ``None`` pins are searched; set pins are fixed. The fields with a
    ``PlanFlag`` are the flags of ``plan`` and ``tune``, in this order (the model-size flags, which
    fill ``sizes``, follow ``--model``)."""

    spec: str = field(
        metadata=_flag(
            "--model",
            required=True,
            metavar="SPEC",
            help="gpt | gpt2 | gpt2-xl | gpt3-175b | hf:gpt2 | hf:llama | hf:bert | hf:PATH (a local HF "
            "model directory) | file.py:factory",
        )
    )
    """Model spec (see ``planner.frontend.bundle.SPEC_HELP``)."""
    gpus: int = field(
        metadata=_flag(
            "--gpus",
            kind="gpu_counts",
            required=True,
            metavar="N[,N...]",
            help="devices in the cluster; a comma-separated list (64,128,256) plans each size and compares them",
        )
    )
    """Devices in the cluster (the flag may list several: a sweep makes one request per count)."""
    gpus_per_node: int = field(
        metadata=_flag(
            "--gpus-per-node",
            kind="positive_int",
            help="devices per node (default: the hardware profile's)",
            to_setting=_profile_node_size,
        )
    )
    """Devices per node (0: take the hardware profile's)."""
    hardware: str = field(
        metadata=_flag(
            "--hardware",
            required=True,
            metavar="KIND|profile.json",
            help=f"{', '.join(KNOWN_KINDS)} (v100-16gb-eth25, v100-32gb-eth100: Ethernet, 25 and 100 "
            "Gb/s per node), or a profile JSON",
        )
    )
    """Hardware kind or path of a profile JSON."""
    global_batch: int = field(
        metadata=_flag("--global-batch", kind="positive_int", required=True, help="sequences per optimizer step")
    )
    """Sequences per optimizer step."""
    seq_len: int = field(metadata=_flag("--seq-len", kind="positive_int", required=True, help="tokens per sequence"))
    """Tokens per sequence."""
    dtype: str = field(default="bf16", metadata=_flag("--dtype", choices=DTYPES))
    """Compute dtype (``runtime.contract.dtype_table.DTYPES``)."""
    sizes: dict = field(default_factory=dict)
    """Model size overrides (layers, hidden, heads, kv_heads, ffn, vocab; each its own flag,
    ``planner.commands.plan_command.SIZE_FLAGS``)."""
    dp: int | None = field(
        default=None, metadata=_flag("--dp", kind="positive_int", help="pin the data-parallel degree")
    )
    """Data-parallel degree; ``None``: searched."""
    tp: int | None = field(
        default=None, metadata=_flag("--tp", kind="positive_int", help="pin the tensor-parallel degree")
    )
    """Tensor-parallel degree; ``None``: searched."""
    pp: int | None = field(default=None, metadata=_flag("--pp", kind="positive_int", help="pin the pipeline degree"))
    """Pipeline-parallel degree (stages); ``None``: searched."""
    zero_stage: int | None = field(
        default=None, metadata=_flag("--zero-stage", kind="int", choices=ZERO_STAGES, help="pin the ZeRO stage")
    )
    """ZeRO stage (``runtime.contract.choices.ZERO_STAGES``); ``None``: searched."""
    micro_batch: int | None = field(
        default=None, metadata=_flag("--micro-batch", kind="positive_int", help="pin the micro-batch size")
    )
    """Sequences per micro-batch on one data-parallel rank; ``None``: searched."""
    checkpoint: str = field(
        default=RecomputeMode.AUTO.value,
        metadata=_flag(
            "--checkpoint",
            choices=names(RecomputeMode),
            help="activation recompute: chosen per layer, whole or only its attention core (auto); "
            "never; the attention core of every block (selective); every block whole (all)",
        ),
    )
    """``auto`` (the solver chooses per layer: nothing, the attention core, or all of it), ``none``,
    ``selective`` (every block's attention core) or ``all`` (every block whole)."""
    memory_headroom: float = field(
        default=0.9,
        metadata=_flag("--memory-headroom", kind="float", help="usable fraction of device memory (default 0.9)"),
    )
    """Usable fraction of each device's memory."""
    tp_across_nodes: bool = field(
        default=False,
        metadata=_flag("--tp-across-nodes", kind="switch", help="allow tensor parallelism across nodes"),
    )
    """Allow tensor-parallel groups that span nodes (slow; off by default)."""
    inputs: dict = field(
        default_factory=dict,
        metadata=_flag(
            "--input",
            kind="repeated",
            metavar="NAME=ROLE",
            help="what training feeds a model input the planner cannot infer (repeatable): "
            "tokens, labels, targets, ones, zeros or positions",
            to_setting=parse_input_pins,
        ),
    )
    """What training feeds a model input the graph does not explain: ``{name: role}``
    (``--input NAME=ROLE``; see ``planner.frontend.input_pins``)."""
    tokens: float | None = field(
        default=None,
        metadata=_flag(
            "--tokens",
            kind="token_count",
            metavar="N",
            help="tokens the whole run trains on (300e9, 2T, 500B): adds its days, GPU-hours and "
            "cost to the plan, and is what compiling must pay back over",
        ),
    )
    """Tokens the whole run trains on (``--tokens``): the run's length in steps, which compiling
    must pay back over; ``None``: ``DEFAULT_HORIZON_STEPS``."""
    compile: str = field(
        default=COMPILE_AUTO,
        metadata=_flag(
            "--compile",
            choices=names(Toggle),
            help="run each layer class under torch.compile (on) or eagerly (off); default: the "
            "planner compiles when the per-step saving repays the compile time over the run "
            "(--tokens, else 1,000 steps)",
            to_setting=_searched_unless_pinned,
        ),
    )
    """Compiled stages (``torch.compile`` per layer class): ``auto`` (the search compiles when the
    per-step saving repays the compile time over the run), ``on`` or ``off`` (``--compile``)."""
    price_per_gpu_hour: float | None = field(
        default=None,
        metadata=_flag(
            "--price-per-gpu-hour",
            kind="positive_float",
            metavar="X",
            help="what one device costs per hour (any currency): the cost in money, with --tokens",
        ),
    )
    """What one device costs per hour, in any currency: ``predicted.cost.money`` of a run of
    ``tokens`` tokens (``cost_models.run_cost``); the search does not read it."""
    offload_optimizer: str | None = field(
        default=None,
        metadata=_flag(
            "--offload-optimizer",
            choices=names(OffloadTier),
            help="where the optimizer state lives and AdamW runs: the device (none), host memory "
            "(cpu, ZeRO-Offload) or NVMe files (nvme, ZeRO-Infinity); default: the planner "
            "offloads only where it pays (a plan that does not fit otherwise, or fits only "
            "with more recompute or smaller micro-batches)",
        ),
    )
    """Where the optimizer state lives (``--offload-optimizer none|cpu|nvme``); ``None``: searched."""
    offload_params: str | None = field(
        default=None,
        metadata=_flag(
            "--offload-params",
            choices=names(OffloadTier),
            help="where the ZeRO-3 parameter shards live: the device (none), host memory (cpu) or "
            "NVMe files (nvme), fetched layer by layer ahead of use; default: searched",
        ),
    )
    """Where the ZeRO-3 parameter shards live (``--offload-params none|cpu|nvme``); ``None``: searched."""
    sequence_parallel: str | None = field(
        default=None,
        metadata=_flag(
            "--sequence-parallel",
            choices=names(Toggle),
            help="pin sequence parallelism in the tensor-parallel regions (norms, residuals and dropout on "
            "seq_len / tp positions per rank; default: searched where tp > 1)",
        ),
    )
    """Sequence parallelism in the tensor-parallel regions (``--sequence-parallel on|off``);
    ``None``: searched wherever tp > 1 and the model allows it."""
    schedule: str | None = field(
        default=None,
        metadata=_flag(
            "--schedule",
            choices=names(ScheduleName),
            help="pin the pipeline schedule: 1f1b, interleaved (v model chunks per pipeline rank: a "
            "v-fold smaller bubble for v times the sends) or zero-bubble (ZB-H1: weight gradients "
            "fill the bubble); default: the planner prices each and keeps the fastest that fits",
        ),
    )
    """The pipeline schedule (``--schedule 1f1b|interleaved|zero-bubble``); ``None``: searched
    (``planner.search.schedule_search.SEARCHED_SCHEDULES``)."""
    virtual_stages: int | None = field(
        default=None,
        metadata=_flag(
            "--virtual-stages",
            kind="positive_int",
            metavar="V",
            help="pin the model chunks per pipeline rank of --schedule interleaved (default: searched)",
        ),
    )
    """Model chunks per pipeline rank of the interleaved schedule (``--virtual-stages``); ``None``: searched."""
    dp_compression: str | None = field(
        default=None,
        metadata=_flag(
            "--dp-compression",
            choices=names(GradCompression),
            help="pin the data-parallel exchange: full-precision gradients (none) or 1-bit Adam's "
            "sign-compressed momentum after a full-precision warm-up of 15%% of the run (onebit-adam: "
            "ZeRO 0 or 1, dp > 1, no offload); default: the planner compresses only where it "
            "shortens the run (slow networks, exposed data-parallel traffic)",
        ),
    )
    """The data-parallel exchange (``--dp-compression none|onebit-adam``; ``cost_models.compression_cost``);
    ``None``: searched where valid, kept only where it shortens the run."""
    overlap: str = field(
        default="on",
        metadata=_flag(
            "--overlap",
            choices=names(Toggle),
            help="price the run as launched with train --overlap on (communication overlapped with compute, "
            "the default) or off (every collective waited where it is issued); written to plan.json overlap",
        ),
    )
    """What the run will overlap (``--overlap on|off``, ``runtime.contract.overlap``): the price
    charges each collective what its window cannot hide (on) or all of it (off). A program may
    give an ``Overlap`` (or plan.json's object) to set the kinds one by one."""
    ep: int | None = field(
        default=None,
        metadata=_flag(
            "--ep",
            kind="positive_int",
            metavar="N",
            help="pin the expert-parallel degree of a mixture of experts: N ranks of each data-parallel "
            "group share the routed experts (N divides dp and the experts), tokens reach them by "
            "all-to-all; 1 replicates every expert; default: searched over the divisors of gcd(dp, experts)",
        ),
    )
    """Expert-parallel degree (``--ep``; ``cost_models.expert_cost``); ``None``: searched."""
    moe_capacity_factor: float | None = field(
        default=None,
        metadata=_flag(
            "--moe-capacity-factor",
            kind="positive_float",
            metavar="F",
            help="capacity mode: each expert takes at most F times its even share of the tokens and drops "
            "the rest (compute and all-to-all bytes priced at min(capacity, load)); default: dropless",
        ),
    )
    """Tokens each expert takes, over its even share (``--moe-capacity-factor``); ``None``: dropless
    routing. plan.json ``model.moe.capacity_factor``."""
    moe_imbalance: float = field(
        default=1.0,
        metadata=_flag(
            "--moe-imbalance",
            kind="float",
            metavar="X",
            help="routing imbalance the plan is priced for: the busiest expert-parallel rank's experts get X "
            "times the mean of the tokens (>= 1.0; default 1.0, balanced)",
        ),
    )
    """The busiest expert-parallel rank's tokens over the mean (``--moe-imbalance``, >= 1.0)."""
    cp: int | None = field(
        default=None,
        metadata=_flag(
            "--cp",
            kind="positive_int",
            metavar="N",
            help="pin the context-parallel degree: every sequence split over N ranks (each holds two of "
            "2N chunks; the sequence length divides by 2N), attention exchanged by --cp-method; 1: none; "
            "default: searched where the sequence is long enough to divide",
        ),
    )
    """Context-parallel degree (``--cp``; ``cost_models.context_cost``); ``None``: searched."""
    cp_method: str | None = field(
        default=None,
        metadata=_flag(
            "--cp-method",
            choices=names(ContextMethod),
            help="pin how a context-parallel group computes attention: ring (key/value blocks passed round, "
            "overlapped with compute), all-gather (keys and values gathered whole, as Llama 3) or ulysses "
            "(heads exchanged for positions by all-to-all; the heads must divide); default: searched",
        ),
    )
    """How a context-parallel group computes attention (``--cp-method``); ``None``: searched."""

    def to_record(self) -> dict:
        """The request as plan.json's ``request``: every field by name (JSON values), enough for
        ``from_record`` to plan the same problem again."""
        return {name: (dict(value) if isinstance(value, dict) else value) for name, value in asdict(self).items()}

    @classmethod
    def from_record(cls, record: Any) -> "PlanRequest":
        """A request from plan.json's ``request`` (``to_record``); keys this planner does not know
        (written by a newer one) are left out. A malformed record is a ``SearchError``."""
        if not isinstance(record, dict):
            raise SearchError(f"a plan's request must be an object, got {type(record).__name__}.")
        known = {f.name for f in fields(cls)}
        missing = sorted({"spec", "gpus", "hardware", "global_batch", "seq_len"} - set(record))
        if missing:
            raise SearchError(f"the plan's request is missing {', '.join(missing)}; re-plan with `planner plan`.")
        try:
            return cls(**{k: value for k, value in record.items() if k in known})
        except TypeError as e:
            raise SearchError(f"the plan's request is malformed ({e}); re-plan with `planner plan`.") from None

    def horizon_steps(self) -> int:
        """Steps of the run: ``ceil(tokens / (global_batch x seq_len))``, or the default horizon."""
        if self.tokens is None:
            return DEFAULT_HORIZON_STEPS
        return max(1, math.ceil(self.tokens / (self.global_batch * self.seq_len)))

    def __post_init__(self) -> None:
        self._check_problem()
        self._check_pins()
        self._check_compile_and_tokens()
        self._check_offload()
        self._check_schedule()
        self._check_recompute()
        self._check_degrees()
        self._check_compression()
        self._check_experts()
        self._check_context()

    def _check_problem(self) -> None:
        """The cluster, the batch and the dtype."""
        if isinstance(self.gpus_per_node, int) and self.gpus_per_node < 0:
            raise SearchError(f"--gpus-per-node must be a positive integer, got {self.gpus_per_node}.")
        for name in ("gpus", "global_batch", "seq_len"):
            _check_positive_int(name, getattr(self, name))
        _check_choice("dtype", self.dtype, DTYPES)

    def _check_pins(self) -> None:
        """The degrees, the micro-batch and the ZeRO stage, where pinned."""
        for name in ("dp", "tp", "pp", "micro_batch"):
            value = getattr(self, name)
            if value is not None:
                _check_positive_int(name, value)
        if self.zero_stage is not None and self.zero_stage not in ZERO_STAGES:
            raise SearchError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage!r}.")

    def _check_compile_and_tokens(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise SearchError(f"--compile must be on or off (or omitted: the planner decides), got {self.compile!r}.")
        tokens = self.tokens
        if tokens is not None and (
            isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not math.isfinite(tokens) or tokens <= 0
        ):
            raise SearchError(f"--tokens must be a positive number of tokens, got {tokens!r}.")

    def _check_offload(self) -> None:
        """Each offload pin is a tier, and the ZeRO stage can offload it."""
        for name in ("offload_optimizer", "offload_params"):
            _check_choice(name, getattr(self, name), OFFLOAD_TIERS, searched=True)
        if self.offload_params not in (None, OffloadTier.NONE) and self.zero_stage not in (None, 3):
            raise SearchError(
                f"--offload-params {self.offload_params} needs ZeRO stage 3 (only ZeRO-3 shards the "
                f"parameters it keeps off the device), but --zero-stage is {self.zero_stage}. Use "
                "--zero-stage 3, or drop one of the two flags."
            )
        if self.offload_optimizer not in (None, OffloadTier.NONE) and self.zero_stage == 0:
            raise SearchError(
                f"--offload-optimizer {self.offload_optimizer} needs ZeRO stage 1, 2 or 3 (each rank "
                "offloads its optimizer shard), but --zero-stage is 0. Use --zero-stage 1, 2 or 3, "
                "or drop one of the two flags."
            )

    def _check_schedule(self) -> None:
        """The pipeline schedule, its chunks, and sequence parallelism."""
        _check_choice("schedule", self.schedule, names(ScheduleName), searched=True)
        if self.virtual_stages is not None:
            _check_positive_int("virtual_stages", self.virtual_stages)
        if self.sequence_parallel not in (None, *names(Toggle)):
            raise SearchError(f"--sequence-parallel must be on or off, got {self.sequence_parallel!r}.")
        try:
            Overlap.of(self.overlap)
        except ConfigError:
            raise SearchError(f"--overlap must be on or off, got {self.overlap!r}.") from None
        if self.sequence_parallel == Toggle.ON and self.tp == 1:
            raise SearchError(
                "--sequence-parallel on needs tensor parallelism, but --tp is 1: sequence "
                "parallelism splits the tensor-parallel regions' sequence over the tp ranks. Drop "
                "--tp 1 or --sequence-parallel on."
            )

    def _check_recompute(self) -> None:
        _check_choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        if not 0.1 <= self.memory_headroom <= 1.0:
            raise SearchError(f"--memory-headroom must be in [0.1, 1.0], got {self.memory_headroom}.")

    def _check_degrees(self) -> None:
        """The pinned degrees fit the cluster and the batch."""
        pins = {"dp": self.dp, "tp": self.tp, "pp": self.pp}
        fixed = (self.cp or 1) if isinstance(self.cp, int) else 1
        for degree in pins.values():
            fixed *= degree or 1
        if all(degree is not None for degree in pins.values()) and fixed != self.gpus:
            context = f" x --cp {self.cp}" if self.cp and self.cp > 1 else ""
            hint = (
                f" (or pin --cp {self.gpus // fixed} to split each sequence over the rest)"
                if not context and self.gpus % fixed == 0 and fixed < self.gpus
                else ""
            )
            raise SearchError(
                f"--dp {self.dp} x --tp {self.tp} x --pp {self.pp}{context} = {fixed}, but --gpus is "
                f"{self.gpus}; the degrees must multiply to the number of devices{hint}."
            )
        if self.gpus % fixed:
            pins["cp"] = self.cp if isinstance(self.cp, int) and self.cp > 1 else None
            pinned = " x ".join(f"--{name} {degree}" for name, degree in pins.items() if degree is not None)
            raise SearchError(f"{pinned} = {fixed} does not divide --gpus {self.gpus}.")
        if self.dp is not None and self.global_batch % self.dp:
            raise SearchError(f"--global-batch {self.global_batch} is not divisible by --dp {self.dp}.")
        if self.micro_batch is not None and self.dp is not None and self.global_batch % (self.dp * self.micro_batch):
            raise SearchError(
                f"--global-batch {self.global_batch} is not divisible by --dp {self.dp} x "
                f"--micro-batch {self.micro_batch}."
            )

    def _check_compression(self) -> None:
        """1-bit Adam replaces the gradient all-reduce of ZeRO 0 and 1 over more than one rank."""
        _check_choice("dp_compression", self.dp_compression, names(GradCompression), searched=True)
        if self.dp_compression != GradCompression.ONEBIT_ADAM:
            return
        flag = "--dp-compression onebit-adam"
        if self.zero_stage is not None and self.zero_stage > 1:
            raise SearchError(
                f"{flag} needs ZeRO stage 0 or 1, but --zero-stage is {self.zero_stage}: 1-bit Adam "
                "compresses each rank's whole momentum in place of the gradient all-reduce of stages 0 "
                "and 1, and stages 2 and 3 reduce-scatter the gradients before any rank has it. Use "
                "--zero-stage 0 or 1, or drop one of the two flags."
            )
        for kind in ("optimizer", "params"):
            tier = getattr(self, f"offload_{kind}")
            if tier not in (None, OffloadTier.NONE):
                raise SearchError(
                    f"{flag} cannot run with --offload-{kind} {tier}: the compressed exchange and the "
                    "frozen-variance update run on the device. Drop one of the two flags."
                )
        pinned = (self.tp or 1) * (self.pp or 1)
        if self.gpus == 1 or self.dp == 1 or pinned == self.gpus:
            why = (
                "--gpus is 1"
                if self.gpus == 1
                else "--dp is 1"
                if self.dp == 1
                else f"--tp and --pp take all {self.gpus} devices"
            )
            raise SearchError(
                f"{flag} needs more than one data-parallel rank, but {why}: there is no data-parallel "
                "exchange to compress. Drop --dp-compression, or leave room for dp > 1."
            )

    def _check_experts(self) -> None:
        """The expert-parallel pin divides the pinned dp; the MoE factors are in range (whether the
        model has experts, and how many, the search checks against the layer table)."""
        if self.ep is not None:
            _check_positive_int("ep", self.ep)
            if self.dp is not None and self.dp % self.ep:
                raise SearchError(
                    f"--ep {self.ep} does not divide --dp {self.dp}: the expert-parallel groups are carved "
                    "out of the data-parallel ranks. Pick an --ep that divides --dp."
                )
        if self.ep is not None and self.ep > 1:
            offloaded = [
                f"--offload-{kind} {tier}"
                for kind, tier in (("optimizer", self.offload_optimizer), ("params", self.offload_params))
                if tier not in (None, OffloadTier.NONE)
            ]
            if self.dp_compression == GradCompression.ONEBIT_ADAM:
                offloaded.append("--dp-compression onebit-adam")
            if offloaded:
                raise SearchError(
                    f"--ep {self.ep} cannot run with {' and '.join(offloaded)}: the runtime keeps sharded experts' "
                    "state on the device and exchanges it in full precision. Drop one of the flags."
                )
        imbalance = self.moe_imbalance
        if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)) or not imbalance >= 1.0:
            raise SearchError(f"--moe-imbalance must be a number >= 1.0 (1.0: balanced routing), got {imbalance!r}.")
        factor = self.moe_capacity_factor
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0
        ):
            raise SearchError(f"--moe-capacity-factor must be a positive number, got {factor!r}.")

    def _check_context(self) -> None:
        """The context-parallel pins: a degree whose ``2 cp`` chunks divide the sequence, a known
        method, and none of what the runtime does not run beside it."""
        _check_choice("cp_method", self.cp_method, names(ContextMethod), searched=True)
        if self.cp is None:
            return
        _check_positive_int("cp", self.cp)
        if self.seq_len % (2 * self.cp):
            raise SearchError(
                f"--cp {self.cp} splits each sequence into 2 x {self.cp} = {2 * self.cp} equal chunks, but "
                f"--seq-len {self.seq_len} does not divide by {2 * self.cp}. Pick a --cp whose double divides "
                "the sequence length."
            )
        if self.gpus % self.cp:
            raise SearchError(f"--cp {self.cp} does not divide --gpus {self.gpus}.")
        if self.cp == 1:
            return
        clashes = [
            f"--offload-{kind} {tier}"
            for kind, tier in (("optimizer", self.offload_optimizer), ("params", self.offload_params))
            if tier not in (None, OffloadTier.NONE)
        ]
        if self.dp_compression == GradCompression.ONEBIT_ADAM:
            clashes.append("--dp-compression onebit-adam")
        if self.ep is not None and self.ep > 1:
            clashes.append(f"--ep {self.ep}")
        if clashes:
            raise SearchError(
                f"--cp {self.cp} cannot run with {' and '.join(clashes)}: the runtime splits sequences only "
                "with state on the device, a full-precision exchange and replicated experts. Drop one of the flags."
            )


_FLAGS: dict[str, CliFlag] = {f.name: flag for f, flag in cli_flags(PlanRequest)}


def request_flag(name: str) -> str:
    """The command-line flag of ``PlanRequest`` field ``name`` (``micro_batch`` -> ``--micro-batch``)."""
    return _FLAGS[name].flag


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SearchError(f"{request_flag(name)} must be a positive integer, got {value!r}.")


def _check_choice(name: str, value: Any, allowed: tuple[str, ...], searched: bool = False) -> None:
    """``value`` is one of ``allowed`` (or None, when ``searched``: the planner decides)."""
    if searched and value is None:
        return
    if value not in allowed:
        decides = " (or omitted: the planner decides)" if searched else ""
        raise SearchError(f"{request_flag(name)} must be one of {', '.join(allowed)}{decides}, got {value!r}.")
