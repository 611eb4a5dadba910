"""The on-disk block codec: byte-plane shuffle + LZ4, with a raw fallback.

KV values of one dtype share their high bytes (sign + exponent) far more than their low
mantissa bytes. Splitting every element into byte planes (all byte-0s, then all byte-1s, ...)
puts the similar bytes next to each other, which is what LZ4's match finder needs. When the
result does not shrink the block by at least `min_ratio`, the raw bytes are stored instead:
decoding raw is free, and a disk tier must never spend CPU for nothing.

No torch import: this module is pure numpy + lz4 so tools can read SSD segments cheaply.
"""

from __future__ import annotations

import lz4.block
import numpy as np
from numpy.typing import NDArray

CODEC_RAW = 0
CODEC_LZ4_SHUFFLE = 1  # byte planes by element size, then lz4.block (size not stored inline)
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_LZ4_SHUFFLE: "lz4+shuffle"}

DEFAULT_MIN_RATIO = 1.1
DEFAULT_PROBE_BYTES = 64 * 1024

# dtype name (as a layout descriptor spells it) -> (stable on-disk code, element size in bytes)
_DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (0, 1),
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
    "float8_e4m3fn": (4, 1),
    "float8_e5m2": (5, 1),
}
_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
_CODE_TO_NAME = {code: name for name, (code, _) in _DTYPES.items()}


def canonical_dtype(name: str) -> str:
    """'fp16' / 'torch.float16' / 'float16' -> 'float16'; ValueError if unknown."""
    key = name.removeprefix("torch.").lower()
    key = _ALIASES.get(key, key)
    if key not in _DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; expected one of {sorted(_DTYPES) + sorted(_ALIASES)}")
    return key


def dtype_code(name: str) -> int:
    return _DTYPES[canonical_dtype(name)][0]


def dtype_name(code: int) -> str:
    try:
        return _CODE_TO_NAME[code]
    except KeyError:
        raise ValueError(f"unknown dtype code {code}") from None


def elem_size_of(name: str) -> int:
    """Bytes per element of a KV dtype: 4 fp32, 2 fp16/bf16, 1 fp8/uint8."""
    return _DTYPES[canonical_dtype(name)][1]


U8Array = NDArray[np.uint8]  # a block's bytes, flat
# What a codec call reads: any contiguous buffer; an array of any dtype is read as its bytes.
Buffer = bytes | bytearray | memoryview | NDArray[np.generic]


def _u8(data: Buffer) -> U8Array:
    """A flat uint8 view of any contiguous buffer (no copy)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def shuffle(data: Buffer, elem_size: int) -> U8Array:
    """Byte planes of `data`: plane i holds byte i of every element; a ragged tail stays last."""
    src = _u8(data)
    if elem_size <= 1:
        return src
    n = src.size // elem_size
    body = src[: n * elem_size].reshape(n, elem_size)
    out = np.empty(src.size, dtype=np.uint8)
    planes = out[: n * elem_size].reshape(elem_size, n)
    for i in range(elem_size):  # one vectorized strided copy per plane, not per byte
        planes[i] = body[:, i]
    out[n * elem_size :] = src[n * elem_size :]
    return out


def unshuffle(data: Buffer, elem_size: int) -> U8Array:
    """Inverse of `shuffle`; returns a new writable array."""
    src = _u8(data)
    if elem_size <= 1:
        return src.copy()
    n = src.size // elem_size
    planes = src[: n * elem_size].reshape(elem_size, n)
    out = np.empty(src.size, dtype=np.uint8)
    body = out[: n * elem_size].reshape(n, elem_size)
    for i in range(elem_size):
        body[:, i] = planes[i]
    out[n * elem_size :] = src[n * elem_size :]
    return out


def encode(
    data: Buffer,
    elem_size: int,
    min_ratio: float = DEFAULT_MIN_RATIO,
    probe_bytes: int = DEFAULT_PROBE_BYTES,
) -> tuple[int, bytes | memoryview]:
    """Compress one block. Returns (codec_id, payload); a raw payload is a view of `data`.

    With `probe_bytes` > 0, a sample of the block (4 slices spread over it, about
    `probe_bytes` in all) is compressed first; if the sample misses `min_ratio`, the block is
    stored raw without compressing all of it. KV blocks are statistically uniform, so the
    sample decides like the whole block would, at a small fraction of the CPU.
    """
    src = _u8(data)
    raw = src.data  # memoryview(src): numpy types its buffer protocol for Python 3.12+ only
    if src.size == 0:
        return CODEC_RAW, raw
    if 0 < probe_bytes and 4 * probe_bytes <= src.size and _probe_ratio(src, elem_size, probe_bytes) < min_ratio:
        return CODEC_RAW, raw
    packed = lz4.block.compress(shuffle(src, elem_size), store_size=False)
    if len(packed) * min_ratio > src.size:
        return CODEC_RAW, raw
    return CODEC_LZ4_SHUFFLE, packed


def _probe_ratio(src: U8Array, elem_size: int, probe_bytes: int) -> float:
    step = max(elem_size, elem_size * (probe_bytes // 4 // elem_size))
    stride = (src.size // 4) // elem_size * elem_size
    sample = np.concatenate([src[k * stride : k * stride + step] for k in range(4)])
    return sample.size / max(1, len(lz4.block.compress(shuffle(sample, elem_size), store_size=False)))


def decode_array(codec_id: int, payload: Buffer, raw_len: int, elem_size: int) -> U8Array:
    """Decode to a uint8 array. Raw payloads are returned as a view (no copy) of `payload`."""
    if codec_id == CODEC_RAW:
        arr = _u8(payload)
        if arr.size != raw_len:
            raise ValueError(f"raw payload is {arr.size} bytes, expected {raw_len}")
        return arr
    if codec_id == CODEC_LZ4_SHUFFLE:
        try:
            planes = lz4.block.decompress(payload, uncompressed_size=raw_len)
        except lz4.block.LZ4BlockError as exc:
            raise ValueError(f"corrupt lz4 payload: {exc}") from exc
        if len(planes) != raw_len:
            raise ValueError(f"lz4 payload decoded to {len(planes)} bytes, expected {raw_len}")
        return unshuffle(planes, elem_size)
    raise ValueError(f"unknown codec id {codec_id}")


def decode(codec_id: int, payload: Buffer, raw_len: int, elem_size: int) -> bytes:
    """Inverse of `encode`; ValueError on a payload that cannot be decoded."""
    return decode_array(codec_id, payload, raw_len, elem_size).tobytes()
