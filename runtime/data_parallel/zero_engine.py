"""ZeRO data parallelism (stages 0-3) with mixed precision, written on ``runtime.distributed.comm``.

Layout
------
The parameters of one pipeline stage are split into *groups* (one per layer, in forward order).
Each group is a flat vector: its parameters concatenated in order and padded with zeros to
``padded = ceil(numel / dp) * dp`` elements, so it splits into ``dp`` equal *shards* of
``S = padded / dp`` elements; data-parallel rank ``r`` owns ``[r S, (r + 1) S)``. Every module
parameter becomes a view of its group's flat buffer (``p.data = flat[off:off + n].view(shape)``),
so collectives and the optimizer work on whole buffers without copies.

Routed expert weights under expert parallelism are groups of their own, sharded and reduced over
the expert-data-parallel group instead of dp (``runtime.data_parallel.expert_groups``).

What each rank holds (``P`` = parameter count, ``b`` = bytes of the compute dtype)::

    stage   compute params      fp32 master            grads                      AdamW m, v
    0       P b (full)          = params if fp32        P b (full)                 8 P
    1       P b (full)          P/dp shard*             P b (full)                 8 P / dp
    2       P b (full)          P/dp shard*             4 P / dp (fp32 shard)      8 P / dp
    3       gathered per layer  4 P / dp (the shard)    4 P / dp (fp32 shard)      8 P / dp
    (* a view of the compute params when they are fp32, separate storage otherwise)

The fp32 gradient shards of stages 2/3 exist from a step's first reduce-scatter until
``zero_grad()``. Offloaded state (stages 1-3, plan.json ``offload``) lives in host memory or NVMe
files instead: ``runtime.data_parallel.offload_engine``.

Gradients
---------
Each rank's loss is the mean over its local samples; the engine *averages* gradients over dp, so
dp ranks with ``B/dp`` samples each reproduce one process with ``B`` samples. Backward accumulates
into the flat gradient buffers (``p.grad`` are views of them); a post-accumulate hook per parameter
marks a group complete, and its bucket is reduced *while backward continues*
(``runtime.data_parallel.grad_reduction``; ``ShardingConfig.overlap`` off: at the pass's end, waited
there): stage 0/1 all-reduce once per step (from the hooks of the last backward, per root, when
``micro_batches_per_step`` is set, else in ``step()``; left in flight until ``step()``); stage 2/3
reduce-scatter on every backward outside ``no_sync()`` into fp32 shard accumulators, freeing the
full gradient. A parameter tied across pipeline stages (``runtime.data_parallel.tied_weights``)
is a group of its own, its reduced gradient summed over its tied group in ``step()``.

Backward passes
---------------
A backward pass is one autograd graph task, or everything inside ``with engine.backward_pass():``.
A split schedule (``runtime.pipeline.executor``) wraps each ``W`` so that a group completes and is
reduced once per micro-batch, and each ``B`` in ``backward_pass(accumulates=False)``, which neither
counts nor reduces. Over ``v`` model chunks (``roots``) a step is ``v * m`` passes; buckets never
span two roots. One norm, clip and step cover all.

Step
----
``step()``: finish reductions; sum of squared gradients over the elements this rank *owns* (at
stage 0 only dp rank 0 counts; parameters replicated across tensor-parallel ranks count on rank 0
of their group) and a non-finite flag, in one fp64 all-reduce over dp and ``norm_groups``.
``N = sqrt(sum) / loss_scale`` is the global norm; if any rank saw inf/nan every rank skips the
step. Otherwise gradients are multiplied by ``(1 / loss_scale) * min(1, max_norm / (N + 1e-6))``
and AdamW (``runtime.data_parallel.flat_shards.adamw_step_``) updates the fp32 masters; stage 0
copies them into the parameters, 1/2 all-gather the updated shards (with ``overlap``, left in
flight until each layer's first use: ``runtime.data_parallel.param_gathers``), 3 keeps only the
shard (its per-layer gathers: ``runtime.data_parallel.zero3_lifetime``). fp16 uses ``DynamicLossScaler``:
``scale_loss(loss).backward()``. ``state_dict()`` returns this rank's shards with the layout to
reshard them (``runtime.data_parallel.flat_shards``), loadable at any dp or stage.

Assumption: every data-parallel rank runs the same graph (same modules, same parameters receive
gradients), as with DDP; module weights must be identical on all dp ranks at construction.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from runtime.data_parallel.engine_config import OptimizerConfig, ParallelContext, ShardingConfig
from runtime.data_parallel.expert_groups import by_kind, check_experts, expert_data_group, place_groups
from runtime.data_parallel.flat_shards import (
    FREE,
    FlatGroup,
    ZeroError,
    adamw_step_,
    build_groups,
    clip_coefficient,
    export_state,
    import_state,
    owned_ranges,
    set_owned_ranges,
    square_sums,
    state_layout,
    storage_bytes,
)
from runtime.data_parallel.grad_reduction import GradientReducer, drop_full_grad, shard_accumulator
from runtime.data_parallel.offload_engine import Offload, OffloadConfig, OptimizerStore, copy_part
from runtime.data_parallel.onebit_adam import OneBitAdam
from runtime.data_parallel.param_gathers import ParamGathers
from runtime.data_parallel.precision import DynamicLossScaler, cast_floating, dtype_name
from runtime.data_parallel.tied_weights import tied_flat_groups
from runtime.data_parallel.zero3_lifetime import Zero3Params, group_roots, in_backward
from runtime.distributed import comm
from runtime.distributed.mesh import get_mesh

__all__ = [
    "ZeroEngine",
    "StepInfo",
    "DynamicLossScaler",
    "ZeroError",
    "ShardingConfig",
    "OptimizerConfig",
    "ParallelContext",
    "OffloadConfig",
]


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
        sharding: ZeRO stage, compute dtype, gradient buckets, prefetch, backward passes per step
            (``runtime.data_parallel.engine_config.ShardingConfig``; default: stage 0 in fp32).
        optimizer: AdamW hyper-parameters, clipping, weight-decay filter and fp16 loss scaler
            (``runtime.data_parallel.engine_config.OptimizerConfig``).
        parallel: the tensor/pipeline-parallel groups that share the gradient norm, replicated and
            tied parameters, this process's rank (``runtime.data_parallel.engine_config.ParallelContext``).
        offload: where the optimizer state and (ZeRO-3) parameter shards live, and the delayed
            update (``runtime.data_parallel.offload_engine.OffloadConfig``; None: on the device).
        roots: names of the submodules called on their own (a rank's model chunks, ``"0"``,
            ``"1"`` ... of an ``nn.ModuleList``; ``None``: the module). Each group lies in one root;
            each root gets the root hooks and its own gradient buckets ("Backward passes").
    """

    def __init__(
        self,
        module: nn.Module,
        layers: Sequence[Sequence[str]] | None = None,
        dp_group: Any = None,
        sharding: ShardingConfig | None = None,
        optimizer: OptimizerConfig | None = None,
        parallel: ParallelContext | None = None,
        offload: OffloadConfig | None = None,
        roots: Sequence[str] | None = None,
    ):
        self.module = module
        self.sharding = sharding = sharding or ShardingConfig()
        self.optimizer = optimizer = optimizer or OptimizerConfig()
        parallel = parallel or ParallelContext()
        self.stage, self.dtype, self.overlap = sharding.zero_stage, sharding.param_dtype, sharding.overlap
        self.prefetch = sharding.prefetch and sharding.overlap
        self.micro_batches_per_step = sharding.micro_batches_per_step
        self.lr = optimizer.lr
        self.scaler = self._loss_scaler(optimizer.loss_scaler)
        self.dp_group = dp_group
        self.dp = comm.group_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if self.dp > 1 else 0
        self.norm_groups = [group for group in parallel.norm_groups if group is not None and comm.group_size(group) > 1]
        self._init_bookkeeping()
        self.edp_group = expert_data_group(parallel, self.dp)
        self.edp = comm.group_size(self.edp_group) if self.edp_group is not None else 1
        self.edp_rank = dist.get_rank(self.edp_group) if self.edp > 1 else 0
        self.groups: list[FlatGroup] = build_groups(module, layers, self.dp, parallel.expert_params, self.edp)
        place_groups(self.groups, (self.dp, self.dp_rank, dp_group), (self.edp, self.edp_rank, self.edp_group))
        check_experts(self.groups, self.optimizer)
        self._roots = list(roots) if roots else [""]
        self._group_root = group_roots(self.groups, self._roots)
        self.device = self._common_device()
        self._set_ranges(parallel)
        self._tied = tied_flat_groups(self.groups, parallel.tied, parallel.tied_keys)
        self._tied_ids = {group.index for group, _, _ in self._tied}
        rank = parallel.rank
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        self._off = Offload(offload or OffloadConfig(), self.groups, sharding, self.device, rank)
        self._opt: OptimizerStore | None = self._off.opt  # the optimizer state's store when offloaded
        with torch.no_grad():
            self._allocate()
            if self.dtype != torch.float32:
                self._cast_buffers()
        self._reducer = GradientReducer(
            self.groups, self._group_root, self.dp, sharding, self.device, self._flat_grad, self._reduced
        )
        self._onebit = self._one_bit_adam(parallel, offload) if optimizer.compression.enabled else None
        self._gathers = ParamGathers(self.counters)  # ZeRO 1/2: parameter all-gathers in flight after step()
        self._register_hooks()

    # ------------------------------------------------------------------ construction
    def _loss_scaler(self, loss_scaler: DynamicLossScaler | None) -> DynamicLossScaler | None:
        """The loss scaler of the compute dtype: the given one or a default one for fp16, none else."""
        if loss_scaler is None and self.dtype == torch.float16:
            loss_scaler = DynamicLossScaler()
        if loss_scaler is not None and self.dtype != torch.float16:
            raise ValueError(f"a loss scaler is only used with fp16, not {dtype_name(self.dtype)}")
        return loss_scaler

    def _init_bookkeeping(self) -> None:
        """The state of backward passes and steps before the first one."""
        self.step_count = 0
        self._no_sync = False
        self._backwards = 0  # backward passes since the last step / zero_grad
        self._graph_task: int | None = None  # graph task whose end callback is queued
        self._scope = False  # inside backward_pass(): autograd calls join the scope's pass
        self._sync_this_backward = False
        self._root_passes: dict[int, int] = {}  # root -> counted passes that reached it this step
        self._pass_roots: set[int] = set()  # roots whose gradients this pass produced
        self._sync_roots: set[int] = set()  # roots whose gradients this pass reduces
        self._counted = False  # this pass counts towards micro_batches_per_step
        self._hooks: list = []
        self._fwd_order: list[int] = []
        self._fwd_seen: set[int] = set()
        self._orders: dict[int, list[int]] = {}  # root -> its groups in the last forward's order
        self.counters = {"reduced_in_backward": 0, "reduced_at_backward_end": 0, "reduced_in_step": 0, "prefetches": 0}
        """Bucket reductions launched from gradient hooks while backward runs (overlapped), by the
        end-of-backward callback, or by ``step()``; stage-3 gathers launched ahead of use."""

    def _common_device(self) -> torch.device:
        """The one device of every parameter."""
        devices = {entry.param.device for group in self.groups for entry in group.entries}
        if len(devices) != 1:
            raise ZeroError(f"all parameters of a stage must be on one device, found {sorted(map(str, devices))}")
        return devices.pop()

    def _set_ranges(self, parallel: ParallelContext) -> None:
        """Each group's element ranges that count in the gradient norm and that decay. An expert
        group at stage 0 counts on its expert-data-parallel rank 0: the ranks of one
        expert-parallel group hold different experts, so each expert counts once over dp."""
        replicated_rank = self._replicated_rank(parallel)
        for group in self.groups:
            set_owned_ranges(
                [group],
                self.stage,
                group.way,
                parallel.replicated_param_filter,
                replicated_rank,
                self.optimizer.weight_decay_filter,
            )

    @staticmethod
    def _replicated_rank(parallel: ParallelContext) -> int:
        """This rank's index in the group its replicated parameters are duplicated across."""
        replicated_group = parallel.replicated_group
        if parallel.replicated_param_filter is not None and replicated_group is None:
            replicated_group = get_mesh().tp_group
        return dist.get_rank(replicated_group) if replicated_group is not None else 0

    def _one_bit_adam(self, parallel: ParallelContext, offload: OffloadConfig | None) -> OneBitAdam:
        """The compressed exchange of this stage (``runtime.data_parallel.onebit_adam``), after
        checking that this engine has the all-reduce it replaces."""
        if self.stage > 1:
            raise ZeroError(
                f"1-bit Adam replaces the gradient all-reduce of ZeRO stages 0 and 1; stage {self.stage} "
                "reduce-scatters gradients instead (plan with --zero-stage 0 or 1, or without --dp-compression)"
            )
        if self._opt is not None:
            raise ZeroError(
                "1-bit Adam updates the whole model on the device; it does not run with the optimizer offloaded"
            )
        if self.dp == 1:
            raise ZeroError("1-bit Adam compresses the data-parallel exchange; this stage has one data-parallel rank")
        replicated, rank = parallel.replicated_param_filter, self._replicated_rank(parallel)
        uncounted = {name for name, (_, counted) in parallel.tied.items() if not counted}
        full_ranges = []
        for group in self.groups:
            norm, decay = owned_ranges(group, 0, 0, replicated, rank, self.optimizer.weight_decay_filter)
            full_ranges.append(([] if uncounted & set(group.names) else norm, decay))

        def segment_of(group: FlatGroup, name: str) -> tuple[str, int]:
            if group.index in self._tied_ids:
                return ("tied", group.index)
            return ("replicated" if replicated is not None and replicated(name) else "own", 0)

        return OneBitAdam(self.optimizer.compression, self.groups, self.dp_group, segment_of, full_ranges)

    def _cast_buffers(self) -> None:
        """Floating-point module buffers to the compute dtype."""
        for submodule in self.module.modules():
            for key, buffer in submodule._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    submodule._buffers[key] = buffer.to(self.dtype)

    def _allocate(self) -> None:
        """Move the parameters into flat buffers, one group at a time (so that the original
        storage of a group can be released before the next one is copied)."""
        self._flat: torch.Tensor | None = None
        self._flat_grad: torch.Tensor | None = None
        if self.stage < 3:
            total = sum(group.padded for group in self.groups)
            self._flat = torch.zeros(total, dtype=self.dtype, device=self.device)
            if self.stage < 2:
                self._flat_grad = torch.zeros(total, dtype=self.dtype, device=self.device)
        base = 0
        for group in self.groups:
            fp32 = torch.zeros(group.padded, dtype=torch.float32, device=self.device)
            for entry in group.entries:
                fp32[entry.offset : entry.offset + entry.numel].copy_(entry.param.detach().reshape(-1))
            own = slice(group.way * group.shard, (group.way + 1) * group.shard)
            if self._flat is not None:
                self._place_flat(group, fp32, own, base)
                base += group.padded
            else:
                group.master = fp32[own].clone()
                group.full = torch.empty(group.padded, dtype=self.dtype, device=self.device)
            self._off.place(group, fp32[own] if self.stage > 0 else fp32)
            # stage 2/3: the fp32 gradient shard is allocated by the first reduction of a step
            # (``shard_accumulator``) and released by ``zero_grad``, so it never exists during the
            # first backward's loss, where a language model's memory peaks.
            self._point_params(group)
            if self.stage == 3:
                self._release_full(group)
                group.state = FREE

    @staticmethod
    def _release_full(group: FlatGroup) -> None:
        """Stage 3: free the storage of ``group``'s full buffer (its views stay, the gathers refill it)."""
        assert group.full is not None
        group.full.untyped_storage().resize_(0)

    def _place_flat(self, group: FlatGroup, fp32: torch.Tensor, own: slice, base: int) -> None:
        """Stages 0-2: ``group``'s views of the stage-wide buffers, filled from ``fp32``, and its master."""
        assert self._flat is not None
        group.base = base
        group.full = self._flat[base : base + group.padded]
        group.full.copy_(fp32)
        if self.stage == 0:
            group.master = group.full if self.dtype == torch.float32 else fp32
        else:
            group.master = group.full[own] if self.dtype == torch.float32 else fp32[own].clone()
        if self._flat_grad is not None:
            group.grad_full = self._flat_grad[base : base + group.padded]

    @staticmethod
    def _point_params(group: FlatGroup) -> None:
        """Every parameter of ``group`` becomes a view of its flat buffer (``.grad`` too, when kept)."""
        assert group.full is not None
        for entry in group.entries:
            entry.param.data = group.full[entry.offset : entry.offset + entry.numel].view(entry.shape)
            entry.param.grad = None
            if group.grad_full is not None:
                entry.param.grad = group.grad_full[entry.offset : entry.offset + entry.numel].view(entry.shape)

    def _sync_tied(self) -> None:
        """Sum the gradients of tied parameters over the stages that hold a copy: this rank's
        copies of one weight first (one per model chunk reading it), then over its tied group;
        every copy gets the sum. The weights go in the order of their keys (the same names on
        every holder), so that ranks sharing a group call its all-reduces in the same order
        whichever chunk met the weight first."""
        copies: dict[str, list[tuple[torch.Tensor, Any]]] = {}
        for group, tied_group, key in self._tied:
            grad = shard_accumulator(group, self.device) if self.stage >= 2 else group.grad_full
            assert grad is not None  # stages 0/1 keep the full gradient buffers
            copies.setdefault(key, []).append((grad, tied_group))
        for _key, held in sorted(copies.items()):
            total, tied_group = held[0]
            for grad, _ in held[1:]:
                total.add_(grad)
            if tied_group is not None:
                comm.all_reduce(total, tied_group)
            for grad, _ in held[1:]:
                grad.copy_(total)

    def _register_hooks(self) -> None:
        for k, name in enumerate(self._roots):
            root = self.module.get_submodule(name)
            self._hooks.append(
                root.register_forward_pre_hook(
                    lambda mod, args, kwargs, k=k: self._root_pre_forward(k, args, kwargs), with_kwargs=True
                )
            )
            self._hooks.append(root.register_forward_hook(lambda mod, args, out, k=k: self._root_post_forward(k)))
        for group in self.groups:
            for entry in group.entries:
                self._hooks.append(
                    entry.param.register_post_accumulate_grad_hook(lambda p, group=group: self._on_grad(group, p))
                )
        if self.stage == 3:
            self._register_gather_hooks()
        elif self.stage in (1, 2):
            self._hooks += self._gathers.hook(self.module, self.groups)

    def _register_gather_hooks(self) -> None:
        """Stage 3: gather each group around the forward of the modules that hold it."""
        by_module: dict[str, list[FlatGroup]] = {}
        for group in self.groups:
            for name in group.hook_modules:
                by_module.setdefault(name, []).append(group)
        for name, groups in by_module.items():
            submodule = self.module.get_submodule(name)
            self._hooks.append(
                submodule.register_forward_pre_hook(lambda mod, args, groups=groups: self._pre_forward(groups))
            )
            self._hooks.append(
                submodule.register_forward_hook(lambda mod, args, out, groups=groups: self._post_forward(groups, out))
            )

    def close(self) -> None:
        """Remove every hook the engine put on the module and its parameters; delete the offload
        stores' NVMe files."""
        self.wait_params()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._off.close()

    def wait_params(self) -> None:
        """Wait for the ZeRO 1/2 parameter all-gathers still in flight after ``step()``
        (``runtime.data_parallel.param_gathers``): call before reading parameters outside the
        module's forward; the engine's own readers (step, state dicts, tracked tensors, close) do."""
        self._gathers.wait_all()

    @property
    def gathers_in_flight(self) -> int:
        """ZeRO 1/2 parameter all-gathers launched by ``step()`` and not yet waited for."""
        return len(self._gathers.pending)

    # ------------------------------------------------------------------ forward
    def _root_pre_forward(self, root: int, args, kwargs):
        if not in_backward():
            self._fwd_order, self._fwd_seen = [], set()
        if self.dtype != torch.float32:
            return cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype)
        return None

    # ------------------------------------------------------------------ backward
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes run inside only accumulate gradients locally (no communication)."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    @contextlib.contextmanager
    def backward_pass(self, accumulates: bool = True) -> Iterator[ZeroEngine]:
        """Every autograd call inside is part of ONE backward pass (see "Backward passes").

        ``accumulates=False``: a pass that accumulates no weight gradient (a split schedule's
        ``B``): it does not count towards ``micro_batches_per_step`` and reduces nothing; at
        ZeRO-3 the groups it gathers are freed when it ends. Not reentrant; call it outside
        autograd, around the ``backward``/``grad`` calls."""
        if in_backward() or self._scope or self._graph_task is not None:
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
        self._reducer.launched = set()
        self._backwards += counted
        self._counted = counted
        self._pass_roots, self._sync_roots = set(), set()
        self._reducer.local_only = self._compressing()
        if not counted or self._no_sync or self.dp == 1 and self.stage < 2 or self._reducer.local_only:
            self._sync_this_backward = False
        elif self.stage < 2 and len(self._roots) > 1:  # decided per root, at its first gradient
            self._sync_this_backward = self.micro_batches_per_step is not None
        elif self.stage < 2:
            self._sync_this_backward = self._backwards == self.micro_batches_per_step
        else:
            self._sync_this_backward = True

    def _syncs(self, root: int) -> bool:
        """Whether this pass reduces root ``root``'s gradients (decided at its first gradient).

        Stages 0/1 over several roots (a rank's model chunks) reduce each root in the root's own
        last pass (the ``micro_batches_per_step / len(roots)``-th that reaches it), so a chunk
        whose backward ends early has its reductions in flight under the other chunks' passes
        instead of all at the step's last one."""
        if root not in self._pass_roots:
            self._pass_roots.add(root)
            passes = self._root_passes[root] = self._root_passes.get(root, 0) + self._counted
            if not self._sync_this_backward:
                pass
            elif self.stage >= 2 or len(self._roots) == 1:
                self._sync_roots.add(root)
            else:
                assert self.micro_batches_per_step is not None  # _start_pass syncs only with it
                if passes == max(1, self.micro_batches_per_step // len(self._roots)):
                    self._sync_roots.add(root)
        return root in self._sync_roots

    def _begin_backward(self) -> None:
        """First hook of a backward pass: decide whether it reduces, queue the end callback (inside
        ``backward_pass()`` the scope did both)."""
        task = torch._C._current_graph_task_id()
        if self._scope or task == self._graph_task:
            return
        if self._graph_task is not None:
            raise ZeroError(
                "a backward pass started inside another one (reentrant activation checkpointing?); "
                "the ZeRO engine needs non-reentrant checkpointing (use_reentrant=False). If an "
                "earlier backward failed instead, call engine.zero_grad() before the next one"
            )
        self._graph_task = task
        self._start_pass(counted=True)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, group: FlatGroup, param: nn.Parameter) -> None:
        self._begin_backward()
        root = self._group_root[group.index]
        syncs = self._syncs(root)
        entry = group.by_id[id(param)]
        self._reducer.settle(group)  # a reduction of an earlier pass still reading this buffer
        if group.grad_full is None:  # stage 2/3: the group's first gradient since its last reduction
            group.grad_full = torch.zeros(group.padded, dtype=self.dtype, device=self.device)
            for other in group.entries:
                if other is not entry:
                    other.param.grad = group.grad_full[other.offset : other.offset + other.numel].view(other.shape)
        view = group.grad_full[entry.offset : entry.offset + entry.numel]
        if param.grad is None:
            raise ZeroError(f"parameter {entry.name!r} has no gradient in its post-accumulate hook")
        if param.grad.data_ptr() != view.data_ptr():  # created by autograd (or the user reset .grad)
            with torch.no_grad():
                view.copy_(param.grad.reshape(-1))
            param.grad = view.view(entry.shape)
        group.dirty = True
        group.flushed = False
        group.waiting.discard(id(param))
        if not group.waiting and not group.ready:
            group.ready = True
            group.visited = True
            self._free(group)
            if syncs and self.overlap:
                self._launch("reduced_in_backward", only_ready=True, root=root)

    def _end_backward(self) -> None:
        """The end of a backward pass: the reductions it owes not yet launched are launched. Stages
        2/3 wait for them here (as FSDP does at the end of backward: the next pass accumulates
        into fresh full gradients, and the memory model counts at most ``REDUCTIONS_IN_FLIGHT + 1``
        of them). Stages 0/1 leave them in flight, so a pipeline rank's last sends and the other
        chunks' passes run beside them, until ``step()`` (or a later gradient of the same buffer)
        waits. With overlap off every reduction is launched and waited here."""
        self._graph_task = None
        if self._sync_roots:
            one_root = len(self._roots) == 1 or self.stage >= 2
            for root in [None] if one_root else sorted(self._sync_roots):
                self._launch("reduced_at_backward_end", only_ready=False, root=root)
            if self.stage >= 2 or not self.overlap:
                self._reducer.drain()
        for group in self.groups:
            group.waiting, group.ready, group.visited = set(group.by_id), False, False
            self._free(group)
        self._reducer.launched = set()

    def _launch(self, where: str, only_ready: bool, root: int | None = None) -> None:
        """Launch the ready buckets (``GradientReducer.launch``), counted in ``counters[where]``."""
        self.counters[where] += self._reducer.launch(only_ready, root)

    def _reduced(self, group: FlatGroup) -> None:
        """``group``'s reduction completed: with the optimizer offloaded, the reduced gradient of
        the step's last backward leaves the device now, overlapped with the rest of backward (a
        tied weight's waits for its sum over stages, in ``step()``)."""
        last = self.micro_batches_per_step is not None and self._backwards >= self.micro_batches_per_step
        if self._opt is not None and last and group.index not in self._tied_ids:
            self._off.flush_grad(group)

    # ------------------------------------------------------------------ step
    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (the identity unless fp16)."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def _grad_source(self, group: FlatGroup) -> torch.Tensor:
        """fp32 gradient aligned with ``group.master`` (may alias the gradient buffers; in host memory
        when the optimizer is offloaded)."""
        if self._opt is not None:
            return self._opt.grad(group)
        if self.stage >= 2:
            return shard_accumulator(group, self.device)
        grad = group.grad_full
        assert grad is not None  # stages 0/1 keep the full gradient buffers
        if self.stage == 1:
            grad = grad[group.way * group.shard : (group.way + 1) * group.shard]
        return grad if grad.dtype == torch.float32 else grad.float()

    def _compressing(self) -> bool:
        """This step exchanges 1-bit Adam's compressed momentum instead of reducing gradients."""
        return self._onebit is not None and self._onebit.compressing(self.step_count)

    def _finish_reductions(self) -> None:
        """``step()``'s first part: every reduction done, tied gradients summed over their stages,
        offloaded gradients in host memory."""
        self._graph_task = None
        self._reducer.local_only = self._compressing()
        self._reducer.launched = set()
        self._launch("reduced_in_step", only_ready=False)
        self._reducer.drain()
        self._reducer.launched, self._backwards, self._root_passes = set(), 0, {}
        for group in self.groups:
            self._free(group)
        self._sync_tied()
        if self._opt is not None:
            self._off.flush_all(self.groups)

    def _global_norm(self) -> tuple[float, bool]:
        """The unscaled global gradient norm and whether any rank saw inf/nan (one fp64 all-reduce
        over dp, then over each of ``norm_groups``)."""
        grad_device = torch.device("cpu") if self._opt is not None else self.device
        sums = square_sums(self.groups, self._grad_source, grad_device).to(self.device)
        sums[1] = (~torch.isfinite(sums[1])).double()  # the overflow flag
        for process_group in ([self.dp_group] if self.dp > 1 else []) + self.norm_groups:
            comm.all_reduce(sums, process_group)
        total_sq, overflow = sums.tolist()
        self._settle()  # a delayed update: the previous step's reaches the device now
        norm = math.sqrt(total_sq) / self.loss_scale if total_sq >= 0 else float("nan")
        return norm, overflow > 0

    @torch.no_grad()
    def step(self, lr: float | None = None) -> StepInfo:
        """Reduce, unscale, check overflow, clip and apply AdamW; collective over all ranks."""
        if in_backward():
            raise ZeroError("step() was called during a backward pass; call it after backward returns")
        if lr is not None:
            self.lr = float(lr)
        self.wait_params()  # the update writes the owned shard a gather may still be sending
        self._finish_reductions()
        if self._compressing():
            return self._compressed_step()
        norm, overflow = self._global_norm()
        if overflow or not math.isfinite(norm):
            return self._skipped(norm)
        coefficient = clip_coefficient(norm, self.optimizer.max_grad_norm) / self.loss_scale
        self.step_count += 1
        # a delayed update reads the step count and the learning rate after step() returned
        step, hyper = self.step_count, replace(self.optimizer, lr=self.lr)

        def update(group: FlatGroup, master, exp_avg, exp_avg_sq, grad=None):
            gradient = self._grad_source(group) if grad is None else grad
            adamw_step_(
                master,
                gradient,
                exp_avg,
                exp_avg_sq,
                step=step,
                config=hyper,
                decay_ranges=group.decay_ranges,
                grad_scale=coefficient,
            )
            return self._publish(group, master) if grad is None else None

        works: list = []
        if self._opt is not None and self._off.delayed:
            self._opt.start_update(self.groups, update)
        elif self._opt is not None:
            works = self._opt.update(self.groups, update)
        else:  # groups in forward order: the next forward waits for each gather at its first use
            for group in self.groups:
                work = update(group, group.master, group.exp_avg, group.exp_avg_sq)
                if self.overlap:
                    self._gathers.defer(group, work)
                else:
                    works.append(work)
        for work in works:
            comm.wait(work)
        if self.scaler is not None:
            self.scaler.update(False)
        return StepInfo(grad_norm=norm, skipped=False, loss_scale=self.loss_scale)

    def _skipped(self, norm: float) -> StepInfo:
        """A step that some rank's inf/nan gradient skipped on every rank."""
        if self.scaler is not None:
            self.scaler.update(True)
        return StepInfo(
            grad_norm=norm if not math.isfinite(norm) else float("inf"), skipped=True, loss_scale=self.loss_scale
        )

    def _compressed_step(self) -> StepInfo:
        """``step()`` after the warm-up: 1-bit Adam on every rank's own gradient (the module
        docstring of ``runtime.data_parallel.onebit_adam``; clipped by the RMS of local norms)."""
        assert self._onebit is not None
        full = self._onebit.full_state(self.stage, self.dp_rank, self._whole_params)
        grads = [self._whole_grad(group) for group in self.groups]
        sums = self._onebit.square_sums(grads)
        sums[1] = (~torch.isfinite(sums[1])).double()  # the overflow flag
        for process_group in [self.dp_group] + self.norm_groups:
            comm.all_reduce(sums, process_group)
        total_sq, overflow = sums.tolist()
        norm = math.sqrt(total_sq / self.dp) / self.loss_scale if total_sq >= 0 else float("nan")
        if overflow or not math.isfinite(norm):
            return self._skipped(norm)
        coefficient = clip_coefficient(norm, self.optimizer.max_grad_norm) / self.loss_scale
        self.step_count += 1
        self._onebit.update(full, grads, self.step_count, replace(self.optimizer, lr=self.lr), coefficient)
        for group, state in zip(self.groups, full):
            assert group.full is not None
            if state.master.data_ptr() != group.full.data_ptr():
                group.full.copy_(state.master)
        if self.scaler is not None:
            self.scaler.update(False)
        return StepInfo(grad_norm=norm, skipped=False, loss_scale=self.loss_scale)

    @staticmethod
    def _whole_params(group: FlatGroup) -> torch.Tensor:
        assert group.full is not None  # stages 0/1 keep the full parameters
        return group.full

    @staticmethod
    def _whole_grad(group: FlatGroup) -> torch.Tensor:
        """This rank's own (unreduced) fp32 gradient of ``group``, whole."""
        assert group.grad_full is not None  # stages 0/1 keep the full gradient buffers
        return group.grad_full.float()

    def compression_state(self) -> dict[str, torch.Tensor]:
        """This rank's 1-bit Adam error buffers (empty without compression or before it starts)."""
        return self._onebit.state_dict() if self._onebit is not None else {}

    def load_compression_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``compression_state()`` (a resume under the same plan)."""
        if self._onebit is not None:
            self._onebit.load_state_dict(state, self.device)

    def _settle(self) -> None:
        """Wait for a delayed update still running on the CPU and bring it to the device."""
        if self._opt is not None and self._off.delayed:
            for work in self._opt.finish_update(self.groups, self._publish):
                comm.wait(work)

    def _publish(self, group: FlatGroup, master: torch.Tensor):
        """Make the compute parameters reflect the updated ``master`` (async handle or None); from
        the host tier that is a cast and a host-to-device copy (asynchronous from pinned memory)."""
        if self.stage == 3:
            self._off.store_shard(group, master)
            return None
        assert group.full is not None
        if self.stage == 0:
            if master is not group.full:
                group.full.copy_(master)
            return None
        shard = group.full[group.way * group.shard : (group.way + 1) * group.shard]
        if master.data_ptr() != shard.data_ptr():
            with copy_part(self.device) if self._opt is not None else contextlib.nullcontext():
                shard.copy_(master, non_blocking=True)
        if group.ways == 1:
            return None
        return comm.all_gather_into(group.full, shard, group.comm_group, async_op=True)

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Clear accumulated gradients (buffers are zeroed and kept; nothing is freed to Python)."""
        if in_backward():
            raise ZeroError("zero_grad() was called during a backward pass")
        self._graph_task = None
        self._reducer.drain()
        self._backwards, self._reducer.launched, self._root_passes = 0, set(), {}
        self._off.new_step()
        for group in self.groups:
            group.dirty = group.ready = group.visited = group.flushed = False
            group.waiting = set(group.by_id)  # also recovers from a backward that raised midway
            self._free(group)
            if self.stage < 2:
                assert group.grad_full is not None
                for entry in group.entries:
                    entry.param.grad = group.grad_full[entry.offset : entry.offset + entry.numel].view(entry.shape)
            else:
                # Released between steps (as FSDP frees gradients in zero_grad); the next
                # backward allocates it again on its first reduce-scatter.
                group.grad_shard = None
                drop_full_grad(group)
        if self._flat_grad is not None:
            self._flat_grad.zero_()

    # ------------------------------------------------------------------ state and memory
    def _shard_position(self, expert: bool = False) -> tuple[int, int]:
        """``(num_shards, shard_index)`` of this rank's state of the dense (or ``expert``) groups
        (stage 0: the one full state)."""
        if self.stage == 0:
            return (1, 0)
        return (self.edp, self.edp_rank) if expert else (self.dp, self.dp_rank)

    def state_dict(self) -> dict:
        """This rank's shards of masters and AdamW state, with the layout needed to reshard.

        Format: see ``runtime.data_parallel.flat_shards``. Stage 0 returns the full (unpadded) state with
        ``num_shards == 1``; stages 1-3 return shard ``dp_rank`` of ``dp``. Under expert parallelism
        the expert groups are left out of it and form ``state["experts"]``, a state of the same
        format holding this rank's experts only, shard ``edp_rank`` of ``dp / ep`` (stage 0: full).
        """
        self._reducer.drain()
        self.wait_params()
        self._settle()
        state: dict = {}
        for key, groups in by_kind(self.groups):
            num_shards, shard_index = self._shard_position(key is not None)
            part = export_state(groups, num_shards, shard_index, self.step_count, self._off.access)
            if key is None:
                state.update(part)
            else:
                state[key] = part
        state.update(
            zero_stage=self.stage,
            lr=self.lr,
            param_dtype=dtype_name(self.dtype),
            loss_scaler=self.scaler.state_dict() if self.scaler is not None else None,
        )
        return state

    def state_layout(self) -> dict:
        """``state_dict()`` without its tensors (the layout a full state must have), read nothing."""
        layout: dict = {}
        for key, groups in by_kind(self.groups):
            part = state_layout(groups, *self._shard_position(key is not None), self.step_count)
            if key is None:
                layout.update(part)
            else:
                layout[key] = part
        return layout

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a state from ``state_dict`` (same layout) or a full one (``consolidate_shards``).

        Collective at stages 1 and 2 (the loaded shards are all-gathered into the parameters).
        """
        self.wait_params()  # a gather in flight would overwrite the loaded parameters
        self._settle()
        for key, groups in by_kind(self.groups):
            part = state if key is None else state.get(key)
            if part is None:
                raise ZeroError("the state holds no expert parameters, but this engine has some (expert parallelism)")
            num_shards, shard_index = self._shard_position(key is not None)
            self.step_count = import_state(groups, part, num_shards, shard_index, self._off.access)
        self.lr = float(state.get("lr", self.lr))
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        works = []
        for group in self.groups:
            with self._off.access(group) as (master, _, _):
                works.append(self._publish(group, master))
        for work in works:
            comm.wait(work)
        if self._onebit is not None:
            self._onebit.forget_full_state()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters by their original names (collective over dp at stages 1-3); an
        expert parameter is this rank's slice of the experts."""
        self.wait_params()
        self._settle()
        out: dict[str, torch.Tensor] = {}
        for group in self.groups:
            with self._off.access(group) as (master, _, _):
                if self.stage == 0 or group.ways == 1:
                    flat = master.clone()
                else:
                    flat = torch.empty(group.padded, dtype=torch.float32, device=self.device)
                    comm.all_gather_into(flat, master.to(self.device), group.comm_group)
            for entry in group.entries:
                out[entry.name] = flat[entry.offset : entry.offset + entry.numel].view(entry.shape).clone().cpu()
        return out

    def tracked_tensors(self) -> list[torch.Tensor]:
        """Every device tensor the engine holds (for memory trackers); views share their base's
        storage. Host-tier tensors are ``host_tensors()``."""
        self.wait_params()
        host = {id(t) for t in self.host_tensors()}
        tensors = [
            t
            for group in self.groups
            for t in (
                group.full,
                group.master,
                group.exp_avg,
                group.exp_avg_sq,
                group.grad_full,
                group.grad_shard,
                group.param_shard,
            )
            if t is not None and id(t) not in host
        ]
        if self._onebit is not None:
            tensors += self._onebit.error_buffers() + self._onebit.whole_state()
        return tensors + [t for t in (self._flat, self._flat_grad) if t is not None]

    def _error_buffers(self) -> list[torch.Tensor | None]:
        """1-bit Adam's error-feedback buffers (none without compression)."""
        return list(self._onebit.error_buffers()) if self._onebit is not None else []

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
        ``exp_avg`` and ``exp_avg_sq`` (and 1-bit Adam's error buffers). Each storage is counted once.
        """
        seen: set[int] = set()  # sizes only: a gather in flight changes no storage, nothing to wait for
        groups = self.groups
        params = [self._flat] + [group.full for group in groups] + [group.master for group in groups]
        grads = [self._flat_grad] + [group.grad_full for group in groups] + [group.grad_shard for group in groups]
        return {
            "params": storage_bytes(params, seen),
            "grads": storage_bytes(grads, seen),
            "optimizer": storage_bytes(
                [group.exp_avg for group in groups] + [group.exp_avg_sq for group in groups] + self._error_buffers(),
                seen,
            ),
        }
