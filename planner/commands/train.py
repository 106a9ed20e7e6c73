"""``planner train``: compile a plan, start one process per rank, train, report.

Local runs (``--nproc N``) spawn N processes with a gloo group on a free port; without
``--nproc`` the command expects torchrun's environment (``RANK``, ``WORLD_SIZE`` ...) so that
``torchrun --nnodes ... -m planner train plan.json`` trains on many nodes. Every rank rebuilds
the original model from the plan's spec and ``--seed`` (on CPU, fp32) and keeps only its shard,
so all plans of one model and seed start from the same weights; an ``hf:PATH`` directory with
safetensors weights starts from them instead, each rank reading only its shards' slices.

The training flags are the fields of ``runtime.training.train_config.TrainOptions`` that carry a ``CliFlag``;
``train_options_from_args`` reads them back into one. ``train_plan`` is the command without the
command line (``planner validate`` calls it with its own options); its ``on_step_start`` hook
(``runtime.training.trainer.StepHook``) runs on every rank before every step, the extension point the
fault-injection tests use (``tests/e2e/fault_hooks.py``).

At the end rank 0 prints where the step time went: each part of plan.json's ``predicted.time``
beside the median measured over the steps after the first two (``runtime.timing`` measures them;
the metrics lines hold every step's). ``--tensorboard DIR`` needs the optional tensorboard
package, checked before any process starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from rich.console import Console, JustifyMethod
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from planner.commands.calibrate_common import physical_memory
from planner.commands.compile import compile_plan
from planner.commands.elastic import Replan, plan_for_world
from planner.errors import UserError
from planner.frontend.bundle import parse_spec
from planner.frontend.checkpoint import check_weights, directory_state
from planner.frontend.hf import hf_directory
from planner.frontend.zoo import ModelSizes, build_model
from planner.plan import TIME_KEYS, Plan, load_plan, output_problem
from planner.units import format_bytes, format_seconds
from runtime.checkpointing.checkpoint_io import CheckpointError, read_meta
from runtime.contract.choices import OffloadTier, Toggle
from runtime.contract.data_roles import LEGACY_INPUTS
from runtime.contract.input_errors import ConfigError
from runtime.contract.overlap import Overlap
from runtime.data_parallel.offload_engine import OffloadConfig, OffloadError
from runtime.distributed.launch import LaunchError, init_distributed, launch_local, shutdown
from runtime.stages.compiled_stages import read_manifest
from runtime.training.data import TokenFile, data_vocab
from runtime.training.saving import resume_point
from runtime.training.train_config import TrainOptions, cli_flags
from runtime.training.trainer import StepHook, StepMetrics, compression_of, schedule_of, train_worker

__all__ = [
    "run_train",
    "train_plan",
    "original_state",
    "compile_for_training",
    "train_options_from_args",
    "WARMUP_STEPS",
    "median_breakdown",
    "breakdown_table",
]

#: Steps left out of the measured medians (first-touch allocations, lazy initialization).
WARMUP_STEPS = 2


def original_state(spec: str, sizes: dict, seq_len: int, seed: int) -> Mapping[str, torch.Tensor]:
    """The original model's parameters and buffers (fp32, CPU) for ``seed``, by original name.

    For an ``hf:PATH`` directory with safetensors weights, a lazy mapping over its files instead
    (``planner.frontend.checkpoint.DirectoryWeights``): ``runtime.stages.compiled_stages.load_weights`` reads
    only the tensors of this rank's stage, and of a tensor-parallel shard only its rows/columns.
    """
    kind, name = parse_spec(spec)
    directory = hf_directory(name) if kind == "hf" else None
    if directory is not None:
        state = directory_state(directory, sizes)
        if state is not None:
            return state
    model = build_model(spec, ModelSizes(**sizes), seed=seed).model
    # remove_duplicate=False: a tied weight appears under every name the graph may use.
    state = {n: param.detach() for n, param in model.named_parameters(remove_duplicate=False)}
    state.update({n: buffer for n, buffer in model.named_buffers(remove_duplicate=False)})
    return state


def compile_for_training(plan: Plan, plan_path: str, out: str | None) -> str:
    """Compile ``plan`` into ``out`` (default: ``plan.compiled`` beside the plan file); the folder."""
    out = out or os.path.splitext(os.path.abspath(plan_path))[0] + ".compiled"
    compile_plan(plan, out)
    return out


def train_options_from_args(args) -> TrainOptions:
    """The ``TrainOptions`` of parsed ``planner train`` flags: each flagged field from its flag
    (``CliFlag.setting``), the others at their defaults. An out-of-range value is a ``UserError``."""
    values = {f.name: flag.setting(getattr(args, flag.dest)) for f, flag in cli_flags(TrainOptions)}
    try:
        return TrainOptions(**values)
    except ConfigError as e:
        raise UserError(str(e)) from None


def median_breakdown(times: Sequence[Mapping[str, float]]) -> tuple[dict[str, float], int]:
    """The median seconds of each part over the steps after the first ``WARMUP_STEPS`` (over all
    of them when there are no more), and how many steps that was. ``times`` are the metrics
    lines' ``time`` objects, in step order."""
    rows = list(times[WARMUP_STEPS:]) or list(times)
    keys = list(rows[0]) if rows else []
    return {k: statistics.median(float(row[k]) for row in rows) for k in keys}, len(rows)


