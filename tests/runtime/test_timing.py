"""runtime.timing: exclusive attribution of a step's time to its parts, group -> part mapping, the
recomputation hooks, and how runtime.distributed.comm charges blocking collectives and waits."""

from __future__ import annotations

import pytest
import torch

import runtime
from planner.plan import TIME_KEYS
from runtime import timing
from runtime.distributed import comm
from runtime.timing import PARTS, PartTimer


class FakeClock:
    """A clock that reads ``now``; tests move it by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_parts_are_the_predicted_time_keys():
    # The runtime cannot import the planner; this keeps its list and plan.json's the same.
    assert PARTS == TIME_KEYS


def test_nested_parts_count_once_in_the_innermost():
    clk = FakeClock()
    t = PartTimer(clock=clk)
    t.start()
    clk.now = 1.0
    assert t.enter("optimizer")
    clk.now = 3.0
    with t.part("dp_comm"):  # an all-gather inside the optimizer step
        clk.now = 4.0
    clk.now = 6.0
    t.exit()
    clk.now = 7.0
    with t.part("recompute"):
        clk.now = 7.5
        with t.part("tp_comm"):  # an all-reduce inside a recomputed forward
            clk.now = 8.0
        clk.now = 9.0
    clk.now = 10.0
    seconds, parts = t.stop()
    assert seconds == 10.0
    assert parts == {
        "compute": 3.0,
        "recompute": 1.5,
        "tp_comm": 0.5,
        "pp_bubble": 0.0,
        "dp_comm": 1.0,
        "optimizer": 4.0,
        "offload": 0.0,
        "ep_comm": 0.0,
        "cp_comm": 0.0,
    }
    assert list(parts) == list(PARTS)
    assert sum(parts.values()) == pytest.approx(seconds)


def test_outside_a_step_nothing_counts_and_stop_closes_open_parts():
    clk = FakeClock()
    t = PartTimer(clock=clk)
    assert not t.active and not t.enter("dp_comm")
    t.exit()  # harmless
    with t.part("pp_bubble"):
        clk.now = 2.0
    t.start()
    t.enter("pp_bubble")
    clk.now = 5.0
    seconds, parts = t.stop()  # an exception left the part open: the step closes it
    assert seconds == 3.0 and parts["pp_bubble"] == 3.0 and parts["compute"] == 0.0
    t.exit()  # the late exit of that part changes nothing
    t.start()
    clk.now = 6.0
    assert t.stop().parts == dict.fromkeys(PARTS, 0.0) | {"compute": 1.0}


def test_unknown_part_and_none():
    t = PartTimer(clock=FakeClock())
    with pytest.raises(ValueError, match="unknown part 'offlaod'"):
        t.enter("offlaod")
    t.start()
    with t.part(None):  # a collective over a group no mesh registered
        pass
    assert t.stop().parts["compute"] == 0.0


def test_sync_runs_at_every_boundary():
    calls = []
    t = PartTimer(clock=FakeClock())
    t.sync = lambda: calls.append(1)
    t.start()
    with t.part("tp_comm"):
        pass
    t.stop()
    assert len(calls) == 4  # start, enter, exit, stop


@pytest.fixture
def groups():
    timing.forget_groups()
    g = {axis: object() for axis in ("tp", "cp", "dp", "pp", "tied")}
    for axis, grp in g.items():
        timing.register_group(grp, axis)
    yield g
    timing.forget_groups()


def test_group_to_part(groups):
    assert {a: timing.part_of(g) for a, g in groups.items()} == {
        "tp": "tp_comm",
        "cp": "cp_comm",
        "dp": "dp_comm",
        "pp": "pp_bubble",
        "tied": "dp_comm",
    }
    assert timing.part_of(None) is None and timing.part_of(object()) is None
    with pytest.raises(ValueError, match="unknown axis"):
        timing.register_group(object(), "sp")
    expert_group = object()
    timing.register_group(expert_group, "ep")  # runtime.moe's all-to-all
    assert timing.part_of(expert_group) == "ep_comm"
    timing.forget_groups()
    assert timing.part_of(groups["tp"]) is None


class FakeWork:
    def __init__(self, clk: FakeClock, seconds: float):
        self.clk, self.seconds = clk, seconds

    def wait(self):
        self.clk.now += self.seconds

    def is_completed(self):
        return False


def test_comm_charges_blocking_calls_and_waits_to_their_group(groups, monkeypatch):
    clk = FakeClock()
    monkeypatch.setattr(timing, "TIMER", PartTimer(clock=clk))
    timing.TIMER.start()

    def blocking(seconds):
        def fn():
            clk.now += seconds

        return fn

    comm._guard("all_reduce", 8, groups["tp"], blocking(1.0))
    pending = comm._guard("all_reduce", 8, groups["dp"], lambda: FakeWork(clk, 2.0), blocking=False)
    assert isinstance(pending, comm.Pending) and pending.part == "dp_comm" and not pending.is_completed()
    clk.now += 0.5  # compute while the reduction runs
    with timing.part("optimizer"):
        comm.wait(pending)
        clk.now += 0.25
    comm.wait(comm.Pending(FakeWork(clk, 4.0), timing.part_of(groups["pp"])))
    comm.wait(None)
    seconds, parts = timing.TIMER.stop()
    assert parts == {
        "compute": 0.5,
        "recompute": 0.0,
        "tp_comm": 1.0,
        "pp_bubble": 4.0,
        "dp_comm": 2.0,
        "optimizer": 0.25,
        "offload": 0.0,
        "ep_comm": 0.0,
        "cp_comm": 0.0,
    }
    assert seconds == 7.75


def test_overlapped_launch_counts_as_compute_and_a_finished_wait_costs_nothing(groups, monkeypatch):
    """What overlap buys in the breakdown: the launch of an asynchronous reduction (here 0.25 s of
    enqueueing) stays in the part that launched it, ``compute`` at the top; the wait on a
    collective that finished under that compute adds nothing to ``dp_comm``, and only the part of
    a wait that still blocks counts there."""
    clk = FakeClock()
    monkeypatch.setattr(timing, "TIMER", PartTimer(clock=clk))
    timing.TIMER.start()

    def launch(remaining: float):
        def fn():
            clk.now += 0.25  # the launch itself
            return FakeWork(clk, remaining)

        return fn

    done = comm._guard("all_reduce", 8, groups["dp"], launch(0.0), blocking=False)
    late = comm._guard("all_gather", 8, groups["dp"], launch(0.75), blocking=False)
    clk.now += 1.0  # backward / forward compute while both are in flight
    comm.wait(done)  # finished under the compute
    comm.wait(late)  # 0.75 s still to go: exposed
    seconds, parts = timing.TIMER.stop()
    assert parts["compute"] == 1.5 and parts["dp_comm"] == 0.75
    assert sum(parts.values()) == seconds == 2.25


class Stage(torch.nn.Module):
    """A stage module as codegen writes one: ``layer_<i>`` children, some checkpointed."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.layer_0 = torch.nn.Linear(8, 8)
        self.layer_1 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        self.checkpointed = checkpointed

    def forward(self, x):
        x = self.layer_0(x)
        x = runtime.checkpoint(self.layer_1, x) if self.checkpointed else self.layer_1(x)
        return x.square().mean()


