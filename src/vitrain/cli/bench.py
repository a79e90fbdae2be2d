"""``vitrain bench`` and ``bench-data``: training-step and input-pipeline throughput."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from vitrain.cli.common import _add_config_arguments, _write_json, processes
from vitrain.config import Config, ConfigError, build_config
from vitrain.recipes import get_recipe


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


def _add_bench_comm_arguments(bench) -> None:
    """``--comm``, and the hidden flags of each torchrun process it starts."""
    bench.add_argument(
        "--comm",
        action="store_true",
        help="time all-reduce, all-gather and reduce-scatter from 4 KiB to 64 MiB over this machine's backend "
        "(NCCL, or gloo on CPUs) at each --nproc count above 1 (default 2): bus GB/s and the latency + "
        "bandwidth fit that `vitrain forecast --network FILE.json` reads",
    )
    bench.add_argument("--comm-worker", type=Path, help=argparse.SUPPRESS)
    bench.add_argument("--comm-sizes", help=argparse.SUPPRESS)
    bench.add_argument("--comm-cpu", action="store_true", help=argparse.SUPPRESS)


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="time training steps on synthetic data: img/s, MFU, peak memory (optionally against timm)"
    )
    bench.add_argument(
        "--recipe", default=None, help="recipe whose model/optimizer settings apply (default: the plain defaults)"
    )
    _add_config_arguments(bench, with_recipe=False)
    bench.add_argument("--model", help="registered model (see list-models); required but with --comm")
    bench.add_argument("--image-size", type=int, help="input side in pixels; required but with --comm")
    bench.add_argument("--batch", type=int, help="images per step; required but with --comm")
    bench.add_argument("--precision", choices=["fp32", "bf16", "fp16", "fp8"], help="required but with --comm")
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
        help="torch.compile mode of --compile, ours and timm's (the bench compiles by its flags: performance.compile "
        "and performance.compile_mode of a recipe or --set do not apply)",
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
    _add_bench_comm_arguments(bench)
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


def command_bench(args: argparse.Namespace) -> int:
    from vitrain.bench import BenchSettings, bench_overrides, compare_with_timm, format_table, measure_training_step
    from vitrain.train import make_plan

    settings = BenchSettings(
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        compile=args.compile,
        compile_backend=args.compile_backend,
        compile_mode=args.compile_mode,
        profile=args.profile,
    )
    if args.comm_worker:
        from vitrain.bench.comm import SIZES, comm_worker

        sizes = tuple(int(size) for size in args.comm_sizes.split(",")) if args.comm_sizes else SIZES
        comm_worker(args.comm_worker, sizes, args.repeats, args.comm_cpu)
        return 0
    if args.comm:
        return _bench_comm(args)
    missing = [flag for flag in ("model", "image_size", "batch", "precision") if getattr(args, flag) is None]
    if missing:
        raise ConfigError(f"bench: give --{', --'.join(name.replace('_', '-') for name in missing)} (or --comm)")
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


def _bench_comm(args: argparse.Namespace) -> int:
    from vitrain.bench.comm import format_comm, run_comm
    from vitrain.bench.scaling import parse_nproc
    from vitrain.hardware import detect_hardware

    try:
        counts = parse_nproc(args.nproc or "2")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    config = build_config(Config(), args.config, args.overrides)
    cpu = config.train.device == "cpu" or not detect_hardware(config.train.device).cuda_available
    try:
        result = run_comm(counts, args.repeats, cpu)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    print(format_comm(result))
    _write_json(args.json, result)
    return 0


def _bench_scaling(args: argparse.Namespace, config: Config) -> int:
    from vitrain.bench.scaling import format_scaling, parse_nproc, plot_scaling, run_scaling
    from vitrain.train import make_plan

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
    from vitrain.hardware import detect_hardware

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
    from vitrain.train import make_plan
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
