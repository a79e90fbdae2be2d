"""``vitrain slurm``: an sbatch script that runs ``vitrain train`` on N nodes x G GPUs.

One Slurm task per node runs torchrun, which starts G workers and joins the other nodes through a
c10d rendezvous on the job's first node (torchrun's own elastic agent, no home-made launcher).
Slurm sends SIGUSR1 a few minutes before the time limit: the batch shell passes it on to the
workers (srun and torchrun forward it), which finish their step, write a checkpoint and exit with
code 3 (``vitrain.cli.EXIT_PREEMPTED``; torchrun itself then exits non-zero); once the job step has
ended, the shell requeues the job, which continues with ``--resume auto`` from the newest complete
checkpoint of the same run folder. (Requeueing earlier would have Slurm kill the workers while they
write the checkpoint.) SIGTERM, which Slurm sends on preemption or ``scancel``, also checkpoints.
"""

from __future__ import annotations

import dataclasses
import shlex


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    nodes: int
    gpus_per_node: int
    time: str = "24:00:00"
    job_name: str = "vitrain"
    partition: str | None = None
    account: str | None = None
    cpus_per_gpu: int = 8
    signal_before_s: int = 180
    """Seconds before the time limit at which Slurm sends SIGUSR1 (checkpoint, then requeue)."""
    shutdown_grace_s: int = 150
    """How long torchrun waits for its workers after forwarding a signal before it kills them (its default,
    30 s, may cut a large checkpoint short); keep it below signal_before_s."""
    numa_binding: bool = True
    """torchrun --numa-binding=node: each worker on the CPUs of its GPU's NUMA node."""
    port: int = 29500
    logs: str = "logs"


def sbatch_script(job: SlurmJob, train_args: list[str]) -> str:
    """The batch script; ``train_args`` are passed to ``vitrain train`` (quoted)."""
    if job.nodes < 1 or job.gpus_per_node < 1:
        raise ValueError("--nodes and --gpus-per-node must be >= 1")
    lines = [*_sbatch_header(job), *_environment(job), *_launch_with_requeue(_torchrun_command(job, train_args))]
    return "\n".join(lines)


def _sbatch_header(job: SlurmJob) -> list[str]:
    """The shebang and the ``#SBATCH`` directives: one task per node, the signal before the limit, requeue."""
    optional = [f"#SBATCH --partition={job.partition}"] if job.partition else []
    optional += [f"#SBATCH --account={job.account}"] if job.account else []
    return [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={job.gpus_per_node}",
        f"#SBATCH --cpus-per-task={job.cpus_per_gpu * job.gpus_per_node}",
        f"#SBATCH --time={job.time}",
        f"#SBATCH --signal=B:USR1@{job.signal_before_s}",
        "#SBATCH --requeue",
        f"#SBATCH --output={job.logs}/%x-%j.out",
        *optional,
        "# written by `vitrain slurm`; submit with sbatch",
        "set -euo pipefail",
        f"mkdir -p {shlex.quote(job.logs)}",
        "",
    ]


def _environment(job: SlurmJob) -> list[str]:
    """The rendezvous address (the job's first node) and the CPU threads per worker."""
    return [
        "# the rendezvous runs on the job's first node",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT={job.port}",
        "export MASTER_ADDR MASTER_PORT",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-" + str(job.cpus_per_gpu) + "}",
        "",
    ]


def _torchrun_command(job: SlurmJob, train_args: list[str]) -> list[str]:
    """torchrun's words: the c10d rendezvous, the forwarded signals and ``vitrain train --resume auto``."""
    return [
        "torchrun",
        "--nnodes=$SLURM_NNODES",
        f"--nproc-per-node={job.gpus_per_node}",
        "--rdzv-id=$SLURM_JOB_ID",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
        "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1",
        f"--shutdown-timeout={job.shutdown_grace_s}",
        *(["--numa-binding=node"] if job.numa_binding else []),
        "-m vitrain train --resume auto",
        *(shlex.quote(arg) for arg in train_args),
    ]


def _launch_with_requeue(torchrun: list[str]) -> list[str]:
    """srun in the background so the shell's USR1 trap runs; the requeue only after the step has ended."""
    return [
        "# time limit: the workers finish their step, checkpoint and exit (code 3); then the job is requeued",
        "preempted=0",
        "forward_usr1() {",
        '    echo "vitrain: SIGUSR1, checkpointing before requeueing job $SLURM_JOB_ID"',
        "    preempted=1",
        '    kill -USR1 "${step:-}" 2>/dev/null || true',
        "}",
        "trap forward_usr1 USR1",
        "",
        "srun --kill-on-bad-exit=1 \\",
        "    " + " \\\n    ".join(torchrun) + " &",
        "step=$!",
        "status=0",
        'wait "$step" || status=$?',
        'if [ "$preempted" = 1 ]; then',
        '    status=0; wait "$step" || status=$?  # the trap cut the first wait short: wait for the checkpoint',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
        "",
    ]
