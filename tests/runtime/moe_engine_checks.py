"""The ZeRO engine with expert parameters, run inside ``test_moe_dispatch``'s 4-rank launch: a tiny
MoE network (input projection, a router + routed experts layer through ``runtime.moe``'s dispatch
and combine, a head) trained for a few steps at dp4 ep2, dp4 ep4 and dp2 tp2 ep2 (the net replicated over tp) under ZeRO 0-3 (and at dp4 ep2 with the optimizer
state, and at ZeRO 3 the parameters, offloaded to host memory), against plain
torch AdamW with ``clip_grad_norm_`` on the full batch in one process with every expert: losses,
gradient norms (each expert counted once) and final weights (dense whole, experts this rank's
slice) at rtol 1e-5. Also: a checkpoint's expert state joined from the ep ranks and cut again for
another ep degree (``runtime.moe.expert_shards``)."""

from __future__ import annotations

import contextlib
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

from runtime.checkpointing import checkpoint_io
from runtime.data_parallel.offload_engine import OffloadConfig
from runtime.data_parallel.zero_engine import OptimizerConfig, ParallelContext, ShardingConfig, ZeroEngine
from runtime.distributed.mesh import Mesh, get_mesh, set_mesh, setup_mesh
from runtime.moe import combine, dispatch, expert_slice
from runtime.portable import grouped_mm

IN, H, FF, E, TOP_K = 6, 8, 5, 4, 2
BATCH, TOKENS, MICRO, STEPS = 8, 3, 2, 3
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
MAX_NORM = 0.3
RTOL = dict(rtol=1e-5, atol=1e-6)
EXPERTS = frozenset({"moe.w1", "moe.w2"})


