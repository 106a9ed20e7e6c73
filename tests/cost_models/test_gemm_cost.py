"""cost_models.gemm_cost: a layer's products priced by shape. On the CPU profiles exactly the summed
model's charge (so CPU predictions do not move); on GPU profiles small products cost more than the
flat efficiency says, large ones the same; tensor parallelism divides the marked dim."""

from __future__ import annotations

import dataclasses

import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.compute import compute_time, gemms_time, matmul_time
from cost_models.gemm_cost import (
    gemm_flops,
    layer_gemm_time,
    layer_matmul_time,
    per_device_gemms,
    prices_by_shape,
)
from cost_models.hardware import load_hardware
from passes.common import B, S
from passes.layer_table import Gemm
from planner.frontend.model_analysis import build_layer_table

CPU = load_hardware("cpu")
H100 = load_hardware("h100-sxm")
FAST = settings(max_examples=60, deadline=None)


@pytest.fixture(scope="module")
def gpt_table():
    return build_layer_table("gpt", batch=2, seq_len=32, dtype="fp32", layers=2, hidden=64, heads=4, vocab=128)


def _split(row: dict, name: str, tp: int) -> float:
    """What cost_models.strategy charges today: the part tp divides, divided; the rest whole."""
    return row[name] - row[name + "_tp"] + row[name + "_tp"] / tp


def test_profiles_that_price_by_shape():
    assert not prices_by_shape(CPU, "fp32") and prices_by_shape(H100, "bf16")
    table = {
        "bf16": {
            "m": [256, 4096],
            "n": [256, 4096],
            "k": [256, 4096],
            "efficiency": [[[0.5, 0.6], [0.6, 0.7]], [[0.6, 0.7], [0.7, 0.8]]],
        }
    }
    calibrated = dataclasses.replace(CPU, gemm_efficiency=table)
    assert prices_by_shape(calibrated, "bf16") and not prices_by_shape(calibrated, "fp32")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("b,s", [(1, 16), (2, 32), (8, 1024)])
def test_cpu_profile_charges_what_the_summed_model_charges(gpt_table, tp, b, s):
    for row in gpt_table.numeric(b, s):
        for p in ("fwd", "bwd"):
            flops = _split(row, f"{p}_flops", tp)
            old = float(compute_time(flops, 0.0, CPU, "fp32"))
            got = layer_gemm_time(row[f"{p}_gemms"], CPU, "fp32", tp)
            assert got == pytest.approx(old, rel=1e-12, abs=0.0)
            # the combined form is the old charge bit for bit
            assert layer_matmul_time(flops, row[f"{p}_gemms"], CPU, "fp32", tp) == old


def test_symbolic_shapes_take_b_and_s(gpt_table):
    lay = gpt_table.layers[1]
    row = gpt_table.numeric(3, 20)[1]
    for hw, dt in ((CPU, "fp32"), (H100, "bf16")):
        for tp in (1, 2):
            assert layer_gemm_time(lay.bwd_gemms, hw, dt, tp, micro_batch=3, seq_len=20) == pytest.approx(
                layer_gemm_time(row["bwd_gemms"], hw, dt, tp), rel=1e-12
            )
    with pytest.raises(ValueError, match="pass b and s"):
        layer_gemm_time(lay.fwd_gemms, CPU, "fp32")


def test_gpu_small_products_cost_more_than_the_flat_efficiency(gpt_table):
    flat = lambda flops: float(compute_time(flops, 0.0, H100, "bf16"))  # noqa: E731
    for p in ("fwd", "bwd"):
        row = gpt_table.numeric(2, 32)[1]
        gemms = row[f"{p}_gemms"]
        got = layer_gemm_time(gemms, H100, "bf16")
        assert got > 5 * flat(row[f"{p}_flops"])  # 64-wide products fill few SMs
        assert got == pytest.approx(gemms_time([g[:5] for g in gemms], H100, "bf16"), rel=1e-12)
    small = [Gemm(64.0, 64.0, 64.0, 1.0, 4)]
    assert layer_gemm_time(small, H100, "bf16") > flat(gemm_flops(small))
    big = [Gemm(8192.0, 8192.0, 8192.0, 1.0, 2, "n")]  # tile-aligned, many waves: the flat rate
    assert layer_gemm_time(big, H100, "bf16") == pytest.approx(flat(gemm_flops(big)), rel=1e-9)


