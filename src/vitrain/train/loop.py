"""The training loop over a built :class:`~vitrain.train.build.Run`.

:func:`train`: maybe resume -> build (``vitrain.train.build``) -> loop (step, log, eval, checkpoint by
cadence or signal) -> finish (summary).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vitrain.checkpoint import find_latest_checkpoint, find_resume_checkpoint, load_resume_payload
from vitrain.config import Plan, Stage
from vitrain.data.mixing import mixing_generator
from vitrain.metrics import MetricsSinks, NullWriter, ThroughputMeter, build_metrics_sinks
from vitrain.metrics.profiling import StepProfiler
from vitrain.models.flops import model_flops
from vitrain.parallel.distributed import all_reduce_, any_rank, broadcast_object, rank0_value, start_step_timeout
from vitrain.parallel.heartbeat import Heartbeat
from vitrain.train.build import (
    Run,
    apply_init_from,
    build_run,
    forward_shapes,
    prepare_run_folder,
    run_peaks,
    warm_up_compiled_shapes,
)
from vitrain.train.evaluate import evaluate
from vitrain.train.plan import with_measured_choices
from vitrain.train.schedule import apply_lr, run_progress, scheduled_lr, scheduled_lr_of
from vitrain.train.signals import Preempted, StopSignals
from vitrain.train.skips import SkipCounter
from vitrain.train.state import TrainState
from vitrain.train.summary import describe_start, write_summary

log = logging.getLogger("vitrain")


class TrainingDiverged(RuntimeError):
    """Too many steps in a row had a NaN/inf loss or gradient norm; the message names the step, LR,
    gradient norm, last complete checkpoint and what to try."""


class Trainer:
    """Runs a :class:`Run` to the end of its plan: stages of the curriculum, epochs of the data,
    windows of steps closed by one device sync (metrics line), eval and checkpoint at epoch ends,
    checkpoints by step or wall-clock cadence, and a checkpoint then :class:`Preempted` when one of
    ``stop``'s signals arrived."""

    def __init__(
        self,
        run: Run,
        metrics: MetricsSinks | NullWriter,
        clock: Callable[[], float] = time.perf_counter,
        stop: StopSignals | None = None,
    ):
        self.run, self.metrics, self.clock = run, metrics, clock
        self.plan = run.plan
        self.stop = stop or StopSignals()  # not entered: no signal is ever recorded
        self.stage: Stage | None = None
        self.last_eval_step = self.last_checkpoint_step = -1
        # rank 0 alone writes metrics: the others skip the CPU's matmul probe
        peak, bf16_peak = run_peaks(self.plan) if self.plan.world.is_main else (None, None)
        if peak is not None and peak.tflops:
            log.info("MFU divides by %.3g TFLOP/s per device (%s)", peak.tflops, peak.source)
        self.meter = ThroughputMeter(self.plan.device, self.plan.world.size, peak, bf16_peak)
        self.last_outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.skips = SkipCounter(self.plan.device, run.state.skipped_steps, run.state.skip_streak)
        world = self.plan.world
        self.heartbeat = Heartbeat(world.rank, world.size, self.plan.config.parallel.timeout_s)
        self.profiler = StepProfiler(self.plan.loop.profile, self.plan.out_dir, self.plan.world.rank, self.plan.device)
        start_step_timeout(self.plan.config.parallel.timeout_s)  # rank 0's probes above are set-up
        self.wall_started = self.last_checkpoint_at = clock()

    # --- clocks and position -----------------------------------------------------------------

    def train_seconds(self) -> float:
        """Training seconds of the run so far, the open window included (host clock, no device sync).
        Several processes on a budget all take rank 0's clock, so they agree on LR, stages and the stop."""
        seconds = self.run.state.train_s + (self.clock() - self.meter.window.started)
        if self.plan.world.size > 1 and self.plan.schedule.duration_unit == "seconds":
            seconds = rank0_value(seconds, self.plan.device)
        return seconds

    def progress(self) -> float:
        return run_progress(self.plan.schedule, self.run.state, self.train_seconds())

    def current_stage(self) -> Stage:
        return self.plan.schedule.stage_at(self.progress(), self._epoch())

    def _clocks(self) -> dict[str, float]:
        """Training seconds (the run's total, eval/checkpoint excluded) and wall seconds of this session."""
        return {"train_s": self.run.state.train_s, "elapsed_s": self.clock() - self.wall_started}

    def _epoch(self) -> float:
        return self.run.state.epoch_position(self.plan.schedule.num_train)

    # --- eval, checkpoints, metrics ----------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        run = self.run
        started = self.clock()
        result = self._evaluate_weights(run.model)
        result.update(self._evaluate_ema())
        run.state.eval_s += self.clock() - started
        run.state.last_eval = result
        if run.state.best_top1 is None or result["top1"] > run.state.best_top1:
            run.state.best_top1 = result["top1"]
        self.last_eval_step = run.state.step
        epoch = self._epoch()
        self.metrics.write({"event": "eval", "step": run.state.step, "epoch": epoch, **result, **self._clocks()})
        ema = (
            f"; EMA weights top1 {result['ema_top1']:.2f}% top5 {result['ema_top5']:.2f}%"
            if "ema_top1" in result
            else ""
        )
        if "cls_top1" in result:
            ema = f" (class head alone {result['cls_top1']:.2f}%){ema}"
        log.info(
            "step %d (epoch %.2f): eval top1 %.2f%% top5 %.2f%% loss %.4f%s",
            run.state.step,
            epoch,
            result["top1"],
            result["top5"],
            result["loss"],
            ema,
        )
        return result

    def _evaluate_weights(self, model: torch.nn.Module) -> dict[str, float]:
        plan = self.plan
        return evaluate(
            model,
            self.run.eval_loader,
            self.run.normalize,
            plan.precision,
            replicas=plan.world.tp_size,
            pad_to=plan.batch.eval_per_process if plan.parallel.compile else None,
        )

    # --- weight EMA --------------------------------------------------------------------------

    def _update_ema(self) -> None:
        """After an optimizer step, at the EMA's cadence (a skipped step leaves it unchanged, on the device)."""
        ema, step = self.run.ema, self.run.state.step
        if ema is not None and step % self.plan.ema.every_steps == 0:
            ema.update(step, self.run.step_fn.skipped)

    def _evaluate_ema(self) -> dict[str, float]:
        """``ema_top1``, ``ema_top5``, ``ema_loss`` of the EMA weights (none when the run evaluates no EMA)."""
        state = self.run.state
        if self.run.ema is None or not self.plan.ema.evaluate:
            return {}
        with self.run.ema.applied() as model:
            result = self._evaluate_weights(model)
        if state.best_ema_top1 is None or result["top1"] > state.best_ema_top1:
            state.best_ema_top1 = result["top1"]
        return {f"ema_{key}": result[key] for key in ("top1", "top5", "loss")}

    def save_checkpoint(self) -> None:
        started = self.clock()
        self.run.checkpoints.save(self.run.state, top1=self._top1_at_this_step())
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
        every_s = plan.checkpoint.every_s
        due_by_time = every_s > 0 and self.clock() - self.last_checkpoint_at >= every_s
        if plan.world.size > 1:
            stop, due_by_time = any_rank(self.stop.received is not None, due_by_time)
        else:
            stop = self.stop.received is not None
        if stop:
            self._preempt(progress)
        every_steps = plan.checkpoint.every_steps
        due_by_steps = every_steps > 0 and state.step % every_steps == 0
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
        raise Preempted(signal_name, state.step, self.run.checkpoints.manager.path_for(state.step))

    def _progress_bar(self) -> tqdm:
        mode, schedule = self.plan.loop.progress, self.plan.schedule
        disabled = (not sys.stderr.isatty() if mode == "auto" else not mode) or not self.plan.world.is_main
        unit = {"steps": "step", "samples": "img", "seconds": "s"}[schedule.duration_unit]
        return tqdm(
            total=round(schedule.run_length),
            initial=round(min(1.0, self.progress()) * schedule.run_length),
            disable=disabled,
            unit=unit,
            unit_scale=unit == "img",
            dynamic_ncols=True,
        )

    def _open_window(self) -> None:
        self.meter.open_window(self.clock(), self.run.train_loader.read_counts)

    def _close_window(self, progress: tqdm) -> None:
        """Synchronize once, charge the window's seconds to training, write a metrics line."""
        state = self.run.state
        if self.meter.window.images == 0 or self.last_outputs is None:
            return
        loss, grad_norm = self.last_outputs
        loss_value = all_reduce_(loss.detach().float().clone(), "mean").item()  # the host sync of the window
        grad_norm_value = grad_norm.item()
        self._check_skipped_steps(loss_value, grad_norm_value)
        elapsed, throughput = self.meter.close_window(self.clock(), self.run.train_loader.read_counts)
        state.train_s += elapsed
        record = {
            "event": "train",
            "step": state.step,
            "epoch": self._epoch(),
            "loss": loss_value if math.isfinite(loss_value) else None,  # None: the last step was skipped
            "lr": scheduled_lr_of(self.run.optimizer),
            "grad_norm": grad_norm_value if math.isfinite(grad_norm_value) else None,
            "skipped_steps": state.skipped_steps,
            **throughput,  # img_s, tflops, mfu, peak_mem_gib, data_wait_frac, read_mb_s, files_s
            "image_size": self.stage.image_size if self.stage else None,
            "bad_images": len(self.run.train_loader.bad_images.bad),
            **self._clocks(),
        }
        self.metrics.write(record)
        mfu = {} if record["mfu"] is None else {"mfu": f"{100 * record['mfu']:.1f}%"}
        progress.set_postfix(loss=f"{loss_value:.3f}", img_s=f"{record['img_s'] or 0:.0f}", **mfu, refresh=False)
        self._open_window()

    def _check_skipped_steps(self, loss_value: float, grad_norm_value: float) -> None:
        """Bring the skip counts into the state; stop when a streak passed train.max_skipped_steps."""
        state, limit = self.run.state, self.plan.loop.max_skipped_steps
        state.skipped_steps, state.skip_streak, longest = self.skips.read()
        if longest <= limit:
            return
        raise TrainingDiverged(
            f"{longest} steps in a row had a non-finite loss or gradient norm and were skipped "
            f"(train.max_skipped_steps={limit}); stopped at step {state.step} with loss {loss_value}, "
            f"grad norm {grad_norm_value}, lr {scheduled_lr_of(self.run.optimizer):.3g}; skipped steps "
            f"change no weights; last complete checkpoint: {find_latest_checkpoint(self.plan.out_dir) or 'none'}; "
            "lower optim.lr, keep optim.grad_clip set, or use precision=bf16/fp32"
        )

    def _enter_stage(self, stage: Stage) -> None:
        if stage != self.stage:
            if self.stage is not None or len(self.plan.schedule.stages) > 1:
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
            self.meter.forward_flops = self._forward_flops(stage.image_size)
        self.run.train_loader.configure(stage.image_size, stage.batch_size)

    def _forward_flops(self, image_size: int) -> int:
        """Analytic forward FLOPs per image at ``image_size`` (0, with a warning, for a model without them)."""
        try:
            return model_flops(self.run.model, image_size)
        except TypeError as error:
            log.warning("no TFLOP/s or MFU in the metrics: %s", error)
            return 0

    # --- the loop ----------------------------------------------------------------------------

    def _train_in_stage(self, progress: tqdm) -> bool:
        """Steps over the rest of the epoch; True when the epoch's data ran out, False when the run
        ended or the next stage began."""
        run, plan, state = self.run, self.plan, self.run.state
        batches = iter(run.train_loader)
        while True:
            waiting_since = self.clock()  # data wait: host time blocked on the loader (workers behind)
            batch = next(batches, None)
            self.meter.waited_for_data(self.clock() - waiting_since)
            if batch is None:
                return True
            apply_lr(run.optimizer, scheduled_lr(plan.schedule, state, self.train_seconds()))
            images, labels, token_box = self._on_device(*batch)
            mixing = {} if token_box is None else {"token_box": token_box}
            self.profiler.before_step(state.step)
            self.last_outputs = run.step_fn(images, labels, **mixing)
            self.skips.add(run.step_fn.skipped)
            self.profiler.after_step(state.step)
            state.step += 1
            self.heartbeat.beat(state.step)
            self._update_ema()
            images_in_step = plan.batch.global_of(len(labels))  # the global batch (TP peers share a slice)
            state.images_seen += images_in_step
            state.epoch_images += images_in_step
            self.meter.stepped(images_in_step)
            position = min(1.0, self.progress()) * plan.schedule.run_length
            progress.update(round(position) - progress.n)
            if state.step % plan.loop.log_every_steps == 0:
                self._close_window(progress)
            self._checkpoint_or_stop(progress)
            if self.progress() >= 1.0 or self.current_stage() != self.stage:
                return False

    def _on_device(self, images: torch.Tensor, labels: torch.Tensor, geometry: torch.Tensor | None = None):
        """A loader batch as the step takes it: normalized images on the device, their labels and the step's
        MixToken box (or None). With Mixup/CutMix, the mixed images and soft targets; with token labels, the
        dense targets of the crops (``geometry``). The mixing draws are a function of (seed, data slice,
        epoch, step), so a resumed run mixes as the uninterrupted one did."""
        run, plan, state = self.run, self.plan, self.run.state
        images = run.normalize(images.to(plan.device, non_blocking=True))
        labels = labels.to(plan.device, non_blocking=True)
        if run.mixer is None and run.token_targets is None:
            return images, labels, None
        rng = mixing_generator(plan.seed, plan.world.data_rank, state.epoch, state.step)
        if run.token_targets is not None:
            size = images.shape[-1]
            return images, run.token_targets(labels, geometry, size), run.token_targets.draw_box(size, rng)
        return *run.mixer(images, labels, rng), None

    def _end_epoch(self, progress: tqdm) -> None:
        state, plan = self.run.state, self.plan
        state.epoch, state.epoch_images = state.epoch + 1, 0
        eval_every, checkpoint_every = plan.loop.eval_every_epochs, plan.checkpoint.every_epochs
        due_eval = eval_every > 0 and state.epoch % eval_every == 0
        due_checkpoint = checkpoint_every > 0 and state.epoch % checkpoint_every == 0
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
                self.profiler.close()
                self._summary(preempted=preempted.signal_name)
                raise
            except RuntimeError as error:  # a collective that failed because a peer died or hangs: name it
                explained = self.heartbeat.explain(error)
                if explained is error:
                    raise
                raise explained from error
            self._close_window(progress)
        self.profiler.close()
        if self.last_eval_step != state.step:
            self.evaluate()
        if self.last_checkpoint_step != state.step:
            self.save_checkpoint()
        return self._summary()

    def _summary(self, preempted: str | None = None) -> dict[str, Any]:
        """Write summary.json and hand the summary to the metric sinks."""
        meter = self.meter
        summary = write_summary(
            self.run,
            self.clock() - self.wall_started,
            meter.images,
            meter.train_s,
            meter.data_wait_s,
            preempted,
            meter.session_utilization(),
            self.profiler.files,
            meter.session_reads(self.run.train_loader.read_counts),
        )
        self.metrics.log_summary(summary)
        return summary


