"""The ``planner`` command line: plan, compile, train, calibrate, validate, export, tune.

Every command turns bad input into one clear paragraph on stderr and exit status 2 (no
traceback); a failed training run exits 1 with the reason. See README.md for examples.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from typing import Any

from runtime.contract.dtype_table import DTYPES
from runtime.training.train_config import TrainOptions, cli_flags, default_of

__all__ = ["main", "build_parser", "user_errors"]  # and USER_ERRORS, computed on access (__getattr__)


def _int_at_least(lo: int, what: str):
    """An argparse type: an integer >= ``lo``, with a message naming what was expected."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(f"must be a {what} integer, got {s!r}")
        return v

    return parse


_positive_int = _int_at_least(1, "positive")
_nonneg_int = _int_at_least(0, "non-negative")


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}")
    return v


def _gpu_counts(s: str) -> list[int]:
    """``--gpus``: one device count, or a comma-separated list of them (a sweep)."""
    parts = [x.strip() for x in s.split(",")]
    out = []
    for x in parts:
        if not x.isdigit() or int(x) < 1:
            raise argparse.ArgumentTypeError(
                f"must be a positive integer or a comma-separated list of them (64,128,256), got {s!r}"
            )
        out.append(int(x))
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"lists a device count twice: {s!r}")
    return out


_TOKEN_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _token_count(s: str) -> float:
    """``--tokens``: a positive count, in plain or scientific notation or with a K/M/B/T suffix."""
    t = s.strip().replace("_", "").replace(",", "")
    scale = _TOKEN_SUFFIXES.get(t[-1:].lower(), 1.0) if t else 1.0
    if scale != 1.0:
        t = t[:-1]
    try:
        v = float(t) * scale
    except ValueError:
        v = float("nan")
    if not (v >= 1 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a token count such as 300e9, 300B or 2T, got {s!r}")
    return v


#: The argparse type of each kind of settings flag (``runtime.training.train_config.CliFlag.kind``; ``switch``
#: flags take no value).
_FLAG_TYPES = {
    "str": None,
    "float": float,
    "positive_float": _positive_float,
    "positive_int": _positive_int,
    "nonneg_int": _nonneg_int,
}


def _add_setting_flags(p: argparse.ArgumentParser, settings) -> None:
    """One flag per ``(field, CliFlag)`` of ``settings`` (``runtime.training.train_config.cli_flags``): its kind's
    type, the field's default (a switch is off by default), its help and metavar."""
    for f, flag in settings:
        if flag.kind == "switch":
            p.add_argument(flag.flag, action="store_true", help=flag.help)
        elif flag.required:
            p.add_argument(flag.flag, type=_FLAG_TYPES[flag.kind], required=True, metavar=flag.metavar, help=flag.help)
        else:
            p.add_argument(
                flag.flag, type=_FLAG_TYPES[flag.kind], default=f.default, metavar=flag.metavar, help=flag.help
            )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        metavar="SPEC",
        help="gpt | gpt2 | gpt2-xl | gpt3-175b | hf:gpt2 | hf:llama | hf:bert | hf:PATH (a local HF "
        "model directory) | file.py:factory",
    )
    for flag, help_ in (
        ("--layers", "transformer blocks"),
        ("--hidden", "model width"),
        ("--heads", "attention heads"),
        ("--kv-heads", "key/value heads (GQA, hf:llama)"),
        ("--ffn", "MLP inner width"),
        ("--vocab", "vocabulary size"),
    ):
        p.add_argument(flag, type=_positive_int, default=None, help=help_)