def breakdown_table(
    predicted: Mapping[str, float], measured: Mapping[str, float], title: str, caption: str | None = None
) -> Table:
    """Part (the ``time`` key: ``planner.plan.TIME_LABELS`` says what each is), predicted,
    measured, measured / predicted: one row per ``predicted.time`` key (and any part only
    measured), then their sums."""
    table = Table(title=title, caption=caption)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("part", "left"),
        ("predicted", "right"),
        ("measured", "right"),
        ("measured/predicted", "right"),
    )
    for column, justify in columns:
        table.add_column(column, justify=justify)
    keys = list(TIME_KEYS) + [k for k in list(predicted) + list(measured) if k not in TIME_KEYS]
    for k in dict.fromkeys(keys):
        predicted_s, measured_s = predicted.get(k), measured.get(k)
        table.add_row(k, _seconds(predicted_s), _seconds(measured_s), _ratio(predicted_s, measured_s))
    predicted_s, measured_s = sum(predicted.values()), sum(measured.values())
    table.add_row(
        "step (sum)", _seconds(predicted_s), _seconds(measured_s), _ratio(predicted_s, measured_s), style="bold"
    )
    return table


def _seconds(seconds: float | None) -> str:
    return "-" if seconds is None else format_seconds(seconds)


def _ratio(predicted: float | None, measured: float | None) -> str:
    return f"{measured / predicted:.2f}" if predicted and measured is not None else "-"


@dataclass(frozen=True)
class _WorkerJob:
    """What every rank needs to train a plan (picklable: sent to each spawned process)."""

    compiled: str
    """The compiled plan's folder."""
    opts: TrainOptions
    """The training options."""
    spec: str
    """The model spec (each rank rebuilds the original model from it)."""
    sizes: dict
    """The plan's model size overrides."""
    seq_len: int
    """The plan's sequence length."""
    on_step_start: StepHook | None
    """Runs on every rank before every step (``runtime.training.trainer.StepHook``)."""
    predicted_time: dict[str, float] | None = None
    """plan.json's ``predicted.time`` of the run (a compressed plan's warm-up when the run ends
    inside it, ``Plan.time_of_run``), printed beside the measured breakdown."""
    restart_note: dict | None = None
    """The re-plan event to write with the first step (``elastic_note``); None when not re-planned."""
    in_warmup: bool = False
    """The run ends inside a compressed plan's full-precision warm-up (``Plan.in_warmup``)."""
    overlap_note: str = ""
    """What the run overlaps unlike the plan's price (``overlap_mismatch``; empty when alike)."""


