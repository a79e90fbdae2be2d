"""Sharded (DCP) checkpoint folders in one process: completion marker, lookup, safe metadata, export.
The multi-process paths (FSDP/TP save at N, load at M) are in tests/dist/test_sharded.py."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from safetensors.torch import load_file

from vitrain.checkpoint import CheckpointError, CheckpointManager, find_latest_checkpoint
from vitrain.checkpoint.sharded import (
    COMPLETE_MARKER,
    load_sharded,
    read_checkpoint_model,
    read_sharded_model,
    save_sharded,
)
from vitrain.cli import main


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"layer.weight": torch.full((4, 3), value), "layer.bias": torch.arange(4.0) + value}


def _save(folder, step, value):
    final = CheckpointManager(folder, keep_last=5).path_for(step).with_suffix("")
    extras = {"state": {"step": step}, "config": {"recipe": "test"}}
    return save_sharded(final, {"model": _weights(value)}, extras, is_main=True)


def test_a_sharded_folder_round_trips_and_counts_only_when_complete(tmp_path):
    first = _save(tmp_path, 3, 1.0)
    assert (first / COMPLETE_MARKER).is_file() and any(first.glob("*.distcp"))
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    weights = read_sharded_model(first)
    assert all(torch.equal(weights[key], value) for key, value in _weights(1.0).items())
    loaded, extras = load_sharded(first, {"model": {key: torch.zeros_like(v) for key, v in _weights(0.0).items()}})
    assert torch.equal(loaded["model"]["layer.bias"], _weights(1.0)["layer.bias"]) and extras["state"]["step"] == 3

    second = _save(tmp_path, 6, 2.0)
    (second / COMPLETE_MARKER).unlink()  # as if killed before the marker was written
    assert find_latest_checkpoint(tmp_path) == first
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        read_sharded_model(second)


def test_a_folder_cut_off_mid_save_is_ignored_then_cleaned(tmp_path):
    _save(tmp_path, 3, 1.0)
    leftover = tmp_path / "checkpoints" / "step-000000006.tmp"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    assert find_latest_checkpoint(tmp_path).name == "step-000000003"
    manager = CheckpointManager(tmp_path, keep_last=1)
    _save(tmp_path, 9, 3.0)
    manager.prune()
    assert [path.name for path in sorted((tmp_path / "checkpoints").iterdir())] == ["step-000000009"]


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    folder = _save(tmp_path, 3, 1.0)
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    with pytest.raises(CheckpointError, match="arbitrary unpickling"):
        read_sharded_model(folder)
    assert not marker.exists()


def test_export_writes_one_safetensors_file_from_either_format(tmp_path, capsys):
    folder = _save(tmp_path, 3, 1.5)
    out = tmp_path / "export" / "model.safetensors"
    assert main(["export", "--checkpoint", str(folder), "--out", str(out)]) == 0
    exported = load_file(str(out))
    assert exported.keys() == _weights(1.5).keys()
    assert all(torch.equal(exported[key], value) for key, value in _weights(1.5).items())

    file_checkpoint = CheckpointManager(tmp_path / "single", keep_last=1).save(
        {"model": _weights(2.5), "config": {}, "state": {"step": 1}}, 1
    )
    assert main(["export", "--checkpoint", str(file_checkpoint), "--out", str(tmp_path / "b.safetensors")]) == 0
    assert torch.equal(
        load_file(str(tmp_path / "b.safetensors"))["layer.weight"],
        read_checkpoint_model(file_checkpoint)[0]["layer.weight"],
    )
    assert main(["export", "--checkpoint", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
