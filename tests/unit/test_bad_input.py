"""Bad configuration and missing resources: exit code 2 and one line naming the key or path with a
fix, before any work (building the model or loaders fails the test)."""

from __future__ import annotations

import pytest
import torch

from vitrain.cli import main
from vitrain.train import build, loop


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(loop, "build_run", refuse)
    monkeypatch.setattr(build, "build_model_for", refuse)


def _train(tmp_path, *overrides, resume=None):
    base = ["data.name=synthetic", "train.steps=2", f"train.out_dir={tmp_path / 'run'}", *overrides]
    return ["train", *(["--resume", resume] if resume else []), *[a for o in base for a in ("--set", o)]]


def _other_model_checkpoint(tmp_path):
    path = tmp_path / "other" / "checkpoints" / "step-000000001.pt"
    path.parent.mkdir(parents=True)
    torch.save({"config": {"model": {"name": "resnet50"}}, "state": {"step": 1}}, path)
    return path


CASES = {
    "resume-missing": (lambda t: _train(t, resume=str(t / "nope.pt")), "--resume {t}/nope.pt: no such checkpoint"),
    "resume-other-model": (
        lambda t: _train(t, resume=str(_other_model_checkpoint(t))),
        "the checkpoint holds a resnet50 but model.name=",
    ),
    "init-from-missing": (lambda t: _train(t, f"train.init_from={t}/nope.pt"), "train.init_from={t}/nope.pt: no such"),
    "finetune-from-missing": (lambda t: ["finetune", "--from", str(t / "nope.pt")], "checkpoint {t}/nope.pt does not"),
    "eval-missing": (lambda t: ["eval", "--checkpoint", str(t / "nope.pt")], "checkpoint {t}/nope.pt does not exist"),
    "data-root-missing": (
        lambda t: _train(t, "data.name=fashion-mnist", f"data.root={t}/nope"),
        "data.root: Fashion-MNIST file {t}/nope/",
    ),
    "config-missing": (lambda t: ["train", "--config", str(t / "nope.yaml")], "--config {t}/nope.yaml: no such file"),
    "out-dir-unwritable": (
        lambda t: _train(t, f"train.out_dir={t}/a-file/run"),
        "train.out_dir={t}/a-file/run: cannot",
    ),
    "every-steps-negative": (lambda t: _train(t, "checkpoint.every_steps=-1"), "checkpoint.every_steps: Input should"),
    "every-minutes-not-a-number": (lambda t: _train(t, "checkpoint.every_minutes=soon"), "checkpoint.every_minutes:"),
    "max-skipped-negative": (lambda t: _train(t, "train.max_skipped_steps=-2"), "train.max_skipped_steps: Input"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line_before_any_work(case, tmp_path, capsys):
    (tmp_path / "a-file").write_text("a file where a folder should be")
    argv, expected = CASES[case]
    assert main(argv(tmp_path)) == 2
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1, message
    assert message.startswith("vitrain: error: ") and expected.format(t=tmp_path) in message, message