def _worker(rank: int, world: int, job: _WorkerJob) -> None:
    """One rank: train, with a progress bar and a summary on rank 0 when ``opts.progress``: the
    last loss, mean throughput, peak memory and the time breakdown beside ``predicted_time``."""
    opts = job.opts
    show = rank == 0 and opts.progress
    reporter = _Reporter(opts.steps) if show else None
    try:
        history = train_worker(
            rank,
            world,
            job.compiled,
            opts,
            lambda: original_state(job.spec, job.sizes, job.seq_len, opts.seed),
            on_metrics=reporter.update if reporter else None,
            on_step_start=job.on_step_start,
            restart_note=job.restart_note,
        )
    finally:
        if reporter:
            reporter.close()
    if show and history:
        _print_summary(history, opts, job.predicted_time, job.in_warmup, job.overlap_note)


def overlap_mismatch(priced: Mapping[str, bool], run: Overlap) -> str:
    """A caption when a run overlaps other traffic than its plan's price assumed (plan.json
    ``overlap`` against ``--overlap``): its communication parts then differ from the prediction
    by design, and how to compare like with like. Empty when they agree."""
    ran = run.to_json()
    if dict(priced) == ran:
        return ""

    def kinds(flags: Mapping[str, bool]) -> str:
        return (", ".join(kind for kind, on in flags.items() if on) or "no") + " traffic"

    toggle = "on" if any(ran.values()) else "off"
    return (
        f"the prediction assumed {kinds(priced)} overlapped, this run overlapped {kinds(ran)} "
        f"(--overlap {toggle}): its communication parts differ by design; plan with --overlap {toggle} to "
        "compare like with like"
    )


def _print_summary(
    history: Sequence[StepMetrics],
    opts: TrainOptions,
    predicted_time: dict[str, float] | None,
    in_warmup: bool = False,
    overlap_note: str = "",
) -> None:
    """Rank 0's closing lines: last loss, mean throughput, peak memory and the time breakdown."""
    last = history[-1]
    peak = (
        f"peak {last.peak_memory_bytes / 2**20:.1f} MiB per device"
        if opts.track_memory
        else "memory not tracked (--no-memory-tracking)"
    )
    print(
        f"done: {len(history)} steps, final loss {last.loss:.4f}, "
        f"{sum(h.tokens_per_s for h in history) / len(history):,.0f} tokens/s, {peak}",
        flush=True,
    )
    for event in (event for h in history for event in h.events):  # a re-plan, a recovery
        print(f"{event['kind']}: {event['message']}", flush=True)
    saves = [h.checkpoint_s for h in history if h.checkpoint_s > 0]
    if saves:
        mode = "asynchronous" if opts.async_checkpoint == Toggle.ON else "synchronous"
        print(
            f"checkpointing ({mode}): the steps waited {format_seconds(sum(saves))} in all for {len(saves)} saves "
            f"(mean {format_seconds(sum(saves) / len(saves))}; training steps took "
            f"{format_seconds(sum(h.step_time_s for h in history))})",
            flush=True,
        )
    measured, n = median_breakdown([h.time for h in history if h.time is not None])
    if measured:
        caption = f"measured: median of the {'last ' if len(history) > WARMUP_STEPS else ''}{n} steps"
        if in_warmup:
            caption += "; predicted: 1-bit Adam's full-precision warm-up, which these steps ran"
        if opts.track_memory and opts.memory_steps is None:
            caption += (
                ", under live-tensor tracking, which slows every operator (--no-memory-tracking times the run as it is)"
            )
        if overlap_note:
            caption += f"; {overlap_note}"
        Console().print(breakdown_table(predicted_time or {}, measured, "step time by part", caption))


class _Reporter:
    """A rich progress bar with step, loss, tokens/s and memory (rank 0)."""

    def __init__(self, steps: int):
        self.progress = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            transient=False,
            disable=not sys.stdout.isatty(),
        )
        self.task = self.progress.add_task("train", total=steps, info="")
        self.progress.start()
        self.tty = sys.stdout.isatty()

    def update(self, metrics: StepMetrics) -> None:
        mem = f"mem {metrics.peak_memory_bytes / 2**20:.1f} MiB  " if metrics.peak_memory_bytes else ""
        info = f"loss {metrics.loss:.4f}  {metrics.tokens_per_s:,.0f} tok/s  {mem}lr {metrics.lr:.2e}"
        self.progress.update(self.task, completed=metrics.step, info=info)
        if not self.tty:
            print(f"step {metrics.step}: {info}", flush=True)

    def close(self) -> None:
        self.progress.stop()


