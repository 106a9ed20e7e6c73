"""GEMM efficiency by shape: the measured table (log-space interpolation, clamping), the default
curve of the GPU profiles, the roofline of CPU profiles, symbolic sizes and profile validation."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import sympy
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cost_models.compute import (
    GEMM_MIN_TIME_S,
    GEMM_TILE,
    compute_time,
    gemm_efficiency,
    gemms_time,
    matmul_flops,
    matmul_time,
    misaligned,
    smax,
)
from cost_models.hardware import KNOWN_KINDS, HardwareProfile, ProfileError, load_hardware

FAST = settings(max_examples=80, deadline=None)
H200 = load_hardware("h200")
CPU = load_hardware("cpu")
GPU_KINDS = [k for k in KNOWN_KINDS if k != "cpu"]


def _table(values=None, sizes=(256, 4096)) -> dict:
    """A 2 x 2 x 2 bf16 table; ``values[i][j][l]`` default to a product of per-axis factors."""
    if values is None:
        f = {256: 0.5, 4096: 1.0}
        values = [[[round(0.8 * f[m] * f[n] * f[k], 6) for k in sizes] for n in sizes] for m in sizes]
    return {"bf16": {"m": list(sizes), "n": list(sizes), "k": list(sizes), "efficiency": values}}


def _with_table(hw=H200, **kw) -> HardwareProfile:
    return dataclasses.replace(hw, gemm_efficiency=_table(**kw))


# ---------------------------------------------------------------------------------------------
# The measured table
# ---------------------------------------------------------------------------------------------
def test_table_hits_its_grid_points_and_interpolates_in_log_space():
    hw = _with_table()
    assert gemm_efficiency(hw, "bf16", 4096, 4096, 4096) == pytest.approx(0.8)
    assert gemm_efficiency(hw, "bf16", 4096, 4096, 256) == pytest.approx(0.4)
    # 1024 is halfway between 256 and 4096 in log space: the mean of the two k planes
    assert gemm_efficiency(hw, "bf16", 4096, 4096, 1024) == pytest.approx(0.6)
    # trilinear: halfway on every axis averages the 8 corners
    corners = [0.8 * a * b * c for a in (0.5, 1) for b in (0.5, 1) for c in (0.5, 1)]
    assert gemm_efficiency(hw, "bf16", 1024, 1024, 1024) == pytest.approx(sum(corners) / 8)
    # a quarter of the way in log space (512 = 256 * 2, 4096 = 256 * 16)
    assert gemm_efficiency(hw, "bf16", 4096, 4096, 512) == pytest.approx(0.4 + 0.25 * 0.4)
    # matmul_time is the FLOPs at that fraction of peak
    t = matmul_time(4096, 4096, 1024, hw, "bf16")
    assert t == pytest.approx(matmul_flops(4096, 4096, 1024) / (hw.peak("bf16") * 0.6))


def test_table_clamps_at_its_edges_and_below_them_keeps_under_the_memory_roofline():
    hw = _with_table()
    assert gemm_efficiency(hw, "bf16", 65536, 65536, 65536) == pytest.approx(0.8)  # above the range
    assert gemm_efficiency(hw, "bf16", 4096, 4096, 10**6) == pytest.approx(0.8)
    # below the range: the edge value, unless the product is memory-bound there
    assert gemm_efficiency(hw, "bf16", 4096, 4096, 128) == pytest.approx(0.4)
    m = 8  # a GEMV-like product: 2 m n k FLOPs over ~ n k bytes, far below the ridge point
    roof = 2 * m * 4096 * 4096 * hw.memory_bandwidth / (hw.peak("bf16") * (2 * m * 4096 + 4096 * 4096) * 2)
    assert gemm_efficiency(hw, "bf16", m, 4096, 4096) == pytest.approx(roof)
    assert roof < 0.4
    # inside the table's range the measurement stands, even above the copy-bandwidth roofline
    slow_memory = dataclasses.replace(hw, memory_bandwidth=1e9)
    assert gemm_efficiency(slow_memory, "bf16", 256, 256, 256) == pytest.approx(0.1)


def test_table_is_per_dtype_and_batched_products_look_up_batch_times_m():
    hw = _with_table()
    # no fp32 table: the default curve prices fp32 (H200 has sm_count)
    assert gemm_efficiency(hw, "fp32", 16384, 16384, 16384) == pytest.approx(hw.compute_efficiency)
    assert gemm_efficiency(hw, "bf16", 256, 4096, 4096, batch=16) == pytest.approx(
        gemm_efficiency(hw, "bf16", 4096, 4096, 4096)
    )


def test_one_point_axes():
    tab = {"bf16": {"m": [1024], "n": [1024], "k": [1024], "efficiency": [[[0.5]]]}}
    hw = dataclasses.replace(H200, gemm_efficiency=tab)
    assert gemm_efficiency(hw, "bf16", 8192, 8192, 8192) == 0.5
    assert gemm_efficiency(hw, "bf16", 512, 2048, 1024) == 0.5


# ---------------------------------------------------------------------------------------------
# The default curve (GPU datasheet profiles) and the CPU roofline
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_default_curve_reaches_compute_efficiency_for_large_gemms(kind):
    hw = load_hardware(kind)
    assert hw.sm_count and hw.gemm_efficiency is None
    for dt in ("bf16", "fp16", "fp32"):
        for n in (8192, 16384):
            assert gemm_efficiency(hw, dt, n, n, n) == pytest.approx(hw.compute_efficiency)
        assert matmul_time(16384, 16384, 16384, hw, dt) == pytest.approx(
            compute_time(matmul_flops(16384, 16384, 16384), 0, hw, dt)
        )
    # a transformer-sized product (tokens x hidden by hidden x 4 hidden) is at full efficiency too
    assert gemm_efficiency(hw, "bf16", 8192, 16384, 4096) == pytest.approx(hw.compute_efficiency)


@pytest.mark.parametrize("kind", GPU_KINDS)
def test_default_curve_prices_small_gemms_below_large_ones(kind):
    hw = load_hardware(kind)
    effs = [gemm_efficiency(hw, "bf16", n, n, n) for n in (64, 128, 256, 512, 1024, 2048, 4096)]
    assert effs == sorted(effs) and effs[0] < 0.01 * hw.compute_efficiency
    assert effs[-1] == pytest.approx(hw.compute_efficiency)
    # fewer tiles than SMs: only some SMs work (1024^3 has 64 tiles of 128 x 128)
    tiles = (1024 // GEMM_TILE) ** 2
    if tiles < hw.sm_count:
        assert gemm_efficiency(hw, "bf16", 1024, 1024, 1024) == pytest.approx(
            hw.compute_efficiency * tiles / hw.sm_count
        )
    # a tiny product is held by the kernel floor (fp16: V100 has no bf16 tensor cores), a
    # misaligned one too: its slower math still fits under the floor
    assert matmul_time(16, 16, 16, hw, "fp16") == pytest.approx(GEMM_MIN_TIME_S)
    assert matmul_time(8, 8, 1, load_hardware("h100-sxm"), "bf16") == pytest.approx(GEMM_MIN_TIME_S)


def test_default_curve_pays_for_padded_tiles_and_uses_split_k_for_long_k():
    hw = H200
    e = hw.compute_efficiency
    # 8192 x 8200: the last tile column is mostly padding
    assert gemm_efficiency(hw, "bf16", 8192, 8200, 8192) == pytest.approx(e * 8200 / (65 * 128))
    # 768 x 768 tiles do not fill 132 SMs; a long k is split so that they do
    short = gemm_efficiency(hw, "bf16", 768, 768, 1024)
    long = gemm_efficiency(hw, "bf16", 768, 768, 16384)
    assert short == pytest.approx(e * 36 / 132)
    assert long == pytest.approx(e)


@FAST
@given(
    m=st.integers(1, 20000),
    n=st.integers(1, 20000),
    k=st.integers(1, 20000),
    axis=st.sampled_from("mnk"),
    factor=st.integers(2, 8),
    kind=st.sampled_from(GPU_KINDS),
    dtype=st.sampled_from(["bf16", "fp32"]),
)
def test_default_curve_never_drops_when_a_size_grows_by_an_integer_factor(m, n, k, axis, factor, kind, dtype):
    hw = load_hardware(kind)
    before = gemm_efficiency(hw, dtype, m, n, k)
    grown = {"m": m, "n": n, "k": k}
    grown[axis] *= factor
    # a misaligned product runs a slower kernel than the aligned one it grows into (k = 175 -> 1,400)
    assume(misaligned(dtype, m, n, k) == misaligned(dtype, *grown.values()))
    after = gemm_efficiency(hw, dtype, grown["m"], grown["n"], grown["k"])
    assert 0 < before <= hw.compute_efficiency + 1e-12
    assert after >= before * (1 - 1e-9)
    # and the time never drops as the work grows
    assert matmul_time(grown["m"], grown["n"], grown["k"], hw, dtype) >= matmul_time(m, n, k, hw, dtype) * (1 - 1e-9)


def test_cpu_profile_keeps_the_roofline():
    n = 8192
    assert gemm_efficiency(CPU, "fp32", n, n, n) == CPU.compute_efficiency
    for shape in ((8192, 8192, 8192), (2, 4096, 4096), (1, 1, 1)):
        moved = (shape[0] * shape[2] + shape[2] * shape[1] + shape[0] * shape[1]) * 4
        assert matmul_time(*shape, CPU, "fp32") == compute_time(matmul_flops(*shape), moved, CPU, "fp32")
    assert gemm_efficiency(CPU, "fp32", 2, 4096, 4096) < CPU.compute_efficiency  # memory-bound


def test_a_list_of_gemms_is_priced_shape_by_shape():
    gemms = [(4096, 768, 768), (1024, 1024, 64, 12), (8, 8, 8, 1, 3)]
    want = (
        matmul_time(4096, 768, 768, H200, "bf16")
        + matmul_time(1024, 1024, 64, H200, "bf16", batch=12)
        + 3 * matmul_time(8, 8, 8, H200, "bf16")
    )
    assert gemms_time(gemms, H200, "bf16") == pytest.approx(want)
    # small GEMMs cost more than their FLOPs at compute_efficiency; on a CPU profile they do not
    flops = sum(matmul_flops(*g[:3], *(g[3:4] or (1,))) * (g[4] if len(g) > 4 else 1) for g in gemms)
    assert gemms_time(gemms, H200, "bf16") > compute_time(flops, 0, H200, "bf16")
    b = sympy.Symbol("b", positive=True, integer=True)
    assert float(gemms_time([(1024 * b, 768, 768)], H200, "bf16").subs(b, 4)) == pytest.approx(
        matmul_time(4096, 768, 768, H200, "bf16")
    )


def test_degenerate_sizes():
    assert matmul_time(0, 128, 128, H200, "bf16") == pytest.approx(0 + 128 * 128 * 2 / H200.memory_bandwidth)
    assert gemm_efficiency(H200, "bf16", 0, 128, 128) == H200.compute_efficiency
    with pytest.raises(ValueError, match="m must be >= 0"):
        gemm_efficiency(H200, "bf16", -1, 2, 2)
    with pytest.raises(ValueError, match="no peak FLOP/s for dtype 'tf32'"):
        gemm_efficiency(CPU, "tf32", 2, 2, 2)


# ---------------------------------------------------------------------------------------------
# Symbolic sizes (layer-table costs are sympy expressions in b and s)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hw", [H200, _with_table(), CPU], ids=["curve", "table", "cpu"])
def test_symbolic_sizes_substitute_and_lambdify_to_the_numeric_value(hw):
    b, s = sympy.symbols("b s", positive=True, integer=True)
    t = matmul_time(b * s, 768, 3 * 768, hw, "bf16")
    e = gemm_efficiency(hw, "bf16", b * s, 768, 3 * 768)
    assert t.free_symbols == {b, s}
    f = sympy.lambdify((b, s), smax(t, b * s * 1e-12))
    for bv, sv in ((1, 128), (4, 1024), (16, 2048)):
        want = matmul_time(bv * sv, 768, 3 * 768, hw, "bf16")
        assert float(t.subs({b: bv, s: sv})) == pytest.approx(want)
        assert float(e.subs({b: bv, s: sv})) == pytest.approx(gemm_efficiency(hw, "bf16", bv * sv, 768, 3 * 768))
        assert f(bv, sv) == pytest.approx(want)
    # the same profile and dtype give the same function (expressions compare and cache equal)
    assert gemm_efficiency(hw, "bf16", b * s, 768, 3 * 768) == e
    # and smax / smin see it as symbolic
    assert float(smax(e, 0.0).subs({b: 4, s: 1024})) == pytest.approx(gemm_efficiency(hw, "bf16", 4096, 768, 2304))


def test_symbolic_batch():
    b = sympy.Symbol("b", positive=True, integer=True)
    t = matmul_time(1024, 1024, 64, H200, "bf16", batch=12 * b)
    assert float(t.subs(b, 8)) == pytest.approx(matmul_time(1024, 1024, 64, H200, "bf16", batch=96))


# ---------------------------------------------------------------------------------------------
# Profile fields and their validation
# ---------------------------------------------------------------------------------------------
def test_new_fields_round_trip_and_hash(tmp_path):
    hw = dataclasses.replace(_with_table(), host_device_bandwidth=5.5e10)
    path = hw.save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["gemm_efficiency"]["bf16"]["k"] == [256, 4096] and data["host_device_bandwidth"] == 5.5e10
    again = load_hardware(str(path))
    assert again == hw and hash(again) == hash(hw)
    assert hash(again) != hash(H200)
    # absent optional fields stay absent in the JSON
    bare = dataclasses.replace(H200, host_device_bandwidth=None)
    assert "gemm_efficiency" not in H200.to_dict() and "host_device_bandwidth" not in bare.to_dict()
    assert "sm_count" not in CPU.to_dict() and H200.to_dict()["sm_count"] == 132
    # the caller's table can change without changing the profile
    tab = _table()
    p = dataclasses.replace(H200, gemm_efficiency=tab)
    tab["bf16"]["efficiency"][0][0][0] = 0.9
    assert p.gemm_efficiency["bf16"]["efficiency"][0][0][0] == 0.1


def _bad(field, value):
    d = load_hardware("a100-80gb").to_dict()
    d[field] = value
    return d


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        (
            "sm_count",
            0,
            r"field 'sm_count' must be a positive integer \(streaming multiprocessors\) or absent \(got 0\)",
        ),
        ("sm_count", 1.5, r"field 'sm_count' must be a positive integer"),
        ("host_device_bandwidth", -1, r"field 'host_device_bandwidth' must be a positive number of bytes/s or absent"),
        ("host_device_bandwidth", "pcie", r"field 'host_device_bandwidth' must be a positive number .*'pcie'"),
        ("gemm_efficiency", [], r"field 'gemm_efficiency' must be a non-empty object of tables by dtype"),
        ("gemm_efficiency", {"int8": {}}, r"field 'gemm_efficiency' has unknown dtype 'int8' \(allowed: fp32, tf32"),
        (
            "gemm_efficiency",
            {"bf16": {"m": [1]}},
            r"field 'gemm_efficiency.bf16' must be an object with exactly 'm', 'n', 'k' \(sizes\) and 'efficiency'",
        ),
        (
            "gemm_efficiency",
            {"bf16": {**_table()["bf16"], "m": [4096, 256]}},
            r"field 'gemm_efficiency.bf16.m' must be a non-empty list of strictly increasing positive integer sizes",
        ),
        (
            "gemm_efficiency",
            {"bf16": {**_table()["bf16"], "k": [0, 16]}},
            r"field 'gemm_efficiency.bf16.k' must be a non-empty list of strictly increasing positive",
        ),
        (
            "gemm_efficiency",
            {"bf16": {**_table()["bf16"], "n": [256.5, 4096]}},
            r"field 'gemm_efficiency.bf16.n' must be a non-empty list",
        ),
        (
            "gemm_efficiency",
            {"bf16": {**_table()["bf16"], "efficiency": [[[0.5, 0.5]]]}},
            r"field 'gemm_efficiency.bf16.efficiency' must be a 2 x 2 x 2 nested list",
        ),
        (
            "gemm_efficiency",
            {"bf16": {**_table()["bf16"], "efficiency": [[[0.5, 0.5], [0.5]], [[0.5, 0.5]] * 2]}},
            r"must be a 2 x 2 x 2 nested list \(one value per m, then per n, then per k\): entry \[0\]\[1\] is \[0.5\]",
        ),
        (
            "gemm_efficiency",
            _table(values=[[[0.5, 0.5], [0.5, 1.2]], [[0.5, 0.5], [0.5, 0.5]]]),
            r"field 'gemm_efficiency.bf16.efficiency\[0\]\[1\]\[1\]' must be a number in \(0, 1\], the achieved "
            r"fraction of peak_flops.bf16 \(got 1.2\)",
        ),
        (
            "gemm_efficiency",
            _table(values=[[[0.5, 0.5], [0.5, 0.0]], [[0.5, 0.5], [0.5, 0.5]]]),
            r"efficiency\[0\]\[1\]\[1\]' must be a number in \(0, 1\]",
        ),
    ],
)
def test_invalid_new_fields_name_the_file_and_field(tmp_path, field, value, pattern):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(_bad(field, value)))
    with pytest.raises(ProfileError, match=pattern) as e:
        load_hardware(str(p))
    assert str(p) in str(e.value)


def test_misaligned_products_keep_the_measured_share_on_tensor_cores():
    """A size not a multiple of 16 bytes of its elements (8 bf16, 4 tf32) costs the tensor-core
    dtypes ``gemm_misaligned_efficiency`` of the aligned rate; plain fp32 and CPUs are unaffected."""
    assert H200.gemm_misaligned_efficiency == pytest.approx(0.17)
    aligned = gemm_efficiency(H200, "bf16", 16384, 50256, 2048)
    assert gemm_efficiency(H200, "bf16", 16384, 50257, 2048) == pytest.approx(0.17 * aligned, rel=1e-3)
    assert gemm_efficiency(H200, "bf16", 16384, 2048, 50257) == pytest.approx(
        0.17 * gemm_efficiency(H200, "bf16", 16384, 2048, 50256), rel=1e-3
    )
    tf32_aligned = gemm_efficiency(H200, "tf32", 4096, 4100, 4096)  # 4100 is a multiple of 4 fp32 values
    assert tf32_aligned > 0.9 * gemm_efficiency(H200, "tf32", 4096, 4096, 4096)
    assert gemm_efficiency(H200, "tf32", 4096, 4102, 4096) < 0.2 * tf32_aligned
    assert gemm_efficiency(H200, "fp32", 4096, 4097, 4096) > 0.9 * gemm_efficiency(H200, "fp32", 4096, 4096, 4096)
    assert load_hardware("cpu").gemm_misaligned_efficiency == 1.0
    assert load_hardware("a100-80gb").gemm_misaligned_efficiency == 1.0  # not measured on an A100
    with pytest.raises(ProfileError, match="gemm_misaligned_efficiency"):
        dataclasses.replace(H200, gemm_misaligned_efficiency=0.0)


def test_a_table_needs_the_peak_it_is_a_fraction_of():
    tab = {"tf32": _table()["bf16"]}
    with pytest.raises(
        ProfileError,
        match=r"field 'gemm_efficiency.tf32' is a fraction of a peak the profile "
        r"lacks: 'peak_flops' has no 'tf32'",
    ):
        dataclasses.replace(CPU, gemm_efficiency=tab)
    assert math.isclose(dataclasses.replace(H200, gemm_efficiency=tab).gemm_efficiency["tf32"]["m"][1], 4096)
