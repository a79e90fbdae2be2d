"""vitrain: train vision transformers from scratch, fast, and say honestly what the hardware does."""

import importlib.metadata as _metadata
import re as _re

__version__ = "0.1.0"

MIN_TORCH = (2, 8)
"""The oldest torch vitrain runs on: its FSDP2, distributed checkpoints and compiled paths need it
(``pyproject.toml`` requires the same; an older one stops ``import vitrain`` with the fix)."""


def torch_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string (``2.11.0+cu130``, NGC's ``2.8.0a0+…``); None if unreadable."""
    match = _re.match(r"(\d+)\.(\d+)", version)
    return None if match is None else (int(match[1]), int(match[2]))


def torch_at_least(version: str, floor: tuple[int, int]) -> bool:
    """Whether torch ``version`` is release ``floor`` (major, minor) or newer, its pre-releases included;
    an unreadable version is let through."""
    release = torch_release(version)
    return release is None or release >= floor


def torch_version_problem(version: str) -> str | None:
    """Why torch ``version`` cannot run vitrain, with the fix; None when it can (pre-releases of a
    supported version, such as NGC's ``2.8.0a0+…``, included)."""
    if torch_at_least(version, MIN_TORCH):
        return None
    floor = ".".join(map(str, MIN_TORCH))
    return (
        f"vitrain needs torch >= {floor}, and this environment has torch {version}: "
        f"pip install 'torch>={floor}' with the torchvision built for it"
    )


def _check_torch() -> None:
    """Read the installed torch's version without importing it (``import vitrain`` stays light)."""
    try:
        version = _metadata.version("torch")
    except _metadata.PackageNotFoundError:  # a source build on the path: nothing to read, torch decides
        return
    problem = torch_version_problem(version)
    if problem is not None:
        raise ImportError(problem)


_check_torch()