def _check_resumable(plan: Plan, opts: TrainOptions) -> bool:
    """Refuse, before any process starts, a checkpoint that belongs to another model; say when
    the run is already done (returns False: nothing to train) or its schedule changes."""
    if opts.checkpoint_dir is None and opts.snapshot_dir is None:
        raise UserError("--resume needs --checkpoint-dir DIR (where the checkpoints are) or --snapshot-dir DIR.")
    point = resume_point(opts)
    if point is None:
        where = " or ".join(d for d in (opts.checkpoint_dir, opts.snapshot_dir) if d)
        print(f"planner train: no checkpoint in {where}; starting from step 0.", file=sys.stderr)
        return True
    step, path, _ = point
    try:
        meta = read_meta(path)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    model = meta.get("model", {})
    old_sizes, new_sizes = model.get("sizes") or {}, plan.model.sizes
    if (
        model.get("spec") == plan.model.spec
        and old_sizes != new_sizes
        and {k: v for k, v in old_sizes.items() if k != "seq_len"}
        == {k: v for k, v in new_sizes.items() if k != "seq_len"}
    ):
        raise UserError(
            f"checkpoint {path} holds a model with {old_sizes.get('seq_len')} positions "
            f"(planned with --seq-len {old_sizes.get('seq_len')}); this plan's has "
            f"{new_sizes.get('seq_len')}. Re-plan with --seq-len {old_sizes.get('seq_len')} "
            "to resume it, or start without --resume."
        )
    if model.get("spec") != plan.model.spec or model.get("sizes") != plan.model.sizes:
        raise UserError(
            f"checkpoint {path} is from model {model.get('spec')!r} {model.get('sizes')}, but "
            f"{plan.model.spec!r} {plan.model.sizes} is being trained; use that model's "
            "--checkpoint-dir or start without --resume."
        )
    if step >= opts.steps:
        print(
            f"planner train: the newest checkpoint ({path}) is at step {step}, already at or past "
            f"--steps {opts.steps}; nothing to train (raise --steps to continue).",
            file=sys.stderr,
        )
        return False
    old = meta.get("schedule")
    new = schedule_of(opts)
    if old and old != new:
        changed = ", ".join(f"{k} {old.get(k)} -> {v}" for k, v in new.items() if old.get(k) != v)
        print(
            f"planner train: note: the learning-rate schedule differs from the checkpointed run's "
            f"({changed}); from step {step + 1} on, losses follow the new schedule, not the old run's.",
            file=sys.stderr,
        )
    return True


def run_train(args, *, on_step_start: StepHook | None = None) -> int:
    """``planner train plan.json --steps K ...``: the flags as ``TrainOptions``, then ``train_plan``
    (with ``--elastic``, of the plan re-made for the world found: ``elastic_plan``)."""
    plan = load_plan(args.plan)
    opts = train_options_from_args(args)
    plan_path, compiled, note = args.plan, args.compiled, None
    if opts.elastic:
        replan = elastic_plan(plan, args.plan, opts, args.nproc)
        if replan is not None:
            step = _resume_step(opts)
            note = {"kind": "replan", "message": replan.message(step), "fields": replan.fields(step)}
            plan, plan_path = replan.plan, replan.path
            compiled = f"{compiled.rstrip(os.sep)}.world{_world_of(plan)}" if compiled else None
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"planner train: {note['message']} (plan {plan_path}).", flush=True)
    return train_plan(
        plan, plan_path, opts, nproc=args.nproc, compiled=compiled, on_step_start=on_step_start, restart_note=note
    )


def _world_of(plan: Plan) -> int:
    return plan.dp * plan.cp * plan.tp * plan.pp


def _resume_step(opts: TrainOptions) -> int:
    """The step a run with these options starts at: the newest complete checkpoint's or snapshot's
    with ``--resume``, else 0."""
    point = resume_point(opts) if opts.resume else None
    return point[0] if point is not None else 0


