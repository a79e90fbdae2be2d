"""train.profile=START:N: a torch.profiler trace of the named steps, its files in the summary."""

from __future__ import annotations

import json

import pytest

from tests.conftest import make_config
from vitrain.config import ConfigError
from vitrain.train import make_plan, train


def _traced_steps(trace_path) -> list[int]:
    events = json.loads(trace_path.read_text())["traceEvents"]
    names = {event.get("name", "") for event in events}
    return sorted(int(name.split("#")[1]) for name in names if name.startswith("ProfilerStep#"))


def test_profile_traces_the_named_steps(small_synthetic_overrides):
    plan = make_plan(make_config(*small_synthetic_overrides, "train.steps=6", "train.profile=2:3"))
    summary = train(plan)
    profile = summary["profile"]
    assert profile["steps"] == [2, 4]
    trace = plan.out_dir / "profile" / "rank0.pt.trace.json"
    assert profile["trace"] == str(trace) and _traced_steps(trace) == [2, 3, 4]
    ops = (plan.out_dir / "profile" / "rank0-ops.txt").read_text()
    assert "aten::addmm" in ops or "aten::mm" in ops  # the blocks' linear layers were traced
    assert "memory_snapshot" not in profile  # CUDA only
    assert json.loads((plan.out_dir / "summary.json").read_text())["profile"] == profile


def test_a_trace_the_run_outlives_ends_with_the_run(small_synthetic_overrides):
    plan = make_plan(make_config(*small_synthetic_overrides, "train.steps=4", "train.profile=3:5"))
    summary = train(plan)
    assert summary["profile"]["steps"] == [3, 3]
    assert _traced_steps(plan.out_dir / "profile" / "rank0.pt.trace.json") == [3]


def test_no_profile_without_the_key(small_synthetic_overrides):
    plan = make_plan(make_config(*small_synthetic_overrides, "train.steps=2"))
    assert train(plan)["profile"] is None and not (plan.out_dir / "profile").exists()


@pytest.mark.parametrize("text", ["abc", "3", "3:0", "-1:2", "2:x", "1.5:2"])
def test_bad_profile_windows_are_refused(small_synthetic_overrides, text):
    with pytest.raises(ConfigError, match=f"train.profile={text}: give START:N"):
        make_plan(make_config(*small_synthetic_overrides, f"train.profile={text}"))
