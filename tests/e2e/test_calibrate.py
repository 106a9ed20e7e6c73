"""`planner calibrate`: a quick 2-process run writes a profile the planner loads."""

from __future__ import annotations

import pytest

from cost_models.comm_cost import collective_time, group_placement
from cost_models.compute import adam_step_bytes, optimizer_step_time
from cost_models.hardware import load_hardware
from planner.commands.calibrate import CalibrationSpec, run_calibration


@pytest.mark.dist
def test_quick_calibration_writes_loadable_profile(tmp_path):
    out = tmp_path / "profile.json"
    drive = tmp_path / "drive"
    drive.mkdir()
    prof = run_calibration(2, out, quick=True, progress=False, timeout_s=120, nvme_path=str(drive))
    hw = load_hardware(str(out))
    assert hw == prof
    assert hw.name.startswith("calibrated-") and hw.gpus_per_node == 2
    assert all(hw.peak(dt) > 1e8 for dt in ("fp32", "bf16", "fp16"))  # more than 0.1 GFLOP/s
    assert hw.memory_bandwidth > 1e8 and hw.intra_node_bandwidth > 1e6
    assert 0 <= hw.intra_node_latency < 0.05
    assert 0 <= hw.sync_overhead_s < 0.05 and 0 <= hw.op_overhead_s < 0.01
    assert 0.25 <= hw.recompute_ratio <= 1.5
    # the optimizer step as the runtime runs it: under the copy bandwidth's roofline here (square
    # roots and divisions), and what the cost model prices the step at
    assert 1e8 < hw.optimizer_bytes_per_s == hw.calibration["optimizer_bytes_per_s"]
    assert optimizer_step_time(1 << 23, hw, "fp32") >= adam_step_bytes(1 << 23, "fp32") / hw.optimizer_bytes_per_s
    # a kind whose few quick timings do not grow with size gets no fit and keeps the generic link
    assert set(hw.intra_node_collectives or {}) <= {"all_reduce", "all_gather", "reduce_scatter", "send"}
    # offload figures of this machine (cost_models.offload_cost): the drive under --nvme-path, AdamW, a copy
    assert hw.nvme_read_bandwidth > 1e6 and hw.nvme_write_bandwidth > 1e6 and hw.nvme_bytes > 0
    assert hw.cpu_adam_params_per_s > 1e6 and hw.host_device_bandwidth > 1e7
    assert hw.host_memory_bytes >= hw.memory_bytes
    assert hw.calibration["offload"]["nvme"]["dir"] == str(drive) and list(drive.iterdir()) == []
    assert str(drive) in hw.source
    cal = hw.calibration
    spec = CalibrationSpec.quick()
    assert len(cal["collectives"]) == 4 * len(spec.message_sizes)
    assert {m["kind"] for m in cal["collectives"]} == {"all_reduce", "all_gather", "reduce_scatter", "send"}
    assert set(cal["matmul_flops"]["fp32"]) == {str(n) for n in spec.matmul_sizes}
    # The fitted model is usable straight away by the collective cost model.
    t_small = collective_time("all_reduce", 4096, group_placement([0, 1], hw.gpus_per_node), hw)
    t_big = collective_time("all_reduce", 1 << 24, [0, 1], hw)
    assert 0 < t_small < t_big
