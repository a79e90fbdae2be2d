"""Building and loading the kernels' C++ extension: compiler flags per vector ISA, torch's JIT
extension cache, and the fallback to PyTorch's ops (with one warning naming the cause) when the
extension cannot be built.

The sources beside this file are compiled on first use by torch's JIT extension loader for the host's
vector ISA (``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2 or plain C++) and cached by torch
under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), in a folder of their own per
ISA and install of torch (:func:`extension_name`); building needs a C++ compiler and ninja (a
dependency of the package, run from this Python's environment whether or not it is activated:
:func:`ninja_binary`). ``performance.cpu_kernels=fused`` makes a failed build an error.

Each new build is checked once, in a child process, for one thing a compile cannot show: that an error
raised in its C++ code reaches Python as a ``RuntimeError``. With a compiler whose unwind tables the
runtime's unwinder cannot walk, the first such error kills the process (seen once with a separately
installed g++ beside torch 2.11); a build that fails the check is not used, as one that does not compile.
The verdict is kept beside the library (``<library>.errors-ok``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch
from filelock import FileLock, Timeout

from vitrain import cpu_features

log = logging.getLogger("vitrain")

Mode = Literal["auto", "fused", "native"]
SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "module.cpp",
        "layer_norm.cpp",
        "gelu.cpp",
        "linear.cpp",
        "weight_gradient.cpp",
        "depthwise.cpp",
        "attention.cpp",
        "tiles.cpp",
    )
]
HEADERS = [Path(__file__).with_name(name) for name in ("kernels.h", "common.h", "tiles.h")]

_module: ModuleType | None = None
_failure: str | None = None
_lock = threading.Lock()


class KernelBuildError(RuntimeError):
    """``performance.cpu_kernels=fused`` but the extension could not be built or loaded."""


def _compile_flags(capability: str) -> list[str]:
    flags = ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability}"]
    if capability.startswith("AVX512"):  # what ATen's own AVX512 kernels are compiled with
        flags += ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
        flags += ["-mamx-tile", "-mamx-bf16"]  # the attention's AMX path, taken only where the CPU has AMX
    elif capability == "AVX2":
        flags += ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    return flags


def _capability() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    return "AVX512" if capability.startswith("AVX512") else capability  # AVX512 / AVX2 / DEFAULT


def extension_name() -> str:
    """The name torch's JIT loader builds and caches the extension under: one per vector ISA and per
    :func:`build_key`, so that two installs of torch (two virtual environments of one Python) never share
    a build folder. In one folder each would rebuild the other's build on its next load (minutes), and
    a torch older than 2.14 could find the newer one's lock file and wait on it."""
    return f"vitrain_cpu_kernels_{_capability().lower()}_{build_key()}"


def build_key() -> str:
    """Eight hex digits that change with whatever makes torch's loader rebuild a cached build: the torch
    release and install folder (its include and library paths), the kernels' folder, the compile flags,
    the compiler (``$CXX``) and ninja's release (a ninja of another log format takes every object file
    for out of date). The folders as written into ``build.ninja``, links not resolved."""
    parts = [
        torch.__version__,
        str(Path(torch.__file__).parent),
        str(SOURCES[0].parent),
        " ".join(_compile_flags(_capability())),
        os.environ.get("CXX", "c++"),
        ninja_version(ninja_binary()),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:8]


def ninja_binary() -> str | None:
    """The ninja that builds the kernels: the one the ``ninja`` package (a dependency of vitrain) put
    beside this Python, found also where its environment is not activated (``.venv/bin/vitrain``, whose
    folder is not on ``PATH``), else the first on ``PATH``; None when there is neither. torch's loader runs
    whichever ``ninja`` comes first on ``PATH``: one machine's system ninja and the environment's may differ
    in release, and each would take the other's build for out of date (minutes on 2 cores)."""
    try:
        import ninja
    except ImportError:
        ninja = None
    if ninja is not None and ninja.BIN_DIR:
        candidate = Path(ninja.BIN_DIR) / f"ninja{sysconfig.get_config_var('EXE') or ''}"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("ninja")


@functools.cache
def ninja_version(binary: str | None) -> str:
    """``ninja --version`` of ``binary`` (``none`` without one, ``unknown`` where it does not answer)."""
    if binary is None:
        return "none"
    try:
        answer = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return answer.stdout.strip() or "unknown"


