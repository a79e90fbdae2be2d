"""``vitrain slurm``: an sbatch script that runs ``vitrain train`` on N nodes x G GPUs; and the process
group's rendezvous of a job step ``srun`` started without torchrun.

Launcher torchrun (the default): one Slurm task per node runs torchrun, which starts G workers and
joins the other nodes through a c10d rendezvous on the job's first node (torchrun's own elastic agent,
no home-made launcher). Launcher srun: Slurm starts G tasks per node, each ``python -m vitrain train``
itself; each takes its rank from Slurm's variables (``World.from_env``) and meets the others at the
job's first node (:func:`slurm_rendezvous`).
Before the script is written, :func:`check_train_config` resolves the training config for the job's
processes, as ``vitrain train`` will, without the files that live on the cluster.
Slurm sends SIGUSR1 a few minutes before the time limit: the batch shell passes it on to the
workers (srun and torchrun forward it), which finish their step, write a checkpoint and exit with
code 3 (``vitrain.cli.EXIT_PREEMPTED``; torchrun itself then exits non-zero); once the job step has
ended, the shell requeues the job, which continues with ``--resume auto`` from the newest complete
checkpoint of the same run folder. (Requeueing earlier would have Slurm kill the workers while they
write the checkpoint.) SIGTERM, which Slurm sends on preemption or ``scancel``, also checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vitrain.config import Config, Plan

LAUNCHERS = ("torchrun", "srun")


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
    launcher: str = "torchrun"
    """torchrun: one task per node starts the node's workers; srun: one task per GPU, each a worker."""

    @property
    def tasks_per_node(self) -> int:
        return self.gpus_per_node if self.launcher == "srun" else 1


def torchrun_options() -> set[str]:
    """The options this environment's torchrun accepts (they grew with torch: ``--signals-to-handle`` and
    ``--numa-binding`` are not in torch 2.8's, ``--shutdown-timeout`` not in 2.11's)."""
    from torch.distributed.run import get_args_parser

    return set(get_args_parser()._option_string_actions)


def sbatch_script(job: SlurmJob, train_args: list[str], options: set[str] | None = None) -> str:
    """The batch script; ``train_args`` are passed to ``vitrain train`` (quoted). ``options``: what the
    cluster's torchrun accepts (default: this environment's, :func:`torchrun_options`)."""
    if job.nodes < 1 or job.gpus_per_node < 1:
        raise ValueError("--nodes and --gpus-per-node must be >= 1")
    if job.launcher not in LAUNCHERS:
        raise ValueError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {job.launcher!r}")
    notes: list[str] = []
    if job.launcher == "torchrun":
        command, notes = _torchrun_command(job, train_args, torchrun_options() if options is None else options)
    else:
        command = _worker_command(train_args)
    lines = [*_sbatch_header(job), *notes, *_environment(job), *_launch_with_requeue(command)]
    return "\n".join(lines)


