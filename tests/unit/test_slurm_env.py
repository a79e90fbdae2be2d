"""Plain ``srun`` without torchrun: the World and the rendezvous from Slurm's variables, Slurm's host-list
syntax, and the sbatch script of both launchers. No process group is formed here (see tests/dist)."""

from __future__ import annotations

import subprocess

import pytest
import torch.distributed as dist

from tests.conftest import FORWARDING_TORCHRUN
from vitrain.cli import main
from vitrain.config import World
from vitrain.parallel import distributed, slurm
from vitrain.parallel.slurm import (
    SlurmJob,
    expand_hostlist,
    first_host,
    sbatch_script,
    slurm_rendezvous,
    torchrun_options,
)


def _srun_task(procid: int, localid: int, *, ntasks: int = 8, nodelist: str = "gpu[03-04]", **extra) -> dict:
    """The variables srun sets for one task of a 2-node x 4-task step (as `srun env | grep SLURM` shows them)."""
    return {
        "SLURM_JOB_ID": "123456",
        "SLURM_JOBID": "123456",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks),
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(procid // 4),
        **extra,
    }


@pytest.mark.parametrize(("procid", "localid"), [(0, 0), (5, 1), (7, 3)])
def test_world_from_srun_task_variables(procid, localid):
    world = World.from_env(_srun_task(procid, localid))
    assert (world.rank, world.size, world.local_rank) == (procid, 8, localid)
    assert world.is_main == (procid == 0)


def test_world_size_falls_back_to_slurm_ntasks():
    env = {key: value for key, value in _srun_task(2, 2, ntasks=4).items() if key != "SLURM_STEP_NUM_TASKS"}
    assert World.from_env(env).size == 4


def test_torchrun_variables_take_precedence_over_slurm_s():
    """srun + torchrun: the task's Slurm variables say one task per node; torchrun's say which worker."""
    env = _srun_task(1, 0, ntasks=2, RANK="6", WORLD_SIZE="16", LOCAL_RANK="6")
    world = World.from_env(env)
    assert (world.rank, world.size, world.local_rank) == (6, 16, 6)


def test_a_batch_script_s_own_shell_is_one_process():
    """sbatch's shell has SLURM_PROCID=0 and the job's SLURM_NTASKS but is no job step: not 8 processes."""
    env = {key: value for key, value in _srun_task(0, 0).items() if not key.startswith(("SLURM_STEP",))}
    world = World.from_env(env)
    assert (world.rank, world.size, world.local_rank) == (0, 1, 0)
    assert World.from_env({}) == World()


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("gpu5", ["gpu5"]),
        ("a1,b2,c3", ["a1", "b2", "c3"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]-ib", ["n098-ib", "n099-ib", "n100-ib", "n101-ib"]),
        ("rack[1-2]-node[1,3]", ["rack1-node1", "rack1-node3", "rack2-node1", "rack2-node3"]),
        ("cn[5],x[1-2],y", ["cn5", "x1", "x2", "y"]),
    ],
)
def test_hostlist_expansion(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[3-1]", "node[a-b]", "node[1-2", "node1]"])
def test_bad_hostlist_is_refused_with_the_text(text):
    with pytest.raises(ValueError, match="Slurm host list"):
        expand_hostlist(text)


def test_rendezvous_from_the_step_s_first_node_and_the_job_id(monkeypatch):
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)  # no scontrol: the parser
    env = _srun_task(3, 3, nodelist="gpu[03-04]", SLURM_STEP_NODELIST="gpu[04],gpu03")
    assert slurm_rendezvous(env) == {"MASTER_ADDR": "gpu04", "MASTER_PORT": str(20000 + 123456 % 20000)}
    job_only = {key: value for key, value in env.items() if key != "SLURM_STEP_NODELIST"}
    assert slurm_rendezvous(job_only)["MASTER_ADDR"] == "gpu03"


def test_rendezvous_keeps_what_is_set_and_is_empty_outside_slurm(monkeypatch):
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    env = _srun_task(0, 0, MASTER_PORT="29500")
    assert slurm_rendezvous(env) == {"MASTER_ADDR": "gpu03"}
    assert slurm_rendezvous({**env, "MASTER_ADDR": "10.0.0.1"}) == {}
    assert slurm_rendezvous({"PATH": "/usr/bin"}) == {}


def test_first_host_asks_scontrol_where_it_is_installed(tmp_path, monkeypatch):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/bash\n[ "$1 $2 $3" = "show hostnames gpu[7-9]" ] && printf "gpu-a\\ngpu-b\\n"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert first_host("gpu[7-9]") == "gpu-a"  # the stand-in's answer, not the parser's gpu7
    scontrol.write_text("#!/bin/bash\nexit 1\n")
    assert first_host("gpu[7-9]") == "gpu7"  # a failing scontrol: the parser


