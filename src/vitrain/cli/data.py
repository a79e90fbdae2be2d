"""``vitrain download-fashion-mnist``, ``check-data``, ``shard`` and ``label``: getting a dataset, checking
it, packing it into shards and labelling it with a teacher."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vitrain.cli.common import _add_config_arguments, _write_json, base_recipe, load_config, processes
from vitrain.config import Config, ConfigError


def _add_download_parser(commands) -> None:
    """``download-fashion-mnist``."""
    download = commands.add_parser("download-fashion-mnist", help="fetch the Fashion-MNIST IDX files (needs internet)")
    download.add_argument("--root", type=Path, required=True, help="folder to write the four *-ubyte.gz files to")
    download.add_argument("--url", default=None, help="base URL of the files (default: the dataset's public mirror)")


def _add_check_data_parser(commands) -> None:
    check = commands.add_parser(
        "check-data",
        help="decode every image of a dataset folder in parallel and report odd and bad files (exit 1 if bad)",
    )
    check.add_argument("root", type=Path, help="dataset root (train/<class>/*, val/<class>/*) or one split folder")
    check.add_argument("--workers", type=int, default=None, help="decode processes (default: one per CPU core)")
    check.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    _add_max_image_pixels(check)


def _add_max_image_pixels(parser) -> None:
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=None,
        help="refuse images with more pixels as decompression bombs (default: data.max_image_pixels's default)",
    )


def _max_image_pixels(args: argparse.Namespace) -> int:
    if args.max_image_pixels is not None and args.max_image_pixels < 1:
        raise ConfigError(f"--max-image-pixels {args.max_image_pixels}: must be >= 1")
    return args.max_image_pixels or Config().data.max_image_pixels


def _add_shard_parser(commands) -> None:
    shard = commands.add_parser(
        "shard",
        help="write an ImageNet-layout folder's train and val splits as WebDataset tar shards (resumable)",
    )
    shard.add_argument("root", type=Path, help="dataset root holding train/<class>/* and val/<class>/*")
    shard.add_argument("--out", type=Path, required=True, help="folder for the shards, index.json and progress.json")
    shard.add_argument("--shard-size", default="1GB", help="about this many bytes per shard (1GB, 500MB, 64KiB)")
    shard.add_argument("--workers", type=int, default=None, help="processes writing shards (default: one per core)")
    _add_max_image_pixels(shard)


def _add_label_parser(commands) -> None:
    label = commands.add_parser(
        "label",
        help="run a teacher over the training images once and store its dense top-k label maps (token labeling)",
        description="Example: vitrain label --teacher runs/volo/ --recipe volo_d1_224 --set data.root=/data/imagenet "
        "--out labels/volo-d1; resumable; under torchrun each process labels its share of the shards",
    )
    label.add_argument("--teacher", required=True, help="run folder, checkpoint, .safetensors file or timm model name")
    label.add_argument("--teacher-weights", type=Path, help="weights file of a timm-name teacher")
    label.add_argument("--teacher-model", help="vitrain model of a .safetensors teacher without vitrain metadata")
    _add_config_arguments(label)
    label.add_argument("--out", required=True, type=Path, help="folder of the label maps (index.json + shards)")
    label.add_argument("--topk", type=int, default=5, help="class scores kept per position (default 5)")
    label.add_argument("--batch", type=int, default=64, help="images per forward pass and process (default 64)")
    label.add_argument("--shard-size", type=int, default=10_000, help="images per shard file (default 10000)")
    label.add_argument("--image-size", type=int, help="side to label at (default: the teacher's input size)")


def command_download_fashion_mnist(args: argparse.Namespace) -> int:
    from vitrain.data.sources import FASHION_MNIST_URL, download_fashion_mnist

    try:
        written = download_fashion_mnist(args.root, args.url or FASHION_MNIST_URL)
    except (OSError, ValueError) as error:
        print(f"vitrain: error: download failed ({error}); check the network or --url", file=sys.stderr)
        return 1
    print(f"{len(written)} file(s) written to {args.root}; train with --set data.root={args.root}")
    return 0


def command_check_data(args: argparse.Namespace) -> int:
    from vitrain.data.check import check_image_folder, format_report

    if args.workers is not None and args.workers < 0:
        raise ConfigError(f"--workers {args.workers}: must be >= 0 (0: decode in this process)")
    report = check_image_folder(args.root, workers=args.workers, max_image_pixels=_max_image_pixels(args))
    print(format_report(report))
    _write_json(args.json, report.to_dict())
    return 1 if report.num_bad else 0


def command_shard(args: argparse.Namespace) -> int:
    from vitrain.data.shards import parse_size, shard_folder

    if args.workers is not None and args.workers < 0:
        raise ConfigError(f"--workers {args.workers}: must be >= 0 (0: write in this process)")
    limit = _max_image_pixels(args)
    index = shard_folder(
        args.root, args.out, parse_size(args.shard_size), args.workers, sys.stderr.isatty(), max_image_pixels=limit
    )
    splits = index["splits"]
    print(
        json.dumps({split: {key: splits[split][key] for key in ("samples", "bad")} for split in splits})
        + f"\n{sum(len(split['shards']) for split in splits.values())} shards, {index['total_bytes']} bytes in "
        f"{args.out}; train with --set data.name=webdataset data.root={args.out}"
    )
    return 0


def command_label(args: argparse.Namespace) -> int:
    config = load_config(base_recipe(args), args)
    from vitrain.token_labeling.label import LabelSettings, label_training_set
    from vitrain.train import make_plan

    settings = LabelSettings(
        teacher=args.teacher,
        out=args.out,
        teacher_weights=args.teacher_weights,
        teacher_model=args.teacher_model,
        k=args.topk,
        batch_size=args.batch,
        shard_size=args.shard_size,
        image_size=args.image_size,
        progress=config.train.progress is True or (config.train.progress == "auto" and sys.stderr.isatty()),
    )
    with processes(config) as world:
        report = label_training_set(make_plan(config, world), settings)
    if world.is_main:
        print(json.dumps(report))
    return 0
