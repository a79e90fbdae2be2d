"""A training run's checkpoints: what each one holds, and saving, finding and resuming them.

A checkpoint holds the model and optimizer tensors (and the weight EMA's, ``ema``, when the run keeps
one), the loss scaler, the loop state (step, images, epoch position, clocks, best accuracy, skip
counts), every process's RNG streams, the loaders' bad-image logs, the config, the plan's key figures
and what inference needs as recorded, and the format string :data:`CHECKPOINT_FORMAT`. A single file
(:class:`~vitrain.checkpoint.manager.CheckpointManager`) holds full tensors; a sharded folder
(:mod:`vitrain.checkpoint.sharded`) each process's shards. Either resumes at any process count: the
loop asks :class:`RunCheckpoints` to save and to resume.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from vitrain.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    find_last_checkpoint,
    find_latest_checkpoint,
    find_named_best_checkpoint,
    load_checkpoint,
)
from vitrain.checkpoint.rng import capture_rng_state, restore_rank_rng_state
from vitrain.checkpoint.sharded import (
    EXTRAS_FILE,
    check_payload,
    full_state,
    is_sharded_checkpoint,
    load_model_state,
    load_optimizer_state,
    load_sharded,
    model_state,
    optimizer_state,
    save_sharded,
    shard_state,
)
from vitrain.config import ConfigError, World
from vitrain.parallel.distributed import barrier, gather_objects
from vitrain.seeds import derive_seed

log = logging.getLogger("vitrain")

CHECKPOINT_FORMAT = "vitrain-checkpoint-v1"
RESUME_NAMES = ("auto", "last", "best")
"""``--resume`` values that name a checkpoint of the run folder rather than give its path."""


class LoopState(Protocol):
    """The loop's counters (``vitrain.train.state.TrainState``), as a checkpoint sees them."""

    step: int

    def state_dict(self) -> dict[str, Any]: ...


class WeightAverage(Protocol):
    """The weight EMA (``vitrain.train.ema.ModelEma``), as a checkpoint sees it."""

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


class BadImages(Protocol):
    """A loader's bad-image log (``vitrain.data.loader.BadImageLog``)."""

    def state_dict(self) -> dict[str, list[str]]: ...

    def load_state_dict(self, state: dict[str, list[str]]) -> None: ...


