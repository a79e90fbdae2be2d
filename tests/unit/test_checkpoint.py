"""Atomic checkpoints, pruning, safe loading."""

from __future__ import annotations

import os

import pytest
import torch

from vitrain.checkpoint import CheckpointError, CheckpointManager, find_latest_checkpoint, load_checkpoint


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
