"""What the user asked ``planner plan`` for: the model, the cluster, the batch and the pins."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cost_models.schedule_cost import SCHEDULES
from planner.search.search_errors import SearchError
from runtime.contract.dtype_table import DTYPES

__all__ = ["PlanRequest", "CHECKPOINT_MODES", "COMPILE_MODES", "DEFAULT_HORIZON_STEPS", "OFFLOAD_TIERS"]

#: Where ``--offload-optimizer`` / ``--offload-params`` may put a state kind (``cost_models.offload_cost``).
OFFLOAD_TIERS = ("none", "cpu", "nvme")

CHECKPOINT_MODES = ("auto", "none", "selective", "all")
COMPILE_MODES = ("auto", "on", "off")

#: Steps a run is assumed to last when the request gives no ``tokens``: what compiling the stages
#: must pay back over (a short fine-tune; a pretraining run is far longer, and says so with --tokens).
DEFAULT_HORIZON_STEPS = 1000


@dataclass
class PlanRequest:
    """One planning problem. ``None`` pins are searched; set pins are fixed."""

    spec: str
    """Model spec (see ``planner.frontend.bundle.SPEC_HELP``)."""
    gpus: int
    """Devices in the cluster."""
    gpus_per_node: int
    """Devices per node (0: take the hardware profile's)."""
    hardware: str
    """Hardware kind or path of a profile JSON."""
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    """Tokens per sequence."""
    dtype: str = "bf16"
    """Compute dtype."""
    sizes: dict = field(default_factory=dict)
    """Model size overrides (layers, hidden, heads, kv_heads, ffn, vocab)."""
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero_stage: int | None = None
    micro_batch: int | None = None
    checkpoint: str = "auto"
    """``auto`` (the solver chooses per layer: nothing, the attention core, or all of it), ``none``,
    ``selective`` (every block's attention core) or ``all`` (every block whole)."""
    memory_headroom: float = 0.9
    """Usable fraction of each device's memory."""
    tp_across_nodes: bool = False
    """Allow tensor-parallel groups that span nodes (slow; off by default)."""
    inputs: dict = field(default_factory=dict)
    """What training feeds a model input the graph does not explain: ``{name: role}``
    (``--input NAME=ROLE``; see ``planner.frontend.input_pins``)."""
    compile: str = "auto"
    """Compiled stages (``torch.compile`` per layer class): ``auto`` (the search compiles when the
    per-step saving repays the compile time over the run), ``on`` or ``off`` (``--compile``)."""
    tokens: float | None = None
    """Tokens the whole run trains on (``--tokens``): the run's length in steps, which compiling
    must pay back over; ``None``: ``DEFAULT_HORIZON_STEPS``."""

    offload_optimizer: str | None = None
    """Where the optimizer state lives (``--offload-optimizer none|cpu|nvme``); ``None``: searched."""
    offload_params: str | None = None
    """Where the ZeRO-3 parameter shards live (``--offload-params none|cpu|nvme``); ``None``: searched."""
    schedule: str | None = None
    """The pipeline schedule (``--schedule 1f1b|interleaved|zero-bubble``); ``None``: searched
    (``planner.search.schedule_search.SEARCHED_SCHEDULES``)."""
    virtual_stages: int | None = None
    """Model chunks per pipeline rank of the interleaved schedule (``--virtual-stages``); ``None``: searched."""
    sequence_parallel: str | None = None
    """Sequence parallelism in the tensor-parallel regions (``--sequence-parallel on|off``);
    ``None``: searched wherever tp > 1 and the model allows it."""

    def horizon_steps(self) -> int:
        """Steps of the run: ``ceil(tokens / (global_batch x seq_len))``, or the default horizon."""
        if self.tokens is None:
            return DEFAULT_HORIZON_STEPS
        return max(1, math.ceil(self.tokens / (self.global_batch * self.seq_len)))

    def __post_init__(self):
        if isinstance(self.gpus_per_node, int) and self.gpus_per_node < 0:
            raise SearchError(f"--gpus-per-node must be a positive integer, got {self.gpus_per_node}.")
        for k in ("gpus", "global_batch", "seq_len"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SearchError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}.")
        if self.dtype not in DTYPES:
            raise SearchError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        for k in ("dp", "tp", "pp", "micro_batch"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise SearchError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}.")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise SearchError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage!r}.")
        if self.compile not in COMPILE_MODES:
            raise SearchError(f"--compile must be on or off (or omitted: the planner decides), got {self.compile!r}.")
        if self.tokens is not None and (
            isinstance(self.tokens, bool)
            or not isinstance(self.tokens, (int, float))
            or not math.isfinite(self.tokens)
            or self.tokens <= 0
        ):
            raise SearchError(f"--tokens must be a positive number of tokens, got {self.tokens!r}.")
        for kind in ("optimizer", "params"):
            v = getattr(self, f"offload_{kind}")
            if v is not None and v not in OFFLOAD_TIERS:
                raise SearchError(
                    f"--offload-{kind} must be one of {', '.join(OFFLOAD_TIERS)} (or omitted: the "
                    f"planner decides), got {v!r}."
                )
        if self.offload_params not in (None, "none") and self.zero_stage not in (None, 3):
            raise SearchError(
                f"--offload-params {self.offload_params} needs ZeRO stage 3 (only ZeRO-3 shards the "
                f"parameters it keeps off the device), but --zero-stage is {self.zero_stage}. Use "
                "--zero-stage 3, or drop one of the two flags."
            )
        if self.offload_optimizer not in (None, "none") and self.zero_stage == 0:
            raise SearchError(
                f"--offload-optimizer {self.offload_optimizer} needs ZeRO stage 1, 2 or 3 (each rank "
                "offloads its optimizer shard), but --zero-stage is 0. Use --zero-stage 1, 2 or 3, "
                "or drop one of the two flags."
            )
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise SearchError(
                f"--schedule must be one of {', '.join(SCHEDULES)} (or omitted: the planner decides), "
                f"got {self.schedule!r}."
            )
        v = self.virtual_stages
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise SearchError(f"--virtual-stages must be a positive integer, got {v!r}.")
        if self.sequence_parallel not in (None, "on", "off"):
            raise SearchError(f"--sequence-parallel must be on or off, got {self.sequence_parallel!r}.")
        if self.sequence_parallel == "on" and self.tp == 1:
            raise SearchError(
                "--sequence-parallel on needs tensor parallelism, but --tp is 1: sequence "
                "parallelism splits the tensor-parallel regions' sequence over the tp ranks. Drop "
                "--tp 1 or --sequence-parallel on."
            )
        if self.checkpoint not in CHECKPOINT_MODES:
            raise SearchError(f"--checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {self.checkpoint!r}.")
        if not 0.1 <= self.memory_headroom <= 1.0:
            raise SearchError(f"--memory-headroom must be in [0.1, 1.0], got {self.memory_headroom}.")
        pins = {k: getattr(self, k) for k in ("dp", "tp", "pp")}
        fixed = 1
        for v in pins.values():
            fixed *= v or 1
        if all(v is not None for v in pins.values()) and fixed != self.gpus:
            raise SearchError(
                f"--dp {self.dp} x --tp {self.tp} x --pp {self.pp} = {fixed}, but --gpus is "
                f"{self.gpus}; the three degrees must multiply to the number of devices."
            )
        if self.gpus % fixed:
            got = " x ".join(f"--{k} {v}" for k, v in pins.items() if v is not None)
            raise SearchError(f"{got} = {fixed} does not divide --gpus {self.gpus}.")
        if self.dp is not None and self.global_batch % self.dp:
            raise SearchError(f"--global-batch {self.global_batch} is not divisible by --dp {self.dp}.")
        if self.micro_batch is not None and self.dp is not None and self.global_batch % (self.dp * self.micro_batch):
            raise SearchError(
                f"--global-batch {self.global_batch} is not divisible by --dp {self.dp} x "
                f"--micro-batch {self.micro_batch}."
            )
