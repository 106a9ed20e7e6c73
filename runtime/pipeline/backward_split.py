"""The split backward of zero-bubble schedules: ``B`` input gradients, ``W`` weight gradients.

Schedules with ``W`` actions (:func:`runtime.contract.schedule_ir.zero_bubble_h1`): ``B``
computes only the gradients of the chunk's received inputs, ``W`` the weight gradients, without
running any part of backward twice (the approach of torch.distributed.pipelining's
``stage_backward_input`` / ``stage_backward_weight``): the autograd graph splits into the nodes on
a path from the outputs to an input (``B`` runs them) and the rest, which lead only to weights.
A node of the first set with an edge into the second (e.g. a linear layer's ``AddmmBackward``,
whose ``mat1`` gradient is ``B``'s work and ``mat2`` gradient ``W``'s) is a *frontier* node: ``B``
records the gradient flowing into it (a node pre-hook) and keeps the graph (``retain_graph``);
``W`` restarts autograd at the frontier edges with those gradients, restricted to the weights
(``inputs=``), so each frontier node computes only its weight-side outputs. Restarting at two
frontier nodes of which one reaches the other through ``B``'s nodes would count the lower one
twice, so ``W`` makes one call per group of weights that share frontier nodes (a linear layer's
weight and bias, a LayerNorm's); a weight used twice along one path (its group's frontier nodes
nested) gets its gradient computed in ``B`` and only accumulated at ``W``. ``W``'s calls are
ordinary ``torch.autograd.backward`` s: gradients *accumulate* into ``.grad`` and
post-accumulate hooks (the ZeRO engine's) fire at ``W``. With a ``backward_scope`` (the ZeRO
engine, :class:`BackwardScope`) each ``B`` and each ``W`` runs inside one of its backward passes,
so that one ``W``'s per-group calls are one pass that reduces each gradient once (as 1F1B's
backward does), and before each ``W`` call the scope's ``prepare_weights`` gathers ZeRO-3's
released weights. A chunk without inputs that need gradients (the first) has nothing for ``B``:
its whole backward runs at ``W``. Memory: ``B`` keeps the chunk's graph, so a micro-batch holds
its activations until its ``W``, all but what only the chunk's outputs reach (a loss's
log-probabilities): ``B`` drops the outputs, and no local of the executor may outlive its action.
Non-reentrant activation checkpointing works: each backward call is its own graph task, so a
checkpointed region is recomputed in ``B`` and again in ``W`` (one more forward of those layers
than a full backward needs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from runtime.pipeline.boundary import PipelineError

__all__ = ["WeightWork", "backward_input", "backward_weight", "BackwardScope"]

#: A group of weights: the nodes where ``W`` restarts for it, and the weights' ``AccumulateGrad`` nodes.
_Group = tuple[set, list]


@dataclass
class WeightWork:
    """What ``B`` leaves for ``W``: one autograd call per group of weights."""

    calls: list[tuple[list[GradientEdge], list[torch.Tensor | None], list[torch.Tensor]]]
    """Per group: root edges (frontier nodes, outputs that reach no input, or a weight's own
    ``AccumulateGrad`` for a gradient ``B`` had to compute), their gradients, the weights."""


class BackwardScope(Protocol):
    """What a pipeline stage tells about its backward work (``runtime.data_parallel.zero_engine.ZeroEngine`` is one)."""

    def backward_pass(self, accumulates: bool = True) -> contextlib.AbstractContextManager:
        """A context in which every autograd call is one backward pass of the caller's;
        ``accumulates=False`` for a ``B`` that leaves the weight gradients to ``W``."""

    def prepare_weights(self, weights: list[torch.Tensor], upcoming: list[torch.Tensor]) -> None:
        """Called before each of ``W``'s autograd calls with the weights it computes and those
        of the next call (``[]`` after the last)."""


def _node(tensor: torch.Tensor) -> Any:
    """A tensor's autograd node: its ``grad_fn``, or a leaf's ``AccumulateGrad``."""
    return tensor.grad_fn if tensor.grad_fn is not None else get_gradient_edge(tensor).node


def _graph(roots: list, targets: set) -> tuple[dict, dict]:
    """Every node reachable from ``roots``: does it reach a node of ``targets`` (the inputs)?
    And each node's parents (reverse edges). Iterative post-order: graphs are thousands deep."""
    reach: dict = {}
    parents: dict = {n: [] for n in roots}
    stack = [(n, False) for n in roots]
    while stack:
        n, expanded = stack.pop()
        children = [f for f, _ in n.next_functions if f is not None]
        if expanded:
            reach[n] = n in targets or any(reach[f] for f in children)
            continue
        if n in reach:
            continue
        reach[n] = False  # visiting (a DAG: every child completes before this node's expansion)
        stack.append((n, True))
        for f in children:
            parents.setdefault(f, []).append(n)
            if f not in reach:
                stack.append((f, False))
    return reach, parents


