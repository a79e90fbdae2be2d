"""Sharded checkpoints (``torch.distributed.checkpoint``, DCP) and the state-dict views every format uses.

A sharded checkpoint is a folder ``checkpoints/step-NNNNNNNNN/``: every rank writes its shards of the
model, optimizer and weight EMA (DCP's ``.distcp`` files and ``.metadata``), rank 0 writes ``extras.pt`` (loop
state, RNG, scaler, config: tensors and plain containers only) and, last, the completion marker
``COMPLETE``. All of it is written under ``step-NNNNNNNNN.tmp`` and renamed into place after the
marker, so a folder with the final name is complete; a crash leaves only a ``.tmp`` folder that the
next save removes. DCP reshards on load, so a checkpoint saved by N processes loads into M (1 included).

Model and optimizer state go through torch's ``get_/set_model_state_dict`` and
``get_/set_optimizer_state_dict``: parameter names as keys (the single-process names under
FSDP/TP), optimizer state keyed by those names too, so single-file and sharded checkpoints hold the
same tensors and load into any strategy.

Loading never unpickles arbitrary objects: tensors are read with ``weights_only=True`` (DCP's own
reader) and the ``.metadata`` file, which DCP pickles, is read by an unpickler that only admits
DCP's metadata classes, dtypes and sizes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.placement_types import _StridedShard

from vitrain.checkpoint.manager import load_checkpoint
from vitrain.io import (
    CHECKPOINT_EXPECTED,
    CHECKPOINT_FIX,
    CheckpointError,
    check_readable_file,
    error_summary,
    fsync_dir,
)
from vitrain.parallel.distributed import active, barrier

COMPLETE_MARKER = "COMPLETE"
EXTRAS_FILE = "extras.pt"

_SHARDED = StateDictOptions()


def _nested_strided(value: DTensor) -> bool:
    """FSDP over a tensor-parallel strided shard (fsdp+tp's fused qkv): FSDP2 cuts each TP rank's rows
    in row blocks, whatever it names that cut (torch 2.14: ``_StridedShard``, 2.11: ``Shard``). DTensor's
    own ``full_tensor`` does not invert this layout, so vitrain gathers and cuts it itself."""
    if len(value.placements) != 2 or not isinstance(value.placements[1], _StridedShard):
        return False
    return isinstance(value.placements[0], (Shard, _StridedShard)) and value.placements[0].dim == 0


def full_tensor(value: Any) -> Any:
    """The whole tensor of a DTensor (a collective: every process calls it); anything else unchanged."""
    if not isinstance(value, DTensor):
        return value
    if _nested_strided(value):
        mesh, (_, tp_place) = value.device_mesh, value.placements
        tp_shape = (value.shape[0] // mesh.size(1), *value.shape[1:])  # this TP rank's rows, before FSDP's cut
        tp_local = _gather_rows(value.to_local(), mesh["dp"], tp_shape)
        return _gather_rows(tp_local, mesh["tp"], tuple(value.shape), tp_place.split_factor)
    if value.device_mesh.ndim == 1 and isinstance(value.placements[0], _StridedShard):
        return _gather_rows(value.to_local(), value.device_mesh, tuple(value.shape), value.placements[0].split_factor)
    return value.full_tensor()


def _gather_rows(local: torch.Tensor, mesh, shape: tuple[int, ...], parts: int = 1) -> torch.Tensor:
    """The whole of a row shard over a one-dimensional ``mesh``; with ``parts`` > 1 a strided one (each
    process holds its share of each of ``parts`` row blocks: tensor parallelism's fused qkv), gathered as
    plain row blocks and put back in order. DTensor's own ``full_tensor`` of a strided shard is not the
    same in every torch release (torch 2.11's cannot)."""
    rows = DTensor.from_local(
        local, mesh, [Shard(0)], shape=shape, stride=_contiguous_stride(shape), run_check=False
    ).full_tensor()
    if parts == 1:
        return rows
    return rows.reshape(mesh.size(), parts, -1, *shape[1:]).transpose(0, 1).reshape(shape)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def shard_like(full: torch.Tensor, reference: Any) -> Any:
    """This process's part of ``full`` laid out as ``reference`` (a DTensor; anything else: ``full``)."""
    if not isinstance(reference, DTensor):
        return full
    full = full.to(reference.device)
    mesh, placements = reference.device_mesh, reference.placements
    if not _nested_strided(reference):
        return distribute_tensor(full, mesh, placements, src_data_rank=None)
    tp_local = distribute_tensor(full, mesh["tp"], [placements[1]], src_data_rank=None).to_local()
    chunks = torch.chunk(tp_local, mesh.size(0), dim=0)  # FSDP2 cuts dim 0 with torch.chunk
    index = mesh.get_local_rank(0)
    local = chunks[index] if index < len(chunks) else tp_local.new_empty((0, *tp_local.shape[1:]))
    return DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride(), run_check=False)


def _map_tree(function, tree: Any, reference: Any = None) -> Any:
    if isinstance(tree, dict):
        return {
            key: _map_tree(function, value, None if reference is None else reference[key])
            for key, value in tree.items()
        }
    if isinstance(tree, list):
        return [_map_tree(function, value, None if reference is None else reference[i]) for i, value in enumerate(tree)]
    return function(tree) if reference is None else function(tree, reference)


def _full_on_cpu(value: Any) -> Any:
    value = full_tensor(value)
    return value.cpu() if isinstance(value, torch.Tensor) else value


def full_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state of tensors and DTensors with each whole, on the CPU (a collective under FSDP/TP)."""
    return _map_tree(_full_on_cpu, state)


def shard_state(state: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Whole tensors cut to this process's part of ``reference``'s (DTensors); plain ones as they are."""
    return _map_tree(shard_like, state, reference)


def model_state(model: nn.Module, full: bool) -> dict[str, Any]:
    """The model's state by parameter name: whole tensors on the CPU (a collective under FSDP/TP: every
    process calls it) or this process's shards (DTensors), for DCP."""
    state = get_model_state_dict(model, options=_SHARDED)
    return full_state(state) if full else state


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, full: bool) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, whole or sharded as in :func:`model_state`."""
    with implicit_replication():  # a fresh optimizer takes one zero step to create its state (mixed TP params)
        state = get_optimizer_state_dict(model, optimizer, options=_SHARDED)
    return _map_tree(_full_on_cpu, state) if full else state


def load_model_state(model: nn.Module, state: dict[str, Any], full: bool) -> None:
    """Load whole tensors (``full``: cut to this process's shards first) or shards laid out as the model's."""
    if full:
        state = _map_tree(shard_like, state, get_model_state_dict(model, options=_SHARDED))
    set_model_state_dict(model, state, options=_SHARDED)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], full: bool) -> None:
    if full:
        reference = optimizer_state(model, optimizer, full=False)
        state = {
            "state": _map_tree(shard_like, state["state"], reference["state"]),
            "param_groups": state["param_groups"],
        }
    with implicit_replication():
        set_optimizer_state_dict(model, optimizer, state, options=_SHARDED)


def is_sharded_checkpoint(path: Path) -> bool:
    return Path(path).is_dir()


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def _replicated(value: Any) -> Any:
    """DCP stores each process's part of a tensor as one block of rows; a strided shard (tensor
    parallelism's fused qkv: a share of each of q, k, v) is not one, so it is stored whole (replicated)."""
    if isinstance(value, DTensor) and any(isinstance(place, _StridedShard) for place in value.placements):
        whole = full_tensor(value)
        return DTensor.from_local(whole, value.device_mesh, [Replicate()] * value.device_mesh.ndim, run_check=False)
    return value


def _unreplicated(loaded: Any, reference: Any) -> Any:
    if loaded is reference or not isinstance(reference, DTensor):
        return loaded
    return shard_like(loaded.to_local(), reference) if isinstance(loaded, DTensor) else loaded


@contextlib.contextmanager
def _without_process_group_warning():
    """DCP warns on every call in a single process that it assumes one; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save_sharded(final: Path, tensors: dict[str, Any], extras: dict[str, Any], is_main: bool) -> Path:
    """Every rank calls this with its shards; rank 0 adds ``extras``, the marker and the rename."""
    tensors = _map_tree(_replicated, tensors)
    temporary = final.with_name(final.name + ".tmp")
    try:
        if is_main:
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir(parents=True)
        barrier()
        with _without_process_group_warning():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(temporary, sync_files=True), no_dist=not active())
        if is_main:
            with open(temporary / EXTRAS_FILE, "wb") as handle:
                torch.save(extras, handle)
                os.fsync(handle.fileno())
        barrier()  # every rank's shards are on disk before the marker says so
        if is_main:
            (temporary / COMPLETE_MARKER).write_text(f"{final.name}\n")
            fsync_dir(temporary)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(temporary, final)
            fsync_dir(final.parent)
    except OSError as error:
        raise CheckpointError(
            f"cannot write sharded checkpoint {final}: {error.strerror or error}; free disk space or choose a "
            "writable train.out_dir (the previous checkpoint is intact)"
        ) from None
    barrier()
    return final


class _RefusedObject(pickle.UnpicklingError):
    """The metadata names a class outside what a checkpoint's metadata holds."""


METADATA_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError, AttributeError)
"""What unpickling damaged bytes raises (a cut-off stream, an unknown opcode, a bad memo or argument)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch dtypes/sizes/layouts and paths; refuses anything else."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module == "torch.distributed.checkpoint.metadata"
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath"))
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise _RefusedObject(f"{module}.{name} is not part of a checkpoint's metadata")
        return super().find_class(module, name)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's reader with the metadata unpickling restricted (tensor data is already weights_only)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / ".metadata"
        check_readable_file(path, f"checkpoint {self.path}:", CHECKPOINT_FIX)
        try:
            with open(path, "rb") as handle:
                metadata = _MetadataUnpickler(handle).load()
        except _RefusedObject as error:
            raise CheckpointError(
                f"checkpoint {self.path}: {path.name} holds objects that need arbitrary unpickling, which vitrain "
                f"refuses: {error}; use a checkpoint written by vitrain"
            ) from None
        except OSError as error:
            raise CheckpointError(
                f"checkpoint {self.path}: {path.name} cannot be read: {error.strerror or error}; {CHECKPOINT_FIX}"
            ) from None
        except METADATA_ERRORS as error:
            raise CheckpointError(_damaged(Path(self.path), f"{path.name} is truncated or damaged", error)) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"checkpoint {self.path}: {path.name} holds a {type(metadata).__name__}, not DCP's metadata; "
                f"{CHECKPOINT_FIX}"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = self.storage_meta  # as DCP's own reader does
        return metadata


def _damaged(folder: Path, what: str, error: BaseException) -> str:
    return f"checkpoint {folder}: {what} ({error_summary(error)}); {CHECKPOINT_FIX}"


@contextlib.contextmanager
def _reading_shards(folder: Path, into_a_run: bool = False):
    """DCP's load of the folder's tensors: a shard file it cannot read (cut off, damaged, missing) or, loading
    ``into_a_run``'s state, tensors that do not map onto it (DCP's CheckpointException, which is no
    Exception) become a CheckpointError."""
    try:
        with _without_process_group_warning():
            yield
    except CheckpointException as error:
        failures = list(error.failures.values())
        cause = failures[0][0] if failures else error
        reading = any(frame.name == "read_data" for _, trace in failures for frame in trace or ())
        if into_a_run and not reading:  # planning: the saved tensors do not map onto this run's
            raise CheckpointError(
                f"checkpoint {folder}: its tensors cannot be loaded into this run ({error_summary(cause)}); resume "
                f"with the config the run started with; if that is the one, {CHECKPOINT_FIX}"
            ) from None
        raise CheckpointError(_damaged(folder, "its tensor files (*.distcp) cannot be read", cause)) from None


def _check_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist; pass a step-* file or folder, or --resume auto")
    if not is_complete(folder):
        raise CheckpointError(
            f"checkpoint {folder} has no {COMPLETE_MARKER} marker: it was cut off while being written; "
            "resume from an earlier one (--resume auto picks the newest complete checkpoint)"
        )


def load_sharded(folder: Path, reference: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's shards of the folder's tensors, laid out like ``reference`` (as from
    ``model_state``/``optimizer_state``; DCP reshards whatever process count wrote them), and the extras."""
    folder = Path(folder)
    _check_folder(folder)
    tensors = _map_tree(_replicated, reference)
    reader = SafeFileSystemReader(folder)
    reader.read_metadata()  # damage reported here, not first as DCP's warning with a traceback
    with _reading_shards(folder, into_a_run=True):
        dcp.load(tensors, storage_reader=reader, no_dist=not active())
    return _map_tree(_unreplicated, tensors, reference), load_checkpoint(folder / EXTRAS_FILE)


