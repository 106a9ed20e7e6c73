"""The training configuration: every setting of a training run, typed and documented in one place.

``TrainOptions`` is what ``planner train`` hands to every rank (it is pickled into the spawned
processes) and what ``runtime.training.trainer.train_worker`` reads. Each field has its default and its
documentation here; a field that ``planner train`` exposes also carries a ``CliFlag`` in its
metadata (flag name, help, the kind of value the flag takes, how the flag's value becomes the
setting), from which the command line builds its flags and reads them back (``cli_flags``).
Fields without one (the AdamW betas, ``memory_steps``, ``progress``) are set by code:
``planner validate``, tests, benchmarks.

``__post_init__`` checks every field and raises ``ConfigError`` (a ``ValueError``) naming the
field, its flag and the value; ``planner train`` reports it as bad input (exit status 2).

Only the standard library is imported: compiled code and the trainer run with torch and
``runtime`` alone.
"""

from __future__ import annotations

import math
import operator
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Callable

from runtime.contract.choices import Toggle, names
from runtime.contract.input_errors import ConfigError
from runtime.contract.overlap import Overlap

__all__ = ["TrainOptions", "CliFlag", "FLAG_KINDS", "cli_flags", "default_of"]

#: What a flag's value may be, checked by the command line as it parses (``planner.cli``):
#: ``switch`` takes no value (present: True).
FLAG_KINDS: tuple[str, ...] = ("str", "float", "positive_float", "positive_int", "nonneg_int", "switch")


@dataclass(frozen=True)
class CliFlag:
    """How one setting appears on the ``planner train`` command line."""

    flag: str
    """The option, e.g. ``--lr``; the parsed value is ``args.<flag without dashes, - as _>``."""
    kind: str = "str"
    """The value it takes, one of ``FLAG_KINDS``."""
    help: str | None = None
    metavar: str | None = None
    """The value's name in usage lines (argparse's default: the flag in capitals)."""
    required: bool = False
    """The flag must be given (the setting has no default)."""
    to_setting: Callable[[Any], Any] | None = None
    """Turns the flag's value into the setting's (None: taken as is). A ``switch`` flag's value is
    False when absent, so a switch that turns a setting off maps through ``operator.not_``."""

    def __post_init__(self) -> None:
        if self.kind not in FLAG_KINDS:
            raise ValueError(f"flag {self.flag}: kind {self.kind!r} is not one of {', '.join(FLAG_KINDS)}")

    @property
    def dest(self) -> str:
        """The attribute argparse stores this flag's value under."""
        return self.flag.lstrip("-").replace("-", "_")

    def setting(self, value: Any) -> Any:
        """The setting's value for the flag's parsed ``value``."""
        return value if self.to_setting is None else self.to_setting(value)


def _flag(flag: str, **kw) -> dict:
    """Field metadata exposing a setting as ``flag`` (see ``CliFlag``)."""
    return {"cli": CliFlag(flag, **kw)}


def _none_unless_positive(value: float) -> float | None:
    """``--clip 0`` (or below) turns clipping off."""
    return value if value > 0 else None


