"""The ``planner`` command line: plan, compile, train, calibrate, validate, export, tune.

Every command turns bad input into one clear paragraph on stderr and exit status 2 (no
traceback); a failed training run exits 1 with the reason. See README.md for examples.
"""

from __future__ import annotations

import argparse
import errno
import gc
import importlib
import os
import sys
from dataclasses import MISSING, Field
from typing import Any, Callable, Iterable

import planner.frontend.model_analysis as model_analysis
from codegen.codegen_errors import CodegenError, LoweringError, TPRewriteError, UnsafeNameError
from cost_models.hardware import ProfileError
from passes.pass_error import PassError
from planner.commands.calibrate_common import CalibrationError
from planner.errors import UserError
from planner.frontend.frontend_errors import ModelError
from planner.plan import PlanError, check_plan_out, output_problem
from planner.search.request import PlanFlag, PlanRequest
from planner.search.search_errors import NoFeasiblePlan, SearchError
from runtime.contract.choices import Toggle, names
from runtime.contract.input_errors import DataError
from runtime.training.train_config import CliFlag, TrainOptions, cli_flags, default_of

__all__ = ["main", "build_parser", "user_errors"]


def _int_at_least(least: int, what: str):
    """An argparse type: an integer >= ``least``, with a message naming what was expected."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"must be a {what} integer, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "positive")
_nonneg_int = _int_at_least(0, "non-negative")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _gpu_counts(text: str) -> list[int]:
    """``--gpus``: one device count, or a comma-separated list of them (a sweep)."""
    parts = [x.strip() for x in text.split(",")]
    out = []
    for x in parts:
        if not x.isdigit() or int(x) < 1:
            raise argparse.ArgumentTypeError(
                f"must be a positive integer or a comma-separated list of them (64,128,256), got {text!r}"
            )
        out.append(int(x))
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"lists a device count twice: {text!r}")
    return out


_TOKEN_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _token_count(text: str) -> float:
    """``--tokens``: a positive count, in plain or scientific notation or with a K/M/B/T suffix."""
    number = text.strip().replace("_", "").replace(",", "")
    scale = _TOKEN_SUFFIXES.get(number[-1:].lower(), 1.0) if number else 1.0
    if scale != 1.0:
        number = number[:-1]
    try:
        value = float(number) * scale
    except ValueError:
        value = float("nan")
    if not (value >= 1 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a token count such as 300e9, 300B or 2T, got {text!r}")
    return value


#: The argparse type of each kind of settings flag (``runtime.training.train_config.CliFlag.kind`` and
#: ``planner.search.request.PlanFlag.kind``; ``switch`` flags take no value, ``repeated`` ones append).
_FLAG_TYPES: dict[str, Callable[[str], Any] | None] = {
    "str": None,
    "int": int,
    "float": float,
    "positive_float": _positive_float,
    "positive_int": _positive_int,
    "nonneg_int": _nonneg_int,
    "gpu_counts": _gpu_counts,
    "token_count": _token_count,
}


def _flag_default(setting: Field, flag: CliFlag) -> Any:
    """What argparse stores for an absent flag: the setting's default, or None for a setting without
    a plain default and for a plan flag that maps its value (``to_setting`` makes the setting of None)."""
    if setting.default is MISSING or (isinstance(flag, PlanFlag) and flag.to_setting is not None):
        return None
    return setting.default


def _add_setting_flags(parser: argparse.ArgumentParser, settings: Iterable[tuple[Field, CliFlag]]) -> None:
    """One flag per ``(field, CliFlag)`` of ``settings`` (``runtime.training.train_config.cli_flags``): its kind's
    type, the field's default (a switch is off by default), its help, metavar and choices."""
    for setting, flag in settings:
        if flag.kind == "switch":
            parser.add_argument(flag.flag, action="store_true", help=flag.help)
            continue
        options: dict[str, Any] = {"metavar": flag.metavar, "help": flag.help}
        if flag.kind == "repeated":
            options["action"] = "append"
        else:
            options["type"] = _FLAG_TYPES[flag.kind]
        if isinstance(flag, PlanFlag) and flag.choices is not None:
            options["choices"] = flag.choices
        if flag.required:
            options["required"] = True
        else:
            options["default"] = _flag_default(setting, flag)
        parser.add_argument(flag.flag, **options)


