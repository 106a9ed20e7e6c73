"""The cost of a run: days, GPU-hours and money against hand-computed values."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cost_models.run_cost import run_cost, scale_cost

TIME = {"compute": 6.0, "recompute": 1.0, "tp_comm": 1.0, "pp_bubble": 1.5, "dp_comm": 0.25, "optimizer": 0.25}


def test_hand_computed_run():
    # 300e9 tokens at 1536 x 2048 tokens per step: ceil(95,367.43) = 95,368 steps of 10 s on 1024 devices.
    c = run_cost(300e9, 1536 * 2048, 10.0, TIME, gpus=1024, price_per_gpu_hour=2.0)
    assert c["steps"] == 95_368
    assert c["days"] == pytest.approx(95_368 * 10.0 / 86_400)  # 11.04 days
    assert c["gpu_hours"] == pytest.approx(95_368 * 10.0 / 3600 * 1024)  # 271,269 GPU-hours
    assert c["money"] == pytest.approx(c["gpu_hours"] * 2.0)  # 542,538
    assert c["by_part"]["compute"] == pytest.approx(c["money"] * 0.6)
    assert c["by_part"]["pp_bubble"] == pytest.approx(c["money"] * 0.15)
    assert sum(c["by_part"].values()) == pytest.approx(c["money"])


def test_without_a_price_parts_are_gpu_hours():
    c = run_cost(1e6, 1000, 2.0, {"compute": 1.5, "dp_comm": 0.5}, gpus=8)
    assert c["steps"] == 1000 and c["money"] is None
    assert c["gpu_hours"] == pytest.approx(1000 * 2.0 / 3600 * 8)
    assert c["by_part"] == pytest.approx({"compute": c["gpu_hours"] * 0.75, "dp_comm": c["gpu_hours"] * 0.25})


def test_a_partial_global_batch_is_a_whole_step():
    assert run_cost(1001, 1000, 1.0, TIME, gpus=1)["steps"] == 2


def test_runner_up_cost_scales_with_its_step_time():
    c = run_cost(1e9, 4096, 3.0, TIME, gpus=64, price_per_gpu_hour=1.5)
    alt = scale_cost(c, 4.5, 3.0)
    assert alt["gpu_hours"] == pytest.approx(c["gpu_hours"] * 1.5)
    assert alt["money"] == pytest.approx(c["money"] * 1.5) and alt["days"] == pytest.approx(c["days"] * 1.5)


@pytest.mark.parametrize(
    "kw, what",
    [
        ({"tokens": 0}, "tokens"),
        ({"tokens": math.inf}, "tokens"),
        ({"gpus": 0}, "gpus"),
        ({"price_per_gpu_hour": -1.0}, "price"),
    ],
)
def test_bad_arguments_are_refused(kw, what):
    args = {
        "tokens": 1e9,
        "tokens_per_step": 1024,
        "step_time_s": 1.0,
        "time": TIME,
        "gpus": 8,
        "price_per_gpu_hour": None,
        **kw,
    }
    with pytest.raises(ValueError, match=what):
        run_cost(**args)


@given(
    tokens=st.floats(1e3, 1e13),
    tps=st.integers(1, 10**7),
    step=st.floats(1e-4, 1e3),
    gpus=st.integers(1, 10**4),
    price=st.one_of(st.none(), st.floats(0.01, 100)),
)
def test_parts_add_up_and_money_is_hours_times_price(tokens, tps, step, gpus, price):
    parts = {"compute": step * 0.7, "dp_comm": step * 0.3}
    c = run_cost(tokens, tps, step, parts, gpus, price)
    assert c["steps"] * tps >= tokens > (c["steps"] - 1) * tps
    assert c["gpu_hours"] == pytest.approx(c["days"] * 24 * gpus)
    billed = c["money"] if price is not None else c["gpu_hours"]
    assert sum(c["by_part"].values()) == pytest.approx(billed)
    if price is not None:
        assert c["money"] == pytest.approx(c["gpu_hours"] * price)
