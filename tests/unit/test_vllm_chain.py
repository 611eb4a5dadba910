"""The vLLM pod's book (proto/vllm_chain.py): full hashes recomputed from short ones and
checked, refusals by reason, tiers, the bounded memory of released blocks, and the claim
changes it hands the index publisher, each in its chain's bucket."""

from __future__ import annotations

import pytest

from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.index.schema import bucket_of
from pagekv.proto.medium import Medium
from pagekv.proto.vllm_chain import VllmBlockBook
from pagekv.proto.vllm_events import (
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    short_hash,
)

BS = 4
CONFIG = HashConfig("sha256", "seed-1")
TOKENS = list(range(100, 124))  # 6 blocks
FULL = hash_prompt(CONFIG, BS, TOKENS)
SHORT = [short_hash(h) for h in FULL]
BUCKET = bucket_of(FULL[0])  # every block of the chain is filed under block 0's bucket
GPU, CPU, DISK = Medium.GPU.bit, Medium.CPU.bit, Medium.DISK.bit


def changes(hashes: list[bytes], old: int, new: int, bucket: int = BUCKET) -> list:
    return [(h, bucket, old, new) for h in hashes]


def stored(first: int, last: int, *, tokens_from: int | None = None, medium: str = "GPU",
           **kw) -> WireBlockStored:
    """Blocks first..last-1 stored, as vLLM reports them (tokens from the block after the
    parent, which is block tokens_from - 1)."""
    start = first if tokens_from is None else tokens_from
    parent = SHORT[start - 1] if start else None
    return WireBlockStored(SHORT[first:last], parent, TOKENS[start * BS:last * BS], BS,
                           kw.pop("lora_id", None), medium, kw.pop("lora_name", None), **kw)


def book(**kw) -> VllmBlockBook:
    return VllmBlockBook(CONFIG, BS, **kw)


def test_short_hashes_become_the_full_chain() -> None:
    b = book()
    out = b.apply([stored(0, 2), stored(2, 5)])
    assert out == changes(FULL[0:5], 0, GPU)
    assert b.masks() == {h: GPU for h in FULL[:5]}
    assert b.full_state() == {BUCKET: {h.hex(): GPU for h in FULL[:5]}}
    assert b.apply([stored(2, 3)]) == []  # held already: nothing changes
    assert not b.refused


def test_a_block_cached_in_between_is_passed_over() -> None:
    b = book()
    b.apply([stored(0, 2)])
    # Tokens of blocks 2..4, hashes of 2 and 4 only (3 was cached by another request).
    ev = stored(2, 5, tokens_from=2)
    ev.block_hashes = [SHORT[2], SHORT[4]]
    out = b.apply([ev])
    assert not b.refused
    assert out == changes([FULL[2], FULL[4]], 0, GPU)


@pytest.mark.parametrize("config", [HashConfig("sha256", "seed-2"), HashConfig("xxhash", "seed-1")])
def test_another_seed_or_algorithm_is_refused(config: HashConfig) -> None:
    b = VllmBlockBook(config, BS)
    assert b.apply([stored(0, 3)]) == []
    assert b.refused == {"hash_mismatch": 1} and len(b) == 0
    (refusal,) = b.take_refusals()
    assert "block 0" in refusal.detail and "--hash-seed" in refusal.detail
    assert b.take_refusals() == []


def test_refusals_by_reason() -> None:
    b = book()
    assert b.apply([stored(2, 3)]) == []  # its parent was never seen
    bad_size = stored(0, 1)
    bad_size.block_size = 8
    b.apply([bad_size, stored(0, 1, lora_id=3), stored(0, 1, medium="HBM"),
             stored(0, 1, group_idx=1), WireBlockRemoved([SHORT[0]], "GPU", 2)])
    wrong = stored(0, 2)
    wrong.block_hashes = [SHORT[0], SHORT[0] ^ 1]  # the second hash does not follow
    b.apply([wrong])
    assert b.refused == {"unknown_parent": 1, "block_size": 1, "lora": 1, "medium": 1,
                         "kv_group": 2, "hash_mismatch": 1}
    assert len(b) == 0