def _add_model_size_args(parser: argparse.ArgumentParser) -> None:
    """The model-size flags. They are not ``PlanRequest`` fields: together they fill its one
    ``sizes`` dict (``planner.commands.plan_command.SIZE_FLAGS``), and ``--help`` lists them
    right after ``--model``."""
    for flag, help_text in (
        ("--layers", "transformer blocks"),
        ("--hidden", "model width"),
        ("--heads", "attention heads"),
        ("--kv-heads", "key/value heads (GQA, hf:llama)"),
        ("--ffn", "MLP inner width"),
        ("--vocab", "vocabulary size"),
    ):
        parser.add_argument(flag, type=_positive_int, default=None, help=help_text)


def _add_request_args(parser: argparse.ArgumentParser) -> None:
    """The planning request's flags (model, cluster, batch, pins), shared by ``plan`` (and its
    sweep) and ``tune``: one per ``PlanRequest`` field with a ``PlanFlag``, in field order, the
    model-size flags after ``--model``."""
    for setting, flag in cli_flags(PlanRequest):
        _add_setting_flags(parser, [(setting, flag)])
        if setting.name == "spec":
            _add_model_size_args(parser)


def _add_plan_command(commands: Any) -> None:
    parser = commands.add_parser(
        "plan", help="choose DP/TP/PP degrees, ZeRO stage, micro-batching and checkpointing for a cluster"
    )
    _add_request_args(parser)
    # Where the plan goes and how it is shown: the command's, not the request's (the search never reads them).
    parser.add_argument(
        "--out",
        default="plan.json",
        help="where to write the plan (default plan.json; a sweep writes one per size, plan-64gpus.json ...)",
    )
    parser.add_argument("--json", action="store_true", help="print only the plan JSON on stdout (a sweep: a list)")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw the schedule and memory (a sweep: time and cost against the device count)",
    )


def _add_compile_command(commands: Any) -> None:
    parser = commands.add_parser("compile", help="lower a plan into per-stage Python modules")
    parser.add_argument("plan")
    parser.add_argument("--out", required=True, metavar="DIR")


def _add_train_command(commands: Any) -> None:
    parser = commands.add_parser("train", help="train a plan on local processes or under torchrun")
    parser.add_argument("plan")
    parser.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="spawn N local processes (gloo on CPU); without it, read torchrun's environment",
    )
    # The training settings' flags (runtime.training.train_config.TrainOptions), --no-memory-tracking after
    # --compiled as --help has always listed them.
    settings = {setting.name: (setting, flag) for setting, flag in cli_flags(TrainOptions)}
    last = settings.pop("track_memory")
    _add_setting_flags(parser, settings.values())
    parser.add_argument(
        "--compiled", default=None, metavar="DIR", help="where to compile the plan (default: a folder beside plan.json)"
    )
    _add_setting_flags(parser, [last])


def _add_calibrate_command(commands: Any) -> None:
    parser = commands.add_parser("calibrate", help="measure this machine and write a hardware profile")
    parser.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="CPU: processes to time collectives between (default 2); CUDA: local GPUs to run the "
        "NCCL collectives over (default all)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="measure local GPUs over NCCL (cuda), CPU processes over gloo (cpu), or cuda when "
        "PyTorch sees a GPU (auto)",
    )
    parser.add_argument("--out", required=True, metavar="profile.json")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument(
        "--nvme-path",
        default=None,
        metavar="DIR",
        help="directory on the drive whose write and read bandwidth to measure for the NVMe "
        "offload tier (default: the system's temporary directory)",
    )


