"""The SSD tier on real files: write-behind, warm restart, corruption, budget, failures."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tiers import ssd_format
from tiers.ssd import SsdTier

LAYOUT = {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_size": 32, "dtype": "float16"}
BB = 2 * 2 * 16 * 2 * 32 * 2  # layers * (K,V) * tokens * heads * head_size * 2 bytes = 8 KiB
MiB = 1 << 20


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block(i: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(i)
    return torch.randn(BB // 2, generator=gen).half().view(torch.uint8)


def tokens(i: int) -> list[int]:
    return list(range(i * 16, i * 16 + 16))


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[Callable[..., SsdTier]]:
    made: list[SsdTier] = []

    def make(directory: Path | None = None, **kw: object) -> SsdTier:
        kw.setdefault("capacity_bytes", 64 * MiB)
        tier = SsdTier(directory or tmp_path / "ssd", block_bytes=BB, layout=LAYOUT, **kw)  # type: ignore[arg-type]
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def segment_files(tier: SsdTier) -> list[Path]:
    return sorted(Path(tier.directory).glob("seg-*.pkv"))


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


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def stalled_sync(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """While the returned event is clear, the writer stops before each write (starts set)."""
    release = threading.Event()
    release.set()
    real = SsdTier._write_batch

    async def held(self: SsdTier, batch: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
        await real(self, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(SsdTier, "_write_batch", held)
    return release


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


# --- failures -------------------------------------------------------------------------------------
def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "tiers.ssd" and r.levelno >= logging.ERROR]


def test_unwritable_directory_disables_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    caplog.set_level(logging.INFO)
    tier = SsdTier(not_a_dir / "ssd", 64 * MiB, BB, LAYOUT)
    try:
        assert tier.disabled
        assert not tier.put(h(1), block(1))
        assert tier.get(h(1)) is None and tier.pop(h(1)) is None
        assert not tier.contains(h(1))
        assert tier.flush(1)
        errors = _errors(caplog)
        assert len(errors) == 1
        assert "disabled" in errors[0].getMessage() and "\n" not in errors[0].getMessage()
    finally:
        tier.close()


def test_disk_full_disables_with_one_log_line_and_reports_losses(
    make_tier: Callable[..., SsdTier], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier()
    tier.put(h(0), block(0))
    tier.flush(30)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdatasync", full)
    caplog.set_level(logging.INFO)
    accepted = {h(i) for i in range(1, 6) if tier.put(h(i), block(i))}
    assert accepted  # refused only once the failure is known
    assert tier.flush(30)
    assert tier.disabled
    assert tier.stats()["disabled"] == 1
    errors = _errors(caplog)
    assert len(errors) == 1 and "No space left" in errors[0].getMessage()
    # Everything it held is reported lost; from now on it is an always-miss tier.
    assert set(tier.take_dropped()) == {h(0)} | accepted
    assert tier.get(h(0)) is None and not tier.put(h(9), block(9))
    assert len(_errors(caplog)) == 1


def test_wrong_block_size_is_rejected(make_tier: Callable[..., SsdTier]) -> None:
    tier = make_tier()
    with pytest.raises(ValueError, match="blocks of"):
        tier.put(h(1), torch.zeros(10, dtype=torch.uint8))