def _add_request_args(p: argparse.ArgumentParser) -> None:
    """The planning request's flags (model, cluster, batch, pins), shared by ``plan`` and ``tune``."""
    _add_model_args(p)
    p.add_argument(
        "--gpus",
        type=_gpu_counts,
        required=True,
        metavar="N[,N...]",
        help="devices in the cluster; a comma-separated list (64,128,256) plans each size and compares them",
    )
    p.add_argument(
        "--gpus-per-node", type=_positive_int, default=None, help="devices per node (default: the hardware profile's)"
    )
    p.add_argument(
        "--hardware",
        required=True,
        metavar="KIND|profile.json",
        help="a100-40gb, a100-80gb, h100-sxm, h200, v100-32gb, cpu, or a profile JSON",
    )
    p.add_argument("--global-batch", type=_positive_int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=_positive_int, required=True, help="tokens per sequence")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--dp", type=_positive_int, default=None, help="pin the data-parallel degree")
    p.add_argument("--tp", type=_positive_int, default=None, help="pin the tensor-parallel degree")
    p.add_argument("--pp", type=_positive_int, default=None, help="pin the pipeline degree")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None, help="pin the ZeRO stage")
    p.add_argument("--micro-batch", type=_positive_int, default=None, help="pin the micro-batch size")
    p.add_argument(
        "--checkpoint",
        choices=("auto", "none", "selective", "all"),
        default="auto",
        help="activation recompute: chosen per layer, whole or only its attention core (auto); "
        "never; the attention core of every block (selective); every block whole (all)",
    )
    p.add_argument("--memory-headroom", type=float, default=0.9, help="usable fraction of device memory (default 0.9)")
    p.add_argument("--tp-across-nodes", action="store_true", help="allow tensor parallelism across nodes")
    p.add_argument(
        "--input",
        action="append",
        default=None,
        metavar="NAME=ROLE",
        help="what training feeds a model input the planner cannot infer (repeatable): "
        "tokens, labels, targets, ones, zeros or positions",
    )
    p.add_argument(
        "--tokens",
        type=_token_count,
        default=None,
        metavar="N",
        help="tokens the whole run trains on (300e9, 2T, 500B): adds its days, GPU-hours and "
        "cost to the plan, and is what compiling must pay back over",
    )
    p.add_argument(
        "--compile",
        choices=("on", "off"),
        default=None,
        help="run each layer class under torch.compile (on) or eagerly (off); default: the "
        "planner compiles when the per-step saving repays the compile time over the run "
        "(--tokens, else 1,000 steps)",
    )
    p.add_argument(
        "--price-per-gpu-hour",
        type=_positive_float,
        default=None,
        metavar="X",
        help="what one device costs per hour (any currency): the cost in money, with --tokens",
    )
    p.add_argument(
        "--offload-optimizer",
        choices=("none", "cpu", "nvme"),
        default=None,
        help="where the optimizer state lives and AdamW runs: the device (none), host memory "
        "(cpu, ZeRO-Offload) or NVMe files (nvme, ZeRO-Infinity); default: the planner "
        "offloads only where it pays (a plan that does not fit otherwise, or fits only "
        "with more recompute or smaller micro-batches)",
    )
    p.add_argument(
        "--offload-params",
        choices=("none", "cpu", "nvme"),
        default=None,
        help="where the ZeRO-3 parameter shards live: the device (none), host memory (cpu) or "
        "NVMe files (nvme), fetched layer by layer ahead of use; default: searched",
    )
    p.add_argument(
        "--sequence-parallel",
        choices=("on", "off"),
        default=None,
        help="pin sequence parallelism in the tensor-parallel regions (norms, residuals and dropout on "
        "seq_len / tp positions per rank; default: searched where tp > 1)",
    )
    p.add_argument(
        "--schedule",
        choices=("1f1b", "interleaved", "zero-bubble"),
        default=None,
        help="pin the pipeline schedule: 1f1b, interleaved (v model chunks per pipeline rank: a "
        "v-fold smaller bubble for v times the sends) or zero-bubble (ZB-H1: weight gradients "
        "fill the bubble); default: the planner prices each and keeps the fastest that fits",
    )
    p.add_argument(
        "--virtual-stages",
        type=_positive_int,
        default=None,
        metavar="V",
        help="pin the model chunks per pipeline rank of --schedule interleaved (default: searched)",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="planner", description="Plan, compile and run parallel training strategies for PyTorch models."
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "plan", help="choose DP/TP/PP degrees, ZeRO stage, micro-batching and checkpointing for a cluster"
    )
    _add_request_args(p)
    p.add_argument(
        "--out",
        default="plan.json",
        help="where to write the plan (default plan.json; a sweep writes one per size, plan-64gpus.json ...)",
    )
    p.add_argument("--json", action="store_true", help="print only the plan JSON on stdout (a sweep: a list)")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw the schedule and memory (a sweep: time and cost against the device count)",
    )

    p = sub.add_parser("compile", help="lower a plan into per-stage Python modules")
    p.add_argument("plan")
    p.add_argument("--out", required=True, metavar="DIR")

    p = sub.add_parser("train", help="train a plan on local processes or under torchrun")
    p.add_argument("plan")
    p.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="spawn N local processes (gloo on CPU); without it, read torchrun's environment",
    )
    # The training settings' flags (runtime.training.train_config.TrainOptions), --no-memory-tracking after
    # --compiled as --help has always listed them.
    settings = {f.name: (f, flag) for f, flag in cli_flags(TrainOptions)}
    last = settings.pop("track_memory")
    _add_setting_flags(p, settings.values())
    p.add_argument(
        "--compiled", default=None, metavar="DIR", help="where to compile the plan (default: a folder beside plan.json)"
    )
    _add_setting_flags(p, [last])

    p = sub.add_parser("calibrate", help="measure this machine and write a hardware profile")
    p.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="CPU: processes to time collectives between (default 2); CUDA: local GPUs to run the "
        "NCCL collectives over (default all)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="measure local GPUs over NCCL (cuda), CPU processes over gloo (cpu), or cuda when "
        "PyTorch sees a GPU (auto)",
    )
    p.add_argument("--out", required=True, metavar="profile.json")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument(
        "--nvme-path",
        default=None,
        metavar="DIR",
        help="directory on the drive whose write and read bandwidth to measure for the NVMe "
        "offload tier (default: the system's temporary directory)",
    )

    p = sub.add_parser("validate", help="run a plan here and compare predicted with measured")
    p.add_argument("plan")
    p.add_argument("--nproc", type=_positive_int, required=True)
    p.add_argument("--steps", type=_positive_int, required=True)
    p.add_argument("--json", action="store_true")
    p.add_argument("--seed", type=_nonneg_int, default=default_of("seed"))
    p.add_argument("--timeout", type=_positive_float, default=default_of("timeout_s"))
    p.add_argument(
        "--nvme-path",
        default=None,
        metavar="DIR",
        help="folder for the NVMe tier's files of a plan that offloads to nvme (default: a "
        "temporary folder, removed afterwards)",
    )

    p = sub.add_parser("tune", help="plan, run the best candidates here and keep the fastest that fits")
    _add_request_args(p)
    p.add_argument(
        "--candidates",
        type=_positive_int,
        default=3,
        metavar="K",
        help="how many of the search's best strategies to run (default 3)",
    )
    p.add_argument(
        "--steps", type=_positive_int, default=5, help="steps per candidate, the first 2 warm-up (default 5)"
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=default_of("timeout_s"),
        metavar="SECONDS",
        help="a candidate still running after this long (or a collective waiting this long) "
        "is stopped and recorded as timed out",
    )
    p.add_argument(
        "--profile-out",
        default=None,
        metavar="profile.json",
        help="write the hardware profile refit from the measured candidates",
    )
    p.add_argument("--out", default="plan.json", help="where to write the chosen plan (default plan.json)")
    p.add_argument("--json", action="store_true", help="print only the chosen plan's JSON on stdout")

    p = sub.add_parser("export", help="export a plan or checkpoint to another format")
    esub = p.add_subparsers(dest="format", metavar="FORMAT")
    esub.required = True
    e = esub.add_parser("deepspeed", help="write the equivalent DeepSpeed ds_config.json")
    e.add_argument("plan")
    e.add_argument("--out", default="ds_config.json")
    e.add_argument(
        "--nvme-path",
        default=None,
        metavar="DIR",
        help="the node-local NVMe drive's folder for a plan that offloads to nvme (zero_optimization's nvme_path)",
    )
    e = esub.add_parser("weights", help="consolidate a checkpoint into one safetensors file")
    e.add_argument("checkpoint")
    e.add_argument("--out", default="model.safetensors")
    e = esub.add_parser(
        "hf",
        help="write a checkpoint of an hf: model as an HF model directory "
        "(config.json + model.safetensors, loadable with from_pretrained)",
    )
    e.add_argument("checkpoint", help="a step-N checkpoint, or a --checkpoint-dir (its newest)")
    e.add_argument("--out", required=True, metavar="DIR", help="the directory to write (must not exist or be empty)")
    return ap


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
    module, function = _DRIVERS[name]
    return getattr(importlib.import_module(module), function)


