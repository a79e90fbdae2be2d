"""Multi-node start-up and recovery on one machine. Two torchrun agents of one process each (``--nnodes=2``)
meet at a c10d rendezvous on localhost and train as one job, with DDP and with FSDP, as the standalone
two-process run does; the script ``vitrain slurm --nodes 2`` writes runs its ``srun`` part with Slurm's
variables set by hand; a rank killed with SIGKILL mid-run comes back through torchrun's restart and the run
ends with the weights of an uninterrupted one."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.dist.test_ddp import TIMEOUT_S, _assert_close, _env, _overrides, _set_args, _weights, torchrun
from vitrain.checkpoint.sharded import read_checkpoint_model
from vitrain.metrics import read_jsonl

SHORT = ("train.epochs=1", "checkpoint.every_steps=2")
"""6 steps, a checkpoint every 2 (mid-epoch ones too): the restart has a recent one to resume from."""
FINAL = "checkpoints/step-000000006"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _agent(args: list[str], port: int, job_id: str) -> list[str]:
    """One torchrun agent of a 2-node job with 1 process per node, meeting the other at localhost:port."""
    rendezvous = ["--nnodes=2", "--nproc-per-node=1", f"--rdzv-id={job_id}", "--rdzv-backend=c10d"]
    rendezvous.append(f"--rdzv-endpoint=127.0.0.1:{port}")
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, "-m", "vitrain", *args]


def _run_together(commands: list[list[str] | str], env: dict[str, str] | list[dict[str, str]]) -> list[tuple[int, str]]:
    """Start every command at once (a string runs in bash; ``env`` for all, or one for each), wait for all:
    (return code, output) of each."""
    envs = env if isinstance(env, list) else [env] * len(commands)
    processes = [
        subprocess.Popen(
            command,
            shell=isinstance(command, str),
            executable="/bin/bash" if isinstance(command, str) else None,
            env=command_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for command, command_env in zip(commands, envs, strict=True)
    ]
    results = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        results.append((process.returncode, output))
    return results


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """The reference: one torchrun agent of 2 processes (DDP)."""
    out_dir = tmp_path_factory.mktemp("standalone") / "run"
    result = torchrun(["train", *_set_args(_overrides(out_dir, *SHORT))])
    assert result.returncode == 0, result.stderr[-3000:]
    return out_dir


def _final(out_dir: Path) -> dict[str, torch.Tensor]:
    path = out_dir / FINAL
    return read_checkpoint_model(path if path.is_dir() else path.with_suffix(".pt"))[0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_nodes_of_one_process_train_as_the_standalone_pair(standalone, tmp_path, strategy):
    out_dir = tmp_path / "run"
    args = ["train", *_set_args(_overrides(out_dir, *SHORT, f"parallel.strategy={strategy}"))]
    port, job = _free_port(), f"two-nodes-{strategy}"
    results = _run_together([_agent(args, port, job), _agent(args, port, job)], _env())
    assert all(code == 0 for code, _ in results), "\n".join(output[-2000:] for _, output in results)
    _assert_close(_final(out_dir), _final(standalone))
    assert json.loads((out_dir / "summary.json").read_text())["world_size"] == 2


def _srun_part(script: str) -> str:
    """The command the batch script runs under ``srun`` (its continued lines, without the ``&``)."""
    lines = script.splitlines()
    first = next(index for index, line in enumerate(lines) if line.startswith("srun "))
    command = []
    for line in lines[first + 1 :]:
        command.append(line.strip().removesuffix("\\").removesuffix("&").strip())
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(command)


def test_the_slurm_script_for_two_nodes_runs_with_slurm_s_variables_set_by_hand(standalone, tmp_path):
    """``vitrain slurm --nodes 2 --gpus-per-node 1``: its torchrun line, once per node, with the variables
    Slurm and the script's head would set (the job id, the node count, the first node's address)."""
    from vitrain.cli import main

    out_dir, script = tmp_path / "run", tmp_path / "job.sbatch"
    train_args = _set_args(_overrides(out_dir, *SHORT, "train.device=cpu"))
    slurm = ["slurm", "--nodes", "2", "--gpus-per-node", "1", "--no-numa-binding", "--out", str(script)]  # no GPU here
    assert main([*slurm, "--", *train_args]) == 0
    command = _srun_part(script.read_text())
    assert command.startswith("torchrun --nnodes=$SLURM_NNODES --nproc-per-node=1")
    assert re.search(r"--rdzv-endpoint=\"\$MASTER_ADDR:\$MASTER_PORT\"", command)
    env = _env(SLURM_JOB_ID="4242", SLURM_NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # torchrun, as on a node
    results = _run_together([command, command], env)
    assert all(code == 0 for code, _ in results), "\n".join(output[-2000:] for _, output in results)
    _assert_close(_final(out_dir), _final(standalone))


def test_a_rank_killed_mid_run_comes_back_and_ends_as_an_uninterrupted_run(standalone, tmp_path):
    """Rank 1 dies by SIGKILL at step 5 of the first attempt; torchrun (--max-restarts=1) starts the group
    again, which resumes from the step-4 checkpoint and ends bitwise where the uninterrupted run ends."""
    out_dir = tmp_path / "run"
    result = _with_peer_fault(
        "kill", 5, ["--max-restarts=1"], ["--resume", "auto", *_set_args(_overrides(out_dir, *SHORT))]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exitcode: -9" in result.stderr and "resumed from" in result.stderr, result.stderr[-2000:]  # killed, back
    final = _weights(out_dir / f"{FINAL}.pt")
    reference = _weights(standalone / f"{FINAL}.pt")
    assert final.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(final[key], tensor), key
    steps = [record["step"] for record in read_jsonl(out_dir / "metrics.jsonl") if record["event"] == "train"]
    assert steps == sorted(set(steps)) and max(steps) == 6  # the restart logs on from its checkpoint


ATTEMPT = """
import os, sys, time, torch, torch.distributed as dist
from vitrain.config import World
from vitrain.parallel.distributed import close_distributed, init_distributed
rank = int(os.environ["RANK"])
time.sleep(float(sys.argv[1]))
init_distributed(World(rank=rank, size=2, local_rank=rank), cuda=False, timeout_s=15)
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print("sum", int(total.item()))
close_distributed()
"""


def test_a_restarted_attempt_never_reads_the_addresses_of_the_attempt_before():
    """torchrun's agent keeps one store across restarts. Two processes start a group through it and exit
    (attempt 0); in each restart one rank comes 1.5 s late, so its peer looks up the late rank's address
    first: it must wait for the new one, not connect to the dead process's (gloo's "Connection refused" after
    a restart, whenever the early rank is the one that connects). Each attempt's keys stay its own."""
    agent = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = _env(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(agent.port), WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True"
    )
    for attempt in range(4):
        late_rank = None if attempt == 0 else attempt % 2
        commands = [[sys.executable, "-c", ATTEMPT, "1.5" if rank == late_rank else "0"] for rank in range(2)]
        envs = [{**env, "RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(attempt)} for rank in range(2)]
        results = _run_together(commands, envs)
        assert all(code == 0 and "sum 3" in output for code, output in results), [out[-1500:] for _, out in results]
    attempts = {key.split("/")[2] for key in agent.list_keys()}
    assert attempts == {f"attempt_{attempt}" for attempt in range(4)}, agent.list_keys()


def _with_peer_fault(mode: str, step: int, torchrun_options: list[str], train_args: list[str]):
    """``vitrain train`` in 2 processes whose rank 1 fails at ``step`` (tests/dist/peer_fault_worker.py)."""
    worker = Path(__file__).with_name("peer_fault_worker.py")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *torchrun_options]
    command = [*launcher, str(worker), mode, str(step), "--", "train", *train_args]
    return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


def test_a_rank_that_hangs_fails_the_group_within_the_timeout_naming_it(tmp_path):
    """Rank 1 stops answering after step 3: rank 0 waits parallel.timeout_s in its next collective, then fails
    with one line naming rank 1 and the step it last finished, instead of hanging forever. Before the first step
    rank 0 works alone for longer than that timeout (its probes), which rank 1 waits out."""
    started = time.monotonic()
    args = _set_args(_overrides(tmp_path / "run", *SHORT, "parallel.timeout_s=5"))
    result = _with_peer_fault("hang", 4, [], args)
    assert result.returncode != 0 and time.monotonic() - started < 60
    message = next(line for line in result.stderr.splitlines() if "a peer died or hangs" in line)
    assert "rank 1 last finished step 3" in message and "parallel.timeout_s=5" in message, message