def train(plan: Plan, resume: str | None = None, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Train ``plan`` to its end (resuming from a checkpoint when asked); return the summary.
    ``clock`` (seconds) measures training time, hence budgets; tests inject a fake one."""
    plan, checkpoint_path, payload = _resume_point(plan, resume)
    prepare_run_folder(plan)
    plan = with_measured_choices(plan)  # after every check of the input: measuring is work
    run = build_run(plan)
    if payload is not None:
        run.state = TrainState.from_state_dict(run.checkpoints.resume(checkpoint_path, payload))
    elif plan.loop.init_from is not None:
        apply_init_from(run, plan.loop.init_from)
    log.info("%s", describe_start(run))
    metrics = build_metrics_sinks(plan.log, plan.out_dir, run.state.step) if plan.world.is_main else NullWriter()
    try:
        metrics.log_config(plan.config.model_dump(mode="json"))
        if plan.parallel.compile:
            _warm_up(run, metrics)
        with StopSignals() as stop:  # SIGTERM/SIGUSR1: finish the step, checkpoint, raise Preempted
            return Trainer(run, metrics, clock, stop).train()
    finally:
        metrics.close()


def _resume_point(plan: Plan, resume: str | None) -> tuple[Plan, Path | None, dict[str, Any] | None]:
    """The checkpoint to resume from (rank 0's view of the folder), its content, and the plan with the
    run folder it belongs to; refused before any work when it cannot serve."""
    checkpoint_path = broadcast_object(find_resume_checkpoint(resume, plan.out_dir, plan.checkpoint.sibling_runs))
    if checkpoint_path is None:
        if resume == "auto":
            log.info("--resume auto: no checkpoint found, starting a new run")
        return plan, None, None
    plan = dataclasses.replace(plan, out_dir=checkpoint_path.parent.parent)
    return plan, checkpoint_path, load_resume_payload(checkpoint_path, plan.model.name)


def _warm_up(run: Run, metrics: MetricsSinks | NullWriter) -> None:
    """performance.compile: every shape compiled before the clock starts."""
    seconds = warm_up_compiled_shapes(run)
    shapes = forward_shapes(run.plan)
    log.info("compiled %d training shape(s) and the eval shape in %.1f s (outside the clock)", len(shapes), seconds)
    metrics.write({"event": "compile", "step": run.state.step, "seconds": seconds, "shapes": shapes})
