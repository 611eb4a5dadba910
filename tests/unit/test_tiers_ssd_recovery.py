"""The SSD tier on real files: warm restart (blocks and their metadata come back; another
layout sees none) and corruption (a torn tail, flipped payload and header bytes). Fixtures: conftest.py (make_tier,
stalled_sync); helpers: ssd_fixtures.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from pagekv.tiers import ssd_format
from pagekv.tiers.ssd import SsdTier
from tests.unit.ssd_fixtures import BB, LAYOUT, MiB, block, h, segment_files, tokens


def entries_in(path: Path) -> list[tuple[int, ssd_format.EntryHeader]]:
    """Walk a segment with the public format helpers: (offset, header) of each entry."""
    data = path.read_bytes()
    _, _, off, align = ssd_format.parse_segment_header(data)
    out = []
    while off < len(data):
        hdr = ssd_format.parse_entry_header(data[off : off + ssd_format.MAX_ENTRY_HEADER_LEN])
        out.append((off, hdr))
        off = ssd_format.align_up(off + hdr.entry_len, align)
    return out


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# --- warm restart and corruption ------------------------------------------------------------------
def test_warm_restart_finds_blocks_with_their_metadata(make_tier: Callable[..., SsdTier], tmp_path: Path) -> None:
    tier = make_tier()
    for i in range(20):
        tier.put(h(i), block(i), h(i - 1) if i else None, tokens(i))
    tier.close()

    again = make_tier()
    assert again.num_entries == 20
    assert again.stats()["recovered_entries"] == 20
    for i in range(20):
        got = again.get(h(i))
        assert got is not None and torch.equal(got, block(i))
    recovered = {r.block_hash: r for r in again.take_recovered()}
    assert recovered[h(5)].parent_hash == h(4)
    assert recovered[h(0)].parent_hash is None
    assert list(recovered[h(5)].token_ids) == tokens(5)
    assert again.take_recovered() == []  # handed over once


def test_another_layout_does_not_see_the_blocks(make_tier: Callable[..., SsdTier], tmp_path: Path) -> None:
    tier = make_tier()
    tier.put(h(1), block(1))
    tier.close()
    other = SsdTier(tmp_path / "ssd", 64 * MiB, BB, {**LAYOUT, "num_layers": 3})
    try:
        assert other.num_entries == 0 and other.get(h(1)) is None
    finally:
        other.close()


def test_torn_tail_is_discarded_on_restart(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier()
    for i in range(10):
        tier.put(h(i), block(i))
    tier.close()
    seg = segment_files(tier)[-1]
    off, hdr = entries_in(seg)[-1]
    os.truncate(seg, off + hdr.header_len + 100)  # the last entry loses most of its payload

    again = make_tier()
    assert again.num_entries == 9
    assert again.stats()["torn_entries"] == 1
    assert again.get(h(9)) is None
    for i in range(9):
        got = again.get(h(i))
        assert got is not None and torch.equal(got, block(i))
    # New blocks go to a fresh segment and survive the next restart.
    again.put(h(50), block(50))
    again.close()
    third = make_tier()
    assert third.num_entries == 10 and third.contains(h(50))


def test_flipped_payload_byte_is_a_counted_miss(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier()
    for i in range(6):
        tier.put(h(i), block(i))
    tier.flush(30)
    seg = segment_files(tier)[0]
    off, hdr = next((o, e) for o, e in entries_in(seg) if e.block_hash == h(2))
    flip_byte(seg, off + hdr.header_len + 100)

    assert tier.get(h(2)) is None  # never wrong data
    stats = tier.stats()
    assert stats["checksum_failures"] == 1
    assert not tier.contains(h(2))
    assert h(2) in tier.take_dropped()
    for i in (0, 1, 3, 4, 5):
        got = tier.get(h(i))
        assert got is not None and torch.equal(got, block(i))


def test_flipped_payload_byte_found_after_restart(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier()
    for i in range(6):
        tier.put(h(i), block(i))
    tier.close()
    seg = segment_files(tier)[0]
    off, hdr = next((o, e) for o, e in entries_in(seg) if e.block_hash == h(4))
    flip_byte(seg, off + hdr.entry_len - 1)

    again = make_tier()
    assert again.contains(h(4))  # the start-up scan reads headers only
    assert again.pop(h(4)) is None
    assert again.stats()["checksum_failures"] == 1
    assert not again.contains(h(4))


def test_flipped_header_byte_skips_only_that_entry(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier()
    for i in range(6):
        tier.put(h(i), block(i))
    tier.close()
    seg = segment_files(tier)[0]
    off, _ = next((o, e) for o, e in entries_in(seg) if e.block_hash == h(2))
    flip_byte(seg, off + 20)  # inside the fixed header fields

    again = make_tier()
    assert again.stats()["checksum_failures"] == 1
    assert not again.contains(h(2))
    for i in (0, 1, 3, 4, 5):  # the scan re-synchronised on the next entry
        got = again.get(h(i))
        assert got is not None and torch.equal(got, block(i))

