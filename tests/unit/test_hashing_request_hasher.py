"""Block hashing: the request hasher, streaming equals from scratch; only full blocks; where
the extra keys go (salt on the first block, LoRA on every block, multimodal inputs on the
blocks they overlap); chains that must differ; bad inputs. Reference functions:
hashing_reference.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagekv.proto.hashing import (
    DEFAULT_HASH_SEED,
    HASH_ALGOS,
    HashConfig,
    RequestBlockHasher,
    block_extra_keys,
    hash_block_tokens,
    hash_prompt,
)
from tests.unit.hashing_reference import FAST, REFERENCE

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
