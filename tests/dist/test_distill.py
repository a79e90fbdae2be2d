"""Knowledge distillation over two processes on the CPU (gloo): each process holds the whole teacher and
runs it on its share of the batch, so DDP and FSDP2 must train the distilled student to the weights one
process reaches on the same global batches (up to float summation order)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist.test_ddp import _assert_close, _overrides, _set_args, _train_in_one_process, torchrun
from vitrain.checkpoint.sharded import read_checkpoint_model
from vitrain.metrics import read_jsonl
from vitrain.models import build_model

FINAL = "checkpoints/step-000000018"


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    """Distillation settings with a teacher exported as safetensors with vitrain metadata."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    teacher = build_model("vit_tiny6_patch7", img_size=14, num_classes=10)
    path = tmp_path_factory.mktemp("teacher") / "teacher.safetensors"
    metadata = {"format": "vitrain-model-v1", "config": json.dumps({"model": {"name": "vit_tiny6_patch7"}})}
    save_file(teacher.state_dict(), str(path), metadata=metadata)
    return [
        "model.head=cls",
        "model.distill_token=true",
        "data.synthetic_num_classes=10",
        # SGD, not Adam: the attention key bias gets a gradient of rounding noise only (softmax ignores a
        # constant shift), which Adam would scale up to a full-size step that differs between the runs
        "optim.name=sgd",
        "train.distill.kind=soft",
        "train.distill.tau=2.0",
        f"train.distill.teacher={path}",
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, settings):
    out_dir = tmp_path_factory.mktemp("single") / "run"
    _train_in_one_process(out_dir, *settings)
    return out_dir


def _final_weights(out_dir, name=FINAL):
    path = out_dir / name if (out_dir / name).is_dir() else out_dir / f"{name}.pt"
    return read_checkpoint_model(path)[0]


def _losses(out_dir):
    return [record["loss"] for record in read_jsonl(out_dir / "metrics.jsonl") if record["event"] == "train"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_distillation_over_two_processes_matches_one_process(reference, settings, tmp_path, strategy):
    out_dir = tmp_path / "run"
    overrides = _overrides(out_dir, *settings, f"parallel.strategy={strategy}")
    result = torchrun(["train", *_set_args(overrides)], nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    ours, theirs = _final_weights(out_dir), _final_weights(reference)
    first = _final_weights(out_dir, "checkpoints/step-000000006")
    assert not torch.allclose(first["head_dist.weight"], ours["head_dist.weight"])  # the dist head trains
    _assert_close(ours, theirs)
    losses = _losses(out_dir)
    assert all(loss == loss for loss in losses) and losses == pytest.approx(_losses(reference), rel=1e-4)