def _run(args) -> int:
    """Dispatch: ``planner plan`` is one cluster size, or a sweep over several (``--gpus 64,128``)."""
    name = args.command
    if name == "plan" and len(args.gpus) > 1:
        name = "sweep"
    if name in ("plan", "sweep", "tune"):  # one process per command: freezing imports is safe
        importlib.import_module("planner.frontend.model_analysis").FREEZE_IMPORTS = True
    return _driver(name)(args)


#: Every layer's bad-input error, by module and name: each becomes one paragraph on stderr and exit
#: status 2. (A checkpoint that fails while training is a failed run, exit 1, not bad input.)
_USER_ERROR_NAMES: tuple[tuple[str, str], ...] = (
    ("planner.frontend.frontend_errors", "ModelError"),  # planner.frontend
    ("passes.core", "PassError"),  # passes
    ("cost_models.hardware", "ProfileError"),  # cost_models
    ("planner.search.search_errors", "SearchError"),
    ("planner.search.search_errors", "NoFeasiblePlan"),
    ("planner.plan", "PlanError"),  # planner.plan
    ("codegen.codegen_errors", "CodegenError"),
    ("codegen.codegen_errors", "LoweringError"),
    ("codegen.codegen_errors", "UnsafeNameError"),
    ("codegen.codegen_errors", "TPRewriteError"),
    ("runtime.stages.compiled_stages", "CompiledError"),
    ("runtime.contract.input_errors", "DataError"),  # runtime
    ("planner.commands.calibrate", "CalibrationError"),
    ("planner.errors", "UserError"),
)


def user_errors(loaded_only: bool = True) -> tuple[type[BaseException], ...]:
    """The classes of ``_USER_ERROR_NAMES``. ``loaded_only``: those whose module is imported (a
    command can only raise an error of a module it imported, so ``main`` imports nothing more)."""
    out = []
    for module, name in _USER_ERROR_NAMES:
        mod = sys.modules.get(module) if loaded_only else importlib.import_module(module)
        if mod is not None:
            out.append(getattr(mod, name))
    return tuple(out)


def __getattr__(name: str) -> Any:
    if name == "USER_ERRORS":  # every error type, importing each layer (tests and tools use it)
        return user_errors(loaded_only=False)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except Exception as e:
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
    rc = main()
    gc.freeze()
    return rc


if __name__ == "__main__":
    sys.exit(console_main())