class MoE(nn.Module):
    """Router (linear, softmax, top-k), ``experts`` of the ``E`` routed experts as [experts, ...]
    weights (this rank's slice under expert parallelism), grouped products between dispatch and combine."""

    def __init__(self, experts: int):
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, H, FF) / 3)
        self.w2 = nn.Parameter(torch.randn(experts, FF, H) / 3)

    def forward(self, x):
        tokens = self.ln(x).reshape(-1, H)
        top_w, top_i = torch.topk(torch.softmax(self.router(tokens), -1), TOP_K, dim=-1)
        sorted_ids, perm = torch.sort(top_i.reshape(-1), stable=True)
        rows = tokens[perm // TOP_K]
        local_rows, offs, routing = dispatch(rows, torch.histc(sorted_ids.float(), E, 0, E - 1), E)
        out = combine(grouped_mm(F.silu(grouped_mm(local_rows, self.w1, offs)), self.w2, offs), routing)
        weighted = out * top_w.reshape(-1)[perm].unsqueeze(-1)
        mixed = tokens.new_zeros(tokens.shape[0] * TOP_K, H).index_copy(0, perm, weighted)
        return x + mixed.view(-1, TOP_K, H).sum(1).view(x.shape)


class Net(nn.Module):
    def __init__(self, experts: int = E):
        super().__init__()
        self.inp = nn.Linear(IN, H)
        self.moe = MoE(experts)
        self.head = nn.Linear(H, 1)

    def forward(self, x, y):
        return ((self.head(self.moe(self.inp(x))).squeeze(-1) - y) ** 2).mean()


def make_net(ep: int = 1, ep_index: int = 0) -> Net:
    """The same initial weights at any ep: the full net is built, then the experts cut to the slice."""
    torch.manual_seed(0)
    net = Net()
    if ep > 1:
        own = expert_slice(E, ep, ep_index)
        local = Net(E // ep)
        state = {k: (v[own] if k in EXPERTS else v) for k, v in net.state_dict().items()}
        local.load_state_dict(state)
        net = local
    return net


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(BATCH, TOKENS, IN, generator=g), torch.randn(BATCH, TOKENS, generator=g)


@contextlib.contextmanager
def one_process():
    """The reference runs with every expert local: a one-rank mesh, the real one restored after."""
    mesh = get_mesh()
    set_mesh(Mesh(1, 1, 1))
    try:
        yield
    finally:
        set_mesh(mesh)


def reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Plain torch on the full batch: losses, gradient norms before clipping, final weights."""
    with one_process():
        net = make_net()
        opt = torch.optim.AdamW(net.parameters(), **HP)
        losses, norms = [], []
        for s in range(STEPS):
            x, y = data(s)
            opt.zero_grad()
            loss = net(x, y)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)))
            opt.step()
            losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in net.named_parameters()}


def layers(net: Net) -> list[list[str]]:
    names = [n for n, _ in net.named_parameters()]
    return [[n for n in names if n.startswith(head)] for head in ("inp.", "moe.", "head.")]


def train(
    zero_stage: int, offload: OffloadConfig | None = None
) -> tuple[list[float], list[float], dict[str, torch.Tensor], ZeroEngine]:
    """The engine at the current mesh (``offload``: its state in host memory): this rank's slice of
    each batch in ``MICRO`` micro-batches; losses averaged over dp."""
    mesh = get_mesh()
    net = make_net(mesh.ep, mesh.ep_index)
    engine = ZeroEngine(
        net,
        layers=layers(net),
        dp_group=mesh.dp_group,
        sharding=ShardingConfig(zero_stage=zero_stage, micro_batches_per_step=MICRO),
        optimizer=OptimizerConfig(**HP, max_grad_norm=MAX_NORM),
        parallel=ParallelContext(
            expert_params=EXPERTS,
            # tp > 1: every weight of this net is replicated over tp, counted once in the norm
            norm_groups=[mesh.tp_group] if mesh.tp > 1 else (),
            replicated_param_filter=(lambda name: True) if mesh.tp > 1 else None,
        ),
        offload=offload,
    )
    per = BATCH // mesh.dp
    rows = slice(mesh.dp_index * per, (mesh.dp_index + 1) * per)
    losses, norms = [], []
    for s in range(STEPS):
        x, y = (t[rows] for t in data(s))
        total = torch.zeros(())
        for i in range(MICRO):
            part = slice(i * per // MICRO, (i + 1) * per // MICRO)
            loss = engine.module(x[part], y[part]) / MICRO
            loss.backward()
            total += loss.detach()
        norms.append(engine.step().grad_norm)
        engine.zero_grad()
        dist.all_reduce(total, group=mesh.dp_group)
        losses.append(float(total) / mesh.dp)
    return losses, norms, engine.full_state_dict(), engine


def check_engine(zero_stage: int, offload: OffloadConfig | None = None) -> None:
    ref_losses, ref_norms, ref_params = reference()
    losses, norms, params, engine = train(zero_stage, offload)
    mesh = get_mesh()
    assert engine.edp == mesh.dp // mesh.ep and sum(g.expert for g in engine.groups) == 1
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), **RTOL)
    assert_close(torch.tensor(norms), torch.tensor(ref_norms), **RTOL)
    own = expert_slice(E, mesh.ep, mesh.ep_index)
    for name, value in ref_params.items():
        assert_close(params[name], value[own] if name in EXPERTS else value, **RTOL, msg=f"{name}")
    engine.close()


def manifest() -> dict:
    """A compiled manifest by hand: one stage, the engine names as attributes, the routed experts
    marked ``"expert": true`` with their full ``[E, ...]`` shape (what ``planner compile`` writes)."""
    params = {}
    for name, value in make_net().named_parameters():
        params[name] = {"fqn": f"model.{name}", "shape": list(value.shape)}
        if name in EXPERTS:
            params[name]["expert"] = True
    return {
        "plan_hash": "moe-checks",
        "plan": {"pp": 1, "dp": 4, "tp": 1, "expert_parallel": 2},
        "model": {"spec": "moe-checks", "sizes": {}},
        "expert_parallel": {"degree": 2, "experts": E, "capacity_factor": None},
        "stages": [{"index": 0, "params": params}],
    }


def _engine(zero_stage: int) -> ZeroEngine:
    mesh = get_mesh()
    net = make_net(mesh.ep, mesh.ep_index)
    return ZeroEngine(
        net,
        layers=layers(net),
        dp_group=mesh.dp_group,
        sharding=ShardingConfig(zero_stage=zero_stage),
        optimizer=OptimizerConfig(**HP),
        parallel=ParallelContext(expert_params=EXPERTS if mesh.ep > 1 else frozenset()),
    )


def _saved(path: str) -> dict[str, torch.Tensor]:
    """Every logical tensor of a checkpoint (weights and AdamW moments) by key."""
    import torch.distributed.checkpoint as dcp

    meta = checkpoint_io.read_meta(path)
    want = {k: torch.empty(shape) for k, shape in meta["tensors"].items()}
    dcp.load(want, checkpoint_id=path)
    return want


def check_checkpoint(out_dir: str) -> None:
    """Trained at dp4 ep2 (ZeRO 2), saved: each expert saved once, whole, equal to the trained
    slices joined; loaded at ep1 (ZeRO 3) and at ep4 (ZeRO 0), each saved again: the same
    tensors (weights and moments) as the ep2 checkpoint."""
    man = manifest()
    setup_mesh(1, 4, 1, ep=2)
    _, _, params, engine = train(2)
    first = checkpoint_io.save(f"{out_dir}/ck_ep2", STEPS, engine, man, get_mesh())
    engine.close()
    saved = _saved(first)
    assert saved["model/model.moe.w1"].shape == (E, H, FF)
    own = expert_slice(E, 2, get_mesh().ep_index)
    for name, value in params.items():
        assert_close(saved[f"model/model.{name}"][own] if name in EXPERTS else saved[f"model/model.{name}"], value)
    for ep, zero_stage in ((1, 3), (4, 0)):
        setup_mesh(1, 4, 1, ep=ep)
        engine = _engine(zero_stage)
        man["plan"]["expert_parallel"] = man["expert_parallel"]["degree"] = ep
        assert checkpoint_io.load(first, engine, man, get_mesh()) == STEPS
        again = _saved(checkpoint_io.save(f"{out_dir}/ck_ep{ep}", STEPS, engine, man, get_mesh()))
        engine.close()
        assert sorted(again) == sorted(k for k in saved if not k.startswith("rng/"))
        for key, value in again.items():
            assert_close(value, saved[key], rtol=0, atol=0, msg=f"ep{ep}: {key}")


MESHES = {"dp4_ep2": (4, 1, 2), "dp4_ep4": (4, 1, 4), "dp2_tp2_ep2": (2, 2, 2)}
OFFLOADED = {  # dp4 ep2: ZeRO stage and where the state lives
    "zero1_optimizer_cpu": (1, OffloadConfig(optimizer="cpu")),
    "zero3_optimizer_and_params_cpu": (3, OffloadConfig(optimizer="cpu", params="cpu")),
}
CASES = (
    [f"engine/{m}/zero{z}" for m in MESHES for z in range(4)]
    + [f"engine/dp4_ep2/{name}" for name in OFFLOADED]
    + ["checkpoint/ep2_to_ep1_and_ep4"]
)


def run_all(rank: int, world: int, verdicts: dict, out_dir: str) -> None:
    """Every case of this module on the launch's ranks; a traceback per failed case."""
    for name, (dp, tp, ep) in MESHES.items():
        setup_mesh(1, dp, tp, ep=ep)
        for stage in range(4):
            try:
                check_engine(stage)
                verdicts[f"engine/{name}/zero{stage}"] = "ok"
            except Exception:  # recorded per case so one failure does not hide the others
                verdicts[f"engine/{name}/zero{stage}"] = traceback.format_exc()
    setup_mesh(1, 4, 1, ep=2)
    for name, (stage, offload) in OFFLOADED.items():
        try:
            check_engine(stage, offload)
            verdicts[f"engine/dp4_ep2/{name}"] = "ok"
        except Exception:
            verdicts[f"engine/dp4_ep2/{name}"] = traceback.format_exc()
    try:
        check_checkpoint(out_dir)
        verdicts["checkpoint/ep2_to_ep1_and_ep4"] = "ok"
    except Exception:
        verdicts["checkpoint/ep2_to_ep1_and_ep4"] = traceback.format_exc()
