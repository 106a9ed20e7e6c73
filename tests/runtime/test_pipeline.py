"""The pipeline executor without processes: one stage, argument checks, tensor metadata, and the
split backward (``B`` input gradients, ``W`` weight gradients) of zero-bubble schedules."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn as nn

from runtime.contract.schedule_ir import RECV_ACT, RECV_GRAD, Action, B, F, one_f_one_b, zero_bubble_h1
from runtime.pipeline.executor import (
    MAX_TENSORS,
    PipelineError,
    PipelineStage,
    StagePlacement,
    TensorMeta,
    backward_input,
    backward_weight,
    run_pipeline,
)
from runtime.pipeline.transport import PostedRecv, ReceiveAhead
from tests.runtime.pipeline_harness import RECV_META, StageModule, make_data, make_layers, reference


def test_single_stage_runs_without_processes():
    data = make_data(3)
    ref_loss, ref_grads = reference(2, data)
    module = StageModule(make_layers(2), 0, 4)
    loss = run_pipeline(module, one_f_one_b(1, 3)[0], data, StagePlacement(0, 1))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for name, g in module.named_grads().items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6)


def test_single_stage_errors_before_running():
    module = StageModule(make_layers(1), 0, 3)
    data = make_data(2)
    data[1] = (data[1][0], data[1][1].int(), data[1][2])
    with pytest.raises(
        PipelineError, match=r"input 1 of micro-batch 1 is \(2, 3\) int32 but micro-batch 0's is \(2, 3\) int64"
    ):
        run_pipeline(module, one_f_one_b(1, 2)[0], data, StagePlacement(0, 1))
    with pytest.raises(PipelineError, match="no micro-batches"):
        run_pipeline(module, [], [], StagePlacement(0, 1))
    with pytest.raises(PipelineError, match="rank 0's list has no B1@s0"):
        run_pipeline(module, one_f_one_b(1, 2)[0][:-1], make_data(2), StagePlacement(0, 1))
    assert all(p.grad is None for p in module.parameters())  # nothing ran


def test_tensor_meta_and_stage_arguments():
    assert TensorMeta((2, 3), torch.float32).requires_grad is True
    assert TensorMeta((2, 3), torch.int64).requires_grad is False
    with pytest.raises(ValueError, match="cannot require grad"):
        TensorMeta((2,), torch.int64, True)
    with pytest.raises(ValueError, match="give its recv_meta"):
        PipelineStage(nn.Linear(2, 2), StagePlacement(1, 2, prev_rank=0, last_rank=1))
    with pytest.raises(ValueError, match="needs next_rank"):
        PipelineStage(nn.Linear(2, 2), StagePlacement(0, 2, last_rank=1))
    with pytest.raises(ValueError, match="receives nothing"):
        PipelineStage(nn.Linear(2, 2), StagePlacement(0, 1), recv_meta=RECV_META)
    assert MAX_TENSORS >= 2


# ---------------------------------------------------------------------- split backward (B / W)


class _Chain(nn.Module):
    """Linear/GELU blocks; ``shared`` reuses one linear twice along the path (nested entries),
    ``ckpt`` recomputes each block (non-reentrant checkpointing)."""

    def __init__(self, shared: bool = False, ckpt: bool = False):
        super().__init__()
        torch.manual_seed(3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6), nn.GELU()) for _ in range(3))
        self.shared, self.ckpt = shared, ckpt

    def forward(self, x):
        for k, blk in enumerate(self.blocks):
            b = self.blocks[0] if self.shared and k == 2 else blk
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return x


@pytest.mark.parametrize("shared, ckpt", [(False, False), (True, False), (False, True)])
def test_backward_input_then_weight_equals_one_backward(shared, ckpt):
    x0, g = torch.randn(4, 6), torch.randn(4, 6)
    ref = _Chain(shared)
    x = x0.clone().requires_grad_(True)
    ref(x).backward(g)
    net = _Chain(shared, ckpt)
    fired = []
    for prm in net.parameters():
        prm.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    xb = x0.clone().requires_grad_(True)
    dx, work = backward_input([net(xb)], [g], [xb])
    torch.testing.assert_close(dx[0], x.grad)
    assert not fired and all(p.grad is None for p in net.parameters())  # B touched no weight
    backward_weight(work)
    used = [q.grad is not None for q in ref.parameters()]  # shared: block 2 is never called
    assert len(fired) == sum(used) == (8 if shared else 12)  # each used weight's hook, once, at W
    for p, q in zip(net.parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, q.grad)


def test_weight_pass_refuses_released_parameters():
    """ZeRO-3 releases a layer's parameter storage outside its passes; W must say so, not crash."""
    net = _Chain()
    x = torch.randn(4, 6, requires_grad=True)
    _, work = backward_input([net(x)], [torch.ones(4, 6)], [x])
    net.blocks[0][1].weight.untyped_storage().resize_(0)
    with pytest.raises(PipelineError, match="give the PipelineStage the ZeRO engine as its backward_scope"):
        backward_weight(work)


