"""Non-finite losses and gradient norms: the step is skipped (nothing changes), a streak longer than
train.max_skipped_steps stops the run with a diagnostic."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import make_config
from vitrain.checkpoint import load_checkpoint
from vitrain.cli import main
from vitrain.config import precision_policy
from vitrain.metrics import read_jsonl
from vitrain.models import build_model
from vitrain.train import make_plan, train
from vitrain.train.objectives import Classification
from vitrain.train.optim import MuonAdamW, adam_step_unless_found_inf
from vitrain.train.step import TrainStep, build_grad_scaler

NAN = float("nan")


pytestmark = pytest.mark.usefixtures("one_thread")


def _poison(step: TrainStep) -> None:
    """Every later forward of ``step`` returns NaN logits (as a corrupt batch or an overflow would)."""
    forward = step.objective.forward
    step.objective.forward = lambda model, images, targets: forward(model, images, targets) * NAN


def _snapshot(step: TrainStep) -> dict:
    return {
        "model": copy.deepcopy(step.model.state_dict()),
        "optimizer": copy.deepcopy(step.optimizer.state_dict()["state"]),
    }


def _assert_snapshots_equal(after: dict, before: dict) -> None:
    for key, tensor in before["model"].items():
        assert torch.equal(after["model"][key], tensor), key
    for index, values in before["optimizer"].items():
        for name, value in values.items():
            assert torch.equal(torch.as_tensor(after["optimizer"][index][name]), torch.as_tensor(value)), (index, name)


def _muon_and_adamw(params: list[torch.nn.Parameter]) -> MuonAdamW:
    matrices = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]
    return MuonAdamW([{"params": matrices, "use_muon": True}, {"params": rest}], lr=1e-3)


OPTIMIZERS = {
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),  # skipped on the device
    "adamw-for-loop": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False),  # one host read per step
    "sgd-fused": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True),
    "muon": lambda params: _muon_and_adamw(list(params)),  # Muon's momentum and AdamW's moments both stay
}


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", ["vit_tiny6_patch7", "localvit_tiny6_patch7"])  # the latter has BatchNorm
def test_a_non_finite_step_changes_nothing(model_name, optimizer_name):
    torch.manual_seed(0)
    model = build_model(model_name, img_size=14, in_chans=1, num_classes=4, embed_dim=48)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    policy = precision_policy("fp32", "autocast", "cpu")
    step = TrainStep(model, optimizer, build_grad_scaler(policy), policy, Classification(), 1.0)
    images, labels = torch.randn(8, 1, 14, 14), torch.randint(4, (8,))
    step(images, labels)
    assert step.skipped.item() == 0.0
    before = _snapshot(step)
    _poison(step)
    loss, grad_norm = step(images, labels)
    assert step.skipped.item() == 1.0 and loss.isnan() and grad_norm.isnan()
    _assert_snapshots_equal(_snapshot(step), before)  # weights, moments, step counts, BatchNorm statistics


def test_fp16_overflow_skips_and_lowers_the_loss_scale():
    torch.manual_seed(0)
    model = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=48)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    policy = precision_policy("fp16", "autocast", "cpu")
    step = TrainStep(model, optimizer, build_grad_scaler(policy), policy, Classification(), 1.0)
    images, labels = torch.randn(8, 1, 14, 14), torch.randint(4, (8,))
    step(images, labels)
    scale, before = step.scaler.get_scale(), _snapshot(step)
    step.scaler.update(new_scale=1e38)  # the scaled loss overflows fp16 gradients: inf grad norm
    step(images, labels)
    assert step.skipped.item() == 1.0
    assert step.scaler.get_scale() == pytest.approx(0.5e38)
    _assert_snapshots_equal(_snapshot(step), before)
    step.scaler.update(new_scale=scale)
    step(images, labels)
    assert step.skipped.item() == 0.0


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_the_device_skip_is_fused_adamws_step_bitwise_and_sets_no_optimizer_attribute(weight_decay):
    """The flag reaches the fused kernel as an argument: the update is step()'s bit for bit when it is 0, none
    when it is 1, no grad_scale/found_inf attribute is ever set on the optimizer, and the step hooks still run."""
    torch.manual_seed(0)
    model = build_model("vit_tiny6_patch7", img_size=14, in_chans=1, num_classes=4, embed_dim=48)
    twin = copy.deepcopy(model)
    ours, theirs = (
        torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=weight_decay, fused=True) for m in (model, twin)
    )
    seen = []
    ours.register_step_pre_hook(lambda opt, args, kwargs: seen.append(("pre", hasattr(opt, "found_inf"))))
    ours.register_step_post_hook(lambda opt, args, kwargs: seen.append(("post", hasattr(opt, "grad_scale"))))
    for flag in (0.0, 0.0, 1.0, 0.0):
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        adam_step_unless_found_inf(ours, torch.tensor(flag))
        if not flag:
            theirs.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    for state, twin_state in zip(ours.state.values(), theirs.state.values(), strict=True):
        assert all(torch.equal(state[key], twin_state[key]) for key in ("step", "exp_avg", "exp_avg_sq"))
    assert seen == [("pre", False), ("post", False)] * 4


def _nan_on_steps(monkeypatch, steps: set[int]) -> dict[int, dict]:
    """Make the forward of the given 1-based steps return NaN; return the model state after each step."""
    original_call, original_forward = TrainStep.__call__, Classification.forward
    after: dict[int, dict] = {}

    def forward(self, model, images, targets):
        logits = original_forward(self, model, images, targets)
        return logits * NAN if len(after) + 1 in steps else logits

    def call(self, images, labels):
        outputs = original_call(self, images, labels)
        after[len(after) + 1] = copy.deepcopy(self.model.state_dict())
        return outputs

    monkeypatch.setattr(Classification, "forward", forward)
    monkeypatch.setattr(TrainStep, "__call__", call)
    return after


def test_transient_nan_steps_are_skipped_and_the_run_goes_on(small_synthetic_overrides, monkeypatch):
    after = _nan_on_steps(monkeypatch, {3, 4})
    plan = make_plan(make_config(*small_synthetic_overrides, "train.max_skipped_steps=2"))
    summary = train(plan)
    assert summary["steps"] == 18 and summary["skipped_steps"] == 2
    for key, tensor in after[2].items():
        assert torch.equal(after[4][key], tensor), key  # steps 3 and 4 changed nothing
    assert any(not torch.equal(after[5][key], tensor) for key, tensor in after[4].items())
    records = read_jsonl(plan.out_dir / "metrics.jsonl")
    records = {record["step"]: record for record in records if record["event"] == "train"}
    assert records[4]["loss"] is None and records[4]["grad_norm"] is None and records[4]["skipped_steps"] == 2
    assert records[6]["loss"] > 0 and records[18]["skipped_steps"] == 2


def test_persistent_nan_stops_with_the_diagnostic(small_synthetic_overrides, monkeypatch, capsys):
    """NaN from step 5 on, at most 3 skips in a row: checkpoints at 2, 4 and 6 (steps 5-6 skipped), and the
    stop at step 8, the fourth skip in a row, before its checkpoint."""
    _nan_on_steps(monkeypatch, set(range(5, 100)))
    overrides = [*small_synthetic_overrides, "train.max_skipped_steps=3", "train.log_every_steps=1"]
    overrides += ["checkpoint.every_steps=2", "checkpoint.keep_last=10"]
    assert main(["train", *[arg for override in overrides for arg in ("--set", override)]]) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    checkpoints = make_plan(make_config(*overrides)).out_dir / "checkpoints"
    assert "4 steps in a row had a non-finite loss or gradient norm" in message
    assert "train.max_skipped_steps=3" in message and "stopped at step 8" in message
    assert "grad norm nan" in message and "lr " in message
    assert f"last complete checkpoint: {checkpoints / 'step-000000006.pt'}" in message
    assert sorted(path.name for path in checkpoints.glob("step-*.pt")) == [
        "step-000000002.pt",
        "step-000000004.pt",
        "step-000000006.pt",
    ]
    step4, step6 = (
        load_checkpoint(checkpoints / "step-000000004.pt"),
        load_checkpoint(checkpoints / "step-000000006.pt"),
    )
    for key, tensor in step4["model"].items():
        assert torch.equal(step6["model"][key], tensor), key  # the skipped steps left the weights alone
    assert (step6["state"]["skipped_steps"], step6["state"]["skip_streak"]) == (2, 2)