@dataclass
class TrainOptions:
    """Every setting of a training run; ``planner train``'s flags are the fields with a ``CliFlag``
    (in this order), the others are set by code."""

    steps: int = field(metadata=_flag("--steps", kind="positive_int", required=True, help="total steps of the run"))
    """Total optimizer steps of the run (a resumed run continues up to this number)."""
    metrics_path: str | None = field(default=None, metadata=_flag("--metrics", metavar="FILE.jsonl"))
    """Rank 0 appends one JSON object per step here."""
    tensorboard_dir: str | None = field(
        default=None,
        metadata=_flag(
            "--tensorboard",
            metavar="DIR",
            help="also write loss, tokens/s, step time, peak memory and the time breakdown as TensorBoard "
            "scalars here (needs: pip install tensorboard)",
        ),
    )
    """Rank 0 writes each step's metrics as TensorBoard scalars in this folder; None: no TensorBoard.
    Needs the optional ``tensorboard`` package."""
    data_path: str | None = field(
        default=None,
        metadata=_flag(
            "--data",
            metavar="PATH",
            help="token file (uint16 .bin/.u16, uint32 .u32, .npy) or UTF-8 text; default synthetic tokens",
        ),
    )
    """Token file or UTF-8 text; None for synthetic tokens."""
    seed: int = field(default=0, metadata=_flag("--seed", kind="nonneg_int"))
    """Fixes initialization and data."""
    checkpoint_dir: str | None = field(default=None, metadata=_flag("--checkpoint-dir", metavar="DIR"))
    """Where checkpoints are saved and resumed from; None: no checkpoints."""
    save_every: int = field(default=0, metadata=_flag("--save-every", kind="nonneg_int", metavar="K"))
    """Save a checkpoint every K steps (and at the end) when ``checkpoint_dir`` is set; 0: never."""
    keep_last: int = field(default=2, metadata=_flag("--keep-last", kind="positive_int", metavar="K"))
    """Checkpoints kept on disk."""
    resume: bool = field(default=False, metadata=_flag("--resume", kind="switch"))
    """Continue from the newest complete checkpoint of ``checkpoint_dir`` and ``snapshot_dir`` (by step;
    none yet: start at step 0)."""
    elastic: bool = field(
        default=False,
        metadata=_flag(
            "--elastic",
            kind="switch",
            help="when the ranks started differ from the plan's dp*tp*pp, re-plan for them (same global "
            "batch; the plan must record its request) and, with --resume, continue from the newest checkpoint",
        ),
    )
    """Re-plan for the world found when it differs from the plan's (``planner.commands.elastic``)."""
    snapshot_every: int = field(
        default=0,
        metadata=_flag(
            "--snapshot-every",
            kind="nonneg_int",
            metavar="N",
            help="every N steps keep a copy of the training state in host memory (and write it to "
            "--snapshot-dir when given); 0: never",
        ),
    )
    """Every N steps stage the state (each rank's part) in host memory, replacing the previous
    snapshot, and write it to ``snapshot_dir`` when set; 0: no snapshots. An in-memory snapshot
    lives only as long as the process: only a written one survives a restart."""
    snapshot_dir: str | None = field(
        default=None,
        metadata=_flag(
            "--snapshot-dir",
            metavar="DIR",
            help="local folder the snapshots are written to (the newest complete one is kept); "
            "--resume takes the newer of it and --checkpoint-dir",
        ),
    )
    """Where snapshots are written (checkpoint format, only the newest complete one kept); None:
    snapshots stay in memory."""
    on_save_error: str = field(
        default="stop",
        metadata=_flag(
            "--on-save-error",
            metavar="stop|continue",
            help="when a checkpoint or snapshot cannot be written: stop the run (exit 1, default) or log "
            "it and train on (the previous checkpoint is kept either way)",
        ),
    )
    """What a failed save does: ``stop`` ends the run with an error naming the folder and the
    cause; ``continue`` logs it (a ``save_error`` event line, one line on stderr) and trains on."""
    async_checkpoint: str = field(
        default=Toggle.ON.value,
        metadata=_flag(
            "--async-checkpoint",
            metavar="on|off",
            help="on (default): a save stages the state in host memory and writes it in the background; "
            "off: every rank waits for the write",
        ),
    )
    """``on``: a step waits only for the copy of the state to host memory (and for the previous
    write, at most one in flight), the write runs in a background thread
    (``runtime.checkpointing.background_writer``); ``off``: the write is in line."""
    overlap: str = field(
        default=Toggle.ON.value,
        metadata=_flag(
            "--overlap",
            metavar="on|off",
            help="on (default): data-parallel, tensor-parallel and pipeline communication runs beside "
            "compute; off: every collective is waited where it is issued (same numbers, for comparison)",
        ),
    )
    """``on``: every kind of communication the runtime can overlap with compute does
    (``runtime.contract.overlap``); ``off``: each collective is waited at once. The losses and
    parameters are the same either way."""
    timeout_s: float = field(
        default=300.0,
        metadata=_flag(
            "--timeout", kind="positive_float", metavar="SECONDS", help="fail if any collective waits longer than this"
        ),
    )
    """Seconds any collective may wait before the run fails."""
    lr: float = field(default=3e-4, metadata=_flag("--lr", kind="positive_float"))
    """Peak learning rate."""
    min_lr: float = field(default=3e-5, metadata=_flag("--min-lr", kind="float"))
    """Learning rate at the end of the cosine decay; one above ``lr`` is lowered to ``lr`` (a
    peak below the default floor then stays constant after warmup)."""
    warmup_steps: int = field(default=0, metadata=_flag("--warmup", kind="nonneg_int", metavar="STEPS"))
    """Linear warmup steps from 0 to ``lr``."""
    weight_decay: float = field(default=0.1, metadata=_flag("--weight-decay", kind="float"))
    """AdamW decoupled weight decay."""
    eps: float = field(
        default=1e-8, metadata=_flag("--adam-eps", kind="positive_float", help="AdamW epsilon (default 1e-8)")
    )
    """AdamW epsilon."""
    max_grad_norm: float | None = field(
        default=1.0,
        metadata=_flag(
            "--clip", kind="float", help="global gradient-norm clip (0: off)", to_setting=_none_unless_positive
        ),
    )
    """Clip gradients to this global L2 norm (None: no clipping)."""
    nvme_path: str | None = field(
        default=None,
        metadata=_flag(
            "--nvme-path",
            metavar="DIR",
            help="folder for the NVMe tier of a plan that offloads optimizer state or parameters to nvme "
            "(each rank writes DIR/rank<r>/, removed at the end)",
        ),
    )
    """Folder of the NVMe offload tier (``runtime.data_parallel.offload_engine``): each rank keeps its offloaded state in
    files under ``DIR/rank<r>/`` and deletes them at the end. Needed when the plan's ``offload``
    puts anything on ``nvme``; None otherwise."""
    delayed_update: bool = field(
        default=False,
        metadata=_flag(
            "--delayed-update",
            kind="switch",
            help="with the optimizer offloaded, overlap each step's CPU update with the next step's forward and "
            "backward; changes the numerics (parameters lag one step)",
        ),
    )
    """One-step delayed update (needs the plan's ``offload.optimizer`` on cpu or nvme): the CPU AdamW
    step of step k runs in the background while step k+1's forward and backward run, and reaches
    the device at step k+1's optimizer step, so step k+1 computes with the parameters of step k-1.
    This changes the numerics (as DeepSpeed's ZeRO-Offload delayed parameter update does); off by
    default. A checkpoint applies the pending update first, so a resumed run continues from the
    fully updated state (not bit-identical to an uninterrupted delayed run)."""
    compression_warmup: int | None = field(
        default=None,
        metadata=_flag(
            "--compression-warmup",
            kind="nonneg_int",
            metavar="N",
            help="with a plan whose dp_compression is onebit-adam: full-precision AdamW steps before the "
            "variance freezes and the exchange is compressed (default: the plan's compression_warmup)",
        ),
    )
    """Steps of full-precision AdamW before 1-bit Adam freezes the variance and compresses the
    data-parallel exchange (``runtime.data_parallel.onebit_adam``); None: the plan's
    ``compression_warmup`` (or 15% of the run when the plan has none). Ignored without
    compression."""
    track_memory: bool = field(
        default=True,
        metadata=_flag(
            "--no-memory-tracking", kind="switch", help="skip live-tensor tracking (faster)", to_setting=operator.not_
        ),
    )
    """Measure peak live tensor bytes (slower on CPU)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    memory_steps: int | None = None
    """Track memory only in the first N steps of this run (later steps report that peak and run
    at full speed); None tracks every step."""
    progress: bool = True
    """Show a progress bar and a summary on rank 0."""

    def __post_init__(self) -> None:
        self.min_lr = min(self.min_lr, self.lr)
        checks = (
            ("steps", _is_int(self.steps) and self.steps >= 1, "a positive integer"),
            ("seed", _is_int(self.seed) and self.seed >= 0, "a non-negative integer"),
            ("save_every", _is_int(self.save_every) and self.save_every >= 0, "a non-negative integer"),
            ("keep_last", _is_int(self.keep_last) and self.keep_last >= 1, "a positive integer"),
            ("snapshot_every", _is_int(self.snapshot_every) and self.snapshot_every >= 0, "a non-negative integer"),
            ("on_save_error", self.on_save_error in ("stop", "continue"), "stop or continue"),
            ("async_checkpoint", self.async_checkpoint in names(Toggle), " or ".join(names(Toggle))),
            ("overlap", self.overlap in names(Toggle), " or ".join(names(Toggle))),
            ("warmup_steps", _is_int(self.warmup_steps) and self.warmup_steps >= 0, "a non-negative integer"),
            ("timeout_s", _finite(self.timeout_s) and self.timeout_s > 0, "a positive number"),
            ("lr", _finite(self.lr) and self.lr > 0, "a positive number"),
            ("min_lr", _finite(self.min_lr) and self.min_lr >= 0, "a non-negative number"),
            ("weight_decay", _finite(self.weight_decay) and self.weight_decay >= 0, "a non-negative number"),
            ("eps", _finite(self.eps) and self.eps > 0, "a positive number"),
            ("beta1", _finite(self.beta1) and 0 <= self.beta1 < 1, "in [0, 1)"),
            ("beta2", _finite(self.beta2) and 0 <= self.beta2 < 1, "in [0, 1)"),
            (
                "max_grad_norm",
                self.max_grad_norm is None or (_finite(self.max_grad_norm) and self.max_grad_norm > 0),
                "a positive number or None (no clipping)",
            ),
            (
                "compression_warmup",
                self.compression_warmup is None or (_is_int(self.compression_warmup) and self.compression_warmup >= 0),
                "a non-negative integer or None (the plan's)",
            ),
            (
                "memory_steps",
                self.memory_steps is None or (_is_int(self.memory_steps) and self.memory_steps >= 1),
                "a positive integer or None (every step)",
            ),
        )
        for name, valid, what in checks:
            if not valid:
                raise ConfigError(f"{_label(name)} must be {what}, got {getattr(self, name)!r}")

    @property
    def overlap_settings(self) -> Overlap:
        """What this run overlaps (``--overlap``), per kind of traffic."""
        return Overlap.from_toggle(self.overlap)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _label(name: str) -> str:
    """``lr (--lr)``: a setting and, if it has one, its flag."""
    cli = _FIELDS[name].metadata.get("cli")
    return f"{name} ({cli.flag})" if cli else name


_FIELDS: dict[str, Field] = {f.name: f for f in fields(TrainOptions)}


def cli_flags(cls: type = TrainOptions) -> list[tuple[Field, CliFlag]]:
    """The fields of dataclass ``cls`` that have a command-line flag, with it, in field order."""
    return [(f, f.metadata["cli"]) for f in fields(cls) if "cli" in f.metadata]


def default_of(name: str, cls: type = TrainOptions) -> Any:
    """The default of setting ``name`` (a ``KeyError`` for a setting without one)."""
    f = {f.name: f for f in fields(cls)}[name]
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")