def test_single_stage_zero_bubble_list_matches_reference():
    data = make_data(3)
    ref_loss, ref_grads = reference(2, data)
    module = StageModule(make_layers(2), 0, 4)
    actions = zero_bubble_h1(1, 3)[0]
    assert [a.kind for a in actions] == ["F", "B", "W"] * 3
    loss = run_pipeline(module, actions, data, StagePlacement(0, 1))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for name, g in module.named_grads().items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6)


def test_chunked_stage_arguments():
    with pytest.raises(ValueError, match="pass a sequence of 2 chunk modules"):
        PipelineStage(nn.Linear(2, 2), StagePlacement(0, 2, 2, prev_rank=1, next_rank=1, last_rank=1))
    with pytest.raises(ValueError, match="model chunk 2 receives from model chunk 1: give its recv_meta"):
        PipelineStage(
            [nn.Linear(2, 2)] * 2, StagePlacement(0, 2, 2, prev_rank=1, next_rank=1, last_rank=1), recv_meta=[(), ()]
        )
    with pytest.raises(ValueError, match="stage 0 needs prev_rank"):
        PipelineStage(
            [nn.Linear(2, 2)] * 2, StagePlacement(0, 2, 2, next_rank=1, last_rank=1), recv_meta=[(), RECV_META]
        )
    with pytest.raises(ValueError, match="need at least 2 pipeline ranks"):
        PipelineStage([nn.Linear(2, 2)] * 2, StagePlacement(0, 1, 2))


class _LossHead(nn.Module):
    """A language-model head whose loss keeps log-probabilities for backward; records them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.out = nn.Linear(6, 64)
        self.log_probs: list = []

    def forward(self, h, labels):
        logp = torch.log_softmax(self.out(h), -1)
        self.log_probs.append(weakref.ref(logp.untyped_storage()))
        return nn.functional.nll_loss(logp, labels)


def test_split_backward_frees_the_loss_tail_at_b():
    """Under a split backward the last stage's B drops the loss's graph above the head's product
    (log-probabilities as large as the logits): nothing of the executor may keep it until W (a
    loop variable did, for the last micro-batch that ran F). Checked at every W of ZB-H1's last
    stage, with the pipeline's sends and receives stubbed out."""
    m = 3
    head = _LossHead()
    stage = PipelineStage(
        head, StagePlacement(1, 2, prev_rank=0, last_rank=1), recv_meta=[TensorMeta((4, 6), torch.float32)]
    )
    stage._preflight = lambda actions, extras: None
    stage._post_recv = lambda a: PostedRecv([torch.randn(4, 6)], [], [None])
    stage._isend = lambda tensors, dst, metas: None
    stage._mean_loss = lambda losses, m: 0.0
    actions = zero_bubble_h1(2, m)[1]
    done_b: list[int] = []
    alive_at_w: list[list[int]] = []
    order = iter([a.microbatch for a in actions if a.kind == "B"])

    def at_w(_p):  # the head weight's gradient is accumulated at W
        alive_at_w.append([i for i in done_b if head.log_probs[i]() is not None])

    real_backward = stage._backward

    def backward(key, *args):
        real_backward(key, *args)
        done_b.append(next(order))

    stage._backward = backward
    head.out.weight.register_post_accumulate_grad_hook(at_w)
    stage.run(actions, [(torch.randint(0, 64, (4,)),) for _ in range(m)])
    assert len(alive_at_w) == m and all(not alive for alive in alive_at_w), alive_at_w


@pytest.mark.parametrize("ahead", [True, False])
def test_receives_posted_ahead_only_with_overlap(ahead):
    """Overlap on: each receive is posted before the compute action preceding it, so the message
    arrives while this rank computes; off (``--overlap off``): nothing is posted ahead, the
    ``RECV`` posts its receive itself and waits for the whole transfer. Either way each receive
    is posted once, in list order (the pairing of messages depends on it)."""
    actions = [
        Action(1, RECV_ACT, 0),
        Action(1, F, 0),
        Action(1, RECV_ACT, 1),
        Action(1, F, 1),
        Action(1, RECV_GRAD, 0),
        Action(1, B, 0),
    ]
    posted: list[tuple[int, int]] = []  # (action index at the time, receive's index)
    now = [0]

    def post(action):
        posted.append((now[0], actions.index(action)))
        return [], []

    receives = ReceiveAhead(actions, post, ahead=ahead)
    for index, action in enumerate(actions):
        now[0] = index
        receives.before(index)
        if action.kind in (RECV_ACT, RECV_GRAD):
            receives.take(index)
    if ahead:
        assert posted == [(0, 0), (1, 2), (3, 4)]  # the first at its own action: nothing ran before it
    else:
        assert posted == [(0, 0), (2, 2), (4, 4)]
