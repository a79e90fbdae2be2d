"""Checkpoints by name: ``--resume last|best`` and ``eval`` / ``export`` given a run folder.

One tiny synthetic run of 18 steps saves at steps 6, 12 and 18 with eval top-1 fixed at 50, 70 and 60 %,
so the best checkpoint (step 12) is neither the first nor the newest."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from tests.conftest import SMALL_SYNTHETIC_RUN, make_config
from vitrain.checkpoint import CheckpointError, find_resume_checkpoint, resolve_checkpoint_argument
from vitrain.cli import main
from vitrain.train import loop, make_plan, train

pytestmark = pytest.mark.usefixtures("one_thread")

TOP1_BY_STEP = {6: 50.0, 12: 70.0, 18: 60.0}


def _overrides(run_dir):
    return [*SMALL_SYNTHETIC_RUN, "train.epochs=3", "checkpoint.keep_last=5", f"train.out_dir={run_dir}"]


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """The run folder of 18 steps whose evaluations report TOP1_BY_STEP (read-only: copy it to change it)."""

    def fixed_top1(self, model):
        return {"top1": TOP1_BY_STEP[self.run.state.step], "top5": 100.0, "loss": 1.0}

    run_dir = tmp_path_factory.mktemp("named") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop.Trainer, "_evaluate_weights", fixed_top1)
        train(make_plan(make_config(*_overrides(run_dir))))
    names = sorted(path.name for path in (run_dir / "checkpoints").glob("step-*.pt"))
    assert names == [f"step-{step:09d}.pt" for step in TOP1_BY_STEP]
    return run_dir


def _copy(run_dir, tmp_path):
    return shutil.copytree(run_dir, tmp_path / "copy")


def _step_of(path) -> int:
    return int(path.name.removeprefix("step-").removesuffix(".pt"))


def test_best_names_the_highest_top1_and_last_the_newest(evaluated_run):
    best = find_resume_checkpoint("best", evaluated_run, None)
    assert _step_of(best) == max(TOP1_BY_STEP, key=TOP1_BY_STEP.get) == 12
    assert _step_of(find_resume_checkpoint("last", evaluated_run, None)) == max(TOP1_BY_STEP) == 18
    assert find_resume_checkpoint("last", evaluated_run, None) == find_resume_checkpoint("auto", evaluated_run, None)


def test_resume_best_continues_from_the_best_step(evaluated_run, tmp_path, step_clock):
    run_dir = _copy(evaluated_run, tmp_path)
    summary = train(make_plan(make_config(*_overrides(run_dir))), resume="best", clock=step_clock)
    assert len(step_clock.shapes) == 18 - 12 and summary["steps"] == 18  # trained steps 13..18 again
    step_clock.shapes.clear()
    train(make_plan(make_config(*_overrides(run_dir))), resume="last", clock=step_clock)
    assert step_clock.shapes == []  # the newest is step 18: nothing left to train


def test_resume_last_or_best_without_a_checkpoint_is_an_error(tmp_path):
    for name in ("last", "best"):
        with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
            find_resume_checkpoint(name, tmp_path / "new-run", None)
    assert find_resume_checkpoint("auto", tmp_path / "new-run", None) is None  # auto starts a new run
    argv = ["train", *[f"--set={override}" for override in _overrides(tmp_path / "new-run")], "--resume", "last"]
    assert main(argv) == 2


def test_resume_best_without_a_recorded_best_is_an_error(evaluated_run, tmp_path):
    run_dir = _copy(evaluated_run, tmp_path)
    (run_dir / "checkpoints" / "best.json").unlink()
    with pytest.raises(CheckpointError, match="records no best checkpoint"):
        find_resume_checkpoint("best", run_dir, None)


def test_eval_of_a_run_folder_reports_its_best_step(evaluated_run, capsys):
    assert main(["eval", "--checkpoint", str(evaluated_run)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 12 and result["checkpoint"].endswith("step-000000012.pt")
    assert resolve_checkpoint_argument(evaluated_run / "checkpoints").name == "step-000000012.pt"
    newest = evaluated_run / "checkpoints" / "step-000000018.pt"
    assert resolve_checkpoint_argument(newest) == newest  # a path stays a path


def test_export_of_a_run_folder_without_a_best_takes_the_newest_and_says_so(evaluated_run, tmp_path, capsys, caplog):
    run_dir = _copy(evaluated_run, tmp_path)
    (run_dir / "checkpoints" / "best.json").unlink()
    out = tmp_path / "model.safetensors"
    with caplog.at_level(logging.WARNING, logger="vitrain"):
        assert main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["checkpoint"].endswith("step-000000018.pt") and out.is_file()
    assert "records no best checkpoint" in caplog.text and "step-000000018.pt" in caplog.text


def test_a_folder_that_is_not_a_run_or_holds_no_checkpoint_exits_2(tmp_path, capsys):
    (tmp_path / "photos").mkdir()
    assert main(["eval", "--checkpoint", str(tmp_path / "photos")]) == 2
    assert "neither a checkpoint nor a run folder" in capsys.readouterr().err
    (tmp_path / "empty-run" / "checkpoints").mkdir(parents=True)
    assert main(["export", "--checkpoint", str(tmp_path / "empty-run"), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


def test_sharded_checkpoints_record_their_best_too(tmp_path):
    """checkpoint.format=sharded: best.json names the best step-N folder; a run folder resolves to it."""

    def fixed_top1(self, model):
        return {"top1": TOP1_BY_STEP[self.run.state.step], "top5": 100.0, "loss": 1.0}

    run_dir = tmp_path / "sharded"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop.Trainer, "_evaluate_weights", fixed_top1)
        train(make_plan(make_config(*_overrides(run_dir), "checkpoint.format=sharded")))
    best = resolve_checkpoint_argument(run_dir)
    assert best.is_dir() and best.name == "step-000000012"
    assert find_resume_checkpoint("best", run_dir, None) == best
    assert json.loads((run_dir / "checkpoints" / "best.json").read_text())["top1"] == 70.0