def _add_validate_command(commands: Any) -> None:
    parser = commands.add_parser("validate", help="run a plan here and compare predicted with measured")
    parser.add_argument("plan")
    parser.add_argument("--nproc", type=_positive_int, required=True)
    parser.add_argument("--steps", type=_positive_int, required=True)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seed", type=_nonneg_int, default=default_of("seed"))
    parser.add_argument("--timeout", type=_positive_float, default=default_of("timeout_s"))
    parser.add_argument(
        "--nvme-path",
        default=None,
        metavar="DIR",
        help="folder for the NVMe tier's files of a plan that offloads to nvme (default: a "
        "temporary folder, removed afterwards)",
    )
    parser.add_argument(
        "--overlap",
        choices=names(Toggle),
        default=default_of("overlap"),
        help="on (default): communication runs beside compute, as the plan's price assumes; off: every "
        "collective waited where it is issued",
    )


def _add_tune_command(commands: Any) -> None:
    parser = commands.add_parser("tune", help="plan, run the best candidates here and keep the fastest that fits")
    _add_request_args(parser)
    # How the candidates run and where the results go: the command's, not the request's.
    parser.add_argument(
        "--candidates",
        type=_positive_int,
        default=3,
        metavar="K",
        help="how many of the search's best strategies to run (default 3)",
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=5, help="steps per candidate, the first 2 warm-up (default 5)"
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=default_of("timeout_s"),
        metavar="SECONDS",
        help="a candidate still running after this long (or a collective waiting this long) "
        "is stopped and recorded as timed out",
    )
    parser.add_argument(
        "--profile-out",
        default=None,
        metavar="profile.json",
        help="write the hardware profile refit from the measured candidates",
    )
    parser.add_argument("--out", default="plan.json", help="where to write the chosen plan (default plan.json)")
    parser.add_argument("--json", action="store_true", help="print only the chosen plan's JSON on stdout")


