"""Offload as a search decision: the search's choice is the best over every offload setting, the
issue's single-GPU requests fit with offload (and a model that fits without it does not offload),
and pins are honoured or refused clearly."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_models.hardware import load_hardware
from cost_models.strategy import NumericTable, candidate_costs
from planner.search.candidates import enumerate_candidates, offload_variants
from planner.search.ilp import solve_candidate
from planner.search.request import PlanRequest
from planner.search.search_errors import NoFeasiblePlan, SearchError
from planner.search.solve import solve
from tests.helpers import gpt_table

TINY = gpt_table(layers=3, hidden=128, heads=2, vocab=4096)
CPU = load_hardware("cpu")


def _req(**kw) -> PlanRequest:
    base = dict(spec="gpt", gpus=1, gpus_per_node=1, hardware="cpu", global_batch=4, seq_len=64, compile="off")
    base.update(kw)
    return PlanRequest(**base)


def _exhaustive(req: PlanRequest, table, hw) -> float | None:
    """The fastest strategy over every candidate and every offload setting (each candidate's ILP is
    exact; ``tests/planner/search/test_ilp.py`` checks it against enumerating partitions)."""
    nt = NumericTable(table)
    gpn = req.gpus_per_node
    plain = enumerate_candidates(req, nt, gpn)
    free = dataclasses.replace(req, offload_optimizer=None, offload_params=None)
    best = None
    for c in plain + offload_variants(free, plain, hw):
        cc = candidate_costs(nt, hw, req.dtype, req.seq_len, c, gpn, hw.memory_bytes * req.memory_headroom)
        ev = solve_candidate(cc, nt.kinds).evaluation
        if ev is not None and (best is None or ev.step_time_s < best):
            best = ev.step_time_s
    return best


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(memory_mb=st.integers(8, 120), gpus=st.sampled_from([1, 2]), batch=st.sampled_from([2, 4]))
def test_search_equals_exhaustive_over_offload_settings(memory_mb, gpus, batch):
    # device memory from "the optimizer state alone does not fit" to "everything fits"
    hw = dataclasses.replace(CPU, memory_bytes=memory_mb * 2**20, gpus_per_node=2)
    req = _req(gpus=gpus, gpus_per_node=2, global_batch=batch)
    best = _exhaustive(req, TINY, hw)
    if best is None:
        with pytest.raises(NoFeasiblePlan):
            solve(req, TINY, hw)
        return
    plan = solve(req, TINY, hw).plan
    assert plan.predicted.step_time_s == pytest.approx(best, rel=1e-6)


def _one_gpu(table, hardware: str, dtype: str = "bf16"):
    req = PlanRequest(
        spec="gpt", gpus=1, gpus_per_node=0, hardware=hardware, global_batch=16, seq_len=2048, dtype=dtype
    )
    return solve(req, table, load_hardware(hardware)).plan


def test_llama_8b_shape_fits_one_a100_with_optimizer_offload():
    # LLaMA-3-8B's size (32 x 4096, vocab 128256) as a closed-form GPT table: 7.5 B parameters
    plan = _one_gpu(gpt_table(layers=32, hidden=4096, heads=32, vocab=128256, max_seq=2048), "a100-80gb")
    assert plan.offload["optimizer"] in ("cpu", "nvme") and plan.zero_stage >= 1
    assert plan.predicted.memory["optimizer"] == 0 and plan.predicted.memory["host"] > 16 * 7e9
    assert plan.predicted.time["optimizer"] > 0 and plan.predicted.memory["total"] <= 0.9 * 80 * 2**30


def test_13b_shape_fits_one_v100_with_offload():
    plan = _one_gpu(gpt_table(layers=40, hidden=5120, heads=40, vocab=32000, max_seq=2048), "v100-32gb", "fp16")
    assert plan.offload["optimizer"] != "none"
    assert plan.predicted.memory["total"] <= 0.9 * 32 * 2**30


def test_1_3b_gpt_on_one_a100_does_not_offload():
    plan = _one_gpu(gpt_table(layers=24, hidden=2048, heads=16, vocab=50257, max_seq=2048), "a100-80gb")
    assert plan.offload == {"optimizer": "none", "params": "none"}
    assert plan.predicted.memory["host"] == 0 and plan.predicted.time["offload"] == 0


def test_offload_loses_when_memory_suffices():
    """Pinning offload on a model that fits only adds time (transfers, a slower AdamW on the host's
    cores); on a CPU profile, where the host's cores are the device's, a tie goes to the device."""
    a100 = load_hardware("a100-80gb")
    free = solve(_req(hardware="a100-80gb"), TINY, a100).plan
    pinned = solve(_req(hardware="a100-80gb", offload_optimizer="cpu"), TINY, a100).plan
    assert free.offload["optimizer"] == "none" and pinned.offload["optimizer"] == "cpu"
    assert pinned.predicted.step_time_s > free.predicted.step_time_s
    assert pinned.predicted.memory["total"] < free.predicted.memory["total"]
    assert solve(_req(), TINY, CPU).plan.offload == {"optimizer": "none", "params": "none"}


def test_pins_are_honoured_and_contradictions_refused():
    plan = solve(_req(offload_optimizer="nvme", offload_params="cpu"), TINY, CPU).plan
    assert plan.offload == {"optimizer": "nvme", "params": "cpu"} and plan.zero_stage == 3
    assert plan.predicted.memory["nvme"] > 0 and plan.predicted.memory["host"] > 0
    assert all(a.offload == plan.offload for a in plan.alternatives)
    with pytest.raises(SearchError, match="--offload-params cpu needs ZeRO stage 3"):
        _req(offload_params="cpu", zero_stage=1)
    with pytest.raises(SearchError, match="--offload-optimizer cpu needs ZeRO stage 1, 2 or 3"):
        _req(offload_optimizer="cpu", zero_stage=0)
    with pytest.raises(SearchError, match="must be one of none, cpu, nvme"):
        _req(offload_optimizer="disk")
    bare = dataclasses.replace(CPU, nvme_read_bandwidth=None)
    with pytest.raises(SearchError, match="lacks nvme_read_bandwidth"):
        solve(_req(offload_optimizer="nvme"), TINY, bare)
