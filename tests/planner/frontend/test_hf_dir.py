"""``hf:PATH`` model directories: building from config.json, bad input at the CLI, and the lazy
weights that ``runtime.stages.compiled_stages.load_weights`` reads shard by shard."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from planner.cli import main
from planner.frontend.checkpoint import DirectoryWeights, directory_state
from planner.frontend.frontend_errors import ModelError
from planner.frontend.zoo import ModelSizes, build_model
from runtime.stages.compiled_stages import _read_shard, load_weights
from runtime.tensor_parallel.sharding import TensorShard

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2 (tied LM head) saved with save_pretrained."""
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_embd=16, n_layer=2, n_head=2, n_positions=32, vocab_size=40, bos_token_id=0, eos_token_id=0
    )
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(path))
    return str(path)


def test_directory_builds_from_its_config(gpt2_dir):
    b = build_model(f"hf:{gpt2_dir}", device="meta")
    assert (b.kind, b.layers, b.hidden, b.heads, b.vocab, b.seq_len) == ("hf", 2, 16, 2, 40, 32)
    assert type(b.model.inner).__name__ == "GPT2LMHeadModel"
    assert b.model.inner.config.resid_pdrop == 0.0  # trained without dropout, like the built-ins
    shallow = build_model(f"hf:{gpt2_dir}", ModelSizes(layers=1), device="meta")  # the trace's shallow copy
    assert len(shallow.model.inner.transformer.h) == 1
    assert build_model("hf:gpt2", ModelSizes(layers=1, hidden=8, heads=2), device="meta").hidden == 8  # still built-in
    with pytest.raises(ModelError, match="hf:PATH"):
        build_model("hf: ")


