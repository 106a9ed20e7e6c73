"""`planner calibrate --device cuda` without a GPU: the profile built from injected timings, and the
device measurement code run on the CPU (the same functions the CUDA path calls)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
import torch.distributed as dist

from cost_models.comm_cost import ring_terms
from cost_models.compute import gemm_efficiency, matmul_time
from cost_models.hardware import load_hardware
from planner.commands.calibrate import resolve_device, run_calibrate
from planner.commands.calibrate_common import MEASURED_KINDS, CalibrationError, gemm_tables
from planner.commands.calibrate_gpu import (
    MAX_OVERLAP_SLOWDOWN,
    DeviceTimer,
    GpuCalibrationSpec,
    build_gpu_profile,
    collect_single_device,
    datasheet_kind,
    measure_copy_bandwidth,
    measure_gemm_table,
    measure_host_copies,
    measure_op_chain,
    measure_overlap_slowdown,
    run_gpu_calibration,
    time_collective,
)

H200 = load_hardware("h200")
SIZES = [128, 1024, 8192]
MB = 1 << 20


def _true_efficiency(dt: str, m: int, n: int, k: int) -> float:
    """A made-up 'measured' GPU: the default curve of the H200 profile, lowered 10% for fp16."""
    return gemm_efficiency(H200, dt, m, n, k) * (0.9 if dt == "fp16" else 1.0)


def _raw(count=8, alpha=None, bw=None, failed_dtype=None, speedup=1.0, name="NVIDIA H200"):
    """Raw measurements as ``run_gpu_calibration`` collects them, with known answers."""
    alpha = alpha or {"all_reduce": 8e-6, "all_gather": 6e-6, "reduce_scatter": 6e-6, "send": 4e-6}
    bw = bw or {"all_reduce": 3.6e11, "all_gather": 3.7e11, "reduce_scatter": 3.7e11, "send": 3.9e11}
    seconds = {}
    for dt in ("bf16", "fp16", "fp32", "tf32"):
        seconds[dt] = [
            [
                [
                    float("nan")
                    if dt == failed_dtype
                    else 2.0 * m * n * k / (H200.peak(dt) * _true_efficiency(dt, m, n, k) * speedup)
                    for k in SIZES
                ]
                for n in SIZES
            ]
            for m in SIZES
        ]
    colls = []
    n_ranks = count
    for kind in MEASURED_KINDS:
        for size in (256 * 1024, 4 * MB, 64 * MB):
            n = 2 if kind == "send" else n_ranks
            steps, link = ring_terms(kind, size, n)
            colls.append({"kind": kind, "size_bytes": size, "n": n, "seconds": steps * alpha[kind] + link / bw[kind]})
    host = [
        {"direction": d, "size_bytes": s, "seconds": 1e-5 + s / b}
        for d, b in (("h2d", 5.0e10), ("d2h", 4.5e10))
        for s in (MB, 64 * MB)
    ]
    raw = {
        "device": {
            "name": name,
            "count": count,
            "sm_count": 132,
            "memory_bytes": 141 * 2**30,
            "capability": "9.0",
            "torch": "test",
            "cuda": "test",
            "nccl": "test",
        },
        "gemm": {"sizes": {"m": SIZES, "n": SIZES, "k": SIZES}, "seconds": seconds},
        "memory_bandwidth": 4.1e12,
        "op_chain": {"host_s": 9e-6, "device_s": 2e-6, "wall_s": 9e-6},
        "model_op_overhead": {"step_s": 0.0168, "num_ops": 200, "per_op_s": 2.8e-5},
        "host_device": host,
    }
    if count >= 2:
        raw["collectives"] = colls
    else:
        raw["collectives"], raw["collectives_skipped"] = [], "one GPU: nothing to time"
    return raw


def _build(raw, datasheet=True, nproc=8, base=H200):
    return build_gpu_profile(raw, base, GpuCalibrationSpec.quick(), datasheet=datasheet, nproc=nproc)


# ---------------------------------------------------------------------------------------------
# The profile from injected timings
# ---------------------------------------------------------------------------------------------
def test_profile_from_injected_timings(tmp_path):
    p = _build(_raw())
    assert p.name.startswith("calibrated-nvidia-h200-") and p.ops_async and p.sm_count == 132
    assert p.gpus_per_node == 8 and p.memory_bytes == 141 * 2**30 and p.memory_bandwidth == 4.1e12
    assert p.peak_flops == H200.peak_flops  # a known GPU keeps its datasheet peaks
    # the table is the measured fraction of peak, cell by cell
    for dt in ("bf16", "fp16", "fp32", "tf32"):
        tab = p.gemm_efficiency[dt]
        assert tab["m"] == SIZES
        for i, m in enumerate(SIZES):
            for j, n in enumerate(SIZES):
                for l_, k in enumerate(SIZES):
                    assert tab["efficiency"][i][j][l_] == pytest.approx(_true_efficiency(dt, m, n, k))
    assert p.compute_efficiency == pytest.approx(_true_efficiency("bf16", 8192, 8192, 8192))
    # pricing a measured shape gives back its measured time
    t = _raw()["gemm"]["seconds"]["bf16"][1][2][0]  # m=1024, n=8192, k=128
    assert matmul_time(1024, 8192, 128, p, "bf16") == pytest.approx(t, rel=1e-9)
    # collectives: the alpha-beta of each kind, and all together
    assert p.intra_node_collectives["all_reduce"]["latency"] == pytest.approx(8e-6, rel=1e-6)
    assert p.intra_node_collectives["send"]["bandwidth"] == pytest.approx(3.9e11, rel=1e-6)
    assert 4e-6 <= p.intra_node_latency <= 8e-6 and 3.6e11 <= p.intra_node_bandwidth <= 3.9e11
    # what one node cannot measure comes from the datasheet profile
    assert (p.inter_node_latency, p.inter_node_bandwidth) == (H200.inter_node_latency, H200.inter_node_bandwidth)
    assert p.recompute_ratio == 1.0 and p.sync_overhead_s == H200.sync_overhead_s
    assert p.op_overhead_s == 2.8e-5
    assert p.overlap_slowdown == H200.overlap_slowdown  # not measured: the datasheet's estimate
    assert p.optimizer_bytes_per_s is None  # not measured: the roofline prices the step
    measured = _build(dict(_raw(), overlap={"overlap_slowdown": 0.07, "collectives_beside": 3}))
    assert measured.overlap_slowdown == 0.07 and measured.calibration["overlap"]["collectives_beside"] == 3
    assert p.host_device_bandwidth == pytest.approx(4.5e10, rel=1e-6)  # the slower direction
    assert p.calibration["host_device_fit"]["h2d"]["latency_s"] == pytest.approx(1e-5, rel=1e-6)
    assert "CUDA" in p.source and "H200" in p.source
    # strict JSON, read back equal
    path = p.save(tmp_path / "gpu.json")
    assert "NaN" not in path.read_text()
    assert load_hardware(str(path)) == p


def test_one_gpu_skips_the_collectives_and_says_so():
    p = _build(_raw(count=1), nproc=1)
    assert p.intra_node_collectives is None
    assert (p.intra_node_latency, p.intra_node_bandwidth) == (H200.intra_node_latency, H200.intra_node_bandwidth)
    assert p.calibration["collectives_skipped"] == "one GPU: nothing to time"
    assert p.calibration["fit"] is None and "collectives not measured: one GPU" in p.source


def test_unknown_gpu_uses_its_best_measured_rates_as_peaks():
    p = _build(_raw(name="Some Future GPU"), datasheet=False)
    for dt in ("bf16", "fp32", "tf32"):
        best = H200.peak(dt) * max(_true_efficiency(dt, m, n, k) for m in SIZES for n in SIZES for k in SIZES)
        assert p.peak(dt) == pytest.approx(best)
        assert max(x for plane in p.gemm_efficiency[dt]["efficiency"] for row in plane for x in row) == pytest.approx(
            1.0
        )
    assert "best measured GEMM rate" in p.source


def test_a_rate_above_the_datasheet_raises_the_peak():
    p = _build(_raw(speedup=2.0))  # everything twice as fast as the datasheet allows at 0.6
    assert p.peak("bf16") == pytest.approx(H200.peak("bf16") * 1.2)
    assert p.compute_efficiency == pytest.approx(1.0)


def test_a_dtype_that_failed_has_no_table():
    p = _build(_raw(failed_dtype="tf32"))
    assert set(p.gemm_efficiency) == {"bf16", "fp16", "fp32"}
    assert p.calibration["gemm_skipped"] == {"tf32": "a GEMM of the grid could not be timed"}
    assert p.peak("tf32") == H200.peak("tf32")  # the datasheet's, untouched
    with pytest.raises(
        CalibrationError,
        match=r"could not time a fp16 GEMM on Some GPU and it is not a GPU with "
        r"a datasheet profile",
    ):
        _build(_raw(failed_dtype="fp16", name="Some GPU"), datasheet=False)


def test_op_overhead_falls_back_to_the_operator_chain():
    raw = _raw()
    raw["model_op_overhead"] = {"error": "RuntimeError: export failed"}
    assert _build(raw).op_overhead_s == 9e-6
    assert _build(raw).calibration["model_op_overhead"]["error"].startswith("RuntimeError")


def test_gemm_tables_clamp_and_skip():
    sizes = {"m": [2], "n": [2], "k": [2]}
    tabs, skipped = gemm_tables(
        sizes, {"fp32": [[[8.0 / 1e9]]], "bf16": [[[None]]], "tf32": [[[1.0]]]}, {"fp32": 1e9, "bf16": 1e9}
    )
    assert tabs["fp32"]["efficiency"] == [[[1.0]]]  # 2 GFLOP/s on a 1 GFLOP/s peak: kept to 1
    assert set(skipped) == {"bf16", "tf32"}


@pytest.mark.parametrize(
    "name,mem,kind",
    [
        ("NVIDIA H200", 141 * 2**30, "h200"),
        ("NVIDIA H100 80GB HBM3", 80 * 2**30, "h100-sxm"),
        ("NVIDIA H100 PCIe", 80 * 2**30, None),
        ("NVIDIA A100-SXM4-80GB", 80 * 2**30, "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", 40 * 2**30, "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", 40 * 2**30, None),
        ("Tesla V100-SXM2-32GB", 32 * 2**30, "v100-32gb"),
        ("NVIDIA GeForce RTX 4090", 24 * 2**30, None),
    ],
)
def test_datasheet_kind(name, mem, kind):
    assert datasheet_kind(name, mem) == kind


# ---------------------------------------------------------------------------------------------
# The entry points without a GPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_calibration_without_a_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(CalibrationError, match=r"calibrate --device cuda: no CUDA device is visible .*--device cpu"):
        run_gpu_calibration(tmp_path / "p.json")
    args = argparse.Namespace(out=str(tmp_path / "p.json"), nproc=None, quick=True, device="cuda")
    with pytest.raises(CalibrationError, match="no CUDA device is visible"):
        run_calibrate(args)
    assert resolve_device(None) == "cpu" and resolve_device("auto") == "cpu" and resolve_device("CUDA") == "cuda"
    with pytest.raises(CalibrationError, match=r"--device 'tpu': expected auto, cpu or cuda"):
        resolve_device("tpu")


# ---------------------------------------------------------------------------------------------
# The measurement code on the CPU
# ---------------------------------------------------------------------------------------------
CPU = torch.device("cpu")


def test_measurements_run_on_the_cpu():
    timer = DeviceTimer(CPU)
    assert not timer.cuda and len(timer.per_call(lambda: None, 4)) == 4
    ticks = []
    g = measure_gemm_table((8, 32), ("fp32", "bf16"), timer, target_s=1e-4, max_reps=3, tick=ticks.append)
    assert g["sizes"] == {"m": [8, 32], "n": [8, 32], "k": [8, 32]} and len(ticks) == 4
    assert all(t > 0 for plane in g["seconds"]["fp32"] for row in plane for t in row)
    assert measure_copy_bandwidth(timer, MB, 3) > 1e6
    chain = measure_op_chain(timer, 50, 2)
    assert 0 < chain["host_s"] < 1e-2 and chain["device_s"] == chain["wall_s"]
    copies = measure_host_copies(timer, (4096, MB), 3)
    assert [(c["direction"], c["size_bytes"]) for c in copies] == [
        ("h2d", 4096),
        ("d2h", 4096),
        ("h2d", MB),
        ("d2h", MB),
    ]
    # the fp32 matmul precision setting is left as it was
    before = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    measure_gemm_table((8,), ("tf32",), timer, 1e-4, 3)
    assert getattr(torch.backends.cuda.matmul, "fp32_precision", None) == before


def test_single_device_collection_on_the_cpu_builds_a_profile():
    spec = GpuCalibrationSpec(
        gemm_sizes=(16, 64),
        gemm_dtypes=("bf16", "fp16", "fp32"),
        gemm_target_s=1e-4,
        gemm_max_reps=3,
        warmup_s=0,
        copy_bytes=MB,
        copy_reps=3,
        optimizer_params=1 << 16,
        op_chain=20,
        op_rounds=2,
        model_budget_s=0.05,
        host_copy_sizes=(4096, MB),
        host_copy_reps=3,
    )
    ticks = []
    raw = collect_single_device(spec, CPU, tick=ticks.append)
    assert len(ticks) == 1 + 3 * 2 + 3
    assert raw["model_op_overhead"]["per_op_s"] > 0, raw["model_op_overhead"]
    raw["device"] = _raw()["device"] | {"name": "cpu stand-in"}
    raw["collectives"], raw["collectives_skipped"] = [], "one device"
    p = build_gpu_profile(raw, load_hardware("cpu"), spec, datasheet=False, nproc=1)
    assert set(p.gemm_efficiency) == {"bf16", "fp16", "fp32"}
    assert p.op_overhead_s == raw["model_op_overhead"]["per_op_s"] and p.host_device_bandwidth > 0
    assert p.optimizer_bytes_per_s == raw["optimizer_bytes_per_s"] > 1e6  # the step, timed on the device
    assert json.dumps(p.to_dict(), allow_nan=False)


@pytest.mark.dist
def test_time_collective_on_a_one_process_gloo_group():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for kind in MEASURED_KINDS:
            nbytes, n, secs = time_collective(kind, 4096, 0, 1, 3, CPU)
            assert nbytes == 4096 and n == (2 if kind == "send" else 1)
            assert math.isfinite(secs) and secs >= 0
        with pytest.raises(ValueError, match="unknown collective kind 'broadcast'"):
            time_collective("broadcast", 4096, 0, 1, 3, CPU)
        # the contention loop runs (one rank: the all-reduces copy nothing, so about no slowdown)
        seen = measure_overlap_slowdown(DeviceTimer(CPU), rounds=3, size=64, matmuls=2, comm_bytes=4096)
        assert 0.0 <= seen["overlap_slowdown"] <= MAX_OVERLAP_SLOWDOWN and seen["collectives_beside"] >= 1
        assert seen["compute_alone_s"] > 0 and seen["compute_beside_s"] > 0
    finally:
        dist.destroy_process_group()
