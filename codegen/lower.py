"""Lower an exported graph and a plan into readable per-stage Python modules.

The input is the ATen ``GraphModule`` of ``torch.export`` (``ep.module()``) and, for each
``call_function`` node, its layer-table row. Lowering:

1. assigns every node to a layer and every parameter or buffer to the one layer that uses it
   (a weight used by several layers becomes a stage-level attribute of each stage that reads it:
   a weight tied across pipeline stages has one copy per stage, recorded in ``StageSpec.tied``);
2. cuts each layer out as its own ``fx.Graph`` whose inputs are the values it reads from earlier
   layers and whose outputs are the values later layers read, so the generated layer method is a
   straight-line list of ATen calls (identical transformer blocks produce identical source and
   share one class);
3. groups layers into the plan's pipeline stages: a stage receives what earlier stages produced
   and it (or a later stage) still needs, and sends on what later stages need;
4. emits one ``stage_<k>.py`` per stage that imports only ``torch`` and ``runtime``.

Nothing is executed: lowering works on the meta device, so a 175B model compiles in seconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from codegen.codegen_errors import LoweringError
from codegen.names import safe_ident
from codegen.selective import extract_attention_cores
from runtime import portable

__all__ = [
    "LayerGraph",
    "StageOptions",
    "StageSpec",
    "partition_graph",
    "emit_stage_source",
    "get_tensor",
    "CODEGEN_NAME",
]

CODEGEN_NAME = "codegen_name"
"""``node.meta`` key: the variable name a rewrite wants its node to have in generated code
(``local_rows``, ``routing``...); fx appends a number if the layer already uses it."""

_DROP_TARGETS = {
    torch.ops.aten._assert_tensor_metadata.default,
}


class _Src:
    """A value printed verbatim into generated code (fx prints kwargs with ``repr``)."""

    def __init__(self, src: str):
        self.src = src

    def __repr__(self) -> str:
        return self.src


_DEVICE = _Src("runtime.device()")


@dataclass
class LayerGraph:
    """One layer-table row cut out of the whole graph."""

    index: int
    name: str
    nodes: list = field(default_factory=list)
    """``call_function`` nodes of this layer, in graph order."""
    params: dict = field(default_factory=dict)
    """Local attribute name -> original parameter/buffer FQN owned by this layer."""
    inputs: list = field(default_factory=list)
    """Nodes read from outside (data placeholders, earlier layers, shared weights)."""
    outputs: list = field(default_factory=list)
    """Nodes of this layer read by later layers or by the graph output."""


@dataclass
class StageSpec:
    index: int
    layers: list
    data_inputs: list
    """Names of the graph's inputs this stage reads (``input_ids``, ``labels`` ...)."""
    recv: list
    """Nodes received from the previous stage, in order."""
    send: list
    """Nodes sent to the next stage, in order (the loss for the last stage)."""
    shared: dict = field(default_factory=dict)
    """Stage-level attribute -> FQN for weights used by several layers of this stage, or by
    layers of several stages."""
    tied: dict = field(default_factory=dict)
    """Stage-level attribute -> the stages holding a copy, for weights read in several stages."""


def partition_graph(
    gm: fx.GraphModule,
    layer_of: Callable[[fx.Node], int],
    layer_names: list[str],
    stages: list[list[int]],
) -> tuple[list[LayerGraph], list[StageSpec], fx.Node]:
    """Assign nodes to layers and stages; return layer graphs, stage specs and the loss node."""
    graph = gm.graph
    loss = _loss_node(graph)
    layers = [LayerGraph(i, name) for i, name in enumerate(layer_names)]
    layer = _assign_nodes(graph, layer_of, layers)
    shared_attrs = _assign_weights(graph, layer, layers, stages)
    _connect_layers(graph, layer, layers, loss)
    specs = [_stage_spec(graph, layers, stages, stage, shared_attrs, loss) for stage in range(len(stages))]
    return layers, specs, loss


def _loss_node(graph: fx.Graph) -> fx.Node:
    """The graph's first output, which must be the loss."""
    output = next(n for n in graph.nodes if n.op == "output")
    outs = output.args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    loss = outs[0]
    if not isinstance(loss, fx.Node):
        raise LoweringError("the model's forward must return the loss tensor as its first output")
    return loss


