"""A run's :class:`~vitrain.config.Plan` from its config and the facts of this run: the data
source, this machine's hardware and the processes it runs in (``resolve`` itself stays pure)."""

from __future__ import annotations

import time

from vitrain.config import Config, Hardware, Plan, World, resolve
from vitrain.data import describe_source
from vitrain.parallel.distributed import broadcast_object


def make_plan(config: Config, world: World | None = None) -> Plan:
    """:func:`resolve` with the facts of this run: its data source, this machine's hardware, the
    processes it runs in, and one run-folder time shared by all of them."""
    now = broadcast_object(time.strftime("%Y%m%d-%H%M%S"))  # one run folder for all processes
    hardware = Hardware.detect(config.train.device)
    return resolve(config, describe_source(config.data), hardware, now=now, world=world or World())
