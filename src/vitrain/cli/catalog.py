"""``vitrain show-config``, ``list-recipes`` and ``list-models``: what a run would be, and what there is to
choose from."""

from __future__ import annotations

import argparse

from vitrain.cli.common import _add_config_arguments, load_config
from vitrain.config import Config, ConfigError, World, config_to_yaml
from vitrain.recipes import DEFAULT_RECIPE, get_recipe, list_recipes


def _add_show_config_parser(commands) -> None:
    """``show-config``."""
    show = commands.add_parser("show-config", help="print the resolved config as YAML")
    _add_config_arguments(show)
    show.add_argument(
        "--processes",
        type=int,
        default=None,
        help="processes of the run, for the per-process batch in the closing comment (default: torchrun's or "
        "srun's WORLD_SIZE here, else 1)",
    )


def _add_list_parsers(commands) -> None:
    """``list-recipes`` and ``list-models``."""
    commands.add_parser("list-recipes", help="named recipes and what they do")
    list_models_parser = commands.add_parser("list-models", help="registered models with their parameter counts")
    list_models_parser.add_argument(
        "--flops", action="store_true", help="also the analytic forward GFLOPs per image at the default input size"
    )


def command_show_config(args: argparse.Namespace) -> int:
    config = load_config(get_recipe(args.recipe), args)
    print(config_to_yaml(config), end="")
    print(measured_comment(config))
    print(batch_comment(config, args.processes or World.from_env().size))
    return 0


def measured_comment(config: Config) -> str:
    """YAML comments: what the config's ``auto`` precision, mode and CPU kernels measure on this machine (cached
    after the first time), or why they could not be measured here."""
    from vitrain.train import make_plan

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
