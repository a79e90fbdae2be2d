"""The training loop: learning, metrics, and exact (bitwise) resume."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tests.conftest import make_config
from vitrain.checkpoint import load_checkpoint
from vitrain.cli import main
from vitrain.metrics import read_jsonl
from vitrain.train import make_plan, train


def test_loss_decreases_and_records_are_written(small_synthetic_overrides, tmp_path):
    plan = make_plan(make_config(*small_synthetic_overrides, "train.epochs=5"))
    summary = train(plan)
    records = read_jsonl(plan.out_dir / "metrics.jsonl")
    losses = [record["loss"] for record in records if record["event"] == "train"]
    assert losses[-1] < 0.6 * losses[0]
    evals = [record for record in records if record["event"] == "eval"]
    assert [record["step"] for record in evals] == [6, 12, 18, 24, 30]
    assert summary["final_top1"] == evals[-1]["top1"] > 50.0  # 10 classes: chance is 10 %
    assert json.loads((plan.out_dir / "summary.json").read_text())["steps"] == 30
    assert summary["images_seen"] == 30 * 16


def _weights(path):
    return load_checkpoint(path)["model"]


@pytest.mark.parametrize("mode", ["fp32", "bf16-o2", "fp8-o2"])
def test_resume_after_epoch_is_bitwise_identical(small_synthetic_overrides, tmp_path, mode):
    if mode == "fp8-o2":
        pytest.importorskip("torchao", reason="precision=fp8 needs torchao (the dev extra installs it)")
    precision = [f"precision={mode.split('-')[0]}", "precision_mode=o2"] if mode != "fp32" else []
    overrides = [
        *small_synthetic_overrides,
        *precision,
        "model.drop_rate=0.1",
        "model.drop_path_rate=0.1",
        "checkpoint.keep_last=5",
    ]
    straight = make_plan(make_config(*overrides))
    train(straight)
    checkpoints = straight.out_dir / "checkpoints"
    final = _weights(checkpoints / "step-000000018.pt")

    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(checkpoints / "step-000000006.pt", resumed_dir / "checkpoints")
    resumed = make_plan(make_config(*overrides, f"train.out_dir={resumed_dir}"))
    summary = train(resumed, resume="auto")
    assert summary["steps"] == 18
    resumed_final = _weights(resumed_dir / "checkpoints" / "step-000000018.pt")
    assert final.keys() == resumed_final.keys()
    for key in final:
        assert torch.equal(final[key], resumed_final[key]), key
    steps = [record["step"] for record in read_jsonl(resumed_dir / "metrics.jsonl")]
    assert steps == sorted(steps) and min(steps) > 6


def test_resume_auto_without_checkpoint_starts_fresh(small_synthetic_overrides):
    plan = make_plan(make_config(*small_synthetic_overrides, "train.steps=2"))
    assert train(plan, resume="auto")["steps"] == 2


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_steps_are_finite_and_keep_fp32_master_weights(small_synthetic_overrides, precision):
    plan = make_plan(make_config(*small_synthetic_overrides, f"precision={precision}", "train.steps=4"))
    summary = train(plan)
    assert summary["precision"] == precision
    losses = [record["loss"] for record in read_jsonl(plan.out_dir / "metrics.jsonl") if record["event"] == "train"]
    assert all(math.isfinite(loss) for loss in losses)
    weights = _weights(plan.out_dir / "checkpoints" / "step-000000004.pt")
    assert all(tensor.dtype == torch.float32 for tensor in weights.values())
    scaler_state = load_checkpoint(plan.out_dir / "checkpoints" / "step-000000004.pt")["scaler"]
    assert bool(scaler_state) == (precision == "fp16")  # loss scaling only for fp16


def test_non_finite_loss_stops_with_step_and_hint(small_synthetic_overrides, capsys):
    argv = ["train"] + [arg for override in small_synthetic_overrides for arg in ("--set", override)]
    argv += ["--set", "optim.lr=1e30", "--set", "optim.grad_clip=null", "--set", "schedule.warmup_epochs=0"]
    argv += ["--set", "train.max_skipped_steps=2"]  # the NaN steps are skipped; the third in a row stops
    assert main(argv) == 1
    message = capsys.readouterr().err.strip()
    assert "at step" in message and "lower optim.lr" in message


def test_o2_step_updates_fp32_master_and_rounds_it_into_the_compute_copy():
    from vitrain.config import precision_policy
    from vitrain.models import build_model
    from vitrain.train.objectives import Classification
    from vitrain.train.step import TrainStep, apply_precision, build_grad_scaler

    def step_for(mode):
        torch.manual_seed(0)
        model = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=48)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        policy = precision_policy("bf16", mode, "cpu")
        low_precision = apply_precision(model, policy)
        return model, TrainStep(
            model, optimizer, build_grad_scaler(policy), policy, Classification(), 1.0, low_precision=low_precision
        )

    images, labels = torch.randn(8, 1, 14, 14), torch.randint(4, (8,))
    o1_model, o1_step = step_for("autocast")
    o2_model, o2_step = step_for("o2")
    o1_losses = [o1_step(images, labels)[0].item() for _ in range(5)]
    o2_losses = [o2_step(images, labels)[0].item() for _ in range(5)]
    assert o2_losses[-1] < o2_losses[0]
    assert all(abs(a - b) < 0.05 * abs(a) for a, b in zip(o1_losses, o2_losses, strict=True)), (o1_losses, o2_losses)
    compute = o2_step.low_precision.compute
    for (name, master), copy in zip(o2_model.named_parameters(), compute.parameters(), strict=True):
        assert master.dtype == torch.float32 and copy.dtype == torch.bfloat16, name
        assert torch.equal(master.to(torch.bfloat16), copy), name
        assert master.grad is not None and master.grad.dtype == torch.float32 and copy.grad is None, name
    assert o1_step.low_precision is None


POLICIES = [(p, m) for p in ("bf16", "fp16") for m in ("autocast", "o2", "full")]


@pytest.mark.parametrize(("precision", "mode"), POLICIES, ids=[f"{p}-{m}" for p, m in POLICIES])
def test_every_precision_policy_tracks_the_fp32_loss(precision, mode):
    """Five AdamW steps on one batch: each policy's losses stay within 5 % of fp32's (full: 10 %, no
    master copy), and its weights, gradients and scaler are where the policy says. eps 1e-3: fp16
    weights need eps >= 1e-4 (config refuses less, see test_fp16_full_refuses_an_adam_eps_that_underflows)."""
    from vitrain.config import precision_policy
    from vitrain.models import build_model
    from vitrain.train.objectives import Classification
    from vitrain.train.step import TrainStep, apply_precision, build_grad_scaler

    def losses_for(precision, mode):
        torch.manual_seed(0)
        model = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=48)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3, fused=True)
        policy = precision_policy(precision, mode, "cpu")
        low_precision = apply_precision(model, policy)
        step = TrainStep(
            model, optimizer, build_grad_scaler(policy), policy, Classification(), 1.0, low_precision=low_precision
        )
        torch.manual_seed(1)
        images, labels = torch.randn(8, 1, 14, 14), torch.randint(4, (8,))
        return [step(images, labels)[0].item() for _ in range(5)], model, step

    reference, _, _ = losses_for("fp32", "autocast")
    losses, model, step = losses_for(precision, mode)
    tolerance = 0.10 if mode == "full" else 0.05
    assert losses[-1] < losses[0], losses
    assert all(abs(a - b) < tolerance * abs(a) for a, b in zip(reference, losses, strict=True)), (reference, losses)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    weights = {parameter.dtype for parameter in model.parameters()}
    assert weights == ({low} if mode == "full" else {torch.float32})
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in model.parameters())
    assert (step.low_precision is not None) == (mode == "o2")
    assert step.scaler.is_enabled() == (precision == "fp16")


def test_o2_keeps_batchnorm_fp32_and_its_running_statistics_reach_the_master():
    from vitrain.config import precision_policy
    from vitrain.models import build_model
    from vitrain.train.objectives import Classification
    from vitrain.train.step import TrainStep, apply_precision, build_grad_scaler

    def run(mode):
        torch.manual_seed(0)
        model = build_model("localvit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=48)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        policy = precision_policy("bf16", mode, "cpu")
        low_precision = apply_precision(model, policy)
        step = TrainStep(
            model, optimizer, build_grad_scaler(policy), policy, Classification(), 1.0, low_precision=low_precision
        )
        torch.manual_seed(1)
        for _ in range(3):
            step(torch.randn(8, 1, 14, 14) + 2.0, torch.randint(4, (8,)))
        return model, step

    o1_model, _ = run("autocast")
    o2_model, o2_step = run("o2")
    compute_norm = o2_step.low_precision.compute.blocks[0].mlp.expand_norm
    master_norm = o2_model.blocks[0].mlp.expand_norm
    assert compute_norm.weight.dtype == torch.float32
    assert compute_norm.running_mean is master_norm.running_mean  # one set of statistics
    assert int(master_norm.num_batches_tracked) == 3
    assert o2_step.low_precision.compute.blocks[0].mlp.expand.weight.dtype == torch.bfloat16
    for name, buffer in o1_model.named_buffers():
        if name.endswith("running_mean"):
            o2_buffer = dict(o2_model.named_buffers())[name]
            assert o2_buffer.abs().sum() > 0, name  # moved from its zero init
            assert torch.allclose(o2_buffer, buffer, rtol=0.1, atol=0.05), name


def test_model_options_from_the_config_reach_the_model(small_synthetic_overrides):
    from vitrain.train import build_model_for

    plan = make_plan(make_config(*small_synthetic_overrides, "model.mlp_ratio=2", "model.head=gap"))
    model = build_model_for(plan)
    assert model.blocks[0].mlp.fc1.out_features == 2 * model.args.embed_dim
    assert model.args.head == "gap" and model.cls_token is None


def test_channels_last_converts_model_and_input_and_trains_the_same(small_synthetic_overrides):
    from vitrain.bench.throughput import synthetic_batch
    from vitrain.train.build import build_training_step

    def two_steps(channels_last):
        plan = make_plan(
            make_config(*small_synthetic_overrides, "model.name=resnet50", f"performance.channels_last={channels_last}")
        )
        step = build_training_step(plan)
        images, labels = synthetic_batch(plan)
        losses = [step(images, labels)[0].item() for _ in range(2)]
        return losses, step.model, images

    (plain, _, _), (nhwc, model, images) = two_steps(False), two_steps(True)
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.conv1.weight.is_contiguous()
    assert nhwc == pytest.approx(plain, rel=1e-4)


def test_gradient_accumulation_equals_the_whole_batch(small_synthetic_overrides):
    """Batch 16 in micro-batches of 8, and of 6 (pieces 6, 6, 4): the gradients of the batch at once,
    and the same losses over three steps (weights are not compared after AdamW: it normalizes the
    float noise of gradients that are zero in exact arithmetic, such as the key bias's)."""
    from vitrain.bench.throughput import synthetic_batch
    from vitrain.train.build import build_training_step

    def train_steps(*extra):
        plan = make_plan(make_config(*small_synthetic_overrides, *extra))
        step = build_training_step(plan)
        images, labels = synthetic_batch(plan)
        losses = [step(images, labels)[0].item()]
        gradients = {name: p.grad.clone() for name, p in step.model.named_parameters()}
        losses += [step(images, labels)[0].item() for _ in range(2)]
        return losses, gradients

    reference_losses, reference = train_steps()
    for micro in (8, 6):
        losses, gradients = train_steps(f"train.micro_batch_size={micro}")
        assert losses == pytest.approx(reference_losses, rel=1e-5)
        for name in reference:
            assert torch.allclose(gradients[name], reference[name], rtol=1e-4, atol=1e-7), name


def test_an_o2_step_refuses_to_run_without_its_low_precision_copy():
    from vitrain.config import precision_policy
    from vitrain.models import build_model
    from vitrain.train.objectives import Classification
    from vitrain.train.step import TrainStep, apply_precision, build_grad_scaler

    model = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=48)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    o2, autocast = precision_policy("bf16", "o2", "cpu"), precision_policy("bf16", "autocast", "cpu")
    with pytest.raises(ValueError, match="low-precision copy"):
        TrainStep(model, optimizer, build_grad_scaler(o2), o2, Classification(), 1.0)
    copy = apply_precision(model, o2)
    with pytest.raises(ValueError, match="low-precision copy"):
        TrainStep(model, optimizer, build_grad_scaler(autocast), autocast, Classification(), 1.0, low_precision=copy)


