"""1-bit Adam on the planner side: the priced exchange and memory against the contract's formulas,
the search's choice on Ethernet and InfiniBand, pins and their conflicts, plan.json, the report and
the DeepSpeed export (no process launches)."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from cost_models.comm_cost import axis_placement
from cost_models.compression_cost import shares, stage_exchange
from cost_models.hardware import load_hardware
from cost_models.strategy import Candidate, NumericTable, candidate_costs, evaluate, warmup_step_s
from planner.cli import main
from planner.commands.plan_command import with_cost
from planner.plan import load_plan, save_plan
from planner.report.deepspeed import to_deepspeed
from planner.report.render import render_plan
from planner.search.compression_search import run_seconds
from planner.search.request import PlanRequest
from planner.search.search_errors import SearchError
from planner.search.solve import solve
from runtime.contract.compressed_exchange import default_warmup, error_buffer_bytes, exchange_bytes
from tests.helpers import gpt_table

GPT_1B3 = gpt_table(layers=24, hidden=2048, heads=16, vocab=50257)
GPT_1B3_NUMERIC = NumericTable(GPT_1B3)
SMALL = gpt_table(layers=3, hidden=128, heads=2, vocab=4096)


def _request(**overrides) -> PlanRequest:
    options = dict(
        spec="gpt",
        gpus=32,
        gpus_per_node=8,
        hardware="v100-32gb-eth100",
        global_batch=512,
        seq_len=2048,
        dtype="fp16",
        compile="off",
    )
    options.update(overrides)
    return PlanRequest(**options)


def _solve(request: PlanRequest, table=GPT_1B3):
    return solve(request, table, load_hardware(request.hardware, request.gpus_per_node))


@pytest.fixture(scope="module")
def ethernet_plans():
    """GPT 1.3B on 4 nodes x 8 V100s with 100 Gb/s Ethernet: free, pinned on, pinned off; a run
    that waits for its gradient reductions (``--overlap off``), whose exposed traffic compression
    cuts (overlapped, full precision hides most of it under backward: about a tie, see below)."""
    return {mode: _solve(_request(dp_compression=mode, overlap="off")) for mode in (None, "onebit-adam", "none")}


def test_overlapped_full_precision_hides_what_compression_would_save():
    free = _solve(_request())
    hidden = free.plan.predicted.hidden["dp_comm"]
    waited = _solve(_request(overlap="off", dp_compression="none"))
    assert hidden > free.plan.predicted.time["dp_comm"] > 0
    assert free.plan.predicted.step_time_s < waited.plan.predicted.step_time_s


def test_ethernet_picks_onebit_adam_and_beats_full_precision(ethernet_plans):
    free, off = ethernet_plans[None], ethernet_plans["none"]
    assert free.plan.dp_compression == "onebit-adam" and free.plan.dp > 1 and free.plan.zero_stage == 0
    assert free.plan.compression_warmup == default_warmup(1000)
    assert free.plan.predicted.step_time_s < off.plan.predicted.step_time_s
    assert off.plan.dp_compression == "none" and off.plan.compression_warmup == 0
    # the best plan without compression is a runner-up, so the gain is visible
    assert any(alt.dp_compression == "none" for alt in free.plan.alternatives)
    assert free.compression is not None and "onebit-adam, because" in free.compression.reason()


def test_free_plan_never_slower_over_the_run_than_either_pin(ethernet_plans):
    steps = 1000
    free = run_seconds(ethernet_plans[None].evaluation, steps)
    for mode in ("onebit-adam", "none"):
        assert free <= run_seconds(ethernet_plans[mode].evaluation, steps) * (1 + 1e-9)


def test_priced_exchange_bytes_and_error_buffers_are_the_contract_s(ethernet_plans):
    evaluation = ethernet_plans["onebit-adam"].evaluation
    cand = evaluation.strategy.candidate
    hw = load_hardware("v100-32gb-eth100")
    costs = candidate_costs(GPT_1B3_NUMERIC, hw, "fp16", 2048, cand, 8, hw.memory_bytes * 0.9)
    plain = dataclasses.replace(cand, dp_compression="none")
    plain_costs = candidate_costs(GPT_1B3_NUMERIC, hw, "fp16", 2048, plain, 8, hw.memory_bytes * 0.9)
    stages, ckpt = evaluation.strategy.stages, sorted(evaluation.strategy.checkpoint)
    mine, theirs = evaluate(costs, stages, ckpt), evaluate(plain_costs, stages, ckpt)
    for k, (first, last) in enumerate(stages):
        numel = sum(costs.layers[i].num_params for i in range(first, last + 1))
        stage, full = mine.stages[k], theirs.stages[k]
        assert stage.exchange.numel == numel
        assert stage.exchange.sent_b == exchange_bytes(numel, cand.dp)
        # no gradient all-reduce: the compressed step sends the exchange instead of the dp traffic
        dp_full = sum(costs.layers[i].warmup_dp_step_sent_b for i in range(first, last + 1))
        assert stage.comm_bytes == pytest.approx(full.comm_bytes - dp_full + exchange_bytes(numel, cand.dp))
        assert stage.warmup_comm_bytes == pytest.approx(full.comm_bytes)
        # stage 0's optimizer state (the stage-1 shards gathered) plus exactly the error buffers
        zero0 = dataclasses.replace(plain, zero_stage=0)
        zero0_costs = candidate_costs(GPT_1B3_NUMERIC, hw, "fp16", 2048, zero0, 8, hw.memory_bytes * 0.9)
        reference = evaluate(zero0_costs, stages, ckpt).stages[k].memory
        assert stage.memory["optimizer"] == reference["optimizer"] + int(error_buffer_bytes(numel, cand.dp))
    predicted = ethernet_plans["onebit-adam"].plan.predicted
    assert predicted.comm_bytes_per_device == mine.comm_bytes_per_device
    assert predicted.compression["warmup_step_time_s"] == pytest.approx(warmup_step_s(mine))


def test_stage_one_is_priced_with_stage_zero_memory():
    hw = load_hardware("v100-32gb-eth100")
    memories = []
    for zero in (0, 1):
        cand = Candidate(16, 2, 1, zero, 4, 8, dp_compression="onebit-adam")
        costs = candidate_costs(GPT_1B3_NUMERIC, hw, "fp16", 2048, cand, 8, hw.memory_bytes)
        memories.append(evaluate(costs, [(0, len(costs.layers) - 1)]).memory)
    assert memories[0]["optimizer"] == memories[1]["optimizer"]


def test_layer_shares_never_exceed_the_exact_stage_exchange():
    hw = load_hardware("v100-16gb-eth25")
    for dp, tp in ((4, 8), (32, 1), (16, 2), (2, 1)):
        placement = axis_placement("dp", dp, tp, 1, 8)
        for numel in (1, 1000, 10**6, 10**9):
            exact = stage_exchange(numel, placement, hw)
            exchange_s, compute_s = shares(numel, placement, hw)
            assert exchange_s <= exact.exchange_s * (1 + 1e-9) and compute_s <= exact.compute_s * (1 + 1e-9)


def test_infiniband_with_hidden_dp_traffic_does_not_compress():
    request = _request(hardware="a100-80gb", gpus=16, global_batch=256, dtype="bf16")
    solution = _solve(request)
    assert solution.plan.dp_compression == "none" and solution.plan.compression_warmup == 0
    assert solution.compression is None  # nothing said on the summary
    out = io.StringIO()
    render_plan(solution.plan, load_hardware("a100-80gb"), Console(file=out, width=120), solution)
    assert "DP compression" not in out.getvalue() and "1-bit Adam" not in out.getvalue()


@pytest.mark.parametrize(
    "pins, words",
    [
        (dict(zero_stage=2), "--zero-stage 0 or 1"),
        (dict(zero_stage=3), "--zero-stage 0 or 1"),
        (dict(offload_optimizer="cpu"), "--offload-optimizer cpu"),
        (dict(dp=1), "more than one data-parallel rank"),
        (dict(gpus=1), "more than one data-parallel rank"),
        (dict(tp=8, pp=4), "more than one data-parallel rank"),
    ],
)
def test_conflicting_pins_are_clear_errors(pins, words):
    with pytest.raises(SearchError, match="--dp-compression onebit-adam") as error:
        _request(dp_compression="onebit-adam", **pins)
    assert words in str(error.value)


def test_cli_conflict_exits_2_without_traceback(tmp_path, capsys):
    code = main(
        [
            "plan",
            "--model",
            "gpt",
            "--layers",
            "2",
            "--hidden",
            "32",
            "--heads",
            "4",
            "--vocab",
            "64",
            "--gpus",
            "8",
            "--hardware",
            "v100-16gb-eth25",
            "--global-batch",
            "8",
            "--seq-len",
            "16",
            "--zero-stage",
            "3",
            "--dp-compression",
            "onebit-adam",
            "--out",
            str(tmp_path / "plan.json"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--dp-compression onebit-adam" in err and "Traceback" not in err


def test_plan_json_report_cost_and_deepspeed(ethernet_plans, tmp_path):
    solution = ethernet_plans[None]
    plan = with_cost(solution.plan, 2048 * 512 * 1000.0, 2.0)
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    data = json.loads(path.read_text())
    assert data["dp_compression"] == "onebit-adam" and data["compression_warmup"] == 150
    assert load_plan(str(path)) == plan
    # the whole run weighs the warm-up at the full-precision step
    warm = plan.predicted.compression["warmup_step_time_s"]
    seconds = 150 * warm + 850 * plan.predicted.step_time_s
    assert plan.predicted.cost["days"] == pytest.approx(seconds / 86400)
    assert sum(plan.predicted.cost["by_part"].values()) == pytest.approx(plan.predicted.cost["money"])
    out = io.StringIO()
    render_plan(plan, load_hardware("v100-32gb-eth100"), Console(file=out, width=160), solution)
    text = out.getvalue()
    assert "DP compression" in text and "in full precision" in text and "150 steps" in text
    optimizer = to_deepspeed(plan)["optimizer"]
    assert optimizer["type"] == "OneBitAdam"
    assert optimizer["params"]["freeze_step"] == 150 and optimizer["params"]["comm_backend_name"] == "nccl"
    assert optimizer["params"]["cuda_aware"] is False and set(optimizer["params"]) >= {"lr", "betas", "eps"}
    assert "optimizer" not in to_deepspeed(ethernet_plans["none"].plan)


def test_a_plan_without_the_keys_loads_uncompressed(ethernet_plans, tmp_path):
    data = ethernet_plans["none"].plan.to_dict()
    del data["dp_compression"], data["compression_warmup"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    plan = load_plan(str(path))
    assert plan.dp_compression == "none" and plan.compression_warmup == 0


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpus=st.sampled_from([8, 16]),
    hardware=st.sampled_from(["v100-16gb-eth25", "v100-32gb-eth100", "a100-80gb"]),
    batch=st.sampled_from([16, 64]),
)
def test_free_plan_is_never_slower_than_a_pin(gpus, hardware, batch):
    request = _request(spec="gpt", gpus=gpus, hardware=hardware, global_batch=batch, seq_len=512, dtype="fp16")
    free = _solve(request, SMALL)
    steps = request.horizon_steps()
    for mode in ("none", "onebit-adam"):
        pinned = _solve(dataclasses.replace(request, dp_compression=mode), SMALL)
        assert run_seconds(free.evaluation, steps) <= run_seconds(pinned.evaluation, steps) * (1 + 1e-6)


def test_train_refuses_a_zero_warmup_before_starting_any_process(tmp_path, capsys):
    from tests.helpers import TINY_GPT, make_plan

    plan = dataclasses.replace(
        make_plan("gpt", dict(TINY_GPT), dp=2), dp_compression="onebit-adam", compression_warmup=3
    )
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    status = main(["train", str(path), "--nproc", "2", "--steps", "4", "--compression-warmup", "0"])
    err = capsys.readouterr().err
    assert status == 2
    assert "--compression-warmup" in err and "at least 1 with 1-bit Adam" in err and "Traceback" not in err
    assert not (tmp_path / "plan.compiled").exists()  # nothing was compiled, no process started


def test_validate_compares_warmup_steps_with_the_warmup_prediction(ethernet_plans):
    """A run that ends inside 1-bit Adam's full-precision warm-up is compared with the warm-up
    step (what ran), one that goes past it with the compressed step."""
    from planner.commands.validate import compare
    from planner.plan import TIME_KEYS

    plan = ethernet_plans["onebit-adam"].plan
    assert plan.dp_compression == "onebit-adam" and plan.compression_warmup > 4
    lines = [
        {"step": i, "step_time_s": 1.0, "peak_memory_bytes": 1, "comm_bytes": 0, "time": dict.fromkeys(TIME_KEYS, 0.0)}
        for i in range(4)
    ]
    warm = plan.predicted.compression
    early = compare(plan, lines)
    assert early["predicted"]["step_time_s"] == warm["warmup_step_time_s"]
    assert early["predicted"]["comm_bytes_per_device"] == warm["warmup_comm_bytes_per_device"]
    assert early["time"]["predicted"] == warm["warmup_time"]
    late = compare(dataclasses.replace(plan, compression_warmup=2), lines)
    assert late["predicted"]["step_time_s"] == plan.predicted.step_time_s
    assert late["time"]["predicted"] == dict(plan.predicted.time)


def test_a_compressed_plan_s_other_zero_stage_is_not_a_runner_up():
    """1-bit Adam keeps stage 0's state after its warm-up and is priced so at ZeRO 0 and 1: the
    same layout, so the winner at one stage never lists itself at the other (it did, as a tie)."""
    table = gpt_table(layers=4, hidden=256, heads=4, vocab=8192)
    request = _request(hardware="v100-16gb-eth25", gpus=2, gpus_per_node=2, global_batch=16, seq_len=128, dtype="fp32")
    plan = _solve(dataclasses.replace(request, dp_compression="onebit-adam"), table).plan
    assert plan.dp_compression == "onebit-adam" and plan.dp == 2
    same_degrees = [alt for alt in plan.alternatives if (alt.dp, alt.tp, alt.pp) == (plan.dp, plan.tp, plan.pp)]
    assert not [alt for alt in same_degrees if alt.dp_compression != "none" and alt.schedule == plan.schedule]
