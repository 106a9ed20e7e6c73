"""Hardware profiles, roofline compute time, collective models and memory formulas."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.comm_cost import (
    GroupPlacement,
    axis_placement,
    collective_time,
    group_placement,
    hierarchical_time,
    ring_time,
    total_bytes_sent,
    zero_dp_collectives,
)
from cost_models.compute import compute_time, matmul_time, optimizer_step_time, ridge_intensity
from cost_models.hardware import KNOWN_KINDS, HardwareProfile, ProfileError, load_hardware
from cost_models.memory import (
    activation_bytes,
    backward_transient_bytes,
    inflight_microbatches,
    memory_breakdown,
    model_state_bytes,
    shard_elements,
    split_by_tp,
    stage_activation_bytes,
    zero_transient_bytes,
)
from runtime.contract.collective_bytes import ring_bytes
from runtime.contract.rank_layout import axis_pattern, axis_ranks, coords_of, cp_index_of, expert_ranks, rank_of

FAST = settings(max_examples=60, deadline=None)


def _valid() -> dict:
    return load_hardware("a100-80gb").to_dict()


def _write(tmp_path, obj, name="p.json") -> str:
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


# ---------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KNOWN_KINDS)
def test_every_kind_loads_with_sane_numbers(kind):
    hw = load_hardware(kind)
    assert hw.name == kind
    assert hw.peak("bf16") >= hw.peak("fp32") > 0
    assert 0 < hw.compute_efficiency <= 1
    assert hw.inter_node_bandwidth <= hw.intra_node_bandwidth
    assert hw.inter_node_latency >= hw.intra_node_latency >= 0
    assert hw.gpus_per_node >= 1 and hw.memory_bytes > 0 and hw.source


def test_vendor_figures():
    a100 = load_hardware("a100-80gb")
    assert a100.peak("bf16") == 312e12 and a100.peak("fp32") == 19.5e12 and a100.peak("tf32") == 156e12
    assert a100.memory_bytes == 80 * 2**30 and a100.intra_node_bandwidth == 300e9
    assert a100.inter_node_bandwidth == 200e9 / 8  # one HDR 200 Gb/s NIC per GPU
    h100 = load_hardware("h100-sxm")
    assert h100.peak("bf16") == 989.4e12 and h100.inter_node_bandwidth == 400e9 / 8
    assert load_hardware("h200").memory_bytes == 141 * 2**30
    assert load_hardware("a100-40gb").memory_bandwidth == 1555e9
    assert load_hardware("v100-32gb").peak("fp16") == 125e12


def test_gpus_per_node_override_and_roundtrip(tmp_path):
    hw = load_hardware("h100-sxm", gpus_per_node=4)
    assert hw.gpus_per_node == 4 and load_hardware("H100-SXM").gpus_per_node == 8
    path = hw.save(tmp_path / "sub" / "h.json")
    again = load_hardware(str(path))
    assert again == hw and hash(again) == hash(hw)
    with pytest.raises(ProfileError, match=r"--gpus-per-node override for 'h100-sxm'.*'gpus_per_node'"):
        load_hardware("h100-sxm", gpus_per_node=0)


def test_unknown_kind_lists_known_kinds():
    with pytest.raises(ProfileError) as e:
        load_hardware("a100")
    msg = str(e.value)
    assert "unknown hardware kind 'a100'" in msg
    assert all(k in msg for k in KNOWN_KINDS)
    assert "Did you mean 'a100-" in msg
    with pytest.raises(ProfileError, match="Did you mean 'h100-sxm'"):  # a prefix beats 'h200'
        load_hardware("h100")


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match=r"hardware profile file not found: .*nope\.json"):
        load_hardware(str(tmp_path / "nope.json"))


def test_malformed_json_gives_line_and_column(tmp_path):
    path = _write(tmp_path, '{\n  "name": "x",\n  "memory_bytes": 12,,\n}')
    with pytest.raises(ProfileError, match=r"p\.json is not valid JSON: .* \(line 3, column 22\)"):
        load_hardware(path)


def test_top_level_must_be_object(tmp_path):
    with pytest.raises(ProfileError, match=r"top level must be a JSON object, got list"):
        load_hardware(_write(tmp_path, [1, 2]))


def test_missing_field_named_with_file(tmp_path):
    d = _valid()
    del d["memory_bandwidth"]
    with pytest.raises(ProfileError, match=r"p\.json: missing field 'memory_bandwidth' \(required: name, "):
        load_hardware(_write(tmp_path, d))


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        ("memory_bandwidth", -1, r"field 'memory_bandwidth' must be a positive number of bytes/s \(got -1\)"),
        ("intra_node_latency", -1e-6, r"field 'intra_node_latency' must be a non-negative number"),
        ("inter_node_bandwidth", "fast", r"field 'inter_node_bandwidth' must be a positive number .*'fast'"),
        ("gpus_per_node", 0, r"field 'gpus_per_node' must be a positive integer \(got 0\)"),
        ("gpus_per_node", 2.5, r"field 'gpus_per_node' must be a positive integer \(got 2.5\)"),
        ("memory_bytes", True, r"field 'memory_bytes' must be a positive integer \(got True\)"),
        ("compute_efficiency", 1.5, r"field 'compute_efficiency' must be a number in \(0, 1\]"),
        ("recompute_ratio", 0, r"field 'recompute_ratio' must be a number in \(0, 2\]"),
        ("recompute_ratio", "fast", r"field 'recompute_ratio' must be a number in \(0, 2\].*'fast'"),
        ("name", "", r"field 'name' must be a non-empty string"),
        ("peak_flops", 3e14, r"field 'peak_flops' must be an object of FLOP/s by dtype"),
        (
            "peak_flops",
            {"fp32": 1e12, "bf16": 2e12},
            r"field 'peak_flops' is missing dtype 'fp16' \(required: fp32, bf16, fp16",
        ),
        (
            "peak_flops",
            {"fp32": 1, "bf16": 1, "fp16": 1, "int8": 1},
            r"field 'peak_flops' has unknown dtype 'int8' \(allowed: fp32, tf32",
        ),
        ("peak_flops", {"fp32": 1, "bf16": -2, "fp16": 1}, r"field 'peak_flops.bf16' must be a positive"),
        ("intra_node_collectives", [1], r"field 'intra_node_collectives' must be an object like"),
        (
            "intra_node_collectives",
            {"allreduce": {"latency": 0, "bandwidth": 1}},
            r"field 'intra_node_collectives' has unknown collective 'allreduce' \(allowed: all_reduce, all_gather, reduce_scatter, send\)",
        ),
        (
            "intra_node_collectives",
            {"send": {"bandwidth": 1}},
            r"field 'intra_node_collectives.send' must be an object with exactly 'latency' \(s\) and 'bandwidth'",
        ),
        (
            "intra_node_collectives",
            {"send": {"latency": 0, "bandwidth": 0}},
            r"field 'intra_node_collectives.send.bandwidth' must be a positive number of bytes/s \(got 0\)",
        ),
    ],
)
def test_bad_field_values_name_field_and_file(tmp_path, field, value, pattern):
    d = _valid()
    d[field] = value
    with pytest.raises(ProfileError, match=r"hardware profile .*p\.json: " + pattern):
        load_hardware(_write(tmp_path, d))


def test_unknown_field_suggests_spelling(tmp_path):
    d = _valid()
    d["memory_bandwith"] = d.pop("memory_bandwidth")
    with pytest.raises(ProfileError, match=r"unknown field 'memory_bandwith' \(did you mean 'memory_bandwidth'\?\)"):
        load_hardware(_write(tmp_path, d))


def test_integral_float_accepted_and_peak_lookup_error():
    d = _valid()
    d["memory_bytes"] = float(d["memory_bytes"])
    hw = HardwareProfile.from_dict(d)
    assert hw.memory_bytes == 80 * 2**30 and isinstance(hw.memory_bytes, int)
    with pytest.raises(ProfileError, match=r"no peak FLOP/s for dtype 'tf32' \(it has: bf16, fp16, fp32\)"):
        load_hardware("cpu").peak("tf32")


# ---------------------------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------------------------
def test_roofline_compute_and_memory_bound():
    hw = load_hardware("a100-80gb")
    rate = 312e12 * 0.7
    assert compute_time(1e15, 1e6, hw, "bf16") == pytest.approx(1e15 / rate)
    assert compute_time(1e6, 2.039e12, hw, "bf16") == pytest.approx(1.0)  # memory-bound: 1 s
    assert compute_time(1e12, 0, hw, "fp32") == pytest.approx(1e12 / (19.5e12 * 0.7))
    # Intensity just below / above the ridge point flips the binding ceiling.
    ridge = ridge_intensity(hw, "bf16")
    assert compute_time(ridge * 0.5 * 1e9, 1e9, hw, "bf16") == pytest.approx(1e9 / hw.memory_bandwidth)
    assert compute_time(ridge * 2 * 1e9, 1e9, hw, "bf16") == pytest.approx(ridge * 2 * 1e9 / rate)
    n = 8192
    assert matmul_time(n, n, n, hw, "bf16") == pytest.approx(2 * n**3 / rate)
    with pytest.raises(ValueError, match="no peak FLOP/s for dtype 'int8'"):
        compute_time(1, 1, hw, "int8")
    with pytest.raises(ValueError, match="flops must be >= 0"):
        compute_time(-1, 1, hw, "fp32")


def test_optimizer_step_is_memory_bound_at_the_runtimes_passes():
    """The step as ``ZeroEngine.step`` + ``zero_grad`` run it: norm (2 reads), fused AdamW with the
    clip and decay inside (28), the zeroed gradient; mixed precision adds the fp32 casts of the
    gradient (twice) and of the master back to the compute copy."""
    hw = load_hardware("h100-sxm")
    assert optimizer_step_time(10**9, hw, "fp32") == pytest.approx((8 + 28 + 4) * 1e9 / 3.35e12)
    assert optimizer_step_time(10**9, hw, "bf16") == pytest.approx((12 + 8 + 28 + 6 + 2) * 1e9 / 3.35e12)


def test_a_measured_optimizer_rate_prices_the_step_instead_of_the_roofline():
    """``optimizer_bytes_per_s`` (what ``planner calibrate`` measures): the fp32 step's bytes at
    that rate, slower or faster than the roofline's, and the casts at the copy bandwidth; invalid
    values are refused."""
    base = load_hardware("cpu")
    roofline = optimizer_step_time(10**7, base, "fp32")
    slow = dataclasses.replace(base, optimizer_bytes_per_s=base.memory_bandwidth / 2)
    fast = dataclasses.replace(base, optimizer_bytes_per_s=base.memory_bandwidth * 4)
    assert optimizer_step_time(10**7, slow, "fp32") == pytest.approx(40 * 10**7 / (base.memory_bandwidth / 2))
    # mixed precision's casts (16 of its 56 bytes) run at the copy bandwidth, the fp32 step at the rate
    assert optimizer_step_time(10**7, slow, "bf16") == pytest.approx(
        40 * 10**7 / (base.memory_bandwidth / 2) + 16 * 10**7 / base.memory_bandwidth
    )
    assert roofline == pytest.approx(40 * 10**7 / base.memory_bandwidth)  # memory-bound without a rate
    assert optimizer_step_time(10**7, fast, "fp32") == pytest.approx(40 * 10**7 / (base.memory_bandwidth * 4))
    for bad in (0, -1.0, float("nan"), "fast"):
        with pytest.raises(ProfileError, match="optimizer_bytes_per_s"):
            dataclasses.replace(base, optimizer_bytes_per_s=bad)


def test_symbolic_costs_substitute():
    sympy = pytest.importorskip("sympy")
    b = sympy.Symbol("b", positive=True)
    hw = load_hardware("a100-80gb")
    t = compute_time(1e12 * b, 1e3 * b, hw, "bf16")
    assert float(t.subs(b, 4)) == pytest.approx(compute_time(4e12, 4e3, hw, "bf16"))
    c = collective_time("all_reduce", 1e6 * b, group_placement(range(16), 8), hw)
    assert float(c.subs(b, 3)) == pytest.approx(collective_time("all_reduce", 3e6, list(range(16)), hw))


# ---------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------
def test_ring_bytes_contract_values():
    assert ring_bytes("all_reduce", 800, 8) == 1400
    assert ring_bytes("all_gather", 800, 8) == 700
    assert ring_bytes("reduce_scatter", 800, 4) == 600
    assert ring_bytes("p2p", 800, 2) == ring_bytes("send", 800, 2) == 800
    assert ring_bytes("all_to_all", 800, 4) == 600
    assert ring_bytes("all_reduce", 800, 1) == 0
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        ring_bytes("gather", 1, 2)


def test_intra_node_ring_exact():
    hw = load_hardware("a100-80gb")
    S = 1e9
    t = collective_time("all_reduce", S, list(range(8)), hw)
    assert t == pytest.approx(2 * 7 * 3e-6 + 2 * 7 / 8 * S / 300e9)
    assert collective_time("all_gather", S, list(range(8)), hw) == pytest.approx(7 * 3e-6 + 7 / 8 * S / 300e9)
    assert collective_time("send", S, [3, 4], hw) == pytest.approx(3e-6 + S / 300e9)
    assert collective_time("send", S, [7, 8], hw) == pytest.approx(10e-6 + S / 25e9)  # crosses nodes
    assert collective_time("all_reduce", S, [5], hw) == 0
    with pytest.raises(ValueError, match="point-to-point transfer is between 2 ranks"):
        collective_time("send", S, [0, 1, 2], hw)
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        collective_time("all_reduce", S, [0, 1], hw, algorithm="tree")


def test_per_collective_links_price_each_kind(tmp_path):
    """A profile's intra_node_collectives replaces the intra-node link for the kinds it lists
    (the rest keep the generic link; inter-node groups keep the network) and round-trips."""
    d = _valid()
    d["intra_node_collectives"] = {
        "reduce_scatter": {"latency": 1e-4, "bandwidth": 1e9},
        "send": {"latency": 2e-6, "bandwidth": 5e11},
    }
    hw = load_hardware(_write(tmp_path, d))
    S = 1e8
    assert collective_time("reduce_scatter", S, range(8), hw) == pytest.approx(7 * 1e-4 + 7 / 8 * S / 1e9)
    assert collective_time("all_gather", S, range(8), hw) == pytest.approx(7 * 3e-6 + 7 / 8 * S / 300e9)
    assert collective_time("recv", S, [0, 1], hw) == pytest.approx(2e-6 + S / 5e11)  # a send's link
    assert collective_time("send", S, [7, 8], hw) == pytest.approx(10e-6 + S / 25e9)  # crosses nodes
    # hierarchical all-reduce: its intra-node reduce-scatter phase uses that kind's link
    pl = group_placement(range(16), 8)
    expect = (7 * 1e-4 + 7 / 8 * S / 1e9) + (7 * 3e-6 + 7 / 8 * S / 300e9) + 2 * 10e-6 + (S / 8) / 25e9
    assert hierarchical_time("all_reduce", S, pl, hw) == pytest.approx(expect)
    again = load_hardware(hw.save(tmp_path / "again.json"))
    assert again == hw and hash(again) == hash(hw)
    assert "intra_node_collectives" not in load_hardware("a100-80gb").to_dict()


def test_cross_node_ring_uses_network_and_hierarchical_formula():
    hw = load_hardware("a100-80gb")
    S = 1e9
    pl = group_placement(range(32), 8)
    assert (pl.size, pl.nodes, pl.ranks_per_node) == (32, 4, 8)
    assert ring_time("all_reduce", S, pl, hw) == pytest.approx(2 * 31 * 10e-6 + 2 * 31 / 32 * S / 25e9)
    expect = 2 * (7 * 3e-6 + 7 / 8 * S / 300e9) + 2 * 3 * 10e-6 + 2 * 3 / 4 * (S / 8) / 25e9
    assert hierarchical_time("all_reduce", S, pl, hw) == pytest.approx(expect)
    assert collective_time("all_reduce", S, pl, hw) == pytest.approx(expect)  # auto picks it


@FAST
@given(
    nodes=st.integers(2, 16),
    per_node=st.integers(2, 8),
    size=st.floats(1e3, 1e11),
    ratio=st.floats(4, 100),
    kind=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]),
)
def test_hierarchical_beats_flat_ring_when_network_is_slow(nodes, per_node, size, ratio, kind):
    base = load_hardware("h100-sxm").to_dict()
    base.update(inter_node_bandwidth=base["intra_node_bandwidth"] / ratio, gpus_per_node=per_node)
    hw = HardwareProfile.from_dict(base)
    pl = group_placement(range(nodes * per_node), per_node)
    assert hierarchical_time(kind, size, pl, hw) < ring_time(kind, size, pl, hw)
    assert collective_time(kind, size, pl, hw) == hierarchical_time(kind, size, pl, hw)


@FAST
@given(
    ranks=st.lists(st.integers(0, 255), min_size=1, max_size=32, unique=True),
    gpn=st.sampled_from([1, 2, 4, 8]),
    s1=st.floats(0, 1e10),
    s2=st.floats(0, 1e10),
    kind=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]),
    algorithm=st.sampled_from(["auto", "ring", "hierarchical"]),
)
def test_time_monotone_in_size_and_nonnegative(ranks, gpn, s1, s2, kind, algorithm):
    hw = load_hardware("a100-40gb", gpus_per_node=gpn)
    lo, hi = sorted((s1, s2))
    t_lo = collective_time(kind, lo, ranks, hw, algorithm)
    t_hi = collective_time(kind, hi, ranks, hw, algorithm)
    assert 0 <= t_lo <= t_hi
    # The network is never faster than NVLink here, so spreading over nodes never helps.
    if len(ranks) > 1:
        inside = collective_time(kind, hi, list(range(len(ranks))), load_hardware("a100-40gb", gpus_per_node=256))
        assert inside <= t_hi * (1 + 1e-12)


def test_group_placement_and_validation():
    assert group_placement([0, 8, 16, 24], 8) == GroupPlacement(4, 4, 1)
    pl = group_placement([6, 7, 8], 8)
    assert (pl.nodes, pl.ranks_per_node, pl.min_ranks_per_node, pl.even) == (2, 2, 1, False)
    with pytest.raises(ValueError, match=r"ranks of a group must be distinct \(got \[1, 1\]\)"):
        group_placement([1, 1], 8)
    with pytest.raises(ValueError, match="non-negative integers"):
        group_placement([-1], 8)
    with pytest.raises(ValueError, match="cannot sit on 2 nodes"):
        GroupPlacement(3, 2, 1)


@FAST
@given(
    dp=st.integers(1, 6),
    tp=st.integers(1, 6),
    pp=st.integers(1, 5),
    gpn=st.sampled_from([1, 2, 3, 4, 8]),
    axis=st.sampled_from(["tp", "dp", "pp"]),
)
def test_axis_placement_matches_mesh_layout(dp, tp, pp, gpn, axis):
    world = dp * tp * pp
    # Brute force: group ranks by the coordinates other than `axis`, using the contract's coordinates.
    idx = "pp dp tp".split().index(axis)
    groups: dict = {}
    for r in range(world):
        c = coords_of(r, dp, tp)
        assert rank_of(*c, dp, tp) == r
        groups.setdefault(tuple(x for i, x in enumerate(c) if i != idx), []).append(r)
    expected = sorted(sorted(g) for g in groups.values())
    assert sorted(sorted(g) for g in axis_ranks(axis, dp, tp, pp)) == expected
    placements = [group_placement(g, gpn) for g in expected]
    got = axis_placement(axis, dp, tp, pp, gpn)
    assert got in placements
    assert got.size == {"tp": tp, "dp": dp, "pp": pp}[axis]
    assert got.nodes == max(p.nodes for p in placements)


@settings(max_examples=60, deadline=None)
@given(
    dp=st.integers(1, 4),
    cp=st.integers(1, 4),
    tp=st.integers(1, 3),
    pp=st.integers(1, 3),
    axis=st.sampled_from(["tp", "cp", "dp", "pp", "dp_cp"]),
)
def test_context_parallel_axis_sits_between_tp_and_dp(dp, cp, tp, pp, axis):
    """Brute force from ``rank = ((p * dp + d) * cp + c) * tp + t``: every rank once, coordinates
    round-trip, and a group of an axis shares every coordinate but that axis's (both dp and cp
    for ``dp_cp``), listed in rank order."""
    cells = [(p, d, c, t) for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)]
    ranks = [rank_of(p, d, t, dp, tp, cp, c) for p, d, c, t in cells]
    assert ranks == list(range(dp * cp * tp * pp))
    for (p, d, c, t), rank in zip(cells, ranks):
        assert coords_of(rank, dp, tp, cp) == (p, d, t) and cp_index_of(rank, tp, cp) == c
    varying = {"tp": {3}, "cp": {2}, "dp": {1}, "pp": {0}, "dp_cp": {1, 2}}[axis]
    by_key: dict = {}
    for cell, rank in zip(cells, ranks):
        by_key.setdefault(tuple(x for i, x in enumerate(cell) if i not in varying), []).append(rank)
    assert axis_ranks(axis, dp, tp, pp, cp) == list(by_key.values())
    if cp == 1 and axis != "dp_cp":  # the three-axis layout is unchanged
        assert axis_ranks(axis, dp, tp, pp, cp) == axis_ranks(axis, dp, tp, pp)
    offsets, bases = axis_pattern(axis, dp, tp, pp, cp)
    assert [[base + offset for offset in offsets] for base in bases] == list(by_key.values())
    for gpn in (1, 2, 3, 4, 8):  # one group per base residue places the worst group of all
        placements = [group_placement(group, gpn) for group in by_key.values()]
        got = axis_placement(axis, dp, tp, pp, gpn, cp)
        assert got in placements
        assert (got.nodes, -got.fewest_per_node) == max((p.nodes, -p.fewest_per_node) for p in placements)


@settings(max_examples=40, deadline=None)
@given(edp=st.integers(1, 4), ep=st.integers(1, 4), tp=st.integers(1, 3), pp=st.integers(1, 3))
def test_expert_groups_split_each_dp_group_ep_innermost(edp, ep, tp, pp):
    """Brute force from ``dp_index = edp_index * ep + ep_index``: an expert group shares every
    coordinate but ep_index, an expert-data group every coordinate but edp_index."""
    dp = edp * ep
    expert_groups, data_groups = expert_ranks(dp, tp, pp, ep)
    for groups, varying in ((expert_groups, "ep"), (data_groups, "edp")):
        by_key: dict = {}
        for r in range(dp * tp * pp):
            p, d, t = coords_of(r, dp, tp)
            key = (p, t, d % ep) if varying == "edp" else (p, t, d // ep)
            by_key.setdefault(key, []).append(r)
        assert sorted(groups) == sorted(by_key.values())
    assert all(len(g) == ep for g in expert_groups) and all(len(g) == edp for g in data_groups)


def test_axis_placement_typical_layout():
    # 64 GPUs, 8 per node: tp=8 stays in a node, dp=4 strides over 4 nodes, pp=2 over 2.
    assert axis_placement("tp", 4, 8, 2, 8) == GroupPlacement(8, 1, 8)
    assert axis_placement("dp", 4, 8, 2, 8) == GroupPlacement(4, 4, 1)
    assert axis_placement("pp", 4, 8, 2, 8) == GroupPlacement(2, 2, 1)
    assert axis_placement("dp", 4, 2, 1, 8) == GroupPlacement(4, 1, 4)
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'"):
        axis_placement("ep", 1, 1, 1, 8)


def test_zero_dp_collectives_bytes():
    P, dp = 1001, 4  # padded to 1004 elements
    assert zero_dp_collectives(P, "bf16", 0, dp) == [("all_reduce", 2002)]
    assert zero_dp_collectives(P, "fp32", 1, dp) == [("all_reduce", 4016), ("all_gather", 4016)]
    assert zero_dp_collectives(P, "fp32", 2, dp) == [("reduce_scatter", 4016), ("all_gather", 4016)]
    z3 = zero_dp_collectives(P, "bf16", 3, dp)
    assert z3 == [("all_gather", 2008), ("all_gather", 2008), ("reduce_scatter", 2008)]
    assert total_bytes_sent(z3, dp) == pytest.approx(3 * 3 / 4 * 2008)
    assert zero_dp_collectives(P, "bf16", 2, 1) == []


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,w,g,opt", [("bf16", 2, 2, 12), ("fp16", 2, 2, 12), ("fp32", 4, 4, 8)])
def test_model_state_bytes_exact(dtype, w, g, opt):
    P, dp, L = 1_000_003, 8, 1000
    shard = 125_001  # ceil(1_000_003 / 8): flat buffer padded to 1_000_008
    assert model_state_bytes(P, dtype, 0, dp, L) == {"params": P * w, "grads": P * g, "optimizer": P * opt}
    assert model_state_bytes(P, dtype, 1, dp, L) == {"params": P * w, "grads": P * g, "optimizer": shard * opt}
    # ZeRO-2/3 keep the gradient shard as an fp32 accumulator (4 bytes) whatever the dtype, and
    # hold up to 3 layers' full gradients with their reduced shards (125 of 1000) in flight.
    inflight = 3 * (L + 125) * g
    assert model_state_bytes(P, dtype, 2, dp, L) == {
        "params": P * w,
        "grads": shard * 4 + inflight,
        "optimizer": shard * opt,
    }
    assert model_state_bytes(P, dtype, 3, dp, L) == {
        "params": shard * w + L * w,
        "grads": shard * 4 + inflight,
        "optimizer": shard * opt,
    }
    assert model_state_bytes(P, dtype, 3, dp, L, prefetch=True)["params"] == shard * w + 2 * L * w
    # dp = 1: no gather buffers exist; 16 bytes per parameter in total, except that ZeRO-2/3
    # still accumulate gradients in fp32 (2 more bytes in bf16/fp16).
    for z in range(4):
        extra = (4 - g) * P if z >= 2 else 0
        assert sum(model_state_bytes(P, dtype, z, 1, L).values()) == 16 * P + extra


def test_zero_transient_bytes_windows():
    # layers of 10, 100, 1, 1, 50 parameters, bf16 (2 bytes), dp 4 (shards of ceil(P / 4))
    ps = [10, 100, 1, 1, 50]
    # ZeRO-3 gathers a layer and prefetches the next: the largest consecutive pair is 10 + 100
    assert zero_transient_bytes(ps, "bf16", 3, 4)["params"] == (10 + 100) * 2
    # 3 consecutive layers' gradients + shards: [10, 100, 1] -> (10+3 + 100+25 + 1+1) * 2 = 280
    # beats [100, 1, 1] (258) and [1, 1, 50] (134 bytes)
    assert zero_transient_bytes(ps, "bf16", 2, 4) == {"params": 0, "grads": 280}
    assert zero_transient_bytes(ps, "bf16", 3, 4)["grads"] == 280
    assert zero_transient_bytes(ps, "bf16", 1, 4) == {"params": 0, "grads": 0}
    assert zero_transient_bytes(ps, "bf16", 3, 1) == {"params": 0, "grads": 0}  # nothing sharded
    assert zero_transient_bytes([7], "fp32", 3, 2) == {"params": 28, "grads": (7 + 4) * 4}
    assert zero_transient_bytes([], "fp32", 3, 2) == {"params": 0, "grads": 0}
    # the bound of model_state_bytes fills every window with the largest layer
    bound = model_state_bytes(sum(ps), "bf16", 2, 4, max(ps))["grads"] - shard_elements(sum(ps), 4) * 4
    assert bound == 3 * (100 + 25) * 2 >= 280
    assert backward_transient_bytes(1000) == 2000


def test_model_state_bytes_errors():
    with pytest.raises(ValueError, match=r"zero_stage must be 0, 1, 2 or 3 \(got 4\)"):
        model_state_bytes(10, "bf16", 4, 2)
    with pytest.raises(ValueError, match="unknown training dtype 'int8'"):
        model_state_bytes(10, "int8", 0, 2)
    with pytest.raises(ValueError, match=r"largest_layer_params \(11\) cannot exceed num_params \(10\)"):
        model_state_bytes(10, "bf16", 3, 2, 11)
    with pytest.raises(ValueError, match="dp must be an integer >= 1"):
        model_state_bytes(10, "bf16", 3, 0)


@FAST
@given(p=st.integers(1, 16), m=st.integers(1, 64), data=st.data())
def test_inflight_microbatches_1f1b(p, m, data):
    i = data.draw(st.integers(0, p - 1))
    k = inflight_microbatches(i, p, m)
    assert k == min(p - i, m)
    # Simulate 1F1B on stage i: warm-up forwards, then one forward + one backward each.
    warm = min(p - i - 1, m)
    live = peak = 0
    for _ in range(warm):
        live += 1
        peak = max(peak, live)
    for _ in range(m - warm):
        live += 1
        peak = max(peak, live)
        live -= 1
    assert peak == k


def test_activation_bytes_with_recompute():
    assert activation_bytes(100, 0, 4, 8) == 400
    assert activation_bytes(100, 3, 4, 8, recompute_peak_bytes=50) == 150
    saved, boundary = [100, 200, 300], [10, 20, 30]
    assert stage_activation_bytes(saved, boundary, [False] * 3, 1, 4, 8) == 3 * 600
    assert stage_activation_bytes(saved, boundary, [True, False, True], 1, 4, 8) == 3 * (10 + 200 + 30) + 300
    assert stage_activation_bytes(saved, boundary, [True] * 3, 0, 2, 1) == 60 + 300
    with pytest.raises(ValueError, match="one entry per layer"):
        stage_activation_bytes(saved, boundary, [True], 0, 1, 1)
    with pytest.raises(ValueError, match=r"stage_index must be in 0..3 \(got 4\)"):
        inflight_microbatches(4, 4, 8)
    assert split_by_tp(1001, 7, 4) == 251 + 7


def test_memory_breakdown_total():
    mem = memory_breakdown(1000, "bf16", 1, 4, activations=5000)
    assert mem == {
        "params": 2000,
        "grads": 2000,
        "optimizer": 250 * 12,
        "activations": 5000,
        "total": 2000 + 2000 + 3000 + 5000,
    }
    assert math.isclose(mem["total"], sum(v for k, v in mem.items() if k != "total"))


def test_backward_transient_counts_the_fresh_weight_gradient():
    from cost_models.memory import backward_transient_bytes

    assert backward_transient_bytes(100) == 200  # 2 x the largest activation
    assert backward_transient_bytes(100, weight_grad=50) == 200  # the activations dominate
    assert backward_transient_bytes(100, weight_grad=8000) == 8100  # an embedding's dense gradient


def test_tensor_parallel_weight_products_accumulate_themselves():
    """The weights whose gradient the runtime's tp linears add into the gradient buffer with the
    product (``runtime.tensor_parallel.overlapped``): the column-parallel ones (QKV, the first MLP
    linear, the LM head) whenever their autograd function runs, the row-parallel ones (output
    projection, second MLP linear) too under SP with overlap in fp32; none at tp 1, never the
    embedding (its gradient is an index-add). Backward then makes no accumulation pass over them."""
    from cost_models.layer_row import LayerRow, NumericTable
    from cost_models.wgrad import fused_weight_elements
    from planner.frontend.model_analysis import build_layer_table

    h, f, vocab, tokens = 64, 256, 128, 32
    table = NumericTable(build_layer_table("gpt", layers=2, hidden=h, heads=4, vocab=vocab, seq_len=16, dtype="fp32"))
    pre, block, _, post = (LayerRow.from_numbers(numbers) for numbers in table.rows(2, 16))
    column, row = 3 * h * h + f * h, h * h + h * f
    assert fused_weight_elements(block, 2, tokens, column=True, row_parallel=False) == column / 2
    assert fused_weight_elements(block, 2, tokens, column=True, row_parallel=True) == (column + row) / 2
    assert fused_weight_elements(block, 1, tokens, column=True, row_parallel=True) == 0
    assert fused_weight_elements(post, 4, tokens, column=True, row_parallel=True) == vocab * h / 4
    assert fused_weight_elements(pre, 2, tokens, column=True, row_parallel=True) == 0
