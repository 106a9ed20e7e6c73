"""Forward/backward FLOPs and bytes saved for backward, per node, by replaying autograd.

The exported graph is a forward only. Instead of keeping a table of backward formulas per op, we
*run* the graph once under autograd on fake tensors (no memory, symbolic sizes) and watch:

- every ATen op dispatched while node ``n`` runs (``linear`` becomes ``t`` + ``addmm``...) is
  costed with ``torch.utils.flop_counter``'s formulas and charged to ``n``'s forward FLOPs;
- every tensor autograd saves while ``n`` runs (``torch.autograd.graph.saved_tensors_hooks``) is
  charged to ``n``'s saved bytes, the storage counted once per layer (views of one storage, or
  a tensor saved by several consumers, cost it once) and parameters/buffers excluded (they are
  resident anyway);
- then ``backward()`` runs; each backward op is charged to the forward node that created the
  autograd function executing it (``torch._C._current_autograd_node()``, mapped back to the node
  by walking ``grad_fn.next_functions`` right after each node ran).

So the counts are, by construction, what ``FlopCounterMode`` and ``saved_tensors_hooks`` report
for an eager training step of the same model, except for one deliberate choice: attention.
``scaled_dot_product_attention`` is replayed as a fused flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``): it saves q, k, v, the output and the
log-sum-exp (b x h x s floats), like FlashAttention on GPUs and the CPU flash kernel, not the
b x h x s x s probabilities of the math fallback the meta device would pick. Its FLOPs follow the
model-FLOPs convention: forward 4·b·h·s_q·s_k·d (QKᵀ and PV), backward twice that (the score
recomputation inside flash backward is not model work); this equals what ``FlopCounterMode``
counts for the math path on the meta device. (A later step, ``passes.mask_kind.price_masks``,
scales a causal core whose kernel skips the masked half by its density.)

FLOPs count matmul-class work only (mm, addmm, bmm, convolution, attention), the
``FlopCounterMode`` convention. Every other op that computes (adds, activations, softmax, norms,
casts, copies, the loss, their backward ops) is memory-bound: its cost is the bytes it moves,
counted as ``fwd_bytes`` / ``bwd_bytes`` = the sizes of its tensor inputs plus its outputs. Ops
that only re-describe a tensor (views: ``is_view``) or have a FLOP formula move nothing here, so
a layer's time is ``flops / rate + bytes / memory bandwidth``, the per-op roofline summed.

GEMM shapes. The FLOPs of a layer alone price every matrix product at one efficiency; a GPU
reaches its peak only on large ones (``cost_models.compute.gemm_efficiency``). So each product
the replay dispatches is also recorded by shape, as a ``GemmCall`` ``(m, n, k, batch)``: ``batch``
products of an ``m x k`` by a ``k x n`` matrix, ``2 m n k batch`` FLOPs, forward and backward
(autograd's own backward products, so their layouts are the ones eager runs):

- ``mm``, ``addmm`` (the bias add is not FLOPs, as in ``flop_registry``), ``bmm``, ``baddbmm``.
  ``matmul`` and ``linear`` never reach the dispatcher undecomposed (they are composite), so
  they are recorded as the products they become.
- fused attention (q ``[..., H, s_q, D]``, k ``[..., K, s_k, D]``, v ``[..., K, s_k, D_v]``) as
  the batched products a flash kernel runs, ``batch = b H`` (heads broadcast under GQA, as the
  kernel does): forward ``S = Q Kᵀ`` ``(s_q, s_k, D)`` and ``O = P V`` ``(s_q, D_v, s_k)``;
  backward ``dV = Pᵀ dO`` ``(s_k, D_v, s_q)``, ``dP = dO Vᵀ`` ``(s_q, s_k, D_v)``, ``dQ = dS K``
  ``(s_q, D, s_k)``, ``dK = dSᵀ Q`` ``(s_k, D, s_q)``. That is 2 + 4 products whose FLOPs are the
  model FLOPs above; the flash backward's recomputation of ``Q Kᵀ`` (a fifth product) is not
  model work and is not listed. The other fused-attention kernels ``flop_registry`` knows (the
  CUDA flash / efficient / cuDNN ones, met only in a graph traced with them) are listed the same
  way, their backward with the fifth product that their FLOP formula counts.
- every other op with a FLOP formula (convolutions, ``_scaled_mm``, nested or variable-length
  attention) has no shape here: its FLOPs stay priced at the flat rate. So the FLOPs of a node's
  GEMMs are its ``fwd_flops`` / ``bwd_flops`` exactly when it runs nothing else with a formula.

Each ``GemmCall`` also says what its two factors are (``operands``): ``w`` a parameter or buffer
(or a view of one), ``x`` a tensor the node's forward multiplied (in backward: one it saved),
``g`` anything else (a gradient). That is what lets tensor parallelism name the dim it divides
(``passes.tensor_parallel.tp_common.gemm_tp_dim``): a weight's output features are ``n`` of the forward
product but ``k`` of the input gradient's.

Writes per node: ``fwd_flops``, ``bwd_flops``, ``fwd_bytes``, ``bwd_bytes`` (sympy), ``saved`` (list of ``SavedTensor``),
``saved_bytes`` (sympy: the node's share after per-layer de-duplication), ``fwd_gemms`` and
``bwd_gemms`` (lists of ``GemmCall``) and ``requires_grad`` (bool). Needs ``layer``
(assign_layers) on every node.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

import sympy
import torch
import torch._decomp
import torch._refs
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from passes.common import PassError, iter_tensors, need, to_expr
from passes.layers import is_size

__all__ = ["annotate_costs", "bytes_moved", "CostReplay", "GemmCall", "gemm_calls", "SavedTensor", "total_saved_bytes"]

_PASS = "annotate_costs"
_aten = torch.ops.aten


@dataclass(frozen=True)
class SavedTensor:
    """One tensor a node's backward keeps."""

    key: Any
    """Identity of its storage (views share it): hashable, unique within one graph."""
    nbytes: sympy.Expr
    """Bytes of the whole storage."""
    dtype: str
    producer: str
    """Name of the node whose output owns the storage (the saving node for kernel internals
    like the attention log-sum-exp or a norm's mean/rstd)."""
    counted: bool
    """True for the first saver of this storage in its layer (the one charged its bytes)."""


