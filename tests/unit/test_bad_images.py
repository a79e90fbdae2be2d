"""Bad and odd image files: decoding, skip-and-replace in the loader and training, `vitrain check-data`."""

from __future__ import annotations

import json
import logging
import re
import struct
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import ExifTags, Image, ImageFile

from tests.conftest import make_config
from vitrain.cli import main
from vitrain.data import build_loaders
from vitrain.data.check import check_image_folder
from vitrain.data.decode import BadImage, decode_image
from vitrain.train import make_plan

BOMB_PIXELS = 100 * 80
LIMIT = 5000  # data.max_image_pixels in these tests: the bomb exceeds it, every other file is far below
RED, BLUE, GREEN, WHITE = (255, 0, 0), (0, 0, 255), (0, 255, 0), (255, 255, 255)


def _noise(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _halves(width: int, height: int, left, right) -> Image.Image:
    """An RGB image, left half one colour, right half another."""
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2], pixels[:, width // 2 :] = left, right
    return Image.fromarray(pixels)


def write_cmyk(path: Path) -> None:
    Image.new("RGB", (32, 24), (200, 40, 60)).convert("CMYK").save(path, "JPEG", quality=95)


def write_gray(path: Path) -> None:
    Image.new("L", (32, 24), 90).save(path, "JPEG", quality=95)


def write_png_named_jpeg(path: Path) -> None:
    Image.fromarray(_noise(24, 32, 7)).save(path, "PNG")


def write_exif_rotated(path: Path, orientation: int = 6) -> None:
    """Stored 40 wide x 20 high, red left half; a camera held upright would show it 20 x 40."""
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation
    _halves(40, 20, RED, BLUE).save(path, "JPEG", quality=95, exif=exif)


def write_rgba(path: Path) -> None:
    """Left third fully transparent (stored black), middle half-transparent red, right third opaque blue."""
    pixels = np.zeros((24, 30, 4), dtype=np.uint8)
    pixels[:, 10:20] = (255, 0, 0, 128)
    pixels[:, 20:] = (0, 0, 255, 255)
    Image.fromarray(pixels).save(path)


def write_palette(path: Path) -> None:
    """Palette black (index 2) transparent on the left half, green (index 1) on the right."""
    image = Image.new("P", (32, 24), 2)
    image.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 0])
    image.paste(1, (16, 0, 32, 24))
    image.save(path, transparency=2)


def write_gray16(path: Path) -> None:
    """16-bit grayscale: 65535 on the left half, 32768 on the right."""
    pixels = np.full((24, 32), 32768, dtype=np.uint16)
    pixels[:, :16] = 65535
    Image.fromarray(pixels).save(path)


def write_truncated(path: Path) -> None:
    Image.fromarray(_noise(40, 48, 3)).save(path, "JPEG")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def write_bomb(path: Path) -> None:
    """BOMB_PIXELS, between 1x and 2x LIMIT: Pillow only warns there; vitrain's own check refuses it."""
    Image.fromarray(_noise(80, 100, 4)).save(path, "JPEG")


HEADER_BOMB_SIDE = 30000


