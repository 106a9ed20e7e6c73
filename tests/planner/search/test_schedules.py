"""planner.search.schedule_search: the schedule pins and their errors, the simulated pricing and the
choice between 1F1B, interleaved and zero bubble."""

from __future__ import annotations

import copy
import dataclasses
import json
import random

import pytest

from cost_models.hardware import load_hardware
from cost_models.schedule_cost import ChunkTimes
from planner.cli import main
from planner.plan import Plan
from planner.search.request import PlanRequest
from planner.search.schedule_search import build_schedule, schedule_options, simulate_pipeline, step_bound
from planner.search.search_errors import SearchError
from planner.search.solve import solve
from runtime.contract.schedule_ir import analyze, interleaved_one_f_one_b, one_f_one_b, zero_bubble_h1
from tests.helpers import SMALL_GPT_FLAGS, gpt_table

HW = load_hardware("a100-80gb", 8)
TABLE = gpt_table(layers=16, hidden=1024, heads=16, vocab=8192)


def _req(**kw) -> PlanRequest:
    base = dict(
        spec="gpt",
        gpus=8,
        gpus_per_node=8,
        hardware="a100-80gb",
        global_batch=8,
        seq_len=1024,
        dtype="bf16",
        compile="off",
    )
    return PlanRequest(**{**base, **kw})


@pytest.mark.parametrize(
    "name, v", [("1f1b", 1), ("zero-bubble", 1), ("interleaved", 2), ("interleaved", 3), ("interleaved", 4)]
)
def test_extrapolated_makespan_equals_the_full_simulation(name, v):
    """Long schedules are simulated at two short lengths and extended at the steady state's pace:
    never below the full simulation, within 1% of it (unequal chunks, sends included)."""
    rng = random.Random(v)
    p, m = 4, 32
    n = p * v
    f = tuple(rng.uniform(1, 2) for _ in range(n))
    b = tuple(2 * x * rng.uniform(0.9, 1.3) for x in f)
    w = tuple(x * 0.4 for x in b) if name == "zero-bubble" else None
    times = ChunkTimes(f, tuple(x * 0.6 for x in b) if w else b, w, 0.05)
    full = {
        "1f1b": lambda: one_f_one_b(p, m),
        "zero-bubble": lambda: zero_bubble_h1(p, m),
        "interleaved": lambda: interleaved_one_f_one_b(p, m, v),
    }[name]()
    exact = analyze(
        full, forward_time=times.forward_s, backward_time=times.backward_s, weight_time=w, send_time=0.05
    ).makespan
    got = simulate_pipeline(name, p, m, v, times).makespan_s
    assert exact * (1 - 1e-12) <= got <= exact * 1.01


def test_options_follow_the_micro_batch_rules():
    from cost_models.strategy import Candidate

    c = Candidate(dp=1, tp=1, pp=4, zero_stage=0, micro_batch_size=1, num_micro_batches=8)
    opts = schedule_options(c, rows=10)
    assert ("1f1b", 1) in opts and ("zero-bubble", 1) in opts and ("interleaved", 2) in opts
    assert ("interleaved", 3) not in opts  # 4 x 3 chunks > 10 rows
    odd = dataclasses.replace(c, num_micro_batches=6)
    assert not [o for o in schedule_options(odd, rows=10) if o[0] == "interleaved"]  # 6 % 4 != 0
    assert schedule_options(dataclasses.replace(c, pp=1), rows=10) == [("1f1b", 1)]