def _sbatch_header(job: SlurmJob) -> list[str]:
    """The shebang and the ``#SBATCH`` directives: the tasks, the signal before the limit, requeue."""
    optional = [f"#SBATCH --partition={job.partition}"] if job.partition else []
    optional += [f"#SBATCH --account={job.account}"] if job.account else []
    return [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        f"#SBATCH --ntasks-per-node={job.tasks_per_node}",
        f"#SBATCH --gpus-per-node={job.gpus_per_node}",
        f"#SBATCH --cpus-per-task={job.cpus_per_gpu * job.gpus_per_node // job.tasks_per_node}",
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


def _torchrun_command(job: SlurmJob, train_args: list[str], options: set[str]) -> tuple[list[str], list[str]]:
    """torchrun's words (the c10d rendezvous, the forwarded signals, ``vitrain train --resume auto``) and the
    script's comments on what this torchrun cannot do. A torchrun that cannot forward SIGUSR1 is refused:
    the signal would kill it, and the job's time limit would end without a checkpoint."""
    if "--signals-to-handle" not in options:
        raise ValueError(
            "this torch's torchrun cannot forward SIGUSR1 to its workers (it has no --signals-to-handle, as in "
            "torch 2.8), so a job reaching its time limit would stop without a checkpoint: write the script with "
            "--launcher srun (each worker receives the signal itself), or upgrade torch"
        )
    optional, notes = [], []
    if "--shutdown-timeout" in options:
        optional.append(f"--shutdown-timeout={job.shutdown_grace_s}")
    else:
        notes.append(
            "# this torch's torchrun has no --shutdown-timeout: it kills the workers 30 s after forwarding a "
            "signal, which may cut a large checkpoint short (the previous complete one stays); --launcher srun "
            "waits for them"
        )
    if job.numa_binding and "--numa-binding" in options:
        optional.append("--numa-binding=node")
    elif job.numa_binding:
        notes.append("# this torch's torchrun has no --numa-binding: the workers are not bound to NUMA nodes")
    words = [
        "torchrun",
        "--nnodes=$SLURM_NNODES",
        f"--nproc-per-node={job.gpus_per_node}",
        "--rdzv-id=$SLURM_JOB_ID",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
        "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1",
        *optional,
        "-m vitrain train --resume auto",
        *(shlex.quote(arg) for arg in train_args),
    ]
    return words, notes


def _worker_command(train_args: list[str]) -> list[str]:
    """One worker per task (launcher srun): ``python -m vitrain train --resume auto``; every task sees all
    of its node's GPUs and takes the one of its SLURM_LOCALID."""
    return ["python -m vitrain train --resume auto", *(shlex.quote(arg) for arg in train_args)]


def _launch_with_requeue(command: list[str]) -> list[str]:
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
        "    " + " \\\n    ".join(command) + " &",
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


# --- the training arguments, checked on this machine ----------------------------------------------

CLUSTER_PATHS = (
    "data.root",
    "token_labels.maps",
    "train.init_from",
    "train.init_weights",
    "train.distill.teacher",
    "train.distill.teacher_weights",
)
"""Config keys naming files on the cluster: not looked for on the machine writing the script."""


def _stand_in_kind(key: str, value: object) -> str | None:
    """``file`` or ``folder``: what stands in for the cluster path ``key=value``; None where ``value`` is no
    path (timm:NAME, a teacher's timm name: no separator, no weights suffix) or resolve reads no file
    (data.root: only its form, which stays)."""
    from vitrain.config.weights import TIMM_PREFIX, WEIGHTS_SUFFIXES

    text = str(value)
    if key == "data.root" or text.startswith(TIMM_PREFIX):
        return None
    if key == "token_labels.maps":
        return "folder"
    if key == "train.distill.teacher":
        if Path(text).suffix in WEIGHTS_SUFFIXES:
            return "file"
        return "folder" if "/" in text else None
    return "file"


@contextlib.contextmanager
def _cluster_paths_stood_in(config: Config) -> Iterator[tuple[Config, dict[str, str]]]:
    """A copy of ``config`` whose cluster paths (:data:`CLUSTER_PATHS`) name stand-ins in a temporary
    folder, each a file or folder of the same name (so its suffix, and with it its kind, is kept), and the
    stand-ins' text -> the values given."""
    config = config.model_copy(deep=True)
    given: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="vitrain-slurm-") as folder:
        for index, key in enumerate(CLUSTER_PATHS):
            *sections, name = key.split(".")
            holder = functools.reduce(getattr, sections, config)
            value = getattr(holder, name)
            kind = None if value is None else _stand_in_kind(key, value)
            if kind is None:
                continue
            stand_in = Path(folder, str(index), Path(str(value)).name or "stand-in")
            stand_in.parent.mkdir()
            if kind == "folder":
                stand_in.mkdir()
            else:
                stand_in.touch()
            setattr(holder, name, str(stand_in))
            given[str(stand_in)] = str(value)
        yield config, given


