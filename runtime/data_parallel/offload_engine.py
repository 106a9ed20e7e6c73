"""ZeRO-Offload and ZeRO-Infinity: optimizer state and parameter shards outside device memory.

Tiers
-----
plan.json ``offload: {"optimizer": T, "params": T}`` places two kinds of state of each rank's ZeRO
shard on a tier ``T`` (``runtime.contract.choices.OffloadTier``; no key means ``none``/``none``):
``none`` on the device; ``cpu`` in host memory (pinned when the device is CUDA, so copies are
asynchronous); ``nvme`` in files under ``planner train --nvme-path DIR``, host memory then holding
only the buffers of the transfers in flight.

``optimizer`` (ZeRO 1-3) moves the fp32 masters and AdamW moments of the rank's shard (``12 P /
dp`` bytes) plus an fp32 host copy of the reduced gradient shard (``4 P / dp``, in host memory
whatever the tier); the device keeps its compute parameters, at ZeRO-1 the full gradient buffer,
at 2/3 only the gradients of layers in flight. AdamW then runs on the CPU with the same kernel
(``runtime.data_parallel.flat_shards.adamw_step_``), so offloaded and resident runs agree to
rounding. ``params`` (ZeRO-3) moves the compute-dtype shards the gathers start from (``P b / dp``).
``OffloadConfig`` checks both rules and the NVMe path before any work starts.

Data path of one step (optimizer offloaded)
-------------------------------------------
1. Backward: when a group's reduction of the step's last backward completes, the engine hands the
   reduced shard to ``OptimizerStore.flush_grad``: on CUDA a ``non_blocking`` copy on a side
   stream into pinned memory, overlapped with the rest of backward. Tied weights flush in
   ``step()``, after their sum over the stages holding them.
2. ``step()`` waits for the copies and computes the norm and overflow flag from the host shards.
3. ``OptimizerStore.update`` walks the groups: AdamW on the CPU for group ``i``, then its master,
   cast to the compute dtype, is copied to the device (asynchronously on CUDA) while ``i + 1``
   updates.

Delayed update (``OffloadConfig.delayed_update``, off by default): step 3 runs on a background
thread (``start_update``) on this step's gradient shards while the next backward flushes into a
second set; the next ``step()`` waits for it after its norm all-reduce and copies the result to the
device (``finish_update``). Step k+1 then computes with the parameters of step k-1 (it changes the
numerics); extra host memory ``(4 + b) P / dp``.

Double buffering (NVMe)
-----------------------
The optimizer file holds, per group, ``[master | exp_avg | exp_avg_sq]`` of its shard (fp32). Two
host *slots*, each big enough for the largest group's three tensors, stream the step through one
IO thread that executes reads and writes strictly in submission order::

    read g0 -> slot A; read g1 -> slot B
    update g0 in A | IO: (g1 arriving in B)
    write g0 from A, then read g2 into A   (queued)
    update g1 in B | IO: writing g0, reading g2

so group ``i`` is written back while ``i + 1`` updates and ``i + 2`` is read into the slot ``i``
leaves (the queue's order makes that safe without locks). Parameter shards (``params: nvme``) use
the same design, two slots read ahead in the previous step's fetch order. The IO is
``os.preadv``/``os.pwrite`` on a ``ctypes`` view of the slot (the GIL is released). Files live in
``DIR/rank<r>/``; ``close()`` (or interpreter exit) removes them, and the folder only when this run
created it and it is empty.

Accounting: the stores list their host tensors (``host_tensors``), which the memory tracker
ignores (``peak_memory_bytes`` stays device memory) and reports as ``host_memory_bytes`` and
``nvme_bytes``; every wait for a transfer runs in the ``offload`` part of ``runtime.timing``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from runtime import timing
from runtime.contract.choices import OffloadTier, names
from runtime.contract.input_errors import ConfigError
from runtime.data_parallel.engine_config import ShardingConfig
from runtime.data_parallel.flat_shards import FlatGroup, resident_access, resident_state

__all__ = [
    "TIERS",
    "copy_part",
    "Offload",
    "OffloadConfig",
    "OffloadError",
    "NvmeFile",
    "OptimizerStore",
    "ParamStore",
    "host_empty",
]

TIERS: tuple[str, ...] = names(OffloadTier)


class OffloadError(ConfigError):
    """An offload setting that cannot run (bad tier, ZeRO stage, missing or unusable NVMe path)."""


@dataclass(frozen=True)
class OffloadConfig:
    """Where a rank keeps its optimizer state and parameter shards (see the module docstring)."""

    optimizer: str = OffloadTier.NONE.value
    """Tier of the fp32 masters and AdamW moments: ``none`` (device), ``cpu`` or ``nvme``."""
    params: str = OffloadTier.NONE.value
    """Tier of the ZeRO-3 compute-dtype parameter shards: ``none``, ``cpu`` or ``nvme``."""
    nvme_path: str | None = None
    """Folder of the NVMe tier's files (``planner train --nvme-path``); needed by an ``nvme`` tier."""
    delayed_update: bool = False
    """With the optimizer offloaded, run each step's CPU update in the background and apply it at
    the next ``step()`` (module docstring, "Delayed update"; one step stale, it changes the
    numerics). Needs ``optimizer`` cpu or nvme."""

    def __post_init__(self) -> None:
        for kind in ("optimizer", "params"):
            tier = getattr(self, kind)
            if tier not in TIERS:
                raise OffloadError(f"offload.{kind} must be one of {', '.join(TIERS)}, got {tier!r}")

    @property
    def active(self) -> bool:
        return self.optimizer != OffloadTier.NONE or self.params != OffloadTier.NONE

    @property
    def uses_nvme(self) -> bool:
        return OffloadTier.NVME in (self.optimizer, self.params)

    def check(self, zero_stage: int) -> None:
        """Raise ``OffloadError`` unless this placement can run at ``zero_stage``."""
        if self.params != OffloadTier.NONE and zero_stage != 3:
            raise OffloadError(
                f"offload.params={self.params!r} needs ZeRO stage 3 (only ZeRO-3 shards the parameters), "
                f"but the plan has zero_stage {zero_stage}; re-plan with --zero-stage 3 or --offload-params none"
            )
        if self.optimizer != OffloadTier.NONE and zero_stage not in (1, 2, 3):
            raise OffloadError(
                f"offload.optimizer={self.optimizer!r} needs ZeRO stage 1, 2 or 3 (a sharded optimizer "
                f"state), but the plan has zero_stage {zero_stage}; re-plan with --zero-stage 1 or higher "
                "or --offload-optimizer none"
            )
        if self.uses_nvme:
            if not self.nvme_path:
                which = [k for k in ("optimizer", "params") if getattr(self, k) == OffloadTier.NVME]
                raise OffloadError(
                    f"the plan puts the {' and '.join(which)} state on NVMe (offload "
                    f"{', '.join(f'{k}=nvme' for k in which)}) but no folder was given: pass "
                    "--nvme-path DIR (a folder on a fast local disk)"
                )
            if os.path.exists(self.nvme_path) and not os.path.isdir(self.nvme_path):
                raise OffloadError(f"--nvme-path {self.nvme_path} exists and is not a folder")
        if self.delayed_update and self.optimizer == OffloadTier.NONE:
            raise OffloadError(
                "the delayed update (--delayed-update) overlaps the CPU optimizer step with the next "
                "step's forward and backward: it needs a plan that offloads the optimizer state "
                "(offload.optimizer cpu or nvme)"
            )

    @classmethod
    def from_plan(cls, plan: dict, nvme_path: str | None = None) -> "OffloadConfig":
        """The placement of plan dict ``plan`` (its ``offload`` key; none/none without it), checked
        against its ZeRO stage and ``nvme_path``."""
        spec = plan.get("offload") or {}
        if not isinstance(spec, dict) or set(spec) - {"optimizer", "params"}:
            raise OffloadError(f"plan offload must be {{'optimizer': tier, 'params': tier}}, got {spec!r}")
        cfg = cls(
            optimizer=spec.get("optimizer", OffloadTier.NONE.value),
            params=spec.get("params", OffloadTier.NONE.value),
            nvme_path=nvme_path,
        )
        cfg.check(int(plan["zero_stage"]))
        return cfg


