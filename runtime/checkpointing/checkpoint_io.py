"""Training checkpoints: atomic, resumable bit-for-bit, and loadable under another plan.

Layout of ``DIR``::

    DIR/step-000120/            one finished checkpoint (torch.distributed.checkpoint format)
        meta.json               step, plan, model, tensor shapes, loss scaler; written last
        *.distcp, .metadata     DCP shards
    DIR/.tmp-step-000130/       a save in progress (ignored; removed by the next save)

What is saved is the *logical* training state, keyed by the original model's parameter names, so
any plan of the same model can load it:

- ``model/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``: the full fp32 master weight and
  AdamW moments of every parameter (ZeRO shards joined over dp, tensor-parallel pieces joined
  over tp; written once, by the rank with dp index 0 and tp index 0 of each pipeline stage; a
  weight tied across stages by its first holder only, and read back by every holder); a routed
  expert parameter under expert parallelism is joined from the ep ranks' rows into the full
  ``[E, ...]`` tensor (``runtime.moe.expert_shards``) and cut again for the loading run's ep degree;
- ``rng/<rank>``: every rank's CPU (and CUDA) generator state; ``compression/<rank>``: its 1-bit Adam
  error buffers (``runtime.data_parallel.onebit_adam``), restored only under the same plan;
- with model chunks (``virtual_stages > 1``) a rank writes the tensors of all its chunks, each by
  its original name, so a checkpoint of an interleaved plan loads under any other plan of the
  model (and the reverse) like any reshard;
- in ``meta.json``: the step (data position: data is a function of (seed, step)), the optimizer
  step count, the loss-scaler state and the plan hash.

Saving is two halves: ``stage`` (in line with training) copies this rank's part to host memory,
its shard of masters and moments, generator states and error buffers; ``write`` joins the shards
into the logical tensors and writes them, in line (``save``, ``--async-checkpoint off``) or in a
background thread on process groups of its own (``runtime.checkpointing.background_writer``).

Atomicity: all ranks write into ``.tmp-step-N``; only after every rank reports success does rank 0
write ``meta.json`` (last) and rename the folder to ``step-N``: the rename is the marker, a folder
without it is invisible to ``list_checkpoints`` and to ``--resume``. A crash or a full disk
mid-save leaves the earlier checkpoints untouched; every rank learns every rank's error, so all
raise the same ``CheckpointError``. Retention counts complete checkpoints only and keeps the newest. Loading under the same plan restores RNG states too, so the losses
after a resume are bit-identical to an uninterrupted run; under another plan the weights and
optimizer state are resharded (RNG streams then differ, which only matters with dropout).

Offloaded state (``runtime.data_parallel.offload_engine``) is saved and loaded the same way: the engine's
``state_dict``/``load_state_dict`` reach each group's masters and moments through its store (the
NVMe tier streams them one group at a time), and the logical format does not record where the
state lived, so a run saved with offload resumes without it and the reverse.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from runtime.data_parallel.flat_shards import FORMAT, consolidate_shards
from runtime.moe import expert_shards
from runtime.stages.compiled_stages import rank_params
from runtime.tensor_parallel.sharding import TensorShard


def _dcp():
    """``torch.distributed.checkpoint``, imported when a checkpoint is read or written: it takes
    half a second to import, which every ``planner`` command would otherwise pay."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _failures() -> tuple[type[BaseException], ...]:
    """What a failed DCP save or load raises: any error, and DCP's own ``CheckpointException``
    (a ``BaseException``). An ``except`` clause evaluates this only when something was raised."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


__all__ = [
    "CheckpointError",
    "StagedCheckpoint",
    "save",
    "stage",
    "write",
    "JoinGroups",
    "load",
    "load_latest",
    "newest",
    "list_checkpoints",
    "read_meta",
    "load_model_tensors",
]

_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_KINDS = ("model", "exp_avg", "exp_avg_sq")
_SHARD_KEYS = ("master", "exp_avg", "exp_avg_sq")
"""The tensors of an engine's ``state_dict()`` (lists, one per flat group)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (the message says which and why)."""


