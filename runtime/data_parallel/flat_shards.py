"""Flat sharded parameter layout, AdamW on flat fp32 shards, clipping, and state resharding.

Layout: a *group* (one layer) is the concatenation of its parameters, padded with zeros to
``padded = ceil(numel / dp) * dp`` elements; data-parallel rank ``r`` owns the shard
``[r * padded / dp, (r + 1) * padded / dp)``. ``build_groups`` turns a module and a list of
parameter names per layer into ``FlatGroup`` records; ``set_owned_ranges`` computes, inside the
part of a group a rank updates, the element ranges that count in the gradient norm and the ones
that receive weight decay. The engine that moves data in and out of these buffers is
``runtime.data_parallel.zero_engine``.

AdamW (decoupled weight decay, Loshchilov & Hutter), one step ``t`` (1-based) for a parameter
``w`` with gradient ``g``, learning rate ``lr`` and decay ``wd``::

    w   <- w * (1 - lr * wd)                       # decoupled decay, only on decayed elements
    m   <- beta1 * m + (1 - beta1) * g
    v   <- beta2 * v + (1 - beta2) * g * g
    w   <- w - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Everything is elementwise, so it applies unchanged to a *flat shard*: a contiguous slice of the
concatenation of a layer's parameters. Padding elements have ``w = g = m = v = 0`` and stay 0
(the update is ``0 / (0 + eps)``). The order of operations follows ``torch.optim.AdamW``'s
single-tensor path so that results agree with it to rounding.

Gradient clipping by the global norm: with ``N = sqrt(sum over every element of every shard on
every rank of g^2)`` the gradients are multiplied by ``min(1, max_norm / (N + 1e-6))``, the same
coefficient ``torch.nn.utils.clip_grad_norm_`` uses.

Sharded state format (what ``ZeroEngine.state_dict`` returns, and what the helpers here reshard)::

    {"format": "planner.zero/1", "num_shards", "shard_index", "step",
     "groups": [{"names": [...], "shapes": [[...], ...], "numel": n}, ...],
     "master": [Tensor], "exp_avg": [Tensor], "exp_avg_sq": [Tensor],   # fp32, one per group
     # added by the engine, informative (a state loads at any stage and dtype):
     "zero_stage", "lr", "param_dtype", "loss_scaler": dict | None}

Group ``i``'s tensors are this shard's slice of the group's flat fp32 vector padded with zeros to
``padded = ceil(n / num_shards) * num_shards`` elements: shard ``k`` holds
``[k * padded / num_shards, (k + 1) * padded / num_shards)``. With ``num_shards == 1`` the
tensors hold exactly ``n`` elements (no padding). ``consolidate_shards`` joins the shards of all
ranks into one such full state; ``slice_shard`` cuts a full state for any other shard count, so
a checkpoint written at one data-parallel degree loads at another.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from runtime.data_parallel.engine_config import OptimizerConfig

__all__ = [
    "ZeroError",
    "FlatParam",
    "FlatGroup",
    "build_groups",
    "hook_module_names",
    "set_owned_ranges",
    "owned_ranges",
    "square_sums",
    "storage_bytes",
    "FORMAT",
    "adamw_step_",
    "clip_coefficient",
    "padded_numel",
    "consolidate_shards",
    "slice_shard",
    "export_state",
    "import_state",
    "state_layout",
    "resident_access",
    "resident_state",
    "GroupAccess",
]

FORMAT = "planner.zero/1"
_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")

#: Stage-3 states of a group's full compute-dtype buffer.
FREE, GATHERING, GATHERED = 0, 1, 2


class ZeroError(RuntimeError):
    """Misuse of the ZeRO engine (bad layer groups, calls in the wrong phase, bad state)."""


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Join sorted ``[a, b)`` ranges that touch."""
    out: list[tuple[int, int]] = []
    for start, end in ranges:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


class FlatParam:
    """One parameter's place in its group's flat buffer: ``flat[offset:offset + numel]``."""

    __slots__ = ("name", "param", "shape", "offset", "numel")

    def __init__(self, name: str, param: nn.Parameter, offset: int):
        self.name, self.param, self.shape = name, param, param.shape
        self.offset, self.numel = offset, param.numel()


