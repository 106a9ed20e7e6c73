"""The pre-flight exchange a pipeline runs before its first send.

All stages of the pipeline exchange one small all-reduce: a table with a row per model chunk,
each row ``[error code, micro-batch count, offending micro-batch, offending input, number of
received tensors, (dtype code, flags, ndim, dims...) per received tensor]`` (flags: 1 requires
grad, 2 split over the tensor-parallel group); row
``c < p`` (local chunk 0) carries its rank's error code, every row its chunk's ``recv_meta``.
Fewer micro-batches than stages, micro-batch inputs whose shapes or dtypes differ, a malformed
action list, or stages that disagree on the micro-batch count then raise :class:`PipelineError`
on *every* rank instead of leaving a neighbour blocked in a receive. Each stage also learns its
successor's ``recv_meta`` (its ``send_metas``), against which it checks every output before
sending it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from runtime.contract.schedule_ir import Action, ScheduleError, validate_rank
from runtime.distributed import comm
from runtime.pipeline.boundary import BOUNDARY_DTYPES, PipelineError, TensorMeta, describe
from runtime.pipeline.placement import StagePlacement

__all__ = ["MAX_TENSORS", "MAX_DIMS", "META_ROW", "exchange", "local_check", "LocalCheck"]

#: Width limits of the pre-flight encoding of a ``recv_meta``.
MAX_TENSORS = 8
MAX_DIMS = 6
_HEAD = 5  # code, num_microbatches, bad micro-batch, bad input, number of received tensors
_SLOT = 3 + MAX_DIMS  # dtype code, flags (1: requires_grad, 2: split), ndim, dims
META_ROW = _HEAD + MAX_TENSORS * _SLOT

# pre-flight error codes
_OK, _FEW_MB, _SHAPES, _SCHEDULE, _META, _NO_MB = 0, 1, 2, 3, 4, 5
_CODE_PROBLEMS = {
    _SCHEDULE: "its action list is invalid",
    _META: "its recv_meta is too large to exchange",
    _NO_MB: "no micro-batches were given",
}

#: Chunk-local inputs: ``extras[i][j]`` is local chunk ``j``'s own inputs for micro-batch ``i``.
Extras = list[list[tuple]]


@dataclass(frozen=True)
class LocalCheck:
    """The outcome of this rank's own checks."""

    code: int = _OK
    """Pre-flight error code (``_OK`` when every check passed)."""
    bad_micro_batch: int = -1
    """The offending micro-batch, or -1."""
    bad_input: int = -1
    """The offending input of that micro-batch, or -1."""
    message: str = ""
    """What is wrong, for this rank's own error."""


def _compare_micro_batches(extras: Extras) -> LocalCheck:
    """Every micro-batch's inputs against micro-batch 0's: count, shapes and dtypes."""
    flat = [tuple(tensor for chunk in inputs for tensor in chunk) for inputs in extras]
    reference = flat[0]
    for i, inputs in enumerate(flat[1:], start=1):
        if len(inputs) != len(reference) or [len(chunk) for chunk in extras[i]] != [len(chunk) for chunk in extras[0]]:
            return LocalCheck(
                _SHAPES, i, -1, f"micro-batch {i} has {len(inputs)} inputs but micro-batch 0 has {len(reference)}"
            )
        for j, (given, expected) in enumerate(zip(inputs, reference)):
            same = (
                given.shape == expected.shape and given.dtype == expected.dtype
                if isinstance(given, torch.Tensor) and isinstance(expected, torch.Tensor)
                else type(given) is type(expected)
            )
            if not same:
                return LocalCheck(
                    _SHAPES,
                    i,
                    j,
                    f"input {j} of micro-batch {i} is {describe(given)} but micro-batch 0's is "
                    f"{describe(expected)}: every micro-batch must have the same shapes and dtypes "
                    f"(pad, or drop the last partial batch)",
                )
    return LocalCheck()


