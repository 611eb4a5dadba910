"""The SSD tier on a full disk: it shrinks its budget to what fits, evicts, keeps serving what it
holds and says so once; a restart recovers every whole entry; a budget larger than the
filesystem is warned about at start-up. On a real 4 MiB tmpfs (mounted here, we are root), and
with ENOSPC injected into os.pwrite for an exact account of one short write.
Fixtures: conftest.py (make_tier); helpers: ssd_fixtures.py.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pagekv.tiers import ssd_space
from pagekv.tiers.ssd import SsdTier
from pagekv.tiers.ssd_batch import Batch
from pagekv.tiers.ssd_format import align_up, entry_header_size
from pagekv.tiers.ssd_writer import SsdWriter
from tests.unit.ssd_fixtures import BB, LAYOUT, MiB, block, h, segment_files, small_tmpfs

FOOT = align_up(BB + entry_header_size(32, 0, 0))  # one block's entry on disk, padding included
FILL = 400  # blocks: more than 4 MiB of entries (about 340 fit)


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("pagekv.tiers.ssd") and r.levelno >= logging.WARNING
            and text in r.getMessage()]


def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("pagekv.tiers") and r.levelno >= logging.ERROR]


def _index_of(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big")


def _put_rounds(tier: SsdTier, blocks: range, every: int = 32) -> None:
    """Put the blocks, flushing after every `every` of them (and at the end)."""
    for n, i in enumerate(blocks, 1):
        tier.put(h(i), block(i))
        if n % every == 0:
            assert tier.flush(30)
    assert tier.flush(30)


def _reads_back_exactly(tier: SsdTier) -> int:
    """Every block the tier says it holds reads back as written; returns how many."""
    held = tier.keys()
    for block_hash, got in zip(held, tier.get_many(held), strict=True):
        assert got is not None, block_hash.hex()[:16]
        assert torch.equal(got, block(_index_of(block_hash)))
    return len(held)


@pytest.fixture
def on_small_fs(tmp_path: Path) -> Iterator[Callable[..., SsdTier]]:
    """SsdTiers (64 MiB budget unless told) on a real 4 MiB filesystem; closed before it is
    unmounted."""
    made: list[SsdTier] = []
    with small_tmpfs(tmp_path / "fs") as fs:

        def make(**kw: object) -> SsdTier:
            kw.setdefault("capacity_bytes", 64 * MiB)
            tier = SsdTier(fs, block_bytes=BB, layout=LAYOUT, **kw)  # type: ignore[arg-type]
            made.append(tier)
            return tier

        try:
            yield make
        finally:
            for tier in made:
                tier.close()


# --- a real full filesystem ---------------------------------------------------------------------
def test_full_disk_shrinks_the_budget_evicts_and_keeps_serving(
    on_small_fs: Callable[..., SsdTier], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    tier = on_small_fs()
    _put_rounds(tier, range(FILL))
    st = tier.stats()
    assert not tier.disabled and st["disabled"] == 0
    assert st["disk_full_events"] >= 1
    assert st["configured_capacity_bytes"] == 64 * MiB
    assert tier.capacity_bytes <= 4 * MiB  # the effective budget: what the filesystem holds
    assert tier.used_bytes <= tier.capacity_bytes
    assert sum(p.stat().st_size for p in segment_files(tier)) == tier.used_bytes  # no torn tail
    held_at_full = _reads_back_exactly(tier)
    assert held_at_full > 200  # the entries that landed are kept, not dropped with the tier
    lost = set(tier.take_dropped())
    assert lost and all(tier.get(b) is None for b in lost)  # cut short: never served

    # It goes on: the oldest blocks make room for new ones, within the shrunk budget.
    _put_rounds(tier, range(FILL, FILL + 200))
    assert not tier.disabled
    assert tier.stats()["evictions"] > 0
    assert not tier.contains(h(0))
    assert all(tier.contains(h(i)) for i in range(FILL + 200 - 32, FILL + 200))
    assert tier.used_bytes <= tier.capacity_bytes
    assert _reads_back_exactly(tier) > 200
    full = _lines(caplog, "disk full")
    assert len(full) == 1, full  # said once, with the real error
    assert "[Errno 28] No space left on device" in full[0] and "Errno 5" not in full[0]
    assert "64.0 to" in full[0]
    assert not _errors(caplog)


def test_restart_on_the_full_disk_recovers_every_whole_entry(
    on_small_fs: Callable[..., SsdTier], caplog: pytest.LogCaptureFixture
) -> None:
    tier = on_small_fs()
    _put_rounds(tier, range(FILL))
    assert tier.stats()["disk_full_events"] >= 1
    held = set(tier.keys())
    tier.close()

    caplog.clear()
    caplog.set_level(logging.INFO)
    again = on_small_fs()
    assert not again.disabled
    st = again.stats()
    assert set(again.keys()) == held  # nothing good discarded because a write was short
    assert st["recovered_entries"] == len(held)
    assert st["torn_entries"] == 0 and st["checksum_failures"] == 0
    assert _reads_back_exactly(again) == len(held)
    assert len(_lines(caplog, "is more than the filesystem can give it")) == 1
    # Still (nearly) full, still on: write until it hits the end of the disk again, then the
    # next round replaces the oldest blocks.
    start = FILL
    while again.stats()["disk_full_events"] == 0 and start < FILL + 20 * 32:
        _put_rounds(again, range(start, start + 32))
        start += 32
    assert again.stats()["disk_full_events"] >= 1
    _put_rounds(again, range(start, start + 32))
    assert not again.disabled
    assert all(again.contains(h(i)) for i in range(start, start + 32))
    assert _reads_back_exactly(again) > 200
    assert not _errors(caplog)


def test_budget_over_the_filesystem_warns_at_start_up(
    on_small_fs: Callable[..., SsdTier], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    on_small_fs(capacity_bytes=2 * MiB).close()  # fits: no warning
    assert not _lines(caplog, "more than the filesystem")
    tier = on_small_fs()
    warned = _lines(caplog, "more than the filesystem")
    assert len(warned) == 1 and "64.0 MiB" in warned[0]
    assert not tier.disabled and tier.capacity_bytes == 64 * MiB  # warned, not yet shrunk


# --- ENOSPC injected: one short write, accounted for exactly ------------------------------------
class FakeDisk:
    """os.pwrite on a disk with `room` bytes left: writes what fits, then fails with ENOSPC."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.real = os.pwrite

    def __call__(self, fd: int, data: memoryview, offset: int) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self.real(fd, data[: self.room], offset)
        self.room -= n
        return n


