"""Where a command writes: an output it cannot write (a directory where a file goes, a file where a
folder goes, a path under a file, a read-only place) is one clear message, exit 2, before the long
work, and whatever was there before (a plan, a metrics file, a file in the way) is kept."""

import os

import pytest

import planner.commands.plan_command as plan_command
import planner.commands.sweep  # noqa: F401 - bound to the real search before `no_search` patches it
import planner.commands.train as train
from planner.cli import main
from planner.plan import PlanError, load_plan, save_plan
from runtime.distributed.launch import LaunchError
from tests.helpers import plan_args

_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0  # root writes everywhere: no read-only place to test


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "p.json"
    assert main(plan_args(out, "--json")) == 0
    return out


@pytest.fixture
def no_search(monkeypatch):
    """The checks must come before the search: reaching it fails the test."""

    def searched(*args, **kwargs):
        raise AssertionError("the search ran before the output was checked")

    monkeypatch.setattr(plan_command, "plan_from_request", searched)


@pytest.fixture
def no_training(monkeypatch):
    """The checks must come before the compile and the launch: reaching either fails the test."""

    def started(*args, **kwargs):
        raise AssertionError("the run started before its outputs were checked")

    monkeypatch.setattr(train, "compile_for_training", started)
    monkeypatch.setattr(train, "launch_local", started)


def _refused(argv, capsys, *expected: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n"), err
    for text in expected:
        assert text in err, err
    return err


def test_plan_out_a_directory_is_refused_before_the_search(tmp_path, capsys, no_search):
    folder = tmp_path / "plans"
    folder.mkdir()
    (folder / "kept.txt").write_text("mine")
    _refused(plan_args(folder), capsys, f"--out {folder} is a directory", os.path.join(folder, "plan.json"))
    assert os.listdir(folder) == ["kept.txt"] and (folder / "kept.txt").read_text() == "mine"


def test_plan_out_under_a_file_is_refused(tmp_path, capsys, no_search):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    _refused(plan_args(blocker / "p.json"), capsys, "cannot be created", f"{blocker} is a file, not a directory")
    _refused(plan_args(blocker / "p.json", "--gpus", "2,4"), capsys, "the sweep's plan", "is a file")
    assert blocker.read_text() == "x"


def test_plan_plot_a_directory_is_refused(tmp_path, capsys, no_search):
    _refused(plan_args(tmp_path / "p.json", "--plot", str(tmp_path)), capsys, f"--plot {tmp_path} is a directory")
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(_ROOT, reason="root may write into read-only folders")
def test_plan_out_in_a_read_only_folder_is_refused(tmp_path, capsys, no_search):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "p.json").write_text("old")
    locked.chmod(0o500)
    try:
        _refused(plan_args(locked / "new.json"), capsys, "cannot write in")
        (locked / "p.json").chmod(0o400)
        _refused(plan_args(locked / "p.json"), capsys, "is read-only")
        assert (locked / "p.json").read_text() == "old"
    finally:
        locked.chmod(0o700)


def test_save_plan_keeps_what_is_there(plan_file, tmp_path):
    plan = load_plan(str(plan_file))
    with pytest.raises(PlanError, match="is a directory"):
        save_plan(plan, str(tmp_path))
    assert os.listdir(tmp_path) == []
    save_plan(plan, str(tmp_path / "new" / "p.json"))  # a missing folder is created, as before
    assert load_plan(str(tmp_path / "new" / "p.json")) == plan


def test_compile_out_a_file_is_refused_and_kept(plan_file, tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("keep me")
    _refused(
        ["compile", str(plan_file), "--out", str(blocker)], capsys, f"cannot compile into {blocker}", "not a directory"
    )
    _refused(["compile", str(plan_file), "--out", str(blocker / "c")], capsys, f"{blocker} is a file")
    assert blocker.read_text() == "keep me" and os.listdir(tmp_path) == ["afile"]


def test_train_metrics_a_directory_is_refused_before_training(plan_file, tmp_path, capsys, no_training):
    argv = ["train", str(plan_file), "--nproc", "2", "--steps", "1", "--metrics", str(tmp_path)]
    _refused(argv, capsys, f"--metrics {tmp_path} is a directory", "metrics.jsonl")


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--snapshot-dir", "--tensorboard"])
def test_train_folder_that_is_a_file_is_refused_and_metrics_kept(plan_file, tmp_path, capsys, no_training, flag):
    metrics, blocker = tmp_path / "keep.jsonl", tmp_path / "afile"
    metrics.write_text('{"step": 1}\n')
    blocker.write_text("x")
    every = {"--checkpoint-dir": ["--save-every", "1"], "--snapshot-dir": ["--snapshot-every", "1"]}.get(flag, [])
    argv = ["train", str(plan_file), "--nproc", "2", "--steps", "2", "--metrics", str(metrics), flag, str(blocker)]
    _refused([*argv, *every], capsys, f"{flag} {blocker} is an existing file, not a directory")
    _refused([*argv[:-1], str(blocker / "sub"), *every], capsys, f"{blocker} is a file, not a directory")
    assert metrics.read_text() == '{"step": 1}\n' and blocker.read_text() == "x"


def test_train_wrong_nproc_keeps_the_metrics(plan_file, tmp_path, capsys, no_training):
    metrics = tmp_path / "keep.jsonl"
    metrics.write_text('{"step": 1}\n')
    _refused(
        ["train", str(plan_file), "--nproc", "3", "--steps", "1", "--metrics", str(metrics)], capsys, "--nproc is 3"
    )
    assert metrics.read_text() == '{"step": 1}\n'


def test_a_failed_run_is_one_sentence(plan_file, tmp_path, capsys, monkeypatch):
    """A run that fails after it started: exit 1 and the reason as a sentence on its own line."""

    def failed(*args, **kwargs):
        raise LaunchError("rank 1 failed: CheckpointError: saving checkpoint step 1 failed (disk full)")

    monkeypatch.setattr(train, "compile_for_training", lambda plan, path, out: str(tmp_path / "c"))
    monkeypatch.setattr(train, "launch_local", failed)
    metrics = tmp_path / "new" / "m.jsonl"
    assert main(["train", str(plan_file), "--nproc", "2", "--steps", "1", "--metrics", str(metrics)]) == 1
    err = capsys.readouterr().err
    assert err.endswith("saving checkpoint step 1 failed (disk full).\n"), err
    assert (tmp_path / "new").is_dir()  # the metrics file's folder is made when the run starts