def _add_export_command(commands: Any) -> None:
    parser = commands.add_parser("export", help="export a plan or checkpoint to another format")
    formats = parser.add_subparsers(dest="format", metavar="FORMAT")
    formats.required = True
    exporter = formats.add_parser("deepspeed", help="write the equivalent DeepSpeed ds_config.json")
    exporter.add_argument("plan")
    exporter.add_argument("--out", default="ds_config.json")
    exporter.add_argument(
        "--nvme-path",
        default=None,
        metavar="DIR",
        help="the node-local NVMe drive's folder for a plan that offloads to nvme (zero_optimization's nvme_path)",
    )
    exporter = formats.add_parser("weights", help="consolidate a checkpoint into one safetensors file")
    exporter.add_argument("checkpoint")
    exporter.add_argument("--out", default="model.safetensors")
    exporter = formats.add_parser(
        "hf",
        help="write a checkpoint of an hf: model as an HF model directory "
        "(config.json + model.safetensors, loadable with from_pretrained)",
    )
    exporter.add_argument("checkpoint", help="a step-N checkpoint, or a --checkpoint-dir (its newest)")
    exporter.add_argument(
        "--out", required=True, metavar="DIR", help="the directory to write (must not exist or be empty)"
    )


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, in the order ``planner --help`` lists them."""
    parser = argparse.ArgumentParser(
        prog="planner", description="Plan, compile and run parallel training strategies for PyTorch models."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for add_command in (
        _add_plan_command,
        _add_compile_command,
        _add_train_command,
        _add_calibrate_command,
        _add_validate_command,
        _add_tune_command,
        _add_export_command,
    ):
        add_command(commands)
    return parser


#: Each command's driver as (module, function), imported when the command runs: the drivers of
#: train, compile or calibrate import torch, and a re-plan that the layer-table cache answers
#: never needs it (ARCHITECTURE.md, import rules).
_DRIVERS = {
    "plan": ("planner.commands.plan_command", "run_plan"),
    "sweep": ("planner.commands.sweep", "run_sweep"),
    "compile": ("planner.commands.compile", "run_compile"),
    "train": ("planner.commands.train", "run_train"),
    "calibrate": ("planner.commands.calibrate", "run_calibrate"),
    "validate": ("planner.commands.validate", "run_validate"),
    "export": ("planner.commands.export", "run_export"),
    "tune": ("planner.commands.tune", "run_tune"),
}


def _driver(name: str):
    return getattr(_driver_module(name), _DRIVERS[name][1])


def _check_outputs(name: str, args) -> None:
    """Before the search (seconds to minutes): the files ``plan``, its sweep and ``tune`` will write
    can be written (not a directory, not under a file, not read-only), else a ``UserError`` naming the flag."""
    if name not in ("plan", "sweep", "tune"):
        return
    if name == "sweep":
        for path in _driver_module("sweep").sweep_paths(args.out, sorted(args.gpus)).values():
            problem = output_problem(path)
            if problem is not None:
                raise UserError(f"--out {args.out}: the sweep's plan {path} {problem}; give another --out.")
    else:
        check_plan_out(args.out)
    for flag, path in (("--plot", getattr(args, "plot", None)), ("--profile-out", getattr(args, "profile_out", None))):
        problem = output_problem(path) if path else None
        if problem is not None:
            raise UserError(f"{flag} {path} {problem}; give a path where that file can be written.")


def _driver_module(name: str):
    return importlib.import_module(_DRIVERS[name][0])


def _run(args) -> int:
    """Dispatch: ``planner plan`` is one cluster size, or a sweep over several (``--gpus 64,128``)."""
    name = args.command
    if name == "plan" and len(args.gpus) > 1:
        name = "sweep"
    _check_outputs(name, args)
    if name in ("plan", "sweep", "tune"):  # one process per command: freezing imports is safe
        model_analysis.FREEZE_IMPORTS = True
    return _driver(name)(args)


#: Every layer's bad-input error: each becomes one paragraph on stderr and exit status 2. (A
#: checkpoint that fails while training is a failed run, exit 1, not bad input.)
_USER_ERRORS: tuple[type[BaseException], ...] = (
    ModelError,  # planner.frontend
    PassError,  # passes
    ProfileError,  # cost_models
    SearchError,  # planner.search
    NoFeasiblePlan,
    PlanError,  # planner.plan
    CodegenError,  # codegen
    LoweringError,
    UnsafeNameError,
    TPRewriteError,
    DataError,  # runtime
    CalibrationError,  # planner.commands
    UserError,  # planner
)

#: The module of the one bad-input error that cannot be imported here: it imports torch, which a
#: re-plan from the layer-table cache never needs (``CompiledError``, a compiled stage folder that
#: does not match its plan).
_COMPILED_STAGES = "runtime.stages.compiled_stages"


def user_errors() -> tuple[type[BaseException], ...]:
    """Every bad-input error a command may have raised: ``_USER_ERRORS``, and ``CompiledError`` once
    its module is imported (a command that never imported it cannot have raised it)."""
    compiled_stages = sys.modules.get(_COMPILED_STAGES)
    return _USER_ERRORS + ((compiled_stages.CompiledError,) if compiled_stages is not None else ())


#: The storage failures a user can act on (a full disk or quota, a read-only file system): one line
#: and exit 1, as a failed run (every file is written atomically, so what was saved is intact).
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def _storage_message(e: OSError) -> str:
    """What went wrong writing to disk and what to do."""
    where = f" writing {e.filename}" if e.filename else ""
    what = os.strerror(e.errno) if e.errno is not None else str(e)
    return (
        f"{what.lower()}{where}; free some space (or choose another folder) and run the command "
        "again: files already saved were left as they were."
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except Exception as e:
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            print(f"planner {args.command}: error: {_storage_message(e)}", file=sys.stderr)
            return 1
        if not isinstance(e, user_errors()):
            raise
        print(f"planner {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"planner {args.command}: interrupted", file=sys.stderr)
        return 130


def console_main() -> int:
    """The ``planner`` console script: ``main``, then freeze the heap so that the interpreter's
    exit does not walk every object torch and sympy created (most of a second of a re-plan)."""
    status = main()
    gc.freeze()
    return status


if __name__ == "__main__":
    sys.exit(console_main())