def test_bubble_bound_picks_interleaved_or_zero_bubble_where_the_bubble_dominates():
    """pp 8 with 8 micro-batches: 1F1B idles (p - 1) / (m + p - 1) = 47% of the step, so another
    schedule wins; the plan records it with the gain over the best plain 1F1B plan."""
    sol = solve(_req(pp=8, dp=1, tp=1, micro_batch=1), TABLE, HW)
    pinned = solve(_req(pp=8, dp=1, tp=1, micro_batch=1, schedule="1f1b"), TABLE, HW)
    plan = sol.plan
    assert plan.schedule in ("interleaved", "zero-bubble")
    assert plan.predicted.step_time_s < 0.9 * pinned.plan.predicted.step_time_s
    assert sol.evaluation.extra["plain_step_s"] == pytest.approx(pinned.plan.predicted.step_time_s)
    assert len(plan.stages) == plan.pp * plan.virtual_stages
    back = Plan.from_dict(json.loads(plan.to_json()))  # plan.json round trip with the schedule
    assert (back.schedule, back.virtual_stages, back.stages) == (plan.schedule, plan.virtual_stages, plan.stages)
    for sched in ("interleaved", "zero-bubble"):
        got = solve(_req(pp=8, dp=1, tp=1, micro_batch=1, schedule=sched), TABLE, HW).plan
        assert got.schedule == sched and got.predicted.step_time_s < pinned.plan.predicted.step_time_s
        assert sum(got.predicted.time.values()) == pytest.approx(got.predicted.step_time_s)


def test_one_f_one_b_where_the_schedule_does_not_matter():
    """Without a pipeline there is nothing to schedule; pinned v is honoured."""
    sol = solve(_req(gpus=1, global_batch=4), TABLE, HW)
    assert (sol.plan.schedule, sol.plan.virtual_stages) == ("1f1b", 1)
    pinned = solve(_req(pp=4, dp=1, tp=2, micro_batch=1, schedule="interleaved", virtual_stages=2), TABLE, HW)
    assert (pinned.plan.schedule, pinned.plan.virtual_stages, len(pinned.plan.stages)) == ("interleaved", 2, 8)


def test_step_bound_is_below_the_simulation():
    rng = random.Random(3)
    from cost_models.strategy import Candidate, NumericTable, candidate_costs

    nt = NumericTable(TABLE)
    for p, v, name in ((4, 2, "interleaved"), (4, 1, "zero-bubble"), (2, 3, "interleaved")):
        cand = Candidate(dp=1, tp=1, pp=p, zero_stage=0, micro_batch_size=1, num_micro_batches=2 * p)
        cc = candidate_costs(nt, HW, "bf16", 1024, cand, 8, HW.memory_bytes)
        n = p * v
        f = tuple(rng.uniform(1, 2) for _ in range(n))
        w = tuple(rng.uniform(0.5, 1) for _ in range(n)) if name == "zero-bubble" else None
        times = ChunkTimes(f, tuple(rng.uniform(1, 3) for _ in range(n)), w, 0.1)
        chunks = tuple((i, i) for i in range(n))
        tail = max(sum(l.dp_step_s + l.opt_s for c in range(r, n, p) for l in cc.layers[c : c + 1]) for r in range(p))
        assert step_bound(cc, chunks, times) <= simulate_pipeline(name, p, 2 * p, v, times).makespan_s + tail


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(virtual_stages=2), "--virtual-stages 2 needs --schedule interleaved"),
        (dict(virtual_stages=2, schedule="zero-bubble"), "not zero-bubble. Add --schedule interleaved"),
        (dict(schedule="zero-bubble", pp=1), "needs a pipeline (pp >= 2), but --pp is 1"),
        (dict(schedule="interleaved", gpus=1, global_batch=4), "there is one device"),
        (
            dict(schedule="interleaved", pp=4, dp=1, tp=2, micro_batch=1, global_batch=6),
            "6 micro-batches is not a multiple of 4",
        ),
        (dict(schedule="interleaved", pp=8, virtual_stages=3), "24 model chunks, more than the layer table's 18 rows"),
    ],
)
def test_contradicting_pins_are_clear_errors(kw, message):
    with pytest.raises(SearchError) as err:
        solve(_req(**kw), TABLE, HW)
    assert message in str(err.value)


