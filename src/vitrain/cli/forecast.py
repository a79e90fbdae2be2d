"""``vitrain forecast``: time, memory, network and storage at any device count, from measured figures."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vitrain.cli.common import _add_config_arguments, _write_json
from vitrain.config import Config, ConfigError, build_config

DESCRIPTION = """\
Before renting N GPUs: what they will give. The inputs are measured, never guessed:

  compute  one device's training step at its batch: --bench FILE (a `vitrain bench --json` record made on
           the GPU kind you will rent), or --measure (bench it here now), or a published rate
           (--img-s-per-device with --model, --image-size, --batch, --precision)
  model    parameters, FLOPs and activations per sharding unit: read from the model itself
  layout   --strategy ddp|fsdp, --tensor-parallel, --accumulation, --batch-per-device
  network  --network: a preset (each with its datasheet source) or a `vitrain bench --comm --json` record
  data     --data: a `vitrain bench-data --json` record or the image folder (count, mean file size), or
           --images and --mean-file-kib; --storage-gbs and --data-cores-per-node make storage and decoding
           limits

For each device count it prints global img/s, scaling efficiency, step time and the exposed communication
after overlap, bytes on the wire per step, memory per device and whether it fits, the storage GB/s and
IOPS the data path needs, the time per epoch (and to --epochs), and the first limit reached (compute,
network, storage, decode, memory). docs/forecast.md says how it is computed and how well it did.

