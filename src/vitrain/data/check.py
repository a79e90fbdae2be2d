"""``vitrain check-data``: decode every image file of a dataset folder, in parallel, and report.

Each file goes through :func:`vitrain.data.decode.decode_image` at full size, exactly as the
loader would decode it, so the report says what training will do with it: use it as is, use it
converted (the notes of ``ODD_NOTES``), or skip it (the reasons of ``BAD_REASONS``).
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from vitrain.config import ConfigError
from vitrain.data.decode import BAD_REASONS, DEFAULT_MAX_IMAGE_PIXELS, ODD_NOTES, BadImage, decode_image
from vitrain.data.sources import IMAGE_EXTENSIONS

SPLIT_NAMES = ("train", "val")
NUM_EXAMPLES = 3
"""Example paths kept per note and per reason."""


@dataclasses.dataclass
class CheckReport:
    """What ``check_image_folder`` found. Paths in examples are relative to ``root``."""

    root: str
    files_per_split: dict[str, int]
    num_ok: int = 0
    """Files that decode (odd ones included)."""
    num_plain: int = 0
    """Files that decode with no conversion (RGB, named by their format, upright)."""
    num_ignored: int = 0
    """Files inside class folders whose extension is not an image's (the loader ignores them too)."""
    odd: dict[str, int] = dataclasses.field(default_factory=dict)
    """Decodable files by conversion note (a file may carry several)."""
    bad: dict[str, int] = dataclasses.field(default_factory=dict)
    """Files that do not decode, by reason."""
    examples: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """Up to NUM_EXAMPLES paths per note or reason (bad ones with the detail)."""

    @property
    def num_files(self) -> int:
        return sum(self.files_per_split.values())

    @property
    def num_bad(self) -> int:
        return sum(self.bad.values())

    @property
    def num_odd_files(self) -> int:
        return self.num_ok - self.num_plain

    def to_dict(self) -> dict:
        return {
            "root": self.root,
            "num_files": self.num_files,
            "files_per_split": self.files_per_split,
            "num_ok": self.num_ok,
            "num_odd": self.num_odd_files,
            "num_bad": self.num_bad,
            "num_ignored": self.num_ignored,
            "odd": self.odd,
            "bad": self.bad,
            "examples": self.examples,
        }


def _class_folders(folder: Path) -> list[Path]:
    return sorted(entry for entry in folder.iterdir() if entry.is_dir())


def find_splits(root: Path) -> dict[str, Path]:
    """``{split name: folder}``: train/ and val/ of an ImageNet-layout root, or the root itself when it
    is one split (a folder of class folders). ConfigError when it is neither."""
    if not root.is_dir():
        raise ConfigError(
            f"check-data: {root} is not a folder; give a dataset root holding train/<class>/* and val/<class>/* "
            "(or one split folder of class folders)"
        )
    splits = {name: root / name for name in SPLIT_NAMES if (root / name).is_dir()}
    if splits:
        return splits
    if _class_folders(root):
        return {root.resolve().name: root}
    raise ConfigError(
        f"check-data: {root} holds neither train/ nor val/ nor class folders; give the dataset root "
        "(train/<class>/*, val/<class>/*) or one split folder (<class>/*)"
    )


def list_files(split_folder: Path) -> tuple[list[Path], int]:
    """Image files under the class folders of a split, sorted (as the loader lists them), and the number
    of other files there."""
    images, ignored = [], 0
    for class_folder in _class_folders(split_folder):
        for path in sorted(class_folder.rglob("*")):
            if not path.is_file():
                continue
            if path.suffix.lower() in IMAGE_EXTENSIONS:
                images.append(path)
            else:
                ignored += 1
    return images, ignored


def check_file(path: Path, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[tuple[str, ...], str | None, str]:
    """``(notes, bad reason or None, detail)`` of one file, decoded at full size."""
    try:
        return decode_image(path, None, max_image_pixels).notes, None, ""
    except BadImage as error:
        return (), error.reason, error.detail


def _check_all(paths: list[Path], workers: int, max_image_pixels: int) -> list[tuple[tuple[str, ...], str | None, str]]:
    if workers <= 1 or len(paths) < 2:
        return [check_file(path, max_image_pixels) for path in paths]
    chunk = max(1, min(256, len(paths) // (4 * workers)))  # big enough to amortize the pickling
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(check_file, paths, [max_image_pixels] * len(paths), chunksize=chunk))


def _add_example(report: CheckReport, key: str, text: str) -> None:
    shown = report.examples.setdefault(key, [])
    if len(shown) < NUM_EXAMPLES:
        shown.append(text)


def check_image_folder(
    root: str | Path, workers: int | None = None, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> CheckReport:
    """Decode every image file of ``root`` (see ``find_splits``) in ``workers`` processes (default: one
    per CPU core; 0 or 1: in this process) and count what was found."""
    root = Path(root)
    splits = find_splits(root)
    paths, files_per_split, ignored = [], {}, 0
    for name, folder in splits.items():
        split_paths, split_ignored = list_files(folder)
        paths += split_paths
        files_per_split[name] = len(split_paths)
        ignored += split_ignored
    if not paths:
        raise ConfigError(
            f"check-data: no image files under {root} (extensions {', '.join(IMAGE_EXTENSIONS)}); "
            "is it the dataset root?"
        )
    workers = (os.cpu_count() or 1) if workers is None else workers
    report = CheckReport(root=str(root), files_per_split=files_per_split, num_ignored=ignored)
    for path, (notes, reason, detail) in zip(paths, _check_all(paths, workers, max_image_pixels), strict=True):
        shown = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        if reason is not None:
            report.bad[reason] = report.bad.get(reason, 0) + 1
            _add_example(report, reason, f"{shown} ({detail})")
            continue
        report.num_ok += 1
        report.num_plain += not notes
        for note in notes:
            report.odd[note] = report.odd.get(note, 0) + 1
            _add_example(report, note, shown)
    report.odd, report.bad = dict(sorted(report.odd.items())), dict(sorted(report.bad.items()))
    return report


def format_report(report: CheckReport) -> str:
    """The report as console text: totals, then one line per note and per reason with examples."""
    splits = ", ".join(f"{name} {count}" for name, count in report.files_per_split.items())
    lines = [f"{report.root}: {report.num_files} image files ({splits})"]
    if report.num_ignored:
        lines.append(
            f"  other files ignored: {report.num_ignored} (not an image extension; the loader ignores them too)"
        )
    lines.append(f"  ok   {report.num_ok:7d}  decode ({report.num_odd_files} of them converted, below)")
    for note, count in report.odd.items():
        lines.append(f"  odd  {count:7d}  {note}: {ODD_NOTES[note]}; e.g. {', '.join(report.examples[note])}")
    lines.append(f"  bad  {report.num_bad:7d}  cannot be decoded" + (", below" if report.num_bad else ""))
    for reason, count in report.bad.items():
        lines.append(f"  bad  {count:7d}  {reason}: {BAD_REASONS[reason]}")
        lines.extend(f"                 {example}" for example in report.examples[reason])
    if report.num_bad:
        lines.append(
            f"{report.num_bad} bad files ({100 * report.num_bad / report.num_files:.2f}%): training replaces them and "
            "evaluation leaves them out, until they pass data.max_bad_fraction (default 0.01) of a split; "
            "repair or remove them"
        )
    return "\n".join(lines)
