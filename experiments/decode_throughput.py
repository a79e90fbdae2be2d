"""JPEG decode throughput on one device: how many images per second the data path can decode.

    python experiments/decode_throughput.py --device cuda --images 1024 --json decode.json
    python experiments/decode_throughput.py --device cpu --images 16          # the dry run

Generates ImageNet-like JPEGs in memory (500x375, quality 90, smooth gradients plus noise, so the entropy
coder has work), then times, over the same bytes:

- Pillow, one process (what each data-loader worker does; multiply by the workers);
- torchvision's ``decode_jpeg`` on the CPU, a batch at a time;
- with CUDA: torchvision's ``decode_jpeg(device="cuda")`` (nvJPEG), batches of ``--batch``, synchronised;
- NVIDIA DALI's ``fn.decoders.image`` (``device="mixed"`` on a GPU, ``"cpu"`` otherwise) where DALI is installed.

Each figure is the best of three passes after a warm-up pass. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg


def make_jpegs(count: int, width: int = 500, height: int = 375, seed: int = 0) -> list[bytes]:
    """``count`` distinct JPEG files' bytes: colour gradients with noise, quality 90."""
    generator = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    files = []
    for _ in range(count):
        phase = generator.uniform(0, 6.28, size=3)
        channels = [127 + 100 * np.sin(xs / (37 + 11 * c) + ys / (53 + 7 * c) + phase[c]) for c in range(3)]
        image = np.stack(channels, axis=-1) + generator.normal(0, 12, size=(height, width, 3))
        buffer = io.BytesIO()
        Image.fromarray(image.clip(0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
        files.append(buffer.getvalue())
    return files


def best_rate(decode_all, count: int, passes: int = 3) -> float:
    decode_all()  # warm-up: library start-up, device memory, first-call kernel choices
    best = 0.0
    for _ in range(passes):
        started = time.perf_counter()
        decode_all()
        best = max(best, count / (time.perf_counter() - started))
    return best


def pillow_pass(files: list[bytes]) -> None:
    for data in files:
        Image.open(io.BytesIO(data)).convert("RGB").load()


def torchvision_pass(files: list[bytes], batch: int, device: str) -> None:
    tensors = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in files]
    for start in range(0, len(tensors), batch):
        decode_jpeg(tensors[start : start + batch], mode=ImageReadMode.RGB, device=device)
    if device == "cuda":
        torch.cuda.synchronize()


def dali_rate(files: list[bytes], batch: int, device: str) -> tuple[float, str] | None:
    """DALI's decoder over the same bytes, or None where DALI is not installed."""
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError:
        return None
    arrays = [np.frombuffer(data, dtype=np.uint8) for data in files]
    where = "mixed" if device == "cuda" else "cpu"

    @pipeline_def(
        batch_size=batch,
        num_threads=4,
        device_id=0 if device == "cuda" else None,
        exec_pipelined=False,
        exec_async=False,
        prefetch_queue_depth=1,
    )
    def pipeline():
        encoded = fn.external_source(name="jpegs", dtype=types.UINT8)
        return fn.decoders.image(encoded, device=where, output_type=types.RGB)

    pipe = pipeline()
    pipe.build()

    def run() -> None:
        for start in range(0, len(arrays), batch):
            chunk = arrays[start : start + batch]
            pipe.feed_input("jpegs", chunk + chunk[: batch - len(chunk)])
            pipe.run()

    return best_rate(run, len(files)), f"fn.decoders.image device={where}, batch {batch}"


def measure(files: list[bytes], batch: int, device: str) -> list[dict]:
    count = len(files)
    rows = [
        {"name": "pillow, 1 process", "img_s": best_rate(lambda: pillow_pass(files), count), "detail": "per worker"},
        {
            "name": "torchvision decode_jpeg cpu",
            "img_s": best_rate(lambda: torchvision_pass(files, batch, "cpu"), count),
            "detail": f"batch {batch}, {torch.get_num_threads()} threads",
        },
    ]
    if device == "cuda":
        rate = best_rate(lambda: torchvision_pass(files, batch, "cuda"), count)
        rows.append({"name": "torchvision decode_jpeg cuda (nvJPEG)", "img_s": rate, "detail": f"batch {batch}"})
    dali = dali_rate(files, batch, device)
    rows.append(
        {"name": "DALI", "img_s": dali[0], "detail": dali[1]}
        if dali
        else {"name": "DALI", "img_s": 0.0, "detail": "not installed (pip install 'vitrain[dali]')"}
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    files = make_jpegs(args.images)
    rows = measure(files, min(args.batch, args.images), args.device)
    mean_kb = sum(map(len, files)) / len(files) / 1024
    for row in rows:
        print(f"{row['name']:40s} {row['img_s']:10.0f} img/s  ({row['detail']})")
    if args.json:
        record = {"images": len(files), "mean_file_kib": mean_kb, "width": 500, "height": 375, "rows": rows}
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
