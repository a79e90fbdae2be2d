"""Token labeling over two processes on the CPU (gloo): every process reads the label maps of its share of
each global batch and computes their dense targets, so DDP and FSDP2 train to the weights one process reaches
on the same global batches (up to float summation order). MixToken pairs images within each process's batch
(as VOLO does under DDP), so its runs differ from one process by design: they must train, with finite losses."""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist.test_ddp import _assert_close, _overrides, _set_args, _train_in_one_process, torchrun
from tests.dist.test_distill import _final_weights, _losses
from vitrain.cli import main
from vitrain.metrics import read_jsonl
from vitrain.models import build_model


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    """Token-labeling settings with label maps of a 10-class teacher over the 96 synthetic training images."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("token-labels")
    torch.manual_seed(2)
    teacher = build_model("vit_tiny6_patch7", img_size=14, num_classes=10)
    metadata = {"format": "vitrain-model-v1", "config": json.dumps({"model": {"name": "vit_tiny6_patch7"}})}
    save_file(teacher.state_dict(), str(folder / "teacher.safetensors"), metadata=metadata)
    argv = ["label", "--teacher", str(folder / "teacher.safetensors"), "--out", str(folder / "maps"), "--topk", "3"]
    assert main([*argv, *_set_args(_overrides(folder / "unused"))]) == 0
    # SGD, as the distillation test: Adam would scale the rounding noise of the attention key bias up
    return ["model.aux_head=true", f"token_labels.maps={folder / 'maps'}", "optim.name=sgd"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, settings):
    out_dir = tmp_path_factory.mktemp("single") / "run"
    _train_in_one_process(out_dir, *settings)
    return out_dir


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_token_labeling_over_two_processes_matches_one_process(reference, settings, tmp_path, strategy):
    out_dir = tmp_path / "run"
    overrides = _overrides(out_dir, *settings, f"parallel.strategy={strategy}")
    result = torchrun(["train", *_set_args(overrides)], nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    ours, theirs = _final_weights(out_dir), _final_weights(reference)
    first = _final_weights(out_dir, "checkpoints/step-000000006")
    assert not torch.allclose(first["aux_head.weight"], ours["aux_head.weight"])  # the aux head trains
    _assert_close(ours, theirs)
    assert _losses(out_dir) == pytest.approx(_losses(reference), rel=1e-4)


def test_mix_token_trains_over_two_processes(settings, tmp_path):
    out_dir = tmp_path / "run"
    result = torchrun(["train", *_set_args(_overrides(out_dir, *settings, "token_labels.mix_token=true"))], nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = _losses(out_dir)
    assert losses and all(loss == loss for loss in losses)
    evals = [record for record in read_jsonl(out_dir / "metrics.jsonl") if record["event"] == "eval"]
    assert "cls_top1" in evals[-1]
