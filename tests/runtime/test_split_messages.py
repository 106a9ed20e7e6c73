"""Split pipeline messages (``runtime.pipeline.transport``): a tensor every tensor-parallel rank
of a stage holds whole leaves each as its ``1 / tp`` slice and arrives whole, gathered over the
receivers' tensor-parallel group; the bytes each rank counts are those of one whole send.

Four gloo ranks: 2 stages x tp 2 (stage 0: ranks 0, 1; stage 1: ranks 2, 3)."""

from __future__ import annotations

import json
import traceback

import pytest
import torch
from torch.testing import assert_close

from runtime.distributed import comm
from runtime.distributed.launch import launch_local
from runtime.distributed.mesh import setup_mesh
from runtime.pipeline.boundary import TensorMeta
from runtime.pipeline.transport import StageTransport

WORLD = 4
#: (shape, dtype, split): an activation tp divides, an integer mask, one whose size tp does not
#: divide (sent whole, as without the flag) and one not marked.
MESSAGE = (
    ((2, 6, 4), torch.float32, True),
    ((2, 6), torch.int64, True),
    ((3, 5), torch.float32, True),
    ((2, 4), torch.float32, False),
)


def _message() -> list[torch.Tensor]:
    torch.manual_seed(7)  # the same on every rank: the tp ranks of a stage hold the same tensors
    return [
        torch.randint(0, 9, shape) if dtype == torch.int64 else torch.randn(shape, dtype=dtype)
        for shape, dtype, _ in MESSAGE
    ]


def _exchange(rank: int) -> dict:
    mesh = setup_mesh(2, 1, 2)
    transport = StageTransport(mesh.pp_group, torch.device("cpu"), mesh.tp_group)
    metas = [TensorMeta(shape, dtype, False, split) for shape, dtype, split in MESSAGE]
    expected = _message()
    comm.STATS.reset()
    if mesh.pp_index == 0:
        transport.start()
        transport.isend(expected, mesh.pp_ranks[1], metas)
        transport.finish()
    else:
        received = transport.wait_recv(transport.post_recv(metas, mesh.pp_ranks[0]))
        for got, want in zip(received, expected):
            assert_close(got, want, rtol=0, atol=0)
    return {"bytes": dict(comm.STATS.bytes_by_kind), "calls": dict(comm.STATS.calls_by_kind)}


def _worker(rank, world, out_dir):
    try:
        verdict = {"ok": True, **_exchange(rank)}
    except Exception:  # reported by the test, with the rank
        verdict = {"ok": False, "error": traceback.format_exc()}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(verdict, f)


@pytest.mark.dist
def test_split_messages_arrive_whole_and_count_a_whole_send(tmp_path):
    launch_local(_worker, WORLD, args=(str(tmp_path),), timeout_s=120, collective_timeout_s=60)
    verdicts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, verdict in enumerate(verdicts):
        assert verdict["ok"], f"rank {rank}:\n{verdict.get('error')}"
    whole = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype, _ in MESSAGE]
    split = [nbytes // 2 for nbytes in whole[:2]]  # the two that 2 divides
    for sender in verdicts[:2]:  # a half of each split tensor, the others whole
        assert sender["bytes"] == {"send": sum(split) + whole[2] + whole[3]}
        assert sender["calls"] == {"send": 4}
    for receiver in verdicts[2:]:  # the other half, gathered: a ring all-gather sends (n-1)/n of it
        assert receiver["bytes"] == {"all_gather": sum(split), "recv": 0}
        assert receiver["calls"] == {"all_gather": 2, "recv": 4}