@dataclass(frozen=True)
class GemmCall:
    """One matrix product a node's forward or backward runs: ``batch`` products of an ``m x k``
    by a ``k x n`` matrix (sympy sizes in ``b`` and ``s``)."""

    m: sympy.Expr
    n: sympy.Expr
    k: sympy.Expr
    batch: sympy.Expr
    operands: tuple[str, str] = ("x", "x")
    """What the ``m x k`` and the ``k x n`` factor are: ``w`` a parameter or buffer (or a view of
    one), ``x`` a tensor the node's forward multiplied (in backward: one it saved), ``g``
    anything else (a gradient). Fused attention's products are ``("x", "x")``."""

    @property
    def flops(self) -> sympy.Expr:
        return 2 * self.m * self.n * self.k * self.batch


def _shape(x):
    return tuple(x.shape) if isinstance(x, torch.Tensor) else x


def _attention_fwd(query, key, value, *args, out_val=None, **kwargs):
    return sdpa_flop_count(_shape(query), _shape(key), _shape(value))


def _attention_bwd(grad_out, query, key, value, *args, **kwargs):
    # Model FLOPs: dV = Pᵀ dO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q (no QKᵀ recompute).
    return 2 * sdpa_flop_count(_shape(query), _shape(key), _shape(value))


def _grouped_mm_flops(mat_a, mat_b, *args, out_val=None, **kwargs):
    """``_grouped_mm`` (a mixture of experts' expert products): each row of a 2-d ``mat_a`` times
    its group's ``mat_b[g]`` (``[S, K] x [E, K, N]``), or in backward the contraction split by
    groups (``[K, S] x [S, N] -> [E, K, N]``, the weights' gradients); 3-d ``mat_a`` batched."""
    lhs, rhs = _shape(mat_a), _shape(mat_b)
    if len(lhs) == 2:
        return 2 * lhs[0] * lhs[1] * rhs[-1]
    if len(rhs) == 2:
        return 2 * lhs[1] * lhs[2] * rhs[1]
    return 2 * lhs[0] * lhs[1] * lhs[2] * rhs[2]


FORMULAS = dict(flop_registry)
FORMULAS[_aten._scaled_dot_product_flash_attention_for_cpu] = _attention_fwd
FORMULAS[_aten._scaled_dot_product_flash_attention_for_cpu_backward] = _attention_bwd
FORMULAS[_aten._grouped_mm] = _grouped_mm_flops