def test_extra_keys_of_the_event_enter_the_hash() -> None:
    keys = [["my-adapter"], None]  # msgpack lists: hashed as the tuples vLLM hashed
    full0 = CONFIG.hash_block(None, TOKENS[:BS], ("my-adapter",))
    full1 = CONFIG.hash_block(full0, TOKENS[BS:2 * BS], None)
    ev = WireBlockStored([short_hash(full0), short_hash(full1)], None, TOKENS[:2 * BS], BS,
                         None, "GPU", "my-adapter", extra_keys=keys)
    b = book()
    assert b.apply([ev]) == changes([full0, full1], 0, GPU, bucket_of(full0))


def test_tiers_removals_and_a_tokenless_store() -> None:
    b = book()
    b.apply([stored(0, 3)])
    # vLLM's offloading tier: no tokens, no parent; each block keeps the parent it had.
    cpu = WireBlockStored([SHORT[2], SHORT[1], 12345], None, [], 0, None, "CPU", None)
    out = b.apply([cpu])
    assert out == changes([FULL[2], FULL[1]], GPU, GPU | CPU)
    assert b.refused == {"unknown_hash": 1}
    assert b.masks()[FULL[1]] == GPU | CPU
    out = b.apply([WireBlockRemoved([SHORT[1], SHORT[2], 999], "GPU")])
    assert out == changes([FULL[1], FULL[2]], GPU | CPU, CPU)
    assert b.ignored_removals == 1
    assert b.masks() == {FULL[0]: GPU, FULL[1]: CPU, FULL[2]: CPU}
    assert b.apply([WireAllBlocksCleared("CPU")]) == changes(FULL[1:3], CPU, 0)
    assert b.masks() == {FULL[0]: GPU}
    assert b.clear() == changes(FULL[:1], GPU, 0) and len(b) == 0


def test_released_blocks_stay_known_within_the_bound() -> None:
    b = book(recent_blocks=2)
    b.apply([stored(0, 4)])
    b.apply([WireBlockRemoved(SHORT[:4], "GPU")])  # 0 and 1 fall out of the recent blocks
    assert len(b) == 0
    b.apply([stored(4, 5)])  # parent 3: still known
    assert b.refused == {} and len(b) == 1
    b.apply([stored(2, 3)])  # parent 1: forgotten
    assert b.refused == {"unknown_parent": 1}
    # A cleared pod's blocks are known too: a child stored after a clear is accepted.
    b.clear()
    b.apply([stored(5, 6)])
    assert b.refused == {"unknown_parent": 1} and len(b) == 1


def test_the_book_is_bounded() -> None:
    b = book(max_blocks=3)
    b.apply([stored(0, 5)])
    assert len(b) == 3 and b.refused == {"book_full": 2}


def test_digests_on_the_wire_are_taken_as_given() -> None:
    b = book()
    root = WireBlockStored(FULL[:1], None, TOKENS[:BS], BS, None, "DISK", None)
    ev = WireBlockStored(FULL[1:3], FULL[0], TOKENS[BS:3 * BS], BS, None, "DISK", None)
    assert b.apply([root, ev]) == changes(FULL[0:3], 0, DISK)
    short_digest = WireBlockStored([FULL[3][:16]], None, TOKENS[:BS], BS, None, "GPU", None)
    b.apply([short_digest, WireBlockRemoved([FULL[1]], "DISK")])
    assert b.refused == {"hash_length": 1}
    assert b.masks() == {FULL[0]: DISK, FULL[2]: DISK}
    # A run whose parent is not known cannot be placed in its chain's bucket: refused.
    orphan = WireBlockStored(FULL[4:5], FULL[3], TOKENS[4 * BS:5 * BS], BS, None, "GPU", None)
    assert b.apply([orphan]) == []
    assert b.refused == {"hash_length": 1, "unknown_parent": 1}
