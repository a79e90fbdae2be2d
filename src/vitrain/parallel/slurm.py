"""``vitrain slurm``: an sbatch script that runs ``vitrain train`` on N nodes x G GPUs.

One Slurm task per node runs torchrun, which starts G workers and joins the other nodes through a
c10d rendezvous on the job's first node (torchrun's own elastic agent, no home-made launcher).
Slurm sends SIGUSR1 a few minutes before the time limit (or on preemption with a grace time): the
batch shell passes it on to the workers (torchrun forwards it), requeues the job, and the requeued
job continues with ``--resume auto`` from the newest complete checkpoint of the same run folder.
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
    numa_binding: bool = True
    """torchrun --numa-binding=node: each worker on the CPUs of its GPU's NUMA node."""
    port: int = 29500
    logs: str = "logs"


def sbatch_script(job: SlurmJob, train_args: list[str]) -> str:
    """The batch script; ``train_args`` are passed to ``vitrain train`` (quoted)."""
    if job.nodes < 1 or job.gpus_per_node < 1:
        raise ValueError("--nodes and --gpus-per-node must be >= 1")
    optional = [f"#SBATCH --partition={job.partition}"] if job.partition else []
    optional += [f"#SBATCH --account={job.account}"] if job.account else []
    torchrun = [
        "torchrun",
        "--nnodes=$SLURM_NNODES",
        f"--nproc-per-node={job.gpus_per_node}",
        "--rdzv-id=$SLURM_JOB_ID",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
        "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1",
        *(["--numa-binding=node"] if job.numa_binding else []),
        "-m vitrain train --resume auto",
        *(shlex.quote(arg) for arg in train_args),
    ]
    lines = [
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
        "# the rendezvous runs on the job's first node",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT={job.port}",
        "export MASTER_ADDR MASTER_PORT",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-" + str(job.cpus_per_gpu) + "}",
        "",
        "# time limit or preemption: the workers checkpoint (SIGUSR1), the job goes back in the queue",
        "requeue() {",
        '    echo "vitrain: SIGUSR1, requeueing job $SLURM_JOB_ID"',
        '    kill -USR1 "$step" 2>/dev/null || true',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "}",
        "trap requeue USR1",
        "",
        "srun --kill-on-bad-exit=1 \\",
        "    " + " \\\n    ".join(torchrun) + " &",
        "step=$!",
        'wait "$step" || wait "$step"  # the second wait outlasts the trap handler',
        "",
    ]
    return "\n".join(lines)