@contextlib.contextmanager
def _ninja_first_on_path():
    """``PATH`` for torch's loader, which runs ``ninja`` by name: a folder holding only a link to
    :func:`ninja_binary` goes first where ``PATH`` would find another ninja or none (nothing else this
    environment's folder holds, such as its own compilers, is put before the user's ``PATH``)."""
    binary, before = ninja_binary(), os.environ.get("PATH")
    if binary is None or shutil.which("ninja") == binary:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="vitrain-ninja-") as folder:
        (Path(folder) / Path(binary).name).symlink_to(binary)
        os.environ["PATH"] = os.pathsep.join(filter(None, [folder, before]))
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("PATH", None)
            else:
                os.environ["PATH"] = before


def build_folder() -> Path:
    """The extension's folder in torch's cache, by torch's own rule: ``$TORCH_EXTENSIONS_DIR/<name>``, or a
    per-Python, per-CUDA folder in its default root."""
    return Path(_cpp_extension()._get_build_directory(extension_name(), verbose=False))


def cached_build() -> Path | None:
    """The shared library of a previous build in torch's extension cache, or None: whether
    :func:`load` would load rather than compile (it still rebuilds when the sources changed)."""
    folder = build_folder()
    libraries = sorted(folder.glob(f"{extension_name()}*.so"), key=lambda path: path.stat().st_mtime)
    return libraries[-1] if libraries else None


CacheState = Literal["missing", "locked", "stale", "fresh"]


def lock_kind() -> Literal["advisory", "file"]:
    """How torch's extension loader locks a build folder: ``advisory`` (torch >= 2.14: an OS lock on the
    ``lock`` file, released when its holder ends, the file itself left behind) or ``file`` (the file's
    existence is the lock: a killed build leaves it, and every later load waits for it forever)."""
    return "advisory" if hasattr(_cpp_extension(), "FileLock") else "file"


def lock_held(lock: Path) -> bool:
    """Whether loading would wait on torch's ``lock`` of a build folder (see :func:`lock_kind`)."""
    if not lock.exists():
        return False
    if lock_kind() == "file":
        return True
    try:
        with FileLock(lock, timeout=0):  # the lock class torch's own wraps
            return False
    except Timeout:
        return True  # another process builds now
    except (OSError, NotImplementedError):
        return True  # not ours to lock, or no OS locks here: the file's existence is all there is


LOCK_IDLE_S = 600.0
"""How long a build folder may stay untouched, its lock file still there, before the lock is taken for a
killed build's leftover (a build writes an object file every minute or so on 2 cores)."""


def wait_for_lock_file(folder: Path, idle_s: float = LOCK_IDLE_S, poll_s: float = 1.0) -> None:
    """Where torch's loader takes the existence of ``folder/lock`` as its lock (:func:`lock_kind` ``file``) it
    waits for the file forever, and a killed build leaves it behind. Wait here instead while a build is
    visibly under way (something in ``folder`` changed within ``idle_s``), and raise ``RuntimeError``, naming
    the file to delete, once the folder has stayed untouched that long. Returns at once with torch's OS lock."""
    lock = folder / "lock"
    if lock_kind() != "file":
        return
    waiting = False
    while lock.exists():
        idle = time.time() - _last_change(folder)
        if idle >= idle_s:
            raise RuntimeError(
                f"torch's build lock {lock} is a leftover (nothing in its folder changed for {idle:.0f} s: a killed "
                "build, or a newer torch, which leaves the file behind): delete it, or set performance.cpu_kernels=native"
            )
        if not waiting:
            log.info("fused CPU kernels: waiting for the build that holds %s", lock)
            waiting = True
        time.sleep(poll_s)


def _last_change(folder: Path) -> float:
    """The newest modification time in ``folder`` (0 when it is empty or gone)."""
    times = []
    for path in folder.glob("*"):
        with contextlib.suppress(OSError):  # removed meanwhile
            times.append(path.stat().st_mtime)
    return max(times, default=0.0)


def cache_state() -> tuple[CacheState, Path | None]:
    """What :func:`load` would find in torch's cache, without loading: ``missing`` (it compiles, minutes),
    ``locked`` (torch's build lock is held: a build is under way, or with torch's older lock file a killed
    build left it and every load waits for it forever; :func:`lock_held`), ``stale`` (a build older than
    the sources or of other sources: it recompiles) or ``fresh`` (it loads). Returns the state and the
    library (or lock) path."""
    library = cached_build()
    if library is None:
        return "missing", None
    lock = library.parent / "lock"
    if lock_held(lock):
        return "locked", lock
    ninja_file = library.parent / "build.ninja"
    built_from_these = ninja_file.is_file() and str(SOURCES[0]) in ninja_file.read_text()
    newest_source = max(path.stat().st_mtime for path in SOURCES + HEADERS if path.is_file())
    if not built_from_these or library.stat().st_mtime < newest_source:
        return "stale", library
    return "fresh", library