def test_interleaved_error_lists_micro_batch_sizes_that_work():
    with pytest.raises(SearchError) as err:
        solve(_req(schedule="interleaved", pp=4, dp=1, tp=2, global_batch=12, micro_batch=2), TABLE, HW)
    assert "Micro-batch counts that work: multiples of 4 (--micro-batch 1, 3)" in str(err.value)


def test_cli_pins_and_exit_2(tmp_path, capsys):
    out = tmp_path / "p.json"
    common = [
        "plan",
        *SMALL_GPT_FLAGS,
        "--gpus",
        "2",
        "--gpus-per-node",
        "2",
        "--hardware",
        "cpu",
        "--global-batch",
        "8",
        "--seq-len",
        "16",
        "--dtype",
        "fp32",
        "--out",
        str(out),
    ]
    assert main(common + ["--json", "--pp", "2", "--schedule", "zero-bubble"]) == 0
    assert '"schedule": "zero-bubble"' in capsys.readouterr().out
    assert main(common + ["--schedule", "zero-bubble", "--pp", "1"]) == 2
    err = capsys.readouterr().err
    assert "--schedule zero-bubble needs a pipeline" in err and "Traceback" not in err


def test_report_and_plot_show_the_chosen_schedule(tmp_path):
    from rich.console import Console

    from planner.report.plot import plot_plan
    from planner.report.render import render_plan

    sol = solve(_req(pp=4, dp=1, tp=2, micro_batch=1, schedule="interleaved", virtual_stages=2), TABLE, HW)
    console = Console(record=True, width=200)
    render_plan(sol.plan, HW, console, sol)
    text = console.export_text()
    assert "interleaved 1F1B, v=2 model chunks per rank" in text
    assert "than the best plain 1F1B plan" in text
    # one row per pipeline rank with the rows of its chunks (rank 3 runs chunks 3 and 7 of 8)
    first, last = sol.plan.stages[3], sol.plan.stages[7]
    assert "rows of its chunks" in text and f"{first[0]}-{first[1]}, {last[0]}-{last[1]} (" in text
    assert plot_plan(sol.plan, str(tmp_path / "s.png"), hw=HW, evaluation=sol.evaluation)
    assert (tmp_path / "s.png").stat().st_size > 0


def test_deep_interleaving_lists_one_row_per_rank_with_its_chunks_abridged():
    """pp 2 with v 8 (16 chunks of 18 rows): two rows, one per rank, each with its first chunks'
    rows, an ellipsis and its last chunk's, and the rank's own micro-step and memory."""
    from rich.console import Console

    from planner.report.render import render_plan

    sol = solve(_req(pp=2, dp=1, tp=4, micro_batch=1, schedule="interleaved", virtual_stages=8), TABLE, HW)
    stages = sol.plan.stages
    assert len(stages) == 16
    console = Console(record=True, width=200)
    render_plan(sol.plan, HW, console, sol)
    text = console.export_text()
    table = text[text.index("Pipeline stages") : text.index("Memory per device")]
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in table.splitlines() if "…" in line]

    def span(chunk: int) -> str:
        first, last = stages[chunk]
        return f"{first}-{last}" if last > first else str(first)

    expected = []
    for rank in (0, 1):
        mine = list(range(rank, 16, 2))
        count = sum(stages[c][1] - stages[c][0] + 1 for c in mine)
        expected.append([str(rank), ", ".join(map(span, mine[:3])) + f", …, {span(mine[-1])} ({count})"])
    assert [row[0:1] + row[2:3] for row in cells] == expected
    micro_steps = [row[4] for row in cells]
    assert all(step.endswith("ms") for step in micro_steps)  # each rank's own micro-step


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zero-bubble", 1)])
def test_activations_held_follow_each_chunks_size(name, v):
    """Equal chunks: the followed bytes are the counted chunks. Unequal ones: a rank whose bigger
    chunk is in flight more often holds more than the average says (interleaved), and gradients
    kept for W count only while their W is pending (zero bubble)."""
    p, m = 4, 8
    n = p * v
    base = ChunkTimes(tuple([1.0] * n), tuple([2.0] * n), (1.0,) * n if name == "zero-bubble" else None, 0.0)
    counted = simulate_pipeline(name, p, m, v, base)
    even = simulate_pipeline(
        name,
        p,
        m,
        v,
        dataclasses.replace(base, act_bytes=(5.0,) * n, keep_bytes=(0.0,) * n if name == "zero-bubble" else None),
    )
    if name != "zero-bubble":
        assert even.held == pytest.approx(counted.held)
    sizes = tuple(float(1 + 3 * (c < p)) for c in range(n))  # the first p chunks 4x the others
    uneven = simulate_pipeline(name, p, m, v, dataclasses.replace(base, act_bytes=sizes))
    sched = build_schedule(name, p, m, v)
    release = "W" if name == "zero-bubble" else "B"
    for r, acts in enumerate(sched):  # the bytes held when each backward starts, walked by hand
        live = at_backward = 0.0
        for a in acts:
            c = a.chunk * p + r
            if a.kind == "B":
                at_backward = max(at_backward, live)
            if a.kind == "F":
                live += sizes[c]
            elif a.kind == release:
                live -= sizes[c]
        per_mb = sum(sizes[c * p + r] for c in range(v))
        assert uneven.held[r] * per_mb == pytest.approx(at_backward)
    if name == "interleaved":  # rank 0 runs its big chunk's warm-up forwards first
        assert uneven.held[0] > counted.held[0]


