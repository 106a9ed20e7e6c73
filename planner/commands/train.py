"""``planner train``: compile a plan, start one process per rank, train, report.

Local runs (``--nproc N``) spawn N processes with a gloo group on a free port; without
``--nproc`` the command expects torchrun's environment (``RANK``, ``WORLD_SIZE`` ...) so that
``torchrun --nnodes ... -m planner train plan.json`` trains on many nodes. Every rank rebuilds
the original model from the plan's spec and ``--seed`` (on CPU, fp32) and keeps only its shard,
so all plans of one model and seed start from the same weights.
"""

from __future__ import annotations

import os
import sys

import torch

from planner.errors import UserError
from planner.plan import Plan, load_plan

__all__ = ["run_train", "original_state", "compile_for_training", "train_options_from_args"]


def original_state(spec: str, sizes: dict, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """The original model's parameters and buffers (fp32, CPU) for ``seed``, by original name."""
    from planner.frontend.zoo import build_model

    b = build_model(spec, seed=seed, **sizes)
    # remove_duplicate=False: a tied weight appears under every name the graph may use.
    state = {n: p.detach() for n, p in b.model.named_parameters(remove_duplicate=False)}
    state.update({n: t for n, t in b.model.named_buffers(remove_duplicate=False)})
    return state


def compile_for_training(plan: Plan, plan_path: str, out: str | None) -> str:
    from planner.commands.compile import compile_plan

    out = out or os.path.splitext(os.path.abspath(plan_path))[0] + ".compiled"
    compile_plan(plan, out)
    return out


def train_options_from_args(args):
    from runtime.trainer import TrainOptions

    return TrainOptions(
        steps=args.steps, lr=args.lr, min_lr=min(args.min_lr, args.lr), warmup_steps=args.warmup,
        weight_decay=args.weight_decay, eps=getattr(args, "adam_eps", 1e-8), max_grad_norm=args.clip if args.clip > 0 else None,
        seed=args.seed, data_path=args.data, metrics_path=args.metrics,
        checkpoint_dir=args.checkpoint_dir, save_every=args.save_every, keep_last=args.keep_last,
        resume=args.resume, timeout_s=args.timeout, track_memory=not args.no_memory_tracking,
        memory_steps=getattr(args, "memory_steps", None),
    )


def _worker(rank: int, world: int, compiled: str, opts, spec: str, sizes: dict, seq_len: int,
            show: bool) -> None:
    from runtime.trainer import train_worker

    reporter = _Reporter(opts.steps) if (rank == 0 and show) else None
    try:
        hist = train_worker(rank, world, compiled, opts,
                            lambda: original_state(spec, sizes, seq_len, opts.seed),
                            on_metrics=reporter.update if reporter else None)
    finally:
        if reporter:
            reporter.close()
    if rank == 0 and show and hist:
        last = hist[-1]
        print(f"done: {len(hist)} steps, final loss {last.loss:.4f}, "
              f"{sum(h.tokens_per_s for h in hist) / len(hist):,.0f} tokens/s, "
              f"peak {last.peak_memory_bytes / 2**20:.1f} MiB per device", flush=True)


class _Reporter:
    """A rich progress bar with step, loss, tokens/s and memory (rank 0)."""

    def __init__(self, steps: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                 transient=False, disable=not sys.stdout.isatty())
        self.task = self.progress.add_task("train", total=steps, info="")
        self.progress.start()
        self.tty = sys.stdout.isatty()

    def update(self, m) -> None:
        info = (f"loss {m.loss:.4f}  {m.tokens_per_s:,.0f} tok/s  "
                f"mem {m.peak_memory_bytes / 2**20:.1f} MiB  lr {m.lr:.2e}")
        self.progress.update(self.task, completed=m.step, info=info)
        if not self.tty:
            print(f"step {m.step}: {info}", flush=True)

    def close(self) -> None:
        self.progress.stop()


def _check_resumable(plan: Plan, directory: str, args) -> bool:
    """Refuse, before any process starts, a checkpoint that belongs to another model; say when
    the run is already done (returns False: nothing to train) or its schedule changes."""
    from runtime.checkpoint_io import CheckpointError, list_checkpoints, read_meta
    from runtime.trainer import schedule_of

    found = list_checkpoints(directory)
    if not found:
        print(f"planner train: no checkpoint in {directory}; starting from step 0.", file=sys.stderr)
        return True
    step, path = found[-1]
    try:
        meta = read_meta(path)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    model = meta.get("model", {})
    old_sizes, new_sizes = model.get("sizes") or {}, plan.model.sizes
    if (model.get("spec") == plan.model.spec and old_sizes != new_sizes
            and {k: v for k, v in old_sizes.items() if k != "seq_len"}
            == {k: v for k, v in new_sizes.items() if k != "seq_len"}):
        raise UserError(f"checkpoint {path} holds a model with {old_sizes.get('seq_len')} positions "
                        f"(planned with --seq-len {old_sizes.get('seq_len')}); this plan's has "
                        f"{new_sizes.get('seq_len')}. Re-plan with --seq-len {old_sizes.get('seq_len')} "
                        "to resume it, or start without --resume.")
    if model.get("spec") != plan.model.spec or model.get("sizes") != plan.model.sizes:
        raise UserError(f"checkpoint {path} is from model {model.get('spec')!r} {model.get('sizes')}, but "
                        f"{plan.model.spec!r} {plan.model.sizes} is being trained; use that model's "
                        "--checkpoint-dir or start without --resume.")
    if step >= args.steps:
        print(f"planner train: the newest checkpoint ({path}) is at step {step}, already at or past "
              f"--steps {args.steps}; nothing to train (raise --steps to continue).", file=sys.stderr)
        return False
    old = meta.get("schedule")
    new = schedule_of(train_options_from_args(args))
    if old and old != new:
        changed = ", ".join(f"{k} {old.get(k)} -> {v}" for k, v in new.items() if old.get(k) != v)
        print(f"planner train: note: the learning-rate schedule differs from the checkpointed run's "
              f"({changed}); from step {step + 1} on, losses follow the new schedule, not the old run's.",
              file=sys.stderr)
    return True



def run_train(args) -> int:
    from runtime.dist import LaunchError, init_distributed, launch_local, shutdown

    plan = load_plan(args.plan)
    world = plan.dp * plan.tp * plan.pp
    if args.resume and not args.checkpoint_dir:
        raise UserError("--resume needs --checkpoint-dir DIR (where the checkpoints are).")
    if args.save_every and not args.checkpoint_dir:
        raise UserError("--save-every needs --checkpoint-dir DIR.")
    if args.resume and not _check_resumable(plan, args.checkpoint_dir, args):
        return 0
    compiled = compile_for_training(plan, args.plan, getattr(args, "compiled", None))
    if args.data is not None:  # fail fast, before any process starts
        from runtime.compiled import read_manifest
        from runtime.data import TokenFile

        TokenFile(args.data, plan.seq_len, vocab=read_manifest(compiled)["model"]["vocab"])
    opts = train_options_from_args(args)
    if args.metrics and not args.resume and os.path.exists(args.metrics):
        os.remove(args.metrics)
    sizes = dict(plan.model.sizes)
    worker_args = (compiled, opts, plan.model.spec, sizes, plan.seq_len, not getattr(args, "quiet", False))
    if args.nproc is not None:
        if args.nproc != world:
            raise UserError(f"{args.plan} needs dp*tp*pp = {plan.dp}*{plan.tp}*{plan.pp} = {world} processes, "
                            f"but --nproc is {args.nproc}. Use --nproc {world} or re-plan with --gpus {args.nproc}.")
        try:
            launch_local(_worker, args.nproc, worker_args, timeout_s=max(600.0, 60.0 * args.steps),
                         collective_timeout_s=args.timeout)
        except LaunchError as e:
            print(f"planner train: training failed: {e}", file=sys.stderr)
            return 1
        return 0
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if world != 1:
            raise UserError(f"{args.plan} needs {world} processes: pass --nproc {world}, or launch under "
                            f"torchrun (torchrun --nproc-per-node ... -m planner train {args.plan} ...).")
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_PORT", str(__import__("runtime.dist").dist.free_port()))
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world:
        raise UserError(f"{args.plan} needs {world} processes (dp*tp*pp), but torchrun started {env_world}.")
    ctx = init_distributed(timeout_s=args.timeout)
    try:
        _worker(ctx.rank, ctx.world_size, *worker_args)
    finally:
        shutdown()
    return 0
