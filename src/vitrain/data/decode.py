"""Decoding one image file to RGB, the same way for the loader and for ``vitrain check-data``.

Odd but decodable files are converted, and what was done is noted:

- CMYK -> RGB (Pillow's conversion; no ICC colour management);
- grayscale (``L``, ``1``) -> RGB by repeating the channel;
- 16-bit (``I;16*``, ``I``) -> 8-bit by scaling 0..65535 to 0..255 (rounded), never by clipping;
- transparency (``RGBA``, ``LA``, ``PA``, a palette's transparent colour) -> composited on white;
- palette (``P``) -> RGB through its palette;
- EXIF orientation applied (``ImageOps.exif_transpose``), so the pixels stand as the camera meant;
- a file whose content is another format than its name says (ImageNet's PNG named ``.JPEG``) is
  decoded by its content.

Files that cannot be decoded raise :class:`BadImage` with a short reason code (see ``BAD_REASONS``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import ExifTags, Image, ImageFile, ImageOps, UnidentifiedImageError

from vitrain.config import DataConfig

DEFAULT_MAX_IMAGE_PIXELS: int = DataConfig.model_fields["max_image_pixels"].default
"""Pillow's own refusal limit (it warns beyond 89,478,485 pixels and raises beyond twice that)."""

BAD_REASONS = {
    "empty": "the file has 0 bytes",
    "not_an_image": "Pillow recognizes no image format in it (text, HTML, another file type)",
    "truncated": "the image data ends early (an interrupted download or copy)",
    "decompression_bomb": "more pixels than data.max_image_pixels",
    "unreadable": "anything else: a corrupt header or data stream, an unsupported mode, an I/O error",
}
"""Why a file is bad, by reason code."""

ODD_NOTES = {
    "cmyk": "CMYK, converted to RGB",
    "grayscale": "grayscale (L or 1), channel repeated to RGB",
    "transparency": "alpha channel or transparent palette colour, composited on white",
    "palette": "palette (P), converted through its palette",
    "16bit": "16 bits per sample, scaled to 8",
    "exif_rotated": "EXIF orientation other than 1, applied",
    "png_named_jpeg": "a PNG named .jpg/.jpeg (decoded as PNG)",
    "wrong_extension": "another format than the file name says (decoded by content)",
    "other_mode": "another Pillow mode (e.g. YCbCr, F), converted by Pillow",
}
"""What was done to a decodable but unusual file, by note code."""

# Composite transparent pixels on white: transparent images in photo datasets are mostly product
# shots and logos cut out to be shown on white web pages, so white is how they were meant to look
# (dropping alpha instead shows whatever colour the transparent pixels happen to store, often black).
ALPHA_BACKGROUND = (255, 255, 255)

_EXTENSION_FORMATS = {
    ".jpg": "JPEG",
    ".jpeg": "JPEG",
    ".png": "PNG",
    ".bmp": "BMP",
    ".webp": "WEBP",
    ".ppm": "PPM",
    ".tif": "TIFF",
    ".tiff": "TIFF",
}
# Leading bytes of the common formats: a file that starts like an image but that Pillow cannot
# identify is a damaged image (unreadable), not a foreign file (not_an_image).
_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"RIFF", b"II*\x00", b"MM\x00*")
_SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


class BadImage(Exception):
    """A file that cannot be decoded: ``reason`` is a code of ``BAD_REASONS``, ``detail`` says more."""

    def __init__(self, reason: str, detail: str):
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


@dataclasses.dataclass(frozen=True)
class DecodedImage:
    image: Image.Image
    """The pixels, mode RGB."""
    notes: tuple[str, ...]
    """Codes of ``ODD_NOTES`` for what was converted; empty for a plain RGB file."""
    format: str | None = None
    """The format Pillow found in the content (``JPEG``, ``PNG``, ...), whatever the file name says."""


@contextlib.contextmanager
def _pillow_limits(max_image_pixels: int) -> Iterator[None]:
    """Pillow's module-wide settings for one decode, restored afterwards: its bomb guard at our limit
    (our own check is exact; Pillow's warning between 1x and 2x its limit is ours to report), and
    truncated files refused (``LOAD_TRUNCATED_IMAGES`` would fill the missing rows with grey)."""
    saved = Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES
    Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = max_image_pixels, False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = saved


def _format_notes(image: Image.Image, path: Path) -> list[str]:
    expected = _EXTENSION_FORMATS.get(path.suffix.lower())
    if expected is None or expected == image.format:
        return []
    if expected == "JPEG" and image.format == "PNG":
        return ["png_named_jpeg"]
    return ["wrong_extension"]


def _apply_draft(image: Image.Image, draft_side: int | None) -> None:
    """JPEG only: decode at 1/2, 1/4 or 1/8 scale in the DCT when the short side stays >= draft_side."""
    if draft_side is None or image.format != "JPEG":
        return
    # draft keeps both sides >= the requested box, so ask for the short side scaled to the aspect
    # ratio: the short side stays >= draft_side
    width, height = image.size
    scale = draft_side / min(width, height)
    image.draft(image.mode, (math.ceil(width * scale), math.ceil(height * scale)))


