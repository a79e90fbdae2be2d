"""Building a training run from its :class:`~vitrain.config.Plan`, in one fixed order.

``build_run`` builds, each stage on what the previous ones made:

1. **model**: seeded, built on the meta device (``model.attn_impl=auto`` chooses attention there),
   materialized on the run's device and initialized (:func:`build_model_for`);
2. **converters**: changes applied to the built model from outside: the fused CPU kernels
   (:func:`vitrain.kernels.convert`) and channels-last weights (:func:`_apply_converters`);
3. **parallelism**: first the precision policy's weights (O2: a low-precision copy of the model, the
   module that runs; full: the model cast in place), then :func:`~vitrain.parallel.parallelize` on the
   module that runs (MixToken's hook goes on its patch embedding first): tensor parallelism -> activation
   checkpointing -> compile -> FSDP2 or DDP;
   The distillation teacher (``train.distill.teacher``), frozen and whole on every process, is loaded here too;
4. **optimizer** over the model's (the fp32 master's) parameters, after sharding made them DTensors;
5. **step**: the :class:`~vitrain.train.step.TrainStep` holding all of the above and the run's objective,
   what each step optimizes (:func:`build_objective`: classification, distillation or token labeling);
6. **loaders**: training and evaluation data, the mixer of training batches (Mixup/CutMix), and token
   labeling's label maps (opened and checked against the training images);
7. **weight EMA** (``train.ema.decay``): a copy of the initialized weights, laid out as the parameters;
8. **checkpoint manager** of the run folder.

``build_training_step`` is stages 1-5 alone (the benchmarks time its step).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from vitrain import kernels
from vitrain.checkpoint import CheckpointManager, RunCheckpoints
from vitrain.checkpoint.rng import capture_rng_state, restore_rng_state
from vitrain.checkpoint.sharded import load_model_state
from vitrain.config import ConfigError, DataPlan, Plan, config_to_yaml
from vitrain.data import Normalize, build_loaders
from vitrain.data.mixing import BatchMixer, build_mixer
from vitrain.data.sources import held_out_split, image_folder_root, image_folder_samples
from vitrain.io import write_file_atomic
from vitrain.kernels import float8
from vitrain.metrics.peak import PeakFlops, peak_flops
from vitrain.models import build_model, load_pretrained
from vitrain.models.flops import model_flops
from vitrain.parallel.distributed import all_reduce_, holds_dtensors
from vitrain.parallel.parallelize import parallelize
from vitrain.seeds import derive_seed
from vitrain.token_labeling.mixtoken import MixTokenHook, apply_mix_token
from vitrain.token_labeling.training import TokenTargets
from vitrain.train.attention_probe import choose_attention
from vitrain.train.ema import ModelEma
from vitrain.train.host_memory import configure_host_allocator
from vitrain.train.losses import DistillationLoss
from vitrain.train.objectives import Classification, Distillation, Objective, TokenLabeling
from vitrain.train.optim import build_optimizer
from vitrain.train.state import TrainState
from vitrain.train.step import TrainStep, apply_precision, build_grad_scaler
from vitrain.weights.inference import inference_record
from vitrain.weights.sources import WeightsSourceError, read_init_weights
from vitrain.weights.teacher import TeacherError, load_teacher

log = logging.getLogger("vitrain")


@dataclasses.dataclass
class Run:
    """Everything a training run holds while it runs."""

    plan: Plan
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step_fn: TrainStep
    train_loader: Any
    eval_loader: Any
    normalize: Normalize
    checkpoints: RunCheckpoints
    state: TrainState
    mixer: BatchMixer | None = None
    """Mixup/CutMix of the training batches on the device (None: off)."""
    ema: ModelEma | None = None
    """The weight EMA (None: train.ema.decay=0)."""
    token_targets: TokenTargets | None = None
    """Token labeling's dense targets of the training batches (None: off)."""


