"""What `planner train` adds to a rank's failure: the fix a user can act on."""

from __future__ import annotations

import dataclasses

import pytest

from planner.commands.train import _check_host_memory, _dtype_hint, _killed_hint
from planner.errors import UserError
from tests.helpers import manual_plan

MISMATCH = "rank 1 failed: RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"


def test_a_dtype_mismatch_under_a_16_bit_plan_points_at_fp32():
    """Inkling-2 keeps its convolutions in fp32 (transformers' ``_keep_in_fp32_modules_strict``)
    and casts to fp32 before them; the runtime computes every layer in the plan's bf16."""
    hint = _dtype_hint(manual_plan("gpt", {"layers": 2}, dtype="bf16"), MISMATCH)
    assert "computes every layer in bf16" in hint and "--dtype fp32" in hint
    assert _dtype_hint(manual_plan("gpt", {"layers": 2}, dtype="fp32"), MISMATCH) == ""
    assert _dtype_hint(manual_plan("gpt", {"layers": 2}, dtype="bf16"), "rank 0 failed: out of memory") == ""


def _predicting(peak: int, host: int = 0):
    """A hand-made plan for an A100 node that predicts ``peak`` bytes per device (``host`` offloaded)."""
    plan = manual_plan("gpt", {"layers": 2}, hardware="a100-80gb")
    memory = {**plan.predicted.memory, "host": host, "total": peak}
    return dataclasses.replace(
        plan, predicted=dataclasses.replace(plan.predicted, peak_memory_bytes=peak, memory=memory)
    )


def test_a_plan_larger_than_this_machine_is_refused_before_its_ranks_start(monkeypatch):
    """A plan made for an 80 GB GPU, trained on local CPU processes to try it: its ranks would be
    killed by the out-of-memory killer and the run would say only that a rank was lost."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    GiB = 1 << 30
    with pytest.raises(UserError) as err:
        _check_host_memory(_predicting(60 * GiB), "big.json", 2, 24 * GiB)
    msg = str(err.value)
    assert "big.json predicts 60.00 GiB per device" in msg and "planned for a100-80gb" in msg
    assert "2 local processes share this machine's 24.00 GiB" in msg and "--hardware cpu" in msg
    _check_host_memory(_predicting(11 * GiB), "fits.json", 2, 24 * GiB)  # 22 GiB in all: fits
    with pytest.raises(UserError, match="per device at its peak"):  # offloaded state lives in the same memory
        _check_host_memory(_predicting(11 * GiB, host=2 * GiB), "offload.json", 2, 24 * GiB)
    _check_host_memory(_predicting(60 * GiB), "unknown.json", 2, None)  # the system does not say: no check


def test_a_rank_killed_by_sigkill_points_at_memory():
    lost = "rank 1 was lost: its process was killed by SIGKILL; the other ranks were stopped"
    hint = _killed_hint(_predicting(3 << 30), lost)
    assert "out-of-memory killer" in hint and "3.00 GiB per device" in hint
    assert _killed_hint(_predicting(3 << 30), "rank 0 failed: ValueError: bad") == ""