#: Products of libraries' own operators, by qualified name (their packets exist only while the
#: library is imported): transformers' grouped product of experts and its backward (both factors).
BLOCK_SPARSE = "planner_runtime::block_sparse_attention"
BLOCK_SPARSE_BACKWARD = "planner_runtime::block_sparse_attention_backward"
NAMED_FORMULAS: dict[str, Callable[..., Any]] = {
    "transformers::grouped_mm_fallback": _grouped_mm_flops,
    "transformers::grouped_mm_fallback_backward": lambda input, weight, *args, out_val=None, **kwargs: (  # noqa: A002
        2 * _grouped_mm_flops(input, weight)
    ),
    # runtime.sparse_attention's operator, counted as the whole square like SDPA: passes.mask_kind
    # prices the core at its layout's density, as it does a causal SDPA
    BLOCK_SPARSE: _attention_fwd,
    BLOCK_SPARSE_BACKWARD: _attention_bwd,
}


def _arg(args, kwargs, i: int, name: str):
    return args[i] if len(args) > i else kwargs.get(name)


def _attention_gemms(query, k, value, backward: bool, recompute: bool = False) -> list[tuple]:
    """The batched products of fused attention (module doc): ``(m, n, k, batch)`` tuples."""
    *lead, s_q, head_dim = query.shape
    s_k, d_v = k.shape[-2], value.shape[-1]
    batch = 1
    for x in lead:  # b x query heads (key/value heads are broadcast, as the kernel does)
        batch = batch * x
    if not backward:
        return [(s_q, s_k, head_dim, batch), (s_q, d_v, s_k, batch)]
    out = [(s_k, d_v, s_q, batch), (s_q, s_k, d_v, batch), (s_q, head_dim, s_k, batch), (s_k, head_dim, s_q, batch)]
    return ([(s_q, s_k, head_dim, batch)] if recompute else []) + out


_ATTENTION_FWD = {
    _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention,
}
_ATTENTION_BWD = {
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: False,
    # flop_registry's formulas of these count the recomputation of Q Kᵀ
    _aten._scaled_dot_product_flash_attention_backward: True,
    _aten._scaled_dot_product_efficient_attention_backward: True,
    _aten._scaled_dot_product_cudnn_attention_backward: True,
}


