"""Block hashing: vLLM's vectors, byte-identity of the fast CBOR path, the request hasher."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import cbor2
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.hashing import (
    DEFAULT_HASH_SEED,
    HASH_ALGOS,
    HashConfig,
    RequestBlockHasher,
    block_extra_keys,
    cbor_dumps,
    get_hash_fn,
    hash_block_tokens,
    hash_prompt,
    pickle_dumps,
    root_hash,
)

ROOT_DIR = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Seed "vllm-none-hash"; b0 = tokens 0..15; b1 = tokens 16..31 chained on b0;
# salted = b0 with extra keys (("cache_salt", "tenant-a"),).
VECTORS = {
    "sha256": {
        "root": "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        "b0": "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798",
        "b1": "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629",
        "salted": "255b152c89e763273cf1498dce0dfd4efdf44000fe683cd2af1845b5b8426a35",
    },
    "sha256_cbor": {
        "root": "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        "b0": "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
        "b1": "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
        "salted": "4e31e1ced73eb044a95997f0109d0ddab3d9145878214f1a0ee37c048b397859",
    },
    "xxhash_cbor": {
        "root": "a4e364baa0791a6f63bbf917db9b700d",
        "b0": "f2313f4548e185b1a011187a342021cc",
    },
}


# vLLM's reference functions, written out independently of the code under test.
def _ref_pickle(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _ref_cbor(obj: object) -> bytes:
    return cbor2.dumps(obj, canonical=True)


REFERENCE = {
    "sha256": lambda o: hashlib.sha256(_ref_pickle(o)).digest(),
    "sha256_cbor": lambda o: hashlib.sha256(_ref_cbor(o)).digest(),
    "xxhash": lambda o: xxhash.xxh3_128_digest(_ref_pickle(o)),
    "xxhash_cbor": lambda o: xxhash.xxh3_128_digest(_ref_cbor(o)),
}


# --- vectors and configuration -------------------------------------------------------------

@pytest.mark.parametrize("algo", sorted(VECTORS))
def test_vllm_vectors_byte_for_byte(algo: str) -> None:
    want = VECTORS[algo]
    fn = get_hash_fn(algo)
    root = root_hash(fn, DEFAULT_HASH_SEED)
    b0 = hash_block_tokens(fn, None, range(16))
    assert root.hex() == want["root"]
    assert b0.hex() == want["b0"]
    config = HashConfig(algo)
    assert config.root == root
    assert hash_prompt(config, 16, list(range(16)))[0] == b0
    if "b1" in want:
        b1 = hash_block_tokens(fn, b0, list(range(16, 32)))
        salted = hash_block_tokens(fn, None, list(range(16)), (("cache_salt", "tenant-a"),))
        assert b1.hex() == want["b1"]
        assert salted.hex() == want["salted"]
        assert hash_prompt(config, 16, list(range(32))) == [b0, b1]
        assert hash_prompt(config, 16, list(range(20)), cache_salt="tenant-a") == [salted]


def test_unknown_algorithm_names_the_valid_ones() -> None:
    with pytest.raises(ValueError) as err:
        get_hash_fn("md5")
    message = str(err.value)
    assert "md5" in message
    for algo in HASH_ALGOS:
        assert algo in message
    with pytest.raises(ValueError, match="sha256_cbor"):
        HashConfig(algo="blake3")
    with pytest.raises(ValueError):
        get_hash_fn(["sha256"])  # type: ignore[arg-type]


def test_hash_config_is_frozen_and_fingerprinted() -> None:
    config = HashConfig()
    assert config == HashConfig("sha256", DEFAULT_HASH_SEED)
    assert hash(config) == hash(HashConfig())
    assert config.hash_fn is get_hash_fn("sha256")
    assert config.root is config.root  # computed once, not per access
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.algo = "xxhash"  # type: ignore[misc]
    # Stable across processes and releases: it namespaces Redis keys.
    assert config.fingerprint() == "sha256-066b1e8987e02713"
    prints = {HashConfig(a, s).fingerprint() for a in HASH_ALGOS for s in ("a", "b", "a:b c")}
    assert len(prints) == 3 * len(HASH_ALGOS)
    assert all(p.isprintable() and " " not in p and ":" not in p for p in prints)
    with pytest.raises(ValueError, match="seed"):
        HashConfig(seed=42)  # type: ignore[arg-type]
    shipped = pickle.loads(pickle.dumps(HashConfig("xxhash_cbor", "s")))  # e.g. to a Ray actor
    assert shipped == HashConfig("xxhash_cbor", "s")
    assert shipped.root == HashConfig("xxhash_cbor", "s").root
    assert shipped.hash_fn is get_hash_fn("xxhash_cbor")


def test_explicit_root_and_empty_parent() -> None:
    fn = get_hash_fn("xxhash")
    other_root = root_hash(fn, "other-seed")
    tokens = list(range(100, 116))
    chained = hash_block_tokens(fn, None, tokens, root=other_root)
    assert chained == REFERENCE["xxhash"]((other_root, tuple(tokens), None))
    assert chained == HashConfig("xxhash", "other-seed").hash_block(None, tokens)
    assert hash_block_tokens(fn, b"", tokens) == hash_block_tokens(fn, None, tokens)


def test_custom_hash_fn_takes_the_generic_path() -> None:
    def md5(obj: object) -> bytes:
        return hashlib.md5(pickle.dumps(obj, protocol=5)).digest()

    parent = hash_block_tokens(md5, None, [1, 2, 3])
    assert parent == md5((md5(DEFAULT_HASH_SEED), (1, 2, 3), None))


def test_no_torch_and_no_process_randomness() -> None:
    """The router imports this module: no torch; and hashes do not depend on the process."""
    code = (
        "import sys; from proto.hashing import HashConfig, hash_prompt, HASH_ALGOS\n"
        "assert 'torch' not in sys.modules, 'proto.hashing pulled in torch'\n"
        "print(','.join(hash_prompt(HashConfig(a), 16, list(range(48)), 's')[-1].hex()"
        " for a in HASH_ALGOS))"
    )
    outs = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT_DIR, env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        outs.add(done.stdout.strip())
    here = ",".join(hash_prompt(HashConfig(a), 16, list(range(48)), "s")[-1].hex()
                    for a in HASH_ALGOS)
    assert outs == {here}


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


# --- request hasher ------------------------------------------------------------------------

def _expected_chain(algo: str, block_size: int, tokens: list[int], salt=None, lora=None,
                    mm=()) -> list[bytes]:
    """From scratch, with the reference hash: every block's extra keys then the chain."""
    ref = REFERENCE[algo]
    parent = ref(DEFAULT_HASH_SEED)
    out = []
    for i in range(len(tokens) // block_size):
        begin, end = i * block_size, (i + 1) * block_size
        keys = []
        if lora is not None:
            keys.append(("lora", *lora))
        for ident, start, length in sorted(mm, key=lambda m: m[1]):
            if start < end and start + length > begin:
                keys.append(("mm", ident, start - begin))
        if salt is not None and i == 0:
            keys.append(("cache_salt", salt))
        parent = ref((parent, tuple(tokens[begin:end]), tuple(keys) if keys else None))
        out.append(parent)
    return out


mm_inputs = st.lists(
    st.tuples(st.sampled_from(["img-a", "img-b", "audio"]), st.integers(0, 120),
              st.integers(1, 40)), max_size=3)


@FAST
@given(
    algo=st.sampled_from(HASH_ALGOS),
    block_size=st.sampled_from([1, 2, 4, 16]),
    tokens=st.lists(st.integers(0, 200_000), max_size=130),
    chunks=st.lists(st.integers(1, 40), min_size=1, max_size=20),
    salt=st.one_of(st.none(), st.text(max_size=8)),
    lora=st.one_of(st.none(), st.tuples(st.text(max_size=5), st.text(max_size=10))),
    mm=mm_inputs,
)
def test_request_hasher_streaming_equals_from_scratch(algo, block_size, tokens, chunks, salt,
                                                       lora, mm) -> None:
    config = HashConfig(algo)
    hasher = RequestBlockHasher(config, block_size, salt, lora, mm)
    seen: list[int] = []
    hashes: list[bytes] = []
    pos = k = 0
    while pos < len(tokens):
        step = chunks[k % len(chunks)]
        k += 1
        seen.extend(tokens[pos:pos + step])
        pos += step
        before = len(hashes)
        added = hasher.extend(seen, hashes)
        assert added == len(hashes) - before == len(seen) // block_size - before
    want = _expected_chain(algo, block_size, tokens, salt, lora, mm)
    assert hashes == want
    assert hash_prompt(config, block_size, tokens, salt, lora, mm) == want


def test_only_full_blocks_are_hashed() -> None:
    config = HashConfig()
    hasher = RequestBlockHasher(config, 16)
    hashes: list[bytes] = []
    tokens = list(range(15))
    assert hasher.extend(tokens, hashes) == 0 and hashes == []
    tokens.append(15)
    assert hasher.extend(tokens, hashes) == 1
    first = list(hashes)
    for t in range(16, 31):  # decode steps that complete no block
        tokens.append(t)
        assert hasher.extend(tokens, hashes) == 0
    assert hashes == first
    tokens.extend(range(31, 70))  # a chunk that completes 3 blocks at once, 6 left over
    assert hasher.extend(tokens, hashes) == 3
    assert hashes == hash_prompt(config, 16, tokens) and len(hashes) == 4


def test_salt_on_first_block_only() -> None:
    config = HashConfig("sha256_cbor")
    tokens = list(range(48))
    salted = hash_prompt(config, 16, tokens, cache_salt="tenant-a")
    plain = hash_prompt(config, 16, tokens)
    assert block_extra_keys(0, 16, cache_salt="tenant-a") == (("cache_salt", "tenant-a"),)
    assert block_extra_keys(1, 16, cache_salt="tenant-a") is None
    assert all(s != p for s, p in zip(salted, plain, strict=True))  # the salt flows down the chain
    fn = config.hash_fn
    assert salted[1] == hash_block_tokens(fn, salted[0], tokens[16:32], None)
    assert hash_prompt(config, 16, tokens, cache_salt="tenant-b")[0] != salted[0]


def test_lora_on_every_block() -> None:
    config = HashConfig("xxhash")
    lora = ("sql-adapter", "/adapters/sql")
    tokens = list(range(1000, 1048))
    hashes = hash_prompt(config, 16, tokens, lora=lora)
    parent = None
    for i, h in enumerate(hashes):
        assert block_extra_keys(i, 16, lora=lora) == (("lora", *lora),)
        parent = hash_block_tokens(config.hash_fn, parent, tokens[i * 16:(i + 1) * 16],
                                   (("lora", *lora),))
        assert h == parent
    assert hash_prompt(config, 16, tokens, lora=("other", "/adapters/sql"))[0] != hashes[0]


def test_mm_keys_only_on_overlapping_blocks() -> None:
    mm = [("img", 10, 20)]  # tokens 10..29: blocks 0 and 1 of size 16
    assert block_extra_keys(0, 16, mm_inputs=mm) == (("mm", "img", 10),)
    assert block_extra_keys(1, 16, mm_inputs=mm) == (("mm", "img", -6),)  # began in block 0
    assert block_extra_keys(2, 16, mm_inputs=mm) is None
    assert block_extra_keys(0, 16, mm_inputs=[("a", 0, 16)]) == (("mm", "a", 0),)
    assert block_extra_keys(1, 16, mm_inputs=[("a", 0, 16)]) is None  # ends at the boundary
    # Every kind on block 0, in order: lora, mm (by start), salt.
    both = [("late", 12, 2), ("early", 3, 2)]
    assert block_extra_keys(0, 16, "s", ("l", "p"), both) == (
        ("lora", "l", "p"), ("mm", "early", 3), ("mm", "late", 12), ("cache_salt", "s"))
    config = HashConfig()
    tokens = list(range(64))
    assert hash_prompt(config, 16, tokens, mm_inputs=both) == hash_prompt(
        config, 16, tokens, mm_inputs=list(reversed(both)))
    with_mm = hash_prompt(config, 16, tokens, mm_inputs=[("img", 40, 4)])
    plain = hash_prompt(config, 16, tokens)
    assert with_mm[:2] == plain[:2] and with_mm[2] != plain[2]


def test_seeds_and_algorithms_give_different_chains() -> None:
    tokens = list(range(64))
    chains = [hash_prompt(HashConfig(a, s), 16, tokens)
              for a in HASH_ALGOS for s in (DEFAULT_HASH_SEED, "pagekv-cluster-2")]
    every_hash = [h for chain in chains for h in chain]
    assert len(set(every_hash)) == len(every_hash)


@pytest.mark.parametrize("kwargs", [
    {"block_size": 0},
    {"block_size": 16, "mm_inputs": [("img", 3, 0)]},
    {"block_size": 16, "mm_inputs": [("img", -1, 4)]},
    {"block_size": 16, "mm_inputs": [("img", 3)]},
    {"block_size": 16, "lora": ("only-name",)},
    {"block_size": 16, "cache_salt": 5},
])
def test_bad_request_inputs_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RequestBlockHasher(HashConfig(), **kwargs)
