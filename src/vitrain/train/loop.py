"""The training run: a row of named phases over a resolved :class:`Plan`.

build (model on meta -> materialize -> init, optimizer, schedule, loaders, checkpoints)
-> maybe resume -> loop (step, log, eval, checkpoint by cadence or signal) -> finish (summary).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from tqdm import tqdm

from vitrain import cpu_features, kernels
from vitrain.checkpoint import CheckpointError, CheckpointManager, find_latest_checkpoint, load_checkpoint
from vitrain.checkpoint.manager import write_file_atomic
from vitrain.checkpoint.sharded import (
    EXTRAS_FILE,
    is_sharded_checkpoint,
    load_model_state,
    load_optimizer_state,
    load_sharded,
    model_state,
    optimizer_state,
    read_checkpoint_model,
    save_sharded,
)
from vitrain.config import ConfigError, Plan, Stage, config_to_yaml, model_overrides
from vitrain.data import Normalize, build_loaders
from vitrain.data.loader import derive_seed
from vitrain.metrics import JsonlWriter, NullWriter, run_environment
from vitrain.models import build_model, load_pretrained, num_parameters
from vitrain.parallel import apply_activation_checkpointing
from vitrain.parallel.distributed import (
    all_reduce_,
    any_rank,
    barrier,
    broadcast_object,
    gather_objects,
    holds_dtensors,
    rank0_value,
    wrap_data_parallel,
)
from vitrain.parallel.parallelize import apply_block_compile, apply_model_parallelism
from vitrain.train.attention_probe import choose_attention
from vitrain.train.evaluate import evaluate
from vitrain.train.host_memory import configure_host_allocator
from vitrain.train.optim import build_optimizer
from vitrain.train.schedule import apply_lr, run_progress, scheduled_lr
from vitrain.train.signals import Preempted, StopSignals
from vitrain.train.skips import SkipCounter
from vitrain.train.state import TrainState, capture_rng_state, restore_rank_rng_state, restore_rng_state
from vitrain.train.step import TrainStep, autocast_context, build_grad_scaler, deferred_gradient_sync

log = logging.getLogger("vitrain")

CHECKPOINT_FORMAT = "vitrain-checkpoint-v1"


class TrainingDiverged(RuntimeError):
    """Too many steps in a row had a NaN/inf loss or gradient norm; the message names the step, LR,
    gradient norm, last complete checkpoint and what to try."""


def build_model_for(plan: Plan, device: str | torch.device | None = None) -> nn.Module:
    """The plan's model: built on the meta device, materialized on ``device``, initialized."""
    model_config = plan.config.model
    model = build_model(
        model_config.name,
        device="meta",
        img_size=plan.config.data.image_size,
        in_chans=plan.in_chans,
        num_classes=plan.num_classes,
        **model_overrides(model_config),
    )
    if model_config.attn_impl == "auto":  # shapes from a meta-device forward, before materializing
        size = plan.config.data.image_size
        images = torch.empty(1, plan.in_chans, size, size, device="meta")
        choose_attention(model, images, plan.config.train.batch_size, plan.precision, plan.precision_mode, plan.device)
    model.to_empty(device=device or plan.device)
    model.init_weights()
    return model


