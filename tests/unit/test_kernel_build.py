"""The C++ kernel's build cache: keyed by what changes the binary, prebuilt builds imported
without a compiler, stale locks broken, a held lock never a hang."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagekv.kvnode.model.attention import cpu_kernel, kernel_build

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("-O3", "-fopenmp")


def test_key_covers_source_flags_torch_includes_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    src = b"int f() { return 1; }"
    base = kernel_build.build_key(FLAGS, src)
    assert kernel_build.build_key(FLAGS, src) == base  # stable, and blind to the source path
    assert kernel_build.build_key(FLAGS, src + b" ") != base
    assert kernel_build.build_key(("-O2", "-fopenmp"), src) != base
    import torch.utils.cpp_extension as ext

    real = ext.include_paths
    monkeypatch.setattr(ext, "include_paths", lambda *a, **k: [*real(), "/other/venv"])
    assert kernel_build.build_key(FLAGS, src) != base  # another venv: another build
    monkeypatch.setattr(ext, "include_paths", real)
    monkeypatch.setattr(kernel_build.torch, "__version__", "9.9.9")
    assert kernel_build.build_key(FLAGS, src) != base
    monkeypatch.undo()
    monkeypatch.setattr(kernel_build, "cpu_tag", lambda: "another-cpu")
    assert kernel_build.build_key(FLAGS, src) != base
    monkeypatch.setenv("CXX", "clang++")
    assert kernel_build.build_key(FLAGS, src) != base


@pytest.fixture
def built() -> Path:
    """The real extension's build directory (compiled once per machine, then reused)."""
    if not cpu_kernel.available():
        pytest.skip("no C++ toolchain here: the kernel cannot be built")
    return Path(cpu_kernel._ext.__file__).parent


def test_prebuilt_kernel_loads_without_jit_or_compiler(built: Path) -> None:
    """A fresh process with JIT off and no compiler on PATH imports the finished build."""
    env = {**os.environ, "PAGEKV_KERNEL_JIT": "0", "PATH": "/nonexistent"}
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO)\n"
            "from kvnode.model.attention import cpu_kernel\n"
            "sys.exit(0 if cpu_kernel.available() else 3)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "loaded prebuilt C++ paged attention" in r.stderr
    assert "compiling" not in r.stderr


def test_no_build_and_no_jit_is_the_torch_path_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert cpu_kernel._build(jit=False) is None
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(msgs) == 1 and "pagekv build-kernels" in msgs[0]


def _fake_load(ext, seen: list):
    """Stands in for torch's compile: records whether torch's lock file was still there."""
    def load(name: str, sources: list[str], build_directory: str, **kwargs):
        seen.append(Path(build_directory, "lock").exists())
        return ext
    return load


def test_stale_torch_lock_is_broken_with_a_log_line(
        built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A builder killed mid-compile leaves torch's `lock` behind; torch would wait on it
    forever. The next builder, holding our flock, knows it is stale and removes it."""
    import torch.utils.cpp_extension as ext

    build_dir = tmp_path / "b"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")
    seen: list[bool] = []
    monkeypatch.setattr(ext, "load", _fake_load(cpu_kernel._ext, seen))
    with caplog.at_level(logging.WARNING, logger=kernel_build.__name__):
        got = kernel_build.compile_into(build_dir, FLAGS, "generic", lambda m: True)
    assert got is cpu_kernel._ext and seen == [False]
    assert any("stale build lock" in r.getMessage() for r in caplog.records)
    ready = json.loads((build_dir / kernel_build.READY_FILE).read_text())
    assert ready["so"] == Path(cpu_kernel._ext.__file__).name


def test_a_held_lock_times_out_with_progress_lines_and_dies_with_its_holder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    build_dir = tmp_path / "b"
    build_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({str(build_dir / '.pagekv-build.flock')!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode())\n"
         "print('held', flush=True); time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv(kernel_build.TIMEOUT_ENV, "1")
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger=kernel_build.__name__), \
                pytest.raises(TimeoutError, match="build lock"):
            kernel_build.compile_into(build_dir, FLAGS, "generic", lambda m: True)
        assert time.monotonic() - t0 < 30
        assert any(f"waiting for process {holder.pid}" in r.getMessage()
                   for r in caplog.records)
    finally:
        holder.kill()
        holder.wait()
    # The kernel released the dead holder's lock: it is ours at once.
    lock = kernel_build.BuildLock(build_dir)
    assert lock.acquire(timeout_s=5)
    lock.release()
