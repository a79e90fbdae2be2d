"""Config loading, resolve() arithmetic, and every user mistake named with its key."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from tests.conftest import make_config, old_flat_layout
from vitrain.cli import main
from vitrain.config import (
    MOVED_KEYS,
    Config,
    ConfigError,
    DatasetInfo,
    Hardware,
    World,
    build_config,
    config_to_yaml,
    parse_duration_s,
    parse_override,
    precision_policy,
    resolve,
    stored_config,
)
from vitrain.models import model_facts
from vitrain.recipes import get_recipe, list_recipes

DATA = DatasetInfo(num_train=60000, num_eval=10000, num_classes=10, channels=1, mean=(0.5,), std=(0.25,))
CPU_BF16 = Hardware(cuda_available=False, bf16_supported=True)
CPU_ONLY = Hardware(cuda_available=False, bf16_supported=False)


def test_resolve_scales_lr_and_derives_steps():
    config = make_config("train.batch_size=256", "optim.lr=0.008", "train.epochs=3", "schedule.warmup_epochs=0.5")
    plan = resolve(config, DATA, CPU_BF16, model_facts)
    assert plan.schedule.lr == pytest.approx(0.008 * 256 / 1024)
    assert plan.schedule.steps_per_epoch == 60000 // 256
    assert plan.schedule.total_steps == 3 * 234
    assert (plan.schedule.duration_unit, plan.schedule.run_length, plan.schedule.warmup) == (
        "samples",
        3 * 234 * 256,
        117 * 256,
    )
    assert plan.schedule.epochs == 3 and plan.loop.eval_every_epochs == plan.checkpoint.every_epochs == 1
    assert [(stage.image_size, stage.batch_size) for stage in plan.schedule.stages] == [(28, 256)]
    assert plan.batch.eval_batch == 512


def test_reference_batch_and_steps_override():
    config = make_config(
        "train.batch_size=64",
        "optim.lr=0.001",
        "optim.reference_batch=64",
        "train.steps=10",
        "checkpoint.every_epochs=0",
    )
    plan = resolve(config, DATA, CPU_BF16, model_facts)
    assert plan.schedule.lr == pytest.approx(0.001)
    assert plan.schedule.total_steps == 10
    assert plan.checkpoint.every_epochs == 0


def test_precision_auto_follows_hardware():
    assert resolve(make_config("precision=auto"), DATA, CPU_BF16, model_facts).precision.dtype == "bf16"
    assert resolve(make_config("precision=auto"), DATA, CPU_ONLY, model_facts).precision.dtype == "fp32"
    with pytest.raises(ConfigError, match="precision=bf16"):
        resolve(make_config("precision=bf16"), DATA, CPU_ONLY, model_facts)
    # a CPU without native bf16 runs it emulated when asked, but auto keeps fp32 there
    emulating = Hardware(cuda_available=False, bf16_supported=False, bf16_emulated=True)
    assert resolve(make_config("precision=bf16"), DATA, emulating, model_facts).precision.dtype == "bf16"
    assert resolve(make_config("precision=auto"), DATA, emulating, model_facts).precision.dtype == "fp32"


def test_o2_applies_only_to_low_precision():
    o2 = ("precision=auto", "precision_mode=o2")
    assert resolve(make_config(*o2), DATA, CPU_BF16, model_facts).precision.mode == "o2"
    assert resolve(make_config(*o2), DATA, CPU_ONLY, model_facts).precision.mode == "autocast"
    with pytest.raises(ConfigError, match="precision_mode"):
        resolve(make_config("precision_mode=o3"), DATA, CPU_BF16, model_facts)


POLICIES = {
    # precision, mode, fsdp -> weights, training autocast, loss scaling, input cast
    ("fp32", "o2", False): ("fp32", False, False, False),
    ("bf16", "autocast", False): ("fp32", True, False, False),
    ("bf16", "o2", False): ("low_precision_copy", False, False, True),
    ("bf16", "o2", True): ("fsdp_mixed_precision", False, False, False),
    ("fp16", "autocast", False): ("fp32", True, True, False),
    ("fp16", "full", False): ("low_precision", False, True, True),
}


@pytest.mark.parametrize("key", list(POLICIES), ids=["-".join(map(str, key)) for key in POLICIES])
def test_the_precision_policy_is_decided_in_one_place(key):
    import torch

    policy = precision_policy(*key[:2], "cpu", fsdp=key[2])
    weights, autocast, *_ = POLICIES[key]
    assert (policy.weights, policy.autocast, policy.loss_scaling, policy.casts_inputs) == POLICIES[key]
    assert policy.mode == (key[1] if key[0] != "fp32" else "autocast")
    low = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[key[0]]
    assert policy.compute_dtype == low and policy.weights_dtype == (torch.float32 if weights == "fp32" else low)
    assert isinstance(policy.autocast_context(), torch.autocast) == (key[0] != "fp32")
    assert isinstance(policy.training_context(), torch.autocast) == autocast


def test_resolve_hands_fsdp_its_mixed_precision_and_every_part_its_batch():
    config = make_config("model.name=vit_tiny6_patch7", "precision=bf16", "precision_mode=o2", "train.batch_size=64")
    config.parallel.strategy, config.train.micro_batch_size = "fsdp", 12
    plan = resolve(config, DATA, CPU_BF16, model_facts, world=World(rank=1, size=4))
    assert plan.precision.weights == "fsdp_mixed_precision" and plan.parallel.fsdp
    assert plan.data.batch is plan.batch and plan.batch.per_process(64) == 16 and plan.batch.eval_per_process == 32
    assert plan.batch.forward_batches(64) == [12, 4] and plan.batch.global_of(16) == 64
    single = resolve(config, DATA, CPU_BF16, model_facts)
    assert single.precision.weights == "low_precision_copy" and not single.parallel.fsdp
    assert single.batch.forward_batches(64) == [12, 4]  # 64 = 5 x 12 + 4 on one process


def test_fp16_full_refuses_an_adam_eps_that_underflows():
    full = ("precision=fp16", "precision_mode=full")
    with pytest.raises(ConfigError, match=r"optim.eps=1e-08 .*optim.eps>=0.0001"):
        resolve(make_config(*full), DATA, CPU_BF16, model_facts)
    assert resolve(make_config(*full, "optim.eps=1e-4"), DATA, CPU_BF16, model_facts).precision.mode == "full"
    assert (
        resolve(make_config("precision=bf16", "precision_mode=full"), DATA, CPU_BF16, model_facts).precision.mode
        == "full"
    )


def test_device_cuda_without_cuda_is_rejected():
    with pytest.raises(ConfigError, match="train.device"):
        resolve(make_config("train.device=cuda"), DATA, CPU_ONLY, model_facts)
    assert resolve(make_config("train.device=auto"), DATA, CPU_ONLY, model_facts).device == "cpu"


def test_out_dir_template_is_filled():
    plan = resolve(
        make_config("recipe=abc", "train.out_dir=runs/{recipe}-{time}"), DATA, CPU_ONLY, model_facts, now="T1"
    )
    assert str(plan.out_dir) == "runs/abc-T1"


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (["train.bach_size=3"], "train.bach_size", "did you mean 'train.batch_size'"),
        (["modle.name=x"], "modle", "did you mean 'model'"),
        (["train.batch_size=lots"], "train.batch_size", "integer"),
        (["data.scale=[0.9, 0.1]"], "data.scale", "low <= high"),
        (["precision=fp4"], "precision", "fp32"),
    ],
)
def test_bad_values_name_the_key(overrides, key, fix):
    with pytest.raises(ConfigError) as error:
        make_config(*overrides)
    message = str(error.value)
    assert key in message and fix in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["data.image_size=30"], "data.image_size"),  # 30 % 7 != 0
        (["train.batch_size=0"], "train.batch_size"),
        (["train.batch_size=100000"], "train.batch_size"),
        (["model.name=vit_enormous"], "model.name"),
        (["data.mean=[0.1, 0.2]"], "data.mean"),
        (["data.translate=28"], "data.translate=28"),
        (
            ["model.stem=conv"],
            "model.stem=conv: the convolutional stem needs a power-of-two patch size",
        ),  # the variant's patch 7
        (["model.name=vit_tiny6_convstem_patch8", "model.patch_size=7"], "model.stem=conv"),  # the variant's stem
        (["model.name=resnet50", "data.image_size=32", "model.stem=conv"], "model.stem=conv"),
        (["train.budget=10 minutes"], "train.budget"),
        (["train.budget=0s"], "train.budget"),
        (["train={budget: 10m, steps: 5}"], "train.steps and train.budget"),
        (["train.epochs=null"], "train.epochs"),
        (["curriculum.stages=[{until: 0.5, image_size: 15}]"], r"curriculum.stages[0].image_size"),
        (["curriculum.stages=[{until: 0.5, image_size: 14}, {until: 0.4, image_size: 21}]"], "stages[1].until"),
        (["curriculum.start_size=10", "curriculum.grow_by=7"], "curriculum.start_size"),
        (["curriculum.start_size=28"], "curriculum.start_size"),
        (["curriculum.start_size=14", "curriculum.stages=[{until: 0.5, image_size: 14}]"], "curriculum.stages"),
    ],
)
def test_resolve_rejects_with_key(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        resolve(make_config(*overrides), DATA, CPU_ONLY, model_facts)


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("10m", 600), ("24h", 86400), ("1h30m", 5400), ("1.5h", 5400), ("2d", 172800)]
)
def test_budget_durations(text, seconds):
    assert parse_duration_s(text) == seconds
    plan = resolve(make_config(f"train.budget={text}", "schedule.warmup_epochs=0.5"), DATA, CPU_ONLY, model_facts)
    assert (plan.schedule.duration_unit, plan.schedule.run_length) == ("seconds", seconds)
    assert plan.schedule.warmup == 117 * 256  # images: the warmup is planned in images, the decay in seconds
    assert plan.schedule.total_steps is None and plan.schedule.epochs is None


def test_a_later_layer_s_length_replaces_the_recipe_s():
    budget_recipe = make_config("train.budget=9m")
    assert (budget_recipe.train.epochs, budget_recipe.train.budget) == (None, "9m")
    shortened = make_config("train.epochs=1", base=budget_recipe)
    assert (shortened.train.epochs, shortened.train.budget, shortened.train.steps) == (1, None, None)
    plan = resolve(make_config("train.steps=7", base=budget_recipe), DATA, CPU_ONLY, model_facts)
    assert (plan.schedule.duration_unit, plan.schedule.run_length) == ("steps", 7)


def test_samples_duration():
    plan = resolve(make_config("train.samples=1000", "train.batch_size=100"), DATA, CPU_ONLY, model_facts)
    assert (plan.schedule.duration_unit, plan.schedule.run_length, plan.schedule.total_steps) == ("samples", 1000, 10)


def test_linear_curriculum_rule_with_constant_tokens():
    """The paper's rule at Fashion-MNIST scale: 14 -> 21 -> 28 px (patch 7), one size per 2 epochs."""
    config = make_config(
        "curriculum.start_size=14",
        "curriculum.grow_by=7",
        "curriculum.grow_every_epochs=2",
        "curriculum.batch_rule=constant_tokens",
        "train.batch_size=100",
    )
    plan = resolve(config, DATA, CPU_ONLY, model_facts)
    sizes = [(stage.image_size, stage.batch_size, stage.until_epoch) for stage in plan.schedule.stages]
    assert sizes == [(14, 400, 2.0), (21, 177, 4.0), (28, 100, None)]  # 16 tokens / 4 and / 9
    assert [plan.schedule.stage_at(0.0, epoch).image_size for epoch in (0.0, 1.99, 2.0, 3.99, 4.0, 30.0)] == [
        14,
        14,
        21,
        21,
        28,
        28,
    ]
    assert plan.schedule.total_steps is None  # the batch changes: steps are known only as the run goes


