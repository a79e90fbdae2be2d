"""Several processes on the CPU (gloo), launched the way users launch them (torchrun), against one process.

Each global batch is split over the ranks and DDP averages the gradients, so two processes must
train to the weights one process reaches on the same global batches (up to float summation order).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import FORWARDING_TORCHRUN
from vitrain.checkpoint import load_checkpoint
from vitrain.cli import main
from vitrain.metrics import read_jsonl

TIMEOUT_S = 300


def _overrides(out_dir, *extra):
    return [
        "precision=fp32",
        "model.name=vit_tiny6_patch7",
        "model.head=gap",
        "data.name=synthetic",
        "data.image_size=14",
        "data.synthetic_num_train=96",
        "data.synthetic_num_eval=30",  # not a multiple of the world size: shards of 15
        "data.scale=[0.5, 1.0]",
        "train.batch_size=16",
        "train.epochs=3",
        "train.progress=off",
        "train.log_every_steps=2",
        "checkpoint.keep_last=5",
        "optim.name=adamw",  # Muon has its own tests: DDP here, FSDP and TP in test_sharded
        "optim.lr=0.2",
        "schedule.warmup_epochs=1",
        f"train.out_dir={out_dir}",
        *extra,
    ]


def _set_args(overrides):
    return [arg for override in overrides for arg in ("--set", override)]


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def torchrun_command(args, nproc=2, program=("-m", "vitrain")):
    """The command that launches ``program`` (vitrain, or a script's path) with ``args`` in ``nproc``
    processes through torchrun, on this host."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*launcher, *program, *args]


def torchrun(args, nproc=2, program=("-m", "vitrain")):
    """Run :func:`torchrun_command` to its end."""
    command = torchrun_command(args, nproc, program)
    return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


def _weights(path):
    return load_checkpoint(path)["model"]


def _without_key_bias(key, tensor):
    """The key bias's gradient is zero (softmax over keys ignores q·b, the same for every key), so AdamW
    steps it by its float noise alone: normalized, that noise differs with the summation order (up to
    5e-5 on torch 2.11) and says nothing about the run. The q and v biases stay compared."""
    if not key.endswith("attn.qkv.bias"):
        return tensor
    q, _, v = tensor.chunk(3)
    return torch.cat([q, v])


def _assert_close(ours, reference, atol=2e-5):
    assert ours.keys() == reference.keys()
    for key in reference:
        mine, theirs = _without_key_bias(key, ours[key]), _without_key_bias(key, reference[key])
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=atol), (key, (mine - theirs).abs().max().item())


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ddp") / "run"
    result = torchrun(["train", *_set_args(_overrides(out_dir))])
    assert result.returncode == 0, result.stderr[-3000:]
    return out_dir, result


def _train_in_one_process(out_dir, *extra) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun worker (OMP_NUM_THREADS=1): the same kernels
    try:
        assert main(["train", *_set_args(_overrides(out_dir, *extra))]) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    single = tmp_path_factory.mktemp("single") / "run"
    _train_in_one_process(single)
    return single


def test_ddp_two_processes_match_one_process(two_process_run, one_process_run):
    out_dir, result = two_process_run
    single = one_process_run
    last = "checkpoints/step-000000018.pt"
    _assert_close(_weights(out_dir / last), _weights(single / last))
    ours, reference = read_jsonl(out_dir / "metrics.jsonl"), read_jsonl(single / "metrics.jsonl")
    ours_train = [r for r in ours if r["event"] == "train"]
    reference_train = [r for r in reference if r["event"] == "train"]
    assert [r["step"] for r in ours_train] == [r["step"] for r in reference_train] == list(range(2, 19, 2))
    losses = [r["loss"] for r in reference_train]
    assert [r["loss"] for r in ours_train] == pytest.approx(losses, rel=1e-4)  # the mean over the ranks
    evals = [(r["num_samples"], r["top1"]) for r in ours if r["event"] == "eval"]
    reference_evals = [(r["num_samples"], r["top1"]) for r in reference if r["event"] == "eval"]
    assert [count for count, _ in evals] == [count for count, _ in reference_evals] == [30] * 3  # summed shards
    assert [top1 for _, top1 in evals] == pytest.approx([top1 for _, top1 in reference_evals], abs=3.4)  # 1 image
    summary = (out_dir / "summary.json").read_text()
    assert '"world_size": 2' in summary and '"images_seen": 288' in summary
    assert result.stdout.count("final_top1") == 1  # rank 0 alone reports


