"""CLI smoke: train a few steps on a Fashion-MNIST-format subset, then evaluate the checkpoint."""

from __future__ import annotations

import json

import pytest

from vitrain.checkpoint import find_latest_checkpoint
from vitrain.cli import main
from vitrain.metrics import read_jsonl


def test_train_then_eval(tiny_fmnist, tmp_path, capsys):
    out_dir = tmp_path / "run"
    argv = [
        "train",
        "--set", f"data.root={tiny_fmnist}",
        "--set", "data.limit_train=256",
        "--set", "data.limit_eval=64",
        "--set", "train.batch_size=32",
        "--set", "train.steps=5",
        "--set", "train.log_every_steps=1",
        "--set", f"train.out_dir={out_dir}",
    ]  # fmt: skip
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    summary = json.loads((out_dir / "summary.json").read_text())
    assert printed["final_top1"] == summary["final_top1"]
    assert summary["steps"] == 5 and summary["images_seen"] == 160
    train_records = [record for record in read_jsonl(out_dir / "metrics.jsonl") if record["event"] == "train"]
    assert [record["step"] for record in train_records] == [1, 2, 3, 4, 5]
    assert all({"loss", "lr", "img_s", "train_s", "elapsed_s", "epoch"} <= record.keys() for record in train_records)
    assert (out_dir / "config.yaml").read_text().startswith("recipe: fmnist")
    checkpoint = find_latest_checkpoint(out_dir)
    assert checkpoint.name == "step-000000005.pt"

    assert main(["eval", "--checkpoint", str(checkpoint)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 5 and result["num_samples"] == 64
    assert abs(result["top1"] - summary["final_top1"]) < 1e-9


def test_list_commands(capsys):
    assert main(["list-models"]) == 0
    listed = capsys.readouterr().out
    assert "locality_vit_tiny6_patch7" in listed and "86.57M" in listed
    assert main(["list-recipes"]) == 0
    assert "fmnist (default)" in capsys.readouterr().out


def test_list_models_with_flops_shows_gflops_at_default_size(capsys):
    assert main(["list-models", "--flops"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["vit_base_patch16"][2:4] == ["35.13", "224"]  # 17.6 GMACs, the published ViT-B/16 figure
    assert float(rows["volo_d1"][2]) == pytest.approx(13.84, abs=0.01)  # 6.9 GMACs (paper: 6.8G)


def test_model_option_of_another_family_is_rejected_with_a_fix(capsys):
    # the default recipe sets model.head=gap; VOLO has no such option
    assert main(["show-config", "--set", "model.name=volo_d1"]) == 0
    assert main(["train", "--set", "model.name=volo_d1", "--set", "data.name=synthetic"]) == 2
    message = capsys.readouterr().err
    assert "model.head=gap" in message and "set model.head=null" in message


@pytest.mark.parametrize("command", [["list-models"], ["show-config"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(command):
    """`vitrain list-models | grep -q local`: the pipe's reader is gone before the output is written;
    the command stops with the shell's SIGPIPE code and no BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has already left
    try:
        result = subprocess.run(
            [sys.executable, "-m", "vitrain", *command],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert "BrokenPipeError" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 141
