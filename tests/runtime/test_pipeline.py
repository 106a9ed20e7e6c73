"""The pipeline executor without processes: one stage, argument checks, tensor metadata."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from runtime.pipeline import MAX_TENSORS, PipelineError, PipelineStage, TensorMeta, run_pipeline
from runtime.schedule import one_f_one_b
from tests.runtime.pipeline_harness import RECV_META, StageModule, make_data, make_layers, reference


def test_single_stage_runs_without_processes():
    data = make_data(3)
    ref_loss, ref_grads = reference(2, data)
    module = StageModule(make_layers(2), 0, 4)
    loss = run_pipeline(module, one_f_one_b(1, 3)[0], data, stage_index=0, num_stages=1)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for name, g in module.named_grads().items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6)


def test_single_stage_errors_before_running():
    module = StageModule(make_layers(1), 0, 3)
    data = make_data(2)
    data[1] = (data[1][0], data[1][1].int(), data[1][2])
    with pytest.raises(PipelineError, match=r"input 1 of micro-batch 1 is \(2, 3\) int32 but micro-batch 0's is \(2, 3\) int64"):
        run_pipeline(module, one_f_one_b(1, 2)[0], data, stage_index=0, num_stages=1)
    with pytest.raises(PipelineError, match="no micro-batches"):
        run_pipeline(module, [], [], stage_index=0, num_stages=1)
    with pytest.raises(PipelineError, match="rank 0's list has no B1@s0"):
        run_pipeline(module, one_f_one_b(1, 2)[0][:-1], make_data(2), stage_index=0, num_stages=1)
    assert all(p.grad is None for p in module.parameters())  # nothing ran


def test_tensor_meta_and_stage_arguments():
    assert TensorMeta((2, 3), torch.float32).requires_grad is True
    assert TensorMeta((2, 3), torch.int64).requires_grad is False
    with pytest.raises(ValueError, match="cannot require grad"):
        TensorMeta((2,), torch.int64, True)
    with pytest.raises(ValueError, match="give its recv_meta"):
        PipelineStage(nn.Linear(2, 2), 1, 2, prev_rank=0, last_rank=1)
    with pytest.raises(ValueError, match="needs next_rank"):
        PipelineStage(nn.Linear(2, 2), 0, 2, last_rank=1)
    with pytest.raises(ValueError, match="receives nothing"):
        PipelineStage(nn.Linear(2, 2), 0, 1, recv_meta=RECV_META)
    assert MAX_TENSORS >= 2
