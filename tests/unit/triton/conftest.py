"""Triton kernel tests: on a GPU they run compiled; without CUDA, under Triton's interpreter.

`triton.jit` reads ``TRITON_INTERPRET`` when it decorates a kernel, i.e. when the kernel's
module is imported (not when triton itself is). pytest imports this conftest before the test
modules beside it, so setting the variable here covers every kernel they import. A kernel
module imported earlier in the session (by a test elsewhere, at collection) was decorated for
the GPU: the ``kernel_module`` fixture imports a module and re-executes it in that case, so the
tests work whatever ran before them.

Usage in a test module here::

    @pytest.fixture(scope="module")
    def prefill(kernel_module):
        return kernel_module("pagekv.kvnode.model.attention.triton_prefill")

and put tensors on ``triton_device`` ("cuda" or "cpu").
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


def _has_compiled_kernels(mod: ModuleType) -> bool:
    """True if the module holds a kernel decorated for the GPU (before the interpreter was on)."""
    from triton.runtime.jit import JITFunction

    return any(isinstance(obj, JITFunction) for obj in vars(mod).values())


def import_kernel_module(name: str) -> ModuleType:
    mod = importlib.import_module(name)
    if not ON_GPU and _has_compiled_kernels(mod):
        mod = importlib.reload(mod)
    return mod


@pytest.fixture(scope="session")
def kernel_module() -> Callable[[str], ModuleType]:
    """``kernel_module(dotted_name)`` -> the module, its kernels runnable on this machine."""
    return import_kernel_module


@pytest.fixture(scope="session")
def triton_device() -> str:
    return "cuda" if ON_GPU else "cpu"
