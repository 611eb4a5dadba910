"""The GGUF container reader and the dequantizers, against llama.cpp's own ``gguf`` package
(its writer, its type table, its dequantize) and against blocks built by hand."""

from __future__ import annotations

import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pagekv.kvnode.model.config import ModelLoadError  # noqa: E402
from pagekv.kvnode.model.gguf_quant import DEQUANTIZABLE, GGML_TYPES, dequantize  # noqa: E402
from pagekv.proto.model_files.gguf import GGUFFile  # noqa: E402
from tests.unit.gguf_fixtures import write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType


def test_type_table_matches_llama_cpp():
    for type_id, (name, block, size) in GGML_TYPES.items():
        kind = Q(type_id)
        assert kind.name == name
        assert gguf.GGML_QUANT_SIZES[kind] == (block, size), name


@pytest.mark.parametrize("qtype", DEQUANTIZABLE)
def test_dequantize_equals_llama_cpp(qtype):
    rng = np.random.default_rng(7)
    values = (rng.standard_normal((6, 128)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
    values[2, :32] = 0.0  # an all-zero block (scale 0)
    values[3, 32:64] = 5.0  # a constant block
    raw = gguf.quants.quantize(values, Q[qtype])
    ours = dequantize(raw.tobytes(), Q[qtype].value, values.shape)
    ref = gguf.quants.dequantize(raw, Q[qtype]).reshape(values.shape)
    assert ours.dtype == np.float32 and ours.shape == values.shape
    np.testing.assert_array_equal(ours, ref)


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def test_hand_built_blocks():
    """One block of each layout, its values worked out from ggml's definitions."""
    nibbles = bytes((j % 16) | ((15 - j % 16) << 4) for j in range(16))  # low j, high 15-j
    low, high = np.arange(16.0), 15.0 - np.arange(16.0)
    q4_0 = dequantize(_f16(0.5) + nibbles, Q.Q4_0.value, (32,))
    np.testing.assert_array_equal(q4_0, 0.5 * (np.concatenate([low, high]) - 8))
    q4_1 = dequantize(_f16(0.25) + _f16(-1.0) + nibbles, Q.Q4_1.value, (32,))
    np.testing.assert_array_equal(q4_1, 0.25 * np.concatenate([low, high]) - 1.0)
    ints = np.arange(-16, 16, dtype=np.int8)
    q8 = dequantize(_f16(2.0) + ints.tobytes(), Q.Q8_0.value, (32,))
    np.testing.assert_array_equal(q8, 2.0 * ints)
    qh = struct.pack("<I", 0b1 | (1 << 16) | (1 << 31))  # bit 4 set on elements 0, 16, 31
    bit4 = np.zeros(32)
    bit4[[0, 16, 31]] = 16
    q5_0 = dequantize(_f16(1.0) + qh + nibbles, Q.Q5_0.value, (32,))
    np.testing.assert_array_equal(q5_0, np.concatenate([low, high]) + bit4 - 16)
    q5_1 = dequantize(_f16(1.0) + _f16(0.5) + qh + nibbles, Q.Q5_1.value, (32,))
    np.testing.assert_array_equal(q5_1, np.concatenate([low, high]) + bit4 + 0.5)
    bf16 = dequantize(struct.pack("<2H", 0x3FC0, 0xC000), Q.BF16.value, (2,))
    np.testing.assert_array_equal(bf16, [1.5, -2.0])


def test_rows_must_be_whole_blocks():
    with pytest.raises(ModelLoadError, match="whole number of Q8_0 blocks"):
        dequantize(bytes(34), Q.Q8_0.value, (2, 16))


METADATA = {
    "general.name": "tiny ünïcode",
    "some.flag": True,
    "some.count": 7,
    "some.eps": 0.25,
    "some.words": ["a", "", "Ġb c", "日本"],
    "some.ints": [3, 1, 4, 1, 5],
    "some.floats": [0.5, -1.5],
}


@pytest.fixture
def small_file(tmp_path):
    tensors = {"a": (np.arange(64, dtype=np.float32).reshape(2, 32), "F32"),
               "b": (np.linspace(-1, 1, 96, dtype=np.float32).reshape(3, 32), "Q8_0")}
    return write_gguf(tmp_path / "small.gguf", METADATA, tensors, arch="test"), tensors


def test_reader_reads_what_llama_cpp_wrote(small_file):
    path, tensors = small_file
    with GGUFFile(path) as f:
        assert f.version == 3
        assert {k: v for k, v in f.metadata.items() if k != "general.architecture"} == METADATA
        assert f.metadata["general.architecture"] == "test"
        assert set(f.tensors) == {"a", "b"}
        b = f.tensors["b"]
        assert (b.shape, b.type_name, b.nbytes) == ((3, 32), "Q8_0", 3 * 34)
        a = dequantize(f.tensor_data(f.tensors["a"]), 0, (2, 32))
        np.testing.assert_array_equal(a, tensors["a"][0])
        ref = gguf.GGUFReader(str(path))
        assert {t.name: t.data_offset for t in ref.tensors} == {n: i.offset for n, i in f.tensors.items()}


def test_truncation_anywhere_is_a_clear_error(small_file, tmp_path):
    path, _ = small_file
    data = path.read_bytes()
    with GGUFFile(path) as f:
        header_end, last = f.tensors["a"].offset, f.tensors["b"]
    cut_path = tmp_path / "cut.gguf"
    for cut in (30, 60, header_end - 20, header_end + 8, last.offset + last.nbytes - 1):
        cut_path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=r"cut\.gguf is truncated"):
            GGUFFile(cut_path)


def test_not_gguf_and_wrong_versions(small_file, tmp_path):
    path, _ = small_file
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ModelLoadError, match="not a GGUF file: it starts with b'GGML'"):
        GGUFFile(bad)
    bad.write_bytes(b"tiny")
    with pytest.raises(ModelLoadError, match="not a GGUF file: 4 bytes"):
        GGUFFile(bad)
    for version, hint in ((1, ""), (3 << 24, "big-endian")):
        bad.write_bytes(data[:4] + struct.pack("<I", version) + data[8:])
        with pytest.raises(ModelLoadError, match=f"unsupported GGUF version {version}.*{hint}"):
            GGUFFile(bad)


def test_corrupt_counts_and_types(small_file, tmp_path):
    path, _ = small_file
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad.gguf"
    huge = bytearray(data)
    huge[16:24] = struct.pack("<Q", 1 << 40)  # metadata count
    bad.write_bytes(bytes(huge))
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        GGUFFile(bad)
    # The first key's value type: after the header (24 bytes) and the key string.
    key_len = struct.unpack_from("<Q", data, 24)[0]
    typ = 24 + 8 + key_len
    data[typ : typ + 4] = struct.pack("<I", 77)
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="unknown value type 77"):
        GGUFFile(bad)