def write_header_bomb(path: Path) -> None:
    """A PNG whose header declares 30000 x 30000 pixels (9e8: over twice LIMIT and twice the default
    limit, where Pillow raises DecompressionBombError on open) and holds one row of pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", HEADER_BOMB_SIDE, HEADER_BOMB_SIDE, 8, 0, 0, 0, 0)  # 8-bit grayscale
    one_row = zlib.compress(bytes(HEADER_BOMB_SIDE + 1))  # filter byte + pixels
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", one_row) + chunk(b"IEND", b""))


ODD_FILES = {  # name in train/n01 -> (writer, the notes check-data reports)
    "cmyk.JPEG": (write_cmyk, ("cmyk",)),
    "gray.JPEG": (write_gray, ("grayscale",)),
    "png_named.JPEG": (write_png_named_jpeg, ("png_named_jpeg",)),
    "exif6.JPEG": (write_exif_rotated, ("exif_rotated",)),
    "rgba.png": (write_rgba, ("transparency",)),
    "palette.png": (write_palette, ("palette", "transparency")),
    "gray16.png": (write_gray16, ("16bit",)),
}
BAD_FILES = {  # name in train/n02 -> (writer, reason)
    "truncated.JPEG": (write_truncated, "truncated"),
    "empty.JPEG": (lambda path: path.write_bytes(b""), "empty"),
    "text.JPEG": (lambda path: path.write_text("this is a text file, not a photo\n"), "not_an_image"),
    "bomb.JPEG": (write_bomb, "decompression_bomb"),
    "header_bomb.png": (write_header_bomb, "decompression_bomb"),
    "damaged.png": (lambda path: path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(64))), "unreadable"),
}
BAD_COUNTS = dict(Counter(reason for _, reason in BAD_FILES.values()))
NUM_PLAIN = 6  # plain RGB JPEGs per class in train/ (one fewer in n02, which holds the bad files)
NUM_TRAIN = 2 * NUM_PLAIN - 1 + len(ODD_FILES) + len(BAD_FILES)  # 24: six batches of 4


@pytest.fixture(scope="module")
def bad_folder(tmp_path_factory) -> Path:
    """An ImageNet-layout root with every odd and bad kind in train/ and one empty file in val/."""
    root = tmp_path_factory.mktemp("bad_images")
    for split, plain in (("train", NUM_PLAIN), ("val", 2)):
        for class_index, name in enumerate(("n01", "n02")):
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(plain - (split == "train" and name == "n02")):
                Image.fromarray(_noise(24 + 4 * index, 32, 10 * class_index + index)).save(
                    folder / f"plain_{index}.JPEG"
                )
    for name, (write, _) in ODD_FILES.items():
        write(root / "train" / "n01" / name)
    for name, (write, _) in BAD_FILES.items():
        write(root / "train" / "n02" / name)
    (root / "train" / "n02" / "notes.txt").write_text("ignored: not an image extension")
    (root / "val" / "n02" / "empty.JPEG").write_bytes(b"")
    return root


def _pixels(path: Path, **kwargs) -> tuple[np.ndarray, tuple[str, ...]]:
    decoded = decode_image(path, **kwargs)
    assert decoded.image.mode == "RGB"
    return np.asarray(decoded.image).astype(int), decoded.notes


# --- decode_image, kind by kind ------------------------------------------------------------------


def test_cmyk_and_grayscale_become_rgb_with_their_colours(tmp_path):
    write_cmyk(tmp_path / "cmyk.jpg")
    pixels, notes = _pixels(tmp_path / "cmyk.jpg")
    assert notes == ("cmyk",) and np.abs(pixels.mean((0, 1)) - (200, 40, 60)).max() < 8
    write_gray(tmp_path / "gray.jpg")
    pixels, notes = _pixels(tmp_path / "gray.jpg")
    assert notes == ("grayscale",) and (pixels == pixels[..., :1]).all() and abs(pixels.mean() - 90) < 3
    Image.fromarray(np.eye(8, dtype=bool)).save(tmp_path / "bilevel.png")  # mode 1
    pixels, notes = _pixels(tmp_path / "bilevel.png")
    assert notes == ("grayscale",) and (pixels[..., 0] == 255 * np.eye(8)).all()


def test_png_named_jpeg_decodes_as_png(tmp_path):
    write_png_named_jpeg(tmp_path / "x.JPEG")
    pixels, notes = _pixels(tmp_path / "x.JPEG", draft_side=4)  # a PNG has no draft: full size
    assert notes == ("png_named_jpeg",) and (pixels == _noise(24, 32, 7)).all()


@pytest.mark.parametrize(("orientation", "red_half"), [(6, "top"), (8, "bottom")])
def test_exif_orientation_is_applied(tmp_path, orientation, red_half):
    write_exif_rotated(tmp_path / "r.jpg", orientation)
    pixels, notes = _pixels(tmp_path / "r.jpg")
    assert notes == ("exif_rotated",)
    assert pixels.shape == (40, 20, 3)  # stored 40 x 20, shown upright 20 wide x 40 high
    top, bottom = pixels[:16].mean((0, 1)), pixels[24:].mean((0, 1))
    red, blue = (top, bottom) if red_half == "top" else (bottom, top)
    assert np.abs(red - RED).max() < 12 and np.abs(blue - BLUE).max() < 12


def test_transparency_is_composited_on_white(tmp_path):
    write_rgba(tmp_path / "a.png")
    pixels, notes = _pixels(tmp_path / "a.png")
    assert notes == ("transparency",)
    assert (pixels[:, :10] == WHITE).all()  # stored black, fully transparent
    assert (np.abs(pixels[:, 10:20] - (255, 127, 127)) <= 1).all()  # half red over white
    assert (pixels[:, 20:] == BLUE).all()
    write_palette(tmp_path / "p.png")
    pixels, notes = _pixels(tmp_path / "p.png")
    assert notes == ("palette", "transparency")
    assert (pixels[:, :16] == WHITE).all() and (pixels[:, 16:] == GREEN).all()
    Image.fromarray(np.array([[0, 255]], dtype=np.uint8)).convert("LA").save(tmp_path / "la.png")
    assert _pixels(tmp_path / "la.png")[1] == ("grayscale", "transparency")


def test_sixteen_bit_is_scaled_not_clipped(tmp_path):
    write_gray16(tmp_path / "g.png")
    pixels, notes = _pixels(tmp_path / "g.png")
    assert notes == ("16bit",)
    assert (pixels[:, :16] == 255).all() and (pixels[:, 16:] == 128).all()
    Image.fromarray(np.array([[0, 1, 128, 256, 32767, 65280]], dtype=np.uint16)).save(tmp_path / "ramp.png")
    assert _pixels(tmp_path / "ramp.png")[0][0, :, 0].tolist() == [0, 0, 0, 1, 127, 254]


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_raise_their_reason(tmp_path, name):
    write, reason = BAD_FILES[name]
    write(tmp_path / name)
    with pytest.raises(BadImage) as raised:
        decode_image(tmp_path / name, max_image_pixels=LIMIT)
    assert raised.value.reason == reason and raised.value.detail


def test_decompression_bomb_limit_is_exact_and_configurable(tmp_path):
    write_bomb(tmp_path / "big.jpg")
    assert decode_image(tmp_path / "big.jpg").image.size == (100, 80)  # the default limit is Pillow's
    assert decode_image(tmp_path / "big.jpg", max_image_pixels=BOMB_PIXELS).image.size == (100, 80)
    with pytest.raises(BadImage, match="decompression_bomb"):
        decode_image(tmp_path / "big.jpg", max_image_pixels=BOMB_PIXELS - 1)
    assert make_config().data.max_image_pixels == 2 * Image.MAX_IMAGE_PIXELS  # and Pillow's own is untouched


def test_a_header_over_twice_the_limit_is_a_bad_image_not_pillows_error(tmp_path):
    """Above twice its limit Pillow raises DecompressionBombError (not an OSError) from Image.open."""
    write_header_bomb(tmp_path / "huge.png")
    with pytest.raises(Image.DecompressionBombError):
        Image.open(tmp_path / "huge.png")  # what decode_image must turn into a BadImage
    with pytest.raises(BadImage) as raised:
        decode_image(tmp_path / "huge.png")  # the default limit
    assert raised.value.reason == "decompression_bomb" and f"{HEADER_BOMB_SIDE**2} pixels" in raised.value.detail


def test_truncated_files_are_refused_even_when_pillow_would_pad_them(tmp_path, monkeypatch):
    write_truncated(tmp_path / "cut.jpg")
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)  # someone else's global setting
    with pytest.raises(BadImage, match="truncated"):
        decode_image(tmp_path / "cut.jpg")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # restored after the decode


def test_draft_still_reduces_odd_jpegs(tmp_path):
    Image.fromarray(_noise(192, 256, 0)).convert("CMYK").save(tmp_path / "c.jpg")
    assert decode_image(tmp_path / "c.jpg", draft_side=40).image.size == (64, 48)
    assert decode_image(tmp_path / "c.jpg").image.size == (256, 192)


# --- loader and training -------------------------------------------------------------------------


def _run_overrides(root: Path, out_dir: Path, *extra: str) -> list[str]:
    overrides = [
        "data.name=imagefolder",
        f"data.root={root}",
        "data.image_size=14",
        "data.num_workers=0",
        f"data.max_image_pixels={LIMIT}",
        "data.max_bad_fraction=0.3",
        "model.name=vit_tiny6_patch7",
        "precision=fp32",
        "train.batch_size=4",
        "train.progress=off",
        f"train.out_dir={out_dir}",
        *extra,
    ]
    return [item for override in overrides for item in ("--set", override)]


def test_loader_replaces_bad_images_deterministically_and_counts_them_from_workers(bad_folder):
    config = make_config(*_run_overrides(bad_folder, Path("unused"))[1::2])
    batches, counts = [], []
    for workers in (0, 2):
        plan = make_plan(config.model_copy(update={"data": config.data.model_copy(update={"num_workers": workers})}))
        train_loader, _ = build_loaders(plan.data)
        train_loader.start_epoch(1)
        batches.append([(images.clone(), labels.clone()) for images, labels in train_loader])
        counts.append(train_loader.bad_images.counts())
    assert counts[0] == counts[1] == BAD_COUNTS
    assert len(batches[0]) == NUM_TRAIN // 4 and all(len(labels) == 4 for _, labels in batches[0])
    for (images_a, labels_a), (images_b, labels_b) in zip(*batches, strict=True):
        assert torch.equal(images_a, images_b) and torch.equal(labels_a, labels_b)


def test_training_skips_bad_images_uses_odd_ones_and_counts_by_reason(bad_folder, tmp_path, monkeypatch, caplog):
    import vitrain.data.loader as loader_module

    decoded: list[str] = []

    def recording_decode(path, *args, **kwargs):
        result = decode_image(path, *args, **kwargs)
        decoded.append(Path(path).name)
        return result

    monkeypatch.setattr(loader_module, "decode_image", recording_decode)
    out_dir = tmp_path / "run"
    argv = ["train", *_run_overrides(bad_folder, out_dir, "train.epochs=2", "train.log_every_steps=6")]
    with caplog.at_level(logging.WARNING, logger="vitrain"):
        assert main(argv) == 0
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["bad_images"] == BAD_COUNTS
    assert summary["bad_eval_images"] == {"empty": 1}
    assert summary["images_seen"] == 2 * NUM_TRAIN  # every slot filled: bad ones replaced
    assert set(ODD_FILES) <= set(decoded)  # the odd files were trained on, not skipped
    assert not set(BAD_FILES) & set(decoded)
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["bad_images"] for record in records if record["event"] == "train"] == [len(BAD_FILES)] * 2
    assert [record["num_samples"] for record in records if record["event"] == "eval"] == [4, 4]  # empty one left out
    warned = [record.getMessage() for record in caplog.records if "image skipped" in record.getMessage()]
    for name in BAD_FILES:  # each bad file logged once, with its reason, over two epochs
        assert sum(f"train/n02/{name} (" in message for message in warned) == 1
    assert sum("val/n02/empty.JPEG (empty:" in message for message in warned) == 1
    assert any("truncated.JPEG (truncated:" in message for message in warned)

    caplog.clear()  # resumed: the counts come back from the checkpoint, nothing is logged twice
    with caplog.at_level(logging.WARNING, logger="vitrain"):
        assert main([*argv, "--set", "train.epochs=3", "--resume", "auto"]) == 0
    assert json.loads((out_dir / "summary.json").read_text())["bad_images"] == summary["bad_images"]
    assert not [record for record in caplog.records if "image skipped" in record.getMessage()]


def test_too_many_bad_images_stop_the_run_with_counts_and_the_key_to_raise(bad_folder, tmp_path, capsys):
    argv = ["train", *_run_overrides(bad_folder, tmp_path / "run", "train.steps=6", "data.max_bad_fraction=0.1")]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    met = re.match(r"vitrain: error: data\.root: (\d) of the 24 training images cannot be decoded", error)
    assert met and 3 <= int(met[1]) < len(BAD_FILES)  # stopped once more than 10 % of 24 were met, not at the end
    assert "data.max_bad_fraction=0.1" in error and "raise data.max_bad_fraction" in error
    assert "vitrain check-data" in error
    named = [name for name in BAD_FILES if name in error]
    assert len(named) == int(met[1])  # the examples are the files met so far, each with its reason
    assert all(
        f"{BAD_FILES[name][1]} " in error and str(bad_folder / "train" / "n02" / name) in error for name in named
    )


def test_a_split_where_nothing_decodes_stops_even_at_fraction_one(tmp_path):
    from vitrain.data.loader import TooManyBadImages

    for split in ("train", "val"):
        (tmp_path / split / "n01").mkdir(parents=True)
        for index in range(4):
            (tmp_path / split / "n01" / f"{index}.JPEG").write_bytes(b"")
    overrides = _run_overrides(tmp_path, tmp_path / "run", "data.max_bad_fraction=1.0")[1::2]
    train_loader, _ = build_loaders(make_plan(make_config(*overrides)).data)
    with pytest.raises(TooManyBadImages, match="none of the 4 training images decodes: empty 4 "):
        next(iter(train_loader))


# --- check-data ------------------------------------------------------------------------------------


def test_check_data_counts_every_kind_with_examples(bad_folder):
    report = check_image_folder(bad_folder, workers=0, max_image_pixels=LIMIT)
    assert report.files_per_split == {"train": NUM_TRAIN, "val": 5}
    assert report.bad == {**BAD_COUNTS, "empty": 2}
    expected_odd: dict[str, int] = {}
    for _, notes in ODD_FILES.values():
        for note in notes:
            expected_odd[note] = expected_odd.get(note, 0) + 1
    assert report.odd == expected_odd
    assert report.num_ok == report.num_files - report.num_bad and report.num_odd_files == len(ODD_FILES)
    assert report.num_ignored == 1
    assert report.examples["truncated"][0].startswith("train/n02/truncated.JPEG (")
    assert report.examples["empty"][:2] == ["train/n02/empty.JPEG (0 bytes)", "val/n02/empty.JPEG (0 bytes)"]
    assert report.examples["exif_rotated"] == ["train/n01/exif6.JPEG"]


def test_check_data_in_parallel_equals_serial(bad_folder):
    serial = check_image_folder(bad_folder, workers=0, max_image_pixels=LIMIT)
    assert check_image_folder(bad_folder, workers=2, max_image_pixels=LIMIT).to_dict() == serial.to_dict()


def test_check_data_cli_reports_and_exit_codes(bad_folder, tiny_imagefolder, tmp_path, capsys):
    args = ["check-data", str(bad_folder), "--workers", "2", "--max-image-pixels", str(LIMIT)]
    assert main([*args, "--json", str(tmp_path / "report.json")]) == 1  # bad files found
    out = capsys.readouterr().out
    assert "truncated" in out and "train/n02/truncated.JPEG" in out and "png_named_jpeg" in out
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["num_bad"] == len(BAD_FILES) + 1 and written["bad"]["decompression_bomb"] == 2
    assert main(["check-data", str(tiny_imagefolder), "--workers", "0"]) == 0  # no bad files
    assert "grayscale" in capsys.readouterr().out  # its grayscale files are reported, not counted as bad
    assert main(["check-data", str(tiny_imagefolder / "train"), "--json", str(tmp_path / "split.json")]) == 0
    assert json.loads((tmp_path / "split.json").read_text())["files_per_split"] == {"train": 18}  # one split folder
    assert main(["check-data", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "nowhere") in err and "train/<class>" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"")
    assert main(["check-data", str(tmp_path / "flat")]) == 2  # no class folders