def check_train_config(config: Config, processes: int) -> Plan:
    """``resolve()`` of ``config`` as a job of ``processes`` CUDA processes (bf16-capable GPUs) will run
    it, raising its ConfigError: the model and its options, batches that split over the processes, the run's
    length, curriculum, parallel strategy with precision, distillation and token-labeling keys. The data is
    taken to have the shape of :func:`vitrain.data.sources.nominal_source_info` (ImageNet-1k's for image
    folders and shards), and the files of :data:`CLUSTER_PATHS` to
    exist (their form is still checked: a timm teacher needs train.distill.teacher_weights, init weights need a
    weights suffix). The plan is for checking only (the precision unmeasured)."""
    from vitrain.config import ConfigError, Hardware, World, resolve
    from vitrain.data.sources import nominal_source_info
    from vitrain.models import model_facts

    hardware = Hardware(cuda_available=True, bf16_supported=True)
    with _cluster_paths_stood_in(config) as (stood_in, given):
        try:
            return resolve(
                stood_in, nominal_source_info(config.data), hardware, model_facts, world=World(size=processes)
            )
        except ConfigError as error:
            message = str(error)
            for stand_in, value in given.items():
                message = message.replace(stand_in, value)
            raise ConfigError(message) from None


# --- srun without torchrun: the rendezvous ---------------------------------------------------------

_HOST_WITH_RANGE = re.compile(r"^(?P<prefix>[^\[]*)\[(?P<ranges>[^\]]*)\](?P<rest>.*)$")


def _split_top_level(text: str) -> list[str]:
    """``a[1,2],b`` -> ``["a[1,2]", "b"]``: commas outside brackets separate hosts."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part for part in parts if part]


def _expand_ranges(ranges: str, text: str) -> list[str]:
    """``01-03,07`` -> ``["01", "02", "03", "07"]``: zero padding kept as the range's start writes it."""
    values = []
    for item in ranges.split(","):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
            raise ValueError(f"cannot read the Slurm host list {text!r}: bad range {item!r}")
        values += [f"{number:0{len(low)}d}" for number in range(int(low), int(high or low) + 1)]
    return values


def expand_hostlist(text: str) -> list[str]:
    """The hosts of Slurm's compressed host-list syntax, in order: ``node[01-03,07],gpu5`` -> node01,
    node02, node03, node07, gpu5 (several bracket groups in one name multiply: ``r[1-2]n[1-2]``)."""
    hosts = []
    for part in _split_top_level(text.strip()):
        match = _HOST_WITH_RANGE.match(part)
        if match is None:
            if "[" in part or "]" in part:
                raise ValueError(f"cannot read the Slurm host list {text!r}: unbalanced bracket in {part!r}")
            hosts.append(part)
            continue
        for value in _expand_ranges(match["ranges"], text):
            hosts += [match["prefix"] + value + rest for rest in expand_hostlist(match["rest"]) or [""]]
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``scontrol show hostnames`` where it is installed (it knows
    every form Slurm writes), else :func:`expand_hostlist`."""
    if shutil.which("scontrol"):
        try:
            result = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
            )
            if result.stdout.split():
                return result.stdout.split()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    hosts = expand_hostlist(nodelist)
    if not hosts:
        raise ValueError(f"the Slurm node list {nodelist!r} names no host")
    return hosts[0]


def slurm_rendezvous(env: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR and MASTER_PORT (read by torch's ``env://`` init) for a job step srun started without
    torchrun, each only where ``env`` lacks it: the step's (or job's) first node, and port
    20000 + SLURM_JOB_ID % 20000 (so two jobs sharing a node use different ports). Empty outside Slurm."""
    found = {}
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if "MASTER_ADDR" not in env and nodelist:
        found["MASTER_ADDR"] = first_host(nodelist)
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if "MASTER_PORT" not in env and job_id and job_id.isdigit():
        found["MASTER_PORT"] = str(20000 + int(job_id) % 20000)
    return found