class FlatGroup:
    """A layer (or a layer's routed experts): its flat buffers, the ranges this rank owns, and the
    engine's bookkeeping.

    ``ways`` is the number of ranks the group is sharded and reduced over: the data-parallel
    degree, or for an expert group (``expert``) the expert-data-parallel degree ``dp / ep``
    (every rank of an expert-parallel group holds other experts, so only the ranks holding the
    same ones share them). The engine sets ``way`` (this rank's shard index among them) and
    ``comm_group`` (their process group; None when ``ways == 1``)."""

    def __init__(self, index: int, names: list[str], entries: list[FlatParam], dp: int, expert: bool = False):
        self.index, self.names, self.entries = index, names, entries
        self.expert = expert
        self.ways = dp
        self.way = 0
        self.comm_group: object | None = None
        self.base = 0  # offset in the stage-wide flat buffers (stages 0-2)
        self.numel = sum(e.numel for e in entries)
        self.padded = padded_numel(self.numel, dp)
        self.shard = self.padded // dp
        self.by_id = {id(e.param): e for e in entries}
        self.full: torch.Tensor | None = None  # compute-dtype params, padded
        self.master: torch.Tensor | None = None  # fp32 (stage 0: padded full, else the shard)
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None  # compute-dtype grads, padded
        self.grad_shard: torch.Tensor | None = None  # stage 2/3: fp32 accumulator
        self.norm_ranges: list[tuple[int, int]] | None = None  # None: the whole tensor
        self.decay_ranges: list[tuple[int, int]] | None = None
        self.hook_modules: list[str] = []
        self.state = GATHERED
        self.gather_work = None
        self.waiting: set[int] = set(self.by_id)  # params without a gradient in this backward
        self.ready = False  # complete in this backward
        self.dirty = False  # local gradients not yet reduced
        self.visited = False  # stage 3: gathered or finished in this backward
        self.param_shard: torch.Tensor | None = None  # stage 3, optimizer offloaded: the gather source
        self.gather_src: torch.Tensor | None = None  # stage 3: a fetched shard kept until its gather ends
        self.flushed = False  # optimizer offload: the reduced gradient is in host memory this step


def build_groups(
    module: nn.Module,
    layers: Sequence[Sequence[str]] | None,
    dp: int,
    experts: frozenset[str] = frozenset(),
    expert_ways: int = 1,
) -> list[FlatGroup]:
    """Check ``layers`` against ``module`` and lay each group out flat (see ``ZeroEngine``).

    Every parameter must be in exactly one group (a tied parameter may be named by any alias).
    ``layers=None``: parameters directly on ``module`` first, then one group per child (per
    grandchild for a ``ModuleList``/``ModuleDict`` child, e.g. one per transformer block).
    Parameters a container holds directly (a ``ParameterList`` inside a ``ModuleList``) must
    then be grouped explicitly. A layer holding parameters named in ``experts`` (routed expert
    weights under expert parallelism) becomes two groups: its other parameters sharded over
    ``dp``, then its expert parameters sharded over ``expert_ways``.
    """
    canonical = list(module.named_parameters())
    if not canonical:
        raise ZeroError("the module has no parameters; a ZeRO engine has nothing to manage")
    by_alias: dict[str, nn.Parameter] = dict(module.named_parameters(remove_duplicate=False))
    canon_name = {id(param): n for n, param in canonical}
    frozen = [n for n, param in canonical if not param.requires_grad]
    if frozen:
        raise ZeroError(f"frozen parameters are not supported (requires_grad=False): {frozen[:5]}")
    if layers is None:
        root = [n for n in canon_name.values() if "." not in n]
        layers = [root] if root else []
        for child, sub in module.named_children():
            # A container is not a layer: a ModuleList of blocks gives one group per block.
            heads = (
                [f"{child}.{k}" for k, _ in sub.named_children()]
                if isinstance(sub, (nn.ModuleList, nn.ModuleDict))
                else [child]
            )
            for head in heads:
                names = [n for n in canon_name.values() if n.startswith(head + ".")]
                if names:
                    layers.append(names)
    seen: dict[int, str] = {}
    groups: list[FlatGroup] = []
    for group_index, layer in enumerate(layers):
        names = list(layer)
        if not names:
            raise ZeroError(f"layer group {group_index} is empty; drop it or give it parameter names")
        routed = [n for n in names if n in experts]
        for part, expert in (([n for n in names if n not in experts], False), (routed, True)):
            if part:
                entries = _flat_entries(part, by_alias, canon_name, seen, group_index)
                group = FlatGroup(len(groups), part, entries, expert_ways if expert else dp, expert=expert)
                group.hook_modules = hook_module_names(module, part)
                groups.append(group)
    missing = [n for n, param in canonical if id(param) not in seen]
    if missing:
        raise ZeroError(f"parameters in no layer group: {missing[:8]} ({len(missing)} in all)")
    return groups