def test_ddp_with_gradient_accumulation_matches_one_process(one_process_run, tmp_path):
    """Each rank's 8 images in micro-batches of 3 (3, 3, 2), gradients reduced once per step (no_sync)."""
    out_dir = tmp_path / "accumulated"
    result = torchrun(["train", *_set_args(_overrides(out_dir, "train.micro_batch_size=3"))])
    assert result.returncode == 0, result.stderr[-3000:]
    final = "checkpoints/step-000000018.pt"
    # micro-batches sum the gradient in another order: the last bits differ; a micro-batch lost or
    # counted twice changes the gradient itself
    _assert_close(_weights(out_dir / final), _weights(one_process_run / final))


def test_ddp_with_muon_matches_one_process(tmp_path):
    """Muon orthogonalizes the all-reduced gradient, so every rank takes the one-process step."""
    muon = ("optim.name=muon", "optim.lr=0.05")
    result = torchrun(["train", *_set_args(_overrides(tmp_path / "ddp", *muon))])
    assert result.returncode == 0, result.stderr[-3000:]
    _train_in_one_process(tmp_path / "single", *muon)
    final = "checkpoints/step-000000018.pt"
    _assert_close(_weights(tmp_path / "ddp" / final), _weights(tmp_path / "single" / final))
    trained = load_checkpoint(tmp_path / "ddp" / final)["optimizer"]["state"]
    assert any("momentum_buffer" in state for state in trained.values())  # Muon's state, not AdamW's alone


def test_ddp_with_per_image_augmentation_matches_one_process(tmp_path):
    """RandAugment, 3-Augment and color jitter are seeded per image and repeated augmentation orders the
    epoch before it is split, so each rank augments its slice as one process does."""
    recipe = ("data.randaugment=rand-m9-mstd0.5-inc1", "data.three_augment=true", "data.color_jitter=0.3")
    recipe += ("data.repeated_aug=3",)
    result = torchrun(["train", *_set_args(_overrides(tmp_path / "ddp", *recipe))])
    assert result.returncode == 0, result.stderr[-3000:]
    _train_in_one_process(tmp_path / "single", *recipe)
    final = "checkpoints/step-000000018.pt"
    _assert_close(_weights(tmp_path / "ddp" / final), _weights(tmp_path / "single" / final))


def test_a_checkpoint_from_two_processes_resumes_in_one(two_process_run, tmp_path):
    out_dir, _ = two_process_run
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    middle, last = "checkpoints/step-000000006.pt", "checkpoints/step-000000018.pt"
    (resumed / middle).write_bytes((out_dir / middle).read_bytes())
    assert main(["train", "--resume", "auto", *_set_args(_overrides(resumed))]) == 0
    _assert_close(_weights(resumed / last), _weights(out_dir / last))


