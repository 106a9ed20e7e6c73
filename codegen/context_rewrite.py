"""Context parallelism in compiled code: each rank runs every sequence's ``seq_len / cp`` positions.

``planner compile`` exports a context-parallel plan's model at the local length ``n = seq_len / cp``
(``planner.commands.compile``), so every shape the graph bakes (views, reshapes, the tensors
crossing a pipeline boundary) is already a rank's. What depends on *which* positions a rank holds
(its two chunks, ``runtime.context_parallel.layout``) is rewritten into calls of
``runtime.context_parallel`` (``entry``), which are the plain computation when ``cp == 1``:

- every attention core (``aten.scaled_dot_product_attention``, ``planner_runtime.block_sparse_attention``)
  becomes ``attention(q, k, v, causal=, window=, scale=, layout=, enable_gqa=)``. Its mask is what
  ``passes.causal_rewrite`` left (``is_causal``) or, for an explicit mask tensor, the mask the graph
  builds, run at the local length (``passes.mask_kind.probe_mask``) and named causal, full, or the
  sliding window the config states for the core's block (a window wider than the local length
  looks causal there, so the config's window is what is kept). A mask
  that is not positional (a document mask, a custom pattern) or an eager (matmul-softmax) core
  cannot be split by position: ``CodegenError`` naming the node and what to do. The mask
  tensors then have no reader left and are dropped.
- ``aten.arange(n)`` (position ids, rotary angles, learned position indices) becomes
  ``positions(n)``: this rank's global positions.
- the loss: the one ``aten.cross_entropy_loss`` (mean, no class weights or smoothing) whose
  targets come from a model input through shape ops. Its targets become ``targets(labels,
  shift=...)`` (the labels gathered over the cp group, shifted at full length when the model
  shifts them, this rank's positions taken back: the next token of a chunk's last position lives
  on another rank); a slice dropping the logits' last position (``logits[:, :-1]``) is removed, the
  last position's target being ignored instead; and the loss becomes ``sequence_mean(loss,
  targets)``: the one-process mean over the whole sequence's counted tokens, whose backward
  suits gradients averaged over the dp_cp group. Whether the model shifts is not guessed: the
  original loss subgraph is run on random logits and labels at the local shapes and must equal
  the unshifted or the shifted cross-entropy.

``rewrite_context`` returns the manifest's ``context_parallel`` entry.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx

import runtime.sparse_attention  # noqa: F401  (registers torch.ops.planner_runtime)
from codegen.codegen_errors import CodegenError
from passes.attention import annotate_attention
from passes.mask_kind import probe_mask
from runtime.context_parallel import entry
from runtime.context_parallel.blocks import AttentionMask

__all__ = ["rewrite_context"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_SPARSE = torch.ops.planner_runtime.block_sparse_attention.default
_ASSERT = aten._assert_tensor_metadata.default
_CARRIED_META = ("layer", "nn_module_stack", "stack_trace", "source_fn_stack", "op_class", "val")
_TARGET_OPS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten._to_copy.default,
    aten.slice.Tensor,
    aten.pad.default,
    aten.constant_pad_nd.default,
    aten.contiguous.default,
}
"""Ops a loss's targets may pass through between a model input and the loss."""
_LOGIT_OPS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.to.dtype,
    aten._to_copy.default,
    aten.alias.default,
    aten.clone.default,
    aten.contiguous.default,
}
"""Ops between the ``[b, n, V]`` logits and the loss (views and casts)."""
_WHAT_TO_DO = "plan this model without context parallelism (--cp 1)"