@dataclasses.dataclass
class RunCheckpoints:
    """Saves and resumes everything of a run that changes while it trains (docs/architecture.md,
    "A training step")."""

    manager: CheckpointManager
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    bad_images: dict[str, BadImages]
    """The loaders' bad-image logs by split: ``train`` and ``eval``."""
    record: dict[str, Any]
    """Saved as it is: the config (``config``), the plan's key figures (``plan``) and what inference needs
    (``inference``: model plan, normalization, crop, class names; ``vitrain.weights.inference``)."""
    world: World
    seed: int
    sharded: bool
    """Each process writes its shards (a sharded folder), rather than one process full tensors (a file)."""
    gathers: bool
    """The parameters are sharded (FSDP/TP): gathering full tensors is a collective of every process."""
    weights_loaded: Callable[[], None]
    """Called after loading weights into ``model`` (the training step's O2 copy follows them)."""
    ema: WeightAverage | None = None
    """The weight EMA, saved under ``ema`` beside the model (None: the run keeps none)."""

    def payload(self, state: LoopState, full: bool = True) -> dict[str, Any]:
        """Everything a resume needs. ``full``: whole tensors (gathered on rank 0 under FSDP/TP, so every
        rank must call this); otherwise this rank's shards, for a sharded checkpoint."""
        tensors = {
            "model": model_state(self.model, full),
            "optimizer": optimizer_state(self.model, self.optimizer, full),
        }
        if self.ema is not None:
            tensors["ema"] = full_state(self.ema.state_dict()) if full else self.ema.state_dict()
        return {**tensors, **self.extras(state)}

    def extras(self, state: LoopState) -> dict[str, Any]:
        """The part of a checkpoint that is not model, optimizer or EMA tensors (rank 0's)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "scaler": self.scaler.state_dict(),
            "state": state.state_dict(),
            "rng": capture_rng_state(),
            "config": self.record["config"],
            "bad_images": {split: images.state_dict() for split, images in self.bad_images.items()},
            "plan": self.record["plan"],
            "inference": self.record.get("inference"),
            "has_ema": self.ema is not None,
        }

    def save(self, state: LoopState, top1: float | None = None) -> None:
        """Every process calls this: a sharded folder (every rank its shards) or a single file (rank 0,
        full tensors gathered first under FSDP/TP). ``top1``: the eval accuracy of these weights."""
        rng_by_rank = gather_objects(capture_rng_state())  # each rank draws its own dropout
        if self.sharded:
            extras = self.extras(state)
            if len(rng_by_rank) > 1:
                extras["rng_by_rank"] = rng_by_rank
            final = self.manager.path_for(state.step).with_suffix("")
            path = save_sharded(final, self.payload(state, full=False), extras, self.world.is_main)
            if self.world.is_main:
                if top1 is not None:
                    self.manager.record_if_best(path.name, state.step, top1)
                self.manager.prune()
                log.info("saved %s", path)
        else:
            payload = self.payload(state) if self.gathers or self.world.is_main else None
            if self.world.is_main:  # DDP: every rank holds the same state; one writes it
                if len(rng_by_rank) > 1:
                    payload["rng_by_rank"] = rng_by_rank
                path = self.manager.save(payload, state.step, top1=top1)
                log.info("saved %s", path)
        barrier()  # no rank runs ahead of a checkpoint it might need to resume from

    def resume(self, path: Path, payload: dict[str, Any]) -> dict[str, Any]:
        """Load the checkpoint at ``path`` (``payload``: its content from :func:`load_resume_payload`);
        returns the loop state it holds. A checkpoint that does not fit this run is a CheckpointError."""
        if self.ema is not None and not payload.get("has_ema", False):
            raise CheckpointError(
                f"checkpoint {path} holds no weight EMA but this run keeps one (train.ema.decay); resume with "
                "the config the run started with (train.ema.decay=0), or start a new run from its weights "
                "with vitrain finetune --from"
            )
        if self.ema is None and payload.get("has_ema", False):
            log.warning("%s holds a weight EMA, which this run (train.ema.decay=0) does not keep", path)
        try:
            # sharded: every rank reads its shards (DCP reshards to this process count)
            state = self._load_sharded(path) if is_sharded_checkpoint(path) else self._load_payload(payload)
        except CheckpointError:
            raise  # a file that cannot be read says so itself
        except (KeyError, RuntimeError, ValueError) as error:
            raise CheckpointError(
                f"checkpoint {path} does not fit this run ({str(error).splitlines()[0][:200]}); "
                "resume with the config the run started with"
            ) from None
        log.info("resumed from %s at step %d", path, state["step"])
        return state

    def _load_sharded(self, path: Path) -> dict[str, Any]:
        reference = {
            "model": model_state(self.model, False),
            "optimizer": optimizer_state(self.model, self.optimizer, False),
        }
        if self.ema is not None:
            reference["ema"] = self.ema.state_dict()  # DCP loads into the EMA's own shards
        tensors, extras = load_sharded(path, reference)
        return self._load_payload({**tensors, **extras}, full=False)

    def _load_payload(self, payload: dict[str, Any], full: bool = True) -> dict[str, Any]:
        load_model_state(self.model, payload["model"], full)
        load_optimizer_state(self.model, self.optimizer, payload["optimizer"], full)
        self.scaler.load_state_dict(payload["scaler"])
        self.weights_loaded()
        if self.ema is not None:
            ema = payload["ema"]
            self.ema.load_state_dict(shard_state(ema, self.ema.state_dict()) if full else ema)
        state = payload["state"]
        world = self.world
        restore_rank_rng_state(payload, world.rank, world.size, derive_seed(self.seed, world.data_rank, state["step"]))
        bad_images = payload.get("bad_images", {})  # absent from checkpoints of older versions
        for split, images in self.bad_images.items():
            images.load_state_dict(bad_images.get(split, {}))
        return state


def find_resume_checkpoint(resume: str | None, out_dir: Path, sibling_runs: str | None) -> Path | None:
    """``auto``: the newest complete checkpoint of the run folder ``out_dir`` (or, with ``sibling_runs``,
    a glob of this recipe's run folders, of the newest among them), None when there is none; ``last``:
    the same, a CheckpointError when there is none; ``best``: the checkpoint with the best eval top-1 of
    that run folder; otherwise a path."""
    if resume is None:
        return None
    if resume not in RESUME_NAMES:
        if Path(resume).is_dir():
            raise CheckpointError(
                f"--resume {resume} is a folder, not a checkpoint file; give a step-*.pt file, or for a run folder "
                f"(sharded step-* folders included) set train.out_dir={resume} and use --resume auto|last|best"
            )
        if not Path(resume).is_file():
            raise CheckpointError(
                f"--resume {resume}: no such checkpoint file; give a step-*.pt file or --resume auto|last|best"
            )
        return Path(resume)
    latest = _newest_checkpoint(out_dir, sibling_runs)
    if resume == "auto":
        return latest
    run_dir = latest.parent.parent if latest is not None else Path(out_dir)
    if resume == "last":
        return find_last_checkpoint(run_dir)
    best = find_named_best_checkpoint(run_dir)
    if latest is not None and best != latest:
        log.warning(
            "--resume best: continuing from %s, not the newer %s (newer checkpoints are replaced as the run reaches "
            "their steps)",
            best.name,
            latest.name,
        )
    return best


def _newest_checkpoint(out_dir: Path, sibling_runs: str | None) -> Path | None:
    if sibling_runs is None:
        return find_latest_checkpoint(out_dir)
    pattern = Path(sibling_runs)
    candidates = [find_latest_checkpoint(folder) for folder in pattern.parent.glob(pattern.name)]
    candidates = [path for path in candidates if path is not None]
    return max(candidates, key=lambda path: path.stat().st_mtime, default=None)


def load_resume_payload(path: Path, model_name: str) -> dict[str, Any]:
    """The checkpoint to resume from, refused (CheckpointError/ConfigError) when it is missing,
    unreadable, needs arbitrary unpickling, or holds another model than ``model_name``."""
    file = path / EXTRAS_FILE if is_sharded_checkpoint(path) else path
    payload = check_payload(load_checkpoint(file), file)
    saved = payload.get("config", {}).get("model", {})
    saved_model = saved.get("name") if isinstance(saved, dict) else None
    if saved_model != model_name:
        raise ConfigError(
            f"--resume {path}: the checkpoint holds a {saved_model} but model.name={model_name}; "
            "resume with the config the run started with, or start from its weights with vitrain finetune --from"
        )
    return payload
