"""The weight EMA (train.ema_*): its update against the formula (decay, timm's warm-up, cadence), skipped
steps, fp32 averages of the O2 master and of full-precision-mode weights, bitwise resume, the eval
records and summary, and ``vitrain eval``/``export --weights ema``. FSDP: tests/dist/test_sharded.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from timm.utils.model_ema import ModelEmaV3
from torch import nn

from tests.conftest import SMALL_SYNTHETIC_RUN, assert_same_training_state, make_config
from vitrain.checkpoint import CheckpointError, find_latest_checkpoint, load_checkpoint
from vitrain.cli import main
from vitrain.config import ConfigError, EmaPlan
from vitrain.metrics import read_jsonl
from vitrain.train import build_model_for, make_plan, train
from vitrain.train.ema import ModelEma, ema_decay_at
from vitrain.train.objectives import Classification

pytestmark = pytest.mark.usefixtures("one_thread")


NAN = float("nan")


def test_warm_up_is_timm_model_ema_v3s():
    timm_ema = ModelEmaV3(nn.Linear(2, 2), decay=0.99, use_warmup=True)
    for step in [*range(1, 40), 500, 10_000]:
        assert ema_decay_at(step, 0.99, warmup=True) == pytest.approx(timm_ema.get_decay(step), abs=1e-15), step
    assert ema_decay_at(10_000, 0.99, warmup=True) == 0.99  # capped at the decay
    assert ema_decay_at(1, 0.99, warmup=False) == 0.99


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


@pytest.mark.parametrize("warmup", [False, True])
def test_update_follows_the_formula_and_a_skipped_step_changes_nothing(warmup):
    model = _tiny_model()
    ema = ModelEma(model, EmaPlan(decay=0.9, warmup=warmup, evaluate=True))
    expected = {name: param.detach().double().clone() for name, param in model.named_parameters()}
    for step in range(1, 5):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param))  # as an optimizer step would
            model[1].running_mean.add_(1.0)
        ema.update(step, skipped=torch.tensor(0.0))
        decay = ema_decay_at(step, 0.9, warmup)
        for name, param in model.named_parameters():
            expected[name] = decay * expected[name] + (1 - decay) * param.detach().double()
    state = ema.state_dict()
    for name, value in expected.items():
        assert state[name].dtype == torch.float32
        assert torch.allclose(state[name].double(), value, rtol=0, atol=1e-6), name
    assert torch.equal(state["1.running_mean"], model[1].running_mean)  # buffers copied, not averaged
    if warmup:  # the first update took the weights (decay 0), so the average moved far from the start
        assert not torch.allclose(state["0.weight"], _tiny_model()[0].weight.detach(), atol=0.1)

    before = {name: tensor.clone() for name, tensor in state.items() if "running" not in name}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    ema.update(5, skipped=torch.tensor(1.0))
    assert all(torch.equal(ema.state_dict()[name], tensor) for name, tensor in before.items())


def test_applied_evaluates_the_average_and_puts_the_live_weights_back():
    model = _tiny_model()
    ema = ModelEma(model, EmaPlan(decay=0.5, evaluate=True))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)
    ema.update(1)
    live = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with ema.applied() as applied:
        assert applied is model
        assert torch.equal(model[0].weight, ema.state_dict()["0.weight"])
        assert not torch.equal(model[0].weight, live["0.weight"])
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in live.items())


def _run_overrides(small_synthetic_overrides, *extra):
    return [*small_synthetic_overrides, "checkpoint.every_steps=1", "checkpoint.keep_last=1000", *extra]


def _ema_and_weights(out_dir, step):
    payload = load_checkpoint(out_dir / "checkpoints" / f"step-{step:09d}.pt")
    return payload["ema"], payload["model"]


@pytest.mark.parametrize(
    ("settings", "decay"),
    [
        (["train.ema.decay=0.8", "train.ema.every_steps=2"], lambda step: 0.8),
        (["train.ema.decay=0.99", "train.ema.warmup=true"], lambda step: ema_decay_at(step, 0.99, True)),
    ],
    ids=["every-2-steps", "warm-up"],
)
def test_training_loop_updates_the_ema_by_the_formula_at_its_cadence(small_synthetic_overrides, settings, decay):
    """Six steps with a checkpoint after each: the saved EMA follows the saved weights."""
    plan = make_plan(make_config(*_run_overrides(small_synthetic_overrides, "train.epochs=1", *settings)))
    train(plan)
    torch.manual_seed(plan.seed)  # the run's initial weights, built as the run built them
    expected = {name: value.double() for name, value in build_model_for(plan).state_dict().items()}
    every = plan.ema.every_steps
    for step in range(1, 7):
        ema, weights = _ema_and_weights(plan.out_dir, step)
        if step % every == 0:
            expected = {
                key: decay(step) * value + (1 - decay(step)) * weights[key].double() for key, value in expected.items()
            }
        for key, value in expected.items():
            assert torch.allclose(ema[key].double(), value, rtol=0, atol=1e-6), (step, key)


def test_a_skipped_step_leaves_the_ema_as_it_was(small_synthetic_overrides, monkeypatch):
    """Step 4's loss is NaN: the step and its EMA update are skipped (device flag, no host read)."""
    calls = []
    forward = Classification.forward

    def forward_nan_at_step_4(self, model, images, targets):
        calls.append(1)
        return forward(self, model, images, targets) * (NAN if len(calls) == 4 else 1.0)

    monkeypatch.setattr(Classification, "forward", forward_nan_at_step_4)
    plan = make_plan(make_config(*_run_overrides(small_synthetic_overrides, "train.epochs=1", "train.ema.decay=0.8")))
    train(plan)
    (ema_3, weights_3), (ema_4, weights_4), (ema_5, _) = (_ema_and_weights(plan.out_dir, step) for step in (3, 4, 5))
    assert load_checkpoint(plan.out_dir / "checkpoints" / "step-000000004.pt")["state"]["skipped_steps"] == 1
    assert all(torch.equal(weights_4[key], value) for key, value in weights_3.items())
    assert all(torch.equal(ema_4[key], value) for key, value in ema_3.items())
    assert not torch.equal(ema_5["head.weight"], ema_4["head.weight"])  # and the next step updates it again