def elastic_plan(plan: Plan, plan_path: str, opts: TrainOptions, nproc: int | None) -> Replan | None:
    """``--elastic``: the plan re-made for the world found (``--nproc``, else torchrun's
    ``WORLD_SIZE``, else 1) when it differs from ``plan``'s; None when it does not. Under torchrun
    only rank 0 plans (and writes the plan file); it sends the plan, or its error, to every rank
    over the default process group, which this starts (``init_distributed`` is idempotent)."""
    world = nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world == _world_of(plan):
        return None
    if nproc is not None or "RANK" not in os.environ:
        return plan_for_world(plan, plan_path, world)
    init_distributed(timeout_s=opts.timeout_s)
    payload: list = [None]
    if dist.get_rank() == 0:
        try:
            replan = plan_for_world(plan, plan_path, world)
            payload[0] = ("plan", replan.plan.to_dict(), replan.path, replan.dropped)
        except UserError as e:
            payload[0] = ("error", str(e))
    dist.broadcast_object_list(payload, src=0)
    if payload[0][0] == "error":
        raise UserError(payload[0][1])
    _, data, path, dropped = payload[0]
    return Replan(plan=Plan.from_dict(data), path=path, old=plan, dropped=dropped)


def _tensorboard_installed() -> bool:
    """Whether ``--tensorboard`` can work: the optional tensorboard package is importable."""
    return importlib.util.find_spec("tensorboard") is not None


def _check_offload(plan: Plan, opts: TrainOptions) -> None:
    """Where the plan keeps optimizer state and parameters must work with these flags: bad input
    (exit 2) before any process starts, not a failed run."""
    try:
        OffloadConfig.from_plan({"zero_stage": plan.zero_stage, "offload": plan.offload}, opts.nvme_path)
    except OffloadError as e:
        raise UserError(str(e)) from None
    if opts.delayed_update and plan.offload["optimizer"] == OffloadTier.NONE:
        raise UserError(
            "--delayed-update overlaps the optimizer step on the host with the next step, so it "
            "needs a plan that offloads the optimizer (plan with --offload-optimizer cpu|nvme)."
        )


def train_plan(
    plan: Plan,
    plan_path: str,
    opts: TrainOptions,
    *,
    nproc: int | None = None,
    compiled: str | None = None,
    on_step_start: StepHook | None = None,
    restart_note: dict | None = None,
) -> int:
    """Compile ``plan`` (read from ``plan_path``) into ``compiled`` and train it with ``opts`` on
    ``nproc`` local processes, or under torchrun's environment when ``nproc`` is None. Exit status:
    0 done (or nothing left to train), 1 the run failed (the reason on stderr); bad input raises
    ``UserError``. ``on_step_start`` must be picklable for local runs (it is sent to every rank).
    ``restart_note``: the re-plan event the first step reports (``run_train``)."""
    world = _world_of(plan)
    if nproc is not None:
        _check_nproc(plan, plan_path, nproc, world)
        _check_host_memory(plan, plan_path, nproc, physical_memory())
    if not _check_before_start(plan, opts):
        return 0
    compiled = compile_for_training(plan, plan_path, compiled)
    _check_data(plan, opts, compiled)
    job = _WorkerJob(
        compiled,
        opts,
        plan.model.spec,
        dict(plan.model.sizes),
        plan.seq_len,
        on_step_start,
        plan.time_of_run(opts.steps),
        restart_note,
        plan.in_warmup(opts.steps),
        overlap_mismatch(plan.overlap, opts.overlap_settings),
    )
    if nproc is not None:
        return _train_local(plan, plan_path, job, nproc, world)
    _train_under_torchrun(plan_path, job, world)
    return 0


