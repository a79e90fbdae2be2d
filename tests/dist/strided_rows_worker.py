"""Run by ``torchrun --nproc-per-node=4`` from ``test_sharded.py``: FSDP2 over a tensor-parallel strided
shard (fsdp+tp's fused qkv) on a 2 × 2 (dp, tp) mesh, gathered whole and cut again by vitrain's checkpoint
code, once as this torch's FSDP2 labels it and once as torch 2.11 labels it (``Shard(0)`` for FSDP's cut).
Writes one JSON line per labeling and rank to the file named by the first argument."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from vitrain.checkpoint.sharded import full_tensor, shard_like

ROWS, COLUMNS = 18, 4  # q, k and v of 6 rows each: 9 rows per TP rank, cut 5 + 4 by FSDP


def _fsdp_over_strided(mesh, whole: torch.Tensor) -> DTensor:
    layer = nn.Linear(COLUMNS, ROWS, bias=False)
    strided = distribute_tensor(whole.clone(), mesh["tp"], [_StridedShard(0, split_factor=3)], src_data_rank=None)
    layer.weight = nn.Parameter(strided)
    fully_shard(layer, mesh=mesh["dp"])
    return layer.weight.data


def _check(name: str, value: DTensor, whole: torch.Tensor) -> dict:
    gathered = full_tensor(value)
    cut = shard_like(whole, value)
    return {
        "labeling": name,
        "rank": dist.get_rank(),
        "placements": str(value.placements),
        "gathered_equal": bool(torch.equal(gathered, whole)),
        "cut_equal": bool(torch.equal(cut.to_local(), value.to_local())),
        "cut_placements_kept": cut.placements == value.placements,
    }


def main(path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    whole = torch.arange(ROWS * COLUMNS, dtype=torch.float32).reshape(ROWS, COLUMNS)
    own = _fsdp_over_strided(mesh, whole)
    older = DTensor.from_local(
        own.to_local(),
        mesh,
        [Shard(0), _StridedShard(0, split_factor=3)],
        shape=whole.shape,
        stride=whole.stride(),
        run_check=False,
    )
    records = [_check("this torch's FSDP2", own, whole), _check("torch 2.11's", older, whole)]
    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            with open(path, "a") as file:
                file.writelines(json.dumps(record) + "\n" for record in records)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