def _where(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    module = list(stack.values())[-1][0] if stack else ""
    return f"node {n.name!r}" + (f" in module {module!r}" if module else "")


def _carry(new: fx.Node, old: fx.Node, name: str) -> fx.Node:
    new.meta.update({key: old.meta[key] for key in _CARRIED_META if key in old.meta})
    new.meta["codegen_name"] = name
    return new


def _arg(n: fx.Node, index: int, name: str, default):
    return n.args[index] if len(n.args) > index else n.kwargs.get(name, default)


def _explicit_mask(n: fx.Node, mask: fx.Node, windows: list | None, method: str) -> AttentionMask:
    """The positional mask an explicit mask tensor stands for (causal, or sliding with the window
    the config states for the core's block, ``windows``), checked against what the graph builds at
    the local length; a ``CodegenError`` otherwise."""
    layer = n.meta.get("layer")
    window = windows[layer - 1] if windows and isinstance(layer, int) and 1 <= layer <= len(windows) else None
    n_local = int(cast(fx.Node, n.args[0]).meta["val"].shape[-2])
    kept = probe_mask(mask, {}, n_local)
    where = torch.arange(n_local)
    for wanted in (AttentionMask(causal=True, window=window), AttentionMask(causal=False)):
        if isinstance(kept, torch.Tensor) and torch.equal(kept.bool(), wanted.visible(where, where)):
            return wanted
    why = kept if isinstance(kept, str) else "it is neither causal, a sliding window the config states, nor full"
    raise CodegenError(
        f"context parallelism ({method}) cannot split the attention of {_where(n)}: its mask cannot be read as "
        f"a function of positions ({why}; a document or custom mask is not). Only causal, sliding-window, "
        f"block-sparse and full masks are supported: use one of them, or {_WHAT_TO_DO}"
    )


def _rewrite_cores(gm: fx.GraphModule, windows: list | None, method: str) -> None:
    """Every attention core -> ``entry.attention``."""
    annotate_attention(gm)
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        info = n.meta.get("attention")
        if info is not None and info.pattern == "eager":
            raise CodegenError(
                f"context parallelism ({method}) cannot split the eager (matmul-softmax) attention of "
                f"{_where(n)}; export the model with SDPA attention (attn_implementation='sdpa') or {_WHAT_TO_DO}"
            )
        if n.target is _SDPA:
            q, k, v = n.args[:3]
            if float(_arg(n, 4, "dropout_p", 0.0)):
                raise CodegenError(
                    f"context parallelism ({method}) does not support attention dropout ({_where(n)}); "
                    "set the model's attention dropout to 0"
                )
            mask = _arg(n, 3, "attn_mask", None)
            if isinstance(mask, fx.Node):
                wanted = _explicit_mask(n, mask, windows, method)
            else:
                wanted = AttentionMask(causal=bool(_arg(n, 5, "is_causal", False)))
            kwargs = {
                "causal": wanted.causal,
                "window": wanted.window,
                "scale": n.kwargs.get("scale", n.args[6] if len(n.args) > 6 else None),
                "enable_gqa": bool(_arg(n, 7, "enable_gqa", False)),
            }
        elif n.target is _SPARSE:
            q, k, v, block, local_blocks, global_blocks = n.args[:6]
            scale = n.args[6] if len(n.args) > 6 else n.kwargs.get("scale")
            kwargs = {"causal": True, "scale": scale, "layout": (int(block), int(local_blocks), int(global_blocks))}
        elif info is not None:
            raise CodegenError(
                f"context parallelism ({method}) cannot split the attention kernel {n.target} of {_where(n)}; "
                f"export it as scaled_dot_product_attention or {_WHAT_TO_DO}"
            )
        else:
            continue
        with gm.graph.inserting_before(n):
            new = _carry(gm.graph.call_function(entry.attention, (q, k, v), kwargs), n, "cp_attention")
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)


def _rewrite_positions(gm: fx.GraphModule, n_local: int) -> None:
    """``arange(n)`` over the sequence -> ``entry.positions(n)``."""
    for n in list(gm.graph.nodes):
        ends = None
        if n.target is aten.arange.default:
            ends = (0, n.args[0])
        elif n.target is aten.arange.start and len(n.args) == 2:
            ends = n.args
        if ends is None or tuple(ends) != (0, n_local):
            continue
        val = n.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) else torch.int64
        kwargs = {"device": n.kwargs.get("device"), "dtype": dtype}
        with gm.graph.inserting_before(n):
            new = _carry(gm.graph.call_function(entry.positions, (n_local,), kwargs), n, "cp_positions")
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)


