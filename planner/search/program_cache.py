"""Timing programs and compute orders kept on disk, so that a re-plan does not rebuild the
schedules it prices.

The schedule walk prices each kept strategy by simulating its pipeline schedule
(``runtime.contract.schedule_ir.TimingProgram``). Replaying a program costs milliseconds; building
one costs a deep interleaved schedule's lists and a walk of them (0.15 s for 16 ranks, 64
micro-batches and 8 chunks here), and a plan of a 126-block model builds nine. A program is a
function of the schedule's name, ``p``, ``m`` and ``v`` and of the code that generates schedules,
nothing else, so every plan of every model shares it: one process builds it, the next reads it.
The same holds for a schedule's compute order as arrays (:class:`planner.search.order_arrays.OrderArrays`,
what the memory analyses read: 0.23 s to build for 128 stages and 256 micro-batches of zero
bubble, milliseconds to read), kept beside the programs by :func:`cached_order`.

The key is the format, a digest of the two source files that generate schedules
(``runtime/contract/schedule_ir.py`` and ``planner/search/schedule_search.py``) and the four
arguments; an edit of either file makes every entry a miss. Entries are numpy ``.npz`` files (no
pickle, so nothing in one can run code) under the layer-table cache's folder
(``planner.frontend.cache.cache_dir``, ``schedule-programs/``), written atomically, and
``PLANNER_CACHE=off`` turns them off with the rest of the cache.

A cache must never make a plan wrong: an entry is used only when its key matches and its steps
form a program (every rank and slot in range, each send's message its own index, each receive
waiting for an earlier send, each message received once), or its arrays an order
(``OrderArrays.check``); anything else is a miss and is overwritten.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from planner.frontend.cache import cache_dir, cache_enabled, write_entry
from planner.search.order_arrays import OrderArrays
from runtime.contract.schedule_ir import COMPUTE, TimingProgram

__all__ = ["FORMAT", "cached_order", "cached_program", "stats"]

FORMAT = 1
"""Version of the entry layout."""

_SUBDIR = "schedule-programs"
_SOURCES = ("runtime/contract/schedule_ir.py", "planner/search/schedule_search.py")
_log = logging.getLogger(__name__)
_digest: str | None = None

stats: Counter = Counter()
"""What the cache did in this process: ``hit``, ``miss``, ``rejected``, ``stored``, ``unwritable``."""


def _code_digest() -> str:
    """SHA-256 of the files that generate schedules (computed once per process)."""
    global _digest
    if _digest is None:
        root = Path(__file__).resolve().parents[2]
        digest = hashlib.sha256()
        for name in _SOURCES:
            digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
        _digest = digest.hexdigest()
    return _digest


def _key(name: str, stages: int, micro_batches: int, virtual_stages: int, what: str = "program") -> str:
    return f"{FORMAT}|{_code_digest()}|{what}|{name}|{stages}|{micro_batches}|{virtual_stages}"


def _entry_path(key: str) -> Path:
    return cache_dir() / _SUBDIR / (hashlib.sha256(key.encode()).hexdigest() + ".npz")


def cached_program(
    name: str, stages: int, micro_batches: int, virtual_stages: int, build: Callable[[], TimingProgram]
) -> TimingProgram:
    """The program of schedule ``name`` for ``(p, m, v)``: read from the cache, or ``build()``
    and stored (a cache that cannot be read or written only costs the building)."""
    if not cache_enabled():
        return build()
    key = _key(str(name), stages, micro_batches, virtual_stages)
    path = _entry_path(key)
    program = _read(path, key)
    if program is not None:
        stats["hit"] += 1
        return program
    program = build()
    _store(path, key, program)
    return program


def _read(path: Path, key: str) -> TimingProgram | None:
    try:
        with np.load(path, allow_pickle=False) as entry:
            if str(entry["key"]) != key:
                raise ValueError("the entry is another key's")
            ranks, chunks, split = (int(x) for x in entry["shape"])
            steps = entry["steps"]
        _check(steps, ranks, chunks)
        columns = [steps[:, k].tolist() for k in range(3)]  # three flat lists: far cheaper than rows
    except FileNotFoundError:
        stats["miss"] += 1
        return None
    except Exception as e:  # noqa: BLE001 - an unusable entry is a miss, rebuilt and overwritten
        _log.debug("schedule-program cache: ignoring %s (%s: %s)", path, type(e).__name__, e)
        stats["rejected"] += 1
        return None
    return TimingProgram.of_columns(ranks, chunks, *columns, split=bool(split))


def _check(steps: np.ndarray, ranks: int, chunks: int) -> None:
    """Raise ValueError unless ``steps`` is a program of ``ranks`` ranks and ``chunks`` chunks."""
    if ranks < 1 or chunks < 1 or steps.ndim != 2 or steps.shape[1] != 3 or steps.dtype.kind != "i":
        raise ValueError("not a table of (rank, slot, message) steps")
    rank, slot, message = steps[:, 0], steps[:, 1], steps[:, 2]
    index = np.arange(len(steps))
    sends, receives = slot == TimingProgram.SEND, slot == TimingProgram.RECEIVE
    compute = ~(sends | receives)
    if ((rank < 0) | (rank >= ranks)).any() or ((slot < 0) & compute).any():
        raise ValueError("a rank or a slot out of range")
    if (slot[compute] >= len(COMPUTE) * ranks * chunks).any() or (message[compute] != 0).any():
        raise ValueError("a compute step out of range")
    if (message[sends] != index[sends]).any():
        raise ValueError("a send that does not name its own step")
    waited = message[receives]
    if not ((waited < index[receives]).all() and np.array_equal(np.sort(waited), index[sends])):
        raise ValueError("receives that do not wait for each earlier send once")


def _store(path: Path, key: str, program: TimingProgram) -> None:
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer,
        key=np.array(key),
        shape=np.array([program.ranks, program.chunks, int(program.split)], dtype=np.int64),
        steps=np.array(program.columns, dtype=np.int32).reshape(3, -1).T,
    )
    stats["stored" if write_entry(path, buffer.getvalue()) else "unwritable"] += 1


def cached_order(
    name: str, stages: int, micro_batches: int, virtual_stages: int, build: Callable[[], OrderArrays]
) -> OrderArrays:
    """The compute order of schedule ``name`` for ``(p, m, v)`` as arrays: read from the cache, or
    ``build()`` and stored (as :func:`cached_program`)."""
    if not cache_enabled():
        return build()
    key = _key(str(name), stages, micro_batches, virtual_stages, "order")
    path = _entry_path(key)
    try:
        with np.load(path, allow_pickle=False) as entry:
            if str(entry["key"]) != key:
                raise ValueError("the entry is another key's")
            order = OrderArrays(
                stages, virtual_stages, entry["kinds"], entry["model_chunks"], entry["starts"].astype(np.int64)
            )
        order.check()
    except FileNotFoundError:
        stats["miss"] += 1
    except Exception as e:  # noqa: BLE001 - an unusable entry is a miss, rebuilt and overwritten
        _log.debug("schedule-order cache: ignoring %s (%s: %s)", path, type(e).__name__, e)
        stats["rejected"] += 1
    else:
        stats["hit"] += 1
        return order
    order = build()
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer, key=np.array(key), kinds=order.kinds, model_chunks=order.model_chunks, starts=order.starts
    )
    stats["stored" if write_entry(path, buffer.getvalue()) else "unwritable"] += 1
    return order