class TickClock:
    """Each reading is one second after the previous one: a part that is entered gets time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("checkpointed", [True, False])
def test_recomputation_counts_only_forwards_inside_backward(checkpointed, monkeypatch):
    monkeypatch.setattr(timing, "TIMER", PartTimer(clock=TickClock()))
    stage = Stage(checkpointed)
    handles = timing.time_recomputation(stage)
    try:
        timing.TIMER.start()
        stage(torch.randn(4, 8)).backward()
        assert timing.TIMER._stack == [timing.RESIDUAL]  # every part entered was left
        parts = timing.TIMER.stop().parts
    finally:
        for h in handles:
            h.remove()
    assert (parts["recompute"] > 0) == checkpointed, parts


def test_the_breakdown_is_the_critical_ranks_and_sums_to_the_step():
    """Two data-parallel ranks: the fast one waited 80 ms in dp_comm for the slow one, which waited
    20 ms. The step is the longest rank's; the parts are the slow (critical) rank's, the few
    microseconds its step is short of the longest added to compute."""
    from runtime.training.trainer import critical_breakdown

    def row(seconds, **parts):
        return [seconds] + [parts.get(part, 0.0) for part in timing.PARTS]

    fast = row(0.7001, compute=0.6101, dp_comm=0.08, optimizer=0.01)
    slow = row(0.7, compute=0.67, dp_comm=0.02, optimizer=0.01)
    step, parts = critical_breakdown([fast, slow])
    assert step == 0.7001
    assert parts["dp_comm"] == 0.02 and parts["optimizer"] == 0.01
    assert parts["compute"] == pytest.approx(0.6701)
    assert sum(parts.values()) == pytest.approx(step)
    # a pipeline: the stage with the most work is critical, whatever its bubble
    first = row(1.0, compute=0.5, pp_bubble=0.5)
    last = row(0.99, compute=0.7, pp_bubble=0.29)
    assert critical_breakdown([first, last])[1]["pp_bubble"] == 0.29