@dataclasses.dataclass
class Run:
    """Everything a training run holds while it runs."""

    plan: Plan
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    step_fn: TrainStep
    train_loader: Any
    eval_loader: Any
    normalize: Normalize
    checkpoints: CheckpointManager
    state: TrainState

    def checkpoint_payload(self, full: bool = True) -> dict[str, Any]:
        """Everything a resume needs. ``full``: whole tensors (gathered on rank 0 under FSDP/TP, so every
        rank must call this); otherwise this rank's shards, for a sharded checkpoint."""
        return {
            "model": model_state(self.model, full),
            "optimizer": optimizer_state(self.model, self.optimizer, full),
            **self.checkpoint_extras(),
        }

    def checkpoint_extras(self) -> dict[str, Any]:
        """The part of a checkpoint that is not model or optimizer tensors (rank 0's)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "scaler": self.scaler.state_dict(),
            "state": self.state.state_dict(),
            "rng": capture_rng_state(),
            "config": self.plan.config.model_dump(mode="json"),
            "bad_images": {
                "train": self.train_loader.bad_images.state_dict(),
                "eval": self.eval_loader.bad_images.state_dict(),
            },
            "plan": {
                "lr": self.plan.lr,
                "global_batch": self.plan.global_batch,
                "steps_per_epoch": self.plan.steps_per_epoch,
                "duration_unit": self.plan.duration_unit,
                "run_length": self.plan.run_length,
                "precision": self.plan.precision,
                "precision_mode": self.plan.precision_mode,
            },
        }

    def load_checkpoint(self, path: Path) -> None:
        """Resume from a checkpoint of either format, whatever the process count that wrote it."""
        if is_sharded_checkpoint(path):
            reference = {
                "model": model_state(self.model, False),
                "optimizer": optimizer_state(self.model, self.optimizer, False),
            }
            tensors, extras = load_sharded(path, reference)
            self.load_payload({**tensors, **extras}, full=False)
        else:
            self.load_payload(load_checkpoint(path))

    def load_payload(self, payload: dict[str, Any], full: bool = True) -> None:
        load_model_state(self.model, payload["model"], full)
        load_optimizer_state(self.model, self.optimizer, payload["optimizer"], full)
        self.scaler.load_state_dict(payload["scaler"])
        self.step_fn.weights_changed()
        self.state = TrainState.from_state_dict(payload["state"])
        world = self.plan.world
        restore_rank_rng_state(
            payload, world.rank, world.size, derive_seed(self.plan.config.train.seed, world.data_rank, self.state.step)
        )
        bad_images = payload.get("bad_images", {})  # absent from checkpoints of older versions
        self.train_loader.bad_images.load_state_dict(bad_images.get("train", {}))
        self.eval_loader.bad_images.load_state_dict(bad_images.get("eval", {}))


def apply_cpu_kernels(model: nn.Module, plan: Plan) -> bool:
    """Convert ``model`` to the fused CPU kernels (:func:`vitrain.kernels.convert`) where the run wants
    them (:func:`vitrain.kernels.wanted`: bf16 on CPU, ``train.cpu_kernels`` not ``native``, the
    extension built or loaded from the cache before any clock starts). Returns whether it did."""
    if not kernels.wanted(plan.device, plan.precision):
        return False
    kernels.paths()  # where they will apply: probed once, before any clock
    kernels.convert(model)
    return True


def build_training_step(plan: Plan) -> TrainStep:
    """Seeded model, optimizer, schedule, scaler and the step that holds them (training and bench)."""
    configure_host_allocator(plan.config.train.host_allocator)  # before the step's first allocations
    kernels.set_mode(plan.config.train.cpu_kernels)
    cpu_features.warn_if_bf16_emulated(plan.device, plan.precision)
    torch.manual_seed(plan.config.train.seed)
    model = build_model_for(plan)
    apply_cpu_kernels(model, plan)
    if plan.config.train.channels_last:  # in place: same parameter objects, NHWC strides
        model.to(memory_format=torch.channels_last)
    sharded = plan.shards_model
    if sharded:  # before the optimizer: sharding replaces the parameters by DTensors
        apply_model_parallelism(model, plan)
    optimizer = build_optimizer(model, plan)
    step = TrainStep(
        model,
        optimizer,
        build_grad_scaler(plan.precision, plan.device, plan.precision_mode),
        plan.precision,
        plan.device,
        plan.config.train.label_smoothing,
        plan.config.optim.grad_clip,
        plan.precision_mode,
    )
    step.micro_batch = plan.config.train.micro_batch_size
    if plan.config.train.activation_checkpointing and not sharded:  # on the module that runs (O2: its copy)
        apply_activation_checkpointing(step.forward_module, plan.config.train.activation_checkpointing)
    if plan.config.train.compile and not sharded:
        apply_block_compile(step.forward_module, plan.config.train.compile_backend)
    if plan.world.size > 1:
        if not sharded:
            step.forward_module = wrap_data_parallel(step.forward_module, plan.device)
        step.agree_on_skip = lambda flag: all_reduce_(flag, "max")  # one rank's NaN skips the step everywhere
        # the same weights everywhere (seeded alike), but each data slice its own dropout / drop-path
        # draws (tensor-parallel peers compute one slice together, so they draw alike)
        torch.manual_seed(derive_seed(plan.config.train.seed, plan.world.data_rank))
    return step


def eval_batch_per_process(plan: Plan) -> int:
    return plan.eval_batch // plan.world.data_size


def forward_shapes(plan: Plan) -> list[tuple[int, int]]:
    """(batch, image size) of every forward pass the run will make: each stage's accumulation pieces
    (the last piece may be smaller) and evaluation (at data.image_size, padded to full batches)."""
    shapes = []
    for stage in plan.stages:
        share = stage.batch_size // plan.world.data_size
        micro = min(plan.config.train.micro_batch_size or share, share)
        shapes += [(micro, stage.image_size)] + ([(share % micro, stage.image_size)] if share % micro else [])
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
    for batch, size in shapes:
        images = torch.zeros(batch, plan.in_chans, size, size, device=plan.device)
        with deferred_gradient_sync(step_fn.forward_module):  # no gradient reduction across processes
            step_fn.forward_logits(run.normalize(images)).float().sum().backward()
    run.optimizer.zero_grad(set_to_none=True)
    for module in (run.model, step_fn.forward_module):
        for param in module.parameters():
            param.grad = None
    size = plan.config.data.image_size
    with torch.inference_mode(), autocast_context(plan.precision, plan.device):
        run.model.eval()
        run.model(
            run.normalize(torch.zeros(eval_batch_per_process(plan), plan.in_chans, size, size, device=plan.device))
        )
        run.model.train()
    with torch.no_grad():
        for name, buffer in run.model.named_buffers():
            buffer.copy_(buffers[name])
    restore_rng_state(rng)
    return time.perf_counter() - started


def build_run(plan: Plan) -> Run:
    step_fn = build_training_step(plan)
    model, optimizer, scaler = step_fn.model, step_fn.optimizer, step_fn.scaler
    train_loader, eval_loader = build_loaders(plan)
    return Run(
        plan=plan,
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        step_fn=step_fn,
        train_loader=train_loader,
        eval_loader=eval_loader,
        normalize=Normalize(plan.mean, plan.std, plan.device, plan.config.train.channels_last),
        checkpoints=CheckpointManager(plan.out_dir, plan.config.checkpoint.keep_last),
        state=TrainState(),
    )


def describe_length(plan: Plan) -> str:
    """The run's length in words, e.g. ``2106 steps (9.00 epochs)`` or ``a 600 s budget``."""
    if plan.duration_unit == "seconds":
        text = f"a {plan.run_length:g} s training budget"
    else:
        steps = plan.total_steps
        text = f"{steps} steps ({plan.epochs:.2f} epochs)" if steps is not None else f"{plan.epochs:.2f} epochs"
    if len(plan.stages) > 1:
        sizes = "->".join(str(stage.image_size) for stage in plan.stages)
        text += f", image sizes {sizes}"
    return text


