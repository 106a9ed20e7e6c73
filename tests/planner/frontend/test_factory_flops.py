"""A user's factory model is priced at the plan's micro-batch, not at its example inputs' shape.

The regression: the cost replay ran ``F.pad`` (HF's causal-LM loss pads its labels) through a
meta kernel that reads sizes as integers, which pinned the batch and sequence symbols to the
example's (2, 16); every cost after it, and ``flops_per_step``, stayed at the example's shape.
References are ``FlopCounterMode`` counts of one eager step over the whole global batch: on the
meta device for a model that runs there, on CPU with eager attention for an HF decoder (whose
meta forward calls ``.item()`` while building masks; see CONVENTIONS' facts).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import passes.autograd_costs as autograd_costs
from passes.common import PassError
from planner.cli import main
from planner.frontend.model_analysis import build_layer_table

_STACK = """
import torch, torch.nn as nn, torch.nn.functional as F

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 24)
        self.layers = nn.ModuleList([Block() for _ in range(2)])  # the model's own Block
        self.head = nn.Linear(24, 40)

    def forward(self, ids):
        x, extra = self.emb(ids), block_inputs(ids)
        for block in self.layers:
            x = block(x, *extra)
        return loss(self.head(x), ids)

def make():
    return Net(), (torch.randint(0, 40, (2, 16)),)
"""
"""An embedding, two blocks and a head: each model below adds its ``Block``, what its blocks read
beside the hidden states (``block_inputs``) and its ``loss``."""

PADDED_LOSS = (
    _STACK
    + """
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(24, 48), nn.Linear(48, 24)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

def block_inputs(ids):
    return ()

def loss(logits, ids):
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:]  # HF's shift: pad, then drop the first
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
"""
)

ROTARY_POLAR = (
    _STACK
    + """
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(24, 24)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(12).float() / 12), persistent=False)

    def forward(self, x):
        # DeepSeek-V2's rotary embedding: frequencies turned complex by torch.polar, per position
        freqs = torch.arange(x.shape[1], device=x.device).float()[:, None] * self.inv_freq
        rotation = torch.polar(torch.ones_like(freqs), freqs)
        pairs = torch.view_as_complex(self.proj(x).reshape(*x.shape[:-1], 12, 2))
        return x + torch.view_as_real(pairs * rotation).flatten(-2)

def block_inputs(ids):
    return ()

