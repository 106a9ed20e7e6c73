"""The cost models may not import the runtime (they are pure data and formulas), so the facts they
repeat about it are tied here: dtype names and sizes, the precision recipe and ZeRO's reductions
in flight (``test_cost_models.py`` ties the ring byte counts)."""

from __future__ import annotations

import pytest

import runtime.dtypes as runtime_dtypes
from cost_models.compute import DTYPE_BYTES, DTYPES
from cost_models.memory import BYTES_PER_PARAM, FP32_GRAD_SHARD, REDUCTIONS_IN_FLIGHT
from runtime.zero import MAX_INFLIGHT_REDUCTIONS


def test_the_training_dtypes_are_the_runtimes():
    assert set(DTYPES) == set(runtime_dtypes.DTYPES) == set(BYTES_PER_PARAM)


@pytest.mark.parametrize("name", runtime_dtypes.DTYPES)
def test_bytes_per_element_and_per_parameter_follow_the_dtype(name):
    size = runtime_dtypes.itemsize(name)
    assert DTYPE_BYTES[name] == size
    recipe = BYTES_PER_PARAM[name]
    assert recipe["weights"] == recipe["grads"] == size
    # Mixed precision keeps fp32 masters and moments beside low-precision weights (runtime.zero).
    assert recipe["master"] == (0 if size == 4 else 4) and recipe["adam_m"] == recipe["adam_v"] == 4
    assert FP32_GRAD_SHARD == runtime_dtypes.itemsize("fp32")


def test_zero_reductions_in_flight_match_the_engine():
    assert REDUCTIONS_IN_FLIGHT == MAX_INFLIGHT_REDUCTIONS