def _targets_source(target: fx.Node, loss: fx.Node) -> fx.Node:
    """The model input the loss's targets are read from (through ``_TARGET_OPS`` only)."""
    n = target
    while n.op != "placeholder":
        if n.op != "call_function" or n.target not in _TARGET_OPS or not isinstance(n.args[0], fx.Node):
            raise CodegenError(
                f"context parallelism cannot split the loss {_where(loss)}: its targets are computed "
                f"({n.name}: {n.target}), not read from a model input; {_WHAT_TO_DO}"
            )
        n = n.args[0]
    return n


def _logits_source(logits: fx.Node, n_local: int) -> tuple[fx.Node, fx.Node | None]:
    """``(the [b, n, V] logits, the slice dropping their last position or None)`` behind the loss's input."""
    n, dropped = logits, None
    while True:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() == 3 and int(val.shape[1]) == n_local:
            return n, dropped
        if n.op != "call_function" or not isinstance(n.args[0], fx.Node):
            break
        if n.target is aten.slice.Tensor and dropped is None and tuple(n.args[1:]) in ((1, 0, -1), (1, None, -1)):
            dropped = n
        elif n.target not in _LOGIT_OPS:
            break
        n = n.args[0]
    raise CodegenError(
        f"context parallelism cannot split the loss {_where(logits)}: its logits are not "
        f"[batch, {n_local}, classes] read through views and casts (and one slice dropping the last position); {_WHAT_TO_DO}"
    )


def _subgraph_value(loss: fx.Node, inputs: list[fx.Node], values: list[torch.Tensor]) -> torch.Tensor:
    """Run the nodes between ``inputs`` and ``loss`` on CPU ``values``."""
    needed: dict[fx.Node, None] = {}
    todo = [loss]
    while todo:
        x = todo.pop()
        if x in needed or x in inputs:
            continue
        if x.op != "call_function":
            raise CodegenError(f"context parallelism cannot split the loss {_where(loss)}: it reads {x.name}")
        needed[x] = None
        todo.extend(x.all_input_nodes)
    order = {x: i for i, x in enumerate(loss.graph.nodes)}
    graph = fx.Graph()
    env = {x: graph.placeholder(f"in{i}") for i, x in enumerate(inputs)}
    for x in sorted(needed, key=order.__getitem__):
        env[x] = graph.node_copy(x, env.__getitem__)
        if "device" in x.kwargs:
            env[x].kwargs = {**env[x].kwargs, "device": torch.device("cpu")}
    graph.output(env[loss])
    return fx.GraphModule(torch.nn.Module(), graph)(*values)


def _shifts(loss: fx.Node, logits: fx.Node, labels: fx.Node, ignore: int) -> bool:
    """Whether the loss scores position ``t`` against label ``t + 1`` (read by running it)."""
    shape = [int(x) for x in logits.meta["val"].shape]
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(shape, generator=generator, dtype=logits.meta["val"].dtype)
    ids = torch.randint(0, shape[-1], shape[:2], generator=generator, dtype=labels.meta["val"].dtype)
    got = _subgraph_value(loss, [logits, labels], [scores, ids])
    for shift in (False, True):
        target = torch.cat([ids[:, 1:], ids.new_full((shape[0], 1), ignore)], 1) if shift else ids
        want = torch.nn.functional.cross_entropy(scores.flatten(0, 1), target.flatten(), ignore_index=ignore)
        if torch.allclose(got.to(want.dtype), want, rtol=1e-5, atol=1e-6):
            return shift
    raise CodegenError(
        f"context parallelism cannot split the loss {_where(loss)}: it is neither the token cross-entropy "
        f"of its logits against its labels nor against the next tokens; {_WHAT_TO_DO}"
    )