def test_lazy_state_resolves_ties_and_buffers(tmp_path, gpt2_dir):
    state = directory_state(gpt2_dir, {})
    ref = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir)
    assert "inner.lm_head.weight" in state  # tied: stored once, as transformer.wte.weight
    torch.testing.assert_close(state["inner.lm_head.weight"], ref.lm_head.weight.detach())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state["inner." + name], p.detach())
    sharded = str(tmp_path / "sharded")  # several files and model.safetensors.index.json
    ref.save_pretrained(sharded, max_shard_size="8KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    state = directory_state(sharded, {})
    torch.testing.assert_close(state.get_slice("inner.lm_head.weight")[3:5], ref.lm_head.weight[3:5].detach())
    torch.testing.assert_close(
        state["inner.transformer.h.1.mlp.c_fc.weight"], ref.transformer.h[1].mlp.c_fc.weight.detach()
    )
    (tmp_path / "config.json").write_text(open(os.path.join(gpt2_dir, "config.json")).read())
    assert directory_state(str(tmp_path), {}) is None  # no weights: fresh initialization


@pytest.mark.parametrize("tp", [2, 4])
def test_lazy_shards_equal_cut(tmp_path, tp):
    torch.manual_seed(0)
    full = {
        "col": torch.randn(8, 6),
        "row": torch.randn(6, 8),
        "vocab": torch.randn(10, 4),
        "qkv": torch.randn(16, 4),
        "bias": torch.randn(8),
    }
    shards = {
        "col": TensorShard(0, "column", 8),
        "row": TensorShard(1, "row", 8),
        "vocab": TensorShard(0, "vocab", 10, padded=-(-10 // tp) * tp),  # tp 4 pads 2 rows
        "qkv": TensorShard(0, "qkv", 16, parts=(8, 4, 4)),
        "bias": TensorShard(0, "column", 8),
    }
    file = str(tmp_path / "model.safetensors")
    save_file(full, file)
    state = DirectoryWeights({k: file for k in full}, {"inner." + k: ["inner." + k] for k in full}, {})
    for name, shard in shards.items():
        for r in range(tp):
            torch.testing.assert_close(
                _read_shard(state.get_slice("inner." + name), shard, r, tp), shard.cut(full[name], r, tp)
            )


class _Counting(DirectoryWeights):
    """Records every slice read and every whole-tensor read."""

    def __init__(self, *a):
        super().__init__(*a)
        self.reads, self.whole = [], []

    def get_slice(self, name):
        inner, reads = super().get_slice(name), self.reads

        class Slice:
            def get_shape(self):
                return inner.get_shape()

            def __getitem__(self, idx):
                reads.append((name, idx))
                return inner[idx]

        return Slice()

    def __getitem__(self, name):
        self.whole.append(name)
        return super().__getitem__(name)


def test_load_weights_reads_only_this_ranks_slice(tmp_path):
    full = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    file = str(tmp_path / "model.safetensors")
    save_file(full, file)
    state = _Counting({k: file for k in full}, {"inner." + k: ["inner." + k] for k in full}, {})
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.empty(4, 4))
    module.b = torch.nn.Parameter(torch.empty(4))
    stage = {
        "params": {
            "w": {"fqn": "inner.w", "shard": {"dim": 0, "kind": "column", "size": 8}},
            "b": {"fqn": "inner.b", "shard": None},
        }
    }
    load_weights(module, stage, state, tp_index=1, tp=2)
    torch.testing.assert_close(module.w.detach(), full["w"][4:])
    assert state.reads == [("inner.w", (slice(4, 8),))] and state.whole == ["inner.b"]


# ---------------------------------------------------------------------------------------------
# Bad input: one paragraph naming the file, exit 2


def _plan(spec, capsys, *extra):
    rc = main(
        [
            "plan",
            "--model",
            spec,
            "--gpus",
            "1",
            "--hardware",
            "cpu",
            "--global-batch",
            "2",
            "--seq-len",
            "8",
            "--dtype",
            "fp32",
            "--out",
            os.devnull,
            "--json",
            *extra,
        ]
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def _copy(src, dst, **edit):
    os.makedirs(dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.update(edit)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


def test_bad_directories_exit_2(tmp_path, capsys, gpt2_dir):
    rc, err = _plan(f"hf:{tmp_path / 'nowhere'}", capsys)
    assert rc == 2 and "neither a built-in" in err
    rc, err = _plan(f"hf:{tmp_path}", capsys)
    assert rc == 2 and str(tmp_path / "config.json") in err and "does not exist" in err
    bad = _copy(gpt2_dir, tmp_path / "unknown", model_type="nonesuch")
    rc, err = _plan(f"hf:{bad}", capsys)
    assert rc == 2 and "'nonesuch' is unknown" in err and "config.json" in err


def test_bad_weights_exit_2(tmp_path, capsys, gpt2_dir):
    tensors = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).state_dict()
    tensors = {k: v.contiguous() for k, v in tensors.items() if k != "lm_head.weight"}
    missing = _copy(gpt2_dir, tmp_path / "missing")
    save_file(
        {k: v for k, v in tensors.items() if k != "transformer.ln_f.weight"}, os.path.join(missing, "model.safetensors")
    )
    rc, err = _plan(f"hf:{missing}", capsys)
    assert rc == 2 and "model.safetensors has no tensor 'transformer.ln_f.weight'" in err
    shaped = _copy(gpt2_dir, tmp_path / "shaped")
    save_file({**tensors, "transformer.wpe.weight": torch.zeros(16, 16)}, os.path.join(shaped, "model.safetensors"))
    rc, err = _plan(f"hf:{shaped}", capsys)
    assert rc == 2 and "'transformer.wpe.weight' has shape (16, 16)" in err and "needs (32, 16)" in err
    rc, err = _plan(f"hf:{gpt2_dir}", capsys, "--hidden", "32")
    assert rc == 2 and "--hidden 32 differs" in err
    rc, err = _plan(f"hf:{gpt2_dir}", capsys, "--seq-len", "64")
    assert rc == 2 and "exceeds the 32 positions" in err


def test_a_layer_count_resizes_the_per_layer_lists(tmp_path):
    """A shallow copy (``--layers``, or the planner's own 2-block trace) keeps the config's
    per-layer lists as long as its blocks (Ergo zips them strictly): the first entries when it
    shrinks, the pattern repeated when it grows; other lists are left alone."""
    import transformers as tf

    from planner.frontend.hf import dir_config

    types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
    tf.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=64,
        layer_types=types, architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(tmp_path)  # fmt: skip
    shallow = dir_config(str(tmp_path), {"layers": 2}, weights=False)
    assert shallow.num_hidden_layers == 2 and shallow.layer_types == types[:2]
    deeper = dir_config(str(tmp_path), {"layers": 6}, weights=False)
    assert deeper.layer_types == types + types[:2] and deeper.architectures == ["Qwen2ForCausalLM"]


def test_sizes_a_config_sets_per_layer_read_as_unknown():
    """transformers' heterogeneous configs raise on reading a per-layer size globally: the front
    end reads it as unknown (the heads then come from the graph) instead of a traceback."""
    from planner.frontend.hf import config_int

    class PerLayer:
        hidden_size = 64

        @property
        def num_attention_heads(self):
            raise RuntimeError("'num_attention_heads' is a per-layer attribute and may vary across layers")

    assert config_int(PerLayer(), "num_attention_heads") == 0
    assert config_int(PerLayer(), "num_attention_heads", 8) == 8
    assert config_int(PerLayer(), "hidden_size") == 64 and config_int(PerLayer(), "missing") == 0
