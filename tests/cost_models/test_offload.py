"""The price of offload (``cost_models.offload_cost``): bytes on each tier by hand, the time parts by
hand, and the parts of a whole strategy's step (``cost_models.strategy.evaluate``)."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.hardware import HardwareProfile, ProfileError, load_hardware
from cost_models.memory import model_state_bytes, zero_transient_bytes
from cost_models.offload_cost import (
    OffloadedLayer,
    check_offload,
    host_state_bytes,
    layer_offload,
    offload_buffer_bytes,
    offload_missing,
    ranks_per_node,
)
from cost_models.strategy import Candidate, NumericTable, candidate_costs, evaluate
from tests.helpers import gpt_table

# A node of two ranks with round numbers: 1 GB/s link per device, NVMe 4 GB/s read and 2 GB/s
# write per node, AdamW 1 G parameters/s per node.
HW = dataclasses.replace(
    load_hardware("a100-80gb"),
    gpus_per_node=2,
    host_device_bandwidth=1e9,
    nvme_read_bandwidth=4e9,
    nvme_write_bandwidth=2e9,
    cpu_adam_params_per_s=1e9,
    host_memory_bytes=2**40,
    nvme_bytes=2**42,
)


def test_device_bytes_per_tier_by_hand():
    # one layer of 1,000 parameters, bf16, dp 2: shard 500
    plain = model_state_bytes(1000, "bf16", 2, 2, largest_layer_params=1000)
    assert plain == {"params": 2000, "grads": 500 * 4 + 3 * (1000 + 500) * 2, "optimizer": 500 * 12}
    # optimizer offloaded at ZeRO 2: no optimizer state, no gradient shard, the buckets in flight only
    assert model_state_bytes(1000, "bf16", 2, 2, largest_layer_params=1000, offload_optimizer="cpu") == {
        "params": 2000,
        "grads": 3 * 1500 * 2,
        "optimizer": 0,
    }
    # at ZeRO 1 the full gradient buffer stays on the device (all-reduced once, then copied)
    assert model_state_bytes(1000, "bf16", 1, 2, offload_optimizer="nvme") == {
        "params": 2000,
        "grads": 2000,
        "optimizer": 0,
    }
    # parameters offloaded at ZeRO 3: the running and the prefetched layer, gathered
    assert model_state_bytes(
        1000, "bf16", 3, 2, largest_layer_params=1000, prefetch=True, offload_optimizer="cpu", offload_params="cpu"
    ) == {"params": 2 * 1000 * 2, "grads": 3 * 1500 * 2, "optimizer": 0}
    # on one rank the parameters still come from the host, and each bucket is the gradient alone
    assert model_state_bytes(
        1000, "bf16", 3, 1, largest_layer_params=1000, prefetch=True, offload_optimizer="cpu", offload_params="nvme"
    ) == {"params": 4000, "grads": 3 * 1000 * 2, "optimizer": 0}
    assert zero_transient_bytes([1000, 10, 1000], "bf16", 3, 1, "cpu", "cpu") == {"params": 1010 * 2, "grads": 2010 * 2}
    assert zero_transient_bytes([1000, 10, 1000], "bf16", 3, 1) == {"params": 0, "grads": 0}


def test_host_and_nvme_bytes_per_tier_by_hand():
    assert host_state_bytes(500, "bf16", "cpu", "none") == (500 * 16, 0)  # master, m, v, grad accumulator
    assert host_state_bytes(500, "bf16", "nvme", "none") == (500 * 4, 500 * 12)
    assert host_state_bytes(500, "bf16", "cpu", "cpu") == (500 * 18, 0)
    assert host_state_bytes(500, "fp32", "nvme", "nvme") == (500 * 4, 500 * 16)
    assert host_state_bytes(500, "bf16", "none", "none") == (0, 0)
    # pinned buffers: 3 gradient buckets, 2 parameter fetches, 2 NVMe swap slots of the state
    assert offload_buffer_bytes(500, "bf16", "nvme", "nvme") == 3 * 1000 + 2 * 1000 + 2 * 6000
    assert offload_buffer_bytes(500, "bf16", "cpu", "none") == 3 * 1000
    # a CPU rank copies into the host tier directly: only the NVMe slots remain
    assert offload_buffer_bytes(500, "bf16", "cpu", "cpu", staged=False) == 0
    assert offload_buffer_bytes(500, "bf16", "nvme", "nvme", staged=False) == 2 * 1000 + 2 * 6000


def test_time_parts_by_hand():
    # 1M parameters at dp 2 (shard 500k, 1 MB in bf16), both kinds on NVMe, 2 ranks per node:
    # per rank NVMe 2 GB/s read, 1 GB/s write, AdamW 500 M/s
    off = layer_offload(OffloadedLayer(10**6, "bf16", 3, 2, "nvme", "nvme"), HW, ranks=2, fwd_s=0.4e-3, bwd_s=0.5e-3)
    # fetch = max(1 MB / 1 GB/s, 1 MB / 2 GB/s) = 1 ms before forward and backward; gradients 1 ms out
    assert off.mb_s == pytest.approx((1e-3 - 0.4e-3) + (1e-3 - 0.5e-3) + (1e-3 - 0.5e-3))
    assert off.optimizer_s == pytest.approx(5e5 / 5e8)
    # state 6 MB read at 2 GB/s and written at 1 GB/s, parameters 1 MB written: 10 ms beside a 1 ms step
    assert off.step_s == pytest.approx(3e-3 + 6e-3 + 1e-3 - 1e-3)
    assert (off.host_b, off.nvme_b) == (5e5 * 4, 5e5 * 14)
    # ZeRO 1, optimizer in host memory: gradients out once per step (exposed), parameters back
    # (1 ms) hidden by the 1 ms AdamW step
    off = layer_offload(OffloadedLayer(10**6, "bf16", 1, 2, "cpu", "none"), HW, ranks=2, fwd_s=1.0, bwd_s=1.0)
    assert (off.mb_s, off.step_s, off.optimizer_s) == (0.0, pytest.approx(1e-3), pytest.approx(1e-3))
    # parameters offloaded with the optimizer on the device: the updated shard goes back each step
    off = layer_offload(OffloadedLayer(10**6, "bf16", 3, 2, "none", "cpu"), HW, ranks=2, fwd_s=1.0, bwd_s=1.0)
    assert (off.mb_s, off.optimizer_s, off.step_s) == (0.0, None, pytest.approx(1e-3))
    assert layer_offload(OffloadedLayer(10**6, "bf16", 2, 2, "none", "none"), HW, 2, 0.0, 0.0).step_s == 0.0


def test_strategy_parts_sum_to_the_step_and_state_leaves_the_device():
    nt = NumericTable(gpt_table(layers=4, hidden=512, heads=8))
    cap = HW.memory_bytes * 0.9
    plain = evaluate(candidate_costs(nt, HW, "bf16", 256, Candidate(2, 1, 1, 2, 2, 2), 2, cap), [(0, 5)])
    cand = Candidate(2, 1, 1, 3, 2, 2, offload_optimizer="nvme", offload_params="cpu")
    cc = candidate_costs(nt, HW, "bf16", 256, cand, 2, cap)
    ev = evaluate(cc, [(0, 5)])
    assert sum(ev.time.values()) == pytest.approx(ev.step_time_s)
    assert ev.time["offload"] == pytest.approx(
        2 * sum(l.offload_mb_s for l in cc.layers) + sum(l.offload_step_s for l in cc.layers)
    )
    assert ev.time["optimizer"] == pytest.approx(sum(l.opt_s for l in cc.layers))
    assert ev.memory["optimizer"] == 0 and ev.memory["params"] < plain.memory["params"]
    assert plain.time["offload"] == 0 and plain.extra["host_bytes"] == plain.extra["nvme_bytes"] == 0
    # per node: 2 ranks x (parameter shard in bf16 + gradient accumulator) + buffers; state on NVMe
    shards = [-(-lay.num_params // 2) for lay in cc.layers]
    assert ev.extra["host_bytes"] == 2 * (sum(6 * s for s in shards) + cc.host_buffers_b)
    assert ev.extra["nvme_bytes"] == 2 * sum(12 * s for s in shards)
    # too little host memory: the same strategy no longer fits
    small = dataclasses.replace(HW, host_memory_bytes=ev.extra["host_bytes"] // 2)
    assert not evaluate(candidate_costs(nt, small, "bf16", 256, cand, 2, cap), [(0, 5)]).feasible


def test_rules_and_missing_fields():
    assert check_offload("cpu", "none", 1) is None and check_offload("nvme", "nvme", 3) is None
    assert "needs ZeRO stage 3" in check_offload("cpu", "cpu", 2)
    assert "needs ZeRO stage 1, 2 or 3" in check_offload("cpu", "none", 0)
    bare = dataclasses.replace(HW, nvme_read_bandwidth=None, cpu_adam_params_per_s=None)
    assert offload_missing(bare, "nvme", "none") == ["cpu_adam_params_per_s", "nvme_read_bandwidth"]
    assert offload_missing(bare, "none", "cpu") == [] and offload_missing(bare, "none", "none") == []
    assert ranks_per_node(1, 8) == 1 and ranks_per_node(64, 8) == 8


@pytest.mark.parametrize("kind", ["a100-40gb", "a100-80gb", "h100-sxm", "h200", "v100-32gb", "cpu"])
def test_every_builtin_profile_can_price_offload(kind):
    hw = load_hardware(kind)
    assert offload_missing(hw, "nvme", "nvme") == []
    assert hw.host_memory_bytes >= hw.memory_bytes and "Offload" in hw.source


def test_profile_offload_fields_are_validated():
    d = load_hardware("cpu").to_dict()
    for field, bad in (("nvme_read_bandwidth", -1), ("host_memory_bytes", 1.5), ("cpu_adam_params_per_s", "fast")):
        with pytest.raises(ProfileError, match=field):
            HardwareProfile.from_dict({**d, field: bad})