Example: vitrain forecast --bench vitb16-h100.json --strategy fsdp --network dgx-h100 --devices 8-1024 \\
  --data /data/imagenet/train --epochs 300 --json forecast.json --plot forecast.png"""


def _add_forecast_parser(commands) -> None:
    from vitrain.forecast.fabrics import FABRICS

    forecast = commands.add_parser(
        "forecast",
        help="predict img/s, time to train, memory, network and storage at 1..N devices from measured figures",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compute = forecast.add_argument_group("compute (one of --bench, --measure, --img-s-per-device)")
    compute.add_argument("--bench", type=Path, help="a `vitrain bench --json` record of one device")
    compute.add_argument("--measure", action="store_true", help="bench one step on this machine first")
    compute.add_argument("--img-s-per-device", type=float, help="a published single-device img/s at --batch")
    compute.add_argument("--model", help="the model (with --measure or --img-s-per-device; else the bench's)")
    compute.add_argument("--image-size", type=int, help="input side in pixels (default: the bench's, or 224)")
    compute.add_argument("--batch", type=int, help="images per step of the measurement")
    compute.add_argument("--precision", choices=["fp32", "bf16", "fp16", "fp8"], help="the measurement's")
    compute.add_argument("--precision-mode", choices=["autocast", "o2", "full"], help="the measurement's")
    compute.add_argument("--optimizer", help="adamw, sgd, muon, ... (default: the bench's, or adamw)")
    compute.add_argument("--memory-gib", type=float, help="peak memory of the measured step (default: the bench's)")
    compute.add_argument("--device-name", help="the measured device (default: the bench's)")
    compute.add_argument("--num-classes", type=int, default=1000, help="classifier outputs (default 1000)")
    layout = forecast.add_argument_group("layout")
    layout.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="data parallelism (default ddp)")
    layout.add_argument("--tensor-parallel", type=int, default=1, help="tensor-parallel degree inside a node")
    layout.add_argument("--accumulation", type=int, default=1, help="micro-steps per optimizer step")
    layout.add_argument("--batch-per-device", type=int, help="micro-batch per device (default: the measured batch)")
    layout.add_argument("--no-reshard", action="store_true", help="FSDP keeps the gathered parameters (ZeRO-2)")
    layout.add_argument("--devices", default="1-64", help="device counts: 1-1024 (doubling) or 2,4,64 (default 1-64)")
    layout.add_argument(
        "--shared-host",
        action="store_true",
        help="the devices are processes sharing this one machine's cores (the local check of `bench --nproc`)",
    )
    layout.add_argument("--device-memory-gib", type=float, help="memory per device (default: the datasheet's)")
    network = forecast.add_argument_group("network")
    network.add_argument(
        "--network", default="dgx-h100", help=f"{', '.join(FABRICS)}, or a `bench --comm` JSON (default dgx-h100)"
    )
    network.add_argument("--devices-per-node", type=int, help="replaces the preset's")
    data = forecast.add_argument_group("data")
    data.add_argument("--data", help="a `vitrain bench-data --json` record or an image folder")
    data.add_argument("--images", type=int, help="images per epoch (instead of --data)")
    data.add_argument("--mean-file-kib", type=float, help="mean image file size in KiB (instead of --data)")
    data.add_argument("--shards", action="store_true", help="the data is read as tar shards, not one file per image")
    data.add_argument("--storage-gbs", type=float, help="what the storage serves to all nodes, GB/s (a limit)")
    data.add_argument("--data-cores-per-node", type=int, help="CPU cores per node decoding (a limit, with --data)")
    data.add_argument(
        "--decode-img-s-per-node",
        type=float,
        help="what one node decodes and augments, img/s (a limit; instead of --data-cores-per-node)",
    )
    data.add_argument("--epochs", type=float, help="also the time to train this many epochs")
    forecast.add_argument("--json", type=Path, help="also write inputs and rows as JSON")
    forecast.add_argument("--plot", type=Path, help="PNG of img/s and scaling efficiency against devices")
    _add_config_arguments(forecast, with_recipe=False)


def _measured(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """(Measured, the bench record or the flags' facts) from --bench, --measure or --img-s-per-device."""
    from vitrain.forecast.inputs import measured_from_bench, read_bench

    if any(override.startswith("model.") for override in args.overrides):
        raise ConfigError(
            "forecast: --set model.* would change the model away from the registered one whose sizes the forecast "
            "reads; forecast a registered variant (vitrain list-models)"
        )
    chosen = [name for name in ("bench", "measure", "img_s_per_device") if getattr(args, name)]
    if len(chosen) != 1:
        raise ConfigError("forecast: give exactly one of --bench FILE, --measure, --img-s-per-device X")
    if args.bench:
        record = read_bench(args.bench)
        return measured_from_bench(record, f"vitrain bench {args.bench}"), record
    missing = [flag for flag in ("model", "batch", "precision") if getattr(args, flag) is None]
    if missing:
        raise ConfigError(f"forecast: --measure and --img-s-per-device need --{', --'.join(missing)}")
    image_size = args.image_size or 224
    if args.measure:
        from vitrain.bench import BenchSettings, bench_overrides, measure_training_step
        from vitrain.cli.common import processes
        from vitrain.train import make_plan

        settings = BenchSettings(steps=5, warmup=2, repeats=3)
        flags = bench_overrides(args.model, image_size, args.batch, args.precision, args.precision_mode, settings)
        config = build_config(Config(), args.config, flags + args.overrides)
        with processes(config) as world:
            record = measure_training_step(make_plan(config, world), settings)
        return measured_from_bench(record, "measured now: vitrain bench"), record
    record = {
        "model": args.model,
        "image_size": image_size,
        "batch": args.batch,
        "precision": args.precision,
        "precision_mode": args.precision_mode or "autocast",
        "optimizer": args.optimizer or "adamw",
        "peak_memory_bytes": int(args.memory_gib * 2**30) if args.memory_gib else None,
        "device_name": args.device_name or "unknown",
        "step_ms_median": 1e3 * args.batch / args.img_s_per_device,
    }
    source = f"{args.img_s_per_device:g} img/s per device at batch {args.batch} (given)"
    return measured_from_bench(record, source), record


def command_forecast(args: argparse.Namespace) -> int:
    import dataclasses

    from vitrain.forecast.fabrics import resolve_fabric
    from vitrain.forecast.inputs import device_memory_bytes, read_data
    from vitrain.forecast.model import Layout, device_counts, forecast
    from vitrain.forecast.report import format_forecast, plot_forecast
    from vitrain.forecast.sizes import model_sizes
    from vitrain.models import model_facts

    try:
        measured, record = _measured(args)
        if args.optimizer:
            measured = dataclasses.replace(measured, optimizer=args.optimizer)
        if args.memory_gib:
            measured = dataclasses.replace(measured, memory_bytes=int(args.memory_gib * 2**30))
        if args.device_name:
            measured = dataclasses.replace(measured, device_name=args.device_name)
        model, image_size = args.model or record["model"], args.image_size or record["image_size"]
        try:
            facts = model_facts(model)
        except KeyError as error:
            raise ValueError(f"--model: {error.args[0]}") from None
        if args.tensor_parallel > 1 and not facts.splits_heads:
            raise ValueError(f"--tensor-parallel: {model} has no blocks tensor parallelism splits (ViTs with an MLP)")
        for flag in ("tensor_parallel", "accumulation", "batch_per_device", "devices_per_node"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
        sizes = model_sizes(model, image_size, args.num_classes)
        fabric = resolve_fabric(args.network, args.devices_per_node)
        counts = device_counts(args.devices)
        data = _data(args, read_data)
        memory = int(args.device_memory_gib * 2**30) if args.device_memory_gib else None
        layout = Layout(
            strategy=args.strategy,
            batch_per_device=args.batch_per_device or measured.batch,
            tensor_parallel=args.tensor_parallel,
            accumulation=args.accumulation,
            reshard_after_forward=not args.no_reshard,
            shared_host=args.shared_host,
            device_memory_bytes=memory or device_memory_bytes(measured.device_name),
        )
        rows = forecast(sizes, measured, layout, fabric, counts, data)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    result = {"inputs": _inputs_record(sizes, measured, layout, fabric, data, args.epochs), "rows": rows}
    print(format_forecast(result))
    _write_json(args.json, result)
    if args.plot is not None:
        print(f"plot: {args.plot}" if plot_forecast(result, args.plot) else "no plot: matplotlib is not installed")
    return 0


def _inputs_record(sizes, measured, layout, fabric, data, epochs: float | None) -> dict[str, Any]:
    """What the forecast started from, in words (the table's header) and in full (the JSON)."""
    import dataclasses

    layout_text = f"{layout.strategy}" + (f" + TP {layout.tensor_parallel}" if layout.tensor_parallel > 1 else "")
    layout_text += f", {layout.batch_per_device}/device" + (
        f" x {layout.accumulation} micro-steps" if layout.accumulation > 1 else ""
    )
    return {
        "model": sizes.model,
        "image_size": sizes.image_size,
        "layout": layout_text,
        "network": f"{fabric.name} ({fabric.devices_per_node}/node)",
        "network_source": fabric.source,
        "measured": f"{measured.source}: {1e3 * measured.step_s:.1f} ms per step of {measured.batch} on "
        f"{measured.device_name}, {measured.precision} {measured.precision_mode}, {measured.optimizer}",
        "data": data.source if data else None,
        "epochs": epochs,
        "model_sizes": sizes.as_dict(),
        "measured_step": dataclasses.asdict(measured),
        "layout_fields": dataclasses.asdict(layout),
        "fabric": dataclasses.asdict(fabric),
    }


def _data(args: argparse.Namespace, read_data) -> Any:
    import dataclasses

    from vitrain.forecast.model import Data

    if args.data and (args.images or args.mean_file_kib):
        raise ValueError("--data and --images/--mean-file-kib both describe the data; keep one")
    if args.data:
        data = read_data(args.data)
    elif args.images or args.mean_file_kib:
        if not (args.images and args.mean_file_kib):
            raise ValueError("--images and --mean-file-kib go together")
        data = Data(args.images, args.mean_file_kib * 1024, source=f"{args.images} images of {args.mean_file_kib} KiB")
    else:
        return None
    if args.decode_img_s_per_node and args.data_cores_per_node:
        raise ValueError("--decode-img-s-per-node and --data-cores-per-node both set the decode limit; keep one")
    data = dataclasses.replace(
        data, shards=args.shards, storage_gbs=args.storage_gbs, cores_per_node=args.data_cores_per_node
    )
    if args.decode_img_s_per_node:  # one node's rate: as a core's, on one core
        data = dataclasses.replace(data, decode_img_s_per_core=args.decode_img_s_per_node, cores_per_node=1)
    return data