def local_check(
    placement: StagePlacement, recv_metas: list[tuple[TensorMeta, ...]], actions: Sequence[Action], extras: Extras
) -> LocalCheck:
    """This rank's own checks, before anything is exchanged."""
    micro_batch_count, stages = len(extras), placement.num_stages
    if micro_batch_count == 0:
        return LocalCheck(_NO_MB, message="no micro-batches were given")
    if micro_batch_count < stages:
        return LocalCheck(
            _FEW_MB,
            message=(
                f"{micro_batch_count} micro-batch{'es' if micro_batch_count != 1 else ''} for {stages} pipeline stages: a pipeline needs at least "
                f"as many micro-batches as stages (use a smaller micro-batch size or fewer stages)"
            ),
        )
    compared = _compare_micro_batches(extras)
    if compared.code != _OK:
        return compared
    if any(len(metas) > MAX_TENSORS or any(len(meta.shape) > MAX_DIMS for meta in metas) for metas in recv_metas):
        return LocalCheck(_META, message=f"recv_meta has more than {MAX_TENSORS} tensors or {MAX_DIMS} dims")
    try:
        validate_rank(actions, placement.stage_index, stages, micro_batch_count, placement.virtual_stages)
    except ScheduleError as error:
        return LocalCheck(_SCHEDULE, message=f"invalid action list: {error}")
    return LocalCheck()


def _encode(check: LocalCheck, micro_batch_count: int, metas: tuple[TensorMeta, ...]) -> list[int]:
    row = [check.code, micro_batch_count, check.bad_micro_batch, check.bad_input, len(metas)] + [0] * (
        MAX_TENSORS * _SLOT
    )
    if check.code != _META:
        for k, meta in enumerate(metas):
            start = _HEAD + k * _SLOT
            flags = int(bool(meta.requires_grad)) | int(meta.split) << 1
            row[start : start + 3] = [BOUNDARY_DTYPES.index(meta.dtype), flags, len(meta.shape)]
            row[start + 3 : start + 3 + len(meta.shape)] = list(meta.shape)
    return row


def _decode_meta(row: list[int]) -> tuple[TensorMeta, ...]:
    metas = []
    for k in range(row[4]):
        start = _HEAD + k * _SLOT
        dtype_code, flags, ndim = row[start : start + 3]
        shape = tuple(row[start + 3 : start + 3 + ndim])
        metas.append(TensorMeta(shape, BOUNDARY_DTYPES[dtype_code], bool(flags & 1), bool(flags & 2)))
    return tuple(metas)


def _problems(rows: list[list[int]], stage: int, check: LocalCheck) -> list[str]:
    """The refusal's lines: one per stage whose row carries an error, or the count disagreement."""
    stages = len(rows)
    problems = []
    for other, row in enumerate(rows):
        if other == stage and check.code != _OK:
            problems.append(f"stage {stage} (this rank): {check.message}")
        elif row[0] == _FEW_MB:
            problems.append(
                f"stage {other}: {row[1]} micro-batch{'es' if row[1] != 1 else ''} for {stages} stages "
                f"(need at least {stages})"
            )
        elif row[0] == _SHAPES:
            problems.append(
                f"stage {other}: input {row[3]} of micro-batch {row[2]} differs in shape or dtype from micro-batch 0"
            )
        elif row[0] != _OK:
            problems.append(f"stage {other}: " + _CODE_PROBLEMS[row[0]])
    counts = {row[1] for row in rows if row[0] not in (_NO_MB,)}
    if not problems and len(counts) > 1:
        problems.append(
            "stages disagree on the number of micro-batches: "
            + ", ".join(f"stage {other} has {row[1]}" for other, row in enumerate(rows))
        )
    return problems


def exchange(
    placement: StagePlacement,
    recv_metas: list[tuple[TensorMeta, ...]],
    actions: Sequence[Action],
    extras: Extras,
    device: torch.device,
) -> list[tuple[TensorMeta, ...] | None]:
    """Run the checks and the exchange; raise :class:`PipelineError` on every rank if any stage
    failed one. Returns each local chunk's successor's ``recv_meta`` (``None`` for the last chunk)."""
    check = local_check(placement, recv_metas, actions, extras)
    stages, chunks = placement.num_stages, placement.virtual_stages
    send_metas: list[tuple[TensorMeta, ...] | None] = [None] * chunks
    if stages == 1:
        if check.code != _OK:
            raise PipelineError(f"pipeline stage 0: {check.message}")
        return send_metas
    table = torch.zeros(stages * chunks, META_ROW, dtype=torch.int64, device=device)
    for j in range(chunks):
        row = _encode(check if j == 0 else replace(check, code=_OK), len(extras), recv_metas[j])
        table[placement.model_chunk(j)] = torch.tensor(row, dtype=torch.int64)
    comm.all_reduce(table, group=placement.pp_group)
    rows = table.cpu().tolist()
    problems = _problems(rows[:stages], placement.stage_index, check)
    if problems:
        raise PipelineError("pipeline refused to start (nothing was sent):\n  " + "\n  ".join(problems))
    for j in range(chunks):
        if not placement.holds_last(j):
            send_metas[j] = _decode_meta(rows[placement.model_chunk(j) + 1])
    return send_metas