def gemm_calls(packet, args, kwargs) -> list[tuple]:
    """The matrix products one dispatched op runs (module doc), as ``(m, n, k, batch, lhs, rhs)``
    with ``lhs`` / ``rhs`` the ``m x k`` / ``k x n`` factor tensors (``None`` for attention's
    internal ones); ``[]`` for an op that is not a listed product."""
    if packet in (_aten.mm, _aten.addmm):
        off = 1 if packet is _aten.addmm else 0
        lhs = _arg(args, kwargs, off, "mat1" if off else "self")
        rhs = _arg(args, kwargs, off + 1, "mat2")
        return [(lhs.shape[0], rhs.shape[1], lhs.shape[1], 1, lhs, rhs)]
    if packet in (_aten.bmm, _aten.baddbmm):
        off = 1 if packet is _aten.baddbmm else 0
        lhs = _arg(args, kwargs, off, "batch1" if off else "self")
        rhs = _arg(args, kwargs, off + 1, "batch2" if off else "mat2")
        return [(lhs.shape[1], rhs.shape[2], lhs.shape[2], lhs.shape[0], lhs, rhs)]
    name = getattr(packet, "_qualified_op_name", "")
    if name == "transformers::grouped_mm_fallback_backward":  # both factors' gradients
        x, weight, offs, grad_out = (
            _arg(args, kwargs, i, arg_name) for i, arg_name in enumerate(("input", "weight", "offs", "grad_output"))
        )
        e = weight.shape[0]
        return [
            (grad_out.shape[0] // e, weight.shape[1], weight.shape[2], e, grad_out, weight),
            (x.shape[1], weight.shape[2], x.shape[0] // e, e, x, grad_out),
        ]
    if packet is _aten._grouped_mm or name == "transformers::grouped_mm_fallback":
        # E groups of the average size (the experts share the tokens evenly)
        lhs, rhs = _arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "mat2")
        if lhs is None:
            lhs, rhs = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
        if lhs.dim() == 2 and rhs.dim() == 3:
            e = rhs.shape[0]
            return [(lhs.shape[0] // e, rhs.shape[2], lhs.shape[1], e, lhs, rhs)]
        if lhs.dim() == 2 and rhs.dim() == 2 and _arg(args, kwargs, 2, "offs") is not None:
            e = _arg(args, kwargs, 2, "offs").shape[0]
            return [(lhs.shape[0], rhs.shape[1], lhs.shape[1] // e, e, lhs, rhs)]
        return []
    if packet in _ATTENTION_FWD or name == BLOCK_SPARSE:
        query, k, value = (_arg(args, kwargs, i, arg_name) for i, arg_name in enumerate(("query", "key", "value")))
        return [gemm + (None, None) for gemm in _attention_gemms(query, k, value, backward=False)]
    if packet in _ATTENTION_BWD or name == BLOCK_SPARSE_BACKWARD:
        query, k, value = (_arg(args, kwargs, i, arg_name) for i, arg_name in ((1, "query"), (2, "key"), (3, "value")))
        recompute = _ATTENTION_BWD.get(packet, False)  # the block-sparse backward's recompute is not model work
        return [gemm + (None, None) for gemm in _attention_gemms(query, k, value, True, recompute)]
    return []


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as a fused flash kernel (see module doc); None if the kernel refuses the inputs."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    if value.shape[-1] != query.shape[-1]:
        # the CPU flash kernel's meta function sizes the output by the query's head dim: a model
        # whose values have their own head dim (DeepSeek's multi-head latent attention) would get
        # a wrong shape, so the composite is replayed
        return None
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(rep, dim=-3)
        value = value.repeat_interleave(rep, dim=-3)
    try:
        return _aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )[0]
    except Exception:  # unsupported mask dtype/layout: replay the composite instead
        return None


_SYMBOLIC_KERNELS: dict[Any, Callable] = {
    # The C++ meta kernel of constant_pad_nd reads ``sizes()`` as integers, which pins the batch
    # and sequence symbols to the traced sizes (``F.pad`` of the labels in HF's causal-LM loss):
    # every cost after it would stop following b and s. Its reference implementation keeps the
    # sizes symbolic; it runs inside the counter's dispatch, so its own ops are not charged and
    # the pad is priced as the one memory-bound op it is.
    _aten.constant_pad_nd.default: torch._refs.constant_pad_nd,
    # polar (DeepSeek-V2's rotary frequencies, ``torch.polar(ones, freqs)``): its kernel, and
    # torch.complex's in its decomposition, read sizes as integers too
    _aten.polar.default: lambda magnitude, angle: torch.view_as_complex(
        torch.stack([magnitude * torch.cos(angle), magnitude * torch.sin(angle)], -1)
    ),
}


def _check_data_independent(node: fx.Node, result: Any) -> None:
    """Refuse a tensor whose size the data decides (an unbacked size: the tokens each expert
    receives, split by their counts; a ``nonzero``): no cost of it follows ``b`` and ``s``, and
    summing such sizes stalls the layer table's simplification (JetMoE's experts: minutes)."""
    for tensor in iter_tensors(result):
        unknown = free_unbacked_symbols(tuple(tensor.shape))
        if unknown:
            raise PassError(
                _PASS,
                node,
                f"this op makes a tensor whose size depends on the data (shape {tuple(tensor.shape)}, "
                f"{', '.join(sorted(map(str, unknown)))} known only when it runs: e.g. the tokens routed to "
                "each expert, split by their counts), and the planner prices sizes that follow the batch "
                "and sequence only. A mixture of experts plans when its experts run as transformers' "
                "grouped products (use_experts_implementation) or densely over every expert; please "
                "report the model.",
            )


@contextlib.contextmanager
def _quiet_fake_tensor_errors():
    """Keep fake tensors' log of a meta kernel that failed off stderr: the replay handles the
    failure (``CostReplay.call_function``) or reports it as a ``PassError``."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


class _Counter(TorchDispatchMode):
    """Charges each dispatched op's FLOPs to the node running it (forward) or owning the
    executing autograd function (backward)."""

    def __init__(self, replay: "CostReplay"):
        super().__init__()
        self.replay = replay

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        symbolic = _SYMBOLIC_KERNELS.get(func)
        out = symbolic(*args, **kwargs) if symbolic is not None else func(*args, **kwargs)
        formula = FORMULAS.get(func._overloadpacket) or NAMED_FORMULAS.get(func.name())
        if formula is not None:
            self._charge(formula(*args, **kwargs, out_val=out), 0)
            calls = gemm_calls(func._overloadpacket, args, kwargs)
            if calls:
                self.replay.record_gemms(calls)
        else:
            moved = bytes_moved(func, args, kwargs, out)
            if moved is not None:
                self._charge(0, moved)
        return out

    def _charge(self, flops: Any, moved: Any) -> None:
        replay = self.replay
        if replay.current is not None:
            replay.fwd[replay.current].append(flops)
            replay.fwd_bytes[replay.current].append(moved)
        else:
            owner = replay.backward_owner()
            replay.bwd.setdefault(owner, []).append(flops)
            replay.bwd_bytes.setdefault(owner, []).append(moved)


#: Ops that alias their input without the schema saying so: they move nothing.
_ALIASING = {_aten._unsafe_view, _aten._reshape_alias, _aten.lift_fresh, _aten.detach, _aten.alias}


#: Ops that read only the indexed elements of their first argument (the table, the source).
_GATHERS = {_aten.embedding, _aten.gather, _aten.index_select, _aten.index}
#: In-place indexed writes: they touch the updated elements of their first argument only.
_SCATTERS = {_aten.index_put_, _aten.scatter_, _aten.scatter_add_, _aten.index_add_}


def bytes_moved(func, args, kwargs, out) -> Any:
    """Bytes a memory-bound op reads and writes; ``None`` for ops that move nothing (views,
    aliases, queries such as ``prim.device`` that return no tensor)."""
    outs = list(iter_tensors(out))
    if not outs or func.is_view or func._overloadpacket in _ALIASING:
        return None
    written = sum(_nbytes(tensor) for tensor in outs)
    packet = func._overloadpacket
    if packet in _GATHERS:  # reads the looked-up elements and the indices, not the whole source
        return 2 * written + sum(
            _nbytes(tensor)
            for tensor in iter_tensors(list(args[1:]) + list(kwargs.values()))
            if not tensor.is_floating_point()
        )
    if packet in _SCATTERS:  # reads and writes the updated elements (the values' size), reads the indices
        values = iter_tensors(list(args[1:]) + list(kwargs.values()))
        return sum(2 * _nbytes(tensor) if tensor.is_floating_point() else _nbytes(tensor) for tensor in values)
    return sum(_nbytes(tensor) for tensor in iter_tensors(list(args) + list(kwargs.values()))) + written


def _nbytes(tensor: torch.Tensor) -> Any:
    """Bytes an op reads or writes of ``t``: its elements (a broadcast view counts its storage)."""
    if any(type(stride) is int and stride == 0 for stride in tensor.stride()):  # expand: reads its storage once
        return tensor.untyped_storage().nbytes()
    return tensor.numel() * tensor.element_size()


class CostReplay(fx.Interpreter):
    """Runs ``gm`` forward and backward on fake tensors, recording FLOPs and saved tensors.

    ``roles`` says which placeholders are parameters (fresh fake leaves that require grad),
    buffers/constants and user inputs (export's fake values, no grad).
    """

    def __init__(self, gm: fx.GraphModule, roles: dict[str, str], symbols: dict):
        super().__init__(gm, garbage_collect_values=False)
        self.roles = roles
        self.symbols = symbols
        self.current: str | None = None
        self.fwd: dict[str, list] = {}
        self.bwd: dict[str | None, list] = {}
        self.fwd_bytes: dict[str, list] = {}
        self.bwd_bytes: dict[str | None, list] = {}
        self.fn_owner: dict[Any, str] = {}
        self.storage_owner: dict[int, str] = {}
        self.node_key: dict[str, int] = {}  # node -> storage of its (first) output
        self.resident: set[int] = set()  # parameter/buffer/constant storages
        self.saved_raw: dict[str, list[tuple[int, Any, torch.dtype]]] = {}
        self.keep: list[Any] = []  # keeps storages alive so their identities are never reused
        self.fwd_gemms: dict[str | None, list] = {}
        self.bwd_gemms: dict[str | None, list] = {}
        self.gemm_inputs: dict[str | None, set] = {}  # node -> storages its forward products multiplied
        self.shape_env: Any = None  # the fake mode's ShapeEnv during the replay
        self.replacements_seen = 0

    # ---- forward bookkeeping
    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name
        self.fwd[n.name] = []
        self.fwd_bytes[n.name] = []
        try:
            result = super().run_node(n)
        except PassError:
            raise
        except Exception as e:
            raise PassError(
                _PASS,
                n,
                f"replaying the op under autograd failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            ) from e
        finally:
            self.current = None
        self._check_symbolic(n)
        _check_data_independent(n, result)
        self.keep.append(result)
        for tensor in iter_tensors(result):
            key = StorageWeakRef(tensor.untyped_storage()).cdata
            self.storage_owner.setdefault(key, n.name)
            self.node_key.setdefault(n.name, key)
        self._claim(result, n.name)
        return result

    def _check_symbolic(self, n: fx.Node) -> None:
        """Refuse a replay that pinned the batch or sequence symbol to its traced size: every
        cost after ``n`` would be a constant, silently wrong at any other micro-batch."""
        env = self.shape_env
        if env is None or len(env.replacements) == self.replacements_seen:
            return
        self.replacements_seen = len(env.replacements)
        for symbol, ours in self.symbols.items():
            value = env.replacements.get(symbol)
            if value is not None and value.is_number:
                raise PassError(
                    _PASS,
                    n,
                    f"the planner cannot price this op at every {ours} size yet: replaying it fixed the {ours} "
                    f"size to {value} (its kernel reads sizes as integers), so the costs would no longer follow "
                    "it. The model cannot be planned until the op has a symbolic kernel (passes/autograd_costs.py, "
                    "_SYMBOLIC_KERNELS); please report it with the model.",
                )

    def call_function(self, target, args, kwargs):
        if target is _aten.scaled_dot_product_attention.default:
            out = _fused_attention(*args, **kwargs)
            if out is not None:
                return out
        try:
            return super().call_function(target, args, kwargs)
        except RuntimeError:
            # Some meta kernels take only concrete sizes (baddbmm broadcasting Bloom's ALiBi bias
            # over symbolic ones): replay the op's decomposition, whose ops are priced as usual.
            decomp = torch._decomp.decomposition_table.get(target)
            if decomp is None:
                raise
            return decomp(*args, **kwargs)

    def backward_owner(self) -> str | None:
        """The node owning the autograd function running now (None if unknown)."""
        fn = torch._C._current_autograd_node()
        return self.fn_owner.get(fn) if fn is not None else None

    def record_gemms(self, calls: list[tuple]) -> None:
        """Charge matrix products (``gemm_calls``) to the running node, forward or backward,
        with what their factors are (``GemmCall.operands``)."""
        forward = self.current is not None
        owner = self.current if forward else self.backward_owner()
        out = (self.fwd_gemms if forward else self.bwd_gemms).setdefault(owner, [])
        for m, n, k, batch, lhs, rhs in calls:
            out.append((m, n, k, batch, (self._factor(lhs, owner, forward), self._factor(rhs, owner, forward))))

    def _factor(self, tensor: Any, owner: str | None, forward: bool) -> str:
        if not isinstance(tensor, torch.Tensor):
            return "x"
        key = StorageWeakRef(tensor.untyped_storage()).cdata
        if key in self.resident:
            return "w"
        if forward:
            self.gemm_inputs.setdefault(owner, set()).add(key)
            self.keep.append(tensor)  # its storage identity must not be reused by a gradient
            return "x"
        return "x" if key in self.gemm_inputs.get(owner, ()) else "g"

    def _claim(self, result: Any, name: str) -> None:
        """Mark the autograd functions created by this node (new ones reachable from its
        outputs; older ones were claimed by earlier nodes)."""
        stack = [tensor.grad_fn for tensor in iter_tensors(result) if tensor.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn in self.fn_owner:
                continue
            self.fn_owner[fn] = name
            for nxt, _ in fn.next_functions:
                if nxt is not None and nxt not in self.fn_owner:
                    stack.append(nxt)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.current is not None:
            storage = tensor.untyped_storage()
            self.saved_raw.setdefault(self.current, []).append(
                (StorageWeakRef(storage).cdata, storage.nbytes(), tensor.dtype)
            )
            self.keep.append(tensor)
        return tensor

    # ---- the replay
    def _inputs(self) -> list[Any]:
        args = []
        for n in self.graph.nodes:
            if n.op != "placeholder":
                continue
            val = n.meta.get("val")
            role = self.roles.get(n.name, "input")
            if role == "param" and isinstance(val, torch.Tensor):
                leaf = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
                if leaf.is_floating_point() or leaf.is_complex():
                    leaf.requires_grad_(True)
                val = leaf
            if role != "input" and isinstance(val, torch.Tensor):
                self.resident.add(StorageWeakRef(val.untyped_storage()).cdata)
            args.append(val)
        return args

    def replay(self) -> None:
        vals = [n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"]
        fake_mode = detect_fake_mode([val for val in vals if isinstance(val, torch.Tensor)])
        if fake_mode is None:
            raise PassError(
                _PASS,
                None,
                "the graph's placeholders carry no fake tensors; trace "
                "the model with planner.frontend.trace.trace_model (torch.export).",
            )
        counter = _Counter(self)
        self.shape_env = fake_mode.shape_env
        self.replacements_seen = len(self.shape_env.replacements) if self.shape_env is not None else 0
        with fake_mode, torch.enable_grad(), _quiet_fake_tensor_errors():
            args = self._inputs()
            self.keep.extend(args)
            with counter, torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                out = self.run(*args)
            roots = [tensor for tensor in iter_tensors(out) if tensor.requires_grad]
            if roots:
                with counter:
                    torch.autograd.backward(roots, [torch.ones_like(tensor) for tensor in roots])

    def annotate(self) -> None:
        """Write the node.meta keys from what the replay recorded."""
        sym = self.symbols
        unowned = self.bwd.pop(None, [])
        unowned_bytes = self.bwd_bytes.pop(None, [])
        nodes = list(self.graph.nodes)

        def total(sizes) -> sympy.Expr:
            return sum((to_expr(x, sym) for x in sizes), sympy.Integer(0))

        def gemms(calls) -> list[GemmCall]:
            return [
                GemmCall(to_expr(m, sym), to_expr(n, sym), to_expr(k, sym), to_expr(batch, sym), operands)
                for m, n, k, batch, operands in calls
            ]

        unowned_gemms = self.bwd_gemms.pop(None, [])

        for n in nodes:
            need(n, "layer", _PASS, "assign_layers")
            n.meta["fwd_flops"] = total(self.fwd.get(n.name, ()))
            n.meta["bwd_flops"] = total(self.bwd.get(n.name, ()))
            n.meta["fwd_bytes"] = total(self.fwd_bytes.get(n.name, ()))
            n.meta["bwd_bytes"] = total(self.bwd_bytes.get(n.name, ()))
            n.meta["fwd_gemms"] = gemms(self.fwd_gemms.get(n.name, ()))
            n.meta["bwd_gemms"] = gemms(self.bwd_gemms.get(n.name, ()))
            n.meta["saved"] = [
                SavedTensor(
                    key,
                    to_expr(nbytes, sym),
                    str(dtype).replace("torch.", ""),
                    self.storage_owner.get(key, n.name),
                    False,
                )
                for key, nbytes, dtype in self.saved_raw.get(n.name, ())
                if key not in self.resident
            ]
            val = self.env.get(n)
            n.meta["requires_grad"] = any(tensor.requires_grad for tensor in iter_tensors(val))
        out = nodes[-1]
        out.meta["bwd_flops"] = out.meta["bwd_flops"] + total(unowned)
        out.meta["bwd_bytes"] = out.meta["bwd_bytes"] + total(unowned_bytes)
        out.meta["bwd_gemms"] = out.meta["bwd_gemms"] + gemms(unowned_gemms)


def _charge(gm: fx.GraphModule) -> None:
    """Charge each storage to the first node of each layer that saves it: sets ``counted`` on
    the records and ``saved_bytes`` on the nodes."""
    seen: set = set()
    for n in gm.graph.nodes:
        layer = n.meta["layer"]
        recs, total = [], sympy.Integer(0)
        for rec in n.meta.get("saved", ()):
            first = (layer, rec.key) not in seen
            seen.add((layer, rec.key))
            recs.append(replace(rec, counted=first))
            if first:
                total = total + rec.nbytes
        n.meta["saved"] = recs
        n.meta["saved_bytes"] = total


def _reduced_graph(gm: fx.GraphModule, same_as: dict[int, int]) -> tuple[fx.GraphModule, dict[str, str]]:
    """A copy of ``gm`` without the layers in ``same_as`` (layer -> earlier identical layer).

    Uses of a dropped node are redirected to the node at the same position in its
    representative layer, so the next kept layer reads the representative's output; size
    arithmetic is kept wherever it is. A kept layer that fed only dropped ones would then feed
    nothing, and autograd would never run its backward: when blocks alternate (Llama-4's dense
    block, a rotary expert block, the dense block again, then an expert block without rotary)
    the second block's output fed the dropped third one only. Such outputs are returned beside
    the graph's own, so the backward starts from them too (each function still runs once).
    Returns the copy and ``{dropped node name: representative node name}``.
    """
    by_layer: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        # size arithmetic is matched by nothing: export computes an expression once, in the first
        # block that needs it, and later blocks read it there (``passes.layers.is_size``)
        if n.op == "call_function" and not is_size(n):
            by_layer.setdefault(n.meta["layer"], []).append(n)
    corr: dict[fx.Node, fx.Node] = {}
    for lay, rep in same_as.items():
        mine, theirs = by_layer.get(lay, []), by_layer.get(rep, [])
        if len(mine) != len(theirs):
            raise PassError(
                _PASS,
                mine[0] if mine else None,
                f"layer {lay} was declared identical to layer {rep} but has a different number of ops.",
            )
        corr.update(zip(mine, theirs))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n in corr:
            env[n] = env[corr[n]]
        else:
            env[n] = graph.node_copy(n, lambda arg: env[arg])
    # what only dropped layers read: outputs too, or its layer's backward would never run
    orphans = [
        env[n] for n in gm.graph.nodes if n not in corr and n.op == "call_function" and n.users and not env[n].users
    ]
    if orphans:
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        output.args = ((output.args[0], tuple(orphans)),)
    return fx.GraphModule(gm, graph), {n.name: twin.name for n, twin in corr.items()}


def annotate_costs(
    gm: fx.GraphModule, roles: dict[str, str], symbols: dict, same_as: dict[int, int] | None = None
) -> fx.GraphModule:
    """Replay ``gm`` under autograd and write FLOPs and saved bytes per node (see module doc).

    ``same_as`` (layer -> an earlier layer with an identical signature) lets the replay skip
    repeated blocks: the graph is replayed without them and their nodes receive the
    representative's results, position by position. Costs do not depend on which block feeds a
    block, so the result is the same as replaying everything, at the cost of one block.
    """
    for n in gm.graph.nodes:
        need(n, "layer", _PASS, "assign_layers")
    if not same_as:
        replay = CostReplay(gm, roles, symbols)
        replay.replay()
        replay.annotate()
        _charge(gm)
        return gm
    small, corr = _reduced_graph(gm, same_as)
    replay = CostReplay(small, roles, symbols)
    replay.replay()
    replay.annotate()
    _copy_results(gm, small, corr, replay)
    _charge(gm)
    return gm


def _arg_nodes(node: fx.Node) -> list:
    """The node's arguments flattened in a fixed order (non-nodes kept as placeholders)."""
    out = []

    def walk(arg):
        if isinstance(arg, (list, tuple)):
            for x in arg:
                walk(x)
        elif isinstance(arg, dict):
            for k in sorted(arg):
                walk(arg[k])
        else:
            out.append(arg)

    walk((node.args, node.kwargs))
    return out


def _copy_results(gm: fx.GraphModule, small: fx.GraphModule, corr: dict[str, str], replay: CostReplay) -> None:
    """Give every node of ``gm`` the results of its replayed twin (itself, or for a dropped
    node its representative), with saved tensors re-identified in ``gm``.

    A saved storage is identified by the node of ``gm`` that created it (``owner``). Storage
    creation is read off the replay: a replayed node either made a fresh storage or aliases one
    of its arguments (a view); the same holds for its twin in ``gm``, so owners follow
    ``gm``'s own wiring (a dropped block's input is the previous block's output, not the
    representative's input). Kernel internals (attention log-sum-exp, norm statistics) are
    owned by the saving node.
    """
    twin = {n: corr.get(n.name, n.name) for n in gm.graph.nodes}
    kept = {n.name: n for n in small.graph.nodes}
    owner: dict[fx.Node, str] = {}

    def arg_with_storage(src: fx.Node, full: fx.Node, key):
        for a_small, a_full in zip(_arg_nodes(src), _arg_nodes(full)):
            if (
                isinstance(a_small, fx.Node)
                and isinstance(a_full, fx.Node)
                and replay.node_key.get(a_small.name) == key
            ):
                return a_full
        return None

    for n in gm.graph.nodes:  # owner of each node's output storage, in graph order
        src = kept.get(twin[n])
        key = replay.node_key.get(twin[n]) if src is not None else None
        if src is None or key is None or replay.storage_owner.get(key) == twin[n]:
            owner[n] = n.name
            continue
        arg = arg_with_storage(src, n, key)
        owner[n] = owner[arg] if arg is not None else replay.storage_owner.get(key, n.name)

    keys = ("fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes", "fwd_gemms", "bwd_gemms", "requires_grad")
    for n in gm.graph.nodes:
        src = kept.get(twin[n])
        if src is None:
            continue
        n.meta.update({k: src.meta[k] for k in keys})
        recs = []
        for rec in src.meta["saved"]:
            who: str | None
            if rec.key == replay.node_key.get(src.name):
                who = owner[n]
            else:
                arg = arg_with_storage(src, n, rec.key)
                who = owner[arg] if arg is not None else (None if rec.producer == src.name else rec.producer)
            ident = ("node", who) if who is not None else ("internal", n.name, rec.key)
            recs.append(SavedTensor(ident, rec.nbytes, rec.dtype, who or n.name, False))
        n.meta["saved"] = recs


def total_saved_bytes(gm: fx.GraphModule) -> sympy.Expr:
    """Bytes autograd keeps for the whole graph, each storage counted once (eager's total)."""
    seen: dict[int, sympy.Expr] = {}
    for n in gm.graph.nodes:
        for rec in n.meta.get("saved", ()):
            seen.setdefault(rec.key, rec.nbytes)
    return sum(seen.values(), sympy.Integer(0))
