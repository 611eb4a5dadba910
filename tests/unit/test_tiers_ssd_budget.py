"""The SSD tier on real files: the byte budget (LRU eviction, dead segments deleted, recency,
a budget shrunk on restart). Fixtures: conftest.py (make_tier,
stalled_sync); helpers: ssd_fixtures.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagekv.tiers.ssd import SsdTier
from tests.unit.ssd_fixtures import BB, MiB, block, h, segment_files


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


# --- budget ---------------------------------------------------------------------------------------
def test_capacity_evicts_lru_and_deletes_dead_segments(make_tier: Callable[..., SsdTier]) -> None:
    capacity = 12 * BB
    tier = make_tier(capacity_bytes=capacity, batch_bytes=BB)
    for i in range(40):
        tier.put(h(i), block(i))
        tier.flush(30)  # one batch per block: eviction decisions at each write
    assert tier.used_bytes <= capacity
    assert sum(p.stat().st_size for p in segment_files(tier)) <= capacity
    assert tier.contains(h(39)) and not tier.contains(h(0))
    held = [i for i in range(40) if tier.contains(h(i))]
    assert held == list(range(held[0], 40))  # the oldest went first
    dropped = tier.take_dropped()
    assert set(dropped) == {h(i) for i in range(held[0])}
    assert tier.stats()["deleted_segments"] > 0
    got = tier.get(h(39))
    assert got is not None and torch.equal(got, block(39))


def test_get_refreshes_recency(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier(capacity_bytes=12 * BB, batch_bytes=BB)
    for i in range(4):
        tier.put(h(i), block(i))
    tier.flush(30)
    assert tier.keys()[0] == h(0)
    tier.get(h(0))
    assert tier.keys()[0] == h(1) and tier.keys()[-1] == h(0)


def test_popped_entries_free_their_segment(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier(capacity_bytes=32 * BB, batch_bytes=BB)  # small segments
    for i in range(16):
        tier.put(h(i), block(i))
        tier.flush(30)
    before = len(segment_files(tier))
    assert before > 1
    tier.pop_many([h(i) for i in range(16)])
    assert wait_until(lambda: len(segment_files(tier)) < before)
    assert wait_until(lambda: tier.used_bytes < 4 * BB)


def test_shrunk_budget_on_restart_evicts_oldest(make_tier: Callable[..., SsdTier], tmp_path: Path) -> None:
    tier = make_tier(capacity_bytes=64 * MiB, segment_bytes=2 * BB)
    for i in range(12):
        tier.put(h(i), block(i))
    tier.close()
    again = make_tier(capacity_bytes=6 * BB)
    assert again.used_bytes <= 6 * BB
    assert again.contains(h(11)) and not again.contains(h(0))