WEIGHTS_KEYS = {"live": "model", "ema": "ema"}
"""Which weights of a checkpoint (``--weights``) -> the key holding them."""


def _no_weights_message(path: Path, weights: str) -> str:
    return (
        f"checkpoint {path} holds no {weights} weights (its run had no weight EMA: train.ema.decay=0); "
        "use --weights live"
    )


def read_sharded_model(folder: Path, weights: str = "live") -> dict[str, torch.Tensor]:
    """The full model weights of a sharded checkpoint, in this process alone (no process group): for
    evaluation, fine-tuning and export. ``weights``: ``live`` (the model's) or ``ema`` (the weight EMA's)."""
    folder = Path(folder)
    _check_folder(folder)
    reader = SafeFileSystemReader(folder)
    metadata = reader.read_metadata()
    key = WEIGHTS_KEYS[weights]
    tensors = {
        name.removeprefix(f"{key}."): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for name, meta in metadata.state_dict_metadata.items()
        if name.startswith(f"{key}.") and hasattr(meta, "size")
    }
    if not tensors:
        raise CheckpointError(_no_weights_message(folder, weights))
    with _reading_shards(folder):
        dcp.load({key: tensors}, storage_reader=reader, no_dist=True)
    return tensors


def check_payload(payload: Any, path: Path) -> dict[str, Any]:
    """``payload``, a checkpoint's content: a dict whose tensors (``model``, ``ema``) are dicts, whose
    ``config`` (when there) is one; anything else (a torch file of a tensor, a list, ...) is a CheckpointError."""
    if not isinstance(payload, dict):
        raise CheckpointError(
            f"checkpoint {path} holds a {type(payload).__name__}, not a vitrain checkpoint (a dict of the model's "
            f"tensors, the config, ...); check the path: give {CHECKPOINT_EXPECTED}"
        )
    wrong = [
        key for key in ("model", "ema", "config", "state") if key in payload and not isinstance(payload[key], dict)
    ]
    if wrong:
        raise CheckpointError(
            f"checkpoint {path}: its {', '.join(wrong)} is a {type(payload[wrong[0]]).__name__}, not a dict: it is "
            f"not a vitrain checkpoint; check the path: give {CHECKPOINT_EXPECTED}"
        )
    return payload


def read_checkpoint_model(path: Path, weights: str = "live") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Full model weights (``weights``: ``live``, or ``ema``, the weight EMA's) and the rest (config, loop
    state; no optimizer, no other weights) of a checkpoint in either format, in this process alone."""
    path = Path(path)
    if is_sharded_checkpoint(path):
        tensors = read_sharded_model(path, weights)
        return tensors, check_payload(load_checkpoint(path / EXTRAS_FILE), path / EXTRAS_FILE)
    payload = load_checkpoint(path)
    check_payload(payload, path)
    if WEIGHTS_KEYS[weights] not in payload:
        raise CheckpointError(_no_weights_message(path, weights))
    info = {key: value for key, value in payload.items() if key not in ("model", "optimizer", "ema")}
    return payload[WEIGHTS_KEYS[weights]], info


__all__ = [
    "COMPLETE_MARKER",
    "SafeFileSystemReader",
    "WEIGHTS_KEYS",
    "full_state",
    "is_complete",
    "is_sharded_checkpoint",
    "load_model_state",
    "load_optimizer_state",
    "load_sharded",
    "model_state",
    "optimizer_state",
    "read_checkpoint_model",
    "read_sharded_model",
    "save_sharded",
    "shard_state",
]
