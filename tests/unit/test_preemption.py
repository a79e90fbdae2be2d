"""SIGTERM and SIGUSR1 during training: the step finishes, a checkpoint of that step is written with
the summary and a metrics record, the command exits with code 3, the handlers before training are
back, and ``--resume auto`` continues to the weights of an uninterrupted run. (The signal is sent by
the process to itself in the middle of a step, so the step it lands in is known; a signal from
another process is tested in test_fault_injection.py.)"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from vitrain.checkpoint import find_latest_checkpoint, load_checkpoint
from vitrain.cli import EXIT_PREEMPTED, main
from vitrain.metrics import read_jsonl
from vitrain.train.step import TrainStep

pytestmark = pytest.mark.usefixtures("one_thread")


def _argv(overrides):
    return ["train", *[arg for override in overrides for arg in ("--set", override)]]


def _signal_during_step(monkeypatch, signal_number: int, at_step: int) -> None:
    original = TrainStep.__call__
    calls = []

    def call(self, images, labels):
        calls.append(1)
        if len(calls) == at_step:
            os.kill(os.getpid(), signal_number)  # lands in the middle of the step
        return original(self, images, labels)

    monkeypatch.setattr(TrainStep, "__call__", call)


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_checkpoints_the_step_and_exits_3(
    small_synthetic_overrides, tmp_path, monkeypatch, capsys, signal_number
):
    overrides = [*small_synthetic_overrides, "model.drop_path_rate=0.1", "checkpoint.keep_last=5"]
    handler_before = signal.getsignal(signal_number)
    with monkeypatch.context() as patch:
        _signal_during_step(patch, signal_number, at_step=8)  # mid-epoch 2, not a log step
        assert main(_argv(overrides)) == EXIT_PREEMPTED == 3
    assert signal.getsignal(signal_number) is handler_before
    name = signal.Signals(signal_number).name
    out_dir = tmp_path / "run"
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message == (
        f"vitrain: preempted by {name} at step 8; checkpoint {out_dir / 'checkpoints' / 'step-000000008.pt'} "
        "saved; continue the run with --resume auto (same config)"
    )
    latest = find_latest_checkpoint(out_dir)
    assert latest.name == "step-000000008.pt"
    assert load_checkpoint(latest)["state"]["epoch_images"] == 2 * 16
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["preempted"] == name and summary["steps"] == 8
    records = read_jsonl(out_dir / "metrics.jsonl")
    assert records[-1] == {**records[-1], "event": "preempted", "step": 8, "signal": name}
    assert [record["step"] for record in records if record["event"] == "train"][-1] == 8

    assert main([*_argv(overrides), "--resume", "auto"]) == 0
    assert main(_argv([*overrides, f"train.out_dir={tmp_path / 'straight'}"])) == 0  # the same recipe and config
    final, resumed = (
        load_checkpoint(find_latest_checkpoint(tmp_path / "straight")),
        load_checkpoint(find_latest_checkpoint(out_dir)),
    )
    assert resumed["state"]["step"] == final["state"]["step"] == 18
    for key, tensor in final["model"].items():
        assert torch.equal(resumed["model"][key], tensor), key
    assert json.loads((out_dir / "summary.json").read_text())["preempted"] is None


def test_stop_signals_record_the_first_signal_and_restore_the_handlers():
    from vitrain.train.signals import StopSignals

    before = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1)}
    with StopSignals() as stop:
        assert all(signal.getsignal(number) != handler for number, handler in before.items())
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == "SIGTERM"  # the first one counts
    assert {number: signal.getsignal(number) for number in before} == before
