"""Real ``vitrain train`` processes killed from outside: SIGKILL at random moments and in the middle
of checkpoint writes, each time resumed with ``--resume auto``; SIGTERM from another process. The
final weights, optimizer state and counters equal an uninterrupted run's bitwise (CPU, fp32, one
process, one thread). Kill moments are drawn from a fixed seed; the figures are in docs/reliability.md."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import assert_same_training_state
from vitrain.checkpoint import find_latest_checkpoint, load_checkpoint
from vitrain.metrics import read_jsonl

WORKER = Path(__file__).with_name("fault_worker.py")
TIMEOUT_S = 300
SEED = 7
# 4 epochs of 10 steps with dropout and stochastic depth (RNG state), checkpoints every 3 steps (mostly
# mid-epoch) and every epoch, two kept
OVERRIDES = [
    "precision=fp32",
    "model.name=vit_tiny6_patch7",
    "model.drop_rate=0.1",
    "model.drop_path_rate=0.1",
    "data.name=synthetic",
    "data.image_size=14",
    "data.synthetic_num_train=160",
    "data.synthetic_num_eval=32",
    "data.scale=[0.5, 1.0]",
    "train.batch_size=16",
    "train.epochs=4",
    "train.progress=off",
    "train.log_every_steps=1",
    "optim.lr=0.2",
    "schedule.warmup_epochs=1",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=2",
]
KILLS = ["random", "mid-write", "random", "before-prune", "random", "mid-write", "random"]
"""The SIGKILL moments, in order: random (0-2 s after training starts), in the middle of a checkpoint
write (half the file written), and after a checkpoint is in place but before older ones are pruned."""


class Worker:
    """``vitrain train --resume auto`` in a subprocess (fault_worker.py) with one seam, logging to a file."""

    def __init__(self, run_dir: Path, seam: str):
        self.run_dir, self.markers = run_dir, run_dir.parent / f"{run_dir.name}-markers"
        self.markers.mkdir(parents=True, exist_ok=True)
        self.log = run_dir.parent / f"{run_dir.name}-{time.monotonic_ns()}.log"
        overrides = [*OVERRIDES, f"train.out_dir={run_dir}"]
        args = [str(self.markers), seam, "--", "train", "--resume", "auto"]
        args += [arg for override in overrides for arg in ("--set", override)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stderr=log, stdout=log)

    def wait_for(self, marker: str) -> None:
        path, deadline = self.markers / f"{marker}-{self.process.pid}", time.monotonic() + TIMEOUT_S
        while not path.exists():
            assert self.process.poll() is None, f"exited {self.process.returncode} before {marker}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {marker} marker within {TIMEOUT_S} s"
            time.sleep(0.005)

    def finish(self) -> int:
        return self.process.wait(timeout=TIMEOUT_S)

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run, started at once so it runs beside the first test's kills."""
    worker = Worker(tmp_path_factory.mktemp("reference") / "run", "none")
    yield worker
    worker.process.kill()


def _final_checkpoint(worker: Worker) -> Path:
    assert worker.finish() == 0, worker.tail()
    return find_latest_checkpoint(worker.run_dir)


def _kill(worker: Worker, kind: str, rng: random.Random) -> float:
    """SIGKILL at the moment ``kind`` names; returns the random delay (0 for the seams)."""
    delay = 0.0
    if kind == "random":
        worker.wait_for("training")
        delay = rng.uniform(0.0, 2.0)
        time.sleep(delay)
    else:
        worker.wait_for({"mid-write": "writing", "before-prune": "pruning"}[kind])
    worker.process.kill()
    worker.process.wait(timeout=TIMEOUT_S)
    return delay


def _trained_step(run_dir: Path) -> int:
    steps = [record["step"] for record in read_jsonl(run_dir / "metrics.jsonl") if record["event"] == "train"]
    return max(steps, default=0)


def test_sigkill_at_random_moments_and_mid_save_then_resume_equals_uninterrupted(reference_run, tmp_path):
    rng, run_dir = random.Random(SEED), tmp_path / "run"
    newest_step, figures = 0, []
    for kind in KILLS:
        worker = Worker(run_dir, "none" if kind == "random" else kind)
        delay = _kill(worker, kind, rng)
        newest = find_latest_checkpoint(run_dir)
        step = load_checkpoint(newest)["state"]["step"] if newest else 0  # never damaged: it loads
        assert step >= newest_step, (kind, step, newest_step)  # and never older than before the kill
        leftovers = [path.name for path in (run_dir / "checkpoints").glob("*.tmp-*")]
        if kind == "mid-write":  # the session's first save, half written: left behind and ignored
            assert leftovers and step == newest_step, (leftovers, step, newest_step)
        if kind == "before-prune":  # the session's first save is in place, though nothing was pruned yet
            assert step > newest_step, (step, newest_step)
        figures.append((kind, round(delay, 2), _trained_step(run_dir), step, len(leftovers)))
        newest_step = step
    final = _final_checkpoint(Worker(run_dir, "none"))
    print("\nkill, delay s, last step trained, newest complete checkpoint after the kill, .tmp files:")
    print("\n".join(str(row) for row in figures))
    assert sum(1 for row in figures if row[0] == "mid-write") == 2
    assert len({row[3] for row in figures}) >= 3, figures  # the kills landed at different points of the run
    assert_same_training_state(final, _final_checkpoint(reference_run))


def test_sigterm_from_another_process_checkpoints_exits_3_and_resumes_exactly(reference_run, tmp_path):
    run_dir = tmp_path / "run"
    worker = Worker(run_dir, "none")
    worker.wait_for("training")
    time.sleep(random.Random(SEED).uniform(0.2, 1.0))
    worker.process.send_signal(signal.SIGTERM)
    assert worker.finish() == 3, worker.tail()
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["preempted"] == "SIGTERM" and 0 < stopped < 40
    assert f"preempted by SIGTERM at step {stopped};" in worker.tail()
    assert load_checkpoint(find_latest_checkpoint(run_dir))["state"]["step"] == stopped
    final = _final_checkpoint(Worker(run_dir, "none"))
    assert_same_training_state(final, _final_checkpoint(reference_run))
