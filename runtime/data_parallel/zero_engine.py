"""ZeRO data parallelism (stages 0-3) with mixed precision, written on ``runtime.distributed.comm``.

Layout
------
The parameters of one pipeline stage are split into *groups* (one per layer, in forward order).
Each group is a flat vector: its parameters concatenated in order and padded with zeros to
``padded = ceil(numel / dp) * dp`` elements, so it splits into ``dp`` equal *shards* of
``S = padded / dp`` elements; data-parallel rank ``r`` owns ``[r S, (r + 1) S)``. Every module
parameter becomes a view of its group's flat buffer (``p.data = flat[off:off + n].view(shape)``),
so collectives and the optimizer work on whole buffers without copies.

What each rank holds (``P`` = parameter count, ``b`` = bytes of the compute dtype)::

    stage   compute params      fp32 master            grads                      AdamW m, v
    0       P b (full)          = params if fp32        P b (full)                 8 P
    1       P b (full)          P/dp shard*             P b (full)                 8 P / dp
    2       P b (full)          P/dp shard*             4 P / dp (fp32 shard)      8 P / dp
    3       gathered per layer  4 P / dp (the shard)    4 P / dp (fp32 shard)      8 P / dp
    (* a view of the compute params when they are fp32, separate storage otherwise)
    The fp32 gradient shards of stages 2/3 exist from a step's first reduce-scatter until
    ``zero_grad()``, which releases them (so they are absent at the start of each forward).

    offloaded (``runtime.data_parallel.offload_engine``, plan.json ``offload``; stages 1-3):
    optimizer cpu    masters, m, v (12 P / dp) and the reduced fp32 gradient shard (4 P / dp) in
                     host memory; the device keeps its compute params, at stage 1 the full gradient
                     buffer, at 2/3 only the gradients of layers in flight, at 3 a compute-dtype
                     shard (P b / dp) that the gathers start from
    optimizer nvme   as cpu, with masters, m, v in files; host memory: the gradient shard and two
                     transfer slots of the largest group's state
    params cpu/nvme  (stage 3) that compute-dtype shard in host memory / a file instead, copied to
                     the device just before each gather

Gradients
---------
Each rank's loss is the mean over its local samples; the engine *averages* gradients over dp,
so dp ranks with ``B/dp`` samples each reproduce one process with ``B`` samples. Backward passes
accumulate into the flat gradient buffers (``p.grad`` are views of them). A post-accumulate hook
on every parameter counts the parameters of a group that received their gradient; when a group
is complete its bucket may be reduced *while backward continues* (async collectives):

- stage 0/1: all-reduce (sum, then divide by dp) of a *bucket* -- consecutive groups, contiguous
  in one big gradient buffer, in backward order, about ``bucket_bytes`` each. Reduced once per
  step: from the hooks of the last backward when ``micro_batches_per_step`` is set, else in
  ``step()``. A backward after a reduction (more backwards than announced) is still right: the
  buffer then holds ``avg + g_r`` and its reduction gives ``(dp avg + sum g_r) / dp``.
- stage 2/3: reduce-scatter of each bucket on *every* backward that is not inside ``no_sync()``
  (a per-micro-batch reduce-scatter, as FSDP does): the result is added (divided by dp) to fp32
  shard accumulators and the full gradient buffer of the group is freed, so gradients cost
  ``4 P / dp`` plus the layers in flight. A bucket of several groups is laid out rank-major
  (``[g1 shard r | g2 shard r]`` for each r) in a staging buffer, one collective for all.
  Inside ``no_sync()`` full gradients accumulate instead and are reduce-scattered later.
  Outside backward ``p.grad`` is then ``None``: the reduced gradient lives in the shards.

A parameter tied across pipeline stages (``runtime.data_parallel.tied_weights``) is a group of its own; ``step()`` sums
its reduced gradient (stage 0/1 the full buffer, 2/3 the fp32 shard) over its tied group first.

Buckets launch strictly in bucket order (a bucket whose groups finish early waits for the
earlier buckets), so every rank issues the same collectives in the same order. The end of each
backward (an autograd engine callback) launches what is left and waits for all of it.

Backward passes
---------------
A backward pass is one autograd graph task, or everything inside ``with
engine.backward_pass():`` (begun on entry, its end-of-backward work on exit). A split schedule
(``runtime.pipeline.executor``: ``B`` input gradients, ``W`` weight gradients in one autograd call per
group of weights) wraps each ``W`` so that a group completes and is reduced once per micro-batch,
as under 1F1B (unwrapped, each ``W`` call was a pass: at pp2 x dp2 ZeRO-1 reduced mid-``W`` and
again in ``step()``, ZeRO-2 issued 20 reduce-scatters per step instead of 8), and each ``B`` in
``backward_pass(accumulates=False)``, which neither counts nor reduces. Over ``v`` model chunks
(``roots``) a step is ``v * m`` passes, each completing one chunk's groups; buckets never span two
roots and a pass launches its root's buckets as they complete. One norm, clip and step cover all.

Step
----
``step()``: finish reductions; sum of squared gradients over the elements this rank *owns*
(its shard; at stage 0 only dp rank 0 counts, the gradients being replicated; parameters that
``replicated_param_filter`` marks as duplicated across tensor-parallel ranks count only on rank 0
of ``replicated_group``) and a non-finite flag, both in one fp64 all-reduce over dp and then over
each of ``norm_groups``. ``N = sqrt(sum) / loss_scale`` is the global gradient norm. If any rank
saw inf/nan, every rank skips the step (and the loss scaler backs off). Otherwise gradients are
multiplied by ``(1 / loss_scale) * min(1, max_norm / (N + 1e-6))`` and AdamW
(``runtime.data_parallel.flat_shards.adamw_step_``) updates the fp32 masters; stage 0 copies them into the compute
parameters, stage 1/2 all-gather the updated shards into the full flat buffers (async, overlapped
with the next group's update), stage 3 keeps only the shard. With the optimizer offloaded the
gradients are host shards (flushed as their reduction completes), and the update runs on the CPU
group by group through the store (``runtime.data_parallel.offload_engine``), each result copied back to the device.

ZeRO-3 parameter lifetime
-------------------------
Gathered per layer just before use and freed after: ``runtime.data_parallel.zero3_lifetime`` (``Zero3Params``, a base
class of ``ZeroEngine``) explains the hooks and their contract.

Mixed precision
---------------
``param_dtype`` (fp32, bf16, fp16) is the compute dtype of parameters, gradients and
collectives; masters, AdamW state and stage-2/3 gradient shards are fp32. Floating-point module
buffers and forward inputs are cast to ``param_dtype``. fp16 uses ``DynamicLossScaler``: call
``scale_loss(loss).backward()`` (or multiply by ``engine.loss_scale``).

State
-----
``state_dict()`` returns this rank's shards (masters, AdamW moments, step, loss scaler) with the
layout needed to reshard them (``runtime.data_parallel.flat_shards``: ``consolidate_shards`` / ``slice_shard``);
``load_state_dict`` takes the same layout or a consolidated one, at any dp or stage.
``full_state_dict()`` gathers the fp32 parameters by their original names.

Assumption: every data-parallel rank runs the same graph (same modules, same parameters receive
gradients), as with DDP; module weights must be identical on all dp ranks at construction.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from runtime.contract.limits import REDUCTIONS_IN_FLIGHT
from runtime.data_parallel.flat_shards import (
    FREE,
    FlatGroup,
    ZeroError,
    adamw_step_,
    build_groups,
    clip_coefficient,
    export_state,
    import_state,
    set_owned_ranges,
    square_sums,
    state_layout,
    storage_bytes,
)
from runtime.data_parallel.offload_engine import Offload, OffloadConfig, copy_part
from runtime.data_parallel.precision import DynamicLossScaler, cast_floating, check_compute_dtype, dtype_name
from runtime.data_parallel.tied_weights import tied_flat_groups
from runtime.data_parallel.zero3_lifetime import Zero3Params, group_roots, in_backward
from runtime.distributed import comm
from runtime.distributed.mesh import get_mesh

#: Cap of the first gradient bucket of a step (the last layers' gradients, ready first).
FIRST_BUCKET_BYTES = 2**20


__all__ = ["ZeroEngine", "StepInfo", "DynamicLossScaler", "ZeroError"]


@dataclass(frozen=True)
class StepInfo:
    """What one ``ZeroEngine.step`` did."""

    grad_norm: float
    """Global gradient norm before clipping (unscaled); inf or nan when the step was skipped."""
    skipped: bool
    """True when some rank saw a non-finite gradient and no rank updated its parameters."""
    loss_scale: float
    """Loss scale to use for the next step (1.0 unless fp16)."""


class ZeroEngine(Zero3Params):
    """ZeRO stage 0-3 data parallelism for one pipeline stage's module (see the module docstring).

    Args:
        module: the stage's module, parameters in fp32, identical on every dp rank.
        layers: parameter names per layer, in forward order; every parameter in exactly one
            group (aliases of tied parameters accepted). ``None``: the parameters directly on
            ``module`` form a first group, then one group per top-level child (per element
            for a ``ModuleList``/``ModuleDict`` child).
        dp_group: data-parallel process group (``None``: dp = 1, no communication).
        zero_stage: 0, 1, 2 or 3.
        param_dtype: compute dtype (``torch.float32``, ``torch.bfloat16``, ``torch.float16``).
        lr, betas, eps, weight_decay: AdamW hyper-parameters (decoupled weight decay).
        max_grad_norm: clip the global gradient norm to this (``None``: no clipping).
        norm_groups: further process groups whose ranks hold other parts of the model (tensor
            and pipeline parallel); squared norms and the overflow flag are summed over them.
        replicated_param_filter: ``name -> bool``; True for parameters duplicated on every rank
            of ``replicated_group`` (e.g. LayerNorm weights under tensor parallelism). They count
            once in the gradient norm, on rank 0 of that group only.
        replicated_group: the group those parameters are duplicated across (default: the tensor
            parallel group of ``runtime.distributed.mesh.get_mesh()``).
        weight_decay_filter: ``name -> bool``; False exempts a parameter from weight decay
            (default: every parameter decays).
        bucket_bytes: target size of one gradient reduction (groups are merged up to it).
        loss_scaler: loss scaler for fp16 (default for fp16: ``DynamicLossScaler()``); must be
            ``None`` for other dtypes.
        prefetch: stage 3 only: gather the next layer asynchronously while this one computes.
        micro_batches_per_step: number of backward passes per step (with ``roots``, the passes of
            all roots together: ``v * m`` for ``v`` model chunks and ``m`` micro-batches); when
            set, stage 0/1 reduce gradients from the hooks of the last one (overlapped with
            backward) instead of in ``step()``.
        tied: ``name -> (group, counted)`` for parameters tied across pipeline stages
            (``runtime.data_parallel.tied_weights``): each must form a group of its own in ``layers``; after the dp
            reduction its gradient (stage 0/1: the full buffer, 2/3: the fp32 shard) is summed
            over ``group``, and it counts in the gradient norm only where ``counted``.
        offload: where the optimizer state and (ZeRO-3) parameter shards live
            (``runtime.data_parallel.offload_engine.OffloadConfig``; None: on the device).
        rank: this process's global rank, naming its NVMe folder (default: ``dist.get_rank()``).
        delayed_update: with the optimizer offloaded, run each step's CPU update in the background
            and apply it at the next ``step()``: step k+1's forward and backward use the parameters
            of step k-1 (one step stale; it changes the numerics). ``state_dict`` and friends wait
            for it and apply it first.
        roots: names of the submodules called on their own (a rank's model chunks, ``"0"``,
            ``"1"`` ... of an ``nn.ModuleList``; ``None``: the module). Each group lies in one root;
            each root gets the root hooks and its own gradient buckets ("Backward passes").
    """

    def __init__(
        self,
        module: nn.Module,
        layers: Sequence[Sequence[str]] | None = None,
        dp_group=None,
        zero_stage: int = 0,
        param_dtype: torch.dtype = torch.float32,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = None,
        norm_groups: Iterable = (),
        replicated_param_filter: Callable[[str], bool] | None = None,
        replicated_group=None,
        weight_decay_filter: Callable[[str], bool] | None = None,
        bucket_bytes: int = 25 * 2**20,
        loss_scaler: DynamicLossScaler | None = None,
        prefetch: bool = True,
        micro_batches_per_step: int | None = None,
        tied: Mapping[str, tuple[object, bool]] | None = None,
        offload: OffloadConfig | None = None,
        rank: int | None = None,
        delayed_update: bool = False,
        roots: Sequence[str] | None = None,
    ):
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if micro_batches_per_step is not None and micro_batches_per_step < 1:
            raise ValueError(f"micro_batches_per_step must be >= 1, got {micro_batches_per_step}")
        self.module = module
        self.stage = zero_stage
        self.dtype = check_compute_dtype(param_dtype)
        self.lr, self.beta1, self.beta2 = float(lr), float(betas[0]), float(betas[1])
        self.eps, self.weight_decay, self.max_grad_norm = float(eps), float(weight_decay), max_grad_norm
        self.bucket_bytes, self.prefetch = int(bucket_bytes), bool(prefetch)
        self.micro_batches_per_step = micro_batches_per_step
        if loss_scaler is None and self.dtype == torch.float16:
            loss_scaler = DynamicLossScaler()
        if loss_scaler is not None and self.dtype != torch.float16:
            raise ValueError(f"a loss scaler is only used with fp16, not {dtype_name(self.dtype)}")
        self.scaler = loss_scaler
        self.dp_group = dp_group
        self.dp = comm.group_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if self.dp > 1 else 0
        self.norm_groups = [g for g in norm_groups if g is not None and comm.group_size(g) > 1]
        if replicated_param_filter is not None and replicated_group is None:
            replicated_group = get_mesh().tp_group
        rep_rank = dist.get_rank(replicated_group) if replicated_group is not None else 0
        self.step_count = 0
        self._no_sync = False
        self._backwards = 0  # backward passes since the last step / zero_grad
        self._cb_task: int | None = None  # graph task whose end callback is queued
        self._scope = False  # inside backward_pass(): autograd calls join the scope's pass
        self._sync_this_backward = False
        self._inflight: list[tuple] = []
        self._launched: set[int] = set()  # buckets launched in this backward pass
        self._hooks: list = []
        self._fwd_order: list[int] = []
        self._fwd_seen: set[int] = set()
        self._orders: dict[int, list[int]] = {}  # root -> its groups in the last forward's order
        self.counters = {"reduced_in_backward": 0, "reduced_at_backward_end": 0, "reduced_in_step": 0, "prefetches": 0}
        """Bucket reductions launched from gradient hooks while backward runs (overlapped), by the
        end-of-backward callback, or by ``step()``; stage-3 gathers launched ahead of use."""

        self.groups: list[FlatGroup] = build_groups(module, layers, self.dp)
        self._roots = list(roots) if roots else [""]
        self._group_root = group_roots(self.groups, self._roots)
        dev = {e.param.device for g in self.groups for e in g.entries}
        if len(dev) != 1:
            raise ZeroError(f"all parameters of a stage must be on one device, found {sorted(map(str, dev))}")
        self.device = dev.pop()
        set_owned_ranges(self.groups, self.stage, self.dp_rank, replicated_param_filter, rep_rank, weight_decay_filter)
        self._tied = tied_flat_groups(self.groups, tied or {})
        self._tied_ids = {g.index for g, _ in self._tied}
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        self._off = Offload(
            offload or OffloadConfig(), self.groups, self.stage, self.dtype, self.device, rank, delayed_update
        )
        self._opt = self._off.opt  # the optimizer state's store when it is offloaded, else None
        with torch.no_grad():
            self._allocate()
            if self.dtype != torch.float32:
                for m in module.modules():
                    for k, b in m._buffers.items():
                        if b is not None and b.is_floating_point():
                            m._buffers[k] = b.to(self.dtype)
        self._buckets = self._make_buckets()
        self._register_hooks()

    # ------------------------------------------------------------------ construction
    def _allocate(self) -> None:
        """Move the parameters into flat buffers, one group at a time (so that the original
        storage of a group can be released before the next one is copied)."""
        dt, dev, r = self.dtype, self.device, self.dp_rank
        if self.stage < 3:
            total = sum(g.padded for g in self.groups)
            self._flat = torch.zeros(total, dtype=dt, device=dev)
            self._flat_grad = torch.zeros(total, dtype=dt, device=dev) if self.stage < 2 else None
        else:
            self._flat = self._flat_grad = None
        base = 0
        for g in self.groups:
            f = torch.zeros(g.padded, dtype=torch.float32, device=dev)
            for e in g.entries:
                f[e.offset : e.offset + e.numel].copy_(e.param.detach().reshape(-1))
            sl = slice(r * g.shard, (r + 1) * g.shard)
            if self.stage < 3:
                g.base = base
                g.full = self._flat[base : base + g.padded]
                g.full.copy_(f)
                if self.stage == 0:
                    g.master = g.full if dt == torch.float32 else f
                else:
                    g.master = g.full[sl] if dt == torch.float32 else f[sl].clone()
                if self._flat_grad is not None:
                    g.grad_full = self._flat_grad[base : base + g.padded]
                base += g.padded
            else:
                g.master = f[sl].clone()
                g.full = torch.empty(g.padded, dtype=dt, device=dev)
            self._off.place(g, f[sl] if self.stage > 0 else f)
            # stage 2/3: the fp32 gradient shard is allocated by the first reduction of a step
            # (``_shard_acc``) and released by ``zero_grad``, so it never exists during the first
            # backward's loss, where a language model's memory peaks.
            for e in g.entries:
                e.param.data = g.full[e.offset : e.offset + e.numel].view(e.shape)
                e.param.grad = None
                if g.grad_full is not None:
                    e.param.grad = g.grad_full[e.offset : e.offset + e.numel].view(e.shape)
            if self.stage == 3:
                g.full.untyped_storage().resize_(0)
                g.state = FREE

    def _sync_tied(self) -> None:
        """Sum the gradients of tied parameters over the stages that hold a copy."""
        for g, group in self._tied:
            grad = self._shard_acc(g) if self.stage >= 2 else g.grad_full
            comm.all_reduce(grad, group)

    def _make_buckets(self) -> list[list[int]]:
        """Consecutive groups in backward order, each bucket at most ``bucket_bytes`` (a group
        larger than that is a bucket of its own). The first bucket is capped at 1 MiB, as DDP
        does, so the first reduction starts early in backward and overlaps the rest of it.

        Stages 2 and 3 reduce-scatter each group (layer) on its own, as FSDP does per module:
        merging would copy the merged groups' gradients into one more staging buffer, and the
        point of sharding gradients is to hold as few full ones as possible."""
        if self.stage >= 2:
            return [[g.index] for g in reversed(self.groups)]
        esize = torch.empty((), dtype=self.dtype).element_size()
        buckets, cur, size = [], [], 0
        cap = min(self.bucket_bytes, FIRST_BUCKET_BYTES)
        for g in reversed(self.groups):
            gb = g.padded * esize
            if cur and (size + gb > cap or self._group_root[g.index] != self._group_root[cur[0]]):
                buckets.append(cur)
                cur, size, cap = [], 0, self.bucket_bytes
            cur.append(g.index)
            size += gb
        if cur:
            buckets.append(cur)
        return buckets

    def _register_hooks(self) -> None:
        m = self.module
        for k, name in enumerate(self._roots):
            sub = m.get_submodule(name)
            self._hooks.append(
                sub.register_forward_pre_hook(
                    lambda mod, args, kwargs, k=k: self._root_pre_forward(k, args, kwargs), with_kwargs=True
                )
            )
            self._hooks.append(sub.register_forward_hook(lambda mod, args, out, k=k: self._root_post_forward(k)))
        for g in self.groups:
            for e in g.entries:
                self._hooks.append(e.param.register_post_accumulate_grad_hook(lambda p, g=g: self._on_grad(g, p)))
        if self.stage == 3:
            by_module: dict[str, list[FlatGroup]] = {}
            for g in self.groups:
                for name in g.hook_modules:
                    by_module.setdefault(name, []).append(g)
            for name, groups in by_module.items():
                sub = m.get_submodule(name)
                self._hooks.append(sub.register_forward_pre_hook(lambda mod, args, gs=groups: self._pre_forward(gs)))
                self._hooks.append(
                    sub.register_forward_hook(lambda mod, args, out, gs=groups: self._post_forward(gs, out))
                )

    def close(self) -> None:
        """Remove every hook the engine put on the module and its parameters; delete the offload
        stores' NVMe files."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._off.close()

    # ------------------------------------------------------------------ forward
    def _root_pre_forward(self, root: int, args, kwargs):
        if not in_backward():
            self._fwd_order, self._fwd_seen = [], set()
        if self.dtype != torch.float32:
            return cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype)
        return None

    # ------------------------------------------------------------------ backward
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes run inside only accumulate gradients locally (no communication)."""
        prev, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = prev

    @contextlib.contextmanager
    def backward_pass(self, accumulates: bool = True):
        """Every autograd call inside is part of ONE backward pass (see "Backward passes").

        ``accumulates=False``: a pass that accumulates no weight gradient (a split schedule's
        ``B``): it does not count towards ``micro_batches_per_step`` and reduces nothing; at
        ZeRO-3 the groups it gathers are freed when it ends. Not reentrant; call it outside
        autograd, around the ``backward``/``grad`` calls."""
        if in_backward() or self._scope or self._cb_task is not None:
            raise ZeroError(
                "backward_pass() must be entered outside any backward pass and does not nest; "
                "if an earlier backward failed, call engine.zero_grad() first"
            )
        self._start_pass(counted=accumulates)
        self._scope = True
        try:
            yield self
        finally:
            self._scope = False
        self._end_backward()

    def _start_pass(self, counted: bool) -> None:
        """A backward pass begins: count it and decide whether it reduces."""
        self._launched = set()
        self._backwards += counted
        if not counted or self._no_sync or self.dp == 1 and self.stage < 2:
            self._sync_this_backward = False
        elif self.stage < 2:
            self._sync_this_backward = self._backwards == self.micro_batches_per_step
        else:
            self._sync_this_backward = True

    def _begin_backward(self) -> None:
        """First hook of a backward pass: decide whether it reduces, queue the end callback (inside
        ``backward_pass()`` the scope did both)."""
        task = torch._C._current_graph_task_id()
        if self._scope or task == self._cb_task:
            return
        if self._cb_task is not None:
            raise ZeroError(
                "a backward pass started inside another one (reentrant activation checkpointing?); "
                "the ZeRO engine needs non-reentrant checkpointing (use_reentrant=False). If an "
                "earlier backward failed instead, call engine.zero_grad() before the next one"
            )
        self._cb_task = task
        self._start_pass(counted=True)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, g: FlatGroup, p: nn.Parameter) -> None:
        self._begin_backward()
        e = g.by_id[id(p)]
        if g.grad_full is None:  # stage 2/3: the group's first gradient since its last reduction
            g.grad_full = torch.zeros(g.padded, dtype=self.dtype, device=self.device)
            for x in g.entries:
                if x is not e:
                    x.param.grad = g.grad_full[x.offset : x.offset + x.numel].view(x.shape)
        view = g.grad_full[e.offset : e.offset + e.numel]
        if p.grad is None:
            raise ZeroError(f"parameter {e.name!r} has no gradient in its post-accumulate hook")
        if p.grad.data_ptr() != view.data_ptr():  # created by autograd (or the user reset .grad)
            with torch.no_grad():
                view.copy_(p.grad.reshape(-1))
            p.grad = view.view(e.shape)
        g.dirty = True
        g.flushed = False
        g.waiting.discard(id(p))
        if not g.waiting and not g.ready:
            g.ready = True
            g.visited = True
            self._free(g)
            if self._sync_this_backward:
                self._launch_buckets(only_ready=True, where="reduced_in_backward", root=self._group_root[g.index])

    def _end_backward(self) -> None:
        sync = self._sync_this_backward
        self._cb_task = None
        if sync:
            self._launch_buckets(only_ready=False, where="reduced_at_backward_end")
            self._drain()
        for g in self.groups:
            g.waiting, g.ready, g.visited = set(g.by_id), False, False
            self._free(g)
        self._launched = set()

    def _launch_buckets(self, only_ready: bool, where: str = "reduced_in_step", root: int | None = None) -> None:
        """Launch the buckets not yet launched in this pass, in bucket order (``root``: only that
        root's; ``only_ready``: up to the first whose groups are not all complete)."""
        for k, ids in enumerate(self._buckets):
            if k in self._launched or root is not None and self._group_root[ids[0]] != root:
                continue
            bucket = [self.groups[i] for i in ids]
            if only_ready and not all(g.ready for g in bucket):
                break
            self._launched.add(k)
            if any(g.dirty for g in bucket):
                self.counters[where] += 1
                self._reduce_bucket(bucket)
        self._poll()

    def _reduce_bucket(self, bucket: list[FlatGroup]) -> None:
        """Launch the reduction of one bucket (async); its completion is handled by ``_finish``."""
        for g in bucket:
            g.dirty = False
        if self.stage < 2:
            if self.dp == 1:
                for g in bucket:
                    self._reduced(g)
                return
            lo = min(g.base for g in bucket)
            hi = max(g.base + g.padded for g in bucket)
            flat = self._flat_grad[lo:hi]
            work = comm.all_reduce(flat, self.dp_group, async_op=True)
            self._inflight.append((work, "ar", flat, bucket))
            self._poll()
            return
        if self.dp == 1:
            with torch.no_grad():
                for g in bucket:
                    if g.grad_full is not None:
                        self._shard_acc(g).add_(g.grad_full)
                    self._drop_grad_full(g)
                    self._reduced(g)
            return
        if len(bucket) == 1 and bucket[0].grad_full is not None:
            g = bucket[0]
            src, cols = g.grad_full, [(g, 0)]
        else:
            total = sum(g.shard for g in bucket)
            staging = torch.zeros(self.dp, total, dtype=self.dtype, device=self.device)
            cols, a = [], 0
            for g in bucket:
                if g.grad_full is not None:
                    staging[:, a : a + g.shard].copy_(g.grad_full.view(self.dp, g.shard))
                self._drop_grad_full(g)
                cols.append((g, a))
                a += g.shard
            src = staging.view(-1)
        out = torch.empty(src.numel() // self.dp, dtype=self.dtype, device=self.device)
        work = comm.reduce_scatter_into(out, src, self.dp_group, async_op=True)
        self._inflight.append((work, "rs", out, (cols, src)))
        self._poll()

    def _shard_acc(self, g: FlatGroup) -> torch.Tensor:
        """The fp32 gradient-shard accumulator of ``g`` (stage 2/3), allocated on first use."""
        if g.grad_shard is None:
            g.grad_shard = torch.zeros(g.shard, dtype=torch.float32, device=self.device)
        return g.grad_shard

    def _drop_grad_full(self, g: FlatGroup) -> None:
        g.grad_full = None
        for e in g.entries:
            e.param.grad = None

    def _finish(self, item) -> None:
        work, kind, out, extra = item
        comm.wait(work)
        with torch.no_grad():
            if kind == "ar":
                out.div_(self.dp)
                for g in extra:
                    self._reduced(g)
                return
            cols, _src = extra
            for g, a in cols:
                self._shard_acc(g).add_(out[a : a + g.shard], alpha=1.0 / self.dp)
                if len(cols) == 1 and g.grad_full is _src:
                    self._drop_grad_full(g)
                self._reduced(g)

    def _reduced(self, g: FlatGroup) -> None:
        """Group ``g``'s reduction completed: with the optimizer offloaded, the reduced gradient of
        the step's last backward leaves the device now, overlapped with the rest of backward (a
        tied weight's waits for its sum over stages, in ``step()``)."""
        last = self.micro_batches_per_step is not None and self._backwards >= self.micro_batches_per_step
        if self._opt is not None and last and g.index not in self._tied_ids:
            self._off.flush_grad(g, self.dp_rank)

    def _poll(self, max_inflight: int = REDUCTIONS_IN_FLIGHT) -> None:
        """Finish completed reductions in order; bound the ones in flight (and their memory)."""
        while self._inflight and (len(self._inflight) > max_inflight or self._inflight[0][0].is_completed()):
            self._finish(self._inflight.pop(0))

    def _drain(self) -> None:
        while self._inflight:
            self._finish(self._inflight.pop(0))

    # ------------------------------------------------------------------ step
    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (the identity unless fp16)."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def _grad_source(self, g: FlatGroup) -> torch.Tensor:
        """fp32 gradient aligned with ``g.master`` (may alias the gradient buffers; in host memory
        when the optimizer is offloaded)."""
        if self._opt is not None:
            return self._opt.grad(g)
        if self.stage >= 2:
            return self._shard_acc(g)
        src = g.grad_full if self.stage == 0 else g.grad_full[self.dp_rank * g.shard : (self.dp_rank + 1) * g.shard]
        return src if src.dtype == torch.float32 else src.float()

    @torch.no_grad()
    def step(self, lr: float | None = None) -> StepInfo:
        """Reduce, unscale, check overflow, clip and apply AdamW; collective over all ranks."""
        if in_backward():
            raise ZeroError("step() was called during a backward pass; call it after backward returns")
        self._cb_task = None
        if lr is not None:
            self.lr = float(lr)
        self._launched = set()
        self._launch_buckets(only_ready=False)
        self._drain()
        self._launched, self._backwards = set(), 0
        for g in self.groups:
            self._free(g)
        self._sync_tied()
        if self._opt is not None:
            self._off.flush_all(self.groups, self.dp_rank)
        grad_device = torch.device("cpu") if self._opt is not None else self.device
        sums = square_sums(self.groups, self._grad_source, grad_device).to(self.device)
        sums[1] = (~torch.isfinite(sums[1])).double()  # the overflow flag
        for grp in ([self.dp_group] if self.dp > 1 else []) + self.norm_groups:
            comm.all_reduce(sums, grp)
        total_sq, flag = sums.tolist()
        self._settle()  # a delayed update: the previous step's reaches the device now
        scale = self.loss_scale
        norm = math.sqrt(total_sq) / scale if total_sq >= 0 else float("nan")
        if flag > 0 or not math.isfinite(norm):
            if self.scaler is not None:
                self.scaler.update(True)
            return StepInfo(
                grad_norm=norm if not math.isfinite(norm) else float("inf"), skipped=True, loss_scale=self.loss_scale
            )
        coef = clip_coefficient(norm, self.max_grad_norm) / scale
        self.step_count += 1
        step, lr = self.step_count, self.lr  # a delayed update reads them after step() returned

        def update(g: FlatGroup, master, exp_avg, exp_avg_sq, grad=None):
            gr = self._grad_source(g) if grad is None else grad
            if coef != 1.0:
                gr.mul_(coef)
            adamw_step_(
                master,
                gr,
                exp_avg,
                exp_avg_sq,
                step=step,
                lr=lr,
                beta1=self.beta1,
                beta2=self.beta2,
                eps=self.eps,
                weight_decay=self.weight_decay,
                decay_ranges=g.decay_ranges,
            )
            return self._publish(g, master) if grad is None else None

        if self._off.delayed:
            self._opt.start_update(self.groups, update)
            works = []
        elif self._opt is not None:
            works = self._opt.update(self.groups, update)
        else:
            works = [update(g, g.master, g.exp_avg, g.exp_avg_sq) for g in self.groups]
        for w in works:
            comm.wait(w)
        if self.scaler is not None:
            self.scaler.update(False)
        return StepInfo(grad_norm=norm, skipped=False, loss_scale=self.loss_scale)

    def _settle(self) -> None:
        """Wait for a delayed update still running on the CPU and bring it to the device."""
        if self._off.delayed:
            for w in self._opt.finish_update(self.groups, self._publish):
                comm.wait(w)

    def _publish(self, g: FlatGroup, master: torch.Tensor):
        """Make the compute parameters reflect the updated ``master`` (async handle or None); from
        the host tier that is a cast and a host-to-device copy (asynchronous from pinned memory)."""
        if self.stage == 3:
            self._off.store_shard(g, master)
            return None
        if self.stage == 0:
            if master is not g.full:
                g.full.copy_(master)
            return None
        shard = g.full[self.dp_rank * g.shard : (self.dp_rank + 1) * g.shard]
        if master.data_ptr() != shard.data_ptr():
            with copy_part(self.device) if self._opt is not None else contextlib.nullcontext():
                shard.copy_(master, non_blocking=True)
        if self.dp == 1:
            return None
        return comm.all_gather_into(g.full, shard, self.dp_group, async_op=True)

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Clear accumulated gradients (buffers are zeroed and kept; nothing is freed to Python)."""
        if in_backward():
            raise ZeroError("zero_grad() was called during a backward pass")
        self._cb_task = None
        self._drain()
        self._backwards, self._launched = 0, set()
        self._off.new_step()
        for g in self.groups:
            g.dirty = g.ready = g.visited = g.flushed = False
            g.waiting = set(g.by_id)  # also recovers from a backward that raised midway
            self._free(g)
            if self.stage < 2:
                for e in g.entries:
                    e.param.grad = g.grad_full[e.offset : e.offset + e.numel].view(e.shape)
            else:
                # Released between steps (as FSDP frees gradients in zero_grad); the next
                # backward allocates it again on its first reduce-scatter.
                g.grad_shard = None
                self._drop_grad_full(g)
        if self._flat_grad is not None:
            self._flat_grad.zero_()

    # ------------------------------------------------------------------ state and memory
    def state_dict(self) -> dict:
        """This rank's shards of masters and AdamW state, with the layout needed to reshard.

        Format: see ``runtime.data_parallel.flat_shards``. Stage 0 returns the full (unpadded) state with
        ``num_shards == 1``; stages 1-3 return shard ``dp_rank`` of ``dp``.
        """
        self._drain()
        self._settle()
        n, idx = (1, 0) if self.stage == 0 else (self.dp, self.dp_rank)
        state = export_state(self.groups, n, idx, self.step_count, self._off.access)
        state.update(
            zero_stage=self.stage,
            lr=self.lr,
            param_dtype=dtype_name(self.dtype),
            loss_scaler=self.scaler.state_dict() if self.scaler is not None else None,
        )
        return state

    def state_layout(self) -> dict:
        """``state_dict()`` without its tensors (the layout a full state must have), read nothing."""
        n, idx = (1, 0) if self.stage == 0 else (self.dp, self.dp_rank)
        return state_layout(self.groups, n, idx, self.step_count)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a state from ``state_dict`` (same layout) or a full one (``consolidate_shards``).

        Collective at stages 1 and 2 (the loaded shards are all-gathered into the parameters).
        """
        self._settle()
        n, idx = (1, 0) if self.stage == 0 else (self.dp, self.dp_rank)
        self.step_count = import_state(self.groups, state, n, idx, self._off.access)
        self.lr = float(state.get("lr", self.lr))
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        works = []
        for g in self.groups:
            with self._off.access(g) as (master, _, _):
                works.append(self._publish(g, master))
        for w in works:
            comm.wait(w)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters by their original names (collective over dp at stages 1-3)."""
        self._settle()
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            with self._off.access(g) as (master, _, _):
                if self.stage == 0 or self.dp == 1:
                    flat = master.clone()
                else:
                    flat = torch.empty(g.padded, dtype=torch.float32, device=self.device)
                    comm.all_gather_into(flat, master.to(self.device), self.dp_group)
            for e in g.entries:
                out[e.name] = flat[e.offset : e.offset + e.numel].view(e.shape).clone().cpu()
        return out

    def tracked_tensors(self) -> list[torch.Tensor]:
        """Every device tensor the engine holds (for memory trackers); views share their base's
        storage. Host-tier tensors are ``host_tensors()``."""
        host = {id(t) for t in self.host_tensors()}
        ts = [
            t
            for g in self.groups
            for t in (g.full, g.master, g.exp_avg, g.exp_avg_sq, g.grad_full, g.grad_shard, g.param_shard)
            if t is not None and id(t) not in host
        ]
        return ts + [t for t in (self._flat, self._flat_grad) if t is not None]

    def host_tensors(self) -> list[torch.Tensor]:
        """The host tier's tensors (offloaded state, host gradient shards, transfer buffers): not
        device memory, which a memory tracker on a CPU rank must be told (``runtime.data_parallel.offload_engine``)."""
        return self._off.host_tensors(self.groups)

    def host_bytes(self) -> int:
        """Bytes of the host tier (each storage counted once)."""
        return storage_bytes(self.host_tensors())

    def nvme_bytes(self) -> int:
        """Bytes of this rank's NVMe-tier files."""
        return self._off.nvme_bytes

    def memory_report(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds right now.

        ``params``: compute parameters (materialized storage only) plus fp32 masters that have
        their own storage; ``grads``: full gradient buffers and fp32 shards; ``optimizer``: AdamW
        ``exp_avg`` and ``exp_avg_sq``. Each storage is counted once.
        """
        seen: set[int] = set()
        gs = self.groups
        return {
            "params": storage_bytes([self._flat] + [g.full for g in gs] + [g.master for g in gs], seen),
            "grads": storage_bytes([self._flat_grad] + [g.grad_full for g in gs] + [g.grad_shard for g in gs], seen),
            "optimizer": storage_bytes([g.exp_avg for g in gs] + [g.exp_avg_sq for g in gs], seen),
        }