def apply_init_from(run: Run, path: Path) -> list[str]:
    """Load a checkpoint's model weights into a new run (fine-tuning); returns the classifier
    parameters left at their initialization because the class count differs."""
    weights, info = read_checkpoint_model(path)
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
    saved_size = info.get("config", {}).get("data", {}).get("image_size")
    log.info(
        "initialized from %s (trained at %s px, now %d px)%s",
        path,
        saved_size,
        run.plan.config.data.image_size,
        f"; new classifier: {', '.join(fresh)}" if fresh else "",
    )
    return fresh


def find_resume_checkpoint(resume: str | None, plan: Plan) -> Path | None:
    """``auto``: the newest complete checkpoint of this run folder (or, when the folder name
    holds ``{time}``, of the newest sibling run of the same recipe); otherwise a path."""
    if resume is None:
        return None
    if resume != "auto":
        if not Path(resume).is_file():
            raise CheckpointError(f"--resume {resume}: no such checkpoint file; give a step-*.pt file or --resume auto")
        return Path(resume)
    template = plan.config.train.out_dir
    if "{time}" not in template:
        return find_latest_checkpoint(plan.out_dir)
    pattern = Path(template.format(recipe=plan.config.recipe, time="*"))
    candidates = [find_latest_checkpoint(folder) for folder in pattern.parent.glob(pattern.name)]
    candidates = [path for path in candidates if path is not None]
    return max(candidates, key=lambda path: path.stat().st_mtime, default=None)