@pytest.mark.parametrize("mode", ["o2", "full"])
def test_the_ema_averages_fp32_weights_in_low_precision_modes(small_synthetic_overrides, mode):
    """O2: the fp32 master, not its bf16 copy (with warm-up, the first update takes the weights exactly);
    full: an fp32 average of the bf16 weights."""
    settings = ["precision=bf16", f"precision_mode={mode}", "train.steps=2", "train.ema.decay=0.9"]
    settings += ["train.ema.warmup=true", "optim.eps=1e-4", "performance.cpu_kernels=native"]  # no kernel build
    plan = make_plan(make_config(*_run_overrides(small_synthetic_overrides, *settings)))
    train(plan)
    (ema_1, weights_1), (ema_2, weights_2) = (_ema_and_weights(plan.out_dir, step) for step in (1, 2))
    floating = [key for key, value in weights_1.items() if value.is_floating_point()]
    assert {ema_2[key].dtype for key in floating} == {torch.float32}
    if mode == "o2":
        assert {weights_1[key].dtype for key in floating} == {torch.float32}  # the master
        assert all(torch.equal(ema_1[key], weights_1[key]) for key in floating)
        rounded = weights_1["head.weight"].bfloat16().float()
        assert not torch.equal(rounded, weights_1["head.weight"])  # so a bf16 average would differ
    else:
        assert weights_1["head.weight"].dtype == torch.bfloat16
        assert all(torch.equal(ema_1[key], weights_1[key].float()) for key in floating)
    decay = ema_decay_at(2, 0.9, True)
    for key in floating:
        expected = decay * ema_1[key].double() + (1 - decay) * weights_2[key].double()
        assert torch.allclose(ema_2[key].double(), expected, rtol=0, atol=1e-6), key