def _flat_entries(
    names: list[str],
    by_alias: dict[str, nn.Parameter],
    canon_name: dict[int, str],
    seen: dict[int, str],
    layer_index: int,
) -> list[FlatParam]:
    """The flat layout of ``names`` (of layer ``layer_index``); ``seen`` records each parameter's
    group so that none is named twice."""
    entries, offset = [], 0
    for n in names:
        if n not in by_alias:
            raise ZeroError(
                f"layer group {layer_index} names {n!r}, which is not a parameter of the module "
                f"(parameters are e.g. {list(canon_name.values())[:4]})"
            )
        param = by_alias[n]
        if id(param) in seen:
            raise ZeroError(f"parameter {n!r} appears in layer groups twice (also as {seen[id(param)]!r})")
        seen[id(param)] = n
        entries.append(FlatParam(canon_name[id(param)], param, offset))
        offset += param.numel()
    return entries


def hook_module_names(module: nn.Module, names: list[str]) -> list[str]:
    """Deepest submodule(s) holding all ``names``; a ``ModuleList``/``ModuleDict`` (never called
    itself) is replaced by those of its children that hold some of them, recursively."""
    paths = [n.split(".")[:-1] for n in names]
    prefix = paths[0]
    for path in paths[1:]:
        k = 0
        while k < min(len(prefix), len(path)) and prefix[k] == path[k]:
            k += 1
        prefix = prefix[:k]
    mod = module.get_submodule(".".join(prefix))
    if prefix and isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
        heads = sorted({tuple(path[: len(prefix) + 1]) for path in paths})
        out: list[str] = []
        for head in heads:
            sub = [n for n, path in zip(names, paths) if tuple(path[: len(prefix) + 1]) == head]
            out.extend(x for x in hook_module_names(module, sub) if x not in out)
        return out
    return [".".join(prefix)]


def set_owned_ranges(
    groups: Sequence[FlatGroup],
    stage: int,
    dp_rank: int,
    replicated: Callable[[str], bool] | None,
    replicated_rank: int,
    decays: Callable[[str], bool] | None,
) -> None:
    """Set each group's ``norm_ranges`` and ``decay_ranges`` inside the part this rank updates.

    That part is the whole padded group at stage 0 and shard ``dp_rank`` otherwise. An element
    counts in the gradient norm when no other rank counts the same value: at stage 0 only dp rank
    0 counts (gradients are replicated over dp), and parameters for which ``replicated(name)``
    holds count only where ``replicated_rank == 0``. ``None`` means the whole tensor.
    """
    for group in groups:
        group.norm_ranges, group.decay_ranges = owned_ranges(group, stage, dp_rank, replicated, replicated_rank, decays)


def owned_ranges(
    group: FlatGroup,
    stage: int,
    dp_rank: int,
    replicated: Callable[[str], bool] | None,
    replicated_rank: int,
    decays: Callable[[str], bool] | None,
) -> tuple[list[tuple[int, int]] | None, list[tuple[int, int]] | None]:
    """``(norm_ranges, decay_ranges)`` of one group (``set_owned_ranges``), relative to the part
    of the group this rank updates; ``None`` means the whole part."""
    shard_start, shard_end = (0, group.padded) if stage == 0 else (dp_rank * group.shard, (dp_rank + 1) * group.shard)
    owner = stage > 0 or dp_rank == 0
    norm, decay, all_norm, all_decay = [], [], owner, True
    for entry in group.entries:
        start, end = max(entry.offset, shard_start), min(entry.offset + entry.numel, shard_end)
        if start >= end:
            continue
        counted = owner and not (replicated is not None and replicated_rank != 0 and replicated(entry.name))
        if counted:
            norm.append((start - shard_start, end - shard_start))
        all_norm &= counted
        if decays is None or decays(entry.name):
            decay.append((start - shard_start, end - shard_start))
        else:
            all_decay = False
    return (None if all_norm else merge_ranges(norm)), (None if all_decay else merge_ranges(decay))