def failure() -> str | None:
    """Why :func:`load` could not build or load the extension; None before a failure."""
    return _failure


def _cpp_extension() -> ModuleType:
    # importing cpp_extension warns that no CUDA runtime was found: irrelevant to a CPU extension
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        quiet.setLevel(level)
    return cpp_extension


def _build() -> ModuleType:
    """The extension, compiled or loaded from torch's cache, after its error-path check."""
    wait_for_lock_file(build_folder())
    module = _load_extension()
    check_error_path(Path(module.__file__))
    return module


ERROR_CHECK_MESSAGE = "vitrain kernels: error-path check"
ERROR_PATH_FAILURE = "the built kernels cannot raise an error"
"""How :func:`failure` begins its reason when a build failed the error-path check (the doctor reads it)."""
_ERROR_CHECK = f"""
import sys
from vitrain.kernels import build
try:
    build._load_extension().raise_error({ERROR_CHECK_MESSAGE!r})
except RuntimeError as error:
    sys.exit(0 if {ERROR_CHECK_MESSAGE!r} in str(error) else 3)
sys.exit(4)
"""


def error_check_command() -> list[str]:
    """The child process of :func:`check_error_path`: loads the built extension and makes it raise."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # not the working folder's modules
    return [sys.executable, *safe_path, "-c", _ERROR_CHECK]


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return {3: "raised an error without the message", 4: "raised nothing"}.get(returncode, f"exited {returncode}")


def check_error_path(library: Path) -> None:
    """Raise ``RuntimeError`` when an error raised in ``library``'s C++ code kills a child process instead of
    reaching Python. A passed check is kept in ``<library>.errors-ok`` (the library's mtime), so it runs once
    per build, one process at a time (the ranks of a run build and check alike); a check that could not run
    at all (the child failed before making the kernels raise) is a warning, and the kernels are used."""
    marker = library.with_name(library.name + ".errors-ok")
    stamp = str(library.stat().st_mtime_ns)
    if _read_marker(marker) == stamp:
        return
    with _exclusive(marker.with_name(marker.name + ".lock")):
        if _read_marker(marker) == stamp:  # another process checked it meanwhile
            return
        try:
            result = subprocess.run(
                error_check_command(), env=_child_env(), capture_output=True, text=True, timeout=300
            )
        except subprocess.TimeoutExpired:
            log.warning("fused CPU kernels: their error-path check did not finish in 300 s; using them unchecked")
            return
        if result.returncode < 0 or result.returncode in (3, 4):
            raise RuntimeError(
                f"{ERROR_PATH_FAILURE}: a process that made them raise one "
                f"{_describe_exit(result.returncode)} ({library}); build them with the compiler torch was built "
                "with (e.g. CXX=/usr/bin/g++, which builds into a folder of its own) or set performance.cpu_kernels=native"
            )
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            log.warning("fused CPU kernels: their error-path check could not run (%s); using them unchecked", last)
            return
        _write_marker(marker, stamp)


def _read_marker(marker: Path) -> str | None:
    try:
        return marker.read_text()
    except OSError:
        return None  # not checked yet


def _write_marker(marker: Path, stamp: str) -> None:
    from vitrain.io import write_file_atomic

    try:
        write_file_atomic(marker, stamp.encode())
    except OSError as error:  # a read-only cache costs a check per process, not the kernels
        log.debug("could not record the kernels' error-path check in %s: %s", marker, error)


@contextlib.contextmanager
def _exclusive(path: Path):
    """An OS lock on ``path`` for the block (released when the process ends, even killed); none where the
    folder is read-only or the file system cannot lock (checks may then run side by side)."""
    lock = FileLock(path)
    try:
        lock.acquire()
    except (OSError, NotImplementedError):
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _child_env() -> dict[str, str]:
    """The environment of the check's child: this vitrain importable (a source tree run by path, not
    installed), nothing else changed."""
    import vitrain

    root = str(Path(vitrain.__file__).resolve().parents[1])
    if root in sys.path:
        return dict(os.environ)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def _load_extension() -> ModuleType:
    cpp_extension = _cpp_extension()
    missing = [path.name for path in SOURCES + HEADERS if not path.is_file()]
    if missing:  # an install that left them out; the compiler's own message would not say so
        raise FileNotFoundError(
            f"kernel sources missing from {Path(__file__).parent}: {', '.join(missing)}; reinstall vitrain"
        )
    capability = _capability()
    with _ninja_first_on_path():
        return cpp_extension.load(
            name=extension_name(),
            sources=[str(source) for source in SOURCES],
            extra_cflags=_compile_flags(capability),
            extra_ldflags=["-fopenmp"],
            verbose=os.environ.get("VITRAIN_KERNELS_VERBOSE") == "1",
        )


def load() -> ModuleType | None:
    """The compiled extension (built on the first call), or None when it cannot be built."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is None and _failure is None:
            try:
                _module = _build()
            except Exception as error:  # noqa: BLE001 - any build failure falls back to native ops
                _failure = (
                    f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
                )
                log.warning("fused CPU kernels unavailable, using PyTorch's ops (%s)", _failure)
    return _module


