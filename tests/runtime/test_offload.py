"""Offload placement checks and error messages, the NVMe file and parameter store, and the memory
tracker's host tier (one process, no process group)."""

from __future__ import annotations

import os

import pytest
import torch

from runtime.contract.input_errors import ConfigError
from runtime.data_parallel.flat_shards import build_groups
from runtime.data_parallel.offload_engine import NvmeFile, OffloadConfig, OffloadError, ParamStore
from runtime.data_parallel.zero_engine import ShardingConfig, ZeroEngine
from runtime.training.memtrack import MemoryTracker
from tests.runtime.zero_harness import (
    BATCH,
    HP,
    MAX_NORM,
    MICRO,
    OPT_CLIPPED,
    data,
    layer_groups,
    make_net,
    reference,
    run_engine,
)


def test_plan_without_offload_is_none_none():
    cfg = OffloadConfig.from_plan({"zero_stage": 0})
    assert (cfg.optimizer, cfg.params, cfg.active) == ("none", "none", False)


def test_nvme_without_a_path_names_the_flag():
    plan = {"zero_stage": 3, "offload": {"optimizer": "nvme", "params": "cpu"}}
    with pytest.raises(OffloadError, match=r"optimizer state on NVMe .* --nvme-path DIR"):
        OffloadConfig.from_plan(plan)
    assert issubclass(OffloadError, ConfigError)  # a bad setting, like the other TrainOptions errors
    assert OffloadConfig.from_plan(plan, "/tmp/x").uses_nvme


def test_params_offload_needs_zero3():
    with pytest.raises(OffloadError, match=r"offload.params='cpu' needs ZeRO stage 3 .* zero_stage 2.*--zero-stage 3"):
        OffloadConfig.from_plan({"zero_stage": 2, "offload": {"optimizer": "none", "params": "cpu"}})


def test_optimizer_offload_needs_a_sharded_optimizer():
    with pytest.raises(OffloadError, match=r"offload.optimizer='cpu' needs ZeRO stage 1, 2 or 3"):
        OffloadConfig("cpu").check(0)


def test_bad_tier_and_bad_key():
    with pytest.raises(OffloadError, match=r"offload.optimizer must be one of none, cpu, nvme, got 'gpu'"):
        OffloadConfig("gpu")
    with pytest.raises(OffloadError, match="must be"):
        OffloadConfig.from_plan({"zero_stage": 3, "offload": {"grads": "cpu"}})


def test_engine_refuses_params_offload_below_zero3():
    net = make_net()
    with pytest.raises(OffloadError, match="needs ZeRO stage 3"):
        ZeroEngine(net, layer_groups(net), sharding=ShardingConfig(zero_stage=1), offload=OffloadConfig(params="cpu"))


def test_nvme_path_that_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(OffloadError, match="is not a folder"):
        OffloadConfig("nvme", nvme_path=str(f)).check(2)


def test_nvme_file_round_trip_and_cleanup(tmp_path):
    (tmp_path / "rank0").mkdir()
    keep = tmp_path / "rank0" / "mine.txt"
    keep.write_text("the user's")
    nf = NvmeFile(str(tmp_path), 0, "optimizer", 3 * 4096)
    a, b = torch.arange(1024, dtype=torch.float32), torch.arange(2048, dtype=torch.float32) * -1
    futs = [nf.write(a, 0), nf.write(b, 4096)]
    back = torch.empty(3072)
    futs += [nf.read(back[:1024], 0), nf.read(back[1024:], 4096)]  # queued after the writes
    for f in futs:
        f.result()
    assert torch.equal(back, torch.cat([a, b]))
    path = nf.path
    nf.close()
    assert not os.path.exists(path)
    assert keep.read_text() == "the user's"  # its folder was the user's: kept, with their file


def test_param_store_reads_ahead_in_the_last_steps_order(tmp_path):
    net = make_net()
    groups = build_groups(net, layer_groups(net), 1)
    store = ParamStore(
        OffloadConfig(params="nvme", nvme_path=str(tmp_path)), groups, torch.float32, torch.device("cpu")
    )
    for g in groups:
        store.store(g, torch.full((g.shard,), float(g.index)))
    order = [0, 1, 2, 3, 4, 4, 3, 2, 1, 0]  # a forward, then backward's reverse
    for _ in range(2):
        for i in order:
            assert torch.equal(store.fetch(groups[i]), torch.full((groups[i].shard,), float(i)))
        store.end_step()
    assert store._order == order
    assert sorted(store._held) == [0, 1]  # the next step's first two groups are being read already
    store.close()
    assert os.listdir(tmp_path) == []


def test_tracker_does_not_count_the_host_tier():
    host = torch.zeros(1 << 16)  # 256 KiB "offloaded"
    dev = torch.zeros(1 << 10)
    mt = MemoryTracker(device="cpu")
    mt.exclude([host])
    mt.track_existing([dev, host])
    with mt:
        host.add_(1.0)  # an op reads and writes the host tensor: still not counted
        tmp = dev * 2
        peak = mt.peak_bytes
    del tmp
    assert peak == 2 * dev.numel() * 4


def _delayed_reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain torch with a one-step delayed update: step k's gradient is taken at the parameters that
    include the updates up to step k - 2; the masters (a second copy under torch's AdamW) include
    all of them. Returns the losses and the final masters."""
    net, master = make_net(), make_net()
    opt = torch.optim.AdamW(master.parameters(), **HP)
    losses = []
    for s in range(steps):
        x, y = data(s)
        total = 0.0
        for i in range(MICRO):
            mb = BATCH // MICRO
            loss = net(x[i * mb : (i + 1) * mb], y[i * mb : (i + 1) * mb])
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        with torch.no_grad():
            for p, m in zip(net.parameters(), master.parameters()):
                m.grad = p.grad.clone()
                p.copy_(m)  # the update of step k - 1 reaches the model now
                p.grad = None
        opt.step()
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_delayed_update_lags_one_step(tmp_path, tier):
    steps = 4
    ref_losses, ref_masters = _delayed_reference(steps)
    net = make_net()
    engine = ZeroEngine(
        net,
        layer_groups(net),
        sharding=ShardingConfig(zero_stage=1, micro_batches_per_step=MICRO),
        optimizer=OPT_CLIPPED,
        offload=OffloadConfig(tier, nvme_path=str(tmp_path), delayed_update=True),
    )
    losses, _ = run_engine(engine, steps, 0, 1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    masters = engine.full_state_dict()  # waits for the last step's update
    for name, t in ref_masters.items():
        torch.testing.assert_close(masters[name], t, rtol=1e-5, atol=1e-6)
    undelayed, _ = reference(steps)
    assert losses[2] != pytest.approx(undelayed[2], rel=1e-4)  # the lag is real
    engine.close()


def test_delayed_update_needs_optimizer_offload():
    net = make_net()
    with pytest.raises(OffloadError, match="delayed update .* needs a plan that offloads the optimizer"):
        ZeroEngine(
            net, layer_groups(net), sharding=ShardingConfig(zero_stage=1), offload=OffloadConfig(delayed_update=True)
        )
