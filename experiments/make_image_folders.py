"""Write the image folders the input-pipeline figures in docs/benchmarks.md are measured on.

    python experiments/make_image_folders.py imagenet-like OUT [--train 20000] [--val 1000] [--classes 100]
    python experiments/make_image_folders.py fashion-mnist OUT [--root /usr/share/datasets/fashion-mnist]

imagenet-like: ImageNet-layout JPEGs at ImageNet's typical 500x375 (landscape; every fourth portrait
375x500), quality 90, 4:2:0 chroma: a smooth random colour field with texture and noise per image, which
compresses like photographs (about 100 KB per file, ImageNet's mean is about 110 KB). fashion-mnist: the
built-in dataset's 60,000 training and 10,000 test images as 28x28 grayscale JPEGs (quality 95) in
train/<class>/ and val/<class>/. Both are seeded: the same command writes the same files; an interrupted imagenet-like run resumes.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter


def photo_like(seed: int, width: int, height: int) -> Image.Image:
    """A seeded image with photo-like statistics: low-frequency colour, mid-frequency texture, sensor noise."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    texture = Image.fromarray(rng.integers(0, 256, (height // 4, width // 4), dtype=np.uint8))
    texture = texture.resize((width, height), Image.BILINEAR).filter(ImageFilter.GaussianBlur(0.8))
    pixels = np.asarray(coarse, dtype=np.float32) + 0.8 * (np.asarray(texture, dtype=np.float32)[..., None] - 128)
    pixels += rng.normal(0, 16, pixels.shape)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def _write_imagenet_like(job: tuple[str, int, int]) -> int:
    """Write one image (kept if an earlier run finished it: files appear complete, by rename)."""
    path, seed, index = job
    if not os.path.exists(path):
        width, height = (375, 500) if index % 4 == 3 else (500, 375)
        photo_like(seed, width, height).save(path + ".tmp", format="JPEG", quality=90, subsampling=2)
        os.replace(path + ".tmp", path)
    return os.path.getsize(path)


def imagenet_like(out: Path, train: int, val: int, classes: int, workers: int) -> None:
    jobs = []
    for split, count, offset in (("train", train, 0), ("val", val, 10**7)):
        for index in range(count):
            folder = out / split / f"n{index % classes:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            jobs.append((str(folder / f"{split}_{index:07d}.JPEG"), offset + index, index))
    with ProcessPoolExecutor(workers) as pool:
        sizes = list(pool.map(_write_imagenet_like, jobs, chunksize=64))
    print(f"{len(sizes)} JPEGs in {out}, {sum(sizes) / len(sizes) / 1e3:.1f} KB on average")


def fashion_mnist(out: Path, root: Path) -> None:
    from vitrain.data.sources import load_fashion_mnist

    names = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")
    for split, folder in (("train", "train"), ("eval", "val")):
        dataset = load_fashion_mnist(root, split)
        for name in names:
            (out / folder / name).mkdir(parents=True, exist_ok=True)
        for index, (image, label) in enumerate(zip(dataset.images, dataset.labels, strict=True)):
            path = out / folder / names[int(label)] / f"{index:05d}.jpg"
            Image.fromarray(image[0].numpy()).save(path, quality=95)
        print(f"{len(dataset)} {split} images in {out / folder}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["imagenet-like", "fashion-mnist"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=20000)
    parser.add_argument("--val", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--root", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if args.kind == "imagenet-like":
        imagenet_like(args.out, args.train, args.val, args.classes, args.workers)
    else:
        fashion_mnist(args.out, args.root)


if __name__ == "__main__":
    main()