def test_explicit_curriculum_stages_by_fraction_of_the_run():
    config = make_config(
        "curriculum.stages=[{until: 0.25, image_size: 14, batch_size: 512, lr_scale: 2.0}, {until: 0.5, image_size: 21}]"
    )
    plan = resolve(config, DATA, CPU_ONLY, model_facts)
    assert [(stage.image_size, stage.batch_size, stage.lr_scale) for stage in plan.schedule.stages] == [
        (14, 512, 2.0),
        (21, 256, 1.0),
        (28, 256, 1.0),
    ]
    assert [plan.schedule.stage_at(progress, 0.0).image_size for progress in (0.0, 0.2499, 0.25, 0.4999, 0.5, 1.0)] == [
        14,
        14,
        21,
        21,
        28,
        28,
    ]


def test_yaml_file_then_set_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  batch_size: 32\n  epochs: 2\noptim:\n  lr: 0.5\n")
    config = build_config(Config(), [path], ["train.epochs=5"])
    assert (config.train.batch_size, config.train.epochs, config.optim.lr) == (32, 5, 0.5)


def test_bad_yaml_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        build_config(Config(), [tmp_path / "missing.yaml"], [])
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        build_config(Config(), [path], [])


def test_parse_override_types():
    assert parse_override("a.b=3") == {"a": {"b": 3}}
    assert parse_override("a=[1, 2]") == {"a": [1, 2]}
    assert parse_override("a.b=null") == {"a": {"b": None}}
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("novalue")