def _folder(config: OffloadConfig) -> str:
    """The NVMe tier's folder (``OffloadConfig.check`` made sure an ``nvme`` tier has one)."""
    if not config.nvme_path:
        raise OffloadError("the NVMe tier needs a folder: pass --nvme-path DIR")
    return config.nvme_path


def _nvme(file: NvmeFile | None) -> NvmeFile:
    """A store's NVMe file (its tier is ``nvme``)."""
    if file is None:
        raise OffloadError("this store keeps its state in host memory, not in an NVMe file")
    return file


def host_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized host tensor, pinned when ``device`` is CUDA (asynchronous copies)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor's memory (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("NVMe transfers need contiguous host tensors")
    n = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * n).from_address(tensor.data_ptr())).cast("B")


#: ``rank<r>`` folders this process created: removed when their last store file goes.
_CREATED: set[str] = set()


def _reserve(descriptor: int, nbytes: int) -> None:
    """Allocate the file's blocks now, so that a disk too small fails at set-up, not mid-run
    (a sparse file where the file system cannot preallocate)."""
    try:
        os.posix_fallocate(descriptor, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(descriptor, nbytes)


def _remove(descriptor: int, path: str) -> None:
    """Close and delete one store file, and its rank folder when this process made it and it is
    now empty."""
    with contextlib.suppress(OSError):
        os.close(descriptor)
    with contextlib.suppress(OSError):
        os.unlink(path)
    folder = os.path.dirname(path)
    if folder in _CREATED:
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # fails, harmlessly, while anything else is in it
            _CREATED.discard(folder)


class NvmeFile:
    """A store file of ``nbytes`` under ``root/rank<rank>/`` and the one thread that reads and writes
    it. ``read``/``write`` queue a transfer between a host tensor and a byte offset and return its
    ``Future``; transfers run in submission order."""

    def __init__(self, root: str, rank: int, kind: str, nbytes: int):
        folder = os.path.join(root, f"rank{rank}")
        try:
            if not os.path.isdir(folder):
                os.makedirs(folder)
                _CREATED.add(folder)
            descriptor, self.path = tempfile.mkstemp(prefix=f"{kind}-", suffix=".bin", dir=folder)
        except OSError as e:
            raise OffloadError(
                f"cannot create the NVMe tier's {kind} file in {folder} ({e}); check --nvme-path (a writable folder)"
            ) from None
        try:
            _reserve(descriptor, nbytes)
        except OSError as e:
            _remove(descriptor, self.path)
            raise OffloadError(
                f"cannot reserve {nbytes / 2**20:.1f} MiB for the NVMe tier's {kind} file in "
                f"{folder} ({e}); free space there or point --nvme-path at a larger disk"
            ) from None
        self.fd, self.nbytes = descriptor, nbytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nvme-{kind}")
        self._cleanup = weakref.finalize(self, _remove, descriptor, self.path)

    def _pread(self, tensor: torch.Tensor, offset: int, before: Callable[[], None] | None) -> None:
        if before is not None:
            before()
        view, done = _bytes_view(tensor), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read of {self.path} at byte {offset + done}")
            done += n

    def _pwrite(self, tensor: torch.Tensor, offset: int, before: Callable[[], None] | None) -> None:
        if before is not None:
            before()
        view, done = _bytes_view(tensor), 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def read(self, tensor: torch.Tensor, offset: int, before: Callable[[], None] | None = None) -> Future:
        """Queue: fill host tensor ``tensor`` from byte ``offset`` (after ``before()``, e.g. waiting for a
        device copy that still reads ``tensor``)."""
        return self._pool.submit(self._pread, tensor, offset, before)

    def write(self, tensor: torch.Tensor, offset: int, before: Callable[[], None] | None = None) -> Future:
        """Queue: store host tensor ``tensor`` at byte ``offset``."""
        return self._pool.submit(self._pwrite, tensor, offset, before)

    def close(self) -> None:
        """Finish queued transfers, then delete the file."""
        self._pool.shutdown(wait=True)
        self._cleanup()


def _wait(fut: Future | None, timed: bool = True) -> None:
    """Block (in the ``offload`` part unless ``timed`` is False: a background thread must not touch
    the process's step timer) until a transfer finished; re-raise its error."""
    if fut is None:
        return
    with timing.part("offload" if timed else None):
        fut.result()


def copy_part(device: torch.device):
    """The timing part of a copy between the host tier and ``device``: ``offload`` on a CPU rank,
    where the copy blocks; none on CUDA, where it is asynchronous and a part boundary would
    synchronize the device (``runtime.timing``), serializing the copy with the CPU work it overlaps."""
    return timing.part("offload" if device.type == "cpu" else None)


def _device_event(device: torch.device):
    """An event recorded on the current CUDA stream (None on a CPU rank)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class OptimizerStore:
    """The fp32 masters, AdamW moments and host gradient shards of one rank (optimizer offload).

    ``adopt`` takes each group's initial fp32 shard; afterwards the tensors are reached through
    ``grad``, ``update`` (the step) and ``open_group`` (checkpoints), never on the device. With the
    ``cpu`` tier ``g.master``, ``g.exp_avg`` and ``g.exp_avg_sq`` are host tensors; with ``nvme``
    they are None between uses (the file holds them).
    """

    def __init__(
        self,
        config: OffloadConfig,
        groups: Sequence[FlatGroup],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        rank: int = 0,
    ):
        tier, delayed = config.optimizer, config.delayed_update
        if tier not in (OffloadTier.CPU, OffloadTier.NVME):
            raise OffloadError(f"optimizer store tier must be cpu or nvme, got {tier!r}")
        self.tier, self.device = tier, device
        self._grads = {group.index: host_empty(group.shard, torch.float32, device).zero_() for group in groups}
        # Delayed update: a second set of gradient shards (the next backward fills one while the
        # CPU steps with the other), the updated shards in the compute dtype, the CPU step's thread.
        self._spare = (
            {group.index: torch.zeros_like(tensor) for group, tensor in zip(groups, self._grads.values())}
            if delayed
            else {}
        )
        self._staged = {group.index: host_empty(group.shard, dtype, device) for group in groups} if delayed else {}
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-adamw") if delayed else None
        self._pending: Future | None = None
        self._fresh = dict.fromkeys(self._grads, True)  # no flush yet this step: the next one copies
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._grad_event: torch.cuda.Event | None = None
        self._file: NvmeFile | None = None
        self._slots: list[torch.Tensor] = []
        self._offset: dict[int, int] = {}
        if tier == OffloadTier.NVME:
            off = 0
            for group in groups:
                self._offset[group.index] = off
                off += 3 * group.shard * 4
            self._file = NvmeFile(_folder(config), rank, "optimizer", off)
            biggest = max(group.shard for group in groups)
            self._slots = [host_empty(3 * biggest, torch.float32, device) for _ in range(2)]

    # -- set-up and access ------------------------------------------------------------------
    @torch.no_grad()
    def adopt(self, group: FlatGroup, master: torch.Tensor) -> None:
        """Take ``group``'s initial fp32 master shard; its moments start at 0."""
        if self.tier == OffloadTier.CPU:
            group.master = host_empty(group.shard, torch.float32, self.device).copy_(master)
            group.exp_avg = torch.zeros_like(group.master)
            group.exp_avg_sq = torch.zeros_like(group.master)
            return
        slot = self._slots[0][: 3 * group.shard]
        slot.zero_()
        slot[: group.shard].copy_(master)
        _nvme(self._file).write(slot, self._offset[group.index]).result()
        group.master = group.exp_avg = group.exp_avg_sq = None

    def _views(self, slot: torch.Tensor, group: FlatGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size = group.shard
        return slot[:size], slot[size : 2 * size], slot[2 * size : 3 * size]

    @contextlib.contextmanager
    def open_group(self, group: FlatGroup, write: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
        """``(master, exp_avg, exp_avg_sq)`` of ``group`` for the body (checkpoints, reads of the
        masters); with ``write=True`` what the body changed is stored back. Blocking."""
        if self.tier == OffloadTier.CPU:
            yield resident_state(group)
            return
        slot, off = self._slots[0][: 3 * group.shard], self._offset[group.index]
        _wait(_nvme(self._file).read(slot, off))
        yield self._views(slot, group)
        if write:
            _wait(_nvme(self._file).write(slot, off))

    # -- gradients ------------------------------------------------------------------------------
    def grad(self, group: FlatGroup) -> torch.Tensor:
        """``group``'s reduced fp32 gradient shard in host memory (after ``wait_grads``)."""
        return self._grads[group.index]

    @torch.no_grad()
    def flush_grad(self, group: FlatGroup, src: torch.Tensor, overwrite: bool) -> None:
        """Move the reduced gradient shard ``src`` (on the device) into the host buffer of ``group``:
        a copy (asynchronous on CUDA) when it is the step's first flush of ``group`` or ``overwrite``
        (``src`` holds the whole gradient), else added to what is there."""
        host = self._grads[group.index]
        if not (overwrite or self._fresh[group.index]):
            with timing.part("offload"):
                host.add_(src.to("cpu", torch.float32))
            return
        self._fresh[group.index] = False
        if self._copy_stream is None:
            with timing.part("offload"):
                host.copy_(src)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host.copy_(src, non_blocking=True)
            src.record_stream(self._copy_stream)
        self._grad_event = torch.cuda.Event()
        self._grad_event.record(self._copy_stream)

    def wait_grads(self) -> None:
        """Block until every gradient copy launched by ``flush_grad`` has landed in host memory."""
        if self._grad_event is not None:
            with timing.part("offload"):
                self._grad_event.synchronize()
            self._grad_event = None

    def zero_grads(self) -> None:
        """Start a new step: the next flush of each group overwrites its host gradient."""
        for k in self._fresh:
            self._fresh[k] = True

    # -- the step ---------------------------------------------------------------------------------
    def update(
        self,
        groups: Sequence[FlatGroup],
        fn: Callable[[FlatGroup, torch.Tensor, torch.Tensor, torch.Tensor], object],
        timed: bool = True,
    ) -> list:
        """Call ``fn(group, master, exp_avg, exp_avg_sq)`` for every group in order (the CPU AdamW step
        and the copy of the result to the device); their results. With ``nvme`` the groups stream
        through the two slots (module docstring): read ``i + 1`` while ``i`` updates, write ``i``
        back while ``i + 1`` updates. ``timed=False``: waits are not timed (a background thread)."""
        if self.tier == OffloadTier.CPU:
            return [fn(group, *resident_state(group)) for group in groups]
        reads: dict[int, Future] = {}
        writes: list[Future] = []

        def fetch(i: int, before=None) -> None:
            if i < len(groups):
                group = groups[i]
                reads[i] = _nvme(self._file).read(
                    self._slots[i % 2][: 3 * group.shard], self._offset[group.index], before
                )

        fetch(0)
        fetch(1)
        out = []
        for i, group in enumerate(groups):
            _wait(reads.pop(i), timed)
            slot = self._slots[i % 2][: 3 * group.shard]
            out.append(fn(group, *self._views(slot, group)))
            event = _device_event(self.device)  # the device copy of the master still reads the slot
            writes.append(_nvme(self._file).write(slot, self._offset[group.index]))
            fetch(i + 2, before=event.synchronize if event is not None else None)
        for pending in writes:
            _wait(pending, timed)
        return out

    # -- the delayed update ---------------------------------------------------------------------------
    def start_update(self, groups: Sequence[FlatGroup], fn: Callable[..., None]) -> None:
        """Run the step in the background: ``fn(group, master, exp_avg, exp_avg_sq, grad)`` per group on
        this step's gradient shards, each updated master kept in the compute dtype for
        ``finish_update``. The next backward flushes into the other set of gradient shards."""
        grads = self._grads
        self._grads, self._spare = self._spare, self._grads

        def one(group: FlatGroup, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
            fn(group, master, exp_avg, exp_avg_sq, grads[group.index])
            self._staged[group.index].copy_(master)

        def work() -> None:
            with torch.no_grad():  # grad mode is per thread
                self.update(groups, one, timed=False)

        assert self._cpu is not None, "start_update needs a store made for the delayed update"
        self._pending = self._cpu.submit(work)

    def finish_update(self, groups: Sequence[FlatGroup], publish: Callable[[FlatGroup, torch.Tensor], object]) -> list:
        """Wait for the background step, if one runs, and ``publish(group, updated shard)`` each group;
        the results (collective handles). Nothing to do: an empty list."""
        if self._pending is None:
            return []
        fut, self._pending = self._pending, None
        fut.result()
        return [publish(group, self._staged[group.index]) for group in groups]

    # -- accounting ---------------------------------------------------------------------------------
    def host_tensors(self) -> list[torch.Tensor]:
        """Every host-tier tensor of this store (gradient shards, transfer slots, delayed-update
        buffers); the cpu tier's state is ``host_state``."""
        return list(self._grads.values()) + list(self._spare.values()) + list(self._staged.values()) + self._slots

    def host_state(self, groups: Sequence[FlatGroup]) -> list[torch.Tensor]:
        """The cpu tier's resident masters and moments (empty for nvme)."""
        if self.tier != OffloadTier.CPU:
            return []
        return [tensor for group in groups for tensor in resident_state(group)]

    @property
    def nvme_bytes(self) -> int:
        return self._file.nbytes if self._file is not None else 0

    def close(self) -> None:
        if self._cpu is not None:
            self._cpu.shutdown(wait=True)  # a background step still running finishes first
            self._pending = None
        if self._file is not None:
            self._file.close()
            self._file = None


class ParamStore:
    """ZeRO-3 compute-dtype parameter shards off the device (parameter offload).

    ``fetch(group)`` returns a fresh device tensor with ``group``'s shard, the source of its
    all-gather (freed with the gather); ``store(group, master)`` writes the updated shard back after
    the optimizer step. ``cpu``: one host shard per group; ``nvme``: a file and two slots read
    ahead in the previous step's fetch order.
    """

    def __init__(
        self,
        config: OffloadConfig,
        groups: Sequence[FlatGroup],
        dtype: torch.dtype,
        device: torch.device,
        rank: int = 0,
    ):
        tier = config.params
        if tier not in (OffloadTier.CPU, OffloadTier.NVME):
            raise OffloadError(f"parameter store tier must be cpu or nvme, got {tier!r}")
        self.tier, self.dtype, self.device = tier, dtype, device
        self._esize = torch.empty((), dtype=dtype).element_size()
        self._shards: dict[int, torch.Tensor] = {}
        self._file: NvmeFile | None = None
        self._offset: dict[int, int] = {}
        self._slots: list[torch.Tensor] = []
        self._held: dict[int, tuple[int, Future]] = {}  # group -> (slot, its read)
        self._order: list[int] = []  # fetches of the previous step
        self._seen: list[int] = []  # fetches of this step
        if tier == OffloadTier.NVME:
            off = 0
            for group in groups:
                self._offset[group.index] = off
                off += group.shard * self._esize
            self._file = NvmeFile(_folder(config), rank, "params", off)
            biggest = max(group.shard for group in groups)
            self._slots = [host_empty(biggest, dtype, device) for _ in range(2)]
        self._numel = {group.index: group.shard for group in groups}

    @torch.no_grad()
    def store(self, group: FlatGroup, master: torch.Tensor) -> None:
        """Keep ``group``'s shard: ``master`` (fp32, any device) cast to the compute dtype."""
        if self.tier == OffloadTier.CPU:
            if group.index not in self._shards:
                self._shards[group.index] = host_empty(group.shard, self.dtype, self.device)
            self._shards[group.index].copy_(master)
            return
        for index in list(self._held):  # slot 0 stages the write: no read may be filling it
            self._drop(index)
        slot = self._slots[0][: group.shard]
        slot.copy_(master)
        _wait(_nvme(self._file).write(slot, self._offset[group.index]))

    def _drop(self, index: int) -> None:
        held = self._held.pop(index, None)
        if held is not None:
            held[1].result()

    def _read_ahead(self, index: int) -> None:
        """Start reading group ``index`` into a slot not held by another group's pending use."""
        if index in self._held or len(self._held) >= len(self._slots):
            return
        busy = {slot for slot, _ in self._held.values()}
        slot = next(candidate for candidate in range(len(self._slots)) if candidate not in busy)
        buf = self._slots[slot][: self._numel[index]]
        self._held[index] = (slot, _nvme(self._file).read(buf, self._offset[index]))

    @torch.no_grad()
    def fetch(self, group: FlatGroup) -> torch.Tensor:
        """A device tensor holding ``group``'s compute-dtype shard (a copy the caller owns)."""
        if self.tier == OffloadTier.CPU:
            with copy_part(self.device):
                return self._shards[group.index].to(self.device, copy=True, non_blocking=True)
        if group.index not in self._held:  # not predicted: make room and read it now
            for index in list(self._held):
                self._drop(index)
            self._read_ahead(group.index)
        slot, fut = self._held.pop(group.index)
        _wait(fut)
        with timing.part("offload"):
            out = self._slots[slot][: group.shard].to(self.device, copy=True)
        self._seen.append(group.index)
        k = len(self._seen)
        if self._order[:k] == self._seen:
            for nxt in self._order[k : k + len(self._slots)]:
                self._read_ahead(nxt)
        return out

    def end_step(self) -> None:
        """A step ended: its fetch order predicts the next step's, whose first reads start now."""
        if self._seen:
            self._order, self._seen = self._seen, []
        for index in list(self._held):
            self._drop(index)
        for nxt in self._order[: len(self._slots)]:
            self._read_ahead(nxt)

    def host_tensors(self) -> list[torch.Tensor]:
        return list(self._shards.values()) + self._slots

    @property
    def nvme_bytes(self) -> int:
        return self._file.nbytes if self._file is not None else 0

    def close(self) -> None:
        if self._file is not None:
            for index in list(self._held):
                self._drop(index)
            self._file.close()
            self._file = None


class Offload:
    """The ZeRO engine's one interface to the offload tiers of its groups (``runtime.data_parallel.zero_engine`` calls it
    at a few points: placing each group's state, reaching it, the ZeRO-3 gather source and its
    update, the start of a step, accounting and ``close``). With nothing offloaded every call does
    what the engine did before: the state stays in the group's own device tensors."""

    def __init__(
        self,
        config: OffloadConfig,
        groups: Sequence[FlatGroup],
        sharding: ShardingConfig,
        device: torch.device,
        rank: int,
    ):
        config.check(sharding.zero_stage)
        self.config, self.stage, self.dtype = config, sharding.zero_stage, sharding.param_dtype
        self.delayed = config.delayed_update
        self.opt = (
            OptimizerStore(config, groups, device, self.dtype, rank) if config.optimizer != OffloadTier.NONE else None
        )
        """The optimizer state's store (None: on the device)."""
        self.params = (
            ParamStore(config, groups, self.dtype, device, rank) if config.params != OffloadTier.NONE else None
        )
        """The ZeRO-3 parameter shards' store (None: gathered from the device)."""

    @torch.no_grad()
    def place(self, group: FlatGroup, master: torch.Tensor) -> None:
        """Put ``group``'s master (initially ``master``, fp32) and AdamW moments on their tier; at
        ZeRO-3 also the compute-dtype shard gathers start from when that is not the device master:
        in the parameter store, or a device copy when only the optimizer state left the device."""
        if self.opt is None:
            resident = group.master
            assert resident is not None  # the engine placed it
            group.exp_avg = torch.zeros_like(resident)
            group.exp_avg_sq = torch.zeros_like(resident)
        else:
            self.opt.adopt(group, master)
        if self.stage == 3 and self.params is not None:
            self.params.store(group, master)
        elif self.stage == 3 and self.opt is not None:
            group.param_shard = master.to(self.dtype, copy=True)

    def access(self, group: FlatGroup, write: bool = False):
        """``(master, exp_avg, exp_avg_sq)`` of ``group`` for a ``with`` body, wherever they live
        (a ``runtime.data_parallel.flat_shards.GroupAccess``)."""
        return self.opt.open_group(group, write) if self.opt is not None else resident_access(group, write)

    def _store(self) -> OptimizerStore:
        """The optimizer state's store (the optimizer is offloaded)."""
        if self.opt is None:
            raise OffloadError("the optimizer state is on the device: there is no host gradient to flush")
        return self.opt

    def flush_grad(self, group: FlatGroup) -> None:
        """``group``'s reduction is complete: copy (ZeRO-1: this rank's shard ``group.way`` of the
        all-reduced buffer) or move (ZeRO-2/3: the fp32 accumulator, released here) its reduced
        gradient into the host tier."""
        if self.stage >= 2:
            store = self._store()
            acc = group.grad_shard if group.grad_shard is not None else torch.zeros(group.shard, device=store.device)
            store.flush_grad(group, acc, overwrite=False)
            group.grad_shard = None
        else:
            assert group.grad_full is not None  # ZeRO-1 keeps the full gradient buffer
            self._store().flush_grad(
                group, group.grad_full[group.way * group.shard : (group.way + 1) * group.shard], overwrite=True
            )
        group.flushed = True

    def flush_all(self, groups: Sequence[FlatGroup]) -> None:
        """In ``step()``: flush what backward did not (tied weights after their sum over stages, the
        last reductions) and wait until every gradient is in host memory."""
        for group in groups:
            if not group.flushed:
                self.flush_grad(group)
        self._store().wait_grads()

    def shard_source(self, group: FlatGroup) -> torch.Tensor:
        """This rank's shard of ``group`` that a ZeRO-3 gather starts from: a device copy fetched from
        the parameter store, the device shard kept when only the optimizer state is offloaded, or
        the fp32 master."""
        if self.params is not None:
            return self.params.fetch(group)
        source = group.param_shard if group.param_shard is not None else group.master
        assert source is not None  # the fp32 master is on the device when no shard was kept
        return source

    @torch.no_grad()
    def store_shard(self, group: FlatGroup, master: torch.Tensor) -> None:
        """After the step (ZeRO-3): the updated ``master`` becomes the shard the next gathers read."""
        if self.params is not None:
            self.params.store(group, master)
        elif group.param_shard is not None:
            with copy_part(group.param_shard.device):
                group.param_shard.copy_(master, non_blocking=True)

    def new_step(self) -> None:
        """``zero_grad``: host gradients start over; the next step's first parameter reads start."""
        if self.opt is not None:
            self.opt.zero_grads()
        if self.params is not None:
            self.params.end_step()

    def host_tensors(self, groups: Sequence[FlatGroup]) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        if self.opt is not None:
            tensors += self.opt.host_tensors() + self.opt.host_state(groups)
        if self.params is not None:
            tensors += self.params.host_tensors()
        return tensors

    @property
    def nvme_bytes(self) -> int:
        return sum(store.nvme_bytes for store in (self.opt, self.params) if store is not None)

    def close(self) -> None:
        """Delete the NVMe files (idempotent)."""
        for store in (self.opt, self.params):
            if store is not None:
                store.close()
