"""The SSD codec: byte-plane shuffle + lz4 round-trips, and falls back to raw when it does not pay."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagekv.tiers import codec

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


@settings(max_examples=150, deadline=None)
@given(data=st.binary(min_size=0, max_size=4096), elem_size=st.sampled_from([1, 2, 4]))
def test_round_trip_any_bytes(data: bytes, elem_size: int) -> None:
    codec_id, payload = codec.encode(data, elem_size)
    assert codec.decode(codec_id, payload, len(data), elem_size) == data


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    n=st.integers(min_value=1, max_value=3000),
    scale=st.floats(min_value=1e-3, max_value=1e3),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_round_trip_kv_values(dtype: str, n: int, scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randn(n, generator=gen) * scale).to(DTYPES[dtype])
    raw = values.view(torch.uint8).numpy().tobytes()
    elem = codec.elem_size_of(dtype)
    codec_id, payload = codec.encode(raw, elem)
    back = codec.decode(codec_id, payload, len(raw), elem)
    assert back == raw
    restored = torch.frombuffer(bytearray(back), dtype=torch.uint8).view(DTYPES[dtype])
    assert torch.equal(restored.view(torch.uint8), values.view(torch.uint8))


def test_compressible_kv_uses_lz4_and_shrinks() -> None:
    # fp16 values that repeat (e.g. a padded or constant region) compress well once shuffled.
    values = torch.tensor([0.5, -1.25, 2.0, 0.0], dtype=torch.float16).repeat(4096)
    raw = values.view(torch.uint8).numpy()
    codec_id, payload = codec.encode(raw, 2)
    assert codec_id == codec.CODEC_LZ4_SHUFFLE
    assert len(payload) * 4 < raw.nbytes
    assert codec.decode(codec_id, payload, raw.nbytes, 2) == raw.tobytes()


def test_incompressible_data_is_stored_raw() -> None:
    data = os.urandom(64 * 1024)
    codec_id, payload = codec.encode(data, 2)
    assert codec_id == codec.CODEC_RAW
    assert bytes(payload) == data


def test_threshold_is_configurable() -> None:
    # Half random, half zeros: ratio about 2. A 3x threshold refuses it, 1.1x takes it.
    data = os.urandom(32 * 1024) + bytes(32 * 1024)
    assert codec.encode(data, 1, min_ratio=1.1)[0] == codec.CODEC_LZ4_SHUFFLE
    assert codec.encode(data, 1, min_ratio=3.0)[0] == codec.CODEC_RAW


def test_shuffle_puts_byte_planes_together() -> None:
    values = np.array([0x0102, 0x0304, 0x0506], dtype="<u2")
    planes = codec.shuffle(values.view(np.uint8), 2)
    assert planes.tolist() == [0x02, 0x04, 0x06, 0x01, 0x03, 0x05]
    assert codec.unshuffle(planes, 2).tobytes() == values.tobytes()


def test_ragged_tail_survives_shuffle() -> None:
    data = bytes(range(11))  # not a multiple of 4
    assert codec.unshuffle(codec.shuffle(data, 4), 4).tobytes() == data


def test_raw_decode_is_a_view_not_a_copy() -> None:
    buf = bytearray(b"abcd" * 16)
    arr = codec.decode_array(codec.CODEC_RAW, memoryview(buf), len(buf), 2)
    buf[0] = ord("z")
    assert arr[0] == ord("z")


def test_corrupt_payload_raises_value_error() -> None:
    values = torch.zeros(8192, dtype=torch.float16).view(torch.uint8).numpy()
    codec_id, payload = codec.encode(values, 2)
    assert codec_id == codec.CODEC_LZ4_SHUFFLE
    with pytest.raises(ValueError):
        codec.decode(codec_id, payload[: len(payload) // 2], values.nbytes, 2)
    with pytest.raises(ValueError):
        codec.decode(99, payload, values.nbytes, 2)


@pytest.mark.parametrize(
    ("name", "canonical", "size"),
    [("fp16", "float16", 2), ("torch.bfloat16", "bfloat16", 2), ("fp8", "float8_e4m3fn", 1),
     ("float32", "float32", 4), ("fp8_e5m2", "float8_e5m2", 1)],
)  # fmt: skip
def test_dtype_names(name: str, canonical: str, size: int) -> None:
    assert codec.canonical_dtype(name) == canonical
    assert codec.elem_size_of(name) == size
    assert codec.dtype_name(codec.dtype_code(name)) == canonical


def test_unknown_dtype_is_rejected_clearly() -> None:
    with pytest.raises(ValueError, match="unknown KV dtype"):
        codec.canonical_dtype("int4")


def test_probe_decides_like_the_whole_block_on_large_blocks() -> None:
    noise = os.urandom(1 << 20)
    assert codec.encode(noise, 2)[0] == codec.CODEC_RAW  # decided by the sample alone
    repetitive = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float16).repeat(1 << 18)
    raw = repetitive.view(torch.uint8).numpy()
    codec_id, payload = codec.encode(raw, 2)
    assert codec_id == codec.CODEC_LZ4_SHUFFLE
    assert codec.decode(codec_id, payload, raw.nbytes, 2) == raw.tobytes()
    assert codec.encode(noise, 2, probe_bytes=0)[0] == codec.CODEC_RAW