def test_show_config_raw_round_trips(capsys):
    assert main(["show-config", "--raw", "--set", "train.batch_size=77"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["batch_size"] == 77
    assert Config.model_validate(printed) == build_config(get_recipe("fmnist"), [], ["train.batch_size=77"])
    assert config_to_yaml(Config.model_validate(printed)) == config_to_yaml(Config.model_validate(printed))


def test_show_config_prints_what_the_run_will_do(capsys, tmp_path):
    """auto and the templates resolved in the YAML (which repeats the run as --config), and what it implies."""
    argv = ["--recipe", "fmnist", "--precision", "fp32", "--batch-size", "128", "--epochs", "2"]
    assert main(["show-config", *argv, "--set", "data.limit_train=1280", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    printed = Config.model_validate(yaml.safe_load(out))
    assert (printed.precision, printed.precision_mode, printed.train.device) == ("fp32", "autocast", "cpu")
    assert printed.train.out_dir.startswith("runs/fmnist-") and "{" not in printed.train.out_dir
    assert "# runs on cpu in fp32 autocast" in out
    assert "# lr 0.0015: optim.lr 0.012 x batch 128 / optim.reference_batch 1024" in out
    assert "# length: 2.00 epochs (2,560 images); 10 steps an epoch over 1280 images" in out
    again = tmp_path / "again.yaml"
    again.write_text(out)
    assert main(["show-config", "--raw", "--config", str(again)]) == 0
    assert Config.model_validate(yaml.safe_load(capsys.readouterr().out)) == printed


def test_every_recipe_validates_and_is_documented(tmp_path):
    teacher_weights = tmp_path / "teacher.pth"  # the distilled recipes' teacher: resolve checks that it exists
    teacher_weights.touch()
    recipes = list_recipes()
    assert "fmnist" in recipes
    imagenet = DatasetInfo(
        num_train=1_281_167, num_eval=50_000, num_classes=1000, channels=3, mean=(0.5,) * 3, std=(0.25,) * 3
    )
    for name, doc in recipes.items():
        config = get_recipe(name)
        assert config.recipe == name
        assert doc, f"recipe {name} has no docstring"
        if config.train.distill.teacher is not None and config.train.distill.teacher_weights is None:
            config.train.distill.teacher_weights = teacher_weights
        if config.token_labels.maps is not None:  # resolve checks that the label-map folder exists
            config.token_labels.maps = tmp_path
        plan = resolve(
            config, imagenet if config.data.name == "imagefolder" else DATA, CPU_BF16, model_facts
        )  # model options fit
        assert plan.schedule.stages[-1].image_size == config.data.image_size


def test_borealis_recipe_plans_the_paper_s_curriculum():
    plan = resolve(
        get_recipe("borealis_24h_1gpu"),
        DatasetInfo(
            num_train=1_281_167, num_eval=50_000, num_classes=1000, channels=3, mean=(0.5,) * 3, std=(0.25,) * 3
        ),
        CPU_BF16,
        model_facts,
    )
    assert [stage.image_size for stage in plan.schedule.stages] == [32, 64, 96, 128, 160, 192, 224]
    assert [stage.until_epoch for stage in plan.schedule.stages] == [5, 10, 15, 20, 25, 30, None]
    assert (plan.schedule.duration_unit, plan.schedule.run_length, plan.batch.global_batch, plan.schedule.lr) == (
        "seconds",
        86400,
        64,
        1e-3,
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--set", "train.bach_size=3"], "train.bach_size"),
        (["train", "--set", "data.image_size=30", "--set", "data.name=synthetic"], "data.image_size"),
        (["train", "--set", "train.batch_size=0", "--set", "data.name=synthetic"], "train.batch_size"),
        (["train", "--set", "data.root=/nonexistent/fmnist"], "data.root"),
        (["train", "--set", "data.name=imagefolder"], "data.root"),
        (["train", "--recipe", "nope"], "--recipe"),
        (["eval", "--checkpoint", "/nonexistent.pt"], "/nonexistent.pt"),
    ],
)
def test_cli_exits_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("overrides", "size", "needle"),
    [
        (["parallel.strategy=tp"], 2, "must divide the 3 attention heads"),
        (["parallel.strategy=tp", "model.name=localvit_tiny6_patch7"], 2, "tensor parallelism splits ViT/DeiT blocks"),
        (["parallel.strategy=tp", "model.name=resnet50"], 2, "use parallel.strategy=fsdp or ddp"),
        (["parallel.strategy=fsdp+tp", "model.num_heads=6"], 4, "needs parallel.tp_size"),
        (["parallel.strategy=fsdp+tp", "model.num_heads=6", "parallel.tp_size=3"], 4, "tp_size=3 with 4 processes"),
        (["parallel.strategy=fsdp", "precision=fp16"], 2, "use precision=bf16"),
        (["parallel.strategy=fsdp", "precision=bf16", "precision_mode=full"], 2, "precision_mode=full"),
        (
            ["parallel.strategy=tp", "model.num_heads=6", "precision=bf16", "precision_mode=o2"],
            2,
            "tp with precision_mode=o2",
        ),
        (["parallel.strategy=fsdp", "parallel.fsdp_cpu_offload=true"], 2, "fsdp_cpu_offload=true needs"),
        (["parallel.strategy=fsdp", "optim.name=lamb"], 2, "LAMB's trust ratio needs the norm"),
        (["parallel.strategy=tp", "model.num_heads=6", "optim.name=lamb"], 2, "LAMB's trust ratio needs the norm"),
    ],
)
def test_unsupported_parallel_combinations_are_refused(overrides, size, needle):
    config = make_config("model.name=vit_tiny6_patch7", *overrides)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        resolve(config, DATA, CPU_BF16, model_facts, world=World(rank=0, size=size))


@pytest.mark.parametrize(
    ("version", "refused"), [("2.8.0", True), ("2.8.1+cu128", True), ("2.9.1+cu128", False), ("2.14.1", False)]
)
def test_fsdp_tp_is_refused_on_a_torch_that_cannot_step_it(monkeypatch, version, refused):
    """torch 2.8's DTensor fails fsdp+tp's first optimizer step (tests/dist/test_sharded.py run on it)."""
    monkeypatch.setattr(torch, "__version__", version)
    config = make_config("model.name=vit_tiny6_patch7", "model.num_heads=6", "parallel.strategy=fsdp+tp")
    config.parallel.tp_size = 2
    if not refused:
        assert resolve(config, DATA, CPU_ONLY, model_facts, world=World(rank=0, size=4)).world.tp_size == 2
        return
    with pytest.raises(ConfigError, match=re.escape(f"needs torch >= 2.9 (this environment has {version}")):
        resolve(config, DATA, CPU_ONLY, model_facts, world=World(rank=0, size=4))
    config.parallel.strategy = "fsdp"  # the strategies that run there are not refused
    assert resolve(config, DATA, CPU_ONLY, model_facts, world=World(rank=0, size=4)).world.tp_size == 1


def test_tensor_parallel_peers_share_a_data_slice(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.14.1")  # a torch that runs fsdp+tp (2.8 refuses it: above)
    config = make_config("model.name=vit_tiny6_patch7", "model.num_heads=6", "parallel.strategy=fsdp+tp")
    config.parallel.tp_size = 2
    plan = resolve(config, DATA, CPU_ONLY, model_facts, world=World(rank=3, size=4))
    assert (plan.world.tp_size, plan.world.data_rank, plan.world.data_size) == (2, 1, 2)
    assert plan.checkpoint.format == "sharded"
    config.train.batch_size = 130  # 2 data slices: fine although 130 is not a multiple of the 4 processes
    assert resolve(config, DATA, CPU_ONLY, model_facts, world=World(rank=0, size=4)).batch.global_batch == 130
    config.checkpoint.format = "file"
    assert resolve(config, DATA, CPU_ONLY, model_facts, world=World(rank=0, size=4)).checkpoint.format == "file"
    single = resolve(make_config("model.name=vit_tiny6_patch7", "parallel.strategy=fsdp"), DATA, CPU_ONLY, model_facts)
    assert (single.world.tp_size, single.checkpoint.format) == (1, "file")


def test_checkpoint_cadence_and_skip_limit_reach_the_plan():
    config = make_config("checkpoint.every_steps=500", "checkpoint.every_minutes=1.5", "train.max_skipped_steps=0")
    plan = resolve(config, DATA, CPU_ONLY, model_facts)
    assert (plan.checkpoint.every_steps, plan.checkpoint.every_s) == (500, 90.0)
    assert plan.loop.max_skipped_steps == 0
    defaults = resolve(make_config(), DATA, CPU_ONLY, model_facts)
    assert (defaults.checkpoint.every_steps, defaults.checkpoint.every_s) == (0, 0.0)
    assert defaults.loop.max_skipped_steps == 16


@pytest.mark.parametrize(
    ("argv", "environment", "expected"),
    [
        (["--processes", "8"], {}, "256 is the global batch: 32 per process over 8 process(es)"),
        ([], {"WORLD_SIZE": "2", "RANK": "0"}, "256 is the global batch: 128 per process over 2 process(es)"),
        (
            ["--processes", "4", "--set", "parallel.strategy=fsdp+tp", "--set", "parallel.tp_size=2"],
            {},
            "128 per process over 4 process(es) (2 data slices of 2 tensor-parallel processes)",
        ),
        (["--processes", "3"], {}, "not a whole number: resolve refuses it"),
    ],
)
def test_show_config_ends_with_the_per_process_batch(capsys, monkeypatch, argv, environment, expected):
    """train.batch_size is global (timm's --batch-size is per device): show-config says each process's share."""
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    assert main(["show-config", *argv]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("# ") and expected in out.splitlines()[-1]
    assert yaml.safe_load(out)["train"]["batch_size"] == 256  # still YAML


NESTED_SETTINGS = {
    "train.ema.decay": "0.99",
    "train.ema.warmup": "true",
    "train.ema.every_steps": "2",
    "train.ema.evaluate": "false",
    "train.distill.kind": "soft",
    "train.distill.alpha": "0.3",
    "train.distill.tau": "2.0",
    "train.distill.teacher": "runs/teacher",
    "train.distill.teacher_weights": "teacher.pth",
    "train.distill.teacher_model": "vit_tiny6_patch7",
    "token_labels.maps": "maps",
    "token_labels.mix_token": "true",
    "token_labels.mix_token_alpha": "0.5",
    "token_labels.dense_weight": "0.25",
    "token_labels.cls_weight": "2.0",
    "token_labels.ground_truth": "true",
    "performance.activation_checkpointing": "all",
    "performance.channels_last": "true",
    "performance.host_allocator": "system",
    "performance.cpu_kernels": "native",
    "performance.compile": "true",
    "performance.compile_backend": "eager",
    "performance.compile_mode": "max-autotune-no-cudagraphs",
}
"""A value other than the default for every key that moved into a section."""


def test_every_moved_key_has_a_non_default_setting_here():
    assert sorted(NESTED_SETTINGS) == sorted(MOVED_KEYS.values())
    config, defaults = make_config(*(f"{key}={value}" for key, value in NESTED_SETTINGS.items())), Config()
    for key in NESTED_SETTINGS:
        section, *path = key.split(".")
        ours, theirs = getattr(config, section), getattr(defaults, section)
        for part in path:
            ours, theirs = getattr(ours, part), getattr(theirs, part)
        assert ours != theirs, key


@pytest.mark.parametrize("old", list(MOVED_KEYS))
def test_an_old_flat_key_is_refused_naming_its_new_key(old, tmp_path):
    value = NESTED_SETTINGS[MOVED_KEYS[old]]
    expected = f"config key '{old}' is now '{MOVED_KEYS[old]}'; rename it"
    with pytest.raises(ConfigError, match=re.escape(f"--set {old}={value}: {expected}")):
        make_config(f"{old}={value}")
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section: {key: yaml.safe_load(value)}}))
    with pytest.raises(ConfigError, match=re.escape(f"--config {path}: {expected}")):
        build_config(Config(), [path])


def test_an_old_flat_key_on_the_command_line_exits_2_with_one_line(capsys):
    assert main(["show-config", "--set", "train.ema_decay=0.999"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'train.ema_decay' is now 'train.ema.decay'" in err and len(err.splitlines()) == 1


def test_a_saved_config_in_the_flat_layout_reads_as_the_nested_one():
    """Checkpoints, exports and config.yaml files of older versions hold the flat keys: they load, moved."""
    config = make_config(*(f"{key}={value}" for key, value in NESTED_SETTINGS.items()))
    saved = config.model_dump(mode="json")
    flat = old_flat_layout(saved)
    assert flat["train"]["distill"] == "soft" and flat["data"]["token_labels"] == "maps"
    assert flat["train"]["compile_mode"] == "max-autotune-no-cudagraphs" and "performance" not in flat
    with pytest.raises(ConfigError, match="is now"):  # loaded, the saved config takes only the new keys
        build_config(stored_config(flat), [], ["train.distill=hard"])
    assert stored_config(flat) == config
    assert stored_config(saved) == config  # the nested layout as it is
    assert stored_config(old_flat_layout(Config().model_dump(mode="json"))) == Config()


def test_performance_amx_off_keeps_the_tiles_off_where_the_machine_has_them():
    amx = Hardware(cuda_available=False, bf16_supported=True, bf16_emulated=True, amx_tiles=True)
    bf16 = ["precision=bf16", "precision_mode=autocast", "train.device=cpu"]
    on = resolve(make_config(*bf16), DATA, amx, model_facts)
    off = resolve(make_config(*bf16, "performance.amx=off"), DATA, amx, model_facts)
    assert on.runtime.amx_tiles and not off.runtime.amx_tiles
    # under autocast only the AMX attention kernel is fused: without the tiles nothing is left to build
    assert (on.runtime.cpu_kernels, off.runtime.cpu_kernels) == ("auto", "native")
    assert not resolve(make_config(*bf16), DATA, CPU_BF16, model_facts).runtime.amx_tiles  # no AMX here