#: torch's fused AdamW kernel (CPU and CUDA), when this torch has it.
_FUSED_ADAMW = getattr(torch, "_fused_adamw_", None)


def _complement(ranges: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The parts of ``[0, size)`` outside the sorted, disjoint ``ranges``."""
    out, at = [], 0
    for start, end in ranges:
        if start > at:
            out.append((at, start))
        at = max(at, end)
    if at < size:
        out.append((at, size))
    return out


@torch.no_grad()
def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    config: OptimizerConfig,
    decay_ranges: Sequence[tuple[int, int]] | None = None,
    grad_scale: float = 1.0,
) -> None:
    """One AdamW update of the flat fp32 ``param`` in place (see the module docstring).

    ``step`` is the 1-based count including this update; ``config`` gives ``lr``, ``betas``, ``eps``
    and ``weight_decay``. ``decay_ranges`` lists the ``[start, end)`` element ranges that receive
    weight decay; ``None`` decays everything. ``grad_scale`` multiplies the gradient first (the
    clip and loss-scale factor); the fused kernel applies it as it reads the gradient, which is left
    as it was, where the unfused path scales it in place.
    """
    if param.dtype != torch.float32 or exp_avg.dtype != torch.float32:
        raise TypeError(f"AdamW runs on fp32 masters and state, got {param.dtype}/{exp_avg.dtype}")
    if step < 1:
        raise ValueError(f"AdamW step count must be >= 1, got {step}")
    lr, (beta1, beta2), eps, weight_decay = config.lr, config.betas, config.eps, config.weight_decay
    if _FUSED_ADAMW is not None and param.device.type in ("cpu", "cuda") and grad.dtype == torch.float32:
        # One pass over the four buffers (torch's fused kernel, the same update: decoupled decay,
        # bias-corrected moments), the decayed ranges and the others as two lists of slices, the
        # scale applied by the kernel: no pass of its own for the decay or the clip.
        # The step count lives on the parameters' device (the CUDA kernel rejects a CPU tensor);
        # a fill, not a host-to-device copy, so the host does not wait for the queued kernels.
        steps = torch.full((), float(step), device=param.device)
        scale = None if grad_scale == 1.0 else torch.full((), 1.0 / grad_scale, device=param.device)
        decayed = [(0, param.numel())] if decay_ranges is None else list(decay_ranges)
        for pieces, decay in ((decayed, weight_decay), (_complement(decayed, param.numel()), 0.0)):
            if not pieces:
                continue
            _FUSED_ADAMW(
                *([t[start:end] for start, end in pieces] for t in (param, grad, exp_avg, exp_avg_sq)),
                [],
                [steps] * len(pieces),
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=decay,
                eps=eps,
                amsgrad=False,
                maximize=False,
                grad_scale=scale,
            )
        return
    if grad_scale != 1.0:
        grad.mul_(grad_scale)
    if weight_decay != 0.0:
        factor = 1.0 - lr * weight_decay
        for start, end in [(0, param.numel())] if decay_ranges is None else decay_ranges:
            param[start:end].mul_(factor)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def square_sums(
    groups: Sequence[FlatGroup], grad_of: Callable[[FlatGroup], torch.Tensor], device: torch.device
) -> torch.Tensor:
    """fp64 ``[sum of g^2 over the norm ranges, sum of g^2 over everything]`` of this rank.

    ``grad_of(group)`` is the gradient aligned with the group's ``master``. Summed over the
    ranks that hold the other parts of the model, the first entry is the squared global norm;
    the second is only used to detect inf/nan anywhere in this rank's gradients.
    """
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for group in groups:
        grad = grad_of(group)
        full_sq = torch.dot(grad, grad).double()
        if group.norm_ranges is None:
            sums[0] += full_sq
        else:
            for start, end in group.norm_ranges:
                sums[0] += torch.dot(grad[start:end], grad[start:end]).double()
        sums[1] += full_sq
    return sums


def storage_bytes(tensors: Sequence[torch.Tensor | None], seen: set[int] | None = None) -> int:
    """Bytes of the distinct non-empty storages behind ``tensors`` (None entries skipped); storages
    already in ``seen`` are skipped and the counted ones added to it."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """Multiplier that clips gradients of global norm ``total_norm`` to ``max_norm`` (1.0: none)."""
    if max_norm is None:
        return 1.0
    if max_norm <= 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_norm}")
    return min(1.0, max_norm / (total_norm + 1e-6))


def padded_numel(numel: int, num_shards: int) -> int:
    """``numel`` rounded up to a multiple of ``num_shards`` (the flat buffer length)."""
    return -(-numel // num_shards) * num_shards


def _check_format(state: dict, what: str) -> None:
    if state.get("format") != FORMAT:
        raise ValueError(
            f"{what} is not a ZeRO engine state dict (format {state.get('format')!r}, expected {FORMAT!r})"
        )


def consolidate_shards(states: Sequence[dict]) -> dict:
    """Join the state dicts of all shards (one per dp rank, any order) into one full state.

    The result has ``num_shards == 1`` and unpadded tensors; pass it to ``slice_shard`` or
    directly to ``ZeroEngine.load_state_dict`` at any data-parallel degree or ZeRO stage.
    """
    if not states:
        raise ValueError("consolidate_shards needs at least one state dict")
    for shard in states:
        _check_format(shard, "a shard")
    n = states[0]["num_shards"]
    by_index = {shard["shard_index"]: shard for shard in states}
    if sorted(by_index) != list(range(n)) or len(states) != n:
        raise ValueError(
            f"consolidate_shards needs exactly one state per shard index 0..{n - 1}, "
            f"got indices {sorted(s['shard_index'] for s in states)}"
        )
    first = by_index[0]
    for shard in states:
        if shard["groups"] != first["groups"] or shard["step"] != first["step"]:
            raise ValueError("shards come from different models or steps; they cannot be joined")
    out = {k: value for k, value in first.items() if k not in _STATE_KEYS}
    out["num_shards"], out["shard_index"] = 1, 0
    for key in _STATE_KEYS:
        out[key] = [
            torch.cat([by_index[k][key][group_index] for k in range(n)])[: grp["numel"]].clone()
            for group_index, grp in enumerate(first["groups"])
        ]
    return out


def slice_shard(full: dict, num_shards: int, index: int) -> dict:
    """Shard ``index`` of ``num_shards`` of a full state (``num_shards == 1``), padding each group."""
    _check_format(full, "the full state")
    if full["num_shards"] != 1:
        raise ValueError(
            f"slice_shard needs a full state (num_shards 1), got num_shards {full['num_shards']}; "
            "join the shards with consolidate_shards first"
        )
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is outside 0..{num_shards - 1}")
    out = {k: value for k, value in full.items() if k not in _STATE_KEYS}
    out["num_shards"], out["shard_index"] = num_shards, index
    for key in _STATE_KEYS:
        tensors = []
        for group_index, grp in enumerate(full["groups"]):
            flat = full[key][group_index]
            n = grp["numel"]
            if flat.numel() != n:
                raise ValueError(f"group {group_index} {key} has {flat.numel()} elements, expected {n}")
            if num_shards == 1:
                tensors.append(flat.clone())
                continue
            size = padded_numel(n, num_shards) // num_shards
            piece = torch.zeros(size, dtype=flat.dtype)
            start, end = index * size, min((index + 1) * size, n)
            if end > start:
                piece[: end - start] = flat[start:end]
            tensors.append(piece)
        out[key] = tensors
    return out


def _layout(groups: Sequence[FlatGroup]) -> list[dict]:
    return [
        {
            "names": [e.name for e in group.entries],
            "shapes": [list(e.shape) for e in group.entries],
            "numel": group.numel,
        }
        for group in groups
    ]


GroupAccess = Callable[..., "contextlib.AbstractContextManager[tuple[torch.Tensor, ...]]"]
"""``access(group, write=False)``: a context manager giving ``(master, exp_avg, exp_avg_sq)`` of the
group for its body (stored back after it when ``write``); ``runtime.data_parallel.offload_engine`` streams NVMe state
through one. The default reads the group's own tensors."""


def resident_state(group: FlatGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(master, exp_avg, exp_avg_sq)`` held in the group's own tensors (device or cpu tier)."""
    master, exp_avg, exp_avg_sq = group.master, group.exp_avg, group.exp_avg_sq
    if master is None or exp_avg is None or exp_avg_sq is None:
        raise ZeroError(f"parameter group {group.index} holds no optimizer state in its own tensors")
    return master, exp_avg, exp_avg_sq


@contextlib.contextmanager
def resident_access(group: FlatGroup, write: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
    """The ``GroupAccess`` of state held in the group's own tensors."""
    yield resident_state(group)


def state_layout(groups: Sequence[FlatGroup], num_shards: int, shard_index: int, step: int) -> dict:
    """A state dict without its tensors: the layout ``export_state`` fills."""
    return {
        "format": FORMAT,
        "num_shards": num_shards,
        "shard_index": shard_index,
        "step": step,
        "groups": _layout(groups),
    }


def export_state(
    groups: Sequence[FlatGroup], num_shards: int, shard_index: int, step: int, access: GroupAccess = resident_access
) -> dict:
    """CPU copy of the groups' masters and AdamW moments as shard ``shard_index`` of ``num_shards``.

    The groups hold the padded full vectors when ``num_shards == 1`` (ZeRO stage 0), their shard
    otherwise; a full state is stored unpadded. ``access`` reaches each group's tensors, one group
    at a time.
    """

    def part(tensor: torch.Tensor, group: FlatGroup) -> torch.Tensor:
        return (tensor[: group.numel] if num_shards == 1 else tensor).detach().clone().cpu()

    state = state_layout(groups, num_shards, shard_index, step)
    for key in _STATE_KEYS:
        state[key] = []
    for group in groups:
        with access(group) as tensors:
            for key, tensor in zip(_STATE_KEYS, tensors):
                state[key].append(part(tensor, group))
    return state


@torch.no_grad()
def import_state(
    groups: Sequence[FlatGroup], state: dict, num_shards: int, shard_index: int, access: GroupAccess = resident_access
) -> int:
    """Copy ``state`` into the groups' masters and moments (reached through ``access``, one group at
    a time); returns its step count.

    ``state`` must have the groups' layout and be either shard ``shard_index`` of ``num_shards``
    or a full state (``num_shards == 1``), which is sliced here.
    """
    _check_format(state, "the state")
    if state["groups"] != _layout(groups):
        raise ZeroError(
            "the state dict's parameter layout (names, shapes or grouping) differs from this "
            "engine's; it was saved from another model or with other layer groups"
        )
    if (state["num_shards"], state["shard_index"]) != (num_shards, shard_index):
        if state["num_shards"] != 1:
            raise ZeroError(
                f"the state holds shard {state['shard_index']} of {state['num_shards']} but this "
                f"rank needs shard {shard_index} of {num_shards}; join all shards with "
                "runtime.data_parallel.flat_shards.consolidate_shards and load the full state"
            )
        state = slice_shard(state, num_shards, shard_index)
    for i, group in enumerate(groups):
        for key in _STATE_KEYS:
            if state[key][i].numel() > group.padded:
                raise ZeroError(f"group {i} {key} has {state[key][i].numel()} elements, more than {group.padded}")
        with access(group, write=True) as tensors:
            for key, dst in zip(_STATE_KEYS, tensors):
                src = state[key][i]
                if src.numel() > dst.numel():
                    raise ZeroError(f"group {i} {key} has {src.numel()} elements, more than {dst.numel()}")
                dst.zero_()
                dst[: src.numel()].copy_(src.to(dst.device))
    return int(state["step"])
