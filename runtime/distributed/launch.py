"""Process-group set-up and local multi-process launch.

``init_distributed`` joins a process group either from torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) or from explicit arguments passed by
``launch_local``, whose ranks meet at a store the launcher itself serves for the run. The
backend is nccl when the process owns a CUDA device, gloo otherwise. Every collective gets
``timeout`` seconds: a rank that dies or stops answering makes the others fail with an error
instead of hanging.

Local ranks start from a fork server (multiprocessing's ``forkserver``) that imported torch and
the trainer once, the first time this process launched ranks: each later launch forks ready
processes, where spawning made every rank import torch again. The ranks run in the launcher's
environment at the time of the launch (the fork server's own is the one it started with, so
``launch_local`` hands each rank its environment and its current standard output and error, which
a caller may have redirected since). ``PLANNER_START_METHOD=spawn`` restores spawning; platforms
without a fork server (Windows) spawn.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import multiprocessing
import multiprocessing.reduction
import os
import platform
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.contract import environment

#: How many times this process has joined a default process group (``init_distributed``).
_JOINS = 0

#: Timeout of every collective; sub-groups (runtime.distributed.mesh) are created with it too, because
#: ``new_group`` would otherwise fall back to torch's 30-minute default.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)

__all__ = [
    "DistContext",
    "init_distributed",
    "shutdown",
    "free_port",
    "launch_local",
    "LaunchError",
    "reuse_host_memory",
    "start_method",
]

#: What the fork server imports once, before it forks any rank (module docstring).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "runtime.training.trainer"]


def start_method() -> str:
    """How ``launch_local`` starts ranks: ``forkserver`` where the platform has one, else
    ``spawn``; ``PLANNER_START_METHOD`` overrides."""
    chosen = environment.read(environment.START_METHOD)
    if chosen:
        if chosen not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"PLANNER_START_METHOD={chosen!r} is not one of this platform's start methods "
                f"({', '.join(multiprocessing.get_all_start_methods())})"
            )
        return chosen
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_host_memory_tuned = False


def reuse_host_memory() -> bool:
    """Keep freed CPU memory in the process heap so the next step reuses it; True if applied.

    glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh
    ``mmap`` and returns it on free, so each training step faults in, page by page, memory the
    kernel must zero first: a language model's logits, a matmul's output, its gradient. On a CPU
    rank that costs as much as the arithmetic on those tensors. Allocating from the heap
    only (``M_MMAP_MAX = 0``) and never trimming it below 2 GiB (``M_TRIM_THRESHOLD``) makes
    steady-state steps fault-free, as a caching allocator does on a GPU; the process keeps its
    peak heap. Applied once per process, on glibc only, unless ``PLANNER_HOST_ALLOCATOR=system``
    asks for glibc's defaults (or jemalloc/tcmalloc is preloaded, which already cache).
    """
    global _host_memory_tuned
    if _host_memory_tuned:
        return True
    if environment.read(environment.HOST_ALLOCATOR).lower() == "system":
        return False
    if any(allocator in os.environ.get("LD_PRELOAD", "") for allocator in ("jemalloc", "tcmalloc", "mimalloc")):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        applied = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return False
    _host_memory_tuned = applied
    return applied


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the world."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank within this node (selects the CUDA device)."""
    device: torch.device
    """Device this rank computes on."""
    backend: str
    """``gloo`` or ``nccl``."""


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    master_port: int | None = None,
    timeout_s: float = 300.0,
    backend: str | None = None,
    store: Any = None,
) -> DistContext:
    """Join (or create) the default process group; idempotent. ``store``: a rendezvous store to
    join through (``launch_local``'s ranks) instead of the ``env://`` one rank 0 would create."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    os.environ.setdefault("MASTER_PORT", "29500")
    use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
    if backend is None:
        backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        reuse_host_memory()
    global COLLECTIVE_TIMEOUT
    COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        global _JOINS
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs: dict[str, Any] = {}
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if store is not None:
            kwargs["store"] = dist.PrefixStore(f"planner/join-{_JOINS}", store)
        elif _JOINS or restart:
            # This process joined a group before (``planner tune`` runs its trials one after
            # another in torchrun's ranks), or torchrun's elastic agent restarted the workers
            # (``--max-restarts``): torchrun's store still holds the keys the previous group (or
            # the previous workers) wrote, and torch numbers a new group's keys from 0 again
            # (stale peer addresses: gloo's connect times out). Prefix them.
            store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
            kwargs["store"] = dist.PrefixStore(f"planner/restart-{restart}/join-{_JOINS}", store)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        _JOINS += 1
    return DistContext(rank, world_size, local_rank, device, backend)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class LaunchError(RuntimeError):
    """A local multi-process run failed: which rank, and why (``details``: the remote traceback)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class _InheritedFd:
    """A file descriptor of the launcher, sent to a rank as it starts (multiprocessing duplicates
    it into the new process while pickling the rank's arguments); the rank receives its own fd."""

    def __init__(self, descriptor: int):
        self.descriptor = descriptor

    def __reduce__(self) -> tuple:
        return _received_fd, (multiprocessing.reduction.DupFd(self.descriptor),)