def test_zero_bubble_frees_the_loss_tail_at_b_and_keeps_gradients_until_w():
    """ZB-H1's last rank, p=2, m=4 (F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3), activations A of which
    the loss tail T goes at B, kept gradients K from B to W. When B3 starts the rank holds
    mb 2's A - T + K and mb 3's A; at the end of any B (before its outputs drop), 2A + 2K - T.
    The first chunk has no B: nothing of it is freed early (``free_bytes`` 0 there)."""
    A, T, K = 25.0, 16.0, 20.0
    times = ChunkTimes(
        (1.0, 1.0), (2.0, 2.0), (1.0, 1.0), 0.0, act_bytes=(10.0, A), keep_bytes=(0.0, K), free_bytes=(0.0, T)
    )
    sim = simulate_pipeline("zero-bubble", 2, 4, 1, times)
    assert sim.held[1] * A == pytest.approx(2 * A - T + K)
    assert sim.held_between[1] * A == pytest.approx(2 * A + 2 * K - T)
    without = simulate_pipeline("zero-bubble", 2, 4, 1, dataclasses.replace(times, free_bytes=None))
    assert without.held[1] * A == pytest.approx(2 * A + K)


def _kept_strategies(fillers):
    """A deep pipeline (pp 8, 8 micro-batches: a 47% bubble under 1F1B) and a pp-1 strategy
    re-labelled at the step times ``fillers(deep 1F1B step, deep's lower bound, deep's best)``: a
    search result whose fifth strategy under 1F1B is the only one another schedule speeds up."""
    from cost_models.strategy import NumericTable, candidate_costs
    from planner.search.schedule_search import best_schedule, schedule_bounds

    nt = NumericTable(TABLE)
    deep = solve(_req(pp=8, dp=1, tp=1, micro_batch=1, schedule="1f1b"), TABLE, HW).evaluation
    flat = solve(_req(pp=1, dp=8, tp=1, micro_batch=1), TABLE, HW).evaluation
    cc_of = {
        ev.strategy.candidate: candidate_costs(nt, HW, "bf16", 1024, ev.strategy.candidate, 8, HW.memory_bytes * 0.9)
        for ev in (deep, flat)
    }
    rows = len(nt.layers)
    opts = schedule_options(deep.strategy.candidate, rows)
    lower = min(b[0] for b in schedule_bounds(cc_of[deep.strategy.candidate], deep, opts))
    best = best_schedule(cc_of[deep.strategy.candidate], deep, opts)
    assert best.strategy.schedule != "1f1b" and lower <= best.step_time_s < deep.step_time_s
    others = [dataclasses.replace(flat, step_time_s=t) for t in fillers(deep.step_time_s, lower, best.step_time_s)]
    from planner.search.ilp import SearchResult

    return SearchResult(ranked=others + [deep]), cc_of, rows, deep, best


