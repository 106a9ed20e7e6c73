"""HF transformers models from their config classes (no hub access, fresh initialization).

Each architecture is wrapped so that ``forward(input_ids, labels)`` returns the mean token
cross-entropy computed from the model's logits, exactly like the built-in GPT: the data loader
provides labels already aligned with the inputs, so no architecture shifts them again.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from planner.frontend.bundle import ModelBundle
from planner.frontend.errors import ModelError

__all__ = ["build_hf", "HF_ARCHS", "HFLossModel"]

HF_ARCHS = ("gpt2", "llama", "bert")

# Our flag name -> the config attribute of each architecture.
_FIELDS = {
    "gpt2": dict(layers="n_layer", hidden="n_embd", heads="n_head", vocab="vocab_size",
                 seq_len="n_positions", ffn="n_inner"),
    "llama": dict(layers="num_hidden_layers", hidden="hidden_size", heads="num_attention_heads",
                  kv_heads="num_key_value_heads", ffn="intermediate_size", vocab="vocab_size",
                  seq_len="max_position_embeddings"),
    "bert": dict(layers="num_hidden_layers", hidden="hidden_size", heads="num_attention_heads",
                 ffn="intermediate_size", vocab="vocab_size", seq_len="max_position_embeddings"),
}


class HFLossModel(nn.Module):
    """``forward(input_ids, labels)`` -> mean cross-entropy of ``inner(input_ids).logits``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.inner(input_ids=input_ids, use_cache=False).logits \
            if self._takes_cache else self.inner(input_ids=input_ids).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    @property
    def _takes_cache(self) -> bool:
        return getattr(self.inner.config, "use_cache", None) is not None and \
            self.inner.config.model_type != "bert"


def build_hf(arch: str, sizes: dict, *, device="cpu", dtype=torch.float32, dropout: float = 0.0):
    if arch not in HF_ARCHS:
        raise ModelError(f"Unknown HF architecture 'hf:{arch}'. Supported: "
                        + ", ".join("hf:" + a for a in HF_ARCHS) + ".")
    try:
        import transformers
    except ImportError:
        raise ModelError("hf: models need the transformers package. Install the extra with "
                        "`pip install -e '.[hf]'` (make test/demo do it for you).") from None
    fields = _FIELDS[arch]
    unknown = set(sizes) - set(fields)
    if unknown:
        raise ModelError(f"hf:{arch} has no size {sorted(unknown)}; it accepts "
                        + ", ".join("--" + k.replace("_", "-") for k in fields) + ".")
    kwargs = {fields[k]: v for k, v in sizes.items()}
    if arch == "gpt2":
        if "vocab" in sizes:  # the default special-token id 50256 must lie inside the vocabulary
            kwargs["bos_token_id"] = kwargs["eos_token_id"] = min(50256, sizes["vocab"] - 1)
        cfg = transformers.GPT2Config(**kwargs, resid_pdrop=dropout, embd_pdrop=dropout,
                                      attn_pdrop=dropout)
        cls = transformers.GPT2LMHeadModel
    elif arch == "llama":
        if "kv_heads" not in sizes and "heads" in sizes:
            kwargs["num_key_value_heads"] = sizes["heads"]
        cfg = transformers.LlamaConfig(**kwargs, attention_dropout=dropout)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.BertConfig(**kwargs, hidden_dropout_prob=dropout,
                                      attention_probs_dropout_prob=dropout)
        cls = transformers.BertForMaskedLM
    cfg.use_cache = False if arch != "bert" else cfg.use_cache
    # Special-token ids of the default configs can fall outside a small vocabulary.
    for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
        tid = getattr(cfg, tok, None)
        if isinstance(tid, int) and tid >= cfg.vocab_size:
            setattr(cfg, tok, cfg.vocab_size - 1)
    heads = cfg.num_attention_heads
    hidden = cfg.hidden_size
    if hidden % heads:
        raise ModelError(f"hf:{arch}: hidden size {hidden} is not divisible by {heads} heads.")
    kv = getattr(cfg, "num_key_value_heads", heads) or heads
    if heads % kv:
        raise ModelError(f"hf:{arch}: {heads} heads are not divisible by {kv} kv heads.")
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        inner = cls(cfg)
    model = HFLossModel(inner).to(dtype)
    seq = getattr(cfg, "n_positions", None) or cfg.max_position_embeddings
    return ModelBundle(f"hf:{arch}", model, (), cfg.vocab_size, seq, hidden, heads, kv,
                       cfg.num_hidden_layers, "hf", dict(sizes))
