"""Peak bytes of live tensors: the ``peak_memory_bytes`` of the metrics JSONL.

On GPU the caching allocator already knows the answer (``torch.cuda.max_memory_allocated``).
On CPU there is no such counter (RSS mixes in the interpreter, libraries and allocator slack), so
``MemoryTracker`` counts tensor storages itself:

* a ``TorchDispatchMode`` sees every ATen op run under it; each storage among the op's outputs
  (and, by default, inputs) that is not yet known is added to a table with its ``nbytes()``;
* a weak reference with a callback on the storage object removes it when the storage is freed.
  PyTorch keeps one Python object per storage alive exactly as long as the storage itself, so
  the callback fires when the memory is released, whichever tensor or view held it last;
* the table is keyed by storage, so views, tied weights and in-place results count once;
* ``current`` is the sum of the table, and ``peak`` the largest ``current`` seen after any op
  (allocations only happen inside ops, so checking after each op sees every maximum);
* storages that exist before the mode starts (parameters, gradients, optimizer state, data) are
  registered with ``track_existing`` (modules, optimizers, tensors, containers or plain objects
  are walked); with ``track_inputs=True`` any further pre-existing tensor is picked up the first
  time an op reads it;
* ``UntypedStorage.resize_`` (the ZeRO-3 way to free a gathered parameter) is not an ATen op, so
  it is wrapped while the tracker is active; ``Tensor.resize_``/``set_`` are ops and are seen;
* storages passed to ``exclude`` are never counted: the host tier of an offloaded run
  (``runtime.data_parallel.offload_engine``), which on a CPU rank is the same RAM as the "device" but is not device
  memory (the metrics report it apart, as ``host_memory_bytes``).

Not seen: memory allocated outside ATen ops (gloo's internal buffers, ``torch.frombuffer`` or
``from_numpy`` tensors, which the caller can register), kernel workspaces, allocator slack. Meta
and fake tensors have no memory and are ignored.

Cost: one Python call per ATen op (tens of microseconds). On a small MLP training step this is a
slowdown of a few times (measured in the tests), on steps dominated by large kernels it is small;
the trainer enables it only when metrics are requested.
"""

from __future__ import annotations

import threading
import weakref
from functools import partial
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["MemoryTracker", "StorageCounter"]

_PLAIN = (torch.Tensor, nn.Parameter)


def _storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The real (non-meta) storages behind ``t``, looking inside wrapper subclasses."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        out: list[torch.UntypedStorage] = []
        for n in names:
            inner = getattr(tensor, n)
            if isinstance(inner, torch.Tensor):  # DTensor also lists its device mesh
                out.extend(_storages_of(inner))
        return out
    if tensor.layout != torch.strided:
        # Sparse and other layouts have no single storage; their parts are not tracked.
        return []
    storage = tensor.untyped_storage()
    return [] if storage.device.type == "meta" else [storage]


