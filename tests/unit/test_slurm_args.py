"""``vitrain slurm`` checks the training arguments before it writes the script: ``vitrain train``'s parse,
config loading and ``resolve()`` for the job's nodes x GPUs CUDA processes, the files on the cluster (data
folders, checkpoints, teachers, label maps) not looked for here."""

from __future__ import annotations

import pytest

from vitrain.cli import main
from vitrain.config import DataConfig
from vitrain.data.sources import nominal_source_info
from vitrain.parallel.slurm import SlurmJob, sbatch_script

MISSING = "/path/that/does/not/exist/here"


def _slurm(out, *train_args: str, nodes: int = 4, gpus: int = 8) -> list[str]:
    """``vitrain slurm`` argv (launcher srun: the script does not depend on this torch's torchrun)."""
    job = ["slurm", "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--launcher", "srun", "--out", str(out)]
    return [*job, "--", *train_args]


def _one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vitrain: error: "), lines
    return lines[0]


def test_a_misspelled_key_is_refused_and_no_script_is_written(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert main(_slurm(out, "--set", "train.bach_size=1")) == 2
    error = _one_error_line(capsys)
    assert "train.bach_size" in error and "did you mean 'train.batch_size'" in error
    assert not out.exists()


def test_a_batch_that_does_not_split_over_the_job_s_processes_is_refused(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert main(_slurm(out, "--set", "train.batch_size=100", nodes=4, gpus=8)) == 2
    error = _one_error_line(capsys)
    assert "train.batch_size=100" in error and "32" in error
    assert not out.exists()
    assert main(_slurm(out, "--set", "train.batch_size=100", nodes=1, gpus=4)) == 0  # 100 = 4 x 25
    assert "train.batch_size=100" in out.read_text()


def test_a_combination_resolve_refuses_is_refused_here(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    train = ["--recipe", "nemo_vit_b16_224", "--set", f"data.root={MISSING}", "--set", "parallel.strategy=fsdp"]
    assert main(_slurm(out, *train, "--set", "precision=fp16", nodes=2)) == 2
    assert "parallel.strategy=fsdp with precision=fp16" in _one_error_line(capsys)
    assert not out.exists()


def test_a_bad_yaml_file_or_recipe_is_refused(tmp_path, capsys):
    out, config = tmp_path / "job.sbatch", tmp_path / "run.yaml"
    config.write_text("train:\n  batch_size: many\n")
    assert main(_slurm(out, "--config", str(config))) == 2
    assert "train.batch_size" in _one_error_line(capsys)
    assert main(_slurm(out, "--recipe", "no_such_recipe")) == 2
    assert "--recipe 'no_such_recipe'" in _one_error_line(capsys)
    assert not out.exists()


def test_paths_on_the_cluster_are_not_looked_for_here(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    train = ["--recipe", "nemo_vit_b16_224", "--set", f"data.root={MISSING}"]
    train += ["--set", f"train.init_from={MISSING}/runs/pretrain", "--set", "train.distill.kind=hard"]
    teacher = f"train.distill.teacher={MISSING}/teacher.safetensors"
    train += ["--set", teacher, "--set", "train.distill.teacher_model=deit_small_patch16"]
    assert main(_slurm(out, *train)) == 0
    script = out.read_text()
    assert f"data.root={MISSING}" in script and teacher in script
    capsys.readouterr()
    labels = ["--recipe", "volo_d1_224_tl", "--set", f"data.root={MISSING}", "--set", f"token_labels.maps={MISSING}"]
    assert main(_slurm(out, *labels)) == 0
    assert f"token_labels.maps={MISSING}" in out.read_text()


def test_a_mistake_about_a_cluster_path_names_the_path_given(tmp_path, capsys):
    """The stand-ins resolve() sees for the cluster's files never show in the message."""
    out = tmp_path / "job.sbatch"
    train = ["--set", f"train.init_from={MISSING}/run", "--set", f"train.init_weights={MISSING}/w.safetensors"]
    assert main(_slurm(out, *train)) == 2
    error = _one_error_line(capsys)
    assert f"{MISSING}/run holds its own weights" in error and "vitrain-slurm-" not in error
    assert (
        main(_slurm(out, "--set", "train.distill.kind=soft", "--set", "train.distill.teacher=deit_base_patch16_224"))
        == 2
    )
    assert "train.distill.teacher_weights=PATH" in _one_error_line(capsys)  # a timm name is no path: checked as such
    assert not out.exists()


def test_a_good_command_writes_the_script_of_its_arguments_as_given(tmp_path):
    out = tmp_path / "job.sbatch"
    train = ["--recipe", "nemo_vit_b16_224", "--set", "data.root=/data/my imagenet", "--set", "train.out_dir=runs/b16"]
    assert main(_slurm(out, *train, nodes=2, gpus=4)) == 0
    assert out.read_text() == sbatch_script(SlurmJob(nodes=2, gpus_per_node=4, launcher="srun"), train)


def test_an_unknown_flag_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    with pytest.raises(SystemExit) as stop:
        main(_slurm(out, "--bogus-flag"))
    assert stop.value.code == 2
    assert "unrecognized arguments: --bogus-flag" in _one_error_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        ("imagefolder", (1_281_167, 50_000, 1000, 3)),
        ("webdataset", (1_281_167, 50_000, 1000, 3)),
        ("fashion-mnist", (60_000, 10_000, 10, 1)),
        ("synthetic", (4096, 1024, 10, 3)),
    ],
)
def test_the_data_on_the_cluster_is_given_its_source_s_shape_without_reading_it(name, sizes):
    info = nominal_source_info(DataConfig(name=name, root=None if name == "synthetic" else MISSING))
    assert (info.num_train, info.num_eval, info.num_classes, info.channels) == sizes
    assert len(info.mean) == len(info.std) == info.channels
    limited = nominal_source_info(DataConfig(name=name, limit_train=500, limit_eval=100))
    assert (limited.num_train, limited.num_eval) == (500, 100)