def _assign_nodes(graph: fx.Graph, layer_of: Callable[[fx.Node], int], layers: list[LayerGraph]) -> dict[fx.Node, int]:
    """Put every ``call_function`` node in its layer (checking that the layers form a chain);
    return the layer of each node placed."""
    layer_count = len(layers)
    layer: dict[fx.Node, int] = {}
    for n in graph.nodes:
        if n.op == "call_function":
            if n.target in _DROP_TARGETS and not n.users:
                continue
            _refuse_nested_graph(n)
            layer_index = layer_of(n)
            if not 0 <= layer_index < layer_count:
                raise LoweringError(f"node {n.name} was assigned to layer {layer_index}, outside 0..{layer_count - 1}")
            for arg in n.all_input_nodes:
                if arg in layer and layer[arg] > layer_index:
                    raise LoweringError(
                        f"node {n.name} (layer {layer_index}, {layers[layer_index].name}) reads {arg.name} from the "
                        f"later layer {layer[arg]} ({layers[layer[arg]].name}); layers must form a chain"
                    )
            layer[n] = layer_index
            layers[layer_index].nodes.append(n)
        elif n.op == "call_module":
            if n.users:
                raise LoweringError(f"unexpected submodule call {n.target} in the exported graph")
        elif n.op not in ("placeholder", "get_attr", "output"):
            raise LoweringError(f"unsupported node kind {n.op} ({n.name})")
    return layer


def _refuse_nested_graph(n: fx.Node) -> None:
    """A higher-order op (a region ``torch.export`` kept as a nested graph: ``torch.cond``, an
    autocast region ...) cannot be printed as a straight line of ATen calls: refuse it by name
    (``passes.grad_regions`` inlines the ``no_grad`` regions before lowering)."""
    if isinstance(n.target, torch._ops.HigherOrderOperator):
        stack = n.meta.get("nn_module_stack") or {}
        where = f" in {next(reversed(stack.values()))[0]}" if stack else ""
        raise LoweringError(
            f"node {n.name}{where} calls {n.target.name()}, a region torch.export kept as a nested "
            "graph; compiled stages run only flat ATen ops, so this model cannot be compiled (rewrite "
            "that part of its forward without it)"
        )


def _assign_weights(
    graph: fx.Graph, layer: dict[fx.Node, int], layers: list[LayerGraph], stages: list[list[int]]
) -> dict[fx.Node, set[int]]:
    """A weight read by a single layer becomes that layer's (recorded in ``layer``); return the
    others, each with the stages that read it."""
    stage_of_layer = {}
    for stage, (first, last) in enumerate(stages):
        for i in range(first, last + 1):
            stage_of_layer[i] = stage
    shared_attrs: dict[fx.Node, set[int]] = {}
    for n in graph.nodes:
        if n.op != "get_attr":
            continue
        target = str(n.target)
        users = {layer[user] for user in n.users if user in layer}
        if not users:
            continue
        if len(users) == 1:
            layer_index = users.pop()
            prefix = layers[layer_index].name
            local = target[len(prefix) + 1 :] if prefix and target.startswith(prefix + ".") else target
            layers[layer_index].params[safe_ident(local)] = target
            layer[n] = layer_index
        else:
            # Read by several layers: an attribute of every stage that reads it (a weight tied
            # across stages has one copy per such stage, its gradients summed by the runtime).
            shared_attrs[n] = {stage_of_layer[user] for user in users}
    return shared_attrs


def _connect_layers(graph: fx.Graph, layer: dict[fx.Node, int], layers: list[LayerGraph], loss: fx.Node) -> None:
    """Set each layer's inputs (what it reads from outside) and outputs (what later layers read)."""
    for layer_graph in layers:
        own = set(layer_graph.nodes) | {
            n for n in graph.nodes if n.op == "get_attr" and layer.get(n) == layer_graph.index
        }
        seen = []
        for n in layer_graph.nodes:
            for arg in n.all_input_nodes:
                if arg not in own and arg not in seen:
                    seen.append(arg)
        layer_graph.inputs = seen
        layer_graph.outputs = [
            n
            for n in layer_graph.nodes
            if n is loss or any(user.op != "output" and layer.get(user, -1) > layer_graph.index for user in n.users)
        ]


