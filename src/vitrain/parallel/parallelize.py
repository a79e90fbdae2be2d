"""Parallelizing a built model over the processes of a run, from outside the model (docs/architecture.md,
"Speed tricks are applied from outside"): :func:`parallelize`, in torchtitan's order: tensor parallelism ->
activation checkpointing -> compile -> FSDP2 or DDP.

- **Mesh.** One named device mesh: ``("dp",)`` for fsdp, ``("tp",)`` for tp, ``("dp", "tp")`` for
  fsdp+tp (tensor-parallel peers are adjacent ranks, so on a cluster they share a node).
- **Tensor parallelism** (Megatron-LM, Shoeybi et al. 2019, section 3) with DTensor's
  ``parallelize_module``: in each ViT block the qkv and fc1 projections are column-parallel, proj and
  fc2 row-parallel, so a block costs one all-reduce in the forward of attention and one of the FFN.
  The fused qkv weight stacks q, k and v row-wise ([q; k; v], timm's layout); a plain row split would
  hand rank 0 all of q and part of k, so its rows are split per third (a strided shard: rank r holds
  its heads' rows of q, of k and of v). Parameter names and the checkpointed full tensors stay the
  single-process ones. Norms, embeddings and the head stay replicated.
- **FSDP2** ``fully_shard`` on every block, then on the root: parameters, gradients and optimizer
  state are sharded over "dp"; zero3 frees gathered block parameters after the forward, zero2 keeps
  them for the backward. precision_mode=o2 becomes FSDP's mixed-precision policy (blocks compute with
  bf16 parameters gathered from the fp32 shards, gradients reduced in fp32).
- **DDP** (ddp over several processes): torch's ``DistributedDataParallel`` around the module that
  runs; the model and its state-dict keys stay unwrapped. Not the composable ``replicate``: it hooks
  the module itself, so evaluation (which calls the model) would go through DDP too; measured on two
  CPU processes with BatchNorm (localvit), training weights were the same bitwise but the eval loss
  differed, and DDP warned of mismatched gradient strides.

Weights are initialized in full on every rank from the same seed, then sharded, so a sharded run
starts from exactly the single-process weights.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from vitrain.config import ParallelPlan
from vitrain.config.precision import PrecisionPolicy
from vitrain.parallel.activation_checkpoint import apply_activation_checkpointing
from vitrain.parallel.distributed import wrap_data_parallel

log = logging.getLogger("vitrain")


def build_mesh(parallel: ParallelPlan) -> DeviceMesh:
    """The run's device mesh with named dimensions ("dp" and/or "tp")."""
    world, strategy = parallel.world, parallel.strategy
    device_type = torch.device(parallel.device).type
    if strategy == "fsdp":
        return init_device_mesh(device_type, (world.size,), mesh_dim_names=("dp",))
    if strategy == "tp":
        return init_device_mesh(device_type, (world.size,), mesh_dim_names=("tp",))
    return init_device_mesh(device_type, (world.data_size, world.tp_size), mesh_dim_names=("dp", "tp"))


class FusedQKVColwiseParallel(ColwiseParallel):
    """Column parallelism for a fused ``[q; k; v]`` projection: each rank takes its share of the
    rows of each third, so its output is ``[q_r, k_r, v_r]`` for its heads."""

    def _partition_linear_fn(self, name, module, device_mesh):
        for param_name, param in module.named_parameters():
            sharded = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=3)], src_data_rank=0)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.forward = types.MethodType(_local_rows_linear, module)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        # already laid out as this rank's heads of q, k and v: no redistribution, just the local part
        return outputs.to_local()