def _check_before_start(plan: Plan, opts: TrainOptions) -> bool:
    """Bad input (exit 2) before any process starts; False when a resumed run has nothing left."""
    if opts.resume and not (opts.checkpoint_dir or opts.snapshot_dir):
        raise UserError("--resume needs --checkpoint-dir DIR (where the checkpoints are) or --snapshot-dir DIR.")
    if opts.save_every and not opts.checkpoint_dir:
        raise UserError("--save-every needs --checkpoint-dir DIR.")
    _check_snapshots(opts)
    _check_outputs(opts)
    if opts.resume and not _check_resumable(plan, opts):
        return False
    kind, name = parse_spec(plan.model.spec)
    if kind == "hf" and hf_directory(name) is not None:  # bad weights: exit 2 before any process starts
        check_weights(name, dict(plan.model.sizes))
    _check_offload(plan, opts)
    try:  # the warm-up the plan's compression will run with (--compression-warmup or the plan's)
        compression_of(plan.to_dict(), opts)
    except ConfigError as e:
        raise UserError(str(e)) from None
    if opts.tensorboard_dir and not _tensorboard_installed():
        raise UserError(
            "--tensorboard needs the tensorboard package, which is not installed: "
            "pip install tensorboard (or pip install 'planner[tensorboard]')."
        )
    return True


def _check_snapshots(opts: TrainOptions) -> None:
    """``--snapshot-dir`` needs ``--snapshot-every`` and a folder of its own (each folder keeps
    its own number of complete checkpoints)."""
    if opts.snapshot_dir and not opts.snapshot_every:
        raise UserError("--snapshot-dir needs --snapshot-every N (how often a snapshot is taken).")
    if (
        opts.snapshot_dir
        and opts.checkpoint_dir
        and os.path.abspath(opts.snapshot_dir) == os.path.abspath(opts.checkpoint_dir)
    ):
        raise UserError(
            "--snapshot-dir must differ from --checkpoint-dir: snapshots keep only the newest one, "
            "which would delete the checkpoints."
        )


def _check_outputs(opts: TrainOptions) -> None:
    """Where the run writes must be writable before it starts: ``--metrics`` a file;
    ``--checkpoint-dir``, ``--snapshot-dir`` and ``--tensorboard`` folders (created when missing)."""
    outputs = (
        ("--metrics", opts.metrics_path, False, "the path of a file to write, such as metrics.jsonl"),
        ("--checkpoint-dir", opts.checkpoint_dir, True, "a folder path (created when missing)"),
        ("--snapshot-dir", opts.snapshot_dir, True, "a folder path (created when missing)"),
        ("--tensorboard", opts.tensorboard_dir, True, "a folder path (created when missing)"),
    )
    for flag, path, folder, wanted in outputs:
        problem = output_problem(path, folder=folder) if path else None
        if problem is not None:
            raise UserError(f"{flag} {path} {problem}; give {wanted}.")


def _fresh_metrics(opts: TrainOptions) -> None:
    """Right before the ranks start, once every check passed: a run from step 0 starts its metrics
    file anew (a resumed run appends to it); the file's folder is created when missing."""
    if not opts.metrics_path:
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(opts.metrics_path)), exist_ok=True)
        if not opts.resume:
            with contextlib.suppress(FileNotFoundError):  # another local rank under torchrun removed it
                os.remove(opts.metrics_path)
    except OSError as e:
        raise UserError(f"--metrics {opts.metrics_path}: cannot start the metrics file ({e.strerror or e}).") from None


def _sentence(text: str) -> str:
    """``text`` as one sentence: stripped, with a closing full stop when it has none."""
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def _check_data(plan: Plan, opts: TrainOptions, compiled: str) -> None:
    """A ``--data`` token file must fit the model's vocabulary: fail fast, before any process starts."""
    if opts.data_path is not None:
        TokenFile(
            opts.data_path,
            plan.seq_len,
            vocab=data_vocab(plan.model.inputs or LEGACY_INPUTS, read_manifest(compiled)["model"]["vocab"]),
        )


def _check_nproc(plan: Plan, plan_path: str, nproc: int, world: int) -> None:
    """``--nproc`` must start as many processes as the plan has ranks: bad input before anything runs."""
    if nproc != world:
        degrees = (
            f"dp*tp*pp = {plan.dp}*{plan.tp}*{plan.pp}"
            if plan.cp == 1
            else f"dp*cp*tp*pp = {plan.dp}*{plan.cp}*{plan.tp}*{plan.pp}"
        )
        raise UserError(
            f"{plan_path} needs {degrees} = {world} processes, "
            f"but --nproc is {nproc}. Use --nproc {world} or re-plan with --gpus {nproc}."
        )


