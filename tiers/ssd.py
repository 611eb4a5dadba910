"""The SSD tier: blocks packed into large append-only segment files, LRU within a byte budget.

`SsdTier` is what the chain sees (a `tiers.base.Tier`); each of its parts has a module:
`ssd_format` + `codec` (the bytes on disk: self-describing entries, checksums, never pickles),
`ssd_ring` (the write-behind backlog `put` copies into: it never waits for the disk),
`ssd_writer` + `ssd_batch` (the task that turns the ring into writes, compressed where that
pays), `ssd_files` (segment files, O_DIRECT, fdatasync, deletion), `ssd_index` (where each
written block is, LRU first, and the byte budget), `ssd_reader` (verified, concurrent reads)
and `ssd_recovery` (the start-up scan: the segments are the log, there is no manifest) and
`ssd_space` (the budget against the filesystem: a full disk shrinks it).

Files: `<directory>/layout-<layout id>/seg-<seq>.pkv`, one sub-directory per KV layout, so a
pod restarted with another model never mixes blocks. `<directory>` belongs to one tier at a
time (`dir_lock`, held for the tier's life): a second pod given it is refused at start.

Threads: an asyncio loop runs in one background thread (`proto.loop_thread`); aiofiles runs
the blocking file calls on a small executor, also the loop's default one. The books (ring,
index, counters, flags) are under one lock, `_lock`, which callers' threads and the loop thread
take alike, never across an await; so a block moves from the ring to the index atomically.

Failure: a full disk (ENOSPC) is an operating condition: the whole entries of a short write
are kept, the budget shrinks to what fits and the tier goes on (`ssd_space`). EIO or an
unwritable directory disable the tier with one `logger.error` line; from then on every lookup
misses and every put is refused. Nothing raises to callers. Blocks the tier lost without being
asked (evicted, corrupt, cut short, disabled) are queued for `take_dropped()`, which the chain
drains to publish removals and drop orphans.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiofiles.os
import torch

from pagekv.proto.loop_thread import LoopThread
from pagekv.proto.medium import Medium
from pagekv.proto.retention import RetentionTable
from pagekv.tiers.base import BlockData, RecoveredEntry, Tier, as_uint8_tensor
from pagekv.tiers.codec import (
    DEFAULT_MIN_RATIO,
    canonical_dtype,
    dtype_code,
    elem_size_of,
)
from pagekv.tiers.dir_lock import DirectoryInUse, DirectoryLock
from pagekv.tiers.ssd_batch import BatchEncoder
from pagekv.tiers.ssd_files import SegmentFiles, segment_header
from pagekv.tiers.ssd_format import (
    MAX_ENTRY_HEADER_LEN,
    MAX_LAYOUT_LEN,
    align_up,
    canonical_layout,
    check_entry_fields,
    entry_header_size,
    layout_id_of,
)
from pagekv.tiers.ssd_index import SsdIndex
from pagekv.tiers.ssd_reader import SsdReader
from pagekv.tiers.ssd_recovery import recover
from pagekv.tiers.ssd_ring import PendingRing
from pagekv.tiers.ssd_space import DiskSpace, room_for, segment_bytes_for
from pagekv.tiers.ssd_writer import SsdWriter

logger = logging.getLogger(__name__)

MiB = 1 << 20
_COUNTERS = (
    "puts", "put_drops", "entries_written", "compressed_entries", "dead_entries_written",
    "bytes_written", "raw_bytes_written", "encode_seconds", "write_seconds", "syncs",
    "reads", "read_hits", "bytes_read", "read_seconds", "evictions",
    "checksum_failures", "torn_entries", "read_errors", "recovered_entries",
    "discarded_segments", "deleted_segments", "disk_full_events",
)  # fmt: skip


class SsdTier(Tier):
    medium = Medium.DISK

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        block_bytes: int,
        layout: dict[str, Any] | str,
        *,
        dtype: str | None = None,
        segment_bytes: int = 64 * MiB,
        batch_bytes: int = 16 * MiB,
        max_pending_bytes: int = 256 * MiB,
        compress: bool = True,
        min_ratio: float = DEFAULT_MIN_RATIO,
        io_threads: int = 4,
        read_chunk_bytes: int = 8 * MiB,
        sync: bool = True,
        sync_delay_s: float = 1.0,
        direct_io: bool | None = None,
        retention: RetentionTable | None = None,
        retained_cap_bytes: int = 0,
    ) -> None:
        """`sync`: fdatasync sealed segments, on `flush()`/`close()`, and `sync_delay_s` after the
        writer runs out of work. `direct_io`: None tries O_DIRECT, falls back to buffered I/O.
        `retention`: eviction passes over the blocks it holds, up to `retained_cap_bytes`."""
        if block_bytes <= 0 or capacity_bytes < 0:
            raise ValueError(f"need block_bytes > 0 and capacity_bytes >= 0, got {block_bytes}, {capacity_bytes}")
        self.block_bytes = block_bytes
        self.layout_bytes = canonical_layout(layout)
        if len(self.layout_bytes) > MAX_LAYOUT_LEN:
            raise ValueError(f"layout descriptor too large ({len(self.layout_bytes)} bytes)")
        self.layout_id = layout_id_of(self.layout_bytes)
        if dtype is None and isinstance(layout, dict):
            dtype = layout.get("dtype")
        self.dtype = canonical_dtype(str(dtype)) if dtype is not None else "uint8"
        self.directory = Path(directory) / f"layout-{self.layout_id:016x}"
        header = segment_header(self.layout_bytes)
        self._max_entry = align_up(block_bytes + MAX_ENTRY_HEADER_LEN)
        room = room_for(self.directory, capacity_bytes)  # a budget past the disk sizes nothing
        seg_bytes = segment_bytes_for(room, segment_bytes, len(header) + self._max_entry)
        self.batch_bytes = align_up(max(self._max_entry, min(batch_bytes, seg_bytes)))
        io_threads = max(1, io_threads)

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._c: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self._ring = PendingRing(self.batch_bytes, max_pending_bytes)
        self.max_pending_bytes = self._ring.max_bytes
        self._index = SsdIndex(capacity_bytes, self._c,
                               lambda: self._files.schedule_reclaim_locked(),
                               retention, retained_cap_bytes // block_bytes)
        self._recovered: dict[bytes, RecoveredEntry] = {}
        self._disabled = False
        self._closing = False
        self._closed = False

        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="pagekv-ssd-io")
        self._loop = LoopThread("pagekv-ssd", self._executor)
        self._files = SegmentFiles(
            self._loop, self.directory, header, seg_bytes, books_lock=self._lock,
            index=self._index, sync=sync, direct_io=direct_io is not False and hasattr(os, "O_DIRECT"),
            counters=self._c, on_error=self._io_error,
        )  # fmt: skip
        self._space = DiskSpace(
            self.directory, index=self._index, files=self._files, books_lock=self._lock,
            counters=self._c, wanted_segment_bytes=segment_bytes,
            smallest_segment_bytes=len(header) + self._max_entry,
        )  # fmt: skip
        elem_size = elem_size_of(self.dtype)
        self._reader = SsdReader(
            self._loop, self._files, cond=self._cond, ring=self._ring, index=self._index,
            remove_locked=self._remove_locked, counters=self._c, block_bytes=block_bytes,
            layout_id=self.layout_id, elem_size=elem_size,
            read_chunk_bytes=align_up(max(self._max_entry, read_chunk_bytes)), buffers=io_threads,
        )  # fmt: skip
        encoder = BatchEncoder(
            layout_id=self.layout_id, dtype_code=dtype_code(self.dtype), elem_size=elem_size,
            compress=compress, min_ratio=min_ratio, threads=io_threads,
            batch_bytes=self.batch_bytes,
        )  # fmt: skip
        self._writer = SsdWriter(
            self._loop, cond=self._cond, ring=self._ring, index=self._index, encoder=encoder,
            files=self._files, closing=lambda: self._closing,
            on_error=self._io_error, counters=self._c, sync_delay_s=sync_delay_s,
        )  # fmt: skip
        self._dir_lock: DirectoryLock | None = None
        try:
            # Before the segments are read: a directory another pod writes is not ours.
            self._dir_lock = _lock_directory(Path(directory))
            self._loop.run(self._start())
        except BaseException:
            self._release_directory()
            self._loop.stop()
            self._executor.shutdown(wait=False)
            raise

    # --- sizes and state -------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """The budget in effect: the configured one, less what a full disk took (ssd_space)."""
        return self._index.capacity

    @property
    def segment_bytes(self) -> int:
        return self._files.segment_bytes

    @property
    def used_bytes(self) -> int:
        return self._index.disk_bytes

    @property
    def pending_bytes(self) -> int:
        return self._ring.nbytes

    @property
    def num_entries(self) -> int:
        return len(self._index) + len(self._ring)

    @property
    def num_free_slots(self) -> int:
        """Blocks the write-behind ring has room for now, counting the largest entry for each
        (disk space is made when they are written)."""
        with self._lock:
            if self._disabled or self._closing:
                return 0
            return self._ring.free_slots(self._max_entry)

    @property
    def disabled(self) -> bool:
        return self._disabled

    @property
    def direct_io(self) -> bool:
        return self._files.direct_io

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._ring or block_hash in self._index

    def keys(self) -> list[bytes]:
        with self._lock:
            return [*self._index.entries, *self._ring.entries]

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._c)
            out.update(
                entries=len(self._index) + len(self._ring),
                pending_entries=len(self._ring),
                pending_bytes=self._ring.nbytes,
                used_bytes=self._index.disk_bytes,
                capacity_bytes=self._index.capacity,
                configured_capacity_bytes=self._space.configured,
                segments=len(self._index.segments),
                direct_io=int(self._files.direct_io),
                disabled=int(self._disabled),
            )
            return out

    def take_dropped(self) -> list[bytes]:
        """Hashes the tier lost on its own (eviction, corruption, disabling) since the last call."""
        with self._lock:
            out, self._index.dropped = self._index.dropped, []
            return out

    def take_recovered(self) -> list[RecoveredEntry]:
        """Blocks found on disk at start-up and still held, oldest first (returned once)."""
        with self._lock:
            out = [r for h, r in self._recovered.items() if h in self._index]
            self._recovered.clear()
            return out

    # --- public operations (any thread but the tier's own) -----------------------------------
    def put(
        self,
        block_hash: bytes,
        data: BlockData,
        parent_hash: bytes | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> bool:
        """Copy a block into the write-behind ring; returns at once (no disk I/O).

        False if refused: disabled, or the backlog is full because the disk is behind.
        """
        if self._disabled or self._closing:
            return False
        src = as_uint8_tensor(data, self.block_bytes)
        tokens = tuple(token_ids or ())
        check_entry_fields(block_hash, parent_hash, tokens)  # here, not in the writer thread
        header_len = entry_header_size(len(block_hash), len(parent_hash or b""), len(tokens))
        with self._lock:
            if self._disabled:
                return False
            if block_hash in self._ring or self._index.touch(block_hash):
                return True  # same hash, same content
            # The copy, under the lock so no reader sees a half-copied block; the caller may
            # overwrite its block as soon as we return. The writer fills in the header.
            arr = src.numpy() if src.device.type == "cpu" else src.cpu().numpy()
            if self._ring.reserve(block_hash, parent_hash, tokens, header_len, arr) is None:
                self._c["put_drops"] += 1  # the disk is behind: refuse rather than grow memory
                return False
            self._c["puts"] += 1
            wake = self._writer.wake_needed_locked()
        if wake:
            self._writer.wake()
        return True

    def _fetch(self, block_hashes: Sequence[bytes], remove: bool) -> list[torch.Tensor | None]:
        if self._disabled or self._closing:
            return [None] * len(block_hashes)
        return self._reader.fetch(block_hashes, remove)

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        return self._fetch([block_hash], remove=False)[0]

    def pop(self, block_hash: bytes) -> torch.Tensor | None:
        return self._fetch([block_hash], remove=True)[0]

    def get_many(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Read several blocks concurrently (adjacent entries in one read); blocks stay."""
        return self._fetch(block_hashes, remove=False)

    def pop_many(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Remove several blocks and return their data (None for misses and corrupt entries)."""
        return self._fetch(block_hashes, remove=True)

    def pop_lru(self) -> tuple[bytes, torch.Tensor] | None:
        """Remove the least recently used block and return it (read back from the disk); a
        block that fails its read is dropped (see take_dropped) and the next one tried."""
        while True:
            with self._lock:
                if self._disabled or self._closing:
                    return None
                block_hash = self._index.lru() or next(iter(self._ring.entries), None)
            if block_hash is None:
                return None
            data = self.pop(block_hash)
            if data is not None:
                return block_hash, data

    def touch(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._ring or self._index.touch(block_hash)

    def remove(self, block_hash: bytes) -> bool:
        with self._lock:
            return self._remove_locked(block_hash)

    def clear(self) -> list[bytes]:
        """Drop every block (files are deleted in the background); return their hashes."""
        with self._lock:
            hashes = [*self._index.entries, *self._ring.entries]
            for h in hashes:
                self._remove_locked(h)
            return hashes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted put is written and synced (or dropped). False on timeout."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._disabled or self._closed
                                       or not (self._ring or self._writer.busy), timeout)
        if done and not (self._disabled or self._closed):
            self._loop.run(self._files.sync_now(), timeout)
        return done

    def close(self, timeout: float | None = 60.0) -> None:
        """Flush, stop the writer and the loop thread. Idempotent."""
        if self._closed or self._closing:
            return
        self.flush(timeout)
        self._closing = True
        try:
            self._loop.run(self._shutdown(), timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._loop.stop(timeout)
            self._executor.shutdown(wait=False)
            self._release_directory()  # after the last write: the next holder may start

    def __enter__(self) -> SsdTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release_directory(self) -> None:
        if self._dir_lock is not None:
            self._dir_lock.release()

    # --- bookkeeping (callers hold _lock) ----------------------------------------------------
    def _remove_locked(self, block_hash: bytes) -> bool:
        if self._ring.remove(block_hash):
            self._cond.notify_all()  # flush() may be waiting for the ring to empty
            return True
        return self._index.remove(block_hash)

    def _io_error(self, what: str, exc: BaseException) -> None:
        """A failed write or sync, from the writer or the files: a full disk shrinks the
        budget, anything else disables the tier."""
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            self._space.full(what, exc)
        else:
            self._disable(what, exc)

    def _disable(self, what: str, exc: BaseException | None) -> None:
        with self._cond:
            if self._disabled:
                return
            self._disabled = True
            self._index.dropped.extend([*self._index.drop_all(), *self._ring.drop_all()])
            # One line, no traceback: an operating condition, not a bug. Logged before anyone
            # waiting in flush() can see the tier disabled.
            logger.error("SSD tier at %s disabled, continuing without it (lookups miss, puts "
                         "are dropped): %s: %s", self.directory, what, exc)
            self._cond.notify_all()

    # --- start and stop (the loop thread) ----------------------------------------------------
    async def _start(self) -> None:
        try:
            await aiofiles.os.makedirs(self.directory, exist_ok=True)
            self._recovered = await recover(
                self._files, self._index, self._lock, self._c,
                layout_id=self.layout_id, block_bytes=self.block_bytes,
            )  # fmt: skip
            self._space.check_at_start()
            async with self._files.lock:
                try:  # eagerly: proves the directory is writable now
                    await self._files.open_segment()
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    self._space.full("starting a segment", exc)  # full, yet it serves what it holds
        except OSError as exc:
            self._disable("cannot use the directory", exc)
        self._writer.start()
        logger.info("SSD tier at %s: %d blocks recovered, %.1f of %.1f MiB used, segments of "
                    "%.1f MiB, %s I/O", self.directory, len(self._index),
                    self._index.disk_bytes / MiB, self._index.capacity / MiB,
                    self.segment_bytes / MiB, "direct" if self._files.direct_io else "buffered")

    async def _shutdown(self) -> None:
        await self._writer.stop()
        await self._files.shutdown()


def _lock_directory(directory: Path) -> DirectoryLock | None:
    """The directory's lock, for the tier's life. Held by another process: DirectoryInUse,
    raised (the pod must not start). Not lockable (unwritable, no flock on this filesystem):
    None and a warning; the tier then goes on as it would have, and disables itself if the
    directory cannot be used at all."""
    try:
        return DirectoryLock(directory)
    except DirectoryInUse:
        raise
    except OSError as exc:
        logger.warning("SSD tier: cannot lock %s (%s); going on unlocked: another process "
                       "given this directory would not be refused", directory, exc)
        return None