def test_process_group_init_takes_the_slurm_rendezvous_first(monkeypatch):
    """srun alone: MASTER_ADDR/PORT are in the environment when init_process_group runs, and the rank
    and world size are passed (env:// would look for RANK / WORLD_SIZE, which srun does not set)."""
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(key, "set")  # so that undoing the test removes what init_distributed sets
        monkeypatch.delenv(key)
    for key, value in _srun_task(5, 1).items():
        monkeypatch.setenv(key, value)
    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs, addr=distributed.os.environ["MASTER_ADDR"], port=distributed.os.environ["MASTER_PORT"])

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    distributed.init_distributed(World.from_env(), cuda=False, timeout_s=10)
    assert (seen["addr"], seen["port"]) == ("gpu03", str(20000 + 123456 % 20000))
    assert (seen["rank"], seen["world_size"], seen["backend"]) == (5, 8, "gloo")


def _script(tmp_path, *launcher: str) -> str:
    path = tmp_path / "job.sbatch"
    args = ["slurm", "--nodes", "2", "--gpus-per-node", "4", "--cpus-per-gpu", "6", *launcher, "--out", str(path)]
    assert main([*args, "--", "--recipe", "nemo_vit_b16_224", "--set", "data.root=/data/my imagenet"]) == 0
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    return path.read_text().replace(" \\\n    ", " ")  # one line per command


TRAIN = "-m vitrain train --resume auto --recipe nemo_vit_b16_224 --set 'data.root=/data/my imagenet'"


def test_sbatch_script_with_srun_runs_one_worker_per_gpu(tmp_path):
    script = _script(tmp_path, "--launcher", "srun")
    for piece in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",  # one task per GPU
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=6",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@",
        f"srun --kill-on-bad-exit=1 python {TRAIN} &",
        'scontrol requeue "$SLURM_JOB_ID"',
    ]:
        assert piece in script, piece
    assert "torchrun" not in script and "--numa-binding" not in script


@FORWARDING_TORCHRUN
def test_sbatch_script_with_torchrun_is_the_default_and_unchanged(tmp_path):
    default, named = _script(tmp_path), _script(tmp_path, "--launcher", "torchrun")
    assert default == named
    for piece in [
        "#SBATCH --ntasks-per-node=1",  # one torchrun per node
        "#SBATCH --cpus-per-task=24",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        f"--numa-binding=node {TRAIN} &",
    ]:
        assert piece in default, piece
    assert "python -m vitrain" not in default


def test_unknown_launcher_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["slurm", "--nodes", "1", "--gpus-per-node", "1", "--launcher", "mpirun"])
    assert "--launcher" in capsys.readouterr().err


@FORWARDING_TORCHRUN
def test_every_torchrun_option_of_the_script_is_one_this_torchrun_accepts(tmp_path):
    """The script's torchrun line is run on the cluster as written: an option this torch does not know
    stops the whole job (torch 2.11's torchrun has no --shutdown-timeout)."""
    script = _script(tmp_path)
    (line,) = [line for line in script.splitlines() if line.startswith("srun ") and " torchrun " in line]
    torchrun_words = line.split("torchrun ", 1)[1].split(" -m vitrain train")[0].split()
    used = {word.split("=")[0] for word in torchrun_words}
    assert {"--rdzv-backend", "--signals-to-handle", "--nproc-per-node"} <= used
    assert used <= torchrun_options()


OLD_TORCHRUN = {"--nnodes", "--nproc-per-node", "--rdzv-id", "--rdzv-backend", "--rdzv-endpoint"}


@FORWARDING_TORCHRUN
def test_an_older_torchrun_gets_the_options_it_has_and_the_script_says_what_is_missing(tmp_path):
    job = SlurmJob(nodes=2, gpus_per_node=4)
    script = sbatch_script(job, ["--recipe", "fmnist"], options=OLD_TORCHRUN | {"--signals-to-handle"})
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1" in script
    assert "--shutdown-timeout" not in script.replace("has no --shutdown-timeout", "")
    assert "--numa-binding=node" not in script
    assert "# this torch's torchrun has no --shutdown-timeout: it kills the workers 30 s after" in script
    assert "# this torch's torchrun has no --numa-binding" in script
    full = sbatch_script(job, ["--recipe", "fmnist"], options=torchrun_options())
    assert ("has no --shutdown-timeout" in full) == ("--shutdown-timeout" not in torchrun_options())


def test_a_torchrun_that_cannot_forward_sigusr1_is_refused_and_srun_named(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(slurm, "torchrun_options", lambda: OLD_TORCHRUN)
    out = tmp_path / "job.sbatch"
    argv = ["slurm", "--nodes", "1", "--gpus-per-node", "2", "--out", str(out)]
    assert main([*argv, "--", "--recipe", "fmnist"]) == 2
    error = capsys.readouterr().err
    assert "cannot forward SIGUSR1" in error and "--launcher srun" in error
    assert not out.exists()
    assert main([*argv, "--launcher", "srun", "--", "--recipe", "fmnist"]) == 0  # srun needs no torchrun
    assert "torchrun" not in out.read_text()
