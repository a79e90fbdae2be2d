"""`vitrain bench-data` (storage, decode + augment per worker count, the verdict) and the read rates of the
training metrics. Nothing here asserts a speed: rates only have to be positive and consistent."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import SMALL_SYNTHETIC_RUN
from vitrain.bench.data import describe_verdict, input_verdict, measure_storage, parse_worker_counts
from vitrain.cli import main
from vitrain.config import ConfigError

NUM_PER_CLASS = 12
CLASSES = ("a", "b")


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory) -> Path:
    """An ImageNet-layout root of small JPEGs: train/ 2 x 12, val/ 2 x 2."""
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    for split, count in (("train", NUM_PER_CLASS), ("val", 2)):
        for name in CLASSES:
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(count):
                pixels = rng.integers(0, 255, size=(40 + index, 48, 3)).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{name}_{index}.jpg", quality=90)
    return root


def _train_sizes(root: Path) -> int:
    return sum(path.stat().st_size for path in (root / "train").rglob("*.jpg"))


# --- the command ------------------------------------------------------------------------------------


def test_command_writes_every_figure_with_positive_rates_and_a_plot(jpeg_folder, tmp_path, capsys):
    pytest.importorskip("timm", reason="--compare-timm needs timm (the [dev] extra)")
    out, plot = tmp_path / "data.json", tmp_path / "data.png"
    argv = ["bench-data", str(jpeg_folder), "--workers", "1,0", "--image-size", "16", "--batch", "4"]
    argv += ["--seconds", "0.2", "--compare-timm", "--train-img-s", "50", "--json", str(out), "--plot", str(plot)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["num_images"] == len(CLASSES) * NUM_PER_CLASS and result["batch"] == 4
    machine = result["machine"]
    assert machine["cpu_model"] and machine["usable_cores"] >= 1 and machine["torch"]
    storage = result["storage"]
    assert storage["tool"] == "vitrain reader" and storage["files_in_sample"] == result["num_images"]
    drop = storage["cache_drop"]
    assert drop["files"] == storage["files_in_sample"]
    assert drop["files_dropped"] == drop["files"] or drop["reason"]  # says why where the kernel refused
    for name in ("cold", "warm"):
        assert storage[name]["read_mb_s"] > 0 and storage[name]["iops"] > 0 and storage[name]["files_read"] >= 1
    rows = result["decode"]
    assert [row["workers"] for row in rows] == [0, 1]
    for row in rows:
        assert row["img_s"] > 0 and row["read_mb_s"] > 0 and row["files_s"] > 0 and row["timm_img_s"] > 0
        assert row["cores_used"] == 1
        assert row["img_s_per_core"] == pytest.approx(row["img_s"] / row["cores_used"])
        assert row["vitrain_over_timm"] == pytest.approx(row["img_s"] / row["timm_img_s"])
    verdict = result["verdict"]
    assert verdict["train_img_s"] == 50 and [point["workers"] for point in verdict["points"]] == [0, 1]
    assert verdict["points"][0]["input_bound"]  # 0 workers: decoding adds to every step
    assert verdict["points"][1]["input_bound"] == (rows[1]["img_s"] < 50)
    printed = capsys.readouterr().out
    assert "decode + augment at 16 px" in printed and verdict["summary"] in printed
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_every_backend_is_timed_on_the_same_images_and_shards_open_fewer_files(jpeg_folder, tmp_path):
    pytest.importorskip("webdataset", reason="the shards backend needs webdataset (the [webdataset] extra)")
    pytest.importorskip("nvidia.dali", reason="the dali backend needs NVIDIA DALI (the [dali] extra)")
    out = tmp_path / "data.json"
    argv = ["bench-data", str(jpeg_folder), "--workers", "1", "--image-size", "16", "--batch", "4"]
    argv += ["--seconds", "0.2", "--backend", "dali,pillow,shards", "--train-img-s", "50", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = result["decode"]
    assert [row["backend"] for row in rows] == result["backends"] == ["dali", "pillow", "shards"]
    for row in rows:
        assert row["img_s"] > 0 and row["files_s"] > 0 and row["read_mb_s"] > 0 and row["workers"] == 1
    # each backend reads the images' own bytes: the same bytes per image, whatever the backend
    per_image = [row["read_mb_s"] / row["files_s"] for row in rows]
    assert max(per_image) == pytest.approx(min(per_image), rel=0.35)
    assert result["files_per_epoch"]["pillow"] == result["files_per_epoch"]["dali"] == 2 * NUM_PER_CLASS
    assert result["files_per_epoch"]["shards"] == 1  # 24 small JPEGs fit one shard
    assert [point["workers"] for point in result["verdict"]["points"]] == [1]  # judged on the first backend
    assert result["verdict"]["points"][0]["img_s"] == rows[0]["img_s"]


def test_unknown_backends_are_refused(jpeg_folder, capsys):
    assert main(["bench-data", str(jpeg_folder), "--backend", "pillow,turbo"]) == 2
    assert "--backend 'pillow,turbo': give backends among pillow, shards, dali" in capsys.readouterr().err


def test_model_and_precision_measure_the_training_rate_for_the_verdict(jpeg_folder, tmp_path):
    out = tmp_path / "data.json"
    argv = ["bench-data", str(jpeg_folder / "train"), "--workers", "0", "--image-size", "14", "--batch", "4"]
    argv += ["--seconds", "0.1", "--model", "vit_tiny6_patch7", "--precision", "fp32", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    training = result["training"]
    assert training["model"] == "vit_tiny6_patch7" and training["image_size"] == 14 and training["batch"] == 4
    assert training["img_s_median"] > 0
    assert "synthetic" in training["source"]
    assert result["verdict"]["train_img_s"] == training["img_s_median"]


@pytest.mark.parametrize("text", ["1,x", "-1,2", "", ",", "1.5"])
def test_bad_worker_lists_are_refused(text):
    with pytest.raises(ConfigError, match="--workers"):
        parse_worker_counts(text)


def test_worker_lists_are_sorted_without_repeats():
    assert parse_worker_counts("4, 1,2,4") == (1, 2, 4)
    assert parse_worker_counts("0") == (0,)


def test_bad_input_exits_2_naming_it(jpeg_folder, tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "train" / "a").mkdir(parents=True)
    (empty / "train" / "a" / "notes.txt").write_text("not an image")
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "image.jpg").write_bytes(b"")  # files, but no class folders
    cases = [
        (["bench-data", str(jpeg_folder), "--workers", "1,two"], "--workers"),
        (["bench-data", str(tmp_path / "missing")], str(tmp_path / "missing")),
        (["bench-data", str(empty)], "no image files under"),
        (["bench-data", str(flat)], "holds neither"),
        (["bench-data", str(jpeg_folder), "--model", "vit_tiny6_patch7"], "--precision"),
        (["bench-data", str(jpeg_folder), "--train-img-s", "0"], "--train-img-s"),
        (["bench-data", str(jpeg_folder), "--batch", "0"], "--batch"),
        (
            [
                "bench-data",
                str(jpeg_folder),
                "--model",
                "vit_tiny6_patch7",
                "--precision",
                "fp32",
                "--image-size",
                "15",
            ],
            "not divisible by the patch size",
        ),
        (["bench-data", str(jpeg_folder), "--seconds", "-1"], "--seconds"),
    ]
    for argv, named in cases:
        assert main(argv) == 2, argv
        error = capsys.readouterr().err
        assert named in error and "check-data:" not in error, (argv, error)


# --- fio ----------------------------------------------------------------------------------------------

FIO_JSON = {
    "fio version": "fio-3.36",
    "jobs": [
        {"jobname": "cold_bandwidth", "read": {"bw_bytes": 123_456_000, "iops": 117.7}},
        {"jobname": "warm_bandwidth", "read": {"bw_bytes": 2_000_000_000, "iops": 1907.3}},
        {"jobname": "cold_iops", "read": {"bw_bytes": 4_096_000, "iops": 1000.5}},
        {"jobname": "warm_iops", "read": {"bw_bytes": 409_600_000, "iops": 100_000.25}},
    ],
}


def _fake_fio(folder: Path, fail: bool = False) -> Path:
    """A `fio` on PATH that records its arguments and prints FIO_JSON (``fail``: then exits 1 with an error)."""
    folder.mkdir()
    script = folder / "fio"
    script.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(folder / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        f"print(json.dumps({FIO_JSON!r}))\n"
        f"if {fail}:\n    sys.exit('fio: no such engine')\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder


def test_fio_on_path_measures_storage_from_its_json(jpeg_folder, tmp_path, monkeypatch):
    fake = _fake_fio(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    paths = sorted(str(path) for path in (jpeg_folder / "train").rglob("*.jpg"))
    storage = measure_storage(paths, 2.0)
    assert storage["tool"] == "fio-3.36" and storage["files_in_sample"] == len(paths)
    assert storage["cold"] == {"read_mb_s": 123.456, "iops": 1000.5}
    assert storage["warm"] == {"read_mb_s": 2000.0, "iops": 100_000.25}
    assert storage["cache_drop"]["method"] == "fio --invalidate=1"
    argv = json.loads((fake / "argv.json").read_text())
    assert "--readonly" in argv and "--output-format=json" in argv and "--runtime=2" in argv
    assert f"--filename={':'.join(paths)}" in argv
    names = [arg.removeprefix("--name=") for arg in argv if arg.startswith("--name=")]
    assert names == ["cold_bandwidth", "warm_bandwidth", "cold_iops", "warm_iops"]
    assert argv.count("--invalidate=1") == 2 and argv.count("--stonewall") == 4


def test_a_failing_fio_falls_back_to_the_own_reader(jpeg_folder, tmp_path, monkeypatch):
    fake = _fake_fio(tmp_path / "bin", fail=True)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    paths = sorted(str(path) for path in (jpeg_folder / "train").rglob("*.jpg"))
    storage = measure_storage(paths, 0.1)
    assert storage["tool"] == "vitrain reader" and storage["fio_error"] == "fio exit status 1: fio: no such engine"
    assert storage["cold"]["read_mb_s"] > 0


# --- the verdict --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("points", "train", "cores", "bound", "needed", "extrapolated"),
    [
        ([(1, 100), (2, 190), (4, 350)], 150, 8, [True, False, False], 2, False),  # measured
        ([(1, 100), (2, 180)], 500, 8, [True, True], 5, True),  # 500 / 100 per core
        ([(1, 100), (2, 180)], 250, 8, [True, True], 3, True),  # ceil(2.5)
        ([(1, 100), (2, 110)], 150, 8, [True, True], 3, True),  # 2 would do linearly, but 2 was measured short
        ([(1, 100), (2, 180)], 1000, 4, [True, True], None, True),  # 10 workers > 4 cores
        ([(0, 1000), (1, 900)], 500, 2, [True, False], 1, False),  # 0 workers: decoding adds to the step
        ([(4, 400)], 500, 2, [True], None, True),  # 4 workers on 2 cores: 200 per core, 5 > 2
    ],
)
def test_verdict_by_hand(points, train, cores, bound, needed, extrapolated):
    verdict = input_verdict(points, train, cores)
    assert [point["input_bound"] for point in verdict["points"]] == bound
    assert verdict["workers_needed"] == needed
    assert verdict["extrapolated"] == extrapolated
    assert verdict["capped"] == (needed is None)
    text = describe_verdict(verdict)
    assert ("extrapolated" in text) == extrapolated
    assert (f"{needed} worker(s)" in text) if needed else (f"even {cores} workers" in text)


def test_verdict_keeps_the_best_per_core_rate_it_extrapolated_from():
    verdict = input_verdict([(1, 90), (2, 200), (4, 300)], 1000, 16)
    assert verdict["best_img_s_per_core"] == 100  # 2 workers: 200 / 2
    assert verdict["workers_needed"] == 10


# --- the training metrics -------------------------------------------------------------------------------


def _train_records(out_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if record["event"] == "train"]


def test_imagefolder_metrics_carry_read_rates_and_the_summary_their_means(jpeg_folder, tmp_path, one_thread):
    out_dir = tmp_path / "run"
    overrides = [
        "data.name=imagefolder",
        f"data.root={jpeg_folder}",
        "data.image_size=14",
        "data.num_workers=1",  # the counts travel from a worker process with the batches
        "model.name=vit_tiny6_patch7",
        "precision=fp32",
        "train.batch_size=4",
        "train.epochs=2",
        "train.log_every_steps=4",
        "train.progress=off",
        f"train.out_dir={out_dir}",
    ]
    assert main(["train", *[item for override in overrides for item in ("--set", override)]]) == 0
    records = _train_records(out_dir)
    assert len(records) >= 3
    assert all(record["read_mb_s"] > 0 and record["files_s"] > 0 for record in records)
    seconds = np.diff([0.0] + [record["train_s"] for record in records])
    total_bytes = sum(record["read_mb_s"] * 1e6 * dt for record, dt in zip(records, seconds, strict=True))
    total_files = sum(record["files_s"] * dt for record, dt in zip(records, seconds, strict=True))
    assert total_files == pytest.approx(2 * len(CLASSES) * NUM_PER_CLASS)  # every image, once per epoch
    assert total_bytes == pytest.approx(2 * _train_sizes(jpeg_folder))
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["mean_read_mb_s"] == pytest.approx(total_bytes / 1e6 / summary["train_s"])
    assert summary["mean_files_s"] == pytest.approx(total_files / summary["train_s"])


def test_in_memory_data_reports_no_read_rates(tmp_path, one_thread):
    out_dir = tmp_path / "run"
    overrides = [*SMALL_SYNTHETIC_RUN, "train.steps=2", "train.log_every_steps=1", f"train.out_dir={out_dir}"]
    assert main(["train", *[item for override in overrides for item in ("--set", override)]]) == 0
    records = _train_records(out_dir)
    assert records and all(record["read_mb_s"] is None and record["files_s"] is None for record in records)
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["mean_read_mb_s"] is None and summary["mean_files_s"] is None
