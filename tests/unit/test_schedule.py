"""LR schedule shape."""

from __future__ import annotations

import math

import pytest

from vitrain.train.schedule import lr_factor


def test_linear_warmup_then_cosine_to_floor():
    factors = [lr_factor(step, 110, 10, "cosine", 0.0, 0.1) for step in range(110)]
    assert factors[0] == 0.0
    assert factors[5] == pytest.approx(0.5)
    assert factors[10] == pytest.approx(1.0)
    assert factors[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))
    assert lr_factor(110, 110, 10, "cosine", 0.0, 0.1) == pytest.approx(0.1)
    assert lr_factor(500, 110, 10, "cosine", 0.0, 0.1) == pytest.approx(0.1)


def test_constant_and_warmup_start():
    assert lr_factor(0, 100, 10, "constant", 0.2, 0.0) == pytest.approx(0.2)
    assert lr_factor(50, 100, 10, "constant", 0.2, 0.0) == 1.0
    assert lr_factor(0, 100, 0, "cosine", 0.0, 0.0) == 1.0
