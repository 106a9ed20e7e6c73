"""HF transformers models: built-in config classes (``hf:gpt2|llama|bert``, fresh initialization)
and local model directories (``hf:PATH``: a ``config.json`` that transformers can build, plus
optional safetensors weights; never a download).

Each architecture is wrapped so that ``forward(input_ids, labels)`` returns the mean token
cross-entropy computed from the model's logits, exactly like the built-in GPT: the data loader
provides labels already aligned with the inputs, so no architecture shifts them again.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from planner.frontend.bundle import ModelBundle
from planner.frontend.frontend_errors import ModelError, first_sentence
from planner.frontend.spec import HF_ARCHS, hf_directory

__all__ = [
    "build_hf",
    "build_hf_dir",
    "dir_config",
    "hf_classes",
    "hf_directory",
    "load_hf_config",
    "weight_files",
    "HF_ARCHS",
    "HFLossModel",
]


# Our flag name -> the config attribute of each architecture.
_FIELDS = {
    "gpt2": dict(
        layers="n_layer", hidden="n_embd", heads="n_head", vocab="vocab_size", seq_len="n_positions", ffn="n_inner"
    ),
    "llama": dict(
        layers="num_hidden_layers",
        hidden="hidden_size",
        heads="num_attention_heads",
        kv_heads="num_key_value_heads",
        ffn="intermediate_size",
        vocab="vocab_size",
        seq_len="max_position_embeddings",
    ),
    "bert": dict(
        layers="num_hidden_layers",
        hidden="hidden_size",
        heads="num_attention_heads",
        ffn="intermediate_size",
        vocab="vocab_size",
        seq_len="max_position_embeddings",
    ),
}


class HFLossModel(nn.Module):
    """``forward(input_ids, labels)`` -> mean cross-entropy of ``inner(input_ids).logits``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner: Any = inner  # a transformers PreTrainedModel (its config, its output's logits)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = (
            self.inner(input_ids=input_ids, use_cache=False).logits
            if self._takes_cache
            else self.inner(input_ids=input_ids).logits
        )
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    @property
    def _takes_cache(self) -> bool:
        return getattr(self.inner.config, "use_cache", None) is not None and self.inner.config.model_type != "bert"


#: The transformers classes of each built-in architecture: (config, model).
_CLASSES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "bert": ("BertConfig", "BertForMaskedLM"),
}


