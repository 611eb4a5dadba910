"""Paged attention backends and the dispatcher that picks one.

Backends share one signature (see ``paged.paged_attention``). ``torch`` is the pure-torch
reference; ``cpp`` is the optional C++ CPU kernel in ``kvnode.model.attention.cpu_kernel``
(a module exposing ``available() -> bool`` and ``paged_attention(...)``, and optionally
``write_kv_cache(...)``). Selection, by argument or ``PAGEKV_ATTENTION_BACKEND``:

* ``auto`` (default): the C++ kernel when it imports, reports ``available()`` and the
  device is CPU; otherwise the reference.
* ``torch``: always the reference.
* ``cpp``: the C++ kernel, or a RuntimeError saying why it cannot be used.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from pagekv.kvnode.model.attention.paged import paged_attention, write_kv_cache

logger = logging.getLogger(__name__)

ENV_VAR = "PAGEKV_ATTENTION_BACKEND"
BACKEND_CHOICES: tuple[str, ...] = ("auto", "torch", "cpp")
_KERNEL_MODULE = "pagekv.kvnode.model.attention.cpu_kernel"


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    name: str  # "torch" or "cpp"
    paged_attention: Callable[..., object]
    write_kv_cache: Callable[..., None]


REFERENCE_BACKEND = AttentionBackend("torch", paged_attention, write_kv_cache)


def _load_kernel() -> tuple[AttentionBackend | None, str]:
    """The C++ backend, or None and the reason it is unusable."""
    try:
        mod = importlib.import_module(_KERNEL_MODULE)
    except ImportError as exc:
        return None, f"{_KERNEL_MODULE} does not import ({exc})"
    try:
        ok = bool(mod.available())
    except Exception as exc:  # a broken build must not take the pod down in auto mode
        return None, f"{_KERNEL_MODULE}.available() raised {exc!r}"
    if not ok:
        return None, f"{_KERNEL_MODULE}.available() is False"
    writer = getattr(mod, "write_kv_cache", write_kv_cache)
    return AttentionBackend("cpp", mod.paged_attention, writer), ""


def get_attention_backend(name: str | None = None, device: str = "cpu") -> AttentionBackend:
    """Pick the attention backend: ``name`` if given, else ``$PAGEKV_ATTENTION_BACKEND``,
    else ``auto``."""
    choice = (name or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if choice not in BACKEND_CHOICES:
        raise ValueError(
            f"unknown attention backend {choice!r} (from {'argument' if name else ENV_VAR}); "
            f"choose one of {', '.join(BACKEND_CHOICES)}"
        )
    if choice == "torch":
        return REFERENCE_BACKEND
    on_cpu = str(device).startswith("cpu")
    kernel, why = _load_kernel()
    if choice == "cpp":
        if kernel is None:
            raise RuntimeError(f"attention backend 'cpp' requested but {why}")
        if not on_cpu:
            raise RuntimeError(f"attention backend 'cpp' is a CPU kernel; device is {device}")
        return kernel
    if kernel is not None and on_cpu:
        return kernel
    if kernel is None:
        logger.debug("attention backend auto -> torch: %s", why)
    return REFERENCE_BACKEND


__all__ = [
    "AttentionBackend",
    "BACKEND_CHOICES",
    "ENV_VAR",
    "REFERENCE_BACKEND",
    "get_attention_backend",
    "paged_attention",
    "write_kv_cache",
]
