"""runtime.checkpoint: recomputation is exact, dropout included (RNG state restored)."""

import torch

import runtime
from planner.frontend.gpt import Block, GPTConfig


def test_checkpointed_layer_with_dropout_matches_plain_run():
    cfg = GPTConfig(vocab=32, seq_len=8, layers=1, hidden=16, heads=2, dropout=0.3)
    torch.manual_seed(0)
    block = Block(cfg)
    x = torch.randn(2, 8, 16, requires_grad=True)

    def run(checkpointed: bool):
        block.zero_grad()
        x.grad = None
        torch.manual_seed(123)
        y = runtime.checkpoint(block, x) if checkpointed else block(x)
        y.square().sum().backward()
        return y.detach(), x.grad.clone(), [p.grad.clone() for p in block.parameters()]

    plain, ckpt = run(False), run(True)
    torch.testing.assert_close(ckpt[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(ckpt[1], plain[1])
    for a, b in zip(ckpt[2], plain[2]):
        torch.testing.assert_close(a, b)
    # Dropout really was active: a different seed gives a different output.
    torch.manual_seed(124)
    assert not torch.equal(block(x).detach(), plain[0])


def test_checkpoint_is_plain_call_without_grad():
    lin = torch.nn.Linear(4, 4)
    with torch.no_grad():
        out = runtime.checkpoint(lin, torch.ones(1, 4))
    assert not out.requires_grad