def load_resume_payload(path: Path, plan: Plan) -> dict[str, Any]:
    """The checkpoint to resume from, refused (CheckpointError/ConfigError) when it is missing,
    unreadable, needs arbitrary unpickling, or holds another model than the config's."""
    payload = load_checkpoint(path / EXTRAS_FILE if is_sharded_checkpoint(path) else path)
    saved_model = payload.get("config", {}).get("model", {}).get("name")
    if saved_model != plan.config.model.name:
        raise ConfigError(
            f"--resume {path}: the checkpoint holds a {saved_model} but model.name={plan.config.model.name}; "
            "resume with the config the run started with, or start from its weights with vitrain finetune --from"
        )
    return payload


def resume_run(run: Run, payload: dict[str, Any], path: Path) -> None:
    try:
        if is_sharded_checkpoint(path):  # every rank reads its shards (DCP reshards to this process count)
            run.load_checkpoint(path)
        else:
            run.load_payload(payload)
    except (KeyError, RuntimeError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint {path} does not fit this run ({str(error).splitlines()[0][:200]}); "
            "resume with the config the run started with"
        ) from None
    log.info("resumed from %s at step %d", path, run.state.step)


def prepare_run_folder(plan: Plan) -> None:
    """Create the run folder and write the resolved config; an unwritable folder is a ConfigError."""
    if not plan.world.is_main:
        return
    try:
        plan.out_dir.mkdir(parents=True, exist_ok=True)
        write_file_atomic(plan.out_dir / "config.yaml", config_to_yaml(plan.config).encode())
    except OSError as error:
        raise ConfigError(
            f"train.out_dir={plan.out_dir}: cannot write the run folder ({error.strerror or error}); "
            "choose a writable folder or free disk space"
        ) from None


