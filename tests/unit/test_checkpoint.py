"""Atomic checkpoints, pruning, safe loading."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from vitrain.checkpoint import (
    CheckpointError,
    CheckpointManager,
    find_best_checkpoint,
    find_latest_checkpoint,
    load_checkpoint,
)
from vitrain.cli import main


def test_save_load_round_trip_and_keep_last(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        manager.save({"step": step, "weights": torch.full((3,), float(step))}, step)
    names = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000000002.pt", "step-000000003.pt"]
    latest = find_latest_checkpoint(tmp_path)
    assert load_checkpoint(latest)["step"] == 3
    assert torch.equal(load_checkpoint(latest)["weights"], torch.full((3,), 3.0))


def test_partial_write_is_ignored_and_cleaned(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save({"step": 1}, 1)
    leftover = tmp_path / "checkpoints" / "step-000000002.pt.tmp-999"
    leftover.write_bytes(b"half a checkpoint")
    assert find_latest_checkpoint(tmp_path).name == "step-000000001.pt"
    manager.save({"step": 3}, 3)
    assert not leftover.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_folder_keeps_previous(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save({"step": 1}, 1)
    os.chmod(tmp_path / "checkpoints", 0o500)
    try:
        with pytest.raises(CheckpointError, match="cannot write checkpoint"):
            manager.save({"step": 2}, 2)
    finally:
        os.chmod(tmp_path / "checkpoints", 0o700)
    assert load_checkpoint(find_latest_checkpoint(tmp_path))["step"] == 1


def test_write_failure_keeps_previous(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save({"step": 1}, 1)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        manager.save({"step": 2}, 2)
    assert [path.name for path in (tmp_path / "checkpoints").iterdir()] == ["step-000000001.pt"]
    assert load_checkpoint(find_latest_checkpoint(tmp_path))["step"] == 1


class Arbitrary:
    pass


def test_refuses_arbitrary_pickles(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"object": Arbitrary()}, path)
    with pytest.raises(CheckpointError, match="refuses"):
        load_checkpoint(path)


def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "cut.pt"
    torch.save({"weights": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(path)


def test_keep_last_plus_the_best_evaluated_one(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step, top1 in [(1, 50.0), (2, 80.0), (3, 60.0), (4, None), (5, 80.0)]:  # 4: no eval; 5 only ties
        manager.save({"step": step}, step, top1=top1)
    kept = sorted(path.name for path in (tmp_path / "checkpoints").glob("step-*.pt"))
    assert kept == ["step-000000002.pt", "step-000000004.pt", "step-000000005.pt"]
    assert find_best_checkpoint(tmp_path).name == "step-000000002.pt"
    assert find_latest_checkpoint(tmp_path).name == "step-000000005.pt"  # best.json is not a checkpoint
    manager.save({"step": 6}, 6, top1=90.0)
    kept = sorted(path.name for path in (tmp_path / "checkpoints").glob("step-*.pt"))
    assert kept == ["step-000000005.pt", "step-000000006.pt"]
    assert find_best_checkpoint(tmp_path).name == "step-000000006.pt"


def _raise_file_size_limit_after(limit_bytes: int):
    """Writes past ``limit_bytes`` fail with EFBIG, as a full disk fails them with ENOSPC: a real
    failure inside torch.save (which reports it only as a RuntimeError 'unexpected pos')."""
    resource = pytest.importorskip("resource")
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))

    def restore():
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)

    return restore


def test_a_real_write_failure_inside_torch_save_is_a_clear_error(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save({"step": 1, "weights": torch.zeros(10)}, 1)
    restore = _raise_file_size_limit_after(100_000)
    try:
        with pytest.raises(CheckpointError, match="cannot write checkpoint .*step-000000002.pt: File too large"):
            manager.save({"step": 2, "weights": torch.zeros(1_000_000)}, 2)
    finally:
        restore()
    assert [path.name for path in (tmp_path / "checkpoints").iterdir()] == ["step-000000001.pt"]
    assert load_checkpoint(find_latest_checkpoint(tmp_path))["step"] == 1


def test_a_full_disk_during_training_exits_2_and_keeps_the_previous_checkpoint(
    small_synthetic_overrides, tmp_path, monkeypatch, capsys
):
    saves = []
    save = CheckpointManager.save

    def save_then_fill_the_disk(self, payload, step, top1=None):
        saves.append(step)
        if len(saves) == 2:
            restore = _raise_file_size_limit_after(100_000)
            try:
                return save(self, payload, step, top1)
            finally:
                restore()
        return save(self, payload, step, top1)

    monkeypatch.setattr(CheckpointManager, "save", save_then_fill_the_disk)
    argv = ["train", *[arg for override in small_synthetic_overrides for arg in ("--set", override)]]
    assert main(argv) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("vitrain: error: cannot write checkpoint ") and "step-000000012.pt" in message
    assert "free disk space" in message and "the previous checkpoint is intact" in message
    assert [path.name for path in (tmp_path / "run" / "checkpoints").glob("step-*")] == ["step-000000006.pt"]
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "step-000000006.pt")["state"]["step"] == 6


class Exploit:
    """Unpickling this runs a shell command: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_malicious_checkpoint_is_refused_without_running_its_code(small_synthetic_overrides, tmp_path, capsys):
    marker, path = tmp_path / "pwned", tmp_path / "checkpoints" / "step-000000001.pt"
    path.parent.mkdir()
    torch.save({"model": Exploit(marker), "config": {}, "state": {"step": 1}}, path)
    with pytest.raises(CheckpointError, match="arbitrary unpickling, which vitrain refuses .*GLOBAL posix.system"):
        load_checkpoint(path)
    train_args = [arg for override in small_synthetic_overrides for arg in ("--set", override)]
    for argv in (
        ["train", "--resume", str(path), *train_args],
        ["train", "--resume", "auto", *train_args, "--set", f"train.out_dir={tmp_path}"],
        ["eval", "--checkpoint", str(path)],
        ["finetune", "--from", str(path), *train_args],
    ):
        assert main(argv) == 2, argv
        message = capsys.readouterr().err.strip()
        assert len(message.splitlines()) == 1 and "refuses" in message, message
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the file really is an exploit: plain unpickling runs it
    assert marker.exists()