def build_run(plan: Plan) -> Run:
    """Every stage, in the order of this module's docstring."""
    step_fn = build_training_step(plan)  # 1-5: model, converters, parallelism, optimizer, step
    train_loader, eval_loader = build_loaders(plan.data)  # 6
    token_labels = plan.step.token_labels
    token_targets = (
        TokenTargets.open(token_labels, plan.data, train_loader, plan.step.label_smoothing) if token_labels else None
    )
    ema = ModelEma(step_fn.model, plan.ema) if plan.ema.enabled else None  # 7: of the fp32 master under O2
    checkpoints = _build_checkpoints(plan, step_fn, {"train": train_loader, "eval": eval_loader}, ema)  # 8
    return Run(
        plan=plan,
        model=step_fn.model,
        optimizer=step_fn.optimizer,
        step_fn=step_fn,
        train_loader=train_loader,
        eval_loader=eval_loader,
        normalize=Normalize(plan.data.mean, plan.data.std, plan.device, plan.runtime.channels_last),
        checkpoints=checkpoints,
        state=TrainState(),
        mixer=build_mixer(plan.data),
        ema=ema,
        token_targets=token_targets,
    )


def build_training_step(plan: Plan) -> TrainStep:
    """Stages 1-5: the seeded model, converted and parallelized, its optimizer and the step holding them.
    The plan's process settings first: the host allocator, and whether the AMX tile kernels may run."""
    configure_host_allocator(plan.runtime.host_allocator)  # before the step's first allocations
    kernels.use_amx_tiles(plan.runtime.amx_tiles)  # before the model: the attention probe times with it
    torch.manual_seed(plan.seed)
    model = build_model_for(plan)  # 1
    _apply_converters(model, plan)  # 2
    low_precision = apply_precision(model, plan.precision)  # 3: O2's copy is the module that runs
    running = low_precision.compute if low_precision else model
    token_labels = plan.step.token_labels
    mix_token = apply_mix_token(running) if token_labels is not None and token_labels.mix_token else None
    forward_module = parallelize(running, plan.parallel, plan.precision)
    teacher = build_teacher(plan) if plan.step.distill is not None else None  # replicated on every process
    optimizer = build_optimizer(model, plan.optim, plan.precision)  # 4: after sharding made the parameters DTensors
    several = plan.world.size > 1
    step = TrainStep(  # 5
        model,
        optimizer,
        build_grad_scaler(plan.precision),
        plan.precision,
        build_objective(plan, teacher, mix_token),
        plan.step.grad_clip,
        micro_batch=plan.batch.micro_batch,
        low_precision=low_precision,
        forward_module=forward_module,
        agree_on_skip=_agree_across_processes if several else None,
    )
    if several:
        # the same weights everywhere (seeded alike), but each data slice its own dropout / drop-path
        # draws (tensor-parallel peers compute one slice together, so they draw alike)
        torch.manual_seed(derive_seed(plan.seed, plan.world.data_rank))
    return step


def build_objective(plan: Plan, teacher: nn.Module | None = None, mix_token: MixTokenHook | None = None) -> Objective:
    """What the plan's step optimizes: token labeling (with ``mix_token``, the MixToken hook on the running
    model), distillation from ``teacher``, or classification by ``train.loss`` and label smoothing."""
    step = plan.step
    classification = Classification(step.loss, step.label_smoothing)
    if step.token_labels is not None:
        return TokenLabeling(step.token_labels, mix_token)
    if step.distill is not None:
        if teacher is None:
            raise ValueError("distillation needs the teacher of its DistillPlan")
        distill = step.distill
        loss = DistillationLoss(classification.criterion, distill.kind, distill.alpha, distill.tau)
        return Distillation(loss, teacher)
    return classification


def build_model_for(plan: Plan, device: str | torch.device | None = None) -> nn.Module:
    """The plan's model: built on the meta device, materialized on ``device``, initialized."""
    model = build_model(plan.model.name, device="meta", **plan.model.arguments)
    if plan.model.choose_attention:  # shapes from a meta-device forward, before materializing
        size = plan.model.image_size
        images = torch.empty(1, plan.model.in_chans, size, size, device="meta")
        choose_attention(model, images, plan.batch.global_batch, plan.precision, plan.runtime.cpu_kernels)
    model.to_empty(device=device or plan.device)
    model.init_weights()
    return model


