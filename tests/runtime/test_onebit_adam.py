"""1-bit Adam's pieces in one process: sign packing, error-compensated compression, its settings,
and the engine's refusals where the exchange it replaces does not exist."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.contract.compressed_exchange import (
    BLOCK,
    default_warmup,
    error_buffer_bytes,
    exchange_bytes,
    exchange_numel,
)
from runtime.contract.input_errors import ConfigError
from runtime.data_parallel.engine_config import CompressionConfig, OptimizerConfig, ShardingConfig
from runtime.data_parallel.flat_shards import ZeroError
from runtime.data_parallel.onebit_adam import compress_, decode, pack_signs, unpack_signs
from runtime.data_parallel.zero_engine import ZeroEngine
from tests.runtime.zero_harness import layer_groups, make_net


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=64).map(lambda v: v * 8))
def test_signs_pack_eight_to_a_byte_and_unpack(values):
    tensor = torch.tensor(values, dtype=torch.float32)
    packed = pack_signs(tensor)
    assert packed.dtype == torch.uint8 and packed.numel() == tensor.numel() // 8
    assert torch.equal(unpack_signs(packed), torch.where(tensor >= 0, 1.0, -1.0))


def test_packing_is_most_significant_bit_first():
    assert pack_signs(torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 0])).item() == 0b1000_0001


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.sampled_from([8, 64, 256]), st.integers(0, 2**31 - 1))
def test_compression_keeps_what_it_lost_in_the_error(blocks, block, seed):
    generator = torch.Generator().manual_seed(seed)
    vector = torch.randn(blocks * block, generator=generator) * torch.logspace(-3, 1, blocks).repeat_interleave(block)
    error = torch.randn(blocks * block, generator=generator) * 0.1
    buffer = vector + error
    packed, scales = compress_(vector, error, block)
    expected = torch.linalg.vector_norm(buffer.view(blocks, block), dim=1) / math.sqrt(block)
    torch.testing.assert_close(scales, expected)  # one scale per block, each its block's RMS
    decoded = decode(packed, scales)
    torch.testing.assert_close(decoded + error, buffer)  # nothing is lost: it is carried
    assert torch.equal(decoded.abs(), scales.repeat_interleave(block))


def test_exchange_bytes_are_a_fourteenth_of_a_bf16_all_reduce():
    numel, ranks = 10_000_000, 8
    padded = exchange_numel(numel, ranks)
    assert padded % (BLOCK * ranks) == 0 and padded - numel < BLOCK * ranks
    # an all-to-all and an all-gather, each of 1 bit per element and one fp32 scale per block
    assert exchange_bytes(numel, ranks) == 2 * (ranks - 1) / ranks * (padded / 8 + 4 * padded / BLOCK)
    all_reduce_bf16 = 2 * (ranks - 1) / ranks * 2 * numel
    assert all_reduce_bf16 / exchange_bytes(numel, ranks) == pytest.approx(1 / (1 / 16 + 1 / 128), rel=1e-3)
    assert exchange_bytes(numel, 1) == 0 and error_buffer_bytes(numel, 1) == 0
    assert error_buffer_bytes(numel, ranks) == 4 * exchange_numel(numel, ranks) * (1 + 1 / ranks)
    assert default_warmup(1000) == 150 and default_warmup(1) == 1


def test_compression_settings_are_checked():
    with pytest.raises(ConfigError, match="dp_compression must be one of none, onebit-adam"):
        CompressionConfig(method="topk")
    with pytest.raises(ConfigError, match="at least 1 with 1-bit Adam"):
        CompressionConfig(method="onebit-adam", warmup_steps=0)
    with pytest.raises(ConfigError, match="non-negative integer"):
        CompressionConfig(method="onebit-adam", warmup_steps=-2)
    assert not CompressionConfig().enabled


@pytest.mark.parametrize(
    "stage, message",
    [(2, "stage 2 reduce-scatters gradients"), (3, "stage 3 reduce-scatters"), (0, "one data-parallel rank")],
)
def test_engine_refuses_compression_without_an_all_reduce_to_replace(stage, message):
    net = make_net()
    optimizer = OptimizerConfig(compression=CompressionConfig(method="onebit-adam", warmup_steps=2))
    with pytest.raises(ZeroError, match=message):
        ZeroEngine(net, layer_groups(net), sharding=ShardingConfig(zero_stage=stage), optimizer=optimizer)