class StorageCounter(TorchDispatchMode):
    """The dispatch mode that keeps the table of live storages (see the module docstring).

    Use it through ``MemoryTracker``; it is public for callers that want the raw counts.
    """

    def __init__(self, track_inputs: bool = True) -> None:
        super().__init__()
        self.track_inputs = track_inputs
        self._live: dict[int, tuple[int, weakref.ref]] = {}
        self._lock = threading.RLock()
        self.current = 0
        self.peak = 0
        self.peak_op = ""
        """Name of the operation after which ``peak`` was reached (``""`` before any)."""
        self._orig_resize: Callable[..., Any] | None = None
        self._excluded: dict[int, weakref.ref] = {}

    # -- table ----------------------------------------------------------------------------

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current -= entry[0]

    def exclude_storage(self, storage: torch.UntypedStorage) -> None:
        """Never count ``st`` (uncount it if it is counted) while it lives."""
        key = id(storage)
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current -= entry[0]
            self._excluded[key] = weakref.ref(storage, partial(self._forget_excluded, key))

    def _forget_excluded(self, key: int, _dead: weakref.ref) -> None:
        self._excluded.pop(key, None)

    def add_storage(self, storage: torch.UntypedStorage) -> int:
        """Count ``st`` if new (or its new size if it was resized); returns the bytes added."""
        key = id(storage)
        if key in self._excluded:
            return 0
        size = storage.nbytes()
        entry = self._live.get(key)  # lock-free fast path: known storage, same size
        if entry is not None and entry[0] == size:
            return 0
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                self._live[key] = (size, weakref.ref(storage, partial(self._freed, key)))
                self.current += size
                return size
            if entry[0] != size:
                self._live[key] = (size, entry[1])
                self.current += size - entry[0]
                return size - entry[0]
            return 0

    def add_tensor(self, tensor: torch.Tensor) -> int:
        return sum(self.add_storage(storage) for storage in _storages_of(tensor))

    def update_peak(self, op: Any = None) -> None:
        if self.current > self.peak:
            self.peak = self.current
            if op is not None:
                self.peak_op = str(op)

    @property
    def num_storages(self) -> int:
        return len(self._live)

    # -- dispatch -------------------------------------------------------------------------

    def _add_all(self, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            self.add_tensor(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                self._add_all(item)

    def _add_inputs(self, obj: Any) -> None:
        """Like ``_add_all`` with a fast exit for plain tensors whose storage is known.

        An input's size cannot have changed unseen: ``resize_``/``set_`` return their tensor
        (an output, checked in full) and ``UntypedStorage.resize_`` is wrapped.
        """
        if isinstance(obj, torch.Tensor):
            if type(obj) in _PLAIN and obj.layout == torch.strided:
                if id(obj.untyped_storage()) in self._live:
                    return
            self.add_tensor(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                self._add_inputs(item)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.track_inputs:
            self._add_inputs(args)
            if kwargs:
                self._add_inputs(tuple(kwargs.values()))
        self._add_all(out)
        self.update_peak(func)
        return out

    # -- storage resize ---------------------------------------------------------------------

    def _patch_resize(self) -> None:
        orig = torch.UntypedStorage.resize_
        counter = self

        def resize_(storage, size):
            resized = orig(storage, size)
            with counter._lock:
                if id(storage) in counter._live:
                    counter.add_storage(storage)
                    counter.update_peak("UntypedStorage.resize_")
            return resized

        self._orig_resize = orig
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]  # patched while the mode is active

    def _unpatch_resize(self) -> None:
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]  # restore
            self._orig_resize = None

    def __enter__(self):
        self._patch_resize()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._unpatch_resize()


class MemoryTracker:
    """Current and peak bytes of live tensors, for the ``peak_memory_bytes`` metric.

    ``backend``: ``"storage"`` counts storages with ``StorageCounter`` (any device);
    ``"cuda"`` reads the caching allocator (``torch.cuda.max_memory_allocated``), which already
    sees every allocation; ``"auto"`` (default) picks ``"cuda"`` when ``device`` is a CUDA device
    (``device=None``: when CUDA is available) and ``"storage"`` otherwise.

    Usage::

        mt = MemoryTracker()
        mt.track_existing(model, optimizer)      # storages created before the tracker
        with mt:
            for step in ...:
                mt.reset_peak()
                train_step()
                peak = mt.peak_bytes

    The tracker can be entered again after leaving; storages freed while outside still lower
    ``current_bytes``, storages allocated outside are not seen (register them).
    """

    def __init__(
        self, device: str | torch.device | None = None, backend: str = "auto", track_inputs: bool = True
    ) -> None:
        if backend not in ("auto", "storage", "cuda"):
            raise ValueError(f"backend must be 'auto', 'storage' or 'cuda', got {backend!r}")
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        if backend == "auto":
            backend = "cuda" if self.device.type == "cuda" else "storage"
        if backend == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("MemoryTracker(backend='cuda') needs CUDA; use backend='storage'")
        self.backend = backend
        self._counter = StorageCounter(track_inputs) if backend == "storage" else None
        self._active = False

    # -- registration -------------------------------------------------------------------------

    def track_existing(self, *objs: Any) -> int:
        """Register tensors that already exist; returns the bytes newly counted.

        Accepts tensors, ``nn.Module`` (parameters, their ``.grad``, buffers), optimizers
        (state and parameters), dicts, lists, tuples, sets, and other objects (their
        attributes, a few levels deep). Each storage is counted once however often it is reached.
        A no-op on the ``cuda`` backend, whose allocator already counts everything.
        """
        if self._counter is None:
            return 0
        before = self._counter.current
        seen: set[int] = set()
        for obj in objs:
            self._walk(obj, seen, 0)
        self._counter.update_peak()
        return self._counter.current - before

    def _walk(self, obj: Any, seen: set[int], depth: int) -> None:
        if obj is None or isinstance(obj, (str, bytes, int, float, bool, type)) or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            assert self._counter is not None  # callers return early without a counter
            self._counter.add_tensor(obj)
            if obj.is_leaf and obj.grad is not None:
                self._walk(obj.grad, seen, depth)
        elif isinstance(obj, nn.Module):
            for param in obj.parameters():
                self._walk(param, seen, depth)
            for buffer in obj.buffers():
                self._walk(buffer, seen, depth)
        elif isinstance(obj, torch.optim.Optimizer):
            self._walk(obj.state, seen, depth)
            self._walk([group["params"] for group in obj.param_groups], seen, depth)
        elif isinstance(obj, dict):
            for value in obj.values():
                self._walk(value, seen, depth)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for value in obj:
                self._walk(value, seen, depth)
        elif depth < 3 and hasattr(obj, "__dict__") and not callable(obj):
            for value in vars(obj).values():
                self._walk(value, seen, depth + 1)

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count the storages of ``tensors`` (memory that is not the device's, such as the
        host tier of an offloaded run); a no-op on the ``cuda`` backend, which sees only device
        allocations anyway."""
        if self._counter is None:
            return
        for tensor in tensors:
            for storage in _storages_of(tensor):
                self._counter.exclude_storage(storage)

    def track(self, tensors: Iterable[torch.Tensor]) -> int:
        """Register individual tensors (same as ``track_existing`` on a list)."""
        return self.track_existing(list(tensors))

    # -- readings -------------------------------------------------------------------------

    @property
    def current_bytes(self) -> int:
        """Bytes of live tracked storages now (allocator's allocated bytes on CUDA)."""
        if self._counter is None:
            return int(torch.cuda.memory_allocated(self.device))
        return self._counter.current

    @property
    def peak_bytes(self) -> int:
        """Largest ``current_bytes`` since the tracker started or ``reset_peak``."""
        if self._counter is None:
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._counter.peak

    @property
    def peak_op(self) -> str:
        """The ATen operation after which the peak was reached (``""`` on the cuda backend or
        when the peak is what existed at ``reset_peak``): where to look when memory is higher than
        predicted."""
        return "" if self._counter is None else self._counter.peak_op

    def reset_peak(self) -> None:
        """Start a new peak from the current bytes (call at the start of each step)."""
        if self._counter is None:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._counter.peak = self._counter.current
            self._counter.peak_op = ""

    @property
    def num_storages(self) -> int:
        """Live storages in the table (0 on the cuda backend)."""
        return 0 if self._counter is None else self._counter.num_storages

    # -- context --------------------------------------------------------------------------

    def __enter__(self) -> "MemoryTracker":
        if self._active:
            raise RuntimeError("this MemoryTracker is already active; it cannot be nested in itself")
        self._active = True
        if self._counter is None:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._counter.update_peak()
            self._counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        if self._counter is not None:
            self._counter.__exit__(*exc)
        else:
            torch.cuda.synchronize(self.device)

    def __repr__(self) -> str:
        return (
            f"MemoryTracker(backend={self.backend!r}, current={self.current_bytes}, "
            f"peak={self.peak_bytes}, storages={self.num_storages})"
        )