def run_peaks(plan: Plan) -> tuple[PeakFlops, PeakFlops | None]:
    """MFU's denominator for the plan's run, and for precision=fp8 the bf16 peak that its "bf16-equivalent"
    MFU divides by (else None). FP8 runs weigh the FP8 and bf16 peaks by the share of FLOPs in FP8, counted
    on a meta-device copy of the model (:func:`vitrain.kernels.float8.fp8_flop_share`)."""
    policy = plan.precision
    if not policy.fp8_scaling:
        return peak_flops(plan.device, policy.dtype), None
    model = build_model(plan.model.name, device="meta", **plan.model.arguments)
    size = plan.model.image_size
    share = float8.fp8_flop_share(model, size, plan.model.in_chans, model_flops(model, size))
    return peak_flops(plan.device, "fp8", share), peak_flops(plan.device, "bf16")


def build_teacher(plan: Plan) -> nn.Module:
    """The frozen distillation teacher of ``train.distill.teacher``, whole on this process's device; a source that
    cannot be loaded or does not fit the data (classes, channels, every stage's image size) is a ConfigError."""
    distill = plan.step.distill
    try:
        return load_teacher(
            distill.teacher,
            weights=distill.teacher_weights,
            model=distill.teacher_model,
            num_classes=plan.model.num_classes,
            in_chans=plan.model.in_chans,
            image_sizes=sorted({stage.image_size for stage in plan.schedule.stages}),
            device=plan.device,
        )
    except TeacherError as error:
        raise ConfigError(f"train.distill.teacher={distill.teacher}: {error}") from None


def _apply_converters(model: nn.Module, plan: Plan) -> None:
    """Stage 2: what changes how the built model computes, applied from outside it: FP8 linear layers
    (precision=fp8: :func:`vitrain.kernels.float8.convert`), else the fused CPU
    kernels (:func:`vitrain.kernels.convert`, where :func:`vitrain.kernels.wanted`: bf16 on CPU, the
    plan's ``cpu_kernels`` not ``native``, the extension built or loaded before any clock) and
    channels-last weights."""
    policy = plan.precision
    if policy.fp8_scaling:  # FP8 linears (torchao); emulated where the device has no FP8 tensor cores
        names = float8.convert(model, policy.fp8_scaling, emulate=not policy.device.startswith("cuda"))
        log.info("precision fp8 (%s scaling): %d linear layers in FP8", policy.fp8_scaling, len(names))
    elif kernels.wanted(policy.device, policy.dtype, plan.runtime.cpu_kernels):
        kernels.paths()  # where they will apply: probed once, before any clock
        kernels.convert(model)
    if plan.runtime.channels_last:  # in place: same parameter objects, NHWC strides
        model.to(memory_format=torch.channels_last)


def _agree_across_processes(skipped: torch.Tensor) -> torch.Tensor:
    """One process's non-finite loss skips the step on every process."""
    return all_reduce_(skipped, "max")


def _class_names_record(data: DataPlan) -> dict[str, list[str]]:
    """An image folder's (or its shards' index's) class names in index order, kept in every checkpoint so that
    ``vitrain predict`` names the classes without the data; the built-in sources' names need no record."""
    if data.source.name == "webdataset":
        from vitrain.data.shards import shard_source

        classes = shard_source(data.source).classes  # None: shards without an index
        return {"class_names": list(classes)} if classes else {}
    if data.source.name != "imagefolder":
        return {}
    return {"class_names": image_folder_samples(image_folder_root(data.source), "train", data.source.val_fraction)[1]}


def _build_checkpoints(plan: Plan, step_fn: TrainStep, loaders: dict[str, Any], ema: ModelEma | None) -> RunCheckpoints:
    """Stage 8: the run folder's checkpoints and what each one saves (inference's record included)."""
    names = _class_names_record(plan.data)
    return RunCheckpoints(
        manager=CheckpointManager(plan.out_dir, plan.checkpoint.keep_last),
        model=step_fn.model,
        optimizer=step_fn.optimizer,
        scaler=step_fn.scaler,
        bad_images={split: loader.bad_images for split, loader in loaders.items()},
        record={
            "config": plan.config.model_dump(mode="json"),
            "plan": {
                "lr": plan.schedule.lr,
                "global_batch": plan.batch.global_batch,
                "steps_per_epoch": plan.schedule.steps_per_epoch,
                "duration_unit": plan.schedule.duration_unit,
                "run_length": plan.schedule.run_length,
                "precision": plan.precision.dtype,
                "precision_mode": plan.precision.mode,
                "ema_decay": plan.ema.decay,
                **names,
            },
            "inference": inference_record(plan, names.get("class_names")),
        },
        world=plan.world,
        seed=plan.seed,
        sharded=plan.checkpoint.format == "sharded",
        gathers=plan.parallel.shards_model,
        weights_loaded=step_fn.weights_changed,
        ema=ema,
    )