def _stage_spec(
    graph: fx.Graph,
    layers: list[LayerGraph],
    stages: list[list[int]],
    stage: int,
    shared_attrs: dict[fx.Node, set[int]],
    loss: fx.Node,
) -> StageSpec:
    """What stage ``stage`` reads, receives and sends, and the shared weights it holds."""
    first, last = stages[stage]
    in_stage = {n for i in range(first, last + 1) for n in layers[i].nodes}
    earlier = {n for i in range(0, first) for n in layers[i].nodes}
    needed_later = {x for i in range(last + 1, len(layers)) for x in layers[i].inputs}
    used_here = {x for i in range(first, last + 1) for x in layers[i].inputs}
    data = [n.name for n in graph.nodes if n.op == "placeholder" and n in used_here]
    recv = [n for n in graph.nodes if n in earlier and (n in used_here or n in needed_later)]
    send = [n for n in graph.nodes if (n in earlier or n in in_stage) and n in needed_later]
    if stage == len(stages) - 1:
        if loss not in in_stage:
            raise LoweringError("the loss is not computed in the last stage")
        send = [loss]
    shared = {safe_ident(str(n.target)): str(n.target) for n, readers in shared_attrs.items() if stage in readers}
    tied = {
        safe_ident(str(n.target)): sorted(readers)
        for n, readers in shared_attrs.items()
        if stage in readers and len(readers) > 1
    }
    return StageSpec(stage, list(range(first, last + 1)), data, recv, send, shared, tied)


def _layer_graph_code(layer: LayerGraph, rewrite=None, selective: bool = False):
    """Build the layer's own fx.Graph and return (python source of forward, globals, in names,
    the sources of its attention cores' forwards when ``selective``: ``[(attr, source)]``)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    in_names = []
    counter = 0
    for x in layer.inputs:
        if x.op == "placeholder":
            input_name = safe_ident(x.name)
        elif x.op == "get_attr":
            input_name = safe_ident(x.target)
        else:
            input_name = "x" if counter == 0 else f"x{counter}"
            counter += 1
        env[x] = graph.placeholder(input_name)
        in_names.append(input_name)
    attr_nodes = {fqn: name for name, fqn in layer.params.items()}
    portable_targets: dict[fx.Node, Callable] = {}
    for n in layer.nodes:
        for arg in n.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.get_attr(attr_nodes[arg.target])
        args = fx.node.map_arg(n.args, lambda arg: env[arg])
        kwargs = fx.node.map_arg(n.kwargs, lambda arg: env[arg])
        args, kwargs = _retarget_devices(args), _retarget_devices(kwargs)
        new = graph.create_node("call_function", n.target, args, kwargs, name=n.meta.get(CODEGEN_NAME))
        new.meta = dict(n.meta)
        env[n] = new
        target = _portable(n)
        if target is not n.target:
            portable_targets[new] = target
    outs = [env[output] for output in layer.outputs]
    graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    if rewrite is not None:
        rewrite(graph, layer)
    for node in graph.nodes:  # after the tp rewrite, which matches nodes by their traced targets
        if node in portable_targets and node.target is not portable_targets[node]:
            node.target = portable_targets[node]
    graph.eliminate_dead_code()
    cores = []
    globals_ = {}
    if selective:  # each attention core: a checkpointed submodule (codegen.selective)
        for core in extract_attention_cores(graph, f"layer {layer.index} ({layer.name})"):
            cpc = core.graph.python_code(root_module="self")
            cores.append((core.attr, cpc.src))
            globals_.update(cpc.globals)
    code = graph.python_code(root_module="self")
    globals_.update(code.globals)
    return code.src, globals_, in_names, cores


def _portable(n: fx.Node):
    """``n``'s target, or the ``runtime.portable`` function generated code calls instead (an
    integer ``histc``, transformers' grouped product of experts)."""
    target = n.target
    if target is torch.ops.aten.histc.default:
        val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        return portable.histc if isinstance(val, torch.Tensor) and not val.is_floating_point() else target
    if isinstance(target, torch._ops.OpOverload) and target.name() == "transformers::grouped_mm_fallback":
        return portable.grouped_mm
    return target


def _retarget_devices(x):
    """Devices baked in at trace time (meta) become ``runtime.device()`` in generated code."""
    if isinstance(x, torch.device):
        return _DEVICE
    if isinstance(x, (list, tuple)):
        return type(x)(_retarget_devices(item) for item in x)
    if isinstance(x, dict):
        return {k: _retarget_devices(item) for k, item in x.items()}
    return x


_ALLOWED_MODULES = ("torch", "runtime", "operator", "math", "builtins", "_operator")