def held_writer(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """(entered, release): the writer sets `entered` at each batch, then waits for `release`."""
    entered, release = threading.Event(), threading.Event()
    real = SsdWriter.write_batch

    async def held(self: SsdWriter, batch: Batch) -> None:
        entered.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
        await real(self, batch)

    monkeypatch.setattr(SsdWriter, "write_batch", held)
    return entered, release


def test_injected_enospc_keeps_whole_entries_cuts_the_tail_and_shrinks(
    make_tier: Callable[..., SsdTier], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    tier = make_tier(batch_bytes=6 * BB)  # a chunk holds 4 entries
    monkeypatch.setattr(ssd_space, "free_bytes", lambda path: 0)  # nothing else is free
    header = tier.used_bytes  # the first segment's header, written at start-up
    disk = FakeDisk(room=FOOT + 2 * FOOT + FOOT // 2)
    monkeypatch.setattr(os, "pwrite", disk)
    entered, release = held_writer(monkeypatch)
    tier.put(h(100), block(100))
    assert entered.wait(30)  # the writer took it alone
    for i in range(4):
        assert tier.put(h(i), block(i))  # one chunk, one write: 2.5 entries land
    release.set()
    assert tier.flush(30)

    assert not tier.disabled
    assert [tier.contains(h(i)) for i in (100, 0, 1, 2, 3)] == [True, True, True, False, False]
    assert tier.get(h(2)) is None  # its first half is on disk: never served
    assert {h(2), h(3)} <= set(tier.take_dropped())
    st = tier.stats()
    assert st["disk_full_events"] == 1
    assert tier.used_bytes == header + 3 * FOOT
    assert tier.capacity_bytes == tier.used_bytes  # held + free (0)
    assert st["configured_capacity_bytes"] == 64 * MiB
    assert [p.stat().st_size for p in segment_files(tier)] == [header + 3 * FOOT]  # tail cut
    assert _reads_back_exactly(tier) == 3
    full = _lines(caplog, "disk full")
    assert len(full) == 1 and "[Errno 28] No space left on device" in full[0]
    assert "Errno 5" not in full[0] and not _errors(caplog)
    tier.close()

    # A restart on the still-full disk: every whole entry back, no tear, and the tier on.
    caplog.clear()
    again = make_tier(batch_bytes=6 * BB)
    assert not again.disabled
    assert set(again.keys()) == {h(100), h(0), h(1)}
    assert again.stats()["torn_entries"] == 0
    assert _reads_back_exactly(again) == 3
    assert len(_lines(caplog, "more than the filesystem")) == 1
    assert len(_lines(caplog, "disk full")) == 1  # its first segment did not fit
    assert len(segment_files(again)) == 1  # the headless file it tried is not left behind

    # Space again (what eviction frees): the oldest go, the new land.
    monkeypatch.setattr(os, "pwrite", disk.real)
    for i in (4, 5):
        assert again.put(h(i), block(i))
    assert again.flush(30)
    assert not again.disabled
    assert set(again.keys()) == {h(4), h(5)}
    assert again.stats()["evictions"] == 3
    assert again.used_bytes <= again.capacity_bytes == header + 3 * FOOT
    assert _reads_back_exactly(again) == 2
    assert not _errors(caplog)


def test_enospc_from_a_sync_keeps_the_tier_on(
    make_tier: Callable[..., SsdTier], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier()
    _put_rounds(tier, range(4))

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdatasync", full)
    caplog.set_level(logging.INFO)
    _put_rounds(tier, range(4, 8))
    _put_rounds(tier, range(8, 12))
    assert not tier.disabled
    assert tier.stats()["disk_full_events"] >= 1
    assert _reads_back_exactly(tier) == 12  # checksums still decide what is served
    assert len(_lines(caplog, "disk full")) == 1 and not _errors(caplog)