def _root_cause(e: BaseException) -> str:
    """One line: the underlying error of a (possibly wrapped, multi-rank) DCP failure."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = getattr(inner, "exc", inner) if not isinstance(inner, BaseException) else inner
        if isinstance(inner, BaseException):
            return _root_cause(inner)
        return str(inner).strip().splitlines()[-1]
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """Finished checkpoints as (step, path), oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        match = _STEP_DIR.match(name)
        path = os.path.join(directory, name)
        if match and os.path.isfile(os.path.join(path, "meta.json")):
            out.append((int(match.group(1)), path))
    return sorted(out)


def earlier(directory: str) -> str:
    """What a failed save leaves: the earlier checkpoints of ``directory``, intact, or none."""
    try:
        saved = list_checkpoints(directory)
    except OSError:
        saved = []
    if not saved:
        return "no earlier checkpoint was saved in it"
    return f"the earlier checkpoints are intact (the latest: step {saved[-1][0]})"


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({e}); delete it to fall back to an older one"
        ) from None


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(error: str, group=None) -> str:
    """Every rank of ``group`` (None: the default group) learns every rank's error (``""``: it
    succeeded): the errors joined, ``""`` when all succeeded. Collective."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return error
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return "; ".join(e for e in errors if e)


def _gather_to(obj: Any, group, dst: int) -> list | None:
    """gather_object onto global rank ``dst`` of ``group`` (a one-rank group: no communication)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


@dataclass(frozen=True)
class JoinGroups:
    """The process groups a checkpoint is joined and written on: ``world`` (None: the default
    group) coordinates the write, ``dp`` and ``tp`` join the ZeRO shards and the tensor-parallel
    pieces (the mesh's groups, or copies of them of the same members made for the writer thread)."""

    world: Any = None
    dp: Any = None
    tp: Any = None


