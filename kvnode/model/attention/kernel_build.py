"""Building and finding the C++ paged-attention extension, without ever hanging a pod start.

`make install`, the Dockerfile and `pagekv build-kernels` build it ahead of time; a pod then
imports the finished `.so` directly (no compiler, no ninja, no lock: a fraction of a second).
Only when no finished build matches does a pod compile just in time.

- **Cache key.** Each build lives in its own directory named by a digest of everything that
  changes the binary: the source's bytes, torch's version and include paths (so two venvs
  never share one), the Python version, the compiler flags, `$CXX` and the CPU (a
  `-march=native` build must not load on another CPU). The source is copied into that
  directory, so two checkouts of the same source share one build instead of rebuilding
  each other's (torch's own versioner keys on the source *path*).
- **Locks.** Builders serialise on an `fcntl.flock` of `<dir>/.pagekv-build.flock`, which the
  kernel releases when its holder dies. Whoever holds it knows that a torch `lock` file left
  in the directory is stale (torch's `FileBaton` waits forever on one) and deletes it, with
  a log line. A process that waits for the flock says so every few seconds, and gives up
  after `PAGEKV_KERNEL_BUILD_TIMEOUT_S` (default 600) with the pure-torch path.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

EXTENSION_NAME = "pagekv_paged_attention"
SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"
READY_FILE = "pagekv-ready.json"
TIMEOUT_ENV = "PAGEKV_KERNEL_BUILD_TIMEOUT_S"
WAIT_LOG_EVERY_S = 5.0


def cpu_tag() -> str:
    """Identify the CPU so a -march=native build is never loaded on a different machine that
    shares the cache directory."""
    desc = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    desc += line
                if line.strip() == "":
                    break  # the first processor's entry is enough
    except OSError:
        pass
    return hashlib.sha256(desc.encode()).hexdigest()[:12]


def build_root() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pagekv" / "torch_extensions"


def build_key(flags: Sequence[str], source: bytes) -> str:
    """Digest of every input that changes the built binary (see the module docstring)."""
    from torch.utils.cpp_extension import include_paths

    parts = [
        hashlib.sha256(source).hexdigest(),
        torch.__version__,
        *include_paths(),
        platform.python_version(),
        sys.abiflags,
        *flags,
        os.environ.get("CXX", "c++"),
        cpu_tag(),
    ]
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


def build_dir_for(flags: Sequence[str], variant: str) -> Path:
    key = build_key(flags, SOURCE.read_bytes())
    return build_root() / f"{EXTENSION_NAME}-{variant}-{key}"


def import_built(build_dir: Path) -> ModuleType | None:
    """The finished extension in `build_dir`, imported straight from its `.so`, or None."""
    try:
        ready = json.loads((build_dir / READY_FILE).read_text())
        so = build_dir / ready["so"]
        spec = importlib.util.spec_from_file_location(ready["module"], so)
        if spec is None or spec.loader is None or not so.is_file():
            return None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    except (OSError, ValueError, KeyError, ImportError):
        return None


class BuildLock:
    """An exclusive flock on the build directory, released by the kernel if we die."""

    def __init__(self, build_dir: Path) -> None:
        self.path = build_dir / ".pagekv-build.flock"
        self._fd: int | None = None

    def acquire(self, timeout_s: float) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout_s
        next_log = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline:
                    os.close(fd)
                    return False
                if now >= next_log:
                    holder = _read_holder(fd)
                    logger.info("waiting for process %s, which is building the C++ kernel in "
                                "%s (%.0f s left before giving up)", holder or "?",
                                self.path.parent, deadline - now)
                    next_log = now + WAIT_LOG_EVERY_S
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def break_stale_torch_lock(build_dir: Path) -> bool:
    """Delete torch's `lock` file, which only a dead builder can have left: call this while
    holding the BuildLock."""
    stale = build_dir / "lock"
    if not stale.exists():
        return False
    logger.warning("removing a stale build lock %s left by a process that died while "
                   "compiling the C++ kernel", stale)
    stale.unlink(missing_ok=True)
    return True


def compile_into(build_dir: Path, flags: Sequence[str], variant: str,
                 smoke_check: Callable[[ModuleType], bool]) -> ModuleType:
    """Compile (or reuse) the extension in `build_dir`; mark it ready once it checks out.
    Raises on a compile error, a failed smoke check or a lock held past the timeout."""
    build_dir.mkdir(parents=True, exist_ok=True)
    timeout = float(os.environ.get(TIMEOUT_ENV, "600"))
    lock = BuildLock(build_dir)
    if not lock.acquire(timeout):
        raise TimeoutError(f"another process held the build lock in {build_dir} for over "
                           f"{timeout:.0f} s ({TIMEOUT_ENV})")
    try:
        ext = import_built(build_dir)  # someone finished it while we waited
        if ext is not None:
            return ext
        break_stale_torch_lock(build_dir)
        from torch.utils.cpp_extension import load

        source = build_dir / SOURCE.name
        shutil.copyfile(SOURCE, source)
        t0 = time.perf_counter()
        logger.info("compiling C++ paged attention (%s) into %s", " ".join(flags), build_dir)
        name = f"{EXTENSION_NAME}_{variant}"
        ext = load(name=name, sources=[str(source)], extra_cflags=list(flags),
                   extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
        if not smoke_check(ext):
            raise RuntimeError("smoke check gave wrong results")
        so = Path(ext.__file__)
        (build_dir / READY_FILE).write_text(json.dumps({"module": ext.__name__,
                                                         "so": so.name}))
        logger.info("compiled C++ paged attention in %.1f s", time.perf_counter() - t0)
        return ext
    finally:
        lock.release()