def _rewrite_loss(gm: fx.GraphModule, n_local: int) -> dict:
    """The loss -> the whole sequence's mean (module doc); the manifest's ``loss`` entry."""
    losses = [n for n in gm.graph.nodes if n.target is aten.cross_entropy_loss.default]
    if len(losses) != 1:
        raise CodegenError(
            f"context parallelism needs the model's loss to be one token cross-entropy; the graph has "
            f"{len(losses)} cross_entropy calls; {_WHAT_TO_DO}"
        )
    loss = losses[0]
    if _arg(loss, 2, "weight", None) is not None or int(_arg(loss, 3, "reduction", 1)) != 1:
        raise CodegenError(f"context parallelism needs a mean cross-entropy without class weights ({_where(loss)})")
    if float(_arg(loss, 5, "label_smoothing", 0.0)):
        raise CodegenError(f"context parallelism does not support label smoothing ({_where(loss)})")
    ignore = int(_arg(loss, 4, "ignore_index", -100))
    logits, dropped = _logits_source(loss.args[0], n_local)
    labels = _targets_source(loss.args[1], loss)
    shift = _shifts(loss, logits, labels, ignore)
    graph = gm.graph
    with graph.inserting_before(loss):
        targets = graph.call_function(entry.targets, (labels,), {"shift": shift, "ignore_index": ignore})
        _carry(targets, loss, "cp_targets").meta.pop("val", None)
        flat = _carry(graph.call_function(aten.flatten.using_ints, (targets,)), loss, "cp_flat_targets")
        flat.meta.pop("val", None)
    loss.args = (loss.args[0], flat, *loss.args[2:])
    if dropped is not None:  # the last position stays; its target is ignored instead
        dropped.replace_all_uses_with(cast(fx.Node, dropped.args[0]))
        graph.erase_node(dropped)
        for n in graph.nodes:  # views after it keep -1 or a flattened size; fix a baked b * (n - 1)
            if n.target in (aten.view.default, aten.reshape.default) and _feeds(n, loss):
                n.args = (n.args[0], [_unshrunk(size, logits, n_local) for size in n.args[1]])
    with graph.inserting_after(loss):
        mean = _carry(graph.call_function(entry.sequence_mean, (loss, flat), {"ignore_index": ignore}), loss, "loss")
    loss.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)
    return {"input": labels.name, "shift": shift, "ignore_index": ignore, "dropped_last_logit": dropped is not None}


def _feeds(n: fx.Node, loss: fx.Node) -> bool:
    return any(user is loss or (user.target in _LOGIT_OPS and _feeds(user, loss)) for user in n.users)


def _unshrunk(size, logits: fx.Node, n_local: int):
    b = int(logits.meta["val"].shape[0])
    return b * n_local if size == b * (n_local - 1) else size


def _check_plan(plan, degree: int, method: str) -> None:
    """Refuse what context parallelism does not combine with, saying what to change."""
    offload = dict(plan.offload or {})
    refusals = [
        (plan.expert_parallel > 1, f"expert parallelism (ep={plan.expert_parallel})", "plan with --ep 1"),
        (any(v not in (None, "none") for v in offload.values()), f"offload {offload}", "plan without offload"),
        (
            (plan.dp_compression or "none") != "none",
            f"dp compression {plan.dp_compression!r}",
            "plan with --dp-compression none",
        ),
    ]
    for refused, what, fix in refusals:
        if refused:
            raise CodegenError(f"context parallelism (cp={degree}, {method}) with {what} is not supported; {fix}")


def rewrite_context(gm: fx.GraphModule, plan, n_local: int, windows: list | None = None) -> dict | None:
    """Rewrite ``gm`` (exported at the local length ``n_local``) for ``plan.context_parallel``;
    the manifest's ``context_parallel`` entry, None without context parallelism. ``windows``: the
    sliding window the model's config states for each block (None where it has none)."""
    context = plan.context_parallel or {}
    degree, method = int(context.get("degree", 1)), context.get("method", "ring")
    if degree <= 1:
        return None
    _check_plan(plan, degree, method)
    _rewrite_cores(gm, windows, method)
    _rewrite_positions(gm, n_local)
    loss = _rewrite_loss(gm, n_local)
    # the mask tensors and the positions only they read (metadata assertions, which codegen drops, do not keep them)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.target is not _ASSERT and n.is_impure())
    cores = sum(1 for n in gm.graph.nodes if n.target is entry.attention)
    positions = sum(1 for n in gm.graph.nodes if n.target is entry.positions)
    gm.graph.lint()
    gm.recompile()
    return {
        "degree": degree,
        "method": method,
        "seq_len": n_local * degree,
        "local_seq_len": n_local,
        "attention_cores": cores,
        "positions": positions,
        "loss": loss,
    }