def _by_name(full: dict, per_attr: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's tensors of a full (consolidated) engine state, by kind then name, into ``per_attr``."""
    for group_index, grp in enumerate(full["groups"]):
        off = 0
        for name, shape in zip(grp["names"], grp["shapes"]):
            n = 1
            for dim in shape:
                n *= dim
            for kind, key in zip(_KINDS, _SHARD_KEYS):
                per_attr[kind][name] = full[key][group_index][off : off + n].view(shape).clone()
            off += n
    return per_attr


def _joined_experts(parts: list, ep: int) -> dict[str, dict[str, torch.Tensor]]:
    """The full ``[E, ...]`` expert tensors, by kind then name, from every dp rank's
    ``(ep_index, state["experts"])``: the shards of each ep index consolidated over its
    expert-data-parallel ranks (ZeRO-0: any one of them holds it whole), then the ep indices'
    rows joined along dim 0 (``runtime.moe.expert_shards``)."""
    by_index: dict[int, list[dict]] = {}
    for ep_index, state in parts:
        by_index.setdefault(ep_index, []).append(state)
    if sorted(by_index) != list(range(ep)):
        raise CheckpointError(f"expert state of ep indices {sorted(by_index)} gathered, expected 0..{ep - 1}")
    slices = []
    for ep_index in range(ep):
        states = by_index[ep_index]
        full = states[0] if states[0]["num_shards"] == 1 else consolidate_shards(states)
        slices.append(_by_name(full, {k: {} for k in _KINDS}))
    return {
        kind: {name: expert_shards.join([piece[kind][name] for piece in slices]) for name in slices[0][kind]}
        for kind in _KINDS
    }


def _logical_state(local: dict, params: dict, mesh, groups: JoinGroups) -> dict[str, torch.Tensor] | None:
    """Full fp32 tensors of this rank's stage (or model chunks) by original name, on the (dp 0,
    tp 0) rank; else None. ``local``: the engine's ``state_dict()`` (this rank's shard); ``params``:
    ``runtime.stages.compiled_stages.rank_params``. Collective over ``groups.dp`` and ``groups.tp``.
    Under expert parallelism the expert parameters (``local["experts"]``) are gathered from every
    dp rank and joined into the full ``[E, ...]`` tensors, so they are saved once, whole."""
    experts = local.get("experts")
    dense = {k: value for k, value in local.items() if k != "experts"}
    gathered: list | None = [dense]  # ZeRO-0: every dp rank holds the full state already
    if dense["num_shards"] != 1:
        gathered = _gather_to(dense, groups.dp, mesh.dp_cp_ranks[0])
    expert_parts = _gather_to((mesh.ep_index, experts), groups.dp, mesh.dp_cp_ranks[0]) if experts else None
    if mesh.rank != mesh.dp_cp_ranks[0]:  # dp index 0 (and cp index 0): the first of the ranks sharing weights
        return None
    assert gathered is not None  # dp index 0 is the gather's destination
    per_attr = _by_name(consolidate_shards(gathered), {k: {} for k in _KINDS})
    if expert_parts is not None:
        for kind, tensors in _joined_experts(expert_parts, mesh.ep).items():
            per_attr[kind].update(tensors)
    pieces = _gather_to(per_attr, groups.tp, mesh.tp_ranks[0]) if mesh.tp > 1 else [per_attr]
    if mesh.tp_index != 0:
        return None
    assert pieces is not None  # tp index 0 is the gather's destination
    out: dict[str, torch.Tensor] = {}
    for attr, (index, entry) in params.items():
        if not entry.get("trainable", True):
            continue
        if entry.get("tied") and entry["tied"][0] != index:
            continue  # a tied weight's copy: its first holder writes it (the copies are identical)
        for kind in _KINDS:
            shard = TensorShard.from_dict(entry.get("shard"))
            joined = [piece[kind][attr] for piece in pieces]
            out[f"{kind}/{entry['fqn']}"] = joined[0] if shard is None else shard.join(joined)
    return out


def _compression_state(engine) -> dict[str, torch.Tensor]:
    """Copies of this rank's 1-bit Adam error buffers (``ZeroEngine.compression_state``), on the host."""
    state = engine.compression_state() if hasattr(engine, "compression_state") else {}
    return {k: tensor.detach().to("cpu", copy=True) for k, tensor in state.items()}


def _rng_state(device) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if device is not None and torch.device(device).type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


@dataclass
class StagedCheckpoint:
    """One rank's part of a checkpoint, copied to host memory by ``stage`` and written by ``write``
    (in line, or by ``runtime.checkpointing.background_writer`` in a thread while training goes on)."""

    directory: str
    """The checkpoint folder (``step-N`` is created in it)."""
    step: int
    """The steps done (the data position)."""
    state: dict[str, torch.Tensor]
    """This rank's own tensors by DCP key (generator states, error buffers), host copies."""
    local: dict
    """A host copy of this rank's shard of the optimizer state (the engine's ``state_dict()``), joined
    into the logical tensors when written (``write``)."""
    params: dict
    """This rank's parameters (``runtime.stages.compiled_stages.rank_params``)."""
    mesh: Any
    """The run's mesh (this rank's coordinates and groups' members)."""
    meta: dict
    """The fields of ``meta.json`` known when staging (rank 0's are the ones written)."""
    compression_shapes: dict[str, list[int]]
    """This rank's 1-bit Adam error buffers' shapes (restored only under the same plan)."""
    keep_last: int
    """Complete checkpoints kept in ``directory`` once this one is published."""

    @property
    def tmp(self) -> str:
        return os.path.join(self.directory, f".tmp-step-{self.step:06d}")

    @property
    def final(self) -> str:
        return os.path.join(self.directory, f"step-{self.step:06d}")


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory. The staged tensors are already private copies (the generator
    states and error buffers are copied), so a host tensor is kept as is, a device tensor copied."""
    return tensor.detach().cpu()


def _prepare_folder(directory: str, step: int) -> None:
    """Rank 0 creates ``.tmp-step-N`` (removing any left by an interrupted save); every rank
    learns whether it could (collective, on the training process group)."""
    rank, _ = _world()
    tmp = os.path.join(directory, f".tmp-step-{step:06d}")
    err = ""
    try:
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
            for name in os.listdir(directory):
                if name.startswith(".tmp-step-"):
                    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            os.makedirs(tmp)
    except OSError as e:
        err = f"cannot create {tmp}: {e}"
    err = _agree(err)
    if err:
        raise CheckpointError(f"saving checkpoint step {step} in {directory} failed ({err}); {earlier(directory)}")


def stage(
    directory: str, step: int, engine, man: dict, mesh, keep_last: int = 2, schedule: dict | None = None
) -> StagedCheckpoint:
    """In line with training: create the folder (collective, on the training process group) and
    copy this rank's state to host memory: its shard of masters and moments (the engine's
    ``state_dict()``, a host copy), its generator states and error buffers. Training may change the
    engine's state as soon as this returns; ``write`` joins and writes the copy. ``directory`` ""
    stages without a folder (a snapshot kept in memory)."""
    rank, world = _world()
    if directory:  # "": a snapshot kept in memory only
        _prepare_folder(directory, step)
    local = engine.state_dict()  # a host copy (runtime.data_parallel.flat_shards.export_state)
    state: dict[str, torch.Tensor] = {f"rng/{rank}/{k}": tensor for k, tensor in _rng_state(engine.device).items()}
    compression = _compression_state(engine)
    state.update({f"compression/{rank}/{k}": tensor for k, tensor in compression.items()})
    meta = {
        "step": step,
        "optimizer_step": int(local["step"]),
        "plan_hash": man["plan_hash"],
        "plan": man["plan"],
        "model": man["model"],
        "world_size": world,
        "schedule": schedule,
        "loss_scaler": engine.scaler.state_dict() if getattr(engine, "scaler", None) is not None else None,
    }
    return StagedCheckpoint(
        directory=directory,
        step=step,
        state={k: _to_host(tensor) for k, tensor in state.items()},
        local=local,
        params=rank_params(man, mesh.pp_index),
        mesh=mesh,
        meta=meta,
        compression_shapes={k: list(tensor.shape) for k, tensor in compression.items()},
        keep_last=keep_last,
    )


def write(staged: StagedCheckpoint, groups: JoinGroups, after_data: Callable[[int], None] | None = None) -> str:
    """Collective over ``groups``: join the staged shards into the logical tensors (over
    ``groups.dp``, then ``groups.tp``) and write them with DCP into ``.tmp-step-N`` (coordinated on
    ``groups.world``); once every rank succeeded, rank 0 writes ``meta.json`` and renames the
    folder to ``step-N`` (the atomic marker ``list_checkpoints`` trusts), then drops the
    checkpoints beyond ``keep_last``. ``after_data(step)`` runs once this rank's data are written
    (a fault-injection point). Raises ``CheckpointError`` on every rank alike when any rank
    failed; the earlier checkpoints stay. ``staged`` is left as it was (a snapshot keeps it)."""
    rank, _ = _world()
    tmp, final, step = staged.tmp, staged.final, staged.step
    group = groups.world
    logical = _logical_state(staged.local, staged.params, staged.mesh, groups) or {}
    shapes = {k: list(tensor.shape) for k, tensor in logical.items()}
    err = ""
    try:
        state = {**staged.state, **logical}
        _dcp().save(state, checkpoint_id=tmp, process_group=group, no_dist=not dist.is_initialized())
        if after_data is not None:
            after_data(step)
    except _failures() as e:  # noqa: BLE001 - full disk, permissions: same ending
        err = f"rank {rank}: {_root_cause(e)}"
    # Everyone learns of any failure; only then is the checkpoint published.
    err = _agree(err, group)
    if err:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {final} failed ({err}); {earlier(os.path.dirname(final))}")
    everyone = _gather_to((shapes, staged.meta["optimizer_step"], staged.compression_shapes), group, 0)
    if rank == 0:
        assert everyone is not None  # rank 0 is the gather's destination
        try:
            _publish(staged, everyone)
        except OSError as e:
            err = f"{e.filename or tmp}: {e.strerror or e}"
            shutil.rmtree(tmp, ignore_errors=True)
    err = _agree(err, group)
    if err:
        raise CheckpointError(f"publishing checkpoint {final} failed ({err}); {earlier(os.path.dirname(final))}")
    return final


def _publish(staged: StagedCheckpoint, everyone: list) -> None:
    """Rank 0: ``meta.json`` (every rank's shapes merged) last inside the folder, the rename, then
    retention (only complete checkpoints count; the newest is always kept)."""
    merged: dict[str, list[int]] = {}
    counts: set[int] = set()
    compression_shapes: dict[str, dict] = {}
    for source_rank, (shapes_of_rank, count, compression_of_rank) in enumerate(everyone):
        merged.update(shapes_of_rank)
        if count is not None:
            counts.add(count)
        if compression_of_rank:
            compression_shapes[str(source_rank)] = compression_of_rank
    meta = dict(staged.meta, optimizer_step=max(counts) if counts else 0)
    meta.update(tensors=merged, compression=compression_shapes)
    with open(os.path.join(staged.tmp, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    if os.path.exists(staged.final):  # re-saving a step (after a resume): replace it
        shutil.rmtree(staged.final)
    os.replace(staged.tmp, staged.final)
    for _, old in list_checkpoints(staged.directory)[: -max(1, staged.keep_last)]:
        shutil.rmtree(old, ignore_errors=True)


def save(directory: str, step: int, engine, man: dict, mesh, keep_last: int = 2, schedule: dict | None = None) -> str:
    """Write checkpoint ``step`` collectively and synchronously (``stage`` then ``write`` on the
    training process group); return its path. Older ones beyond ``keep_last`` go. ``schedule``
    (the learning-rate schedule's settings) is recorded in the meta for resumes."""
    staged = stage(directory, step, engine, man, mesh, keep_last=keep_last, schedule=schedule)
    return write(staged, JoinGroups(dp=mesh.dp_cp_group, tp=mesh.tp_group))


def _check_same_model(meta: dict, man: dict, path: str) -> None:
    saved, planned = meta.get("model", {}), man["model"]
    if saved.get("spec") != planned["spec"] or saved.get("sizes") != planned["sizes"]:
        raise CheckpointError(
            f"checkpoint {path} is from model {saved.get('spec')!r} {saved.get('sizes')}, but this plan trains "
            f"{planned['spec']!r} {planned['sizes']}; point --checkpoint-dir at this model's checkpoints"
        )


def newest(directories: dict[str, str | None]) -> tuple[int, str, str] | None:
    """The newest complete checkpoint over ``directories`` (``{source: folder}``, e.g. checkpoint and
    snapshot; None folders skipped) as (step, path, source); on equal steps the first source wins.
    None when there is none."""
    best: tuple[int, str, str] | None = None
    for source, directory in directories.items():
        found = list_checkpoints(directory) if directory else []
        if found and (best is None or found[-1][0] > best[0]):
            best = (found[-1][0], found[-1][1], source)
    return best


def load_latest(directory: str, engine, man: dict, mesh) -> int:
    """Restore the newest checkpoint of ``directory`` into ``engine``; return its step (0 if there is none)."""
    found = list_checkpoints(directory)
    return load(found[-1][1], engine, man, mesh) if found else 0


def load(path: str, engine, man: dict, mesh) -> int:
    """Restore the checkpoint at ``path`` into ``engine`` (collective); return its step."""
    meta = read_meta(path)
    step = int(meta["step"])
    _check_same_model(meta, man, path)
    params = rank_params(man, mesh.pp_index)
    rank, world = _world()
    same_plan = meta.get("plan_hash") == man["plan_hash"] and meta.get("world_size") == world
    want: dict[str, torch.Tensor] = {}
    for _, entry in params.values():
        if not entry.get("trainable", True):
            continue
        for kind in _KINDS:
            key = f"{kind}/{entry['fqn']}"
            if key not in meta["tensors"]:
                raise CheckpointError(f"checkpoint {path} has no tensor {key}; it was saved from another model")
            want[key] = torch.empty(meta["tensors"][key], dtype=torch.float32)
    rng = {}
    if same_plan:
        rng = {f"rng/{rank}/{k}": tensor.clone() for k, tensor in _rng_state(engine.device).items()}
        for k, shape in meta.get("compression", {}).get(str(rank), {}).items():
            rng[f"compression/{rank}/{k}"] = torch.empty(shape, dtype=torch.float32)
    try:
        _dcp().load({**want, **rng}, checkpoint_id=path, no_dist=not dist.is_initialized())
    except _failures() as e:  # noqa: BLE001
        raise CheckpointError(
            f"checkpoint {path} is corrupt or incomplete ({_root_cause(e)}); delete it to resume from an older one"
        ) from None
    # Build this rank's full (unsharded over dp) engine state from the logical tensors.
    layout = engine.state_layout()  # no tensors: an offloaded state is not read for its layout
    by_attr = {name: entry for name, (_, entry) in params.items()}
    full = _full_state(layout, want, by_attr, mesh, int(meta["optimizer_step"]))
    full["loss_scaler"] = meta.get("loss_scaler")
    if "experts" in layout:
        full["experts"] = _full_state(layout["experts"], want, by_attr, mesh, int(meta["optimizer_step"]))
    engine.load_state_dict(full)
    if same_plan:
        prefix = f"compression/{rank}/"
        engine.load_compression_state({k[len(prefix) :]: t for k, t in rng.items() if k.startswith(prefix)})
        torch.set_rng_state(rng[f"rng/{rank}/cpu"])
        if f"rng/{rank}/cuda" in rng:
            torch.cuda.set_rng_state(rng[f"rng/{rank}/cuda"], engine.device)
    return step


def _full_state(layout: dict, want: dict[str, torch.Tensor], by_attr: dict, mesh, step: int) -> dict:
    """A full (``num_shards == 1``) engine state of ``layout``'s groups from the logical tensors:
    each cut to this rank's rows of the experts (a routed expert parameter) and its tp piece."""
    full = {k: value for k, value in layout.items() if k != "experts"}
    full.update(format=FORMAT, num_shards=1, shard_index=0, step=step)
    for kind, key in zip(_KINDS, _SHARD_KEYS):
        flats = []
        for grp in layout["groups"]:
            parts = []
            for name in grp["names"]:
                entry = by_attr[name]
                tensor = want[f"{kind}/{entry['fqn']}"]
                if expert_shards.is_expert(entry):
                    tensor = expert_shards.cut(tensor, mesh.ep_index, mesh.ep, entry["fqn"])
                shard = TensorShard.from_dict(entry.get("shard"))
                parts.append((tensor if shard is None else shard.cut(tensor, mesh.tp_index, mesh.tp)).reshape(-1))
            flats.append(torch.cat(parts) if parts else torch.zeros(0))
        full[key] = flats
    return full


def load_model_tensors(path: str) -> dict[str, torch.Tensor]:
    """The consolidated fp32 weights of a checkpoint by original name (no process group needed)."""
    meta = read_meta(path)
    want = {
        k: torch.empty(shape, dtype=torch.float32) for k, shape in meta["tensors"].items() if k.startswith("model/")
    }
    try:
        with warnings.catch_warnings():  # torch warns that it loads in one process: that is the intent
            warnings.filterwarnings(
                "ignore", message="torch.distributed is (disabled, )?unavailable", category=UserWarning
            )
            _dcp().load(want, checkpoint_id=path, no_dist=True)
    except _failures() as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path} is corrupt or incomplete ({_root_cause(e)})") from None
    return {k[len("model/") :]: tensor for k, tensor in want.items()}
