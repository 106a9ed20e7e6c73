"""Op classes: what kind of work each node is (for cost models and reports).

``classify_ops`` writes ``node.meta["op_class"]``, one of

- ``matmul``: mm/addmm/bmm/matmul/linear/convolution,
- ``attention``: fused scaled-dot-product / flash / efficient / flex attention,
- ``norm``: layer/RMS/batch/group norm kernels, and any op inside a module whose class name ends
  in ``Norm`` (HF's ``LlamaRMSNorm`` is written as pow/mean/rsqrt/mul),
- ``embedding``: table lookups,
- ``loss``: cross-entropy, NLL and other losses (and the log-softmax that feeds an NLL),
- ``view``: ops that only re-describe or copy data layout (view, reshape, transpose, expand,
  slice, split, cat, dtype casts, contiguous, getitem, size queries, asserts),
- ``elementwise``: everything else that computes (activations, adds, softmax, dropout, ...),
- ``placeholder`` / ``output`` for graph inputs and the output.
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["classify_ops", "op_name", "OP_CLASSES"]

OP_CLASSES = ("matmul", "attention", "norm", "embedding", "loss", "view", "elementwise", "placeholder", "output")

_MATMUL = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "matmul",
    "linear",
    "convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "_convolution",
    "addbmm",
    "einsum",
    "_scaled_mm",
    "addmv",
    "mv",
    "dot",
    "_grouped_mm",
    "grouped_mm",
    "grouped_mm_fallback",
}
_ATTENTION = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "flex_attention",
    "block_sparse_attention",
}
_NORM = {
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "_fused_rms_norm",
    "batch_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training",
    "group_norm",
    "native_group_norm",
    "instance_norm",
}
_EMBEDDING = {"embedding", "embedding_bag", "_embedding_bag"}
_LOSS = {
    "cross_entropy_loss",
    "nll_loss",
    "nll_loss_forward",
    "nll_loss2d",
    "nll_loss2d_forward",
    "nll_loss_nd",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "kl_div",
    "soft_margin_loss",
    "multi_margin_loss",
    "multilabel_margin_loss",
    "ctc_loss",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "margin_ranking_loss",
    "hinge_embedding_loss",
    "triplet_margin_loss",
}
_VIEW = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "t",
    "permute",
    "expand",
    "expand_as",
    "slice",
    "select",
    "narrow",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "unsqueeze",
    "squeeze",
    "flatten",
    "unflatten",
    "alias",
    "detach",
    "contiguous",
    "clone",
    "to",
    "_to_copy",
    "type_as",
    "cat",
    "stack",
    "getitem",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "_assert_tensor_metadata",
    "_assert_scalar",
    "lift_fresh_copy",
    "view_as",
    "movedim",
    "repeat",
    "repeat_interleave",
    "tile",
    "_unsafe_split",
    "as_strided",
    "diagonal",
    "tensor_split",
    "unfold",
    "index_select",
    "gather",
    "new_ones",
    "new_zeros",
    "new_empty",
    "ones",
    "zeros",
    "empty",
    "full",
    "arange",
    "ones_like",
    "zeros_like",
    "empty_like",
    "full_like",
    "scalar_tensor",
    "index",
    "_assert_async",
    "sym_constrain_range_for_size",
    "copy",
    "fill",
}


def op_name(node: fx.Node) -> str:
    """The bare op name: ``aten.linear.default`` -> ``linear``, ``operator.getitem`` ->
    ``getitem``; a trailing in-place ``_`` is kept (``add_``)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    return getattr(t, "__name__", None) or str(t)


def _module_types(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for _p, typ in stack.values():
        name = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
        out.append(name.rsplit(".", 1)[-1])
    return out


def _feeds_loss(node: fx.Node) -> bool:
    return any(op_name(u) in _LOSS for u in node.users)


def classify_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """Write ``meta['op_class']`` on every node (see module doc)."""
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            n.meta["op_class"] = n.op
            continue
        if n.op != "call_function":
            n.meta["op_class"] = "view" if n.op == "get_attr" else "elementwise"
            continue
        name = op_name(n)
        types = _module_types(n)
        if name in _ATTENTION:
            cls = "attention"
        elif name in _MATMUL:
            cls = "matmul"
        elif name in _NORM:
            cls = "norm"
        elif name in _EMBEDDING:
            cls = "embedding"
        elif name in _LOSS or (name in ("log_softmax", "_log_softmax") and _feeds_loss(n)):
            cls = "loss"
        elif name in _VIEW:
            cls = "view"
        elif types and types[-1].endswith("Norm"):
            cls = "norm"
        else:
            cls = "elementwise"
        n.meta["op_class"] = cls
    return gm