def test_tp_divides_the_marked_dim():
    g = [
        Gemm(4096, 1024, 512, 1, 3, "n"),
        Gemm(4096, 1024, 512, 8, 1, "batch"),
        Gemm(64, 64, 64, 1, 2, None),
        Gemm(4096, 1024, 512, 1, 1, "k"),
        Gemm(4096, 1024, 512, 1, 1, "m"),
    ]
    assert per_device_gemms(g, tp=4) == [
        (4096, 256, 512, 1, 3),
        (4096, 1024, 512, 2, 1),
        (64, 64, 64, 1, 2),
        (4096, 1024, 128, 1, 1),
        (1024, 1024, 512, 1, 1),
    ]
    assert gemm_flops(g, tp=4) == pytest.approx(
        (gemm_flops(g) - gemm_flops(g[2:3])) / 4 + gemm_flops(g[2:3]), rel=1e-15
    )
    # on a GPU each product is priced at its per-device shape
    want = sum(c * float(matmul_time(m, n, k, H100, "bf16", bt)) for m, n, k, bt, c in per_device_gemms(g, 4))
    assert layer_gemm_time(g, H100, "bf16", tp=4) == pytest.approx(want, rel=1e-12)
    # a column-parallel product's n shrinks: tile quantization makes it no cheaper than 1/tp
    col = [Gemm(2048, 4096, 4096, 1, 1, "n")]
    assert layer_gemm_time(col, H100, "bf16", tp=8) >= layer_gemm_time(col, H100, "bf16") / 8 * (1 - 1e-12)
    with pytest.raises(ValueError):
        per_device_gemms([(1, 2, 3, 1, 1, "z")])
    with pytest.raises(ValueError):
        per_device_gemms(g, tp=0)


def test_matmul_time_prices_the_unlisted_flops_at_the_flat_rate():
    g = [Gemm(64.0, 64.0, 64.0, 1.0, 1)]
    extra = 1e9  # e.g. a convolution's FLOPs, which carry no shape
    flops = gemm_flops(g) + extra
    got = layer_matmul_time(flops, g, H100, "bf16")
    assert got == pytest.approx(
        layer_gemm_time(g, H100, "bf16") + float(compute_time(extra, 0.0, H100, "bf16")), rel=1e-12
    )
    # a table without shapes (an older JSON): everything at the flat rate, as before
    assert layer_matmul_time(flops, (), H100, "bf16") == float(compute_time(flops, 0.0, H100, "bf16"))
    # rounding never makes the rest negative
    assert layer_matmul_time(gemm_flops(g) * (1 - 1e-15), g, H100, "bf16") == layer_gemm_time(g, H100, "bf16")


@FAST
@given(
    st.lists(
        st.tuples(
            st.integers(1, 1 << 14),
            st.integers(1, 1 << 14),
            st.integers(1, 1 << 14),
            st.integers(1, 64),
            st.integers(1, 4),
            st.sampled_from([None, "m", "n", "k", "batch"]),
        ),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([1, 2, 4, 8]),
)
def test_cpu_equivalence_and_gpu_lower_bound_for_any_shapes(gemms, tp):
    flops = gemm_flops(gemms, tp)
    assert layer_gemm_time(gemms, CPU, "fp32", tp) == pytest.approx(
        float(compute_time(flops, 0.0, CPU, "fp32")), rel=1e-12
    )
    # shape pricing never beats the flat achievable rate
    assert layer_gemm_time(gemms, H100, "bf16", tp) >= float(compute_time(flops, 0.0, H100, "bf16")) * (1 - 1e-12)


def test_symbolic_entries_with_sympy_sizes():
    g = [Gemm(B * S, sympy.Integer(64), sympy.Integer(64), sympy.Integer(1), 3, "n")]
    assert gemm_flops(g, 2, micro_batch=2, seq_len=8) == pytest.approx(3 * 2 * 16 * 32 * 64)
