"""ggml tensor types: their sizes, and dequantization to float32 of the ones we load.

A quantized tensor is a sequence of blocks along its rows (the fastest-varying GGUF
dimension); each block stores ``block_size`` values in ``type_size`` bytes. Dequantized here,
block-parallel in numpy (no per-element Python): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.
Every other type (the k-quants, i-quants, TQ and FP4 types) goes to gguf-py when it is
installed and covers it (``gguf_py_quant``), bit for bit what llama.cpp's Python package
computes; else it is refused by name, saying what to do. Block layouts are ggml's
(``ggml-common.h``):

* Q8_0: fp16 scale ``d``, 32 int8 ``q``: ``x = d * q``
* Q4_0: ``d``, 16 bytes of nibbles: element ``j`` is the low nibble of byte ``j``, element
  ``j + 16`` its high nibble: ``x = d * (q - 8)``
* Q4_1: ``d``, fp16 minimum ``m``, nibbles as Q4_0: ``x = d * q + m``
* Q5_0 / Q5_1: as Q4_0 / Q4_1 plus a uint32 ``qh`` holding bit 4 of element ``j`` at bit ``j``:
  ``x = d * (q - 16)`` / ``x = d * q + m``
"""

from __future__ import annotations

import numpy as np

from pagekv.kvnode.model.config import ModelLoadError
from pagekv.kvnode.model.gguf_py_quant import (
    INSTALL_HINT,
    dequantize_with_gguf_py,
    gguf_py_covers,
    gguf_py_import_error,
    gguf_py_type_names,
    gguf_py_version,
)
from pagekv.proto.model_files.ggml_types import GGML_TYPES, ggml_type_name, tensor_nbytes  # noqa: F401

_F16 = "<f2"
_BLOCKS = {
    "Q8_0": np.dtype([("d", _F16), ("q", "i1", (32,))]),
    "Q4_0": np.dtype([("d", _F16), ("qs", "u1", (16,))]),
    "Q4_1": np.dtype([("d", _F16), ("m", _F16), ("qs", "u1", (16,))]),
    "Q5_0": np.dtype([("d", _F16), ("qh", "<u4"), ("qs", "u1", (16,))]),
    "Q5_1": np.dtype([("d", _F16), ("m", _F16), ("qh", "<u4"), ("qs", "u1", (16,))]),
}
DEQUANTIZABLE: tuple[str, ...] = ("F32", "F16", "BF16", *_BLOCKS)
_BIT_POSITIONS = np.arange(32, dtype=np.uint32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] values: the 16 low nibbles, then the 16 high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n] uint32 -> [n, 32] bit 4 of each element (bit j of qh is element j's)."""
    return (((qh[:, None] >> _BIT_POSITIONS) & 1) << 4).astype(np.uint8)


def uses_gguf_py(ggml_type: int) -> bool:
    """Whether a tensor of this type is dequantized by gguf-py (not one of PageKV's own)."""
    return ggml_type_name(ggml_type) not in DEQUANTIZABLE


def check_dequantizable(ggml_type: int, name: str = "tensor") -> None:
    """ModelLoadError, naming the tensor, its type and what to do, unless PageKV or the
    installed gguf-py dequantizes the type."""
    type_name = ggml_type_name(ggml_type)
    if type_name in DEQUANTIZABLE or gguf_py_covers(ggml_type):
        return
    own = ", ".join(DEQUANTIZABLE)
    import_error = gguf_py_import_error()
    if import_error is not None:
        raise ModelLoadError(
            f"tensor {name!r} is {type_name}, which PageKV does not dequantize itself (it does "
            f"{own}); gguf-py, which dequantizes the k-quants, i-quants, TQ and FP4 types, "
            f"cannot be imported ({import_error}): `{INSTALL_HINT}`, or re-quantize the file "
            f"to one of {own}"
        )
    extra = [t for t in gguf_py_type_names() if t not in DEQUANTIZABLE]
    raise ModelLoadError(
        f"tensor {name!r} is {type_name}, which neither PageKV ({own}) nor the installed "
        f"gguf-py {gguf_py_version()} ({', '.join(extra)}) dequantizes: "
        f"re-quantize the file to one of those types (llama.cpp's llama-quantize), or try a "
        f"newer gguf-py (`pip install -U gguf`)"
    )


def dequantize(raw: memoryview | bytes, ggml_type: int, shape: tuple[int, ...],
               name: str = "tensor") -> np.ndarray:
    """The tensor's values as a float32 array of ``shape`` (row-major); a new array, never a
    view of ``raw``. PageKV's own code for the types in DEQUANTIZABLE, gguf-py's for the
    others it covers; ModelLoadError for a type neither covers or a size mismatch."""
    type_name = ggml_type_name(ggml_type)
    check_dequantizable(ggml_type, name)
    expected = tensor_nbytes(ggml_type, shape, name)
    if len(raw) != expected:
        raise ModelLoadError(f"tensor {name!r}: {len(raw)} bytes, {type_name} {shape} needs "
                             f"{expected}")
    if type_name not in DEQUANTIZABLE:
        return dequantize_with_gguf_py(raw, ggml_type, shape, name)
    if type_name == "F32":
        return np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(shape)
    if type_name == "F16":
        return np.frombuffer(raw, dtype=_F16).astype(np.float32).reshape(shape)
    if type_name == "BF16":  # the top half of a float32
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    b = np.frombuffer(raw, dtype=_BLOCKS[type_name])
    d = b["d"].astype(np.float32)[:, None]
    if type_name == "Q8_0":
        out = d * b["q"].astype(np.float32)
    elif type_name == "Q4_0":
        out = d * (_nibbles(b["qs"]).astype(np.float32) - 8.0)
    elif type_name == "Q4_1":
        out = d * _nibbles(b["qs"]).astype(np.float32) + b["m"].astype(np.float32)[:, None]
    else:  # Q5_0, Q5_1
        q = (_nibbles(b["qs"]) | _high_bits(b["qh"])).astype(np.float32)
        if type_name == "Q5_0":
            out = d * (q - 16.0)
        else:
            out = d * q + b["m"].astype(np.float32)[:, None]
    return out.reshape(shape)
