"""Block hashing: byte identity of the fast CBOR (and pickle) serializer with cbor2's canonical
encoding, edge cases included, and of the hash functions with vLLM's. Reference functions:
hashing_reference.py.
"""

from __future__ import annotations

import enum

import cbor2
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagekv.proto.hashing import (
    DEFAULT_HASH_SEED,
    HASH_ALGOS,
    cbor_dumps,
    get_hash_fn,
    hash_block_tokens,
    pickle_dumps,
)
from tests.unit.hashing_reference import FAST, REFERENCE, _ref_cbor, _ref_pickle

# --- byte identity of the fast serializer --------------------------------------------------

EDGE_INTS = [0, 1, 2, 23, 24, 25, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, 2**64,
             2**70, -1, -24, -25, -256, -257, -(2**64), -(2**64) - 1]
token_ints = st.one_of(
    st.sampled_from(EDGE_INTS),
    st.integers(0, 300_000),
    st.integers(0, 2**80),
    st.integers(-(2**70), -1),
)
odd_items = st.one_of(
    st.booleans(),
    st.floats(allow_nan=False),
    st.sampled_from([1.0, 2.0, 300.0]),  # equal (and hash-equal) to cached ints
    st.text(max_size=3),
    st.none(),
)
token_lists = st.one_of(
    st.lists(token_ints, max_size=40),
    st.lists(st.one_of(token_ints, odd_items), max_size=20),
)
key_items = st.one_of(st.text(max_size=300), token_ints, st.sampled_from(["lora", "mm", "é"]))
extra_keys = st.one_of(
    st.none(),
    st.lists(st.lists(key_items, max_size=4).map(tuple), max_size=4).map(tuple),
    st.lists(st.lists(st.one_of(key_items, odd_items, st.binary(max_size=3)),
                      max_size=3).map(tuple), max_size=3).map(tuple),
)
parents = st.one_of(st.binary(max_size=300), st.sampled_from([None, "root", 7]))


@FAST
@given(parent=parents, tokens=token_lists, extra=extra_keys, as_list=st.booleans())
def test_fast_cbor_is_cbor2_canonical(parent, tokens, extra, as_list) -> None:
    seq = list(tokens) if as_list else tuple(tokens)
    obj = (parent, seq, extra)
    want = _ref_cbor(obj)
    assert cbor_dumps(obj) == want  # cold: may fill the per-int cache
    assert cbor_dumps(obj) == want  # warm: served from the cache
    assert pickle_dumps(obj) == _ref_pickle(obj)


@FAST
@given(parent=st.binary(min_size=16, max_size=32), tokens=st.lists(token_ints, max_size=40),
       extra=extra_keys)
def test_hash_functions_match_reference(parent, tokens, extra) -> None:
    for algo in HASH_ALGOS:
        fn, ref = get_hash_fn(algo), REFERENCE[algo]
        want = ref((parent, tuple(tokens), extra))
        assert fn((parent, tuple(tokens), extra)) == want
        assert hash_block_tokens(fn, parent, tokens, extra) == want
        assert hash_block_tokens(fn, parent, tuple(tokens), extra) == want
        assert fn(DEFAULT_HASH_SEED) == ref(DEFAULT_HASH_SEED)


@pytest.mark.parametrize("size", [0, 1, 23, 24, 25, 255, 256, 65535, 65536])
def test_cbor_length_heads_at_every_boundary(size: int) -> None:
    """Byte string, array and text heads switch width at 24, 256 and 65536."""
    cases = [
        (b"x" * size, [300, 2], None),
        (b"p", [70_000 + (i % 7) for i in range(size)], None),
        (b"p", [300], (("salt", "x" * size),)),
        (b"p", [300], (("salt", "é" * (size // 2)),)),  # 2 UTF-8 bytes per character
        (b"p", [300], (("k",) * min(size, 300),)),
        (b"p", [300], (("k", 5),) * min(size, 300)),
    ]
    for obj in cases:
        assert cbor_dumps(obj) == _ref_cbor(obj)


class Colour(enum.IntEnum):
    RED = 300


@pytest.mark.parametrize("tokens", [
    [300, 5, True, 7],           # True must not borrow 1's bytes
    [300, 5, False, 1, 0],       # nor False 0's
    [300, 2.0, 5],               # 2.0 == 2 and hash(2.0) == hash(2)
    [300, Colour.RED, 5],        # int subclass: cbor2 writes it as an int
    [300, 2**64, -(2**64) - 1],  # bignums
    [7], [], [1], [True],
])
def test_cbor_tokens_that_alias_cached_ints(tokens: list) -> None:
    cbor_dumps((b"p", [2, 5, 7, 300, 0, 1], None))  # warm the cache with the ints first
    for seq in (tokens, tuple(tokens)):
        assert cbor_dumps((b"p", seq, None)) == _ref_cbor((b"p", seq, None))
        fn = get_hash_fn("sha256_cbor")
        assert hash_block_tokens(fn, b"p", seq) == REFERENCE["sha256_cbor"]((b"p", tuple(seq), None))


def test_cbor_extra_keys_that_alias_cached_keys() -> None:
    cbor_dumps((b"p", [300, 5], (("mm", "img", 1), ("lora", "a", "b"))))  # warm the key cache
    for extra in [(("mm", "img", True),), (("mm", "img", 1.0),), (("lora", "a", b"b"),),
                  (("mm", "img", 1),) * 2, ((),), (("lora", "a", "b"), ("cache_salt", "s"))]:
        obj = (b"p", [300, 5], extra)
        assert cbor_dumps(obj) == _ref_cbor(obj)
    for i in range(5000):  # past the key cache's bound: still exact
        obj = (b"p", [300, 5], (("mm", "img", i - 2500),))
        assert cbor_dumps(obj) == _ref_cbor(obj)


def test_cbor_errors_are_cbor2_errors() -> None:
    numpy_tokens = np.array([300, 5], dtype=np.int64)
    for bad in [(b"p", list(numpy_tokens), None), (b"p", [300], (("salt", "\ud800"),))]:
        with pytest.raises(Exception) as ref_err:
            _ref_cbor(bad)
        with pytest.raises(type(ref_err.value)):
            cbor_dumps(bad)
    fn = get_hash_fn("xxhash_cbor")
    with pytest.raises(cbor2.CBOREncodeError):
        hash_block_tokens(fn, b"p", numpy_tokens)