def imports_for(globals_: dict) -> list[str]:
    """Import lines for the globals fx's code generator referenced (only trusted modules)."""
    lines = []
    for name, obj in sorted(globals_.items()):
        if name in ("torch", "fx_pytree", "pytree"):
            continue
        if name in ("inf", "nan"):
            lines.append(f"from math import {name}")
        elif name == "device":
            lines.append("from torch import device")
        elif name == "NoneType":
            lines.append("NoneType = type(None)")
        elif callable(obj) and getattr(obj, "__module__", None):
            mod = obj.__module__
            if mod.split(".")[0] not in _ALLOWED_MODULES:
                raise LoweringError(f"the graph calls {mod}.{obj.__name__}, which compiled code may not import")
            lines.append(f"from {mod} import {obj.__name__} as {safe_ident(name)}")
        else:
            raise LoweringError(f"generated code would need the global {name!r} ({type(obj).__name__})")
    return sorted(set(lines))


def _tensor_ctor(tensor: torch.Tensor) -> str:
    shape = tuple(int(size) for size in tensor.shape)
    return f"torch.empty({shape!r}, dtype={tensor.dtype}, device=device)"


@dataclass(frozen=True)
class StageOptions:
    """How one stage file is written, beyond the graph and the stage's layers."""

    num_stages: int
    """Entries of the plan's ``stages`` (model chunks when there are several per pipeline rank);
    the last one returns the loss."""
    header: str
    """Comment lines at the top of the file."""
    checkpoint_layers: frozenset[int] = frozenset()
    """Layer-table rows whose activations are recomputed (wrapped in ``runtime.checkpoint``)."""
    selective_layers: frozenset[int] = frozenset()
    """Rows whose attention cores are recomputed (checkpointed submodules, ``codegen.selective``)."""
    doc: str | None = None
    """The stage class's docstring (which says where the stage runs); None for the default."""

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


