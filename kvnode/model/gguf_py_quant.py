"""Dequantization through gguf-py (llama.cpp's own Python package, in the ``model`` extra) for
the ggml types PageKV's ``gguf_quant`` does not implement itself: the k-quants, the i-quants,
TQ1_0/TQ2_0, MXFP4, NVFP4.

gguf is imported on first use, never at module import: a pod whose file holds only the types
PageKV dequantizes itself runs without it, and the router never loads it. Which types the
installed gguf-py covers is asked of gguf-py itself (one all-zero block per type), so a newer
release that adds a type is used without a change here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import math
from types import ModuleType

import numpy as np

from pagekv.kvnode.model.config import ModelLoadError
from pagekv.proto.model_files.ggml_types import GGML_TYPES, ggml_type_name, tensor_nbytes

INSTALL_HINT = "pip install 'pagekv[model]'"


@functools.cache
def _gguf_module() -> tuple[ModuleType | None, str]:
    """(the gguf package, "") or (None, why it cannot be imported)."""
    try:
        return importlib.import_module("gguf"), ""
    except ImportError as exc:
        return None, str(exc)


def gguf_py_import_error() -> str | None:
    """None when gguf-py imports; else the import error's text."""
    module, error = _gguf_module()
    return None if module is not None else error


def gguf_py_version() -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


@functools.cache
def gguf_py_covers(ggml_type: int) -> bool:
    """Whether the installed gguf-py dequantizes this ggml type (False when it is missing)."""
    gguf, _ = _gguf_module()
    if gguf is None:
        return False
    try:
        kind = gguf.GGMLQuantizationType(ggml_type)
        _, type_size = gguf.GGML_QUANT_SIZES[kind]
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), kind)
    except Exception:  # NotImplementedError, or a type this release does not know
        return False
    return True


def gguf_py_type_names() -> list[str]:
    """The types of PageKV's table that the installed gguf-py dequantizes."""
    return [name for type_id, (name, _, _) in GGML_TYPES.items() if gguf_py_covers(type_id)]


def dequantize_with_gguf_py(raw: memoryview | bytes, ggml_type: int, shape: tuple[int, ...],
                            name: str) -> np.ndarray:
    """The tensor's values as a new float32 array of ``shape``, by gguf-py's
    ``gguf.quants.dequantize``; the caller has checked ``gguf_py_covers`` and the size."""
    gguf, _ = _gguf_module()
    assert gguf is not None  # gguf_py_covers said yes
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype=np.float32)
    row_bytes = tensor_nbytes(ggml_type, (shape[-1],), name)
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, row_bytes)
    try:
        values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(ggml_type))
    except Exception as exc:  # a bug of that release: one clear error, not its traceback
        raise ModelLoadError(
            f"tensor {name!r}: gguf-py {gguf_py_version()} failed to dequantize "
            f"{ggml_type_name(ggml_type)}: {type(exc).__name__}: {exc}"
        ) from exc
    out = np.asarray(values, dtype=np.float32).reshape(shape)
    return out.copy() if np.may_share_memory(out, rows) else out
