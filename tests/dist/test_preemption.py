"""Preemption with several processes and under the Slurm batch script, on the CPU (gloo).

A signal that reaches one rank stops every rank at the same step with one checkpoint, and the
resumed 2-process run ends where an uninterrupted 2-process run ends (dropout included: each rank's
RNG streams are saved). The sbatch script, run with stand-ins for srun and scontrol, passes SIGUSR1
on to the worker and requeues the job only after the checkpoint is written.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.conftest import FORWARDING_TORCHRUN
from tests.dist.test_ddp import _env, _set_args, torchrun_command
from vitrain.checkpoint import find_latest_checkpoint, load_checkpoint
from vitrain.metrics import read_jsonl
from vitrain.parallel.slurm import SlurmJob, sbatch_script

TIMEOUT_S = 300


def _overrides(out_dir, *extra):
    return [
        "precision=fp32",
        "model.name=vit_tiny6_patch7",
        "model.drop_rate=0.1",
        "model.drop_path_rate=0.1",
        "data.name=synthetic",
        "data.image_size=14",
        "data.synthetic_num_train=96",
        "data.synthetic_num_eval=32",
        "data.scale=[0.5, 1.0]",
        "train.batch_size=16",
        "train.epochs=3",
        "train.progress=off",
        "train.log_every_steps=1",
        "checkpoint.keep_last=5",
        "optim.lr=0.2",
        "schedule.warmup_epochs=1",
        f"train.out_dir={out_dir}",
        *extra,
    ]


def _torchrun(args, log: Path) -> subprocess.Popen:
    """vitrain in 2 processes under torchrun, started and left running (its output in ``log``)."""
    with open(log, "w") as handle:
        return subprocess.Popen(torchrun_command(args), env=_env(), stdout=handle, stderr=handle)


def _wait_for_training(run_dir: Path, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not any(record["event"] == "train" for record in _records(run_dir)):
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


def _rank_pid(parent: int, rank: int) -> int:
    """The pid of torchrun's worker with this RANK (from /proc)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    for child in children:
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under {parent}: {children}")


def test_a_signal_to_one_rank_stops_both_at_one_step_and_the_resumed_run_matches(tmp_path):
    straight_dir, run_dir = tmp_path / "straight", tmp_path / "run"
    straight = _torchrun(["train", *_set_args(_overrides(straight_dir))], tmp_path / "straight.log")
    interrupted = _torchrun(["train", *_set_args(_overrides(run_dir))], tmp_path / "run.log")
    _wait_for_training(run_dir, interrupted, tmp_path / "run.log")
    os.kill(_rank_pid(interrupted.pid, 1), signal.SIGUSR1)  # rank 1 only: rank 0 learns it from rank 1
    assert interrupted.wait(timeout=TIMEOUT_S) != 0  # torchrun reports its workers' exit code 3 as a failure
    output = (tmp_path / "run.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["steps"]
    assert f"preempted by SIGUSR1 at step {stopped};" in output  # rank 1
    assert f"preempted by a signal to another process at step {stopped};" in output  # rank 0, the same step
    checkpoint = load_checkpoint(find_latest_checkpoint(run_dir))
    assert checkpoint["state"]["step"] == stopped < 18 and len(checkpoint["rng_by_rank"]) == 2

    resumed = _torchrun(["train", "--resume", "auto", *_set_args(_overrides(run_dir))], tmp_path / "resumed.log")
    assert resumed.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    assert straight.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    ours = load_checkpoint(find_latest_checkpoint(run_dir))["model"]
    reference = load_checkpoint(find_latest_checkpoint(straight_dir))["model"]
    for key, tensor in reference.items():
        assert torch.allclose(ours[key], tensor, rtol=1e-5, atol=1e-7), (key, (ours[key] - tensor).abs().max())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _slurm_stand_ins(folder: Path) -> Path:
    """``srun`` that runs its command as the one task (so the batch shell's signal reaches torchrun, as
    srun forwards it), and ``scontrol`` that names this host and logs requeue requests."""
    folder.mkdir()
    (folder / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (folder / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1" = show ]; then echo 127.0.0.1; else echo "$*" >> "$SCONTROL_LOG"; fi\n'
    )
    for name in ("srun", "scontrol"):
        (folder / name).chmod(0o755)
    return folder


@FORWARDING_TORCHRUN
def test_the_sbatch_script_checkpoints_on_usr1_and_requeues_after(tmp_path):
    run_dir, requeues = tmp_path / "run", tmp_path / "scontrol.log"
    job = SlurmJob(nodes=1, gpus_per_node=1, numa_binding=False, port=_free_port(), logs=str(tmp_path / "logs"))
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(job, _set_args(_overrides(run_dir))))
    path = f"{_slurm_stand_ins(tmp_path / 'bin')}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    slurm = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1", "SCONTROL_LOG": str(requeues)}
    env = _env(PATH=path, **slurm)

    with open(tmp_path / "job.log", "w") as log:
        batch = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, stdout=log, stderr=log)
    _wait_for_training(run_dir, batch, tmp_path / "job.log")
    batch.send_signal(signal.SIGUSR1)  # what #SBATCH --signal=B:USR1@180 does
    assert batch.wait(timeout=TIMEOUT_S) != 0
    output = (tmp_path / "job.log").read_text()
    assert "vitrain: SIGUSR1, checkpointing before requeueing job 42" in output
    assert requeues.read_text() == "requeue 42\n"
    checkpoint = find_latest_checkpoint(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["preempted"] == "SIGUSR1" and load_checkpoint(checkpoint)["state"]["step"] == summary["steps"]
    assert checkpoint.stat().st_mtime <= requeues.stat().st_mtime  # requeued after the checkpoint

    requeues.unlink()
    with open(tmp_path / "requeued.log", "w") as log:  # the requeued job: the same script again
        requeued = subprocess.run(["bash", script], env=env, cwd=tmp_path, stdout=log, stderr=log, timeout=TIMEOUT_S)
    assert requeued.returncode == 0, (tmp_path / "requeued.log").read_text()[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 18 and not requeues.exists()
