"""Blocks on the wire between pods (tiers/peer_entries.py): an entry round-trips, and every
kind of damage or mix-up is refused with the reason the puller's metrics count."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from pagekv.tiers.codec import CODEC_LZ4_SHUFFLE, CODEC_RAW
from pagekv.tiers.peer_entries import (
    EntryRejected,
    KvLayout,
    pack_block,
    unpack_block,
    unpack_chain,
)
from pagekv.tiers.ssd_format import ENTRY_FIXED_LEN, parse_entry_header

SHAPE = {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_size": 16,
         "dtype": "float16", "model": "test-model"}
ELEMS = 2 * 2 * 16 * 2 * 16  # layers x K/V x tokens x heads x head size
LAYOUT = KvLayout.of(SHAPE, elem_size=2, block_bytes=ELEMS * 2)


def h(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def noisy_block(seed: int = 0) -> np.ndarray:
    """Random halves: LZ4 cannot shrink them, so compress=True falls back to raw."""
    return np.random.default_rng(seed).standard_normal(ELEMS).astype(np.float16)


def smooth_block() -> np.ndarray:
    """Few distinct values: the byte planes compress well."""
    return (np.arange(ELEMS) % 4).astype(np.float16) * np.float16(0.5)


def rejected(entry: bytes, block_hash: bytes, parent: bytes | None,
             layout: KvLayout = LAYOUT) -> str:
    with pytest.raises(EntryRejected) as info:
        unpack_block(layout, entry, block_hash, parent)
    return info.value.reason


def flip(entry: bytes, pos: int) -> bytes:
    buf = bytearray(entry)
    buf[pos] ^= 0x40
    return bytes(buf)


@pytest.mark.parametrize("parent", [None, h("parent")])
def test_raw_round_trip(parent):
    data = noisy_block()
    entry = pack_block(LAYOUT, h("b"), parent, data)
    hdr = parse_entry_header(entry)
    assert hdr.codec == CODEC_RAW and hdr.parent_hash == parent
    assert len(entry) == hdr.header_len + LAYOUT.block_bytes
    out = unpack_block(LAYOUT, entry, h("b"), parent)
    assert out.dtype == np.uint8 and out.size == LAYOUT.block_bytes
    assert np.array_equal(out.view(np.float16), data)


def test_compressed_round_trip_is_smaller():
    data = smooth_block()
    raw = pack_block(LAYOUT, h("b"), None, data)
    packed = pack_block(LAYOUT, h("b"), None, data, compress=True)
    assert parse_entry_header(packed).codec == CODEC_LZ4_SHUFFLE
    assert len(packed) < len(raw) // 2
    out = unpack_block(LAYOUT, packed, h("b"), None)
    assert np.array_equal(out.view(np.float16), data)


def test_compress_falls_back_to_raw_on_noise():
    data = noisy_block(1)
    entry = pack_block(LAYOUT, h("b"), None, data, compress=True)
    assert parse_entry_header(entry).codec == CODEC_RAW
    assert np.array_equal(unpack_block(LAYOUT, entry, h("b"), None).view(np.float16), data)


def test_wrong_sized_block_is_not_packed():
    with pytest.raises(ValueError, match="bytes"):
        pack_block(LAYOUT, h("b"), None, noisy_block()[:-1])


@pytest.mark.parametrize("compress", [False, True])
def test_flipped_payload_byte_is_a_checksum_failure(compress):
    entry = pack_block(LAYOUT, h("b"), h("p"), smooth_block(), compress)
    hdr = parse_entry_header(entry)
    for pos in (hdr.header_len, hdr.header_len + hdr.payload_len // 2, len(entry) - 1):
        assert rejected(flip(entry, pos), h("b"), h("p")) == "checksum"


def test_flipped_header_bytes_are_checksum_failures():
    entry = pack_block(LAYOUT, h("b"), h("p"), noisy_block())
    header_len = parse_entry_header(entry).header_len
    # magic, codec, a length field, inside the block hash, the header checksum itself
    for pos in (0, 6, 20, ENTRY_FIXED_LEN + 3, header_len - 1):
        assert rejected(flip(entry, pos), h("b"), h("p")) == "checksum", pos


def test_truncated_entries_are_checksum_failures():
    entry = pack_block(LAYOUT, h("b"), None, noisy_block())
    header_len = parse_entry_header(entry).header_len
    for cut in (len(entry) - 1, header_len + 1, header_len, header_len - 1, 10, 0):
        assert rejected(entry[:cut], h("b"), None) == "checksum", cut
    # and bytes past its end are not silently ignored
    assert rejected(entry + b"\0", h("b"), None) == "checksum"


def test_another_block_or_parent_is_a_hash_mismatch():
    entry = pack_block(LAYOUT, h("b"), h("p"), noisy_block())
    assert rejected(entry, h("other"), h("p")) == "hash_mismatch"
    assert rejected(entry, h("b"), h("other parent")) == "hash_mismatch"
    assert rejected(entry, h("b"), None) == "hash_mismatch"  # asked as the chain's root
    root = pack_block(LAYOUT, h("b"), None, noisy_block())
    assert rejected(root, h("b"), h("p")) == "hash_mismatch"


def test_another_layout_or_block_size_is_a_config_mismatch():
    entry = pack_block(LAYOUT, h("b"), None, noisy_block())
    other_model = KvLayout.of({**SHAPE, "model": "another"}, 2, LAYOUT.block_bytes)
    assert other_model.layout_id != LAYOUT.layout_id
    assert rejected(entry, h("b"), None, other_model) == "config_mismatch"
    # same layout descriptor, another block size in bytes
    bigger = KvLayout(LAYOUT.json, LAYOUT.layout_id, "float16", 2, LAYOUT.block_bytes * 2)
    assert rejected(entry, h("b"), None, bigger) == "config_mismatch"
    other_tokens = KvLayout.of({**SHAPE, "block_size": 32}, 2, LAYOUT.block_bytes * 2)
    big_entry = pack_block(other_tokens, h("b"), None, np.zeros(ELEMS * 2, np.float16))
    assert rejected(big_entry, h("b"), None) == "config_mismatch"


def test_chain_checks_each_parent_link():
    blocks = [noisy_block(i) for i in range(3)]
    names = [h(f"b{i}") for i in range(3)]
    entries = [pack_block(LAYOUT, names[i], names[i - 1] if i else None, blocks[i])
               for i in range(3)]
    out = unpack_chain(LAYOUT, entries, names, None)
    assert all(np.array_equal(o.view(np.float16), b) for o, b in zip(out, blocks, strict=True))
    # the middle entry out of place: the chain breaks there
    with pytest.raises(EntryRejected) as info:
        unpack_chain(LAYOUT, [entries[0], entries[2], entries[1]], names, None)
    assert info.value.reason == "hash_mismatch"