def loss(logits, ids):
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())
"""
)

GLOBAL_BATCH, SEQ = 8, 16


def _flops_per_step(spec: str, micro_batch: int, tmp_path) -> float:
    """plan.json's ``flops_per_step`` with the attention FLOPs its mask skips added back
    (``model.attention.saved_flops``: a causal core is priced at its density), so that it compares
    with ``FlopCounterMode``, which counts every score of the dense product."""
    out = tmp_path / f"plan-{micro_batch}.json"
    args = ["plan", "--model", spec, "--gpus", "2", "--gpus-per-node", "2", "--hardware", "a100-80gb"]
    args += ["--global-batch", str(GLOBAL_BATCH), "--seq-len", str(SEQ), "--dtype", "fp32", "--dp", "2"]
    assert main([*args, "--micro-batch", str(micro_batch), "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["micro_batch_size"] == micro_batch
    return plan["model"]["flops_per_step"] + (plan["model"].get("attention") or {}).get("saved_flops", 0.0)


def _load(path, name="make"):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"factory_flops_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_padded_loss_model_follows_the_micro_batch(tmp_path, capsys):
    path = tmp_path / "padded.py"
    path.write_text(PADDED_LOSS)
    with torch.device("meta"):
        model, _ = _load(path)()
        ids = torch.randint(0, 40, (GLOBAL_BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(ids).backward()
    reference = counter.get_total_flops()
    for micro_batch in (1, 4):
        assert _flops_per_step(f"{path}:make", micro_batch, tmp_path) == reference
    table = build_layer_table(f"{path}:make")
    assert table.fixed == {}
    at = {(b, s): table.total("fwd_flops", b, s) + table.total("bwd_flops", b, s) for b, s in ((1, 16), (3, 7))}
    assert at[(1, 16)] * 8 == reference and at[(3, 7)] != at[(1, 16)] * 3


@pytest.mark.slow  # about 17 s here: an HF trace; the padded model above checks the same path in CI
def test_hf_factory_follows_the_micro_batch(tmp_path, capsys):
    from tests.fixtures import hf_archs

    model, _ = hf_archs.llama()
    model.inner.config._attn_implementation = "eager"  # CPU FlopCounterMode counts no SDPA
    ids = torch.randint(0, hf_archs.VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(ids).backward()
    reference = counter.get_total_flops()
    for micro_batch in (1, 2):
        assert _flops_per_step("tests/fixtures/hf_archs.py:llama", micro_batch, tmp_path) == reference


def test_a_replay_that_pins_a_size_is_an_error(tmp_path, monkeypatch):
    """Without the symbolic pad kernel the replay would pin b and s: it must say so, not price
    the model at its example's shape."""
    from passes.analyze import analyze
    from planner.frontend.trace import trace_model

    path = tmp_path / "padded_guard.py"
    path.write_text(PADDED_LOSS)
    monkeypatch.setattr(autograd_costs, "_SYMBOLIC_KERNELS", {})
    traced = trace_model(f"{path}:make")
    with pytest.raises(PassError, match=r"fixed the (b|s) size to (2|16)") as err:
        analyze(traced)
    assert "pad" in str(err.value)
    assert "While executing" not in str(err.value) and "tlparse" not in str(err.value)  # torch.fx's notes


def test_rotary_frequencies_by_polar_follow_the_sequence(tmp_path, monkeypatch):
    """``torch.polar`` (DeepSeek-V2's rotary frequencies) has a kernel that reads sizes as
    integers: its symbolic stand-in keeps the costs following b and s, and without it the replay
    refuses the model rather than price it at the example's shape."""
    path = tmp_path / "polar.py"
    path.write_text(ROTARY_POLAR)
    table = build_layer_table(f"{path}:make")
    assert table.fixed == {}
    one, other = (table.total("fwd_flops", b, s) + table.total("bwd_flops", b, s) for b, s in ((1, 16), (3, 7)))
    assert one > 0 and other != one * 3 and other == pytest.approx(one * 3 * 7 / 16, rel=0.05)
    from passes.analyze import analyze
    from planner.frontend.trace import trace_model

    kernels = {op: kernel for op, kernel in autograd_costs._SYMBOLIC_KERNELS.items() if "polar" not in str(op)}
    monkeypatch.setattr(autograd_costs, "_SYMBOLIC_KERNELS", kernels)
    with pytest.raises(PassError, match=r"fixed the (b|s) size to (2|16)") as err:
        analyze(trace_model(f"{path}:make"))
    assert "polar" in str(err.value)


DATA_SIZED = (
    _STACK
    + """
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(24, 24)

    def forward(self, x, keep):
        rows = x.flatten(0, 1)[keep]  # as many rows as the data keeps: a size known only at run time
        return x + self.up(rows).sum() / x.numel()

def block_inputs(ids):
    return (ids.flatten() > 20,)

def loss(logits, ids):
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())
"""
)


def test_a_size_the_data_decides_is_refused_at_its_op(tmp_path):
    """A tensor whose size depends on the data (JetMoE's experts split by their token counts;
    here boolean indexing) has no cost that follows b and s: the replay refuses it at that op,
    at once, where summing such sizes used to stall the table for minutes."""
    from passes.analyze import analyze
    from planner.frontend.trace import trace_model

    path = tmp_path / "data_sized.py"
    path.write_text(DATA_SIZED)
    with pytest.raises(PassError, match=r"size depends on the data \(shape \(u\d+, 24\)") as err:
        analyze(trace_model(f"{path}:make"))
    assert "data_sized.py" in str(err.value)