def emit_stage_source(
    gm: fx.GraphModule,
    layers: list[LayerGraph],
    spec: StageSpec,
    options: StageOptions,
    rewrite=None,
) -> tuple[str, dict]:
    """Return (source of ``stage_<k>.py``, {module attribute path: original FQN}).

    The file is written in three steps: the weights shared between the stage's layers become
    attributes of the stage (``_StageSource.add_shared``); each layer becomes a submodule whose
    class holds its parameters and straight-line forward, identical layers sharing one class
    (``add_layer``); then the stage class calls them in order, wrapping the recomputed layers in
    ``runtime.checkpoint`` (``render``). ``rewrite`` (``codegen.tp_rewrite``) rewrites each
    layer's graph for tensor parallelism.
    """
    state = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    state |= {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    out = _StageSource(layers, spec, lambda fqn: get_tensor(gm, fqn), rewrite, is_constant=lambda fqn: fqn not in state)
    out.add_shared()
    for layer_index in spec.layers:
        out.add_layer(
            layer_index,
            recompute=layer_index in options.checkpoint_layers,
            selective=layer_index in options.selective_layers,
        )
    return out.render(options.header, options.num_stages, options.doc), out.param_map


def _param_line(attr: str, tensor: torch.Tensor, constant: bool = False) -> str:
    """The constructor line of one parameter, buffer or constant of a generated module."""
    if constant:
        return f"self.register_buffer({attr!r}, {_constant_ctor(attr, tensor)}, persistent=False)"
    if isinstance(tensor, torch.nn.Parameter):
        return f"self.{attr} = torch.nn.Parameter({_tensor_ctor(tensor)})"
    return f"self.register_buffer({attr!r}, {_tensor_ctor(tensor)})"


#: Most elements of a constant written into generated source.
MAX_CONSTANT_ELEMENTS = 1 << 16


def _constant_ctor(attr: str, tensor: torch.Tensor) -> str:
    """Source that rebuilds a constant ``torch.export`` lifted (a tensor made in ``forward``, not
    a parameter or buffer, so no state dict holds it): its values, written out."""
    if tensor.is_meta:
        raise LoweringError(
            f"the constant {attr} was created on the meta device, so its values are unknown; "
            "register it as a buffer of the model instead"
        )
    if tensor.numel() > MAX_CONSTANT_ELEMENTS:
        raise LoweringError(
            f"the constant {attr} has {tensor.numel():,} elements (more than "
            f"{MAX_CONSTANT_ELEMENTS:,} are not written into source); register it as a "
            "buffer of the model instead"
        )
    vals = ", ".join(_scalar_src(value) for value in tensor.detach().cpu().reshape(-1).tolist())
    shape = tuple(int(size) for size in tensor.shape)
    return f"torch.tensor([{vals}], dtype={tensor.dtype}, device=device).reshape({shape!r})"


def _scalar_src(value) -> str:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return f"float({str(value)!r})"
    return repr(value)


class _StageSource:
    """The pieces of one stage file as they are collected, and their final assembly."""

    def __init__(
        self,
        layers: list[LayerGraph],
        spec: StageSpec,
        get: Callable[[str], torch.Tensor],
        rewrite,
        is_constant: Callable[[str], bool],
    ):
        self.layers, self.spec, self.get, self.rewrite = layers, spec, get, rewrite
        self.is_constant = is_constant
        """True for tensors export lifted that are neither parameters nor buffers: their values
        are written into the source, and they are not in ``param_map`` (no state dict has them)."""
        self.classes: dict[str, str] = {}  # class body -> class name
        self.class_src: list[tuple[str, str, list[str]]] = []  # (name, body, layer names)
        self.globals: dict = {}
        self.init_lines: list[str] = []
        self.body_lines: list[str] = []
        self.param_map: dict[str, str] = {}
        self.value_name: dict[fx.Node, str] = {}
        self.shared_by_fqn = {fqn: attr for attr, fqn in spec.shared.items()}

    def vname(self, n: fx.Node) -> str:
        """The variable holding value ``n`` in the stage's forward."""
        if n not in self.value_name:
            self.value_name[n] = safe_ident(n.name, prefix="v_")
        return self.value_name[n]

    def add_shared(self) -> None:
        """Weights read by several layers of the stage: attributes of the stage itself."""
        for attr, fqn in self.spec.shared.items():
            tensor = self.get(fqn)
            if self.is_constant(fqn):
                self.init_lines.append(_param_line(attr, tensor, constant=True))
                continue
            if isinstance(tensor, torch.nn.Parameter) or tensor.requires_grad:
                self.init_lines.append(f"self.{attr} = torch.nn.Parameter({_tensor_ctor(tensor)})")
            else:
                self.init_lines.append(f"self.register_buffer({attr!r}, {_tensor_ctor(tensor)})")
            self.param_map[attr] = fqn

    def add_layer(self, layer_index: int, recompute: bool, selective: bool = False) -> None:
        """Layer-table row ``li``: its class (shared with identical layers), its attribute and
        its call in the stage's forward."""
        layer = self.layers[layer_index]
        cls = self._layer_class(layer_index, layer, selective)
        attr = f"layer_{layer_index}"
        self.init_lines.append(f"self.{attr} = {cls}(device)  # {layer.name!r}"[:200])
        for local, fqn in layer.params.items():
            if not self.is_constant(fqn):
                self.param_map[f"{attr}.{local}"] = fqn
        args = []
        for x in layer.inputs:
            if x.op == "get_attr":
                args.append(f"self.{self.shared_by_fqn[x.target]}")
            elif x.op == "placeholder":
                args.append(safe_ident(x.name))
            else:
                args.append(self.vname(x))
        outs = [self.vname(output) for output in layer.outputs]
        lhs = outs[0] if len(outs) == 1 else ", ".join(outs)
        call = f"runtime.checkpoint(self.{attr}, {', '.join(args)})" if recompute else f"self.{attr}({', '.join(args)})"
        # a layer with no outputs (the empty head of a model whose loss is computed earlier) is
        # still called, so that the stage runs every row of its range
        self.body_lines.append(f"{lhs} = {call}" if outs else call)

    def _layer_class(self, layer_index: int, layer: LayerGraph, selective: bool = False) -> str:
        """The name of the class that runs layer ``li`` (a new one unless an identical exists)."""
        src, glb, _, cores = _layer_graph_code(layer, self.rewrite, selective)
        for k, value in glb.items():
            if k in self.globals and self.globals[k] is not value:
                raise LoweringError(f"conflicting generated global {k!r}")
            self.globals[k] = value
        pinit = [
            "        " + _param_line(local, self.get(fqn), self.is_constant(fqn)) for local, fqn in layer.params.items()
        ]
        pinit += [
            f"        self.{attr} = {self._core_class(core_src)}()  # recomputed in backward"
            for attr, core_src in cores
        ]
        method = "\n".join("    " + line if line.strip() else "" for line in src.strip("\n").splitlines())
        body = (
            "    def __init__(self, device=None):\n        super().__init__()\n"
            + ("\n".join(pinit) + "\n" if pinit else "")
            + "\n"
            + method
            + "\n"
        )
        if body in self.classes:
            name = self.classes[body]
            next(entry for entry in self.class_src if entry[0] == name)[2].append(layer.name)
            return name
        last = len(self.layers) - 1
        base = (
            "SelectiveBlock"
            if cores
            else "Block"
            if not layer.name.startswith("(") and layer_index not in (0, last)
            else ("Pre" if layer_index == 0 else ("Post" if layer_index == last else "Layer"))
        )
        name, i = base, 2
        while name in self.classes.values():
            name, i = f"{base}{i}", i + 1
        self.classes[body] = name
        self.class_src.append((name, body, [layer.name]))
        return name

    def _core_class(self, src: str) -> str:
        """The class of an attention core (selective recompute): its forward, no weights."""
        method = "\n".join("    " + line if line.strip() else "" for line in src.strip("\n").splitlines())
        body = (
            "    SELECTIVE_RECOMPUTE = True  # runtime.timing counts its forward in backward as recompute\n\n"
            + method
            + "\n"
        )
        if body in self.classes:
            return self.classes[body]
        name, i = "AttentionCore", 2
        while name in self.classes.values():
            name, i = f"AttentionCore{i}", i + 1
        self.classes[body] = name
        self.class_src.append((name, body, ["the attention core of a selectively recomputed layer"]))
        return name

    def render(self, header: str, num_stages: int, doc: str | None = None) -> str:
        """The whole file: header, imports, layer classes, the stage class."""
        spec = self.spec
        recv_names = [self.vname(n) for n in spec.recv]
        params = recv_names + [safe_ident(data_input) for data_input in spec.data_inputs]
        sends = [self.vname(n) for n in spec.send]
        ret = (
            sends[0]
            if len(sends) == 1 and spec.index == num_stages - 1
            else "(" + ", ".join(sends) + ("," if len(sends) == 1 else "") + ")"
        )
        out = [header.rstrip(), "", "import torch", "", "import runtime"]
        used_src = "\n".join(body for _, body, _ in self.class_src)
        out += _operator_imports("\n".join([used_src, *self.body_lines]))
        out += imports_for(
            {k: value for k, value in self.globals.items() if re.search(rf"\b{re.escape(k)}\b", used_src)}
        )
        out += ["", ""]
        for name, body, names in self.class_src:
            shown = ", ".join(names[:3]) + (f" ... ({len(names)} layers)" if len(names) > 3 else "")
            out += [
                f"class {name}(torch.nn.Module):",
                f'    """Layer(s): {_doc_safe(shown)}."""',
                "",
                body.rstrip(),
                "",
                "",
            ]
        doc = doc or f"Pipeline stage {spec.index} of {num_stages}"
        out += [
            f"class Stage{spec.index}(torch.nn.Module):",
            f'    """{_doc_safe(doc)}: layer-table rows {spec.layers[0]}..{spec.layers[-1]}."""',
            "",
            f"    DATA_INPUTS = {tuple(safe_ident(data_input) for data_input in spec.data_inputs)!r}",
            f"    RECV = {tuple(recv_names)!r}",
            f"    SEND = {tuple(sends)!r}",
            "",
            "    def __init__(self, device=None):",
            "        super().__init__()",
        ]
        out += ["        " + line for line in self.init_lines]
        out += ["", f"    def forward(self, {', '.join(params)}):"]
        out += ["        " + line for line in self.body_lines]
        out += [f"        return {ret}", ""]
        return "\n".join(out)


#: The runtime modules that register the custom operators compiled code may call, by namespace.
_OPERATOR_MODULES = {"planner_runtime": "runtime.sparse_attention"}


def _operator_imports(source: str) -> list[str]:
    """``import`` lines for the runtime modules whose operators ``source`` calls
    (``torch.ops.planner_runtime.*`` exists only once ``runtime.sparse_attention`` is imported)."""
    return [
        f"import {module}  # registers torch.ops.{namespace}"
        for namespace, module in _OPERATOR_MODULES.items()
        if f"torch.ops.{namespace}." in source
    ]


def _doc_safe(text: str) -> str:
    return text.replace("\\", "/").replace('"""', "'''").replace("\n", " ")


def get_tensor(gm: fx.GraphModule, fqn: str) -> torch.Tensor:
    """The parameter or buffer ``fqn`` of ``gm``."""
    mod_path, _, attr = fqn.rpartition(".")
    mod = gm.get_submodule(mod_path) if mod_path else gm
    return getattr(mod, attr)