def forward_shapes(plan: Plan) -> list[tuple[int, int]]:
    """(batch, image size) of every forward pass the run will make: each stage's accumulation pieces
    (the last piece may be smaller) and evaluation (at data.image_size, padded to full batches)."""
    shapes = [
        (batch, stage.image_size)
        for stage in plan.schedule.stages
        for batch in plan.batch.forward_batches(stage.batch_size)
    ]
    return list(dict.fromkeys(shapes))


def warm_up_compiled_shapes(run: Run) -> float:
    """Compile every training shape (forward and backward) and the eval shape before the clock starts;
    weights, optimizer, BatchNorm statistics and RNG states are left as they were. Returns seconds."""
    plan, step_fn = run.plan, run.step_fn
    started = time.perf_counter()
    shapes = forward_shapes(plan)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(shapes) + 2)
    buffers = {name: buffer.clone() for name, buffer in run.model.named_buffers()}
    rng = capture_rng_state()
    channels = plan.model.in_chans
    step_fn.warm_up(
        run.normalize(torch.zeros(batch, channels, size, size, device=plan.device)) for batch, size in shapes
    )
    size = plan.model.image_size
    with plan.precision.evaluation_context(), plan.precision.autocast_context():
        run.model.eval()
        run.model(run.normalize(torch.zeros(plan.batch.eval_per_process, channels, size, size, device=plan.device)))
        run.model.train()
    with torch.no_grad():
        for name, buffer in run.model.named_buffers():
            buffer.copy_(buffers[name])
    restore_rng_state(rng)
    return time.perf_counter() - started


def apply_init_from(run: Run, path: str | Path) -> list[str]:
    """Load a checkpoint's model weights into a new run (fine-tuning); returns the classifier
    parameters left at their initialization because the class count differs."""
    try:
        weights, info = read_init_weights(path, run.plan.loop.init_weights)
    except WeightsSourceError as error:
        raise ConfigError(f"train.init_from={path}: {error}") from None
    target = run.model
    if holds_dtensors(run.model):  # FSDP/TP: adapt a plain full copy (resampling, new head), then shard it
        target = build_model_for(run.plan, "cpu")
        target.load_state_dict(get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True)))
    try:
        fresh = load_pretrained(target, weights)
    except ValueError as error:
        raise ConfigError(f"train.init_from={path}: {error}; fine-tune the same model.name") from None
    if target is not run.model:
        load_model_state(run.model, target.state_dict(), full=True)
    run.step_fn.weights_changed()
    if run.ema is not None:
        run.ema.reset()  # the average starts from the weights fine-tuning starts from
    saved_size = info.get("data", {}).get("image_size", "?")
    log.info(
        "initialized from %s (trained at %s px, now %d px)%s",
        path,
        saved_size,
        run.plan.model.image_size,
        f"; new classifier: {', '.join(fresh)}" if fresh else "",
    )
    return fresh


def prepare_run_folder(plan: Plan) -> None:
    """Create the run folder and write the resolved config, and the evaluation images held out of an image
    folder without val/ (``val_split.json``); an unwritable folder is a ConfigError."""
    if not plan.world.is_main:
        return
    held = held_out_split(plan.data.source) if plan.data.source.name == "imagefolder" else None
    try:
        plan.out_dir.mkdir(parents=True, exist_ok=True)
        write_file_atomic(plan.out_dir / "config.yaml", config_to_yaml(plan.config).encode())
        if held is not None:
            record = {"val_fraction": plan.data.source.val_fraction, "images": held}
            write_file_atomic(plan.out_dir / "val_split.json", (json.dumps(record, indent=1) + "\n").encode())
    except OSError as error:
        raise ConfigError(
            f"train.out_dir={plan.out_dir}: cannot write the run folder ({error.strerror or error}); "
            "choose a writable folder or free disk space"
        ) from None
