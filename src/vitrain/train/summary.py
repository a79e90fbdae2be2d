"""What a run says about itself: its length in words (the start line) and ``summary.json`` (the end)."""

from __future__ import annotations

import json
from typing import Any

from vitrain.config import SchedulePlan
from vitrain.config.precision import PrecisionPolicy
from vitrain.io import write_file_atomic
from vitrain.metrics import run_environment
from vitrain.models import num_parameters
from vitrain.train.attention_probe import attention_impl
from vitrain.train.build import Run


def describe_length(schedule: SchedulePlan) -> str:
    """The run's length in words, e.g. ``2106 steps (9.00 epochs)`` or ``a 600 s budget``."""
    if schedule.duration_unit == "seconds":
        text = f"a {schedule.run_length:g} s training budget"
    else:
        steps = schedule.total_steps
        text = f"{steps} steps ({schedule.epochs:.2f} epochs)" if steps is not None else f"{schedule.epochs:.2f} epochs"
    if len(schedule.stages) > 1:
        sizes = "->".join(str(stage.image_size) for stage in schedule.stages)
        text += f", image sizes {sizes}"
    return text


def describe_precision(policy: PrecisionPolicy) -> str:
    """``bf16 (o2)``, ``fp32``, ``fp8 (o2, tensorwise)``: the precision, the mode where it is not autocast,
    and FP8's scaling."""
    details = [policy.mode] if policy.mode != "autocast" else []
    details += [policy.fp8_scaling] if policy.fp8_scaling else []
    return policy.name + (f" ({', '.join(details)})" if details else "")


def describe_start(run: Run) -> str:
    """The run's first log line: model, size, length, batch, LR, precision, device and folder."""
    plan = run.plan
    return (
        f"{plan.model.name}: {num_parameters(run.model) / 1e6:.2f}M params, {describe_length(plan.schedule)} at batch "
        f"{plan.batch.global_batch}, lr {plan.schedule.lr:.3g}, {describe_precision(plan.precision)} on "
        f"{plan.device} -> {plan.out_dir}"
    )


def write_summary(
    run: Run,
    wall_s: float,
    images_this_session: int,
    session_train_s: float,
    session_data_wait_s: float,
    preempted: str | None = None,
    utilization: dict[str, float | None] | None = None,
    profile: dict[str, Any] | None = None,
    data_reads: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    """Write ``summary.json`` (rank 0) and return it. ``utilization``: the session's ``mean_tflops`` (the
    whole job's), ``mean_mfu`` (per device), the peak MFU divides by (``mfu_peak_tflops``, ``mfu_peak_source``)
    and ``peak_mem_gib``, as the training loop measured them;
    ``profile``: the steps and files of a ``train.profile`` trace (rank 0's); ``data_reads``: the session's
    ``mean_read_mb_s`` and ``mean_files_s`` (rank 0's training loader; None for in-memory data). ``auto``: the
    measured choice of the run's ``auto`` precision, mode and CPU kernels, with every candidate's img/s."""
    state, plan = run.state, run.plan
    summary = {
        "model": plan.model.name,
        "num_params": num_parameters(run.model),
        "recipe": plan.config.recipe,
        "device": plan.device,
        "precision": plan.precision.name,
        "precision_mode": plan.precision.mode,
        "attention": attention_impl(run.model),
        "epochs": state.epoch_position(plan.schedule.num_train),
        "steps": state.step,
        "world_size": plan.world.size,
        "images_seen": state.images_seen,
        "best_top1": state.best_top1,
        "final_top1": state.last_eval["top1"] if state.last_eval else None,
        "final_top5": state.last_eval["top5"] if state.last_eval else None,
        "best_ema_top1": state.best_ema_top1,
        "final_ema_top1": state.last_eval.get("ema_top1") if state.last_eval else None,
        "final_cls_top1": state.last_eval.get("cls_top1") if state.last_eval else None,
        "wall_s": wall_s,
        "train_s": state.train_s,
        "eval_s": state.eval_s,
        "checkpoint_s": state.checkpoint_s,
        "mean_img_s": images_this_session / session_train_s if session_train_s > 0 else None,
        **{"mean_tflops": None, "mean_mfu": None, "mfu_peak_tflops": None, "mfu_peak_source": None},
        **{"peak_mem_gib": None, **(utilization or {})},
        "auto": plan.measured.record() if plan.measured is not None else None,
        "data_wait_frac": session_data_wait_s / session_train_s if session_train_s > 0 else None,
        **{"mean_read_mb_s": None, "mean_files_s": None, **(data_reads or {})},
        "bad_images": run.train_loader.bad_images.counts(),
        "bad_eval_images": run.eval_loader.bad_images.counts(),
        "skipped_steps": state.skipped_steps,
        "preempted": preempted,
        "profile": profile or None,
        **run_environment(plan.device),
    }
    if plan.world.is_main:
        write_file_atomic(plan.out_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
    return summary
