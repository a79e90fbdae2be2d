"""``vitrain eval``, ``export`` and ``predict``: the commands that read a trained checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vitrain.cli.common import _add_config_arguments
from vitrain.config import ConfigError


def _add_checkpoint_parsers(commands) -> None:
    """``eval`` and ``export``: the commands that read a trained checkpoint (``predict`` has its own)."""
    evaluate = commands.add_parser("eval", help="evaluate a checkpoint on its configured data")
    evaluate.add_argument(
        "--checkpoint",
        required=True,
        type=Path,
        help="a checkpoint (runs/.../checkpoints/step-*: file or sharded folder) or a run folder (its best)",
    )
    _add_weights_argument(evaluate)
    _add_config_arguments(evaluate, with_recipe=False)

    export = commands.add_parser(
        "export",
        help="write a checkpoint's model weights (file or sharded folder) as one safetensors file, as a timm "
        "model folder, or as an ONNX model checked with onnxruntime",
    )
    export.add_argument("--checkpoint", required=True, type=Path, help="runs/.../checkpoints/step-* or a run folder")
    export.add_argument(
        "--out",
        required=True,
        type=Path,
        help="the .safetensors file to write (--format timm: the folder; --format onnx: the .onnx file)",
    )
    export.add_argument(
        "--format",
        choices=["safetensors", "timm", "onnx"],
        default="safetensors",
        help="safetensors (default): vitrain's weights and saved config in one file; timm: model.safetensors in "
        "timm's layout and a Hugging Face hub config.json, for timm.create_model; onnx: the fp32 model with a "
        "free batch size and the evaluation transform in its metadata, checked with onnxruntime "
        "(pip install 'vitrain[onnx]')",
    )
    _add_weights_argument(export)


def _add_predict_parser(commands) -> None:
    predict = commands.add_parser(
        "predict",
        help="classify image files or folders with a trained checkpoint (top-k classes and probabilities)",
        description="Examples: vitrain predict runs/my-run photo.jpg; vitrain predict --checkpoint runs/fmnist/ "
        "photos/ --topk 3 --json",
    )
    predict.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="image files or folders (recursive); without --checkpoint the first PATH is the run or checkpoint",
    )
    predict.add_argument(
        "--checkpoint",
        type=Path,
        help="a step-* file or sharded folder, or a run folder (its best checkpoint, else its newest)",
    )
    predict.add_argument("--topk", type=int, default=5, help="classes shown per image (default 5)")
    predict.add_argument("--batch", type=int, default=64, help="images per forward pass (default 64)")
    output = predict.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="one JSON object per image and line")
    output.add_argument("--csv", action="store_true", help="CSV rows path,rank,class,index,prob")
    _add_weights_argument(predict)
    _add_config_arguments(predict, with_recipe=False)


def _add_weights_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        choices=["live", "ema"],
        default="live",
        help="the trained weights (live, default) or their moving average (ema: runs with train.ema.decay)",
    )


def command_eval(args: argparse.Namespace) -> int:
    from vitrain.checkpoint import resolve_checkpoint_argument
    from vitrain.checkpoint.sharded import read_checkpoint_model
    from vitrain.data import Normalize, build_loaders
    from vitrain.train import build_model_for, make_plan
    from vitrain.train.evaluate import evaluate
    from vitrain.weights.inference import checkpoint_config

    args.checkpoint = resolve_checkpoint_argument(args.checkpoint)  # a run folder: its best checkpoint
    weights, info = read_checkpoint_model(args.checkpoint, args.weights)
    plan = make_plan(checkpoint_config(info["config"], args.config, args.overrides, info.get("plan")), measure=False)
    model = build_model_for(plan)
    model.load_state_dict(weights)
    _, eval_loader = build_loaders(plan.data)
    result = evaluate(model, eval_loader, Normalize(plan.data.mean, plan.data.std, plan.device), plan.precision)
    step = info["state"]["step"]
    print(json.dumps({"checkpoint": str(args.checkpoint), "weights": args.weights, "step": step, **result}))
    return 0


def command_export(args: argparse.Namespace) -> int:
    from vitrain.checkpoint import resolve_checkpoint_argument
    from vitrain.export import export_model, export_onnx, export_timm

    args.checkpoint = resolve_checkpoint_argument(args.checkpoint)  # a run folder: its best checkpoint
    result = {"checkpoint": str(args.checkpoint), "weights": args.weights, "format": args.format, "out": str(args.out)}
    if args.format == "timm":
        result.update(export_timm(args.checkpoint, args.out, args.weights))
    elif args.format == "onnx":
        result.update(export_onnx(args.checkpoint, args.out, args.weights))
    else:
        result["tensors"] = export_model(args.checkpoint, args.out, args.weights)
    print(json.dumps(result))
    return 0


def command_predict(args: argparse.Namespace) -> int:
    """Exit 0 when at least one image was classified, 1 when none was (each failure on stderr)."""
    from vitrain import predict

    if args.topk < 1 or args.batch < 1:
        raise ConfigError(f"--topk {args.topk} --batch {args.batch}: both must be >= 1")
    if args.checkpoint is None:
        if len(args.paths) < 2:
            raise ConfigError("give the run (or checkpoint) and then the images: vitrain predict RUN PATH...")
        args.checkpoint, args.paths = args.paths[0], args.paths[1:]
    paths = predict.collect_image_paths(args.paths)
    trained = predict.load_trained_model(args.checkpoint, args.weights, args.config, args.overrides)
    style = "json" if args.json else "csv" if args.csv else "table"
    width = max((len(str(path)) for path in paths), default=4)
    topk = min(args.topk, len(trained.class_names))
    for line in predict.header_lines(style, trained.class_names, width, topk):
        print(line)
    workers = trained.plan.data.num_workers
    classified = 0
    for prediction in predict.predict_files(trained, paths, args.batch, topk, workers):
        if prediction.error is not None:
            print(predict.error_line(prediction), file=sys.stderr)
        classified += prediction.error is None
        for line in predict.prediction_lines(prediction, trained.class_names, style, width):
            print(line)
    if not classified:
        print(f"vitrain: no image classified ({len(paths)} file(s) found)", file=sys.stderr)
    return 0 if classified else 1