@pytest.mark.parametrize("model_name", ["vit_tiny6_patch7", "localvit_tiny6_patch7"])
def test_flat_o2_buffers_step_bitwise_as_the_per_tensor_copies(model_name):
    """O2's weights and gradients moved through flat buffers: the same weights, optimizer state and compute
    copy as the per-tensor copies after several clipped AdamW steps (LocalViT: BatchNorm keeps an fp32 group
    in the compute copy), in a few ops instead of one or more per parameter."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vitrain.config import precision_policy
    from vitrain.models import build_model
    from vitrain.train.objectives import Classification
    from vitrain.train.step import LowPrecisionWeights, TrainStep, build_grad_scaler

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not func.is_view  # ops that compute (views and aliases launch nothing)
            return func(*args, **(kwargs or {}))

    def run(flat: bool):
        torch.manual_seed(0)
        model = build_model(model_name, img_size=14, in_chans=1, num_classes=4, embed_dim=48)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        policy = precision_policy("bf16", "o2", "cpu")
        low_precision = LowPrecisionWeights(model, policy.compute_dtype, flat=flat)
        step = TrainStep(
            model, optimizer, build_grad_scaler(policy), policy, Classification(), 0.5, low_precision=low_precision
        )
        torch.manual_seed(1)
        for _ in range(4):
            step(torch.randn(8, 1, 14, 14), torch.randint(4, (8,)))
        low_precision.compute(torch.randn(8, 1, 14, 14, dtype=torch.bfloat16)).float().sum().backward()
        with CountOps() as counter:
            low_precision.pull_grads()
            low_precision.push_weights()
        return model, optimizer, low_precision, counter.ops

    flat_model, flat_optimizer, flat_copy, flat_ops = run(True)
    plain_model, plain_optimizer, plain_copy, plain_ops = run(False)
    assert flat_copy.flat is not None and plain_copy.flat is None
    for (name, ours), reference in zip(flat_model.state_dict().items(), plain_model.state_dict().values(), strict=True):
        assert torch.equal(ours, reference), name
    for ours, reference in zip(
        flat_copy.compute.state_dict().values(), plain_copy.compute.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, reference)
    for ours, reference in zip(flat_optimizer.state.values(), plain_optimizer.state.values(), strict=True):
        assert reference and all(torch.equal(ours[key], reference[key]) for key in reference)
    groups = len(flat_copy.flat.groups)
    assert flat_ops <= 1 + groups + len(flat_copy.buffer_pairs) and plain_ops > 10 * flat_ops  # one per bf16 tensor
