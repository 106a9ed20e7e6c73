"""Compiled stages: every generated layer class's ``forward`` under ``torch.compile``, once per class.

A plan with ``compile: true`` (plan.json; ``planner plan --compile on|off`` or the planner's
choice) makes the trainer call :func:`compile_stage` on its stage module after loading the
weights and before the ZeRO engine takes it over, then :func:`warm_up`:

- **One compilation per class.** The stage's layers are its ``layer_<i>`` children (``Pre``,
  ``Block`` x L, ``Post``). Each distinct class gets one ``torch.compile`` of its ``forward``
  function (static shapes: a plan fixes the micro-batch), and each instance's ``forward`` is
  that one compiled function bound to it. Dynamo caches compiled code per code object and its
  guards check the parameters' metadata (graph inputs), not which instance they belong to, so
  24 identical blocks compile once and reuse it (:func:`compile_counts` reads Dynamo's counters;
  ``tests/runtime/test_compile_stages.py`` checks it).
- **Hooks stay eager.** Only ``forward`` is compiled, not ``Module.__call__``: the module hooks
  around a layer (ZeRO-3's gather before it and release after it, the gradient hooks on its
  outputs, the recompute timer of ``runtime.timing``) run eagerly around the compiled region;
  ``runtime.checkpoint`` sits in the stage's ``forward``, outside the layers, and recomputes a
  compiled layer like an eager one (non-reentrant checkpointing packs the compiled region's
  saved tensors and reruns the compiled forward in backward).
- **Collectives are graph breaks.** The tensor-parallel entry points that communicate
  (``runtime.tensor_parallel.EAGER_ONLY``: their collectives go through ``runtime.distributed.comm``, Python
  with timers and byte counters) are wrapped in ``torch.compiler.disable`` (:func:`prepare`), so a
  tensor-parallel layer compiles into the regions between them and each collective runs as
  before. The wrapping happens when compilation is first asked for (importing Dynamo costs
  seconds, which an uncompiled run does not pay), in ``runtime.tensor_parallel`` itself and in
  the stage file's imported names.
- **Eager under the memory tracker.** Dynamo does not compile under a ``TorchDispatchMode`` such
  as the step's memory tracker (``runtime.training.memtrack``) and, asked to run a frame there once, runs
  that code eagerly for good. So a layer's ``forward`` calls the plain function while such a mode
  is active and the compiled one otherwise: memory-tracked steps run eagerly (their peak is the
  eager one), and a compiled run tracks memory in its first :data:`TRACKED_STEPS` steps only
  (``runtime.training.trainer``), unless the options say otherwise, then trains compiled.
- **Compile in set-up, not in the first step.** :func:`warm_up` runs one forward and backward of
  a micro-batch of zeros (random state saved and restored, gradients not kept), so the compile
  time is paid before training (and outside the memory tracker). On CPU processes (gloo) the
  ranks of data-parallel index 0 compile first while the others wait, and those then load the
  same graphs from the cache instead of compiling them at the same time on the same cores
  (:func:`warm_up_in_turn`).

Inductor keeps compiled kernels in ``TORCHINDUCTOR_CACHE_DIR`` (torch's default: a folder per
user in the temp directory), which every rank of a run and every later run on the machine share:
a repeated run loads its kernels instead of generating and building them.

``PLANNER_COMPILE_BACKEND`` picks another ``torch.compile`` backend (default ``inductor``):
``aot_eager`` captures the same graphs and autograd split without generating code, which is how
the tests check the runtime's part quickly. CUDA graphs (``mode="reduce-overhead"``) are not
used: ZeRO-3 gathers parameters into freshly resized storage every micro-batch and tensor
parallelism breaks layers into several regions, both of which defeat static graph replay.
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from runtime import moe, tensor_parallel
from runtime.contract import environment

__all__ = [
    "TRACKED_STEPS",
    "backend",
    "prepare",
    "compile_stage",
    "warm_up",
    "warm_up_in_turn",
    "compile_counts",
    "CompiledLayers",
]


#: How long the ranks that load compiled graphs from the cache wait for the ranks compiling them.
COMPILE_WAIT_S = 3600.0

#: Steps a compiled run tracks memory in when its options track every step (``memory_steps``
#: None): those run eagerly, the rest compiled; later steps report the tracked steps' peak.
TRACKED_STEPS = 2

_EAGER: dict[Callable, Callable] = {}
"""Each ``EAGER_ONLY`` function of ``runtime.tensor_parallel`` and ``runtime.moe`` -> its ``torch.compiler.disable``
wrapper (filled by :func:`prepare`)."""


def backend() -> str:
    """The ``torch.compile`` backend: ``PLANNER_COMPILE_BACKEND`` or ``inductor``."""
    return environment.read(environment.COMPILE_BACKEND)


def prepare() -> None:
    """Make the tensor-parallel and expert-parallel entry points graph breaks (once per process):
    wrap each of ``runtime.tensor_parallel.EAGER_ONLY`` and ``runtime.moe.EAGER_ONLY`` (dispatch
    and combine: counts read on the host, all-to-alls through ``runtime.distributed.comm``) in
    ``torch.compiler.disable`` where the module holds it, so calls from compiled code (and from the
    module's own traced helpers) run eagerly."""
    for package in (tensor_parallel, moe):
        for name in package.EAGER_ONLY:
            fn = getattr(package, name)
            if fn in _EAGER.values():
                continue
            wrapped = torch.compiler.disable(fn, recursive=True)
            _EAGER[fn] = wrapped
            setattr(package, name, wrapped)


def _rebind_imports(module: torch.nn.Module) -> None:
    """A stage file imported before :func:`prepare` holds the plain functions under its own
    names (``from runtime.tensor_parallel import copy_to_tp as ...``): point them at the wrappers."""
    src = sys.modules.get(type(module).__module__)
    if src is None:
        return
    names = vars(src)
    for name, value in list(names.items()):
        if callable(value) and value in _EAGER:
            names[name] = _EAGER[value]


class CompiledLayers:
    """What :func:`compile_stage` did: the compiled function of each layer class, the layers
    bound to them, and the set-up time (``seconds``, filled by :func:`warm_up`)."""

    def __init__(self, functions: dict[type, Callable], layers: dict[str, type], backend_name: str):
        self.functions = functions
        self.layers = layers
        """``layer_<i>`` -> its class."""
        self.backend = backend_name
        self.seconds = 0.0

    @property
    def classes(self) -> list[str]:
        return [layer_class.__name__ for layer_class in self.functions]

    def describe(self) -> str:
        return (
            f"{len(self.layers)} layers, {len(self.functions)} compiled class"
            f"{'es' if len(self.functions) != 1 else ''} ({', '.join(self.classes)}; {self.backend})"
        )


def compile_stage(module: torch.nn.Module, backend_name: str | None = None) -> CompiledLayers:
    """Bind every layer of ``module`` (its children) to one ``torch.compile`` of its class's
    ``forward`` (static shapes), compiled on first call; see the module docstring."""
    prepare()
    _rebind_imports(module)
    backend_name = backend_name or backend()
    functions: dict[type, Callable] = {}
    layers: dict[str, type] = {}
    for name, layer in module.named_children():
        cls = type(layer)
        if cls not in functions:
            functions[cls] = torch.compile(cls.forward, backend=backend_name, dynamic=False)
        # An instance attribute: nn.Module.__call__ (and its hooks) call self.forward.
        layer.forward = _Forward(layer, cls.forward, functions[cls])
        layers[name] = cls
    return CompiledLayers(functions, layers, backend_name)


def _dispatch_mode_active() -> bool:
    """A ``TorchDispatchMode`` Dynamo would refuse to compile under (the memory tracker's) is on."""
    try:
        from torch.utils._python_dispatch import any_torch_dispatch_mode_on_stack
    except ImportError:  # pragma: no cover - older or newer torch: any mode counts
        return torch._C._len_torch_dispatch_stack() > 0
    return any_torch_dispatch_mode_on_stack()


class _Forward:
    """A layer's ``forward``: the class's compiled function, or its plain one while a dispatch
    mode is active. Dynamo does not compile under a ``TorchDispatchMode`` (the step's memory
    tracker, ``runtime.training.memtrack``), and a frame it was asked to run there is marked to run
    eagerly from then on, compiled code or not; so a tracked step runs the layers eagerly, and
    the untracked steps after it compiled."""

    def __init__(self, layer: torch.nn.Module, eager: Callable, compiled: Callable):
        self.layer, self.eager, self.compiled = layer, eager, compiled

    def __call__(self, *args, **kwargs):
        fn = self.eager if _dispatch_mode_active() else self.compiled
        return fn(self.layer, *args, **kwargs)


def _flat_tensors(x: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(x)[0] if isinstance(leaf, torch.Tensor)]


def warm_up(module: torch.nn.Module, inputs: Sequence[torch.Tensor], info: CompiledLayers | None = None) -> float:
    """One forward and backward of ``module`` on ``inputs`` (what the stage receives, then its data
    inputs) so every compiled layer compiles now: the random state is restored after it and the
    gradients are computed, not accumulated (``torch.autograd.grad``). Returns the seconds taken
    (also stored in ``info.seconds``)."""
    started = time.perf_counter()
    devices = [inp.device for inp in inputs if inp.device.type == "cuda"][:1]
    with torch.random.fork_rng(devices=devices):
        out = module(*inputs)
        outs = [tensor for tensor in _flat_tensors(out) if tensor.requires_grad]
        leaves: list[torch.Tensor] = [param for param in module.parameters() if param.requires_grad]
        leaves += [tensor for tensor in inputs if tensor.requires_grad and tensor.is_leaf]
        if outs and leaves:
            torch.autograd.grad(
                outs, leaves, grad_outputs=[torch.ones_like(tensor) for tensor in outs], allow_unused=True
            )
    del out, outs
    seconds = time.perf_counter() - started
    if info is not None:
        info.seconds = seconds
    return seconds


def warm_up_in_turn(
    module: torch.nn.Module, inputs: Sequence[torch.Tensor], info: CompiledLayers | None, first: bool
) -> float:
    """:func:`warm_up` on every rank; on gloo the ranks with ``first`` (data-parallel index 0: one
    rank per distinct graph, whose tensor-parallel peers are ``first`` too) compile before the
    others, which then load the graphs from the shared cache. The wait is a gloo monitored
    barrier over all ranks with a generous timeout (a cold compile takes minutes on big models);
    with another backend, or without a process group, every rank compiles at once."""
    staggered = dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "gloo"
    if not staggered:
        return warm_up(module, inputs, info)
    wait = datetime.timedelta(seconds=COMPILE_WAIT_S)
    seconds = 0.0
    if first:
        seconds = warm_up(module, inputs, info)
    dist.monitored_barrier(timeout=wait, wait_all_ranks=True)
    if not first:
        seconds = warm_up(module, inputs, info)
    dist.monitored_barrier(timeout=wait, wait_all_ranks=True)
    return seconds


def compile_counts() -> dict[str, int]:
    """Dynamo's counters of this process: ``frames`` compiled (one per distinct layer class,
    plus one per region after a graph break, plus any recompilation), ``graphs`` (distinct
    graphs captured) and ``graph_breaks``."""
    from torch._dynamo.utils import counters

    return {
        "frames": int(counters["frames"].get("ok", 0)),
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }
