"""Timing programs kept on disk: a hit is the program built, anything doubtful is rebuilt."""

from __future__ import annotations

import os

import numpy as np
import pytest

from planner.search import program_cache
from runtime.contract.schedule_ir import TimingProgram, interleaved_one_f_one_b

TIMES = dict(forward_time=[1.0, 1.5, 0.5, 2.0, 1.0, 1.25], backward_time=[2.0, 3.0, 1.0, 4.0, 2.5, 2.0], send_time=0.1)


def _program(builds: list) -> TimingProgram:
    def build() -> TimingProgram:
        builds.append(1)
        return TimingProgram.of(interleaved_one_f_one_b(3, 6, 2))

    return program_cache.cached_program("interleaved", 3, 6, 2, build)


def test_a_hit_is_the_program_built(cache):
    builds: list = []
    built = _program(builds)
    read = _program(builds)
    assert len(builds) == 1 and dict(program_cache.stats) == {"miss": 1, "stored": 1, "hit": 1}
    assert [tuple(step) for step in read.steps] == list(built.steps)
    assert (read.ranks, read.chunks, read.messages, read.split) == (built.ranks, built.chunks, built.messages, False)
    assert read.makespan(**TIMES) == built.makespan(**TIMES)
    assert [path.suffix for path in cache.iterdir()] == [".npz"]


def _rewrite(path, **changes) -> None:
    with np.load(path) as entry:
        arrays = {name: entry[name] for name in entry.files}
    arrays.update(changes)
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    "damage",
    ["truncated", "other key", "receive before its send", "message received twice", "slot out of range"],
)
def test_a_doubtful_entry_is_rebuilt_and_overwritten(cache, damage):
    builds: list = []
    built = _program(builds)
    (path,) = cache.iterdir()
    steps = np.array(built.steps, dtype=np.int32)
    receives = np.flatnonzero(steps[:, 1] == TimingProgram.RECEIVE)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "other key":
        _rewrite(path, key=np.array("1|another schedule"))
    elif damage == "receive before its send":
        steps[receives[0], 2] = receives[0] + 1
        _rewrite(path, steps=steps)
    elif damage == "message received twice":
        steps[receives[1], 2] = steps[receives[0], 2]
        _rewrite(path, steps=steps)
    else:
        steps[0, 1] = 3 * 3 * 2
        _rewrite(path, steps=steps)
    again = _program(builds)
    assert len(builds) == 2 and program_cache.stats["rejected"] == 1
    assert again.makespan(**TIMES) == built.makespan(**TIMES)
    assert _program(builds).makespan(**TIMES) == built.makespan(**TIMES) and len(builds) == 2  # overwritten


def test_off_or_unwritable_only_costs_the_building(cache, monkeypatch):
    builds: list = []
    monkeypatch.setenv("PLANNER_CACHE", "off")
    _program(builds)
    assert not cache.exists() and len(builds) == 1
    monkeypatch.delenv("PLANNER_CACHE")
    cache.parent.mkdir(exist_ok=True)
    cache.write_text("a file where the folder should be")
    assert _program(builds).makespan(**TIMES) == TimingProgram.of(interleaved_one_f_one_b(3, 6, 2)).makespan(**TIMES)
    assert program_cache.stats["unwritable"] == 1 and os.path.isfile(cache)