def _local_rows_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The fused projection's product with this rank's rows, read as a plain row shard: the product each
    rank computes is the same, and DTensor's rules for a strided shard in a linear layer (which differ
    between torch releases: torch 2.11 cannot redistribute it) are not asked. The parameters stay
    strided shards (their global order is what checkpoints hold); the input gradient is still summed
    over the ranks."""

    def as_row_shard(param: DTensor | None) -> DTensor | None:
        if param is None:
            return None
        return DTensor.from_local(param.to_local(), param.device_mesh, [Shard(0)], run_check=False)

    return nn.functional.linear(x, as_row_shard(module.weight), as_row_shard(module.bias))


TENSOR_PARALLEL_LAYERS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
"""The linears of every block that tensor parallelism splits: column-, row-, column-, row-parallel."""


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split every ViT block's attention heads and FFN columns over ``mesh`` (resolve() admitted only
    models whose blocks have a fused-qkv ``attn`` and a two-layer ``mlp``)."""
    styles = (FusedQKVColwiseParallel(), RowwiseParallel(), ColwiseParallel(), RowwiseParallel())
    plan = dict(zip(TENSOR_PARALLEL_LAYERS, styles, strict=True))
    for block in model.block_modules():
        parallelize_module(block, mesh, plan)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, parallel: ParallelPlan, precision: PrecisionPolicy) -> None:
    """FSDP2 per block, then the root (whose remaining parameters form one more group); under O2 each
    BatchNorm first, in fp32 (FSDP's low-precision gather would hand it bf16 weights beside its fp32
    running statistics, which ``batch_norm`` refuses)."""
    o2 = precision.weights == "fsdp_mixed_precision"
    policy = MixedPrecisionPolicy(
        param_dtype=precision.compute_dtype if o2 else None,
        reduce_dtype=torch.float32 if o2 else None,
    )
    options = {
        "mesh": mesh,
        "mp_policy": policy,
        "offload_policy": CPUOffloadPolicy() if parallel.fsdp_cpu_offload else OffloadPolicy(),
    }
    reshard = parallel.fsdp_reshard == "zero3"
    units = []
    if o2:  # BatchNorm stays fp32 as in O2's copy: its own unit, gathered in fp32, its input left as it comes
        fp32 = {**options, "mp_policy": MixedPrecisionPolicy(torch.float32, torch.float32, cast_forward_inputs=False)}
        for norm in [module for module in model.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]:
            fully_shard(norm, reshard_after_forward=reshard, **fp32)
            units.append(norm)
    for block in model.block_modules():
        fully_shard(block, reshard_after_forward=reshard, **options)
    fully_shard(model, reshard_after_forward=False, **options)  # the root is needed first in the backward
    if mesh.device_type == "cpu":
        # gloo: reduce-scatter with SUM and divide after, not with AVG, which torch 2.8's gloo summed
        # (every gradient times the world size)
        for module in (*units, *model.block_modules(), model):
            module.set_force_sum_reduction_for_comms(True)


def apply_buffer_sync(model: nn.Module, mesh: DeviceMesh) -> None:
    """BatchNorm running statistics are per process under FSDP (each sees its own slice); as DDP does,
    every training forward starts from the first data-parallel rank's. They are broadcast after each
    training forward (not before, as DDP does): every forward still starts from rank 0's statistics, and
    between steps every rank holds them, so evaluation and checkpoints see the same model everywhere."""
    buffers = [buffer for module in model.modules() for buffer in module.buffers(recurse=False)]
    buffers = [buffer for buffer in buffers if buffer.is_floating_point()]
    if not buffers:
        return
    group = mesh.get_group("dp")

    def broadcast_buffers(module: nn.Module, args, output) -> None:
        if module.training:
            for buffer in buffers:
                dist.broadcast(buffer, group=group, group_src=0)

    model.register_forward_hook(broadcast_buffers)


def apply_compile(model: nn.Module, parallel: ParallelPlan) -> None:
    """``torch.compile`` the module in place: per block (:func:`apply_block_compile`), or, for
    ``compile_scope=model`` (the benchmark's ``--compile``), the whole module at once."""
    if parallel.compile_scope == "blocks":
        apply_block_compile(model, parallel.compile_backend, parallel.compile_mode)
    else:
        model.compile(backend=parallel.compile_backend, mode=compile_mode_argument(parallel.compile_mode))


def compile_mode_argument(mode: str) -> str | None:
    """torch.compile's ``mode`` argument for ``performance.compile_mode`` (None: torch's default)."""
    return None if mode == "default" else mode


def apply_block_compile(model: nn.Module, backend: str, mode: str = "default") -> None:
    """``torch.compile`` every block in place (torchtitan's per-block compile: blocks of one class share a
    graph, so compiling costs one block per input shape, not the whole model). Shapes are static: each
    new one compiles once (the loop warms them all before its clock), so the recompile limit must cover
    them; the loop raises it to the number of shapes of the run."""
    for block in model.block_modules():
        block.compile(backend=backend, dynamic=False, mode=compile_mode_argument(mode))


def parallelize(model: nn.Module, parallel: ParallelPlan, precision: PrecisionPolicy) -> nn.Module:
    """Apply the plan's parallelism to ``model``, the module that runs forward and backward (under O2
    its low-precision copy), in this order: tensor parallelism -> activation checkpointing -> compile ->
    FSDP2 (fsdp, fsdp+tp) or DDP (ddp over several processes). Returns the module each step calls:
    ``model`` itself, changed in place, or its DDP wrapper. ``precision``: FSDP2's mixed-precision policy."""
    mesh = build_mesh(parallel) if parallel.shards_model else None
    if mesh is not None and "tp" in parallel.strategy:
        apply_tensor_parallel(model, mesh["tp"])
    if parallel.activation_checkpointing:
        apply_activation_checkpointing(model, parallel.activation_checkpointing)
    if parallel.compile:
        apply_compile(model, parallel)
    if mesh is not None:
        if parallel.fsdp:
            apply_fsdp(model, mesh["dp"], parallel, precision)
            apply_buffer_sync(model, mesh)
        shape = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
        log.info("parallel: %s over mesh %s", parallel.strategy, shape)
    elif parallel.world.size > 1:
        return wrap_data_parallel(model, parallel.device)
    return model
