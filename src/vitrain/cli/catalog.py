"""``vitrain show-config``, ``list-recipes`` and ``list-models``: what a run would be, and what there is to
choose from."""

from __future__ import annotations

import argparse

from vitrain.cli.common import _add_config_arguments, _add_run_flags, base_recipe, load_config, run_config
from vitrain.config import Config, ConfigError, World, config_to_yaml
from vitrain.recipes import DEFAULT_RECIPE, list_recipes


def _add_show_config_parser(commands) -> None:
    """``show-config``."""
    show = commands.add_parser(
        "show-config", help="print what the run will do: the resolved config as YAML (--raw: as given)"
    )
    _add_config_arguments(show)
    _add_run_flags(show)
    show.add_argument("--raw", action="store_true", help="the config as given: auto settings and templates unresolved")
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
    if args.raw:
        print(config_to_yaml(load_config(base_recipe(args), args)), end="")
        return 0
    config, choice = run_config(args)
    show_run(config, choice, args.processes or World.from_env().size)
    return 0


def show_run(config: Config, choice, processes: int) -> None:
    """What the run will do, as YAML comments over the resolved config: the recipe chosen for --data and why,
    device, precision (measured where auto), each process's batch, the scaled LR, the length and the run folder.
    The YAML itself has the auto settings and the run folder filled in, so ``--config`` of it repeats the run."""
    from vitrain.train import make_plan

    for reason in choice.reasons if choice else ():
        print(f"# {reason}")
    batch = batch_comment(config, processes)  # a bad --processes before anything is measured
    try:
        plan = make_plan(config)
    except ConfigError as error:
        print(config_to_yaml(config), end="")
        print(f"# not resolved here: {error}")
        print(batch)
        return
    print(config_to_yaml(resolved_config(plan)), end="")
    for line in run_comments(plan):
        print(f"# {line}")
    print(batch)


def resolved_config(plan) -> Config:
    """The plan's config with what ``auto`` and the templates became: device, precision and mode, CPU kernels,
    run folder."""
    config = plan.config.model_copy(deep=True)
    config.train.device, config.train.out_dir = plan.device, str(plan.out_dir)
    config.precision, config.precision_mode = plan.precision.name, plan.precision.mode
    config.performance.cpu_kernels = plan.runtime.cpu_kernels
    return config


def run_comments(plan) -> list[str]:
    """Lines on what the run will do that the YAML does not say."""
    schedule, optim = plan.schedule, plan.config.optim
    measured = f" (measured: {plan.measured.describe()})" if plan.measured else ""
    if schedule.duration_unit == "seconds":
        length = f"{plan.config.train.budget} of training (wall clock, evaluation excluded)"
    elif schedule.duration_unit == "steps":
        length = f"{schedule.total_steps} optimizer steps"
    else:
        length = f"{schedule.run_length / schedule.num_train:.2f} epochs ({schedule.run_length:,.0f} images)"
    return [
        f"runs on {plan.device} in {plan.precision.name} {plan.precision.mode}{measured}",
        f"lr {schedule.lr:.4g}: optim.lr {optim.lr:g} x batch {plan.batch.global_batch} / optim.reference_batch "
        f"{optim.reference_batch}",
        f"length: {length}; {schedule.steps_per_epoch} steps an epoch over {schedule.num_train} images",
        f"run folder: {plan.out_dir}",
    ]


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
