"""performance.compile: every block compiled, every shape compiled before the clock, none during training.

A counting torch.compile backend (it runs the captured graph as is) records each graph compiled, so
the tests see exactly when compilation happens without paying for inductor.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch._dynamo import register_backend

from tests.conftest import make_config
from vitrain.checkpoint import load_checkpoint
from vitrain.checkpoint.rng import capture_rng_state
from vitrain.metrics import NullWriter, read_jsonl
from vitrain.train import make_plan, train
from vitrain.train.build import build_run, forward_shapes, warm_up_compiled_shapes
from vitrain.train.loop import Trainer

COMPILED: collections.Counter = collections.Counter()


@register_backend
def counting_backend(graph_module, example_inputs):
    COMPILED[tuple(tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor))[:1]] += 1
    return graph_module.forward


@pytest.fixture
def compile_overrides(small_synthetic_overrides):
    torch._dynamo.reset()
    COMPILED.clear()
    return [
        *small_synthetic_overrides,
        "data.image_size=28",
        "data.synthetic_num_eval=30",  # eval batch 32: the single eval batch is padded
        "curriculum.stages=[{until: 0.5, image_size: 14}]",
        "train.micro_batch_size=6",  # pieces of 6, 6, 4: two training shapes per stage
    ]


def test_every_shape_compiles_before_the_clock_and_warm_up_changes_nothing(compile_overrides):
    plan = make_plan(
        make_config(*compile_overrides, "performance.compile=true", "performance.compile_backend=counting_backend")
    )
    assert forward_shapes(plan) == [(6, 14), (4, 14), (6, 28), (4, 28)]
    run = build_run(plan)
    weights = {name: value.clone() for name, value in run.model.state_dict().items()}
    rng = capture_rng_state()["torch"]
    warm_up_compiled_shapes(run)
    assert all(torch.equal(weights[name], value) for name, value in run.model.state_dict().items())
    assert torch.equal(capture_rng_state()["torch"], rng)
    assert all(param.grad is None for param in run.model.parameters())
    compiled_before = sum(COMPILED.values())
    assert compiled_before >= 5  # 4 training shapes and the eval shape (a graph per shape at least)
    Trainer(run, NullWriter()).train()
    assert sum(COMPILED.values()) == compiled_before  # nothing compiled while the clock ran


def test_compiled_training_equals_eager(compile_overrides, tmp_path):
    eager = make_plan(make_config(*compile_overrides, f"train.out_dir={tmp_path / 'eager'}"))
    compiled = make_plan(
        make_config(
            *compile_overrides,
            "performance.compile=true",
            "performance.compile_backend=counting_backend",
            f"train.out_dir={tmp_path / 'compiled'}",
        )
    )
    train(eager)
    train(compiled)
    final = "checkpoints/step-000000018.pt"
    ours, reference = (
        load_checkpoint(compiled.out_dir / final)["model"],
        load_checkpoint(eager.out_dir / final)["model"],
    )
    for key in reference:
        assert torch.allclose(ours[key], reference[key], rtol=1e-4, atol=1e-6), key
    events = [record for record in read_jsonl(compiled.out_dir / "metrics.jsonl") if record["event"] == "compile"]
    assert len(events) == 1 and events[0]["shapes"] == [[6, 14], [4, 14], [6, 28], [4, 28]]


def test_the_compile_mode_reaches_every_block_and_needs_inductor(compile_overrides, monkeypatch):
    from vitrain.config import ConfigError
    from vitrain.train.build import build_training_step

    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda module, **kwargs: calls.append((module, kwargs)))
    mode, compiled = (
        "performance.compile_mode=max-autotune-no-cudagraphs",
        [*compile_overrides, "performance.compile=true"],
    )
    plan = make_plan(make_config(*compiled, "performance.compile_backend=inductor", mode))
    model = build_training_step(plan).forward_module
    assert [module for module, _ in calls] == list(model.block_modules())
    assert all(
        kwargs == {"backend": "inductor", "dynamic": False, "mode": "max-autotune-no-cudagraphs"} for _, kwargs in calls
    )
    calls.clear()
    build_training_step(make_plan(make_config(*compiled, "performance.compile_backend=inductor")))
    assert calls and all(kwargs["mode"] is None for _, kwargs in calls)  # default: torch's own
    with pytest.raises(ConfigError, match="compile_mode=max-autotune-no-cudagraphs is a mode of inductor"):
        make_plan(make_config(*compiled, "performance.compile_backend=counting_backend", mode))
    with pytest.raises(ConfigError, match="compile_mode"):
        make_config(*compile_overrides, "performance.compile_mode=turbo")