def hf_classes(arch: str) -> tuple[type, type]:
    """``(config class, model class)`` of a built-in architecture (importing transformers and the
    architecture's modules)."""
    if arch not in HF_ARCHS:
        raise ModelError(
            f"Unknown HF architecture 'hf:{arch}'. Supported: " + ", ".join("hf:" + name for name in HF_ARCHS) + "."
        )
    try:
        import transformers
    except ImportError:
        raise ModelError(
            "hf: models need the transformers package. Install the extra with "
            "`pip install -e '.[hf]'` (make test/demo do it for you)."
        ) from None
    config_name, model_name = _CLASSES[arch]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def _config_error(exc: BaseException) -> str:
    """``Type: message`` of what transformers refused in a config: the innermost cause of ``exc``
    (huggingface_hub's strict-dataclass validation wraps the real ``ValueError`` in its own type)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return f"{type(exc).__name__}: {first_sentence(str(exc))}"


def _arch_config(arch: str, config_cls: type, sizes: dict, dropout: float):
    """The config of a built-in architecture at ``sizes`` (flag name -> value), or a ``ModelError``
    quoting what transformers' validation refused (whatever exception type it raised)."""
    fields = _FIELDS[arch]
    kwargs = {fields[k]: size for k, size in sizes.items()}
    try:
        if arch == "gpt2":
            if "vocab" in sizes:  # the default special-token id 50256 must lie inside the vocabulary
                kwargs["bos_token_id"] = kwargs["eos_token_id"] = min(50256, sizes["vocab"] - 1)
            return config_cls(**kwargs, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        if arch == "llama":
            if "kv_heads" not in sizes and "heads" in sizes:
                kwargs["num_key_value_heads"] = sizes["heads"]
            return config_cls(**kwargs, attention_dropout=dropout)
        return config_cls(**kwargs, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    except Exception as e:  # noqa: BLE001 - transformers validates with several exception types
        flags = " ".join(f"--{k.replace('_', '-')} {size}" for k, size in sizes.items())
        raise ModelError(
            f"hf:{arch}: transformers refuses the config these sizes make ({flags or 'the defaults'}): "
            f"{_config_error(e)} Change the size flags."
        ) from None


def build_hf(arch: str, sizes: dict, *, device="cpu", dtype=torch.float32, dropout: float = 0.0):
    config_cls, cls = hf_classes(arch)
    fields = _FIELDS[arch]
    unknown = set(sizes) - set(fields)
    if unknown:
        raise ModelError(
            f"hf:{arch} has no size {sorted(unknown)}; it accepts "
            + ", ".join("--" + k.replace("_", "-") for k in fields)
            + "."
        )
    cfg = _arch_config(arch, config_cls, sizes, dropout)
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
    kv_heads = getattr(cfg, "num_key_value_heads", heads) or heads
    if heads % kv_heads:
        raise ModelError(f"hf:{arch}: {heads} heads are not divisible by {kv_heads} kv heads.")
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        inner = cls(cfg)
    model = HFLossModel(inner).to(dtype)
    seq = getattr(cfg, "n_positions", None) or cfg.max_position_embeddings
    return ModelBundle(
        f"hf:{arch}", model, (), cfg.vocab_size, seq, hidden, heads, kv_heads, cfg.num_hidden_layers, "hf", dict(sizes)
    )


# --------------------------------------------------------------------------------------------
# Local model directories (hf:PATH)

#: Our size flag -> the generic config attribute (transformers' ``attribute_map`` covers GPT-2's
#: ``n_layer``/``n_embd``/``n_head``/``n_positions``).
_GENERIC = dict(
    layers="num_hidden_layers",
    hidden="hidden_size",
    heads="num_attention_heads",
    kv_heads="num_key_value_heads",
    ffn="intermediate_size",
    vocab="vocab_size",
    seq_len="max_position_embeddings",
)


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it (empty: the directory has no weights).

    Reads ``model.safetensors`` or the sharded index ``model.safetensors.index.json``; PyTorch
    pickles (``pytorch_model.bin``) are refused with the fix.
    """
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelError(
                f"cannot read {index} ({e}); it must hold the 'weight_map' save_pretrained writes."
            ) from None
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        try:
            with safe_open(single, framework="pt") as f:
                return {k: single for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ModelError(
                f"{single} is not a readable safetensors file ({e}); write it again with "
                "save_pretrained(..., safe_serialization=True)."
            ) from None
    if any(n.endswith(".bin") for n in os.listdir(path)):
        raise ModelError(
            f"{path} holds PyTorch .bin weights; only safetensors are read. Convert them: "
            "AutoModelForCausalLM.from_pretrained(PATH).save_pretrained(PATH, "
            "safe_serialization=True)."
        )
    return {}


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' warnings (e.g. about special-token ids) while loading a config."""
    from transformers.utils import logging as tf_logging

    level = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)


def load_hf_config(path: str):
    """The transformers config of a model directory, or a ``ModelError`` naming the file."""
    try:
        import transformers
    except ImportError:
        raise ModelError(
            "hf: models need the transformers package. Install the extra with `pip install -e '.[hf]'`."
        ) from None
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelError(
            f"{cfg_path} does not exist: an hf:PATH model directory needs the config.json "
            "that save_pretrained writes (and optionally *.safetensors weights)."
        )
    try:
        with open(cfg_path, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(
            f"cannot read {cfg_path} ({e}); it must be a JSON object as save_pretrained writes it."
        ) from None
    try:
        with _quiet_transformers():
            cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers validates with several exception types
        if _known_model_type(model_type):
            raise ModelError(
                f"cannot build a model from {cfg_path}: transformers {transformers.__version__} refuses "
                f"this {model_type!r} config: {_config_error(e)} Fix that value in config.json."
            ) from None
        what = (
            f"its model_type {model_type!r} is unknown to transformers {transformers.__version__}"
            if model_type
            else "it has no model_type"
        )
        raise ModelError(
            f"cannot build a model from {cfg_path}: {what}. Use a config.json written by "
            "save_pretrained of an architecture this transformers version ships, or "
            f"upgrade transformers. ({_config_error(e)})"
        ) from None
    _check_token_model(cfg, path)
    return cfg


def _check_token_model(cfg, path: str | None = None) -> None:
    """A ``ModelError`` unless ``cfg``'s model reads one token sequence: what the planner traces
    and trains (an encoder-decoder, a vision or audio model, a multimodal wrapper does not; for
    the last, read from ``path``, the message gives the command that writes its language model's
    config)."""
    if getattr(cfg, "is_encoder_decoder", False):
        raise ModelError(
            f"{cfg.model_type!r} is an encoder-decoder model (its config sets is_encoder_decoder), "
            "and the planner plans and trains decoder-only and encoder-only models, which take "
            "one token sequence: use a causal LM or an encoder architecture."
        )
    text = getattr(cfg, "text_config", None)
    if not _vocab_size(cfg) and text is not None and _vocab_size(text):
        raise ModelError(
            f"{cfg.model_type!r} is a multimodal model (its token vocabulary is in text_config), and "
            "the planner plans and trains models that read one token sequence: plan its language "
            f"model, a config.json of model_type {getattr(text, 'model_type', '?')!r} holding "
            "text_config's fields"
            + (
                f": python -c \"import transformers as t; t.AutoConfig.from_pretrained('{path}')"
                f".text_config.save_pretrained('{path.rstrip('/')}-text')\" and plan hf:{path.rstrip('/')}-text."
                if path
                else " (e.g. written by save_pretrained of text_config)."
            )
        )
    if not _vocab_size(cfg):
        raise ModelError(
            f"{cfg.model_type!r} reads no token ids (its config has no vocab_size: an image, audio or "
            "other non-text model), and the planner plans and trains models that read one token "
            "sequence: use a causal LM or an encoder architecture."
        )


def _known_model_type(model_type) -> bool:
    """Whether this transformers ships a config class for ``model_type``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _model_class(cfg):
    """The class named by ``cfg.architectures`` (a causal LM if the config names none)."""
    import transformers

    _check_token_model(cfg)  # also a config built in memory (the built-in hf: presets)
    for name in getattr(cfg, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    except (KeyError, AttributeError):
        raise ModelError(
            f"transformers has no causal-LM class for model_type {cfg.model_type!r} and the "
            f"config.json names no known class in 'architectures'; add one ({_class_example(cfg.model_type)})."
        ) from None


def _vocab_size(cfg) -> int:
    """The config's token vocabulary (0 when it has none: ViT, Whisper's encoder, ...)."""
    return config_int(cfg, "vocab_size")


def config_int(cfg, name: str, default: int = 0) -> int:
    """A whole-model size of ``cfg`` (``default`` when it has none, or when it differs per layer:
    transformers' heterogeneous configs raise on reading a per-layer attribute globally, e.g.
    ``num_attention_heads`` of a model whose layers have different head counts; the planner then
    reads the heads from the graph)."""
    try:
        value = getattr(cfg, name, None)
    except (AttributeError, RuntimeError):  # AmbiguousGlobalPerLayerAttributeError is a RuntimeError
        return default
    try:
        return int(value) if value is not None else default
    except (TypeError, ValueError):
        return default


def _class_example(model_type: str) -> str:
    """An ``architectures`` entry that fits ``model_type``: its masked-LM class (an encoder) from
    transformers' auto mappings, else a generic example."""
    from transformers.models.auto import modeling_auto

    for mapping, kind in (
        ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked-LM"),
        ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal-LM"),
    ):
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        if isinstance(name, str):
            return f'"architectures": ["{name}"], transformers\' {kind} class for {model_type!r}'
    return 'e.g. "LlamaForCausalLM" for a decoder, a *ForMaskedLM class for an encoder'


def dir_config(path: str, sizes: dict, *, weights: bool, dropout: float = 0.0):
    """The config of ``hf:PATH`` with the plan's overrides applied.

    ``layers`` may shrink or grow the block count (the shallow trace, or a truncated model);
    ``seq_len`` raises the position table when it is longer (refused when the directory holds
    weights); the other size flags are refused with weights (the tensors fix them) and set the
    generic config attributes otherwise. Every dropout probability is set to ``dropout`` (the
    planner trains without dropout unless asked), and the KV cache is off.
    """
    cfg = load_hf_config(path)
    cfg_file = os.path.join(path, "config.json")
    for key, value in sizes.items():
        attr = _GENERIC.get(key)
        if attr is None:
            raise ModelError(f"hf:{path} has no size {key!r}.")
        try:
            current = getattr(cfg, attr, None)
        except RuntimeError:  # differs per layer (a heterogeneous config): one flag cannot set it
            raise ModelError(
                f"{cfg_file} sets {attr} per layer, so --{key.replace('_', '-')} cannot change it; drop the flag."
            ) from None
        if key == "layers":
            _set_layer_count(cfg, int(value))
        elif key == "seq_len":
            if not isinstance(current, int) or current < 1 or value <= current:
                continue  # no position table (XLNet states -1 and refuses a new value) or long enough
            if weights:
                raise ModelError(
                    f"sequence length {value} exceeds the {current} positions of {cfg_file} "
                    "(max_position_embeddings), and its weights fix that size; lower "
                    "--seq-len to at most " + str(current) + "."
                )
            setattr(cfg, attr, int(value))
        elif current != value:
            flag = "--" + key.replace("_", "-")
            if weights:
                raise ModelError(
                    f"{flag} {value} differs from {cfg_file} ({attr} = {current}), whose "
                    f"weights fix that size; drop {flag}."
                )
            if current is None:
                raise ModelError(f"{cfg_file} has no {attr}, so {flag} cannot change it; drop {flag}.")
            setattr(cfg, attr, int(value))
            if key == "heads" and "kv_heads" not in sizes and hasattr(cfg, "num_key_value_heads"):
                cfg.num_key_value_heads = int(value)
    for attr, value in list(cfg.to_dict().items()):
        if isinstance(value, float) and ("dropout" in attr or attr.endswith("pdrop")):
            setattr(cfg, attr, dropout)
    if getattr(cfg, "use_cache", None) is not None:
        cfg.use_cache = False
    for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
        tid = getattr(cfg, tok, None)
        if isinstance(tid, int) and tid >= cfg.vocab_size:
            setattr(cfg, tok, cfg.vocab_size - 1)
    cfg._attn_implementation = "sdpa"  # build_hf_dir falls back to eager for a class without SDPA
    _check_routing(cfg, cfg_file)
    _check_rotary(cfg, cfg_file, sizes)
    return cfg


def _check_rotary(cfg, cfg_file: str, sizes: dict) -> None:
    """A ``ModelError`` when a rotary embedding of ``rotary_dim`` features (GPT-J, CodeGen) is
    wider than a head: what ``--hidden`` / ``--heads`` smaller than the config's make (the trace
    would fail on a broadcast in the rotation)."""
    rotary, heads, hidden = (config_int(cfg, attr) for attr in ("rotary_dim", "num_attention_heads", "hidden_size"))
    if rotary and heads and hidden and rotary > hidden // heads:
        flags = " ".join(f"--{key.replace('_', '-')} {sizes[key]}" for key in ("hidden", "heads") if key in sizes)
        raise ModelError(
            f"{cfg_file}: rotary_dim {rotary} is wider than a head ({hidden} / {heads} heads = "
            f"{hidden // heads} features)"
            + (f" under {flags}" if flags else "")
            + f"; keep hidden / heads at least {rotary}, or lower rotary_dim."
        )


#: Config attributes naming the experts a token is routed to, and the routed experts of a layer.
_TOP_K_ATTRS = ("num_experts_per_tok", "moe_top_k")
_EXPERT_ATTRS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _check_routing(cfg, cfg_file: str) -> None:
    """A ``ModelError`` when a mixture of experts routes each token to more experts than a layer
    has (an edited config: the trace would fail deep in the router's ``topk``). One expert is no
    mixture: Jamba then builds a plain MLP whatever its top-k."""
    top_k = next(((attr, value) for attr in _TOP_K_ATTRS if (value := config_int(cfg, attr))), None)
    experts = next(((attr, value) for attr in _EXPERT_ATTRS if (value := config_int(cfg, attr))), None)
    if top_k and experts and 1 < experts[1] < top_k[1]:
        raise ModelError(
            f"{cfg_file} routes each token to {top_k[0]} = {top_k[1]} experts, more than the "
            f"{experts[1]} a layer has ({experts[0]}); lower {top_k[0]} or raise {experts[0]}."
        )


def _set_layer_count(cfg, layers: int) -> None:
    """Give ``cfg`` ``layers`` blocks, and each of its per-layer lists (``layer_types``,
    ``mlp_layer_types``, ...: a list with one entry per block) as many entries: the first ones, or
    the list repeated (its pattern kept) when the count grows. A model that zips the list with its
    blocks strictly (Ergo) would refuse a shallow copy otherwise."""
    before = config_int(cfg, "num_hidden_layers")
    if before >= 2 and before != layers:
        for name, value in list(cfg.to_dict().items()):
            if isinstance(value, list) and len(value) == before and name != "architectures":
                setattr(cfg, name, (value * (layers // before + 1))[:layers])
    cfg.num_hidden_layers = layers


def build_hf_dir(
    path: str,
    sizes: dict,
    *,
    device="cpu",
    dtype=torch.float32,
    dropout: float = 0.0,
    weights: bool | None = None,
    context=None,
) -> ModelBundle:
    """``hf:PATH``: the directory's architecture built from its config (fresh initialization; the
    runtime loads the directory's weights, see ``planner.frontend.checkpoint``). ``context`` is an
    optional context manager to build under (e.g. parameters on meta, buffers real)."""
    has_weights = bool(weight_files(path)) if weights is None else weights
    cfg = dir_config(path, sizes, weights=has_weights, dropout=dropout)
    cls = _model_class(cfg)
    if not getattr(cls, "_supports_sdpa", True):  # e.g. Gemma2 (soft-capped scores), Bloom (ALiBi)
        cfg._attn_implementation = "eager"
    try:
        with _quiet_transformers(), context or contextlib.nullcontext(), torch.device(device):
            inner = cls(cfg)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - a config transformers accepts but cannot build from
        raise ModelError(
            f"transformers cannot build {cls.__name__} from {os.path.join(path, 'config.json')} ({_config_error(e)})."
        ) from None
    model = HFLossModel(inner).to(dtype)
    heads = config_int(cfg, "num_attention_heads")
    kv_heads = config_int(cfg, "num_key_value_heads", heads) or heads
    positions = config_int(cfg, "max_position_embeddings")  # -1: no limit (XLNet)
    seq = positions if positions > 0 else int(sizes.get("seq_len") or 2048)
    return ModelBundle(
        f"hf:{path}",
        model,
        (),
        _vocab_size(cfg),
        seq,
        config_int(cfg, "hidden_size"),
        heads,
        kv_heads,
        config_int(cfg, "num_hidden_layers"),
        "hf",
        dict(sizes),
    )


def config_windows(model: nn.Module, layers: int, cfg: Any = None) -> list[int | None] | None:
    """The sliding window of each of the ``layers`` blocks an HF config states (None where a block
    attends to the whole causal prefix), or None for a model that is not HF or has no window:
    ``layer_types`` (``sliding_attention`` / ``full_attention``, Qwen2, Gemma 2/3, GPT-OSS) with
    ``sliding_window``, else ``sliding_window`` on every block unless ``use_sliding_window`` is
    False (Mistral). ``passes.mask_kind`` names the windows the graph's probe is too short to see.
    ``cfg``: the full model's config when ``model`` is a shallow copy (whose lists are its own)."""
    cfg = cfg if cfg is not None else getattr(getattr(model, "inner", model), "config", None)
    window = config_int(cfg, "sliding_window") if cfg is not None else 0
    if window < 1:
        return None
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, (list, tuple)) and types:
        per = [window if t == "sliding_attention" else None for t in types]
        per = (per * (layers // len(per) + 1))[:layers]  # a shallow copy lists its own blocks
    elif getattr(cfg, "use_sliding_window", True) is False:
        return None
    else:
        per = [window] * layers
    return per if any(per) else None