def test_ddp_with_mixing_resumes_to_the_same_weights(two_process_run, tmp_path):
    """Each rank mixes its own 8 images (pairs within them) with draws from (seed, rank, epoch, step):
    the 2-process run resumed mid-epoch mixes as it did uninterrupted and ends bitwise equal."""
    mixing = ("data.mixup=0.8", "data.cutmix=1.0", "data.mix_mode=pair", "train.epochs=2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = torchrun(["train", *_set_args(_overrides(straight, *mixing, "checkpoint.every_steps=4"))])
    assert result.returncode == 0, result.stderr[-3000:]
    (resumed / "checkpoints").mkdir(parents=True)
    (resumed / "checkpoints" / "step-000000008.pt").write_bytes(
        (straight / "checkpoints" / "step-000000008.pt").read_bytes()
    )
    result = torchrun(["train", "--resume", "auto", *_set_args(_overrides(resumed, *mixing))])
    assert result.returncode == 0, result.stderr[-3000:]
    final = "checkpoints/step-000000012.pt"
    ours, reference = _weights(resumed / final), _weights(straight / final)
    assert all(torch.equal(ours[key], reference[key]) for key in reference)
    unmixed = _weights(two_process_run[0] / final)  # the same run without mixing, at the same step
    assert not all(torch.allclose(reference[key], unmixed[key], atol=1e-4) for key in reference)


def test_batch_not_divisible_by_the_processes_is_refused_before_training(tmp_path):
    result = torchrun(["train", *_set_args(_overrides(tmp_path / "run", "train.batch_size=15"))])
    assert result.returncode != 0
    assert "train.batch_size=15 is global and must split evenly over the 2 data-parallel processes" in result.stderr


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_failing_rank_fails_the_whole_job_promptly(tmp_path):
    """Started by hand (no torchrun to kill the survivors): rank 1 stops on bad input after joining the
    group; rank 0 must not wait forever in its next collective but fail within parallel.timeout_s."""
    port = _free_port()
    processes = []
    for rank in range(2):
        overrides = _overrides(tmp_path / "run", "parallel.timeout_s=20")
        if rank == 1:
            overrides.append(f"data.root={tmp_path / 'missing'}")  # synthetic + root: a config error on rank 1
        env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        command = [sys.executable, "-m", "vitrain", "train", *_set_args(overrides)]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    started = time.monotonic()
    codes = [process.wait(timeout=120) for process in processes]
    assert time.monotonic() - started < 90
    assert codes[1] == 2 and codes[0] != 0, codes
    assert "data.root" in processes[1].stderr.read()


@FORWARDING_TORCHRUN
def test_slurm_script_has_the_launch_pieces_and_is_valid_bash(tmp_path):
    script_path = tmp_path / "job.sbatch"
    args = ["slurm", "--nodes", "4", "--gpus-per-node", "8", "--time", "02:00:00", "--partition", "gpu"]
    args += ["--out", str(script_path), "--", "--recipe", "nemo_vit_b16_224", "--set", "data.root=/data/my imagenet"]
    assert main(args) == 0
    script = script_path.read_text().replace(" \\\n    ", " ")  # one line per command
    for piece in [
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",  # one torchrun per node
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=02:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@",
        'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1',
        "srun --kill-on-bad-exit=1",
        "--nnodes=$SLURM_NNODES",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
        "--numa-binding=node",
        "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1",
        'scontrol requeue "$SLURM_JOB_ID"',
        "-m vitrain train --resume auto --recipe nemo_vit_b16_224 --set 'data.root=/data/my imagenet'",
    ]:
        assert piece in script, piece
    assert subprocess.run(["bash", "-n", str(script_path)], capture_output=True).returncode == 0


def test_slurm_refuses_bad_train_arguments_before_writing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["slurm", "--nodes", "1", "--gpus-per-node", "1", "--", "--bogus-flag"])


def test_scaling_sweep_runs_each_world_size_and_reports_efficiency(tmp_path, capsys):
    record = tmp_path / "scaling.json"
    args = ["bench", "--model", "vit_tiny6_patch7", "--image-size", "14", "--batch", "4", "--precision", "fp32"]
    args += ["--warmup", "1", "--steps", "2", "--repeats", "1", "--nproc", "1,2", f"--json={record}"]
    assert main(args) == 0
    result = json.loads(record.read_text())
    rows = result["rows"]
    assert [(row["processes"], row["global_batch"]) for row in rows] == [(1, 4), (2, 8)]  # weak scaling
    assert rows[0]["efficiency"] == pytest.approx(1.0) == rows[0]["speedup"]
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["img_s"] / (2 * rows[0]["img_s"]))
    assert [run["world_size"] for run in result["runs"]] == [1, 2]
    assert "scaling efficiency" in capsys.readouterr().out
