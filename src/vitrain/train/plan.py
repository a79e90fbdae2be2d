"""A run's :class:`~vitrain.config.Plan` from its config and the facts of this run: the data
source, this machine's hardware, the processes it runs in, and what the ``auto`` settings measure
here (``resolve`` itself stays pure)."""

from __future__ import annotations

import dataclasses
import time

from vitrain import cpu_features
from vitrain.config import Config, Plan, World, resolve
from vitrain.data import describe_source
from vitrain.hardware import detect_hardware
from vitrain.models import model_facts
from vitrain.parallel.distributed import broadcast_object
from vitrain.train.precision_choice import measure_precision


def make_plan(config: Config, world: World | None = None, measure: bool = True) -> Plan:
    """:func:`resolve` with the facts of this run: its data source, this machine's hardware, the
    processes it runs in and one run-folder time shared by all of them; every mistake in the input is
    raised before anything is measured. ``measure``: then choose the ``auto`` precision, mode and CPU
    kernels by timing the run's step (:func:`with_measured_choices`); ``train()`` does so itself, after
    checking the resume point and the run folder."""
    world = world or World()
    now = broadcast_object(time.strftime("%Y%m%d-%H%M%S"))  # one run folder for all processes
    plan = resolve(
        config, describe_source(config.data), detect_hardware(config.train.device), model_facts, now=now, world=world
    )
    if config.precision == "bf16":  # asked for; auto takes it only where it measures faster
        cpu_features.warn_if_bf16_emulated(plan.device, plan.precision.dtype)
    return with_measured_choices(plan) if measure else plan


def with_measured_choices(plan: Plan) -> Plan:
    """``plan`` with its ``auto`` precision, mode and CPU kernels chosen by measurement
    (:mod:`vitrain.train.precision_choice`; cached), its run folder kept; unchanged where they were
    measured already or nothing is left to choose."""
    if plan.measured is not None:
        return plan
    config = plan.config
    info, hardware = describe_source(config.data), detect_hardware(config.train.device)
    measured = measure_precision(config, info, hardware, plan.world)
    if measured is None:
        return plan
    world = dataclasses.replace(plan.world, tp_size=1)  # resolve derives it again
    return dataclasses.replace(
        resolve(config, info, hardware, model_facts, world=world, measured=measured), out_dir=plan.out_dir
    )