@dataclasses.dataclass(frozen=True)
class Paths:
    """The fused paths this process takes beyond the kernels' portable C++, decided once by
    :func:`paths` from what this CPU and this build of torch support; where one is not taken,
    PyTorch's ops (or the kernels' portable path) run instead."""

    bias_in_product: bool
    """Linear layers add the bias inside oneDNN's bf16 product (``cpu_features.onednn_bf16_linear``)."""
    amx_tiles: bool
    """Attention and weight gradients on AMX tiles: the CPU has AMX-BF16, the kernels were built with
    it, and this process may use them (:func:`use_amx_tiles`, else ``VITRAIN_AMX``)."""


_paths: Paths | None = None


def paths() -> Paths:
    """:class:`Paths` for this process, decided on the first call (the extension is built first if it
    is not yet); a plain global rather than ``functools.cache`` so that ``torch.compile`` reads it."""
    global _paths
    if _paths is None:
        _paths = _decide_paths()
    return _paths


def reset_paths() -> None:
    """Decide :func:`paths` again on the next call (tests that patch what the CPU supports)."""
    global _paths
    _paths = None


def use_amx_tiles(allowed: bool | None) -> None:
    """Whether this process may run the AMX tile kernels from now on (a run's ``RuntimePlan.amx_tiles``;
    None: as ``VITRAIN_AMX`` says): :func:`vitrain.cpu_features.allow_amx_tiles`, and :func:`paths`
    decided again with it."""
    cpu_features.allow_amx_tiles(allowed)
    reset_paths()


def _decide_paths() -> Paths:
    module = load()
    chosen = Paths(
        bias_in_product=cpu_features.onednn_bf16_linear(),
        amx_tiles=module is not None and cpu_features.amx_allowed() and bool(module.amx_available()),
    )
    if module is not None:
        log.debug(
            "fused CPU kernels: bias inside oneDNN's bf16 product %s, AMX tiles %s",
            "yes" if chosen.bias_in_product else "no (PyTorch's F.linear)",
            "yes" if chosen.amx_tiles else "no (feature-major copies, explicit or SDPA attention)",
        )
    return chosen


def extension() -> ModuleType | None:
    """The loaded extension, without building it: None until :func:`load` succeeded. What the ops
    check on every call (cheap, and traceable by ``torch.compile``)."""
    return _module


def wanted(device: str, precision: str, mode: Mode) -> bool:
    """Whether a run on ``device`` in ``precision`` converts its model to the kernels, by ``mode`` (the plan's
    ``RuntimePlan.cpu_kernels``): bf16 on CPU and ``auto`` or ``fused``; ``auto`` also needs the extension to
    build (or load from torch's cache), ``fused`` fails with :class:`KernelBuildError` where it cannot."""
    if mode not in ("auto", "fused", "native"):
        raise ValueError(f"cpu kernels mode must be auto, fused or native, not {mode!r}")
    if device != "cpu" or precision != "bf16" or mode == "native":
        return False
    if load() is not None:
        return True
    if mode == "fused":
        raise KernelBuildError(
            f"performance.cpu_kernels=fused, but the fused CPU kernels could not be built: {_failure}. "
            "Install a C++ compiler (g++) and ninja, or set performance.cpu_kernels=auto to fall back to "
            "PyTorch's ops."
        )
    return False