EMA_SETTINGS = ["train.ema.decay=0.9", "train.ema.warmup=true", "train.ema.every_steps=2"]


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """12 steps over 2 epochs with the EMA updated every other step and a checkpoint after every step."""
    out_dir = tmp_path_factory.mktemp("ema") / "run"
    overrides = [
        *SMALL_SYNTHETIC_RUN,
        f"train.out_dir={out_dir}",
        *EMA_SETTINGS,
        "train.epochs=2",
        "train.log_every_steps=3",
        "model.drop_path_rate=0.1",  # the RNG stream must survive evaluating the EMA and resuming
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = make_plan(make_config(*overrides, "checkpoint.every_steps=1", "checkpoint.keep_last=1000"))
        train(plan)
    finally:
        torch.set_num_threads(threads)
    return plan, overrides


def test_resume_mid_run_ends_bitwise_equal_ema_included(ema_run, tmp_path):
    plan, overrides = ema_run
    final = find_latest_checkpoint(plan.out_dir)
    for step in (5, 9):  # mid-epoch between two EMA updates; after an eval of both weights
        folder = tmp_path / f"from-{step}"
        (folder / "checkpoints").mkdir(parents=True)
        shutil.copy(plan.out_dir / "checkpoints" / f"step-{step:09d}.pt", folder / "checkpoints")
        train(make_plan(make_config(*overrides, f"train.out_dir={folder}")), resume="auto")
        resumed = find_latest_checkpoint(folder)
        assert_same_training_state(resumed, final)
        ours, reference = load_checkpoint(resumed), load_checkpoint(final)
        assert ours["ema"].keys() == reference["ema"].keys()
        assert all(torch.equal(ours["ema"][key], value) for key, value in reference["ema"].items()), step
        assert ours["state"]["best_ema_top1"] == reference["state"]["best_ema_top1"]


def test_eval_records_summary_and_cli_carry_the_ema(ema_run, tmp_path, capsys):
    plan, overrides = ema_run
    evals = [record for record in read_jsonl(plan.out_dir / "metrics.jsonl") if record["event"] == "eval"]
    assert [record["step"] for record in evals] == [6, 12]
    assert all({"top1", "ema_top1", "ema_top5", "ema_loss"} <= record.keys() for record in evals)
    summary = json.loads((plan.out_dir / "summary.json").read_text())
    assert summary["final_ema_top1"] == evals[-1]["ema_top1"]
    assert summary["best_ema_top1"] == max(record["ema_top1"] for record in evals)
    assert [record["ema_loss"] for record in evals] != [record["loss"] for record in evals]

    final = find_latest_checkpoint(plan.out_dir)
    for weights, key in (("ema", "ema_"), ("live", "")):
        assert main(["eval", "--checkpoint", str(final), "--weights", weights]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["weights"] == weights
        assert result["loss"] == pytest.approx(evals[-1][f"{key}loss"], rel=1e-6)

    out = tmp_path / "ema.safetensors"
    assert main(["export", "--checkpoint", str(final), "--out", str(out), "--weights", "ema"]) == 0
    exported, saved = load_file(str(out)), load_checkpoint(final)["ema"]
    assert exported.keys() == saved.keys() and all(torch.equal(exported[key], saved[key]) for key in saved)

    # evaluating the average leaves training alone: without it, the same weights bitwise
    plain = make_plan(make_config(*overrides, "train.ema.evaluate=false", f"train.out_dir={tmp_path / 'no-eval'}"))
    train(plain)
    assert_same_training_state(find_latest_checkpoint(plain.out_dir), final)
    assert "ema_top1" not in read_jsonl(plain.out_dir / "metrics.jsonl")[-1]


def test_eval_and_export_of_a_checkpoint_without_ema_say_so(small_synthetic_overrides, tmp_path, capsys):
    plan = make_plan(make_config(*small_synthetic_overrides, "train.steps=1"))
    train(plan)
    checkpoint = str(find_latest_checkpoint(plan.out_dir))
    assert main(["eval", "--checkpoint", checkpoint, "--weights", "ema"]) == 2
    assert "holds no ema weights" in capsys.readouterr().err
    assert (
        main(["export", "--checkpoint", checkpoint, "--out", str(tmp_path / "a.safetensors"), "--weights", "ema"]) == 2
    )
    assert "train.ema.decay=0" in capsys.readouterr().err


def test_sharded_format_saves_and_resumes_the_ema_in_one_process(small_synthetic_overrides, tmp_path):
    overrides = [*small_synthetic_overrides, *EMA_SETTINGS, "train.epochs=2", "checkpoint.format=sharded"]
    straight = make_plan(make_config(*overrides))
    train(straight)
    folder = tmp_path / "resumed"
    shutil.copytree(straight.out_dir / "checkpoints" / "step-000000006", folder / "checkpoints" / "step-000000006")
    train(make_plan(make_config(*overrides, f"train.out_dir={folder}")), resume="auto")
    exported = []
    for run_dir in (straight.out_dir, folder):
        out = tmp_path / f"{run_dir.name}.safetensors"
        checkpoint = run_dir / "checkpoints" / "step-000000012"
        assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out), "--weights", "ema"]) == 0
        exported.append(load_file(str(out)))
    resumed, reference = exported
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[key], value) for key, value in reference.items())


def test_resuming_a_checkpoint_without_ema_into_a_run_with_one_is_refused(small_synthetic_overrides, tmp_path):
    plan = make_plan(make_config(*small_synthetic_overrides, "train.steps=2"))
    train(plan)
    resumed = make_plan(make_config(*small_synthetic_overrides, "train.steps=4", "train.ema.decay=0.9"))
    with pytest.raises(CheckpointError, match="holds no weight EMA"):
        train(resumed, resume="auto")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.ema.warmup=true"], "train.ema.warmup=True has no effect without an EMA"),
        (["train.ema.every_steps=4"], "train.ema.every_steps=4 has no effect"),
        (["train.ema.decay=0.9", "train.ema.every_steps=50"], "train.ema.every_steps=50 exceeds the run's 18 "),
        (["train.ema.decay=1.0"], "train.ema.decay"),
    ],
)
def test_ema_mistakes_name_the_key(small_synthetic_overrides, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_plan(make_config(*small_synthetic_overrides, *overrides))


def test_show_config_lists_the_ema_keys(capsys):
    assert main(["show-config", "--raw"]) == 0
    shown = capsys.readouterr().out
    ema = shown[shown.index("  ema:") :]
    assert all(f"    {key}:" in ema for key in ("decay", "warmup", "every_steps", "evaluate"))
