"""``vitrain train``, ``finetune`` and ``slurm``: the commands that run (or script) a training run."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from vitrain.cli.common import (
    EXIT_BAD_INPUT,
    _add_config_arguments,
    _add_run_flags,
    base_recipe,
    load_config,
    log,
    processes,
    run_config,
)
from vitrain.config import Config, ConfigError, World, stored_config
from vitrain.recipes import get_recipe


def _add_train_parsers(commands) -> None:
    """``train`` and ``finetune``."""
    train = commands.add_parser(
        "train",
        help="train a recipe, or on your images (default: a LocalViT on Fashion-MNIST)",
        description="Examples: vitrain train (the default recipe on Fashion-MNIST); vitrain train --data my-images/ "
        "--budget 1h (a recipe chosen for your images and the budget on this machine; --dry-run shows it); "
        "vitrain train --recipe deit_s_300ep --data /data/imagenet --batch-size 1024",
    )
    _add_config_arguments(train)
    _add_run_flags(train)
    train.add_argument(
        "--dry-run", action="store_true", help="print the run (and the recipe chosen for --data) and stop"
    )
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

    from vitrain.cli import build_parser

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
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus-per-node must be >= 1")
    train = _parse_train_args(train_args)  # bad train arguments fail here, not on the cluster
    config = load_config(base_recipe(train), train)  # and a bad --set before torch is imported
    from vitrain.parallel.slurm import SlurmJob, check_train_config, sbatch_script

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
    check_train_config(config, job.nodes * job.gpus_per_node)
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


def _print_result(summary: dict, world: World) -> None:
    if world.is_main:
        keys = ("best_top1", "final_top1", "wall_s", "mean_img_s")
        ema = {"final_ema_top1": summary["final_ema_top1"]} if summary["final_ema_top1"] is not None else {}
        print(json.dumps({**{key: summary[key] for key in keys}, **ema}))


def command_train(args: argparse.Namespace) -> int:
    config, choice = run_config(args)
    if args.dry_run:
        from vitrain.cli.catalog import show_run

        show_run(config, choice, World.from_env().size)
        return 0
    for reason in choice.reasons if choice else ():
        log.info("--data: %s", reason)
    from vitrain.train import make_plan, train  # torch: once the config is known to be good

    with processes(config) as world:
        summary = train(make_plan(config, world, measure=False), resume=args.resume)  # measures after its checks
    _print_result(summary, world)
    return 0


def command_finetune(args: argparse.Namespace) -> int:
    """``train`` with ``train.init_from``: the recipe's config (timm weights: with the model holding them),
    or without --recipe the source's saved config."""
    config = load_config(_finetune_base(args), args)
    config.train.init_from = str(args.init_from)
    from vitrain.train import make_plan, train

    with processes(config) as world:
        summary = train(make_plan(config, world, measure=False))  # measures after its checks
    _print_result(summary, world)
    return 0


def _finetune_base(args: argparse.Namespace) -> Config:
    """The config a fine-tuning run starts from, before --config/--set: --recipe's, its model replaced by
    the one holding timm weights; else the saved config of vitrain weights, as recipe ``<recipe>_ft``."""
    from vitrain.config.weights import init_source_kind

    timm_source = init_source_kind(args.init_from) == "timm"
    if args.recipe is not None and not timm_source:
        return get_recipe(args.recipe)
    if args.recipe is None and timm_source:
        raise ConfigError(
            f"--from {args.init_from}: timm weights carry no training config; give --recipe (the data and "
            "schedule to fine-tune with; the weights set its model.name)"
        )
    weights = load_config(get_recipe(args.recipe), args).train.init_weights if timm_source else None
    from vitrain.weights.sources import WeightsSourceError, read_init_weights

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
    base = stored_config(saved)
    base.recipe = f"{base.recipe}_ft"
    return base