def _weight_groups(reach: dict, parents: dict, input_nodes: set, weight_roots: set) -> list[_Group]:
    """Weights (leaves other than the inputs) grouped by the nodes where ``W`` must start: a
    weight's *entries* are the first nodes that reach an input (frontier nodes) or outputs that
    reach none, met walking up from it; weights that share an entry share a group."""
    groups: list[_Group] = []
    for leaf in [n for n in reach if not n.next_functions and hasattr(n, "variable") and n not in input_nodes]:
        entries, seen, todo = set(), {leaf}, [leaf]
        while todo:
            n = todo.pop()
            if n in weight_roots:
                entries.add(n)
            for parent in parents.get(n, ()):
                if reach[parent]:
                    entries.add(parent)
                elif parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        merged = [group for group in groups if group[0] & entries]
        for group in merged:
            groups.remove(group)
            entries |= group[0]
        groups.append((entries, [leaf] + [weight for group in merged for weight in group[1]]))
    return groups


def _nested(entries: set, reach: dict) -> bool:
    """Does an entry reach another one through nodes that reach an input? Restarting ``W`` at
    both would then count the lower one's gradient twice."""
    for entry in entries:
        todo, seen = [f for f, _ in entry.next_functions if f is not None and reach.get(f)], set()
        while todo:
            n = todo.pop()
            if n in entries:
                return True
            if n not in seen:
                seen.add(n)
                todo += [f for f, _ in n.next_functions if f is not None and reach.get(f)]
    return False


def _input_gradients(
    input_pairs: list[tuple[torch.Tensor, Any]], wanted: list[torch.Tensor], frontier: set, captured: dict
) -> Sequence[torch.Tensor | None]:
    """One ``autograd.grad`` from the outputs that reach an input to ``wanted`` (the inputs, then
    the eager weights), recording into ``captured`` the gradient flowing into each frontier node."""

    def keep(node: Any) -> Callable:
        def hook(grad_outputs: Any) -> None:
            captured[node] = grad_outputs

        return hook

    handles = [node.register_prehook(keep(node)) for node in frontier]
    try:
        return torch.autograd.grad(
            [output for output, _ in input_pairs],
            wanted,
            [grad for _, grad in input_pairs],
            retain_graph=True,
            allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()


def backward_input(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], WeightWork]:
    """``B``: the gradients of ``inputs`` only; returns them and the work left for ``W``.

    ``outputs`` / ``grads`` are what ``torch.autograd.backward`` would take. The graph is kept
    for :func:`backward_weight`; see the module docstring for the frontier split. A group of
    weights whose entries are nested (a weight used in two places along one path) cannot be
    restarted without double counting: ``B`` computes its gradient and ``W`` accumulates it.
    """
    roots = [_node(output) for output in outputs]
    input_nodes = {_node(x) for x in inputs}
    reach, parents = _graph(roots, input_nodes)
    root_edge = {n: (get_gradient_edge(output), grad) for output, grad, n in zip(outputs, grads, roots) if not reach[n]}
    groups = _weight_groups(reach, parents, input_nodes, set(root_edge))
    eager = [group for group in groups if _nested(group[0], reach)]
    frontier = {entry for group in groups if group not in eager for entry in group[0] if entry not in root_edge}
    captured: dict = {}
    input_pairs = [(output, grad) for output, grad, n in zip(outputs, grads, roots) if reach[n]]
    eager_weights = [n.variable for group in eager for n in group[1]]
    input_grads: list = [None] * len(inputs)
    eager_grads: Sequence = ()
    if input_pairs:
        computed = _input_gradients(input_pairs, list(inputs) + eager_weights, frontier, captured)
        input_grads, eager_grads = list(computed[: len(inputs)]), computed[len(inputs) :]
    calls = []
    for entries, leaves in groups:
        if (entries, leaves) in eager:
            pairs = [(GradientEdge(n, 0), grad) for n, grad in zip(leaves, eager_grads) if grad is not None]
            eager_grads = eager_grads[len(leaves) :]
        else:
            pairs = [root_edge[entry] for entry in entries if entry in root_edge]
            pairs += [
                (GradientEdge(entry, k), grad)
                for entry in entries
                if entry in captured
                for k, grad in enumerate(captured[entry])
                if grad is not None
            ]
        if pairs:
            calls.append(([edge for edge, _ in pairs], [grad for _, grad in pairs], [n.variable for n in leaves]))
    input_grads = [grad if grad is not None else torch.zeros_like(x) for grad, x in zip(input_grads, inputs)]
    return input_grads, WeightWork(calls)


def backward_weight(
    work: WeightWork, prepare: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = None
) -> None:
    """``W``: accumulate the weight gradients ``B`` left (ordinary backward calls, hooks fire).
    ``prepare(weights, upcoming)`` runs before each call with that call's weights and the next
    call's (a ZeRO-3 engine gathers the first and prefetches the second there)."""
    for k, (roots, grads, weights) in enumerate(work.calls):
        if prepare is not None:
            prepare(weights, work.calls[k + 1][2] if k + 1 < len(work.calls) else [])
        if any(weight.numel() and not weight.untyped_storage().nbytes() for weight in weights):
            raise PipelineError(
                "a W action found a weight whose storage is released (ZeRO-3 keeps a layer's "
                "parameters only inside its forward and one backward pass, and B and W are separate "
                "passes): give the PipelineStage the ZeRO engine as its backward_scope, which gathers "
                "them before each W call"
            )
        torch.autograd.backward(roots, grads, inputs=weights)
