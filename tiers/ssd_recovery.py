"""The SSD tier's start-up scan: rebuild the index from the segment files themselves.

There is no manifest to keep consistent: the segments *are* the log. Every segment's entry
headers are read (headers only: each has its own checksum), oldest segment first, so a block
written twice is found at its newest copy. A torn tail (zeros, or a length past the end of the
file) ends a segment's scan; a header that fails its checksum is skipped by re-synchronising
on the next valid entry magic. Segments of another layout or format are left alone. Payloads
are not read here: their checksums are verified on every read.

Removals are not logged, so an entry removed before a restart (promoted, evicted) can come
back after it; its bytes are still the KV of its hash, so that costs disk space, not
correctness, and LRU eviction takes care of the space.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from typing import Any

import aiofiles
import aiofiles.os

from pagekv.tiers.base import RecoveredEntry
from pagekv.tiers.ssd_files import SegmentFiles
from pagekv.tiers.ssd_format import (
    ENTRY_MAGIC,
    MAX_ENTRY_HEADER_LEN,
    MAX_LAYOUT_LEN,
    EntryHeader,
    FormatError,
    align_up,
    is_torn,
    parse_entry_header,
    parse_segment_header,
)
from pagekv.tiers.ssd_index import Segment, SsdIndex

logger = logging.getLogger(__name__)


async def recover(
    files: SegmentFiles,
    index: SsdIndex,
    books_lock: threading.Lock,
    counters: dict[str, float],
    *,
    layout_id: int,
    block_bytes: int,
) -> dict[bytes, RecoveredEntry]:
    """Index what the directory holds, within the budget; the blocks found, oldest first."""
    recovered: dict[bytes, RecoveredEntry] = {}
    for seq, path in await files.list_segments():
        st = await aiofiles.os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            logger.warning("SSD tier: %s is not a regular file; ignored", path)
            continue
        seg = Segment(seq, path, size=st.st_size)
        entries = await _scan_segment(seg, layout_id, block_bytes, counters)
        with books_lock:
            index.add_segment(seg)
            for hdr, offset in entries:
                index.add(hdr.block_hash, seg, offset, hdr.entry_len)
                recovered[hdr.block_hash] = RecoveredEntry(hdr.block_hash, hdr.parent_hash, hdr.token_ids)
    with books_lock:
        counters["recovered_entries"] = len(index)
        doomed = index.collect_empty(files.active)
        # Over budget (it may have shrunk since the last run): evict the oldest, leaving room
        # for the segment this run starts.
        evicted, emptied = index.evict(files.header_len)
        for block_hash in evicted:
            recovered.pop(block_hash, None)
    await files.delete(doomed + emptied)
    return recovered


async def _scan_segment(
    seg: Segment, layout_id: int, block_bytes: int, counters: dict[str, float]
) -> list[tuple[EntryHeader, int]]:
    """Headers of the valid entries of one segment, in file order (payloads are not read)."""
    found: list[tuple[EntryHeader, int]] = []
    async with aiofiles.open(seg.path, "rb") as f:
        head = await f.read(min(seg.size, MAX_LAYOUT_LEN + 64))
        try:
            seg_layout, _, first_entry, align = parse_segment_header(head)
        except FormatError as exc:
            logger.warning("SSD tier: %s discarded: %s", seg.path, exc)
            counters["discarded_segments"] += 1
            return found
        if seg_layout != layout_id:
            logger.warning("SSD tier: %s belongs to another layout; discarded", seg.path)
            counters["discarded_segments"] += 1
            return found
        seg.first_entry = first_entry
        offset: int | None = first_entry
        while offset is not None and offset < seg.size:
            remaining = seg.size - offset
            await f.seek(offset)
            chunk = await f.read(min(MAX_ENTRY_HEADER_LEN, remaining))
            hdr: EntryHeader | None = None
            try:
                hdr = parse_entry_header(chunk)
            except FormatError:
                if not is_torn(chunk, remaining):
                    counters["checksum_failures"] += 1
                    logger.warning("SSD tier: %s has a corrupt entry header at %d; skipped",
                                   seg.path, offset)
                    offset = await _resync(f, seg, offset + align, align)
                    continue
            if hdr is None or hdr.entry_len > remaining:
                counters["torn_entries"] += 1
                logger.warning("SSD tier: %s has a torn tail at %d; ignored", seg.path, offset)
                break
            if hdr.layout_id == layout_id and hdr.raw_len == block_bytes:
                found.append((hdr, offset))
            offset = align_up(offset + hdr.entry_len, align)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # headers are not needed again
    return found


async def _resync(f: Any, seg: Segment, offset: int, align: int) -> int | None:
    """The offset of the next aligned entry whose header verifies (rare: after corruption)."""
    await f.seek(offset)
    rest = await f.read(seg.size - offset)
    view = memoryview(rest)
    for pos in range(0, len(rest), align):
        if rest[pos : pos + len(ENTRY_MAGIC)] != ENTRY_MAGIC:
            continue
        try:
            hdr = parse_entry_header(view[pos : pos + MAX_ENTRY_HEADER_LEN])
        except FormatError:
            continue
        if pos + hdr.entry_len <= len(rest):
            return offset + pos
    return None
