"""torch.distributed for runs launched by torchrun (or srun + torchrun, or srun alone): the process group
from the environment, and the few collectives the loop needs. Nothing here is home-made communication:
NCCL on GPUs, gloo on CPUs, torch's DistributedDataParallel for the model."""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from vitrain.config import World
from vitrain.parallel.slurm import slurm_rendezvous

log = logging.getLogger("vitrain")

_host_group: dist.ProcessGroup | None = None
"""A gloo group beside NCCL for decisions agreed on the host (stop, checkpoint), so they never wait for
the GPU; None: the default group is gloo already."""


SETUP_TIMEOUT_S = 1800.0
"""How long a collective may wait before the first step (at least): rank 0 alone measures the ``auto`` choices
and the CPU's matmul peak, and may build the fused kernels (minutes), while its peers wait for the answer.
:func:`start_step_timeout` then brings in ``parallel.timeout_s``."""


def init_distributed(world: World, cuda: bool, timeout_s: float) -> None:
    """Join the run's process group (a no-op for one process). Until :func:`start_step_timeout`, collectives
    wait up to ``max(timeout_s, SETUP_TIMEOUT_S)``."""
    if world.size == 1 or dist.is_initialized():
        return
    rendezvous = slurm_rendezvous(os.environ)  # srun without torchrun: none is set yet
    if rendezvous:
        os.environ.update(rendezvous)
        log.info("rendezvous from Slurm: %s", ", ".join(f"{key}={value}" for key, value in rendezvous.items()))
    if cuda:
        torch.cuda.set_device(world.local_rank)
    timeout = datetime.timedelta(seconds=max(timeout_s, SETUP_TIMEOUT_S))
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        timeout=timeout,
        store=attempt_store(os.environ, world.size, timeout),
        device_id=torch.device("cuda", world.local_rank) if cuda else None,
        rank=world.rank,  # srun alone sets no RANK / WORLD_SIZE for env:// to read
        world_size=world.size,
    )
    if cuda:
        global _host_group
        _host_group = dist.new_group(backend="gloo")
    log.info("process group: rank %d of %d (%s)", world.rank, world.size, dist.get_backend())


def attempt_store(environ: Mapping[str, str], world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The torchrun agent's store, with this attempt's keys apart from every earlier attempt's; None where
    torchrun shares no store (init_process_group then makes its own from MASTER_ADDR / MASTER_PORT).

    The agent keeps one store for all its restarts (``--max-restarts``), and the process group's start-up keys
    (each rank's gloo address, NCCL's unique id) do not name the attempt: after a restart, a rank could read
    the address a killed peer had published and fail with "Connection refused". The agent's restart count
    (the same on every node while the nodes restart together) keeps each attempt's keys apart."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in environ:
        return None
    agent = dist.TCPStore(
        environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"/vitrain/attempt_{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)


def start_step_timeout(timeout_s: float) -> None:
    """Once every process is here (a barrier under the set-up timeout), a collective of any group this process
    joined that waits longer than ``timeout_s`` raises: a dead or stuck peer fails the job instead of hanging
    it, and no peer's solo set-up work counts against the steps' timeout."""
    if not active():
        return
    dist.barrier()
    timeout = datetime.timedelta(seconds=timeout_s)
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # torch < 2.12
    for group in list(dist.distributed_c10d._world.pg_map):  # the default group, the host group, mesh groups
        if dist.get_rank(group) >= 0:  # a member (torch lists no group this process is not in; checked anyway)
            set_timeout(timeout, group)


def close_distributed() -> None:
    global _host_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _host_group = None


def active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (run folder names, timestamps)."""
    if not active():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In place: the sum (or mean, max) over ranks; unchanged for one process."""
    if active():
        if op == "mean":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= dist.get_world_size()
        else:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor


def rank0_value(value: float, device: str) -> float:
    """Rank 0's float on every rank: decisions every rank must take alike (the budget's clock)."""
    if not active():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(tensor, src=0)
    return float(tensor.item())


def any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each flag, true on every rank when it is true on any: decisions all ranks must take at the same
    step (stop on a signal one rank received, checkpoint by wall-clock). Agreed on the host over gloo."""
    if not active():
        return flags
    tensor = torch.tensor(flags, dtype=torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_host_group)
    return tuple(bool(value) for value in tensor.tolist())


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (``[value]`` for one process)."""
    if not active():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=_host_group)
    return gathered


def barrier() -> None:
    if active():
        dist.barrier()


def wrap_data_parallel(module: nn.Module, device: str) -> nn.Module:
    """DDP over the module that computes (the O2 copy under O2): gradients are averaged across ranks
    in buckets during the backward pass; rank 0's weights and buffers are broadcast at wrap time."""
    device_ids = [torch.device(device).index] if device.startswith("cuda") else None
    return DistributedDataParallel(module, device_ids=device_ids)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (a view: writing it writes the DTensor); a tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def holds_dtensors(model: nn.Module) -> bool:
    """Whether FSDP or tensor parallelism has sharded ``model``'s parameters (into DTensors)."""
    return any(isinstance(param, DTensor) for param in model.parameters())