def _write_summary(
    run: Run,
    wall_s: float,
    images_this_session: int,
    session_train_s: float,
    session_data_wait_s: float,
    preempted: str | None = None,
) -> dict[str, Any]:
    state, plan = run.state, run.plan
    summary = {
        "model": plan.config.model.name,
        "num_params": num_parameters(run.model),
        "recipe": plan.config.recipe,
        "device": plan.device,
        "precision": plan.precision,
        "precision_mode": plan.precision_mode,
        "epochs": state.epoch_position(plan.num_train),
        "steps": state.step,
        "world_size": plan.world.size,
        "images_seen": state.images_seen,
        "best_top1": state.best_top1,
        "final_top1": state.last_eval["top1"] if state.last_eval else None,
        "final_top5": state.last_eval["top5"] if state.last_eval else None,
        "wall_s": wall_s,
        "train_s": state.train_s,
        "eval_s": state.eval_s,
        "checkpoint_s": state.checkpoint_s,
        "mean_img_s": images_this_session / session_train_s if session_train_s > 0 else None,
        "data_wait_frac": session_data_wait_s / session_train_s if session_train_s > 0 else None,
        "bad_images": run.train_loader.bad_images.counts(),
        "bad_eval_images": run.eval_loader.bad_images.counts(),
        "skipped_steps": state.skipped_steps,
        "preempted": preempted,
        **run_environment(plan.device),
    }
    if plan.world.is_main:
        write_file_atomic(plan.out_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
    return summary


class Trainer:
    """Runs a :class:`Run` to the end of its plan: stages of the curriculum, epochs of the data,
    windows of steps closed by one device sync (metrics line), eval and checkpoint at epoch ends,
    checkpoints by step or wall-clock cadence, and a checkpoint then :class:`Preempted` when one of
    ``stop``'s signals arrived."""

    def __init__(
        self,
        run: Run,
        metrics: JsonlWriter,
        clock: Callable[[], float] = time.perf_counter,
        stop: StopSignals | None = None,
    ):
        self.run, self.metrics, self.clock = run, metrics, clock
        self.plan = run.plan
        self.stop = stop or StopSignals()  # not entered: no signal is ever recorded
        self.stage: Stage | None = None
        self.last_eval_step = self.last_checkpoint_step = -1
        self.session_images, self.session_train_s, self.session_data_wait_s = 0, 0.0, 0.0
        self.window_images, self.window_started, self.window_data_wait_s = 0, 0.0, 0.0
        self.last_outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.skips = SkipCounter(self.plan.device, run.state.skipped_steps, run.state.skip_streak)
        self.wall_started = self.last_checkpoint_at = clock()

    # --- clocks and position -----------------------------------------------------------------

    def train_seconds(self) -> float:
        """Training seconds of the run so far, the open window included (host clock, no device sync).
        Several processes on a budget all take rank 0's clock, so they agree on LR, stages and the stop."""
        seconds = self.run.state.train_s + (self.clock() - self.window_started)
        if self.plan.world.size > 1 and self.plan.duration_unit == "seconds":
            seconds = rank0_value(seconds, self.plan.device)
        return seconds

    def progress(self) -> float:
        return run_progress(self.plan, self.run.state, self.train_seconds())

    def current_stage(self) -> Stage:
        return self.plan.stage_at(self.progress(), self.run.state.epoch_position(self.plan.num_train))

    def _clocks(self) -> dict[str, float]:
        """Training seconds (the run's total, eval/checkpoint excluded) and wall seconds of this session."""
        return {"train_s": self.run.state.train_s, "elapsed_s": self.clock() - self.wall_started}

    def _epoch(self) -> float:
        return self.run.state.epoch_position(self.plan.num_train)

    # --- eval, checkpoints, metrics ----------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        run = self.run
        started = self.clock()
        plan = self.plan
        result = evaluate(
            run.model,
            run.eval_loader,
            run.normalize,
            plan.precision,
            plan.device,
            replicas=plan.world.tp_size,
            pad_to=eval_batch_per_process(plan) if plan.config.train.compile else None,
        )
        run.state.eval_s += self.clock() - started
        run.state.last_eval = result
        if run.state.best_top1 is None or result["top1"] > run.state.best_top1:
            run.state.best_top1 = result["top1"]
        self.last_eval_step = run.state.step
        epoch = self._epoch()
        self.metrics.write({"event": "eval", "step": run.state.step, "epoch": epoch, **result, **self._clocks()})
        log.info(
            "step %d (epoch %.2f): eval top1 %.2f%% top5 %.2f%% loss %.4f",
            run.state.step,
            epoch,
            result["top1"],
            result["top5"],
            result["loss"],
        )
        return result

    def save_checkpoint(self) -> None:
        started = self.clock()
        run, world = self.run, self.plan.world
        rng_by_rank = gather_objects(capture_rng_state())  # each rank draws its own dropout
        if self.plan.checkpoint_format == "sharded":  # every rank writes its shards
            extras = run.checkpoint_extras()
            if len(rng_by_rank) > 1:
                extras["rng_by_rank"] = rng_by_rank
            final = run.checkpoints.path_for(run.state.step).with_suffix("")
            path = save_sharded(final, run.checkpoint_payload(full=False), extras, world.is_main)
            if world.is_main:
                run.checkpoints.prune()
                log.info("saved %s", path)
        else:
            gathered = self.plan.shards_model  # FSDP/TP: gathering the full state is a collective
            payload = run.checkpoint_payload() if gathered or world.is_main else None
            if world.is_main:  # DDP: every rank holds the same state; one writes it
                if len(rng_by_rank) > 1:
                    payload["rng_by_rank"] = rng_by_rank
                path = run.checkpoints.save(payload, run.state.step, top1=self._top1_at_this_step())
                log.info("saved %s", path)
        barrier()  # no rank runs ahead of a checkpoint it might need to resume from
        self.run.state.checkpoint_s += self.clock() - started
        self.last_checkpoint_step = self.run.state.step
        self.last_checkpoint_at = self.clock()

    def _top1_at_this_step(self) -> float | None:
        """The eval top-1 of the weights being saved (None without an eval at this step): ranks 'best'."""
        state = self.run.state
        return state.last_eval["top1"] if state.last_eval and self.last_eval_step == state.step else None

    def _checkpoint_or_stop(self, progress: tqdm) -> None:
        """After a step: checkpoint by the step or wall-clock cadence, or, when a signal asked, checkpoint
        and raise :class:`Preempted`. Several processes agree first, so all act at the same step."""
        plan, state = self.plan, self.run.state
        every_s = plan.checkpoint_every_s
        due_by_time = every_s > 0 and self.clock() - self.last_checkpoint_at >= every_s
        if plan.world.size > 1:
            stop, due_by_time = any_rank(self.stop.received is not None, due_by_time)
        else:
            stop = self.stop.received is not None
        if stop:
            self._preempt(progress)
        due_by_steps = plan.checkpoint_every_steps > 0 and state.step % plan.checkpoint_every_steps == 0
        if (due_by_steps or due_by_time) and self.progress() < 1.0:  # the end of the run saves anyway
            self._close_window(progress)
            self.save_checkpoint()
            self._open_window()

    def _preempt(self, progress: tqdm) -> None:
        state = self.run.state
        signal_name = self.stop.received or "a signal to another process"
        log.warning("%s: stopping after step %d with a checkpoint", signal_name, state.step)
        self._close_window(progress)
        self.metrics.write(
            {"event": "preempted", "step": state.step, "epoch": self._epoch(), "signal": signal_name, **self._clocks()}
        )
        if self.last_checkpoint_step != state.step:
            self.save_checkpoint()
        raise Preempted(signal_name, state.step, self.run.checkpoints.path_for(state.step))

    def _progress_bar(self) -> tqdm:
        mode = self.plan.config.train.progress
        disabled = (not sys.stderr.isatty() if mode == "auto" else not mode) or not self.plan.world.is_main
        unit = {"steps": "step", "samples": "img", "seconds": "s"}[self.plan.duration_unit]
        return tqdm(
            total=round(self.plan.run_length),
            initial=round(min(1.0, self.progress()) * self.plan.run_length),
            disable=disabled,
            unit=unit,
            unit_scale=unit == "img",
            dynamic_ncols=True,
        )

    def _open_window(self) -> None:
        self.window_images, self.window_started, self.window_data_wait_s = 0, self.clock(), 0.0

    def _close_window(self, progress: tqdm) -> None:
        """Synchronize once, charge the window's seconds to training, write a metrics line."""
        state = self.run.state
        if self.window_images == 0 or self.last_outputs is None:
            return
        loss, grad_norm = self.last_outputs
        loss_value = all_reduce_(loss.detach().float().clone(), "mean").item()  # the host sync of the window
        grad_norm_value = grad_norm.item()
        self._check_skipped_steps(loss_value, grad_norm_value)
        elapsed = self.clock() - self.window_started
        state.train_s += elapsed
        self.session_train_s += elapsed
        self.session_images += self.window_images
        self.session_data_wait_s += self.window_data_wait_s
        record = {
            "event": "train",
            "step": state.step,
            "epoch": self._epoch(),
            "loss": loss_value if math.isfinite(loss_value) else None,  # None: the last step was skipped
            "lr": self.run.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm_value if math.isfinite(grad_norm_value) else None,
            "skipped_steps": state.skipped_steps,
            "img_s": self.window_images / elapsed if elapsed > 0 else None,
            "data_wait_frac": self.window_data_wait_s / elapsed if elapsed > 0 else None,
            "image_size": self.stage.image_size if self.stage else None,
            "bad_images": len(self.run.train_loader.bad_images.bad),
            **self._clocks(),
        }
        self.metrics.write(record)
        progress.set_postfix(loss=f"{loss_value:.3f}", img_s=f"{record['img_s'] or 0:.0f}", refresh=False)
        self._open_window()

    def _check_skipped_steps(self, loss_value: float, grad_norm_value: float) -> None:
        """Bring the skip counts into the state; stop when a streak passed train.max_skipped_steps."""
        state, limit = self.run.state, self.plan.config.train.max_skipped_steps
        state.skipped_steps, state.skip_streak, longest = self.skips.read()
        if longest <= limit:
            return
        raise TrainingDiverged(
            f"{longest} steps in a row had a non-finite loss or gradient norm and were skipped "
            f"(train.max_skipped_steps={limit}); stopped at step {state.step} with loss {loss_value}, "
            f"grad norm {grad_norm_value}, lr {self.run.optimizer.param_groups[0]['lr']:.3g}; skipped steps "
            f"change no weights; last complete checkpoint: {find_latest_checkpoint(self.plan.out_dir) or 'none'}; "
            "lower optim.lr, keep optim.grad_clip set, or use precision=bf16/fp32"
        )

    def _enter_stage(self, stage: Stage) -> None:
        if stage != self.stage:
            if self.stage is not None or len(self.plan.stages) > 1:
                log.info(
                    "stage: image size %d, batch %d, lr x%g (epoch %.2f, %.1f%% of the run)",
                    stage.image_size,
                    stage.batch_size,
                    stage.lr_scale,
                    self._epoch(),
                    100 * self.progress(),
                )
                self.metrics.write(
                    {
                        "event": "stage",
                        "step": self.run.state.step,
                        "epoch": self._epoch(),
                        "image_size": stage.image_size,
                        "batch_size": stage.batch_size,
                        "lr_scale": stage.lr_scale,
                        **self._clocks(),
                    }
                )
            self.stage = stage
        self.run.train_loader.configure(stage.image_size, stage.batch_size)

    # --- the loop ----------------------------------------------------------------------------

    def _train_in_stage(self, progress: tqdm) -> bool:
        """Steps over the rest of the epoch; True when the epoch's data ran out, False when the run
        ended or the next stage began."""
        run, plan, state = self.run, self.plan, self.run.state
        batches = iter(run.train_loader)
        while True:
            waiting_since = self.clock()  # data wait: host time blocked on the loader (workers behind)
            batch = next(batches, None)
            self.window_data_wait_s += self.clock() - waiting_since
            if batch is None:
                return True
            images, labels = batch
            apply_lr(run.optimizer, scheduled_lr(plan, state, self.train_seconds()))
            images = run.normalize(images.to(plan.device, non_blocking=True))
            self.last_outputs = run.step_fn(images, labels.to(plan.device, non_blocking=True))
            self.skips.add(run.step_fn.skipped)
            state.step += 1
            images_in_step = len(labels) * plan.world.data_size  # the global batch (TP peers share a slice)
            state.images_seen += images_in_step
            state.epoch_images += images_in_step
            self.window_images += images_in_step
            position = min(1.0, self.progress()) * plan.run_length
            progress.update(round(position) - progress.n)
            if state.step % plan.config.train.log_every_steps == 0:
                self._close_window(progress)
            self._checkpoint_or_stop(progress)
            if self.progress() >= 1.0 or self.current_stage() != self.stage:
                return False

    def _end_epoch(self, progress: tqdm) -> None:
        state, plan = self.run.state, self.plan
        state.epoch, state.epoch_images = state.epoch + 1, 0
        due_eval = plan.eval_every_epochs > 0 and state.epoch % plan.eval_every_epochs == 0
        due_checkpoint = plan.checkpoint_every_epochs > 0 and state.epoch % plan.checkpoint_every_epochs == 0
        if not (due_eval or due_checkpoint) or self.progress() >= 1.0:
            return  # the end of the run evaluates and saves anyway
        self._close_window(progress)
        if due_eval:
            self.evaluate()
        if due_checkpoint:
            self.save_checkpoint()
        self._open_window()

    def train(self) -> dict[str, Any]:
        run, state = self.run, self.run.state
        self.wall_started = self.last_checkpoint_at = self.clock()
        self._open_window()
        run.model.train()
        with self._progress_bar() as progress:
            try:
                while self.progress() < 1.0:
                    self._enter_stage(self.current_stage())
                    run.train_loader.start_epoch(state.epoch, state.epoch_images)
                    if self._train_in_stage(progress):
                        self._end_epoch(progress)
            except Preempted as preempted:
                self._summary(preempted=preempted.signal_name)
                raise
            self._close_window(progress)
        if self.last_eval_step != state.step:
            self.evaluate()
        if self.last_checkpoint_step != state.step:
            self.save_checkpoint()
        return self._summary()

    def _summary(self, preempted: str | None = None) -> dict[str, Any]:
        return _write_summary(
            self.run,
            self.clock() - self.wall_started,
            self.session_images,
            self.session_train_s,
            self.session_data_wait_s,
            preempted,
        )


def train(plan: Plan, resume: str | None = None, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Train ``plan`` to its end (resuming from a checkpoint when asked); return the summary.
    ``clock`` (seconds) measures training time, hence budgets; tests inject a fake one."""
    checkpoint_path = broadcast_object(find_resume_checkpoint(resume, plan))  # rank 0's view of the folder
    payload = None
    if checkpoint_path is not None:
        plan = dataclasses.replace(plan, out_dir=checkpoint_path.parent.parent)
        payload = load_resume_payload(checkpoint_path, plan)  # refused before any work when it cannot serve
    elif resume == "auto":
        log.info("--resume auto: no checkpoint found, starting a new run")
    prepare_run_folder(plan)
    run = build_run(plan)
    if payload is not None:
        resume_run(run, payload, checkpoint_path)
    elif plan.config.train.init_from is not None:
        apply_init_from(run, Path(plan.config.train.init_from))
    log.info(
        "%s: %s params, %s at batch %d, lr %.3g, %s on %s -> %s",
        plan.config.model.name,
        f"{num_parameters(run.model) / 1e6:.2f}M",
        describe_length(plan),
        plan.global_batch,
        plan.lr,
        plan.precision + (f" ({plan.precision_mode})" if plan.precision_mode != "autocast" else ""),
        plan.device,
        plan.out_dir,
    )
    if plan.world.is_main:
        metrics = JsonlWriter(plan.out_dir / "metrics.jsonl", truncate_after_step=run.state.step)
    else:
        metrics = NullWriter()
    if plan.config.train.compile:
        seconds = warm_up_compiled_shapes(run)
        shapes = forward_shapes(plan)
        log.info("compiled %d training shape(s) and the eval shape in %.1f s (outside the clock)", len(shapes), seconds)
        metrics.write({"event": "compile", "step": run.state.step, "seconds": seconds, "shapes": shapes})
    try:
        with StopSignals() as stop:  # SIGTERM/SIGUSR1: finish the step, checkpoint, raise Preempted
            return Trainer(run, metrics, clock, stop).train()
    finally:
        metrics.close()