def _apply_exif_orientation(image: Image.Image) -> bool:
    """Transpose in place by the EXIF orientation; True when it was other than 1."""
    try:
        orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
    except (OSError, SyntaxError, ValueError):  # a malformed EXIF block does not spoil the pixels
        return False
    if orientation not in range(2, 9):
        return False
    ImageOps.exif_transpose(image, in_place=True)
    return True


def _sixteen_bit_to_rgb(image: Image.Image) -> Image.Image:
    values = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
    eight_bit = ((values * 255 + 32767) // 65535).astype(np.uint8)  # 65535 -> 255, 32768 -> 128
    return Image.fromarray(eight_bit).convert("RGB")


def _composite_on_background(image: Image.Image) -> Image.Image:
    background = Image.new("RGBA", image.size, (*ALPHA_BACKGROUND, 255))
    return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")


def _to_rgb(image: Image.Image) -> tuple[Image.Image, list[str]]:
    """The image in mode RGB and the notes on its conversion."""
    mode = image.mode
    if mode == "RGB":
        return image, []
    if mode == "CMYK":
        return image.convert("RGB"), ["cmyk"]
    if mode in ("L", "1"):
        return image.convert("RGB"), ["grayscale"]
    if mode in _SIXTEEN_BIT_MODES:
        return _sixteen_bit_to_rgb(image), ["16bit"]
    if mode == "P":
        if "transparency" in image.info:
            return _composite_on_background(image), ["palette", "transparency"]
        return image.convert("RGB"), ["palette"]
    if mode in _ALPHA_MODES:
        notes = ["palette"] if mode == "PA" else ["grayscale"] if mode in ("LA", "La") else []
        return _composite_on_background(image), [*notes, "transparency"]
    return image.convert("RGB"), ["other_mode"]


def _classify_pillow_error(error: Exception, header: bytes) -> BadImage:
    if isinstance(error, Image.DecompressionBombError):
        return BadImage("decompression_bomb", str(error))
    if isinstance(error, UnidentifiedImageError):
        if header.startswith(_SIGNATURES):
            return BadImage("unreadable", "starts like an image but its header cannot be parsed (damaged or cut short)")
        return BadImage("not_an_image", f"no image format recognized (starts with {header[:8]!r})")
    if "truncated" in str(error).lower():
        return BadImage("truncated", str(error))
    return BadImage("unreadable", f"{type(error).__name__}: {error}")


def _open_and_convert(handle, path: Path, draft_side: int | None, max_image_pixels: int) -> DecodedImage:
    image = Image.open(handle)
    notes = _format_notes(image, path)
    width, height = image.size
    if width * height > max_image_pixels:
        raise BadImage(
            "decompression_bomb",
            f"{width}x{height} = {width * height} pixels > data.max_image_pixels={max_image_pixels}",
        )
    _apply_draft(image, draft_side)
    image.load()  # inside the try: a truncated file fails here
    if _apply_exif_orientation(image):
        notes.append("exif_rotated")
    rgb, mode_notes = _to_rgb(image)
    return DecodedImage(rgb, tuple(mode_notes + notes), image.format)


@contextlib.contextmanager
def _opened(source: str | Path | bytes | BinaryIO) -> Iterator[BinaryIO]:
    """A binary file object over a path (opened and closed here), bytes, or a caller's file object (left open)."""
    if isinstance(source, (str, Path)):
        with open(source, "rb") as handle:
            yield handle
    elif isinstance(source, (bytes, bytearray, memoryview)):
        yield io.BytesIO(source)
    else:
        yield source


def decode_image(
    source: str | Path | bytes | BinaryIO,
    draft_side: int | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    name: str | None = None,
) -> DecodedImage:
    """Decode an image file to RGB (conversions listed in ``ODD_NOTES``); raise :class:`BadImage` when it
    cannot be. ``source``: the file's path, its bytes (e.g. a sample of a tar shard) or a binary file object
    positioned at its start. ``name``: the file name the content came with, whose extension is checked
    against the content (default: the path's; bytes without a name skip that check). ``draft_side``: JPEGs
    may decode at a reduced scale keeping the short side >= it."""
    path = Path(name if name is not None else source if isinstance(source, (str, Path)) else "")
    header = b""
    try:
        # we own the file object, so Pillow does not close the loaded image with it: no copy needed
        with _opened(source) as handle:
            header = handle.read(16)
            if not header:
                raise BadImage("empty", "0 bytes")
            handle.seek(0)
            with _pillow_limits(max_image_pixels):
                return _open_and_convert(handle, path, draft_side, max_image_pixels)
    except BadImage:
        raise
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as error:
        # DecompressionBombError (a header over twice the limit, raised by Image.open) is no OSError
        raise _classify_pillow_error(error, header) from None