def test_a_strategy_below_the_fourth_under_1f1b_wins_under_its_best_schedule():
    """Four strategies faster than the deep pipeline under 1F1B, slower than it under its best
    schedule: the bound walk prices the fifth and it wins (re-pricing only the first four kept
    1F1B's fastest of them); the four still rank behind it, as the plan's runners-up."""
    from planner.search.schedule_search import apply_schedules

    res, cc_of, rows, deep, best = _kept_strategies(
        lambda one, lower, best: [best + (one - best) * k / 5 for k in (1, 2, 3, 4)]
    )
    out = apply_schedules(res, cc_of, rows)
    assert out.best.strategy.candidate == deep.strategy.candidate
    assert out.best.strategy.schedule == best.strategy.schedule
    assert out.best.step_time_s == pytest.approx(best.step_time_s)
    assert out.best.extra["plain_step_s"] == res.ranked[0].step_time_s
    assert [e.step_time_s for e in out.ranked[1:]] == [e.step_time_s for e in res.ranked[:4]]
    assert apply_schedules(res, cc_of, rows, keep=5).best.step_time_s == out.best.step_time_s


def test_the_bound_walk_stops_where_no_schedule_can_win(monkeypatch):
    """When the four fastest under 1F1B beat even the deep pipeline's lower bound, it is not
    priced (one pricing per shown strategy, none for it) and keeps its 1F1B price."""
    import planner.search.schedule_search as schedules

    res, cc_of, rows, deep, _best = _kept_strategies(lambda one, lower, best: [lower * k / 10 for k in (6, 7, 8, 9)])
    calls = []
    real = schedules._best
    monkeypatch.setattr(schedules, "_best", lambda cc, ev, *a: calls.append(ev) or real(cc, ev, *a))
    out = schedules.apply_schedules(res, cc_of, rows)
    assert len(calls) == 4 and deep not in calls
    assert out.ranked[-1] is deep and out.best is res.ranked[0]


def test_schedules_that_do_not_fit_are_not_simulated(monkeypatch):
    """A schedule's memory follows from its action order: with room for little more than 1F1B's
    activations, best_schedule simulates only schedules that fit, and picks what pricing every
    option in full picks."""
    import planner.search.schedule_search as schedules
    from cost_models.strategy import memory_bound

    res, cc_of, rows, deep, _best = _kept_strategies(lambda *a: [])
    cc = copy.copy(cc_of[deep.strategy.candidate])
    cc.capacity = memory_bound(deep)
    opts = schedule_options(deep.strategy.candidate, rows)
    priced = [ev for o in opts if (ev := schedules.price_schedule(cc, deep, *o)) is not None and ev.feasible]
    assert 1 < len(priced) < len(opts)  # some fit, some do not
    sims = []
    real = schedules._makespan
    monkeypatch.setattr(schedules, "_makespan", lambda *a: sims.append(a) or real(*a))
    got = schedules.best_schedule(cc, deep, opts)
    fitting = {(ev.strategy.schedule, ev.strategy.virtual_stages) for ev in priced}
    assert sims and {(a[0], a[3]) for a in sims} <= fitting
    want = min(priced, key=lambda ev: ev.step_time_s)
    assert (got.strategy.schedule, got.strategy.virtual_stages) == (
        want.strategy.schedule,
        want.strategy.virtual_stages,
    )
    assert got.step_time_s == pytest.approx(want.step_time_s)