def _received_fd(duplicate: Any) -> int:
    return duplicate.detach()


def _launcher_stdio() -> tuple[_InheritedFd, _InheritedFd] | None:
    """The launcher's standard output and error for ranks forked by the fork server (which keeps
    the ones it started with); None where they are not open files."""
    try:
        os.fstat(1), os.fstat(2)
    except OSError:
        return None
    return _InheritedFd(1), _InheritedFd(2)


@dataclass(frozen=True)
class _RankJob:
    """What every local rank of one ``launch_local`` runs, and where (pickled to each rank)."""

    fn: Callable
    """Called as ``fn(rank, world_size, *args)``."""
    world_size: int
    """Number of local ranks."""
    port: int
    """The port of the launcher's rendezvous store on the loopback interface."""
    timeout_s: float
    """Timeout of each collective, in seconds."""
    args: tuple
    """Further arguments of ``fn``."""
    error_dir: str
    """Where each rank writes ``rank{r}.err`` (its failure) or ``rank{r}.done``."""
    env: dict[str, str]
    """The launcher's environment at the time of the launch."""
    stdio: tuple[Any, Any] | None = None
    """The launcher's standard output and error (forked ranks), or None."""


def _enter_launcher_context(rank: int, job: _RankJob) -> None:
    """The rank's environment, standard streams and threads: the launcher's, not the fork server's."""
    os.environ.clear()  # the launcher's environment, not the fork server's (module docstring)
    os.environ.update(job.env)
    if job.stdio is not None:  # print where the launcher prints now
        sys.stdout.flush(), sys.stderr.flush()
        for descriptor, target in zip(job.stdio, (1, 2)):
            os.dup2(descriptor, target)
            os.close(descriptor)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(job.world_size)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(job.port)
    # The machine's cores shared by every local rank (no oversubscription); PLANNER_NUM_THREADS
    # overrides the intra-op threads per rank.
    torch.set_num_threads(
        int(environment.read(environment.NUM_THREADS) or 0) or max(1, (os.cpu_count() or 1) // job.world_size)
    )


def _entry(rank: int, job: _RankJob) -> None:
    _enter_launcher_context(rank, job)
    world_size = job.world_size
    try:
        store = dist.TCPStore(
            "127.0.0.1", job.port, world_size, is_master=False, timeout=datetime.timedelta(seconds=job.timeout_s)
        )
        init_distributed(rank, world_size, job.port, timeout_s=job.timeout_s, store=store)
        try:
            job.fn(rank, world_size, *job.args)
            # Leave together: a rank that tears its connections down while a peer still
            # talks to it makes gloo abort that peer.
            if dist.is_initialized() and world_size > 1:
                try:
                    dist.barrier()
                except RuntimeError:  # a peer already left (it failed or gave up): nothing to wait for
                    pass
        finally:
            shutdown()
        open(os.path.join(job.error_dir, f"rank{rank}.done"), "w").close()
    except BaseException as e:
        # Record the error with its time: the launcher reports the first failure (the cause),
        # not the connection errors it triggers on the other ranks. Written whole, then renamed:
        # the launcher never reads half a report.
        report = os.path.join(job.error_dir, f"rank{rank}.err")
        with open(report + ".tmp", "w", encoding="utf-8") as f:
            f.write(f"{time.time():.6f}\n{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        os.replace(report + ".tmp", report)
        raise


def _diagnose(ctx: Any, error_dir: str, nproc: int) -> LaunchError:
    """Name the rank that failed first and why."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(process.is_alive() for process in ctx.processes):
        time.sleep(0.05)
    # A rank killed from outside (SIGKILL: the OOM killer, an operator) is the one that was lost.
    # torch.multiprocessing stops the survivors with SIGTERM once one rank fails, and gloo aborts
    # (SIGABRT) a rank whose peer vanished mid-collective: those are consequences, so the
    # earliest error a rank reported comes before them.
    signalled = []
    for rank, process in enumerate(ctx.processes):
        code = process.exitcode
        if code is not None and code < 0 and -code != signal.SIGTERM:
            try:
                signal_name = signal.Signals(-code).name
            except ValueError:
                signal_name = f"signal {-code}"
            lost = LaunchError(
                f"rank {rank} was lost: its process was killed by {signal_name}; the other ranks were stopped"
            )
            if -code == signal.SIGKILL:
                return lost
            signalled.append(lost)
    errors = []
    for rank in range(nproc):
        path = os.path.join(error_dir, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                stamp, _, rest = f.read().partition("\n")
            try:
                errors.append((float(stamp), rank, rest))
            except ValueError:  # not a report this launcher's ranks write
                continue
    if errors:
        _, first, text = min(errors)
        head, _, remote_traceback = text.partition("\n\n")
        return LaunchError(f"rank {first} failed: {head.strip()}", details=remote_traceback)
    if signalled:
        return signalled[0]
    codes = {rank: process.exitcode for rank, process in enumerate(ctx.processes)}
    return LaunchError(f"a rank exited without an error report (exit codes {codes})")


def launch_local(
    fn: Callable[..., Any],
    nproc: int,
    args: Sequence[Any] = (),
    timeout_s: float = 300.0,
    collective_timeout_s: float | None = None,
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``nproc`` local processes with a gloo group
    (started as ``start_method()`` says).

    Raises ``LaunchError`` naming the rank that failed first (a rank killed by a signal is
    reported as lost) and kills the rest. ``timeout_s`` bounds the whole run;
    ``collective_timeout_s`` bounds each collective.
    """
    coll_timeout = collective_timeout_s if collective_timeout_s is not None else timeout_s
    # The launcher serves the rendezvous store on a port the kernel picks while binding it, held
    # for the whole run. A port found free and released first (``free_port``) could be taken before
    # rank 0 bound it, by any process of the machine (another run's gloo connections draw from the
    # same ephemeral range): the run then failed at start with "address already in use".
    store = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, timeout=datetime.timedelta(seconds=coll_timeout), wait_for_workers=False
    )
    port = store.port
    method = start_method()
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
    with tempfile.TemporaryDirectory(prefix="planner-launch-") as error_dir:
        job = _RankJob(
            fn,
            nproc,
            port,
            coll_timeout,
            tuple(args),
            error_dir,
            dict(os.environ),
            _launcher_stdio() if method == "forkserver" else None,
        )
        ctx = mp.start_processes(
            _entry,
            args=(job,),
            nprocs=nproc,
            join=False,
            start_method=method,
        )
        deadline = time.monotonic() + timeout_s
        # torch logs each peer it terminates after a failure; the failure is reported by _diagnose
        spawn_log = logging.getLogger("torch.multiprocessing.spawn")
        spawn_level = spawn_log.level
        spawn_log.setLevel(logging.ERROR)
        try:
            while True:
                try:
                    if ctx.join(timeout=0.5):
                        return
                except (mp.ProcessRaisedException, mp.ProcessExitedException):
                    if all(os.path.exists(os.path.join(error_dir, f"rank{rank}.done")) for rank in range(nproc)):
                        # Every rank finished its work; the failure happened while exiting.
                        print(
                            "planner: warning: a process failed while exiting after all ranks had "
                            "finished; the run itself completed",
                            file=sys.stderr,
                        )
                        return
                    raise _diagnose(ctx, error_dir, nproc) from None
                if time.monotonic() > deadline:
                    raise LaunchError(f"local run of {nproc} processes timed out after {timeout_s:.0f} s")
        finally:
            spawn_log.setLevel(spawn_level)
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
            for process in ctx.processes:
                process.join(5)
