"""Files that are whole or absent: atomic writes (temporary name, fsync, rename, fsync the folder) and
safe reads of torch and safetensors files, where every decoding failure is one :class:`CheckpointError`
naming the file, why and what to do. Checkpoints, metrics sinks, the kernels' build marker, the measured
choices' cache and the weight sources all read and write through here."""

from __future__ import annotations

import os
import pickle
import struct
import tarfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint or weights file could not be written or read; the message says which file, why and the fix."""


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds the old or the new content, never a part."""
    path = Path(path)
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _unpickling_reason(error: pickle.UnpicklingError) -> str:
    """The line of torch's refusal that names the object, without its advice to load unsafely."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    marker = "WeightsUnpickler error:"
    detail = next((line.split(marker, 1)[1].strip() for line in lines if marker in line), None)
    if detail is not None:
        return (detail.split(". ")[0] or "an empty error")[:300].rstrip(".")  # not its advice to allowlist
    details = [line for line in lines if not line.startswith(("Weights only load failed", "Check the documentation"))]
    return (details or lines or ["unsupported object"])[0][:300].rstrip(".")


# --- reading weight files: every decoding failure one CheckpointError naming the file and a fix ----------

TORCH_FILE_ERRORS = (
    pickle.UnpicklingError,
    RuntimeError,
    EOFError,
    OSError,
    KeyError,
    ValueError,  # UnicodeDecodeError included
    IndexError,
    TypeError,
    AssertionError,
    OverflowError,
    struct.error,
    zipfile.BadZipFile,
)
"""What ``torch.load(weights_only=True)`` raises on bytes it cannot decode: a cut-off or damaged zip
(RuntimeError, OSError), a legacy pickle stream cut off or corrupt (EOFError, KeyError, IndexError,
ValueError, struct.error, UnpicklingError, ...), storages that do not match their records
(AssertionError, TypeError)."""

CHECKPOINT_FIX = "use an intact copy or another checkpoint of the run"
CHECKPOINT_EXPECTED = "a step-*.pt file that vitrain wrote"

_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGICS = tuple(
    pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=protocol) for protocol in range(pickle.HIGHEST_PROTOCOL + 1)
)
"""How the files of torch's pre-1.6 format begin: its magic number, pickled at some protocol."""


def error_summary(error: BaseException) -> str:
    """``Type: first sentence`` of an error, short (torch appends paragraphs of advice to some)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text.split(". ")[0].rstrip(".")[:200]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _os_problem(what: str, path: Path, error: OSError, fix: str) -> str:
    reason = error.strerror or str(error)
    if isinstance(error, PermissionError):
        return f"{what} {path} cannot be read: {reason}; make it readable for this user (chmod u+r), or {fix}"
    return f"{what} {path} cannot be read: {reason}; check the file and its disk, or {fix}"


def check_readable_file(path: Path, what: str, fix: str, expected: str | None = None) -> int:
    """The size of ``path``, a readable non-empty file; else CheckpointError ``<what> <path> <why>; <fix>``
    (a folder, no permission, an I/O error, 0 bytes). ``fix``: what to do about a damaged file;
    ``expected``: what the path should name, for a folder in its place (None: ``fix`` again)."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"{what} {path} is a folder, not a file; {fix if expected is None else f'check the path: give {expected}'}"
        )
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            handle.read(1)
    except OSError as error:
        raise CheckpointError(_os_problem(what, path, error, fix)) from None
    if size == 0:
        raise CheckpointError(f"{what} {path} is empty (0 bytes: a save or copy that was cut off); {fix}")
    return size


def _torch_format(path: Path) -> str | None:
    """``zip`` (torch.save since 1.6), ``legacy`` (the older pickle stream or tar), or None: not a torch file."""
    with open(path, "rb") as handle:
        head = handle.read(64)
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if head.startswith(_LEGACY_MAGICS) or tarfile.is_tarfile(path):
        return "legacy"
    return None


def _looks_like_text(path: Path) -> bool:
    with open(path, "rb") as handle:
        text = handle.read(512).decode("utf-8", errors="replace")[:-1]  # the last may be a cut character
    return all(character.isprintable() or character.isspace() for character in text) and "\ufffd" not in text


def _zip_problem(path: Path) -> str | None:
    """Why a zip file is not torch.save's (its members), or None when it might be (or is cut off)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None  # a cut-off archive: torch's reason says that
    if any(name.endswith("/data.pkl") for name in names):
        return None
    listed = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "") if names else "nothing"
    return f"a zip archive of {listed}, not one torch.save wrote"


def read_torch_file(
    path: Path, what: str = "checkpoint", fix: str = CHECKPOINT_FIX, expected: str = CHECKPOINT_EXPECTED
) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; a file that is not there as a readable file, is not
    a torch file, is cut off or damaged, or needs arbitrary unpickling is a CheckpointError
    ``<what> <path> <why>; <fix>`` (``expected``: what the path should name, for a file of another kind)."""
    path = Path(path)
    check_readable_file(path, what, fix, expected)
    try:
        kind = _torch_format(path)
    except OSError as error:
        raise CheckpointError(_os_problem(what, path, error, fix)) from None
    if kind is None:
        content = "a text file" if _looks_like_text(path) else "its bytes are neither a zip nor a pickle of torch's"
        raise CheckpointError(f"{what} {path} is not a PyTorch file ({content}); check the path: give {expected}")
    try:
        with warnings.catch_warnings():  # a damaged stream's odd pickle protocol: the error below says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = _unpickling_reason(error)
        if "global" not in reason.lower():  # not a refused object: bytes that do not decode
            raise CheckpointError(
                f"{what} {path} cannot be read: it is truncated or damaged ({reason}); {fix}"
            ) from None
        raise CheckpointError(
            f"{what} {path} holds objects that need arbitrary unpickling, which vitrain refuses "
            f"(weights_only=True, no fallback: unpickling can run any code): {reason}; "
            "use a checkpoint written by vitrain, or save trusted weights as a plain state dict of tensors"
        ) from None
    except TORCH_FILE_ERRORS as error:
        wrong_zip = _zip_problem(path) if kind == "zip" else None
        if wrong_zip is not None:
            raise CheckpointError(f"{what} {path} is {wrong_zip}; check the path: give {expected}") from None
        raise CheckpointError(
            f"{what} {path} cannot be read: it is truncated or damaged ({error_summary(error)}); {fix}"
        ) from None


SAFETENSORS_FIX = "export it again (vitrain export) or copy it again"


def read_safetensors(path: Path, what: str = "safetensors file", fix: str = SAFETENSORS_FIX):
    """(tensors, metadata) of a ``.safetensors`` file; whatever keeps it from being read (a folder, no
    permission, 0 bytes, a header whose length, JSON or tensor offsets do not fit the file) is a
    CheckpointError ``<what> <path> <why>; <fix>``."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{what} {path} does not exist; check the path")
    check_readable_file(path, what, fix, "a .safetensors file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            names = handle.keys()  # a safetensors handle is no mapping
            tensors = {name: handle.get_tensor(name) for name in names}
    except (SafetensorError, OSError, ValueError) as error:
        reason = str(error).removeprefix("Error while deserializing header: ")
        raise CheckpointError(
            f"{what} {path} cannot be read: it is truncated, damaged or not a safetensors file ({reason}); {fix}"
        ) from None
    return tensors, metadata