def test_a_higher_zero_stage_makes_room_for_the_schedule():
    """The search keeps a triple's fastest strategy under 1F1B (ZeRO 0 here). Where zero bubble or
    interleaved does not fit beside its model state, the same stages at ZeRO 1 (a candidate the
    search enumerated) are priced too, and win if they fit; the triple keeps one strategy."""
    from cost_models.strategy import NumericTable, candidate_costs, evaluate, memory_bound
    from planner.search.ilp import SearchResult
    from planner.search.schedule_search import apply_schedules, price_schedule

    nt = NumericTable(TABLE)
    rows = len(nt.layers)
    base = solve(
        _req(gpus=16, global_batch=16, pp=8, dp=2, tp=1, micro_batch=1, zero_stage=0, schedule="1f1b"), TABLE, HW
    ).evaluation
    c0 = base.strategy.candidate
    c1 = dataclasses.replace(c0, zero_stage=1)

    def costs(c, cap):
        return candidate_costs(nt, HW, "bf16", 1024, c, 8, cap)

    def fastest(cc, ev):  # the best schedule but 1F1B, priced in full
        got = [
            e
            for o in schedule_options(cc.cand, rows)
            if o[0] != "1f1b" and (e := price_schedule(cc, ev, *o)) is not None
        ]
        return min(got, key=lambda e: e.step_time_s)

    roomy = HW.memory_bytes * 0.9
    same_stages = evaluate(
        costs(c1, roomy), base.strategy.stages, sorted(base.strategy.checkpoint), sorted(base.strategy.selective)
    )
    sharded = fastest(costs(c1, roomy), same_stages)
    plain = fastest(costs(c0, roomy), base)
    assert memory_bound(sharded) < memory_bound(plain) and memory_bound(base) <= memory_bound(sharded)
    cap = memory_bound(sharded)  # room for ZeRO 1's schedule, not ZeRO 0's
    cc_of = {c0: costs(c0, cap), c1: costs(c1, cap)}
    out = apply_schedules(SearchResult(ranked=[base]), cc_of, rows)
    assert len(out.ranked) == 1 and out.best.strategy.candidate == c1
    assert out.best.strategy.schedule == sharded.strategy.schedule
    assert out.best.step_time_s == pytest.approx(sharded.step_time_s)
    assert out.best.step_time_s < base.step_time_s and out.best.strategy.stages == base.strategy.stages
    # without the ZeRO 1 candidate (a --zero-stage 0 pin), the triple stays 1F1B at ZeRO 0
    pinned = apply_schedules(SearchResult(ranked=[base]), {c0: cc_of[c0]}, rows)
    assert pinned.best.strategy.candidate == c0 and pinned.best.step_time_s <= base.step_time_s


def test_the_compute_order_is_the_schedules_compute_actions():
    """``compute_order`` (what the memory analyses read, built without the messages) equals each
    schedule's compute actions, and refuses what the schedule refuses."""
    import itertools

    from planner.search.schedule_search import build_schedule, compute_order
    from runtime.contract.choices import ScheduleName
    from runtime.contract.schedule_ir import B, F, ScheduleError, W

    compared = 0
    for name, p, m in itertools.product(
        (ScheduleName.ONE_F_ONE_B, ScheduleName.INTERLEAVED, ScheduleName.ZERO_BUBBLE),
        (1, 2, 3, 4),
        (1, 2, 3, 4, 8, 12),
    ):
        for v in (1, 2, 3) if name == ScheduleName.INTERLEAVED else (1,):
            try:
                full = build_schedule(name, p, m, v)
            except (ScheduleError, ValueError):
                with pytest.raises((ScheduleError, ValueError)):
                    compute_order(name, p, m, v)
                continue
            assert compute_order(name, p, m, v) == tuple(tuple(a for a in acts if a.kind in (F, B, W)) for acts in full)
            compared += 1
    assert compared > 40
