"""Paged attention backends and the dispatcher that picks one.

Backends share one signature (see ``paged.paged_attention``, ``sliding_window`` included).

* ``torch``: the pure-torch reference (``paged``), every phase.
* ``cpp``: CPU. Decode rows and short prefill/extend rows go to the C++ kernel
  (``cpu_kernel``: a module exposing ``available() -> bool``, ``paged_attention(...)`` and
  optionally ``has_avx512_path()`` and ``write_kv_cache(...)``), longer ones to the
  reference's SDPA path, which is faster there (``phase_dispatch``; measured in
  ``bench/attention.py``).
* ``triton``: the Triton kernels (``triton_backend``: ``available(device) -> (bool, str)``
  and ``backend() -> AttentionBackend``). CUDA; on CPU only under Triton's interpreter
  (``TRITON_INTERPRET=1``), which is for tests.

Selection, by argument or ``PAGEKV_ATTENTION_BACKEND``: ``auto`` (default) never picks a path
slower than another available one for a phase: on CPU ``cpp`` when the kernel is usable, on
CUDA ``triton`` when it is usable, otherwise ``torch`` (never ``triton`` on CPU). A named
backend that cannot be used is a RuntimeError saying why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagekv.kvnode.model.attention.paged import paged_attention, write_kv_cache
from pagekv.kvnode.model.attention.phase_dispatch import (
    AVX512_LIMITS,
    PORTABLE_LIMITS,
    phase_dispatched,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ENV_VAR = "PAGEKV_ATTENTION_BACKEND"
BACKEND_CHOICES: tuple[str, ...] = ("auto", "torch", "cpp", "triton")
_KERNEL_MODULE = "pagekv.kvnode.model.attention.cpu_kernel"  # named in the reasons logged
_TRITON_MODULE = "pagekv.kvnode.model.attention.triton_backend"


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    name: str  # "torch", "cpp" or "triton"
    paged_attention: Callable[..., torch.Tensor]
    write_kv_cache: Callable[..., None]
    phases: str = ""  # what runs each phase, for the log line

    def describe(self) -> str:
        return self.phases or self.name


REFERENCE_BACKEND = AttentionBackend(
    "torch", paged_attention, write_kv_cache, "torch SDPA decode and prefill"
)


def _load_kernel() -> tuple[AttentionBackend | None, str]:
    """The C++ backend (decode and short prefill in the kernel, the rest on the reference
    path), or None and the reason it is unusable."""
    try:
        from pagekv.kvnode.model.attention import cpu_kernel as mod
    except ImportError as exc:
        return None, f"{_KERNEL_MODULE} does not import ({exc})"
    try:
        ok = bool(mod.available())
    except Exception as exc:  # a broken build must not take the pod down in auto mode
        return None, f"{_KERNEL_MODULE}.available() raised {exc!r}"
    if not ok:
        return None, f"{_KERNEL_MODULE}.available() is False"
    writer = getattr(mod, "write_kv_cache", write_kv_cache)
    try:
        avx512 = bool(mod.has_avx512_path())
    except Exception:  # an older or stand-in module: assume the slower path
        avx512 = False
    limits = AVX512_LIMITS if avx512 else PORTABLE_LIMITS
    return AttentionBackend("cpp", phase_dispatched(mod.paged_attention, limits), writer,
                            limits.describe()), ""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


def _load_triton(device: str) -> tuple[AttentionBackend | None, str]:
    """The Triton backend for ``device``, or None and the reason it is unusable. Imported
    only when asked for: a CPU pod never loads triton."""
    if device.startswith("cpu") and not _interpreting():
        return None, ("it runs on CUDA; on CPU only under Triton's interpreter "
                      "(TRITON_INTERPRET=1, for tests)")
    try:
        from pagekv.kvnode.model.attention import triton_backend as mod
    except Exception as exc:  # missing module or triton, or a broken one: auto falls back
        return None, f"{_TRITON_MODULE} does not import ({type(exc).__name__}: {exc})"
    try:
        ok, why = mod.available(device)
        if not ok:
            return None, f"{_TRITON_MODULE}.available({device!r}) is False: {why}"
        return mod.backend(), ""
    except Exception as exc:
        return None, f"{_TRITON_MODULE} failed on {device} ({type(exc).__name__}: {exc})"


def _select(choice: str, device: str) -> AttentionBackend:
    if choice == "torch":
        return REFERENCE_BACKEND
    on_cpu = device.startswith("cpu")
    if choice == "triton":
        backend, why = _load_triton(device)
        if backend is None:
            raise RuntimeError(f"attention backend 'triton' requested but {why}")
        return backend
    if choice == "cpp" or on_cpu:
        if choice == "cpp" and not on_cpu:
            raise RuntimeError(f"attention backend 'cpp' is a CPU kernel; device is {device}")
        kernel, why = _load_kernel()
        if kernel is not None:
            return kernel
        if choice == "cpp":
            raise RuntimeError(f"attention backend 'cpp' requested but {why}")
        logger.debug("attention backend auto -> torch: %s", why)
        return REFERENCE_BACKEND
    if device.startswith("cuda"):  # auto on CUDA
        backend, why = _load_triton(device)
        if backend is not None:
            return backend
        logger.info("attention backend auto -> torch on %s: %s", device, why)
    return REFERENCE_BACKEND


def get_attention_backend(name: str | None = None, device: str = "cpu") -> AttentionBackend:
    """Pick the attention backend: ``name`` if given, else ``$PAGEKV_ATTENTION_BACKEND``,
    else ``auto``."""
    choice = (name or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if choice not in BACKEND_CHOICES:
        raise ValueError(
            f"unknown attention backend {choice!r} (from {'argument' if name else ENV_VAR}); "
            f"choose one of {', '.join(BACKEND_CHOICES)}"
        )
    backend = _select(choice, str(device))
    logger.info("attention: %s (backend %s, device %s)", backend.describe(), backend.name,
                device)
    return backend


__all__ = [
    "AttentionBackend",
    "BACKEND_CHOICES",
    "ENV_VAR",
    "REFERENCE_BACKEND",
    "get_attention_backend",
    "paged_attention",
    "write_kv_cache",
]
