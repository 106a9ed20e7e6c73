"""The cost models' bytes per parameter follow the runtime's precision recipe (dtype sizes and ZeRO's
reductions in flight come from ``runtime.contract`` on both sides)."""

from __future__ import annotations

import pytest

import runtime.dtypes as runtime_dtypes
from cost_models.compute import DTYPE_BYTES
from cost_models.memory import BYTES_PER_PARAM, FP32_GRAD_SHARD
from runtime.contract.dtype_table import DTYPES


@pytest.mark.parametrize("name", DTYPES)
def test_bytes_per_element_and_per_parameter_follow_the_dtype(name):
    size = runtime_dtypes.itemsize(name)
    assert DTYPE_BYTES[name] == size
    recipe = BYTES_PER_PARAM[name]
    assert recipe["weights"] == recipe["grads"] == size
    # Mixed precision keeps fp32 masters and moments beside low-precision weights (runtime.data_parallel.zero_engine).
    assert recipe["master"] == (0 if size == 4 else 4) and recipe["adam_m"] == recipe["adam_v"] == 4
    assert FP32_GRAD_SHARD == runtime_dtypes.itemsize("fp32")
