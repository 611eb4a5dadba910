"""The SSD tier on real files: basic behaviour (write-behind, reads of pending blocks, the
backlog limit, compression, buffered I/O, the chain's calls). Fixtures: conftest.py (make_tier,
stalled_sync); helpers: ssd_fixtures.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from pagekv.tiers import ssd_format
from pagekv.tiers.ssd import SsdTier
from tests.unit.ssd_fixtures import BB, block, h, segment_files, tokens


# --- basic behaviour -----------------------------------------------------------------------------
def test_put_flush_get_round_trip(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier()
    for i in range(40):
        assert tier.put(h(i), block(i), h(i - 1) if i else None, tokens(i))
    assert tier.flush(30)
    assert tier.num_entries == 40
    assert tier.stats()["entries_written"] == 40
    for i in range(40):
        got = tier.get(h(i))
        assert got is not None and torch.equal(got, block(i))
    assert tier.get(h(999)) is None
    # Many small blocks went into one segment file, not one file per block.
    assert len(segment_files(tier)) == 1


def test_put_does_not_wait_for_the_disk_and_pending_blocks_are_readable(
    make_tier: Callable[..., SsdTier], stalled_sync: threading.Event
) -> None:
    tier = make_tier()
    stalled_sync.clear()
    for i in range(10):
        assert tier.put(h(i), block(i))  # returns although the writer is stuck
    assert tier.stats()["pending_entries"] > 0
    for i in range(10):
        got = tier.get(h(i))
        assert got is not None and torch.equal(got, block(i))
    popped = tier.pop(h(3))
    assert popped is not None and torch.equal(popped, block(3))
    assert not tier.flush(0.05)
    stalled_sync.set()
    assert tier.flush(30)
    assert tier.num_entries == 9 and not tier.contains(h(3))
    got = tier.get(h(9))
    assert got is not None and torch.equal(got, block(9))


def test_backlog_limit_refuses_instead_of_growing(
    make_tier: Callable[..., SsdTier], stalled_sync: threading.Event
) -> None:
    tier = make_tier(max_pending_bytes=4 * BB, batch_bytes=BB)
    stalled_sync.clear()
    results = [tier.put(h(i), block(i)) for i in range(12)]
    assert results[0] and not all(results)
    assert tier.stats()["put_drops"] >= 1
    stalled_sync.set()
    assert tier.flush(30)


def test_put_copies_the_callers_block(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier()
    src = block(1).clone()
    tier.put(h(1), src)
    src.zero_()
    tier.flush(30)
    got = tier.get(h(1))
    assert got is not None and torch.equal(got, block(1))


def test_pop_many_reads_and_removes(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier()
    for i in range(8):
        tier.put(h(i), block(i))
    tier.flush(30)
    got = tier.pop_many([h(2), h(3), h(4), h(100), h(6)])
    assert [g is not None for g in got] == [True, True, True, False, True]
    for i, g in zip((2, 3, 4), got[:3], strict=True):
        assert g is not None and torch.equal(g, block(i))
    assert tier.num_entries == 4
    assert not any(tier.contains(h(i)) for i in (2, 3, 4, 6))


def test_compressible_blocks_are_compressed_and_round_trip(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier()
    data = torch.tensor([0.5, -0.25], dtype=torch.float16).repeat(BB // 4).view(torch.uint8)
    tier.put(h(1), data)
    tier.put(h(2), block(2))  # random fp16: stored raw
    tier.flush(30)
    stats = tier.stats()
    assert stats["compressed_entries"] == 1
    # Entries are 4 KiB-aligned: a raw one takes 12 KiB here, the compressed one a single 4 KiB page.
    assert stats["bytes_written"] == ssd_format.align_up(BB + 1) + ssd_format.ALIGN
    got = tier.get(h(1))
    assert got is not None and torch.equal(got, data)


def test_buffered_io_mode_round_trips_and_restarts(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier(direct_io=False)
    assert tier.stats()["direct_io"] == 0
    for i in range(12):
        tier.put(h(i), block(i))
    tier.flush(30)
    got = tier.pop_many([h(i) for i in range(3)])
    assert all(g is not None and torch.equal(g, block(i)) for i, g in enumerate(got))
    tier.close()
    again = make_tier()  # the format does not depend on the I/O mode
    assert again.num_entries == 12  # popped entries may come back after a restart (see ssd.py)
    got = again.get(h(7))
    assert got is not None and torch.equal(got, block(7))


def test_mixed_batch_with_compressed_and_removed_entries(
    make_tier: Callable[..., SsdTier], stalled_sync: threading.Event
) -> None:
    tier = make_tier()
    zeros = torch.zeros(BB, dtype=torch.uint8)
    stalled_sync.clear()
    tier.put(h(0), block(0))  # taken by the writer at once, held before its write
    for i in range(1, 7):
        tier.put(h(i), zeros if i % 2 else block(i))
    assert tier.pop(h(4)) is not None  # removed while pending: must not be written
    stalled_sync.set()
    assert tier.flush(30)
    assert tier.stats()["compressed_entries"] == 3
    assert not tier.contains(h(4))
    for i in (0, 1, 2, 3, 5, 6):
        got = tier.get(h(i))
        assert got is not None and torch.equal(got, zeros if i % 2 else block(i))


def test_bad_entry_fields_are_rejected_at_put(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier()
    with pytest.raises(ValueError):
        tier.put(b"", block(0))
    with pytest.raises(ValueError):
        tier.put(h(1), block(1), token_ids=[-1])
    with pytest.raises(ValueError):
        tier.put(b"x" * 65, block(1))
    assert tier.put(h(2), block(2)) and tier.flush(30) and not tier.disabled


def test_the_chains_calls_on_a_tier(make_tier: Callable[..., SsdTier]) -> None:
    """pop_lru, put_rows and touch: what tiers.base.Tier declares for the chain."""
    tier = make_tier()
    rows = torch.stack([block(i) for i in range(3)])
    assert tier.put_rows([h(i) for i in range(3)], rows) == 3
    assert tier.flush(30)
    assert tier.touch(h(0)) and not tier.touch(h(99))
    assert tier.keys() == [h(1), h(2), h(0)]
    victim = tier.pop_lru()
    assert victim is not None and victim[0] == h(1) and torch.equal(victim[1], block(1))
    assert tier.remove(h(2))
    assert tier.keys() == [h(0)]
    assert tier.pop_lru() is not None and tier.pop_lru() is None


def test_num_free_slots_is_what_the_backlog_takes(
    make_tier: Callable[..., SsdTier], stalled_sync: threading.Event
) -> None:
    tier = make_tier(max_pending_bytes=4 * BB, batch_bytes=BB)
    stalled_sync.clear()
    free = tier.num_free_slots
    assert free >= 1
    assert all(tier.put(h(i), block(i)) for i in range(free))
    assert tier.num_free_slots == 0 and not tier.put(h(free), block(free))
    stalled_sync.set()
    assert tier.flush(30)
    assert tier.num_free_slots == free

