"""Planning mixtures of experts from the command line: ``--ep``, ``--moe-capacity-factor``,
``--moe-imbalance``, plan.json's ``expert_parallel`` and ``model.moe``, the report, the DeepSpeed
export, and Mixtral-8x7B on 64 H100 (its config, no weights)."""

from __future__ import annotations

import json

import pytest

from planner.cli import main
from planner.plan import load_plan
from planner.report.deepspeed import launcher_command
from tests.helpers import SMALL_GPT_FLAGS

tf = pytest.importorskip("transformers")

TINY_MIXTRAL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    num_local_experts=4,
    num_experts_per_tok=2,
)


def _plan(model: str, *flags: str) -> list[str]:
    return ["plan", "--model", model, "--gpus", "4", "--gpus-per-node", "4", "--hardware", "h100-sxm",
            "--global-batch", "16", "--seq-len", "64", *flags]  # fmt: skip


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_mixtral") / "mixtral"
    tf.MixtralConfig(**TINY_MIXTRAL).save_pretrained(path)
    return str(path)


def test_ep_pin_capacity_and_imbalance_reach_the_plan_report_and_deepspeed(mixtral_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # the report's lines unwrapped
    out = tmp_path / "plan.json"
    flags = ("--ep", "2", "--moe-capacity-factor", "1.25", "--moe-imbalance", "1.1")
    assert main([*_plan(f"hf:{mixtral_dir}", *flags), "--out", str(out)]) == 0
    report = capsys.readouterr().out
    assert "ep=2: 2 experts per rank" in report and "capacity factor 1.25" in report
    assert "all-to-all bytes / device / step" in report and "tokens / expert / micro-batch" in report
    plan = load_plan(out)
    assert plan.expert_parallel == 2
    assert plan.model.moe == {"layers": [1, 2], "experts": 4, "top_k": 2, "shared_experts": 0, "capacity_factor": 1.25}
    assert (plan.request["ep"], plan.request["moe_capacity_factor"], plan.request["moe_imbalance"]) == (2, 1.25, 1.1)
    assert plan.predicted.time["ep_comm"] > 0
    ds = tmp_path / "ds.json"
    assert main(["export", "deepspeed", str(out), "--out", str(ds)]) == 0
    config = json.loads(ds.read_text())
    assert any("split_params_into_different_moe_groups_for_optimizer" in w for w in config["planner"]["warnings"])
    assert "--num-experts 4 --moe-expert-parallel-size 2" in launcher_command(plan)
    moe = config["planner"]["moe"]
    assert moe == {
        "num_experts": 4,
        "ep_size": 2,
        "k": 2,
        "capacity_factor": 1.25,
        "eval_capacity_factor": 1.25,
        "min_capacity": 4,
        "drop_tokens": True,
        "use_residual": False,
        "layers": [1, 2],
    }


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--ep", "2"), "this model has no routed experts"),
        (("--ep", "3"), "--ep 3 does not divide"),
        (("--moe-imbalance", "0.5"), "--moe-imbalance must be a number >= 1.0"),
    ],
)
def test_bad_moe_flags_exit_2_with_one_message(flags, message, mixtral_dir, capsys):
    model = "gpt" if flags[:2] == ("--ep", "2") else f"hf:{mixtral_dir}"
    argv = _plan(model, *flags) + (list(SMALL_GPT_FLAGS[2:]) if model == "gpt" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_mixtral_8x7b_on_64_h100_shards_its_experts_and_beats_replicating_them(tmp_path, capsys):
    """Mixtral-8x7B (transformers' defaults: 32 x 4096, 8 experts top-2, ffn 14336) on 8 nodes of
    8 H100, 1024 x 4096 tokens per step: the plan shards the experts (ep > 1) and its runners-up
    show the best plan with every expert replicated, slower. (Traces 46.7B parameters on the meta
    device: about a minute and a half here.)"""
    tf.MixtralConfig().save_pretrained(tmp_path / "mixtral")
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", f"hf:{tmp_path / 'mixtral'}", "--gpus", "64", "--gpus-per-node", "8",
            "--hardware", "h100-sxm", "--global-batch", "1024", "--seq-len", "4096", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    plan = load_plan(out)
    assert plan.expert_parallel > 1
    replicated = [alt for alt in plan.alternatives if alt.expert_parallel == 1]
    assert replicated and replicated[0].step_time_s > plan.predicted.step_time_s
