"""Triton kernel tests: on a GPU they run compiled; without CUDA, under Triton's interpreter.

`triton.jit` reads ``TRITON_INTERPRET`` when it decorates a function: a kernel module's kernels
when that module is imported, and triton's own library functions (``tl.zeros``, ...) when
triton is. So the variable must be set before triton is first imported. pytest imports this
conftest before the test modules beside it, and setting the variable here covers them:

* the usual case, triton not imported yet: everything here runs in this process;
* a kernel module imported earlier (triton already interpreted): ``kernel_module`` re-executes
  it so that its kernels are interpreted too;
* triton itself imported earlier without the variable (by a test module collected before
  this directory, say): nothing can be re-decorated in this process, so this directory's
  tests run in one fresh pytest process with the variable set, and each test here reports
  that run's outcome (``pytest_pyfunc_call`` below).

Usage in a test module here::

    @pytest.fixture(scope="module")
    def prefill(kernel_module):
        return kernel_module("pagekv.kvnode.model.attention.triton_prefill")

and put tensors on ``triton_device`` ("cuda" or "cpu").
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

HERE = Path(__file__).resolve().parent
ON_GPU = torch.cuda.is_available()
# Triton imported before this conftest, with its functions decorated for the GPU.
TRITON_DECORATED_EARLY = (not ON_GPU and "triton" in sys.modules
                          and os.environ.get("TRITON_INTERPRET") != "1")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


def _has_compiled_kernels(mod: ModuleType) -> bool:
    """True if the module holds a kernel decorated for the GPU (before the interpreter was on)."""
    from triton.runtime.jit import JITFunction

    return any(isinstance(obj, JITFunction) for obj in vars(mod).values())


def import_kernel_module(name: str) -> ModuleType:
    mod = importlib.import_module(name)
    if not ON_GPU and not TRITON_DECORATED_EARLY and _has_compiled_kernels(mod):
        mod = importlib.reload(mod)
    return mod


@pytest.fixture(scope="session")
def kernel_module() -> Callable[[str], ModuleType]:
    """``kernel_module(dotted_name)`` -> the module, its kernels runnable on this machine."""
    return import_kernel_module


@pytest.fixture(scope="session")
def triton_device() -> str:
    return "cuda" if ON_GPU else "cpu"


# -- triton decorated too early: run this directory's tests in a fresh process -------------

_fresh_outcomes: dict[str, tuple[str, str]] | None = None  # nodeid -> (outcome, text)


def _run_fresh(session: pytest.Session) -> dict[str, tuple[str, str]]:
    """Every selected test of this directory in one new pytest process; their outcomes."""
    items = [i for i in session.items if HERE in Path(str(i.path)).resolve().parents]
    nodeids = [i.nodeid for i in items]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"--junitxml={report}", *nodeids],
            cwd=session.config.rootpath, env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True, text=True, timeout=1800,
        )
        cases = ET.parse(report).getroot().iter("testcase") if report.exists() else []
        by_name = {(c.get("classname"), c.get("name")): c for c in cases}
    outcomes = {}
    for nodeid in nodeids:
        path, _, name = nodeid.partition("::")
        case = by_name.get((path.removesuffix(".py").replace("/", "."), name))
        if case is None:
            outcomes[nodeid] = ("failed", "no result from the fresh pytest process")
            continue
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, text = "failed", child.text or child.get("message", "")
            elif child.tag == "skipped":
                outcome, text = "skipped", child.get("message", "")
        outcomes[nodeid] = (outcome, text)
    return outcomes


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    global _fresh_outcomes
    if not TRITON_DECORATED_EARLY:
        return None  # the test runs here
    if _fresh_outcomes is None:
        _fresh_outcomes = _run_fresh(pyfuncitem.session)
    outcome, text = _fresh_outcomes.get(pyfuncitem.nodeid, ("failed", "not run"))
    if outcome == "failed":
        pytest.fail(f"in a fresh process (triton was imported before TRITON_INTERPRET=1):\n{text}",
                    pytrace=False)
    if outcome == "skipped":
        pytest.skip(text)
    return True
