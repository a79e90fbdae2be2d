"""Objectives: what a training step optimizes plugs into :class:`TrainStep` from outside it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from vitrain.config import precision_policy
from vitrain.train.objectives import Classification
from vitrain.train.step import TrainStep, build_grad_scaler

pytestmark = pytest.mark.usefixtures("one_thread")


class ScaledRegression:
    """A made-up objective: ``scale`` x the mean squared distance of the outputs to the targets; ``scale`` comes
    with each step call. Records what the step handed it."""

    def __init__(self):
        self.seen: list[tuple] = []

    def forward(self, model, images, targets, *, scale):
        self.seen.append(("forward", tuple(images.shape), scale))
        return model(images)

    def loss(self, outputs, targets, *, scale):
        self.seen.append(("loss", tuple(outputs.shape), scale))
        return scale * ((outputs - targets) ** 2).mean()

    def warm_up(self, model, images):
        self.seen.append(("warm_up", tuple(images.shape)))
        return model(images)


def _tiny_step(objective, micro_batch=None, lr=0.5):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    policy = precision_policy("fp32", "autocast", "cpu")
    step = TrainStep(model, optimizer, build_grad_scaler(policy), policy, objective, None, micro_batch=micro_batch)
    return model, step


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_a_custom_objective_gives_its_gradient_through_the_unchanged_step(micro_batch):
    objective = ScaledRegression()
    model, step = _tiny_step(objective, micro_batch)
    reference = copy.deepcopy(model)
    images = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    targets = torch.randn(4, 2, generator=torch.Generator().manual_seed(2))
    expected_loss = 3.0 * ((reference(images) - targets) ** 2).mean()
    expected_loss.backward()

    loss, grad_norm = step(images, targets, scale=3.0)

    assert torch.allclose(loss, expected_loss.detach(), rtol=1e-6)
    expected_norm = torch.cat([param.grad.reshape(-1) for param in reference.parameters()]).norm()
    assert torch.allclose(grad_norm, expected_norm, rtol=1e-6) and step.skipped.item() == 0.0
    for param, before in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(param.grad, before.grad, rtol=1e-5, atol=1e-7)
        assert torch.allclose(param, before - 0.5 * before.grad, rtol=1e-5, atol=1e-7)  # SGD's update
    pieces = [(4, 3)] if micro_batch is None else [(2, 3), (2, 3)]
    expected_calls = [call for shape in pieces for call in (("forward", shape, 3.0), ("loss", (shape[0], 2), 3.0))]
    assert objective.seen == expected_calls  # every micro-batch, the step call's context each time


def test_a_custom_objective_warms_up_without_changing_the_weights():
    objective = ScaledRegression()
    model, step = _tiny_step(objective)
    before = copy.deepcopy(model.state_dict())
    step.warm_up([torch.randn(4, 3), torch.randn(2, 3)])
    assert objective.seen == [("warm_up", (4, 3)), ("warm_up", (2, 3))]
    assert all(param.grad is None for param in model.parameters())
    assert all(torch.equal(model.state_dict()[key], value) for key, value in before.items())


def test_a_non_finite_custom_loss_skips_the_step():
    class Infinite(ScaledRegression):
        def loss(self, outputs, targets, *, scale):
            return super().loss(outputs, targets, scale=scale) * float("inf")

    model, step = _tiny_step(Infinite())
    before = copy.deepcopy(model.state_dict())
    step(torch.randn(4, 3), torch.randn(4, 2), scale=1.0)
    assert step.skipped.item() == 1.0
    assert all(torch.equal(model.state_dict()[key], value) for key, value in before.items())


def test_classification_is_the_training_loss_of_the_logits():
    model, step = _tiny_step(Classification("ce", 0.1))
    reference = copy.deepcopy(model)
    images, labels = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    loss, _ = step(images, labels)
    expected = nn.functional.cross_entropy(reference(images), labels, label_smoothing=0.1)
    assert torch.allclose(loss, expected)
    with pytest.raises(TypeError):  # an input the objective does not take is an error, not ignored
        step(images, labels, token_box=None)
