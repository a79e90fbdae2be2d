"""``resolve()``: every derived number of a run, computed once before anything expensive runs.

A :class:`Plan` holds the config and what follows from it on this machine and world (batches, LR,
run length, curriculum stages, cadences, precision, parallel layout). Every user mistake is raised
here as a :class:`ConfigError` naming the key and a fix. ``vitrain.train.make_plan`` gathers
the facts (data, hardware, processes) and calls it."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vitrain import torch_at_least
from vitrain.config import plan as parts
from vitrain.config.checks import model_facts_of, require
from vitrain.config.inputs import check_inputs, profile_window
from vitrain.config.plan import DatasetInfo, Hardware, MeasuredPrecision, ModelFacts, ModelLookup, Plan, Stage, World
from vitrain.config.schema import Config, ConfigError, ModelConfig
from vitrain.config.training import distill_plan, ema_plan, mix_plan, token_label_plan

if TYPE_CHECKING:
    from vitrain.config.precision import PrecisionPolicy


def _check_batch_and_length(config: Config, num_train: int) -> int:
    train = config.train
    require(
        train.batch_size >= 1, f"train.batch_size must be >= 1 (got {train.batch_size}); set e.g. train.batch_size=256"
    )
    require(
        train.eval_batch_size is None or train.eval_batch_size >= 1,
        f"train.eval_batch_size must be >= 1 (got {train.eval_batch_size}); or leave it null",
    )
    steps_per_epoch = num_train // train.batch_size
    require(
        steps_per_epoch >= 1,
        f"train.batch_size={train.batch_size} exceeds the {num_train} training samples; "
        "lower train.batch_size or raise data.limit_train",
    )
    return steps_per_epoch


# ModelConfig fields that are model arguments, passed through when set.


MODEL_OPTIONS = (
    "patch_size",
    "head",
    "stem",
    "mlp_ratio",
    "num_heads",
    "attn_impl",
    "attn_softmax_fp32",
    "drop_rate",
    "attn_drop_rate",
    "drop_path_rate",
    "distill_token",
    "aux_head",
)

# model.* options whose argument has another name in some families: option -> (argument, ...).


OPTION_ARGUMENTS = {"aux_head": ("aux_head", "use_aux_head")}


def _argument_name(option: str, fields: set[str]) -> str | None:
    """The argument of a family (its args' ``fields``) that model.``option`` sets; None if it has none."""
    return next((name for name in OPTION_ARGUMENTS.get(option, (option,)) if name in fields), None)


def model_overrides(model: ModelConfig, args: Any = None) -> dict[str, Any]:
    """The model.* options as model arguments (unset ones None); attn_impl=auto is chosen after the
    build (vitrain.train.attention_probe), so the model is built with its variant's default. With the
    variant's ``args``, options are named as that family's arguments (model.aux_head is VOLO's
    use_aux_head) and options it lacks are left out."""
    options = {option: getattr(model, option) for option in MODEL_OPTIONS}
    if options["attn_impl"] == "auto":
        options["attn_impl"] = None
    if args is not None:
        fields = {field.name for field in dataclasses.fields(args)}
        named = {_argument_name(option, fields): value for option, value in options.items()}
        options = {name: value for name, value in named.items() if name is not None}
    return options


def _resolve_patch_size(config: Config, facts: ModelFacts) -> int:
    """The model's input stride (patch size; VOLO's patch x downsampling), after checking that every
    model option set in the config is an argument of this model family."""
    fields = {field.name for field in dataclasses.fields(facts.args)}
    accepted = [option for option in MODEL_OPTIONS if _argument_name(option, fields) is not None]
    for option in MODEL_OPTIONS:
        require(
            getattr(config.model, option) is None or option in accepted,
            f"model.{option}={getattr(config.model, option)} (from the recipe or your overrides) is not an option "
            f"of {config.model.name}; set model.{option}=null (that family takes "
            f"{', '.join(sorted(accepted)) or 'none of the model.* options'})",
        )
    patch = config.model.patch_size or getattr(facts.args, "total_stride", getattr(facts.args, "patch_size", 1))
    if (config.model.stem or getattr(facts.args, "stem", None)) == "conv":  # set here or by the variant
        problem = facts.stem_problem(patch)
        require(problem is None, f"model.stem=conv: {problem} (model.patch_size, data.image_size)")
    require(
        config.data.image_size % patch == 0,
        f"data.image_size={config.data.image_size} is not divisible by the patch size {patch} of "
        f"{config.model.name}; set data.image_size to a multiple of {patch} or change model.patch_size",
    )
    return patch


def resolve_device(requested: str, cuda_available: bool) -> str:
    """``train.device`` -> the device a process runs on (``auto``: CUDA where there is one)."""
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    require(
        requested == "cpu" or requested.startswith("cuda"),
        f"train.device={requested!r} is not known; use auto, cpu, cuda or cuda:N",
    )
    require(
        requested == "cpu" or cuda_available,
        f"train.device={requested!r} but CUDA is not available here; use train.device=cpu",
    )
    return requested


FP8_CAPABILITY = (8, 9)


def auto_precision(hardware: Hardware) -> str:
    """``precision=auto`` where nothing was measured (``resolve()`` called without :class:`MeasuredPrecision`):
    bf16 where the device computes it natively, else fp32. Runs measure instead (``make_plan``)."""
    return "bf16" if hardware.bf16_supported else "fp32"


def _resolve_precision(config: Config, hardware: Hardware, measured: MeasuredPrecision | None) -> tuple[str, str]:
    """(precision, precision_mode) of the run: ``auto`` takes the measured choice (unmeasured: see
    :func:`auto_precision`; the mode autocast); an explicit precision or mode is never overridden."""
    requested, mode = config.precision, config.precision_mode
    if requested == "auto":
        precision = measured.precision if measured is not None else auto_precision(hardware)
    else:
        require(
            requested not in ("bf16", "fp8") or hardware.bf16_supported or hardware.bf16_emulated,
            f"precision={requested} is not supported by this device; use precision=fp32 (or auto)",
        )
        if requested == "fp8":
            _check_fp8(hardware)
        precision = requested
    if precision == "fp32":
        return precision, "autocast"  # every mode computes alike in fp32
    if mode == "auto":
        mode = measured.mode if measured is not None and measured.precision == precision else "autocast"
    return precision, mode


def _check_fp8(hardware: Hardware) -> None:
    """precision=fp8 needs torchao, and on CUDA FP8 tensor cores (a CPU emulates them)."""
    require(
        importlib.util.find_spec("torchao") is not None,
        "precision=fp8 needs torchao; pip install 'vitrain[fp8]' (or use precision=bf16)",
    )
    capability = hardware.cuda_capability
    require(
        capability is None or tuple(capability) >= FP8_CAPABILITY,
        f"precision=fp8 needs FP8 tensor cores (CUDA compute capability 8.9+: Ada, Hopper, Blackwell); "
        f"this GPU has {'.'.join(map(str, capability or ()))}; use precision=bf16",
    )


def kernels_can_apply(device: str, precision: str, mode: str, amx_tiles: bool) -> bool:
    """Whether the fused CPU kernels change how a run computes: bf16 on a CPU, outside autocast (O2, full), or
    under autocast where the attention kernel's AMX tiles run (``vitrain.kernels``)."""
    return device == "cpu" and precision == "bf16" and (mode != "autocast" or amx_tiles)


def amx_tiles_for(config: Config, hardware: Hardware) -> bool:
    """Whether the run's kernels may use AMX tiles: the machine allows them and performance.amx is not off."""
    return hardware.amx_tiles and config.performance.amx


def _resolve_cpu_kernels(
    config: Config, device: str, precision: str, mode: str, hardware: Hardware, measured: MeasuredPrecision | None
) -> str:
    """``performance.cpu_kernels`` of the run: ``auto`` takes the measured choice, and ``native`` where the kernels
    cannot apply (so nothing is built for a path that does not run them)."""
    requested = config.performance.cpu_kernels
    if requested != "auto":
        return requested
    if not kernels_can_apply(device, precision, mode, amx_tiles_for(config, hardware)):
        return "native"
    return measured.cpu_kernels if measured is not None else "auto"


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")


_SECONDS_PER = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration_s(text: str) -> float:
    """``"90s"``, ``"10m"``, ``"24h"``, ``"1h30m"``, ``"2d"`` -> seconds; ValueError otherwise."""
    compact = text.replace(" ", "").lower()
    parts = _DURATION_PART.findall(compact)
    if not parts or "".join(number + unit for number, unit in parts) != compact:
        raise ValueError(text)
    return sum(float(number) * _SECONDS_PER[unit] for number, unit in parts)


def _resolve_duration(config: Config, steps_per_epoch: int) -> tuple[str, float, float]:
    """(unit, length, warmup) of the run. Epochs become images so curriculum batch sizes may differ;
    the warmup is in steps for step-measured runs and in images otherwise."""
    train, batch = config.train, config.train.batch_size
    given = [key for key in ("steps", "samples", "budget") if getattr(train, key) is not None]
    if len(given) > 1:
        raise ConfigError(
            f"train.{given[0]} and train.{given[1]} both set the run's length; keep one (set the other to null)"
        )
    warmup_samples = round(config.schedule.warmup_epochs * steps_per_epoch) * batch
    if train.steps is not None:
        return "steps", float(train.steps), float(min(train.steps, round(warmup_samples / batch)))
    if train.budget is not None:
        try:
            budget_s = parse_duration_s(train.budget)
        except ValueError:
            raise ConfigError(
                f"train.budget={train.budget!r} is not a duration; write e.g. 90s, 10m, 24h or 1h30m"
            ) from None
        require(budget_s > 0, f"train.budget={train.budget!r} must be longer than zero; e.g. train.budget=10m")
        return "seconds", budget_s, float(warmup_samples)
    if train.samples is not None:
        return "samples", float(train.samples), float(min(train.samples, warmup_samples))
    require(
        train.epochs is not None,
        "the run has no length; set one of train.epochs, train.steps, train.samples or train.budget",
    )
    total = max(1, round(train.epochs * steps_per_epoch)) * batch
    return "samples", float(total), float(min(total, warmup_samples))


def _stage_batch(config: Config, image_size: int, patch: int, batch: int | None) -> int:
    if batch is not None:
        return batch
    if config.curriculum.batch_rule == "fixed":
        return config.train.batch_size
    tokens = lambda size: (size // patch) ** 2  # noqa: E731
    return max(1, config.train.batch_size * tokens(config.data.image_size) // tokens(image_size))


def _resolve_stages(config: Config, patch: int, num_train: int) -> tuple[Stage, ...]:
    """The curriculum as stages (explicit list or linear rule), ending with the final stage."""
    curriculum, final_size = config.curriculum, config.data.image_size
    require(
        not (curriculum.stages and curriculum.start_size),
        "curriculum.stages and curriculum.start_size both define the curriculum; keep one",
    )
    stages: list[Stage] = []
    if curriculum.start_size is not None:
        require(
            curriculum.start_size < final_size,
            f"curriculum.start_size={curriculum.start_size} must be below data.image_size={final_size}",
        )
        sizes = range(curriculum.start_size, final_size, curriculum.grow_by)
        for index, size in enumerate(sizes):
            require(
                size % patch == 0,
                f"curriculum: stage size {size} (start_size + k * grow_by) is not a multiple of the patch size {patch}; "
                f"make curriculum.start_size and curriculum.grow_by multiples of {patch}",
            )
            batch = _stage_batch(config, size, patch, None)
            stages.append(Stage(size, batch, until_epoch=(index + 1) * curriculum.grow_every_epochs))
    previous_until = 0.0
    for index, stage in enumerate(curriculum.stages):
        key = f"curriculum.stages[{index}]"
        require(
            stage.until > previous_until,
            f"{key}.until={stage.until} must be greater than the previous stage's ({previous_until}); "
            "list stages in order",
        )
        require(
            stage.image_size % patch == 0,
            f"{key}.image_size={stage.image_size} is not a multiple of the patch size {patch}; "
            f"use a multiple of {patch}",
        )
        previous_until = stage.until
        batch = _stage_batch(config, stage.image_size, patch, stage.batch_size)
        stages.append(Stage(stage.image_size, batch, stage.lr_scale, until=stage.until))
    for index, stage in enumerate(stages):
        require(
            stage.batch_size <= num_train,
            f"curriculum stage {index} batch size {stage.batch_size} exceeds the {num_train} training samples; "
            "set its batch_size or lower train.batch_size",
        )
    return (*stages, Stage(final_size, config.train.batch_size))


def _tensor_parallel_shape(config: Config, facts: ModelFacts) -> tuple[int, int] | None:
    """Heads and FFN width of a model whose blocks tensor parallelism can split (ViT/DeiT blocks with the
    plain MLP FFN); None for the other families."""
    if not facts.splits_heads:
        return None
    args = facts.args
    ratio = config.model.mlp_ratio or args.mlp_ratio
    return config.model.num_heads or args.num_heads, args.mlp_dim or int(args.embed_dim * ratio)


# Optimizers whose update needs each whole tensor, and why (refused where a strategy shards tensors).


WHOLE_TENSOR_OPTIMIZERS = {
    "lamb": "LAMB's trust ratio needs the norm of each whole tensor",
}


def _check_optimizer_sees_whole_tensors(optimizer: str, strategy: str, world: World) -> None:
    require(
        strategy == "ddp" or optimizer not in WHOLE_TENSOR_OPTIMIZERS or world.size == 1,
        f"optim.name={optimizer} with parallel.strategy={strategy}: {WHOLE_TENSOR_OPTIMIZERS.get(optimizer)} and "
        "this strategy shards them; use parallel.strategy=ddp or optim.name=adamw",
    )


FSDP_TP_MIN_TORCH = (2, 9)
"""The oldest torch whose DTensor runs fsdp+tp's optimizer step: torch 2.8's cannot step the parameters FSDP
shards over the data-parallel mesh together with those sharded over both meshes."""


def fsdp_tp_runs_on(version: str) -> bool:
    """Whether torch ``version`` can step fsdp+tp's optimizer (an unreadable version is let through)."""
    return torch_at_least(version, FSDP_TP_MIN_TORCH)


def _check_torch_runs(strategy: str) -> None:
    import torch

    floor = ".".join(map(str, FSDP_TP_MIN_TORCH))
    require(
        strategy != "fsdp+tp" or fsdp_tp_runs_on(torch.__version__),
        f"parallel.strategy=fsdp+tp needs torch >= {floor} (this environment has {torch.__version__}, whose "
        f"DTensor cannot step the optimizer over the dp and dp x tp meshes together); pip install "
        f"'torch>={floor}', or use parallel.strategy=fsdp or tp",
    )


def _resolve_parallel(
    config: Config, world: World, precision: str, mode: str, cuda: bool, facts: ModelFacts
) -> tuple[World, str]:
    """The world with its tensor-parallel degree, and the checkpoint format; every unsupported combination
    of strategy, model, precision and process count is refused here, naming the key."""
    parallel = config.parallel
    strategy = parallel.strategy
    tp_size = 1
    if "tp" in strategy:
        tp_size = parallel.tp_size or (world.size if strategy == "tp" else 0)
        require(
            tp_size > 0,
            "parallel.strategy=fsdp+tp needs parallel.tp_size (processes per tensor-parallel group, e.g. the "
            "GPUs of one node)",
        )
        require(
            world.size % tp_size == 0 and (strategy == "tp") == (tp_size == world.size),
            f"parallel.tp_size={tp_size} with {world.size} processes: tp uses all processes (tp_size=0 or "
            f"{world.size}); fsdp+tp needs a tp_size that divides {world.size} and is smaller",
        )
        shape = _tensor_parallel_shape(config, facts)
        require(
            shape is not None,
            f"parallel.strategy={strategy}: tensor parallelism splits ViT/DeiT blocks (attention heads and the "
            f"MLP FFN); {config.model.name} has other blocks; use parallel.strategy=fsdp or ddp",
        )
        heads, hidden = shape
        require(
            heads % tp_size == 0 and hidden % tp_size == 0,
            f"parallel.tp_size={tp_size} must divide the {heads} attention heads and the FFN width {hidden} of "
            f"{config.model.name}; choose a tp_size that divides both",
        )
    _check_optimizer_sees_whole_tensors(config.optim.name, strategy, world)
    _check_torch_runs(strategy)
    if strategy != "ddp":
        require(
            precision != "fp16",
            f"parallel.strategy={strategy} with precision=fp16: loss scaling of sharded gradients is not "
            "supported; use precision=bf16 (no loss scaling needed) or parallel.strategy=ddp",
        )
        require(
            mode != "full" or precision == "fp32",
            f"parallel.strategy={strategy} with precision_mode=full is not supported; use precision_mode=o2 "
            "(FSDP: its mixed-precision policy) or autocast",
        )
        require(
            mode != "o2" or precision == "fp32" or "fsdp" in strategy,
            "parallel.strategy=tp with precision_mode=o2 is not supported; use autocast, or fsdp+tp (FSDP's "
            "mixed-precision policy is O2)",
        )
    require(
        not parallel.fsdp_cpu_offload or ("fsdp" in strategy and cuda),
        "parallel.fsdp_cpu_offload=true needs parallel.strategy=fsdp (or fsdp+tp) on CUDA; remove it",
    )
    checkpoint_format = config.checkpoint.format
    if checkpoint_format == "auto":
        checkpoint_format = "sharded" if strategy != "ddp" and world.size > 1 else "file"  # Plan.shards_model
    return dataclasses.replace(world, tp_size=tp_size), checkpoint_format


def _check_batches_split(batch: int, eval_batch: int, stages: tuple[Stage, ...], world: World) -> None:
    """Every global batch (training, evaluation, each curriculum stage's) splits over the data slices."""
    for key, size in [("train.batch_size", batch), ("train.eval_batch_size", eval_batch)] + [
        (f"curriculum stage at {stage.image_size} px: batch", stage.batch_size) for stage in stages[:-1]
    ]:
        slices = world.data_size
        require(
            size % slices == 0,
            f"{key}={size} is global and must split evenly over the {slices} data-parallel processes; "
            f"use a multiple of {slices}",
        )


def precision_policy(
    precision: str, mode: str, device: str, fsdp: bool = False, fp8_scaling: str = "tensorwise"
) -> PrecisionPolicy:
    """How a run computes, decided here alone from the resolved ``precision``, ``precision_mode`` and
    whether FSDP2 shards the model (its mixed-precision policy is then O2's low-precision compute).
    fp8 is bf16 with FP8 linear layers of ``fp8_scaling``."""
    from vitrain.config.precision import PrecisionPolicy

    if precision == "fp8":
        bf16 = precision_policy("bf16", mode, device, fsdp)
        return dataclasses.replace(bf16, fp8_scaling=fp8_scaling)
    low = precision != "fp32"
    mode = mode if low else "autocast"  # fp32: every mode computes alike
    if not low or mode == "autocast":
        weights = "fp32"
    elif mode == "o2":
        weights = "fsdp_mixed_precision" if fsdp else "low_precision_copy"
    else:
        weights = "low_precision"
    return PrecisionPolicy(
        precision, mode, device, weights, autocast=low and mode == "autocast", loss_scaling=precision == "fp16"
    )


def _model_plan(config: Config, data: DatasetInfo, patch: int, facts: ModelFacts) -> parts.ModelPlan:
    return parts.ModelPlan(
        name=config.model.name,
        options=model_overrides(config.model, facts.args),
        image_size=config.data.image_size,
        in_chans=data.channels,
        num_classes=data.num_classes,
        patch_size=patch,
        choose_attention=config.model.attn_impl == "auto",
    )


def _parallel_plan(config: Config, world: World, device: str) -> parts.ParallelPlan:
    performance, parallel = config.performance, config.parallel
    return parts.ParallelPlan(
        strategy=parallel.strategy,
        world=world,
        device=device,
        activation_checkpointing=performance.activation_checkpointing,
        compile=performance.compile,
        compile_backend=performance.compile_backend,
        compile_mode=performance.compile_mode,
        fsdp_reshard=parallel.fsdp_reshard,
        fsdp_cpu_offload=parallel.fsdp_cpu_offload,
    )


def _optimizer_plan(config: Config, lr: float) -> parts.OptimizerPlan:
    optim = config.optim
    return parts.OptimizerPlan(
        name=optim.name,
        implementation=optim.implementation,
        lr=lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        layer_decay=optim.layer_decay,
        momentum=optim.momentum,
        muon_momentum=optim.muon_momentum,
        ns_steps=optim.ns_steps,
    )


def _schedule_plan(
    config: Config,
    lr: float,
    steps_per_epoch: int,
    duration: tuple[str, float, float],
    num_train: int,
    stages: tuple[Stage, ...],
) -> parts.SchedulePlan:
    """The LR schedule over the run's length, with the steps and epochs it lasts when known in advance."""
    unit, length, warmup = duration
    batch = config.train.batch_size
    total_steps = epochs = None
    if unit == "steps":
        total_steps, epochs = int(length), length / steps_per_epoch
    elif unit == "samples":
        epochs = length / (steps_per_epoch * batch)
        if len({stage.batch_size for stage in stages}) == 1:
            total_steps = math.ceil(length / batch)
    schedule = config.schedule
    return parts.SchedulePlan(
        lr=lr,
        name=schedule.name,
        warmup_start=schedule.warmup_start,
        min_lr_ratio=schedule.min_lr_ratio,
        duration_unit=unit,
        run_length=length,
        warmup=warmup,
        steps_per_epoch=steps_per_epoch,
        num_train=num_train,
        stages=stages,
        total_steps=total_steps,
        epochs=epochs,
    )


def _checkpoint_plan(config: Config, checkpoint_format: str) -> parts.CheckpointPlan:
    checkpoint, template = config.checkpoint, config.train.out_dir
    return parts.CheckpointPlan(
        format=checkpoint_format,
        keep_last=checkpoint.keep_last,
        every_epochs=checkpoint.every_epochs,
        every_steps=checkpoint.every_steps,
        every_s=60.0 * checkpoint.every_minutes,
        sibling_runs=template.format(recipe=config.recipe, time="*") if "{time}" in template else None,
    )


SINK_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""The package each metric sink imports; its extra of vitrain has the sink's name."""


def _log_plan(config: Config) -> parts.LogPlan:
    """The sinks besides metrics.jsonl, each once; a sink whose package is not installed is refused here,
    found without importing it (the tracking clients take seconds to import)."""
    log = config.log
    sinks = tuple(dict.fromkeys(sink for sink in log.sinks if sink != "jsonl"))
    for sink in sinks:
        package = SINK_PACKAGES.get(sink)
        require(
            package is None or importlib.util.find_spec(package) is not None,
            f"log.sinks: {sink} needs the {package} package, which is not installed; "
            f"pip install 'vitrain[{sink}]', or remove {sink} from log.sinks",
        )
    return parts.LogPlan(sinks=sinks, **log.model_dump(exclude={"sinks"}))


def _training_parts(
    config: Config, num_classes: int, patch: int, kernels: tuple[str, bool], facts: ModelFacts, models: ModelLookup
) -> tuple[parts.StepPlan, parts.RuntimePlan, parts.LoopPlan]:
    cpu_kernels, amx_tiles = kernels
    train = config.train
    step = parts.StepPlan(
        label_smoothing=train.label_smoothing,
        grad_clip=config.optim.grad_clip,
        loss=train.loss,
        distill=distill_plan(config, facts, models),
        token_labels=token_label_plan(config, num_classes, patch, facts),
    )
    return (
        step,
        parts.RuntimePlan(
            host_allocator=config.performance.host_allocator,
            cpu_kernels=cpu_kernels,
            channels_last=config.performance.channels_last,
            amx_tiles=amx_tiles,
        ),
        parts.LoopPlan(
            eval_every_epochs=train.eval_every_epochs,
            log_every_steps=train.log_every_steps,
            max_skipped_steps=train.max_skipped_steps,
            progress=train.progress,
            init_from=train.init_from,
            init_weights=train.init_weights,
            profile=profile_window(train.profile),
        ),
    )


def _data_plan(
    config: Config,
    data: DatasetInfo,
    device: str,
    world: World,
    batch: parts.BatchPlan,
    mixing: parts.MixPlan | None,
    crop_geometry: bool,
) -> parts.DataPlan:
    mean, std = tuple(config.data.mean or data.mean), tuple(config.data.std or data.std)
    return parts.DataPlan(
        config.data, data.channels, mean, std, config.train.seed, device, world, batch, mixing, crop_geometry
    )


def _batch_plan(config: Config, world: World) -> parts.BatchPlan:
    train = config.train
    return parts.BatchPlan(
        global_batch=train.batch_size,
        eval_batch=train.eval_batch_size or 2 * train.batch_size,
        micro_batch=train.micro_batch_size,
        data_slices=world.data_size,
    )


def resolve(
    config: Config,
    data: DatasetInfo,
    hardware: Hardware,
    models: ModelLookup,
    now: str = "now",
    world: World | None = None,
    measured: MeasuredPrecision | None = None,
) -> Plan:
    """Derive every number of the run from ``config``; raise ConfigError on any user mistake. The facts are
    given: the data's (``data``), the machine's (``hardware``), the model catalog's (``models``: name ->
    :class:`ModelFacts`, :func:`vitrain.models.model_facts`) and, for ``auto``, what timing the run's step
    chose for its precision, mode and CPU kernels (``measured``; ``make_plan`` measures)."""
    world = world or World()
    facts = model_facts_of(config.model.name, models)
    patch = _resolve_patch_size(config, facts)
    steps_per_epoch = _check_batch_and_length(config, data.num_train)
    device = resolve_device(config.train.device, hardware.cuda_available)
    if world.size > 1 and device == "cuda":
        device = f"cuda:{world.local_rank}"  # one GPU per process
    precision, mode = _resolve_precision(config, hardware, measured)
    check_inputs(config, data, precision, mode, device)
    world, checkpoint_format = _resolve_parallel(config, world, precision, mode, hardware.cuda_available, facts)
    parallel = _parallel_plan(config, world, device)
    duration = _resolve_duration(config, steps_per_epoch)
    out_dir = Path(config.train.out_dir.format(recipe=config.recipe, time=now))
    stages = _resolve_stages(config, patch, data.num_train)
    batch = _batch_plan(config, world)
    _check_batches_split(batch.global_batch, batch.eval_batch, stages, world)
    lr = config.optim.lr * batch.global_batch / config.optim.reference_batch
    cpu_kernels = _resolve_cpu_kernels(config, device, precision, mode, hardware, measured)
    kernels = (cpu_kernels, amx_tiles_for(config, hardware))
    step, runtime, loop = _training_parts(config, data.num_classes, patch, kernels, facts, models)
    mixing = mix_plan(config, data.num_classes, stages, batch)
    schedule = _schedule_plan(config, lr, steps_per_epoch, duration, data.num_train, stages)
    return Plan(
        config=config,
        device=device,
        out_dir=out_dir,
        seed=config.train.seed,
        world=world,
        model=_model_plan(config, data, patch, facts),
        batch=batch,
        precision=precision_policy(precision, mode, device, parallel.fsdp, config.performance.fp8_scaling),
        parallel=parallel,
        optim=_optimizer_plan(config, lr),
        schedule=schedule,
        data=_data_plan(config, data, device, world, batch, mixing, crop_geometry=step.token_labels is not None),
        step=step,
        runtime=runtime,
        loop=loop,
        checkpoint=_checkpoint_plan(config, checkpoint_format),
        ema=ema_plan(config, schedule.total_steps),
        log=_log_plan(config),
        measured=measured,
    )
