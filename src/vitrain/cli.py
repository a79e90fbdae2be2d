"""Command line: parse, resolve a config, call the library, map errors to exit codes.

Exit codes: 0 success; 1 unexpected failure, or training diverged (too many non-finite steps in a
row); 2 bad input (config, paths, checkpoints: unsafe, unreadable, unwritable or a full disk; more
undecodable images than data.max_bad_fraction allows); 3 preempted (SIGTERM or SIGUSR1: the step
finished, a checkpoint was saved; continue with ``--resume auto``); 130 interrupted (Ctrl-C, no
checkpoint); check-data: 1 when it found bad files; doctor: 1 when a check failed; predict: 1 when no
image could be classified.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import sys
from pathlib import Path

from vitrain.checkpoint import CheckpointError, resolve_checkpoint_argument
from vitrain.config import Config, ConfigError, World, build_config, config_to_yaml
from vitrain.hardware import detect_hardware
from vitrain.recipes import DEFAULT_RECIPE, get_recipe, list_recipes
from vitrain.train import make_plan
from vitrain.train.loop import TrainingDiverged
from vitrain.train.signals import Preempted

log = logging.getLogger("vitrain")
EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 3
EXIT_BROKEN_PIPE = 141  # what a shell reports for a program ended by SIGPIPE (128 + 13)


def _add_config_arguments(parser: argparse.ArgumentParser, with_recipe: bool = True) -> None:
    if with_recipe:
        parser.add_argument(
            "--recipe", default=DEFAULT_RECIPE, help=f"named recipe (default {DEFAULT_RECIPE}; see list-recipes)"
        )
    parser.add_argument(
        "--config", action="append", default=[], type=Path, help="YAML file layered over the recipe (repeatable)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one dotted key (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitrain", description="Train vision transformers from scratch, fast.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a recipe (default: locality ViT on Fashion-MNIST)")
    _add_config_arguments(train)
    train.add_argument(
        "--resume",
        metavar="auto|last|best|PATH",
        help="continue from the newest checkpoint of the run (auto: or start; last: or fail), its best by eval "
        "top-1 (best), or a file",
    )

    finetune = commands.add_parser(
        "finetune", help="train from a checkpoint's weights at another resolution and/or class count"
    )
    finetune.add_argument(
        "--from",
        dest="init_from",
        required=True,
        help="the weights to start from: a checkpoint (file or sharded folder), a run folder (its best), a "
        ".safetensors file of `vitrain export`, or timm:NAME (timm's weights: --set train.init_weights=FILE, else "
        "the local Hugging Face cache; nothing is downloaded)",
    )
    finetune.add_argument(
        "--recipe", default=None, help="fine-tuning recipe (default: the checkpoint's own config, as '<recipe>_ft')"
    )
    _add_config_arguments(finetune, with_recipe=False)

    _add_checkpoint_parsers(commands)
    _add_predict_parser(commands)

    show = commands.add_parser("show-config", help="print the resolved config as YAML")
    _add_config_arguments(show)
    show.add_argument(
        "--processes",
        type=int,
        default=None,
        help="processes of the run, for the per-process batch in the closing comment (default: torchrun's or "
        "srun's WORLD_SIZE here, else 1)",
    )

    download = commands.add_parser("download-fashion-mnist", help="fetch the Fashion-MNIST IDX files (needs internet)")
    download.add_argument("--root", type=Path, required=True, help="folder to write the four *-ubyte.gz files to")
    download.add_argument("--url", default=None, help="base URL of the files (default: the dataset's public mirror)")

    commands.add_parser("list-recipes", help="named recipes and what they do")
    list_models_parser = commands.add_parser("list-models", help="registered models with their parameter counts")
    list_models_parser.add_argument(
        "--flops", action="store_true", help="also the analytic forward GFLOPs per image at the default input size"
    )
    _add_bench_parser(commands)
    _add_bench_data_parser(commands)
    _add_slurm_parser(commands)
    _add_plot_parser(commands)
    _add_check_data_parser(commands)
    _add_shard_parser(commands)
    _add_doctor_parser(commands)
    _add_label_parser(commands)
    return parser


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
        description="Example: vitrain predict --checkpoint runs/fmnist/ photos/ --topk 3 --json",
    )
    predict.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="image files or folders (recursive)")
    predict.add_argument(
        "--checkpoint",
        required=True,
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


def _add_doctor_parser(commands) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check what this machine can do for vitrain: CPU, GPUs, environment (exit 1 if a check fails)",
    )
    _add_config_arguments(doctor)
    doctor.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="the device you mean to train on: cuda makes a missing GPU a failure, cpu skips the GPU checks",
    )
    doctor.add_argument("--out", type=Path, help="folder runs will be written to (default: the recipe's run root)")
    doctor.add_argument("--json", type=Path, help="also write every check as JSON to this file")


def _add_weights_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        choices=["live", "ema"],
        default="live",
        help="the trained weights (live, default) or their moving average (ema: runs with train.ema_decay)",
    )


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


def _add_bench_window_arguments(bench) -> None:
    """How long `vitrain bench` measures, and how many more steps it profiles."""
    bench.add_argument("--steps", type=int, default=10, help="steps per timed window (default 10)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    bench.add_argument("--repeats", type=int, default=5, help="timed windows; img/s is their median (default 5)")
    bench.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile N more steps after the timed windows: where the step's time goes (matmul, attention, "
        "normalization, optimizer, ..., GPU idle), per measured run (default 0: none)",
    )


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="time training steps on synthetic data: img/s, MFU, peak memory (optionally against timm)"
    )
    bench.add_argument(
        "--recipe", default=None, help="recipe whose model/optimizer settings apply (default: the plain defaults)"
    )
    _add_config_arguments(bench, with_recipe=False)
    bench.add_argument("--model", required=True, help="registered model (see list-models)")
    bench.add_argument("--image-size", type=int, required=True, help="input side in pixels")
    bench.add_argument("--batch", type=int, required=True, help="images per step")
    bench.add_argument("--precision", required=True, choices=["fp32", "bf16", "fp16"])
    bench.add_argument(
        "--precision-mode", choices=["autocast", "o2", "full"], help="default: the recipe's; autocast without --recipe"
    )
    bench.add_argument("--compile", action="store_true", help="torch.compile the model; compile time reported apart")
    bench.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of --compile and the ladder's compile rung (default inductor; "
        "aot_eager or eager trace without generating kernels, for dry runs)",
    )
    bench.add_argument(
        "--compile-mode",
        choices=["default", "max-autotune-no-cudagraphs"],
        default="default",
        help="torch.compile mode of --compile, ours and timm's (the bench compiles by its flags: train.compile "
        "and train.compile_mode of a recipe or --set do not apply)",
    )
    _add_bench_window_arguments(bench)
    bench.add_argument("--json", type=Path, help="also write the result as JSON to this file")
    bench.add_argument(
        "--compare-timm", action="store_true", help="also time the timm model of the same architecture, timm's way"
    )
    bench.add_argument(
        "--timm-eager",
        action="store_true",
        help="with --compare-timm --compile: also time timm eager, as its train.py runs by default",
    )
    bench.add_argument(
        "--ladder",
        action="store_true",
        help="the cumulative ladder fp32 -> +bf16 -> +fused optimizer -> +attention -> +compile -> +O2 -> "
        "+activation checkpointing, relative throughput per rung and a PNG bar chart",
    )
    bench.add_argument(
        "--nproc",
        help="scaling sweep: comma-separated process counts (e.g. 1,2,4), each a torchrun of this bench with "
        "--batch images per process; reports scaling efficiency and a PNG",
    )
    bench.add_argument(
        "--plot", type=Path, help="--ladder/--nproc: PNG path (default: <kind>-<model>.png, or beside --json)"
    )


def _add_bench_data_parser(commands) -> None:
    bench = commands.add_parser(
        "bench-data",
        help="measure the input pipeline of an image folder: storage MB/s and IOPS, decode + augment img/s per "
        "worker count, and whether training would wait for data",
        description="Example: vitrain bench-data /data/imagenet --workers 2,4,8 --model vit_base_patch16_224 "
        "--precision bf16 --json data.json --plot data.png",
    )
    bench.add_argument("root", type=Path, help="dataset root (train/<class>/*) or one split folder of class folders")
    bench.add_argument("--workers", default="1,2,4", help="data-loader worker counts to time (default 1,2,4)")
    bench.add_argument("--image-size", type=int, default=224, help="training input side in pixels (default 224)")
    bench.add_argument("--batch", type=int, default=64, help="images per batch (default 64)")
    bench.add_argument(
        "--seconds", type=float, default=3.0, help="time box of each storage pass and worker count (default 3)"
    )
    bench.add_argument("--json", type=Path, help="also write every figure and the machine as JSON to this file")
    bench.add_argument("--plot", type=Path, help="PNG of img/s against workers")
    bench.add_argument("--model", help="measure training img/s of this model (with --precision) for the verdict")
    bench.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="precision of --model's steps")
    bench.add_argument("--train-img-s", type=float, help="a measured training img/s to judge against (not --model)")
    bench.add_argument("--compare-timm", action="store_true", help="also time timm's loader at each worker count")
    bench.add_argument(
        "--backend",
        default="pillow",
        help="loaders to time, comma-separated: pillow (image files), shards (tar shards), dali (DALI CPU pipeline); "
        "the verdict judges the first (default pillow)",
    )
    bench.add_argument(
        "--shards", type=Path, help="the root's shards from `vitrain shard` (default: written to a temp folder)"
    )
    bench.add_argument(
        "--recipe", default=None, help="recipe whose data augmentation (and model settings) apply (default: defaults)"
    )
    _add_config_arguments(bench, with_recipe=False)


def _add_plot_parser(commands) -> None:
    plot = commands.add_parser(
        "plot",
        help="learning curves of one or several runs (top-1, loss, LR, img/s, MFU, data wait) as PNG, SVG or HTML",
    )
    plot.add_argument("runs", nargs="+", type=Path, help="run folders (train.out_dir, holding metrics.jsonl)")
    plot.add_argument("--out", required=True, type=Path, help="the .png, .svg or .html file to write")
    plot.add_argument("--names", nargs="+", help="one name per run in the legend (default: the folder names)")


def command_plot(args: argparse.Namespace) -> int:
    from vitrain.report.runs import plot_runs

    print(plot_runs(args.runs, args.out, args.names))
    return 0


def _add_slurm_parser(commands) -> None:
    slurm = commands.add_parser(
        "slurm",
        help="write an sbatch script running `vitrain train` on N nodes x G GPUs (torchrun, c10d, requeue)",
        description="Example: vitrain slurm --nodes 4 --gpus-per-node 8 --time 24:00:00 --out job.sbatch -- "
        "--recipe nemo_vit_b16_224 --set data.root=/data/imagenet; then sbatch job.sbatch",
    )
    slurm.add_argument("--nodes", type=int, required=True)
    slurm.add_argument("--gpus-per-node", type=int, required=True)
    slurm.add_argument("--time", default="24:00:00", help="Slurm time limit (default 24:00:00)")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--job-name", default="vitrain")
    slurm.add_argument("--cpus-per-gpu", type=int, default=8, help="CPU cores per GPU for data loading (default 8)")
    slurm.add_argument("--no-numa-binding", action="store_true", help="do not pass --numa-binding=node to torchrun")
    slurm.add_argument(
        "--launcher",
        choices=["torchrun", "srun"],
        default="torchrun",
        help="torchrun (default): one task per node starts the workers; srun: one task per GPU, each a worker",
    )
    slurm.add_argument("--out", type=Path, help="write the script here (default: stdout)")
    slurm.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the arguments of `vitrain train`")


def _parse_train_args(train_args: list[str]) -> argparse.Namespace:
    """``vitrain train``'s parse of the arguments after ``--``; where argparse refuses them (an unknown
    flag), one ``vitrain: error:`` line, without argparse's usage text, and exit 2 (SystemExit, as argparse)."""
    import io

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return build_parser().parse_args(["train", *train_args])
    except SystemExit as stop:
        if stop.code in (0, None):  # --help: printed to stdout
            raise
        lines = captured.getvalue().strip().splitlines() or ["error: cannot parse them"]
        reason = lines[-1].split("error: ", 1)[-1]
        print(f"vitrain: error: the training arguments after --: {reason}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None


def command_slurm(args: argparse.Namespace) -> int:
    """The batch script, written only once the training arguments resolve to a run of nodes x GPUs CUDA
    processes here, as ``vitrain train`` checks them (recipe, --config, --set, resolve()), the files on the
    cluster (data.root, checkpoints, teachers, label maps) not looked for (``check_train_config``)."""
    from vitrain.parallel.slurm import SlurmJob, check_train_config, sbatch_script

    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus-per-node must be >= 1")
    job = SlurmJob(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        time=args.time,
        job_name=args.job_name,
        partition=args.partition,
        account=args.account,
        cpus_per_gpu=args.cpus_per_gpu,
        numa_binding=not args.no_numa_binding,
        launcher=args.launcher,
    )
    train = _parse_train_args(train_args)  # bad train arguments fail here, not on the cluster
    check_train_config(load_config(get_recipe(train.recipe), train), job.nodes * job.gpus_per_node)
    try:
        script = sbatch_script(job, train_args)
    except ValueError as error:  # what this environment's torchrun cannot do
        raise ConfigError(str(error)) from None
    if args.out is None:
        print(script, end="")
    else:
        args.out.write_text(script)
        args.out.chmod(0o755)
        log.info(
            "wrote %s (%d nodes x %d GPUs); submit with: sbatch %s", args.out, job.nodes, job.gpus_per_node, args.out
        )
    return 0


def load_config(base: Config, args: argparse.Namespace) -> Config:
    return build_config(base, args.config, args.overrides)


@contextlib.contextmanager
def processes(config: Config):
    """The run's processes: under torchrun (WORLD_SIZE > 1) join the process group (NCCL on GPUs,
    gloo on CPUs) for the duration, rank 0 alone logging at INFO; yields this process's World."""
    from vitrain.parallel.distributed import close_distributed, init_distributed

    world = World.from_env()
    if world.size > 1:
        cuda = detect_hardware(config.train.device).cuda_available and config.train.device != "cpu"
        init_distributed(world, cuda, config.parallel.timeout_s)
        if not world.is_main:
            log.setLevel(logging.WARNING)
    try:
        yield world
    finally:
        close_distributed()


def _print_result(summary: dict, world: World) -> None:
    if world.is_main:
        keys = ("best_top1", "final_top1", "wall_s", "mean_img_s")
        ema = {"final_ema_top1": summary["final_ema_top1"]} if summary["final_ema_top1"] is not None else {}
        print(json.dumps({**{key: summary[key] for key in keys}, **ema}))


def command_train(args: argparse.Namespace) -> int:
    from vitrain.train import train

    config = load_config(get_recipe(args.recipe), args)
    with processes(config) as world:
        summary = train(make_plan(config, world, measure=False), resume=args.resume)  # measures after its checks
    _print_result(summary, world)
    return 0


def command_finetune(args: argparse.Namespace) -> int:
    """``train`` with ``train.init_from``: the recipe's config (timm weights: with the model holding them),
    or without --recipe the source's saved config."""
    from vitrain.train import train

    config = load_config(_finetune_base(args), args)
    config.train.init_from = str(args.init_from)
    with processes(config) as world:
        summary = train(make_plan(config, world, measure=False))  # measures after its checks
    _print_result(summary, world)
    return 0


def _finetune_base(args: argparse.Namespace) -> Config:
    """The config a fine-tuning run starts from, before --config/--set: --recipe's, its model replaced by
    the one holding timm weights; else the saved config of vitrain weights, as recipe ``<recipe>_ft``."""
    from vitrain.weights.sources import WeightsSourceError, init_source_kind, read_init_weights

    timm_source = init_source_kind(args.init_from) == "timm"
    if args.recipe is not None and not timm_source:
        return get_recipe(args.recipe)
    if args.recipe is None and timm_source:
        raise ConfigError(
            f"--from {args.init_from}: timm weights carry no training config; give --recipe (the data and "
            "schedule to fine-tune with; the weights set its model.name)"
        )
    weights = load_config(get_recipe(args.recipe), args).train.init_weights if timm_source else None
    try:
        saved = read_init_weights(args.init_from, weights)[1]
    except WeightsSourceError as error:
        raise ConfigError(f"--from {args.init_from}: {error}") from None
    if timm_source:
        base = get_recipe(args.recipe)
        base.model = base.model.model_copy(update=saved["model"])
        return base
    if "recipe" not in saved:
        raise ConfigError(
            f"--from {args.init_from} carries no vitrain config (not written by `vitrain export`): give --recipe"
        )
    base = Config.model_validate(saved)
    base.recipe = f"{base.recipe}_ft"
    return base


def command_eval(args: argparse.Namespace) -> int:
    from vitrain.checkpoint.sharded import read_checkpoint_model
    from vitrain.data import Normalize, build_loaders
    from vitrain.train import build_model_for
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


def command_show_config(args: argparse.Namespace) -> int:
    config = load_config(get_recipe(args.recipe), args)
    print(config_to_yaml(config), end="")
    print(measured_comment(config))
    print(batch_comment(config, args.processes or World.from_env().size))
    return 0


def measured_comment(config: Config) -> str:
    """YAML comments: what the config's ``auto`` precision, mode and CPU kernels measure on this machine (cached
    after the first time), or why they could not be measured here."""
    try:
        plan = make_plan(config)
    except ConfigError as error:
        return f"# auto settings not measured here: {error}"
    policy = plan.precision
    if plan.measured is None:
        return f"# computes in {policy.dtype} ({policy.mode}) on {plan.device}, CPU kernels {plan.runtime.cpu_kernels}"
    return f"# measured on {plan.device}: {plan.measured.describe()}"


def batch_comment(config: Config, processes: int) -> str:
    """A YAML comment: train.batch_size is global; what each process (each data slice, under tensor
    parallelism) takes of it, and its micro-batches (timm's --batch-size is per device)."""
    if processes < 1:
        raise ConfigError(f"--processes {processes}: must be at least 1")
    tp = config.parallel.tp_size or (processes if config.parallel.strategy == "tp" else 1)
    slices = max(processes // tp, 1)
    batch = config.train.batch_size
    share = (
        f"{batch // slices}" if batch % slices == 0 else f"{batch / slices:g} (not a whole number: resolve refuses it)"
    )
    micro = config.train.micro_batch_size
    accumulation = f", in micro-batches of {micro}" if micro else ""
    return (
        f"# train.batch_size {batch} is the global batch: {share} per process over {processes} process(es)"
        f"{f' ({slices} data slices of {tp} tensor-parallel processes)' if tp > 1 else ''}{accumulation}"
    )


def command_download_fashion_mnist(args: argparse.Namespace) -> int:
    from vitrain.data.sources import FASHION_MNIST_URL, download_fashion_mnist

    try:
        written = download_fashion_mnist(args.root, args.url or FASHION_MNIST_URL)
    except (OSError, ValueError) as error:
        print(f"vitrain: error: download failed ({error}); check the network or --url", file=sys.stderr)
        return 1
    print(f"{len(written)} file(s) written to {args.root}; train with --set data.root={args.root}")
    return 0


def command_list_recipes(args: argparse.Namespace) -> int:
    for name, doc in list_recipes().items():
        print(f"{name}{' (default)' if name == DEFAULT_RECIPE else ''}\n    {' '.join(doc.split())}")
    return 0


def command_list_models(args: argparse.Namespace) -> int:
    from vitrain.models import build_model, list_models, num_parameters
    from vitrain.models.flops import model_flops

    flops_header = f"{'GFLOPs':>8} {'at':>4}  " if args.flops else ""
    print(f"{'name':28} {'params':>9}  {flops_header}description")
    for spec in list_models():
        model = build_model(spec.name, device="meta")
        flops = f"{model_flops(model, spec.args.img_size) / 1e9:8.2f} {spec.args.img_size:4d}  " if args.flops else ""
        print(f"{spec.name:28} {num_parameters(model) / 1e6:8.2f}M  {flops}{spec.description}")
    return 0


def command_bench(args: argparse.Namespace) -> int:
    from vitrain.bench import BenchSettings, bench_overrides, compare_with_timm, format_table, measure_training_step

    settings = BenchSettings(
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        compile=args.compile,
        compile_backend=args.compile_backend,
        compile_mode=args.compile_mode,
        profile=args.profile,
    )
    if args.timm_eager and not (args.compare_timm and args.compile):
        raise ConfigError("--timm-eager times timm uncompiled beside a compiled run: add --compare-timm and --compile")
    base = get_recipe(args.recipe) if args.recipe else Config()
    flags = bench_overrides(args.model, args.image_size, args.batch, args.precision, args.precision_mode, settings)
    if args.ladder:
        return _bench_ladder(args, base, flags, settings)
    config = build_config(base, args.config, flags + args.overrides)
    if args.nproc:
        return _bench_scaling(args, config)
    with processes(config) as world:
        plan = make_plan(config, world)
        if args.compare_timm:
            result = compare_with_timm(plan, settings, timm_eager=args.timm_eager)
        else:
            result = measure_training_step(plan, settings)
    if world.is_main:
        print(format_table(result))
        _write_json(args.json, result)
    return 0


def command_bench_data(args: argparse.Namespace) -> int:
    from vitrain.bench.data import (
        DataBenchSettings,
        format_report,
        measure_training_img_s,
        parse_backends,
        parse_worker_counts,
        plot_decode,
        run_bench_data,
    )

    if args.train_img_s is not None and args.model is not None:
        raise ConfigError("--train-img-s and --model both give the training rate; keep one")
    if (args.model is None) != (args.precision is None):
        raise ConfigError("--model and --precision go together: give both to measure training img/s, or neither")
    settings = DataBenchSettings(
        root=args.root,
        workers=parse_worker_counts(args.workers),
        image_size=args.image_size,
        batch=args.batch,
        seconds=args.seconds,
        compare_timm=args.compare_timm,
        train_img_s=args.train_img_s,
        backends=parse_backends(args.backend),
        shards=args.shards,
    )
    base = get_recipe(args.recipe) if args.recipe else Config()
    training = None
    if args.model is not None:
        training = functools.partial(
            measure_training_img_s,
            *(base, args.config, args.overrides, args.model, args.precision, args.image_size, args.batch),
        )
    result = run_bench_data(settings, build_config(base, args.config, args.overrides), training)
    print(format_report(result))
    _write_json(args.json, result)
    if args.plot is not None:
        done = plot_decode(result, args.plot)
        print(f"plot: {args.plot}" if done else "no plot: matplotlib is not installed (pip install -e '.[plot]')")
    return 0


def _write_json(path: Path | None, result: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


def _bench_scaling(args: argparse.Namespace, config: Config) -> int:
    from vitrain.bench.scaling import format_scaling, parse_nproc, plot_scaling, run_scaling

    try:
        counts = parse_nproc(args.nproc)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    make_plan(config)  # bad input fails here, before any process starts
    passed, skip = [], False
    for arg in args.argv[1:]:  # the sweep sets these flags itself
        if skip:
            skip = False
        elif arg in ("--nproc", "--json", "--plot", "--batch"):
            skip = True
        elif not arg.startswith(("--nproc=", "--json=", "--plot=", "--batch=")):
            passed.append(arg)
    on_cpu = not detect_hardware(config.train.device).cuda_available or config.train.device == "cpu"
    result = run_scaling(passed, args.batch, counts, on_cpu)
    print(format_scaling(result))
    _write_json(args.json, result)
    plot_path = args.plot or (args.json.with_suffix(".png") if args.json else Path(f"scaling-{args.model}.png"))
    if plot_scaling(result, plot_path, f"{args.model}, {args.image_size} px, batch {args.batch} per process"):
        print(f"plot: {plot_path}")
    return 0


def _bench_ladder(args: argparse.Namespace, base: Config, flags: list[str], settings) -> int:
    import dataclasses

    from vitrain.bench import format_ladder, ladder_rungs, plot_ladder, run_ladder
    from vitrain.models import model_spec
    from vitrain.train.attention_probe import candidates as attention_candidates

    try:
        fields = {field.name for field in dataclasses.fields(model_spec(args.model).args)}
    except KeyError as error:
        raise ConfigError(f"--model: {error.args[0]}") from None

    def plan_for(extra: list[str]):
        return make_plan(build_config(base, args.config, flags + args.overrides + extra))

    attention = attention_candidates(plan_for([]).device) if "attn_impl" in fields else ()
    rungs = ladder_rungs(args.precision, attention, with_compile=True)
    result = run_ladder(plan_for, settings, rungs)
    print(format_ladder(result))
    _write_json(args.json, result)
    plot_path = args.plot or (args.json.with_suffix(".png") if args.json else Path(f"ladder-{args.model}.png"))
    title = f"{args.model}, {args.image_size} px, batch {args.batch}"
    if plot_ladder(result, plot_path, title):
        print(f"plot: {plot_path}")
    else:
        print("no plot: matplotlib is not installed (pip install -e '.[plot]')", file=sys.stderr)
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


def command_doctor(args: argparse.Namespace) -> int:
    from vitrain.doctor import format_report, run_doctor

    report = run_doctor(load_config(get_recipe(args.recipe), args), device=args.device, out=args.out)
    print(format_report(report))
    _write_json(args.json, report.to_dict())
    return report.exit_code


def command_label(args: argparse.Namespace) -> int:
    from vitrain.token_labeling.label import LabelSettings, label_training_set

    config = load_config(get_recipe(args.recipe), args)
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


COMMANDS = {
    "train": command_train,
    "eval": command_eval,
    "export": command_export,
    "predict": command_predict,
    "show-config": command_show_config,
    "download-fashion-mnist": command_download_fashion_mnist,
    "finetune": command_finetune,
    "list-recipes": command_list_recipes,
    "list-models": command_list_models,
    "bench": command_bench,
    "bench-data": command_bench_data,
    "slurm": command_slurm,
    "check-data": command_check_data,
    "shard": command_shard,
    "doctor": command_doctor,
    "label": command_label,
    "plot": command_plot,
}


def _discard_stdout() -> None:
    """Point stdout at /dev/null: the reader of the pipe is gone, and Python's flush at exit would
    otherwise print a BrokenPipeError of its own."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    from tqdm.contrib.logging import logging_redirect_tqdm

    redirect = logging_redirect_tqdm() if args.command in ("train", "finetune", "label") else contextlib.nullcontext()
    try:
        with redirect:
            code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a reader that left early (`| head`, `| grep -q`) shows here, not at exit
        return code
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except (ConfigError, CheckpointError) as error:
        print(f"vitrain: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TrainingDiverged as error:
        print(f"vitrain: error: {error}", file=sys.stderr)
        return 1
    except Preempted as stop:
        print(f"vitrain: {stop}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("vitrain: interrupted", file=sys.stderr)
        return 130
