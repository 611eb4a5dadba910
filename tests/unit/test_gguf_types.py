"""Every ggml type gguf-py dequantizes loads, bit for bit what gguf-py computes: PageKV's own
dequantizers for its eight types, gguf-py for the rest (k-quants, i-quants, TQ, FP4); every
other type, and every type gguf-py would have handled when gguf-py is not installed, is one
ModelLoadError naming the tensor, its type and what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pagekv.kvnode.model.config import ModelLoadError  # noqa: E402
from pagekv.kvnode.model.gguf_quant import (  # noqa: E402
    DEQUANTIZABLE,
    GGML_TYPES,
    dequantize,
    uses_gguf_py,
)
from tests.unit.gguf_fixtures import random_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[2]
N_BLOCKS = 64


def gguf_py_dequantizes(kind) -> bool:
    """Asked of gguf-py directly: does it dequantize one all-zero block of this type?"""
    _, size = gguf.GGML_QUANT_SIZES[kind]
    try:
        gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    return True


COVERED = [k.name for k in Q if gguf_py_dequantizes(k)]
NOT_COVERED = [k.name for k in Q if k.name not in COVERED and k.name not in DEQUANTIZABLE]


def test_the_table_knows_every_type_of_gguf_py():
    """The reader sizes tensors from PageKV's table: a type missing there could not even be
    opened, whoever dequantizes it."""
    ours = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}
    assert {name: Q[name].value for name in COVERED} == {name: ours.get(name) for name in COVERED}
    assert set(DEQUANTIZABLE) <= set(COVERED)
    assert {"Q4_K", "Q6_K", "IQ4_XS", "TQ2_0", "MXFP4"} <= set(COVERED)


@pytest.mark.parametrize("qtype", COVERED)
def test_random_blocks_dequantize_bit_for_bit_as_gguf_py(qtype):
    kind = Q[qtype]
    block, _ = gguf.GGML_QUANT_SIZES[kind]
    blocks = random_blocks(qtype, N_BLOCKS * (256 // block if block == 1 else 1),
                           np.random.default_rng(kind.value))
    rows = blocks.reshape(4, -1)  # four rows of whole blocks
    ref = gguf.quants.dequantize(rows, kind)
    assert ref.dtype == np.float32 and np.isfinite(ref).all()  # the layout kept scales finite
    ours = dequantize(memoryview(rows.tobytes()), kind.value, ref.shape, f"t.{qtype}")
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))
    assert uses_gguf_py(kind.value) is (qtype not in DEQUANTIZABLE)


@pytest.mark.parametrize("qtype", NOT_COVERED)
def test_type_nothing_dequantizes_is_refused_by_name(qtype):
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    message = (rf"tensor 'blk\.0\.attn_q\.weight' is {qtype}, which neither PageKV \(F32, F16, "
               r"BF16, .*\) nor the installed gguf-py .*\(.*Q4_K.*\) dequantizes: re-quantize "
               r"the file")
    with pytest.raises(ModelLoadError, match=message):
        dequantize(bytes(size), Q[qtype].value, (block,), "blk.0.attn_q.weight")


def test_size_mismatch_through_gguf_py():
    with pytest.raises(ModelLoadError, match=r"'w': 143 bytes, Q4_K \(256,\) needs 144"):
        dequantize(bytes(143), Q.Q4_K.value, (256,), "w")


WITHOUT_GGUF = """
import sys
sys.modules["gguf"] = None  # as if gguf-py were not installed
from pagekv.kvnode.model.config import ModelLoadError
from pagekv.kvnode.model.gguf_quant import dequantize
own = dequantize(bytes([0, 60]) + bytes(range(16)), 2, (32,))  # Q4_0, d = 1.0
print("own", own.min(), own.max())
try:
    dequantize(bytes(144), 12, (256,), "blk.0.ffn_down.weight")
except ModelLoadError as exc:
    print("refused", exc)
"""


def test_without_gguf_py_own_types_load_and_the_rest_say_what_to_do():
    r = subprocess.run([sys.executable, "-c", WITHOUT_GGUF], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    own, refused = r.stdout.splitlines()
    assert own == "own -8.0 7.0"
    assert refused.startswith("refused tensor 'blk.0.ffn_down.weight' is Q4_K, which PageKV "
                              "does not dequantize itself")
    assert "pip install 'pagekv[model]'" in refused
    assert "re-quantize the file to one of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1" in refused