def _train_local(plan: Plan, plan_path: str, job: _WorkerJob, nproc: int, world: int) -> int:
    """Spawn ``nproc`` local processes (one per rank) and train; 1 when the run failed."""
    _check_nproc(plan, plan_path, nproc, world)
    _fresh_metrics(job.opts)
    try:
        launch_local(
            _worker,
            nproc,
            (job,),
            timeout_s=max(600.0, 60.0 * job.opts.steps),
            collective_timeout_s=job.opts.timeout_s,
        )
    except LaunchError as e:
        hints = _dtype_hint(plan, str(e)) + _killed_hint(plan, str(e))
        print(f"planner train: training failed: {_sentence(str(e))}{hints}", file=sys.stderr)
        return 1
    return 0


def _check_host_memory(plan: Plan, plan_path: str, nproc: int, memory: int | None) -> None:
    """Local CPU ranks share the host's memory: a plan whose predicted peak (its host offload
    with it) times ``nproc`` exceeds ``memory`` would have its ranks killed by the kernel's
    out-of-memory killer minutes in, and the run would say only that a rank was lost (a plan
    made for an 80 GB GPU, trained here to try it). Bad input instead, before anything starts.
    GPU ranks each have a device of their own: not checked here."""
    if memory is None or torch.cuda.is_available():
        return
    per_rank = plan.predicted.peak_memory_bytes + plan.predicted.memory.get("host", 0)
    if per_rank * nproc <= memory:
        return
    raise UserError(
        f"{plan_path} predicts {format_bytes(per_rank)} per device at its peak (planned for "
        f"{plan.hardware.name}), and its {nproc} local processes share this machine's "
        f"{format_bytes(memory)} of memory: {format_bytes(per_rank * nproc)} in all, more than there is, "
        "so the out-of-memory killer would stop the run. Train it on the machines it was planned "
        "for, or plan for this one (--hardware cpu, or a profile from `planner calibrate`)."
    )


def _killed_hint(plan: Plan, error: str) -> str:
    """What a rank killed by SIGKILL most often means: the kernel's out-of-memory killer."""
    if "SIGKILL" not in error:
        return ""
    return (
        " SIGKILL most often comes from the out-of-memory killer: the plan predicts "
        f"{format_bytes(plan.predicted.peak_memory_bytes)} per device at its peak; check the "
        "memory free for every local process (or `dmesg`)."
    )


def _dtype_hint(plan: Plan, error: str) -> str:
    """What to do when a rank failed on two dtypes meeting in one operation under a 16-bit plan:
    the runtime computes every layer in the plan's dtype, and a model that keeps some modules in
    fp32 (transformers' ``_keep_in_fp32_modules``, Inkling-2's convolutions) casts its activations
    to fp32 before them."""
    if plan.dtype == "fp32" or not re.search(r"same dtype|dtype mismatch|expected .*dtype", error):
        return ""
    return (
        f" The plan computes every layer in {plan.dtype}; a model that keeps some layers in fp32 "
        "mixes the two: plan with --dtype fp32."
    )


def _train_under_torchrun(plan_path: str, job: _WorkerJob, world: int) -> None:
    """Train this process's rank under torchrun's environment (a single process sets up its own)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if world != 1:
            raise UserError(
                f"{plan_path} needs {world} processes: pass --nproc {world}, or launch under "
                f"torchrun (torchrun --nproc-per-node ... -m planner train {plan_path} ...)."
            )
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        # One process meets only itself: an in-process store, no port to find or to lose.
        store = dist.HashStore()
    else:
        store = None
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world:
        raise UserError(f"{plan_path} needs {world} processes (dp*cp*tp*pp), but torchrun started {env_world}.")
    _fresh_metrics(job.opts)
    ctx = init_distributed(timeout_s=job.opts.timeout_s, store=store)
    try:
        _worker(ctx.rank, ctx.world_size, job)
    finally:
        shutdown()
