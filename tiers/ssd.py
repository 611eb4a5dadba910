"""The SSD tier: blocks packed into large append-only segment files, LRU within a byte budget.

Design (see also `tiers/ssd_format.py` for the bytes on disk):

* Files. `<directory>/layout-<layout id>/seg-<seq>.pkv`, one sub-directory per KV layout so a
  pod restarted with another model never mixes blocks. Segments are written sequentially and
  never rewritten; a write batch packs many encoded entries (up to `batch_bytes`) into one
  aligned staging buffer and writes it with one call.
* Direct I/O. Segments are opened with O_DIRECT where the filesystem allows it (entries are
  4 KiB-aligned, staging buffers are page-aligned and made once at start-up): the page cache
  would be a second copy of what the DRAM tier already caches, and the copy into it costs as
  much as the disk write. Without O_DIRECT (tmpfs, some network filesystems) the tier falls
  back to buffered I/O and drops the pages it wrote or read (POSIX_FADV_DONTNEED).
* Threads. An asyncio loop runs in one background thread; aiofiles runs the blocking file calls
  (open, write, close, scan reads, remove) on a small executor. Block reads go through cached
  read-only aiofiles handles, but read with `os.preadv` on the handle's descriptor inside one
  executor job that also verifies and copies out: aiofiles has no positional read, a shared
  handle's seek+read would race between concurrent reads, and one hop per run instead of five
  (open, seek, read, close, verify) is what keeps reads near device speed on a busy host. `put` copies the block into a pending buffer and wakes the writer: it
  never waits for the disk. Encoding (shuffle + lz4) of batch N+1 overlaps the write of batch N.
  A pending block is readable from the pending buffer until its write lands. Reads split into
  runs of adjacent entries that are read concurrently (one staging buffer each), verified and
  copied out on the executor.
* Durability. The writer `fdatasync`s a segment when it seals it, one second after it runs out
  of work, and on `flush()` / `close()` (so `flush()` returning means durable); never per
  batch, which would cost a journal commit per write. A crash loses at most the unsynced tail,
  which the start-up scan sees as torn (or never sees).
* Manifest. There is none to keep consistent: the segments *are* the log. At start-up every
  segment's entry headers are scanned (headers only; each has its own checksum), which rebuilds
  the index. A torn tail (zeros, or a length past the end of the file) ends a segment's scan; a
  header that fails its checksum is skipped by re-synchronising on the next valid entry magic.
  Payload checksums are verified on every read; a failure is counted, the entry dropped, and
  the read is a miss. Removals are not logged, so an entry removed before a restart (promoted,
  evicted) can come back after it; its bytes are still the KV of its hash, so that costs disk
  space, not correctness, and LRU eviction takes care of the space.
* Budget. `capacity_bytes` bounds the bytes of segment files on disk (headers, padding and holes
  included). Before each batch is written, LRU entries are evicted until the batch fits; a
  segment whose entries are all gone is deleted (no compaction). In the exclusive chain an SSD
  read is a promotion that removes the entry, so LRU order is write order and eviction frees
  whole old segments first.
* Failure. ENOSPC, EIO or an unwritable directory disable the tier with one `logger.error`
  line; from then on every lookup misses and every put is refused. Nothing raises to callers.
  Blocks the tier lost without being asked (evicted, corrupt, disabled) are queued for
  `take_dropped()`, which the chain drains to publish removals and drop orphans.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import re
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiofiles
import aiofiles.os
import numpy as np
import torch

from tiers.base import BlockData, Tier, TierMedium, as_uint8_tensor
from tiers.codec import (
    CODEC_RAW,
    DEFAULT_MIN_RATIO,
    canonical_dtype,
    decode_array,
    dtype_code,
    elem_size_of,
    encode,
)
from tiers.ssd_format import (
    ENTRY_FIXED_LEN,
    ENTRY_MAGIC,
    MAX_ENTRY_HEADER_LEN,
    MAX_HASH_LEN,
    MAX_LAYOUT_LEN,
    MAX_TOKENS,
    EntryHeader,
    FormatError,
    align_up,
    canonical_layout,
    checksum,
    entry_header_len,
    entry_header_size,
    layout_id_of,
    pack_entry_header,
    pack_segment_header,
    parse_entry_header,
    parse_segment_header,
)

logger = logging.getLogger(__name__)

MiB = 1 << 20
_SEG_RE = re.compile(r"^seg-(\d{10})\.pkv$")
_T = TypeVar("_T")
_CORRUPT = "corrupt"  # read result: the bytes arrived but failed verification
MAX_READ_HANDLES = 64  # open read-only segment files kept for reuse


@dataclass(slots=True)
class _Segment:
    seq: int
    path: str
    size: int = 0  # bytes in the file; what counts against the budget
    first_entry: int = 0  # offset of the first entry (after the padded segment header)
    live: int = 0  # indexed entries
    pins: int = 0  # reads in flight: the file must not be deleted under them
    dirty: bool = False  # written since its last fdatasync


@dataclass(slots=True)
class _Loc:
    seg: _Segment
    offset: int  # aligned
    length: int  # header + payload, unpadded


@dataclass(slots=True, eq=False)
class _Chunk:
    """One slice of the pending ring: puts lay entries out here exactly as they go to disk."""

    arr: np.ndarray  # uint8 view of the slice
    view: memoryview  # the same bytes, page-aligned, for the write call
    fill: int = 0  # bytes reserved (aligned)
    entries: list[_Pending] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Pending:
    """A block accepted by put and not on disk yet: its raw payload sits in a chunk."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    chunk: _Chunk
    offset: int  # of the entry (header first) in the chunk
    header_len: int
    nbytes: int

    def payload(self) -> np.ndarray:
        start = self.offset + self.header_len
        return self.chunk.arr[start : start + self.nbytes]


@dataclass(slots=True)
class _Batch:
    """What one write call sends: `view[:size]`, holding `items` (p, offset, length, codec)."""

    chunk: _Chunk
    view: memoryview
    size: int = 0
    items: list[tuple[_Pending, int, int, int]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _ReadHandle:
    f: Any  # aiofiles handle, read-only; positional reads use its descriptor
    users: int = 0


@dataclass(slots=True, frozen=True)
class RecoveredEntry:
    """A block found on disk at start-up (handed to the chain once, for its tree and events)."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


class SsdTier(Tier):
    medium: TierMedium = "DISK"

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
    ) -> None:
        """`sync`: fdatasync sealed segments, on `flush()`/`close()`, and `sync_delay_s` after the
        writer runs out of work. `direct_io`: None tries O_DIRECT, falls back to buffered I/O."""
        if block_bytes <= 0 or capacity_bytes < 0:
            raise ValueError(f"need block_bytes > 0 and capacity_bytes >= 0, got {block_bytes}, {capacity_bytes}")
        self.block_bytes = block_bytes
        self._capacity = capacity_bytes
        self.layout_bytes = canonical_layout(layout)
        if len(self.layout_bytes) > MAX_LAYOUT_LEN:
            raise ValueError(f"layout descriptor too large ({len(self.layout_bytes)} bytes)")
        self.layout_id = layout_id_of(self.layout_bytes)
        if dtype is None and isinstance(layout, dict):
            dtype = layout.get("dtype")
        self.dtype = canonical_dtype(str(dtype)) if dtype is not None else "uint8"
        self._dtype_code = dtype_code(self.dtype)
        self.elem_size = elem_size_of(self.dtype)
        self.compress = compress
        self.min_ratio = min_ratio
        self.sync = sync
        self.sync_delay_s = sync_delay_s
        self.direct_io = direct_io is not False and hasattr(os, "O_DIRECT")
        self.max_pending_bytes = max_pending_bytes
        self.directory = Path(directory) / f"layout-{self.layout_id:016x}"
        header = pack_segment_header(self.layout_bytes)
        self._seg_header = mmap.mmap(-1, align_up(len(header)))  # padded, aligned for O_DIRECT
        self._seg_header.write(header)
        max_entry = align_up(block_bytes + MAX_ENTRY_HEADER_LEN)
        # A small budget gets small segments, so that deleting one frees a useful fraction.
        self.segment_bytes = max(min(segment_bytes, capacity_bytes // 4), len(self._seg_header) + max_entry)
        self.batch_bytes = align_up(max(max_entry, min(batch_bytes, self.segment_bytes)))
        self.read_chunk_bytes = align_up(max(max_entry, read_chunk_bytes))
        # Buffers, made once (anonymous mmaps are page-aligned, as O_DIRECT wants):
        # * the pending ring: `put` copies each block straight to its place in an entry laid
        #   out as on disk, so a raw batch is written from where it was copied, with no second
        #   copy; the ring's size is the write-behind backlog (`max_pending_bytes`);
        # * two output buffers for batches that compress (encode N+1 while N is written);
        # * one read buffer per I/O thread.
        n_chunks = max(2, max_pending_bytes // self.batch_bytes)
        self._ring = mmap.mmap(-1, n_chunks * self.batch_bytes)
        ring = np.frombuffer(self._ring, dtype=np.uint8)
        ring_view = memoryview(self._ring)
        self._chunks = [
            _Chunk(ring[i * self.batch_bytes : (i + 1) * self.batch_bytes],
                   ring_view[i * self.batch_bytes : (i + 1) * self.batch_bytes])
            for i in range(n_chunks)
        ]  # fmt: skip
        self._free_chunks: list[_Chunk] = list(reversed(self._chunks))
        self._filling: _Chunk | None = None
        self._sealed: deque[_Chunk] = deque()  # full chunks waiting for the writer
        self._wbufs = [
            _Chunk(np.frombuffer(buf, dtype=np.uint8), memoryview(buf))
            for buf in (mmap.mmap(-1, self.batch_bytes) for _ in range(2))
        ]
        self.max_pending_bytes = n_chunks * self.batch_bytes
        self._io_threads = max(1, io_threads)

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index: OrderedDict[bytes, _Loc] = OrderedDict()  # LRU first
        self._pending: dict[bytes, _Pending] = {}
        self._pending_bytes = 0
        self._segments: dict[int, _Segment] = {}
        self._disk_bytes = 0
        self._next_seq = 1
        self._active: _Segment | None = None
        self._active_file: Any = None  # aiofiles handle; loop thread only
        self._dropped: list[bytes] = []
        self._recovered: dict[bytes, RecoveredEntry] = {}
        self._busy = False
        self._wake_scheduled = False
        self._reclaim_scheduled = False
        self._disabled = False
        self._closing = False
        self._closed = False
        self._c: dict[str, float] = dict.fromkeys(
            (
                "puts", "put_drops", "entries_written", "compressed_entries", "dead_entries_written",
                "bytes_written", "raw_bytes_written", "encode_seconds", "write_seconds", "syncs",
                "reads", "read_hits", "bytes_read", "read_seconds", "evictions",
                "checksum_failures", "torn_entries", "read_errors", "recovered_entries",
                "discarded_segments", "deleted_segments",
            ),
            0,
        )  # fmt: skip

        self._loop = asyncio.new_event_loop()
        self._executor = ThreadPoolExecutor(self._io_threads, thread_name_prefix="pagekv-ssd-io")
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._loop.run_forever, name="pagekv-ssd", daemon=True)
        self._thread.start()
        self._run(self._start())

    # --- sizes and state -------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._disk_bytes

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def num_entries(self) -> int:
        return len(self._index) + len(self._pending)

    @property
    def disabled(self) -> bool:
        return self._disabled

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._pending or block_hash in self._index

    def keys(self) -> list[bytes]:
        with self._lock:
            return [*self._index, *self._pending]

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._c)
            out.update(
                entries=len(self._index) + len(self._pending),
                pending_entries=len(self._pending),
                pending_bytes=self._pending_bytes,
                used_bytes=self._disk_bytes,
                capacity_bytes=self._capacity,
                segments=len(self._segments),
                direct_io=int(self.direct_io),
                disabled=int(self._disabled),
            )
            return out

    def take_dropped(self) -> list[bytes]:
        """Hashes the tier lost on its own (eviction, corruption, disabling) since the last call."""
        with self._lock:
            out, self._dropped = self._dropped, []
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
        _check_entry_fields(block_hash, parent_hash, tokens)  # here, not in the writer thread
        header_len = entry_header_size(len(block_hash), len(parent_hash or b""), len(tokens))
        footprint = align_up(header_len + self.block_bytes)
        with self._lock:
            if self._disabled:
                return False
            if block_hash in self._pending or block_hash in self._index:
                if block_hash in self._index:
                    self._index.move_to_end(block_hash)
                return True  # same hash, same content
            chunk = self._filling
            if chunk is None or chunk.fill + footprint > self.batch_bytes:
                if chunk is not None:
                    self._sealed.append(chunk)
                    self._filling = None
                if not self._free_chunks:
                    self._c["put_drops"] += 1  # the disk is behind: refuse rather than grow memory
                    return False
                chunk = self._filling = self._free_chunks.pop()
            p = _Pending(block_hash, parent_hash, tokens, chunk, chunk.fill, header_len, self.block_bytes)
            chunk.fill += footprint
            chunk.entries.append(p)
            # The copy, under the lock so no reader sees a half-copied block; the caller may
            # overwrite its block as soon as we return. The writer fills in the header.
            np.copyto(p.payload(), src.numpy() if src.device.type == "cpu" else src.cpu().numpy())
            chunk.arr[p.offset + header_len + self.block_bytes : p.offset + footprint] = 0  # padding
            self._pending[block_hash] = p
            self._pending_bytes += self.block_bytes
            self._c["puts"] += 1
            wake = not self._wake_scheduled
            self._wake_scheduled = True
        if wake:
            self._loop.call_soon_threadsafe(self._work.set)
        return True

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

    def evict(self) -> bytes | None:
        with self._lock:
            if not self._index:
                return None
            block_hash, loc = self._index.popitem(last=False)
            self._c["evictions"] += 1
            self._forget_locked(loc)
            return block_hash

    def remove(self, block_hash: bytes) -> bool:
        with self._lock:
            return self._remove_locked(block_hash)

    def clear(self) -> list[bytes]:
        """Drop every block (files are deleted in the background); return their hashes."""
        with self._lock:
            hashes = [*self._index, *self._pending]
            for h in hashes:
                self._remove_locked(h)
            return hashes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted put is written and synced (or dropped). False on timeout."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._disabled or self._closed or (not self._pending and not self._busy), timeout
            )
        if done and not (self._disabled or self._closed):
            self._run(self._sync_now(), timeout)
        return done

    def close(self, timeout: float | None = 60.0) -> None:
        """Flush, stop the writer and the loop thread. Idempotent."""
        if self._closed or self._closing:
            return
        self.flush(timeout)
        self._closing = True
        try:
            self._run(self._shutdown(), timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()
            self._executor.shutdown(wait=False)

    def __enter__(self) -> SsdTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- bookkeeping (callers hold self._lock) ---------------------------------------------
    def _remove_locked(self, block_hash: bytes) -> bool:
        p = self._pending.pop(block_hash, None)
        if p is not None:  # its bytes stay in the chunk; written, if at all, as a dead entry
            self._pending_bytes -= p.nbytes
            self._cond.notify_all()
            return True
        loc = self._index.pop(block_hash, None)
        if loc is None:
            return False
        self._forget_locked(loc)
        return True

    def _forget_locked(self, loc: _Loc) -> None:
        """An indexed entry left the index: its segment may now be reclaimable."""
        loc.seg.live -= 1
        if loc.seg.live == 0 and loc.seg.pins == 0:
            self._schedule_reclaim_locked()

    def _schedule_reclaim_locked(self) -> None:
        if self._reclaim_scheduled or self._closed:
            return
        self._reclaim_scheduled = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._reclaim()))

    def _collect_empty_locked(self) -> list[_Segment]:
        """Unlink (from the books) segments with no entries left; the caller deletes the files."""
        doomed = []
        for seg in list(self._segments.values()):
            if seg.live or seg.pins:
                continue
            if seg is self._active and seg.size <= seg.first_entry:
                continue  # fresh active segment: nothing to reclaim yet
            doomed.append(self._unlink_locked(seg))
        return doomed

    def _unlink_locked(self, seg: _Segment) -> _Segment:
        del self._segments[seg.seq]
        self._disk_bytes -= seg.size
        return seg

    def _disable(self, what: str, exc: BaseException | None) -> None:
        with self._cond:
            if self._disabled:
                return
            self._disabled = True
            self._dropped.extend([*self._index, *self._pending])
            self._index.clear()
            self._pending.clear()
            self._sealed.clear()
            self._filling = None
            self._pending_bytes = 0
            # One line, no traceback: an operating condition, not a bug. Logged before anyone
            # waiting in flush() can see the tier disabled.
            logger.error(
                "SSD tier at %s disabled, continuing without it (lookups miss, puts are dropped): %s: %s",
                self.directory,
                what,
                exc,
            )
            self._cond.notify_all()

    # --- the loop thread ---------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SsdTier: blocking call from the tier's own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        self._work = asyncio.Event()
        self._idle_sync: asyncio.TimerHandle | None = None
        self._sealing: set[asyncio.Task[None]] = set()  # segments being synced and closed
        self._seg_lock = asyncio.Lock()  # serialises appends and segment deletion
        self._rfiles: OrderedDict[int, _ReadHandle] = OrderedDict()  # seq -> handle, LRU first
        self._rbufs: asyncio.Queue[mmap.mmap] = asyncio.Queue()
        for _ in range(self._io_threads):
            self._rbufs.put_nowait(mmap.mmap(-1, self.read_chunk_bytes))
        try:
            await aiofiles.os.makedirs(self.directory, exist_ok=True)
            await self._recover()
            async with self._seg_lock:
                await self._open_segment()  # eagerly: proves the directory is writable now
        except OSError as exc:
            self._disable("cannot use the directory", exc)
        self._writer_task = asyncio.get_running_loop().create_task(self._writer_main())
        logger.info(
            "SSD tier at %s: %d blocks recovered, %.1f of %.1f MiB used, segments of %.1f MiB, %s I/O",
            self.directory,
            len(self._index),
            self._disk_bytes / MiB,
            self._capacity / MiB,
            self.segment_bytes / MiB,
            "direct" if self.direct_io else "buffered",
        )

    async def _shutdown(self) -> None:
        self._work.set()
        await self._writer_task
        async with self._seg_lock:
            self._close_active()
        await asyncio.gather(*self._sealing)
        for seq in list(self._rfiles):
            await self._close_read_handle(seq)

    def _opener(self, path: str, flags: int) -> int:
        return os.open(path, flags | (os.O_DIRECT if self.direct_io else 0))

    # --- writing -----------------------------------------------------------------------------
    async def _writer_main(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            with self._lock:
                self._wake_scheduled = False
            await self._drain()
            if self._closing:
                return

    def _take_chunk(self) -> _Chunk | None:
        """The next chunk to write: a full one, else the one being filled (so nothing waits)."""
        with self._lock:
            if self._sealed:
                chunk: _Chunk | None = self._sealed.popleft()
            elif self._filling is not None and self._filling.entries:
                chunk, self._filling = self._filling, None
            else:
                chunk = None
            if chunk is not None:
                self._busy = True
            return chunk

    def _recycle(self, chunk: _Chunk) -> None:
        with self._lock:
            for p in chunk.entries:  # not written (dropped or failed): gone
                if self._pending.get(p.block_hash) is p:
                    self._remove_locked(p.block_hash)
                    self._dropped.append(p.block_hash)
            chunk.entries.clear()
            chunk.fill = 0
            self._free_chunks.append(chunk)

    async def _drain(self) -> None:
        """Prepare chunk N+1 (headers, compression) while chunk N is written; sync when idle."""
        turn = 0

        def start(chunk: _Chunk | None) -> asyncio.Task[_Batch] | None:
            nonlocal turn
            if chunk is None:
                return None
            turn += 1
            return asyncio.ensure_future(self._prepare(chunk, self._wbufs[turn % 2]))

        task = start(self._take_chunk())
        try:
            while task is not None:
                batch = await task
                task = start(self._take_chunk())
                try:
                    await self._write_batch(batch)
                finally:
                    self._recycle(batch.chunk)
            if self._idle_sync is None:
                self._idle_sync = self._loop.call_later(self.sync_delay_s, self._start_idle_sync)
        except OSError as exc:
            self._disable("write failed", exc)
        except Exception as exc:  # a bug must not kill the writer silently and leave flush() hanging
            logger.exception("SSD tier writer failed")
            self._disable("writer crashed", exc)
        finally:
            if task is not None:
                done = await asyncio.gather(task, return_exceptions=True)
                if isinstance(done[0], _Batch):
                    self._recycle(done[0].chunk)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    async def _prepare(self, chunk: _Chunk, out: _Chunk) -> _Batch:
        """Turn a chunk of raw entries into the bytes to write.

        Uncompressed (the common case: KV rarely passes the ratio threshold), each entry's
        header is written into the space its put reserved and the chunk is written as it is.
        Blocks that compress are re-laid into an output buffer. Encoding runs on the executor,
        split across the I/O threads (lz4, numpy and xxhash release the GIL).
        """
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        entries = list(chunk.entries)
        codecs: list[tuple[int, Any]] = [(CODEC_RAW, None)] * len(entries)
        if self.compress and entries:
            with self._lock:  # popped while pending: not worth compressing or writing
                live = [i for i, p in enumerate(entries) if self._pending.get(p.block_hash) is p]
            groups = [live[k :: self._io_threads] for k in range(self._io_threads)]
            parts = await asyncio.gather(
                *(loop.run_in_executor(None, self._encode_group, entries, g) for g in groups if g)
            )
            for part in parts:
                for i, codec, payload in part:
                    codecs[i] = (codec, payload)
            if all(c == CODEC_RAW for c, _ in codecs) and len(live) == len(entries):
                codecs = [(CODEC_RAW, None)] * len(entries)
            else:
                batch = await loop.run_in_executor(None, self._relayout, chunk, out, entries, codecs, live)
                self._c["encode_seconds"] += time.perf_counter() - t0
                return batch
        batch = await loop.run_in_executor(None, self._headers_in_place, chunk, entries)
        self._c["encode_seconds"] += time.perf_counter() - t0
        return batch

    def _encode_group(self, entries: list[_Pending], idxs: list[int]) -> list[tuple[int, int, Any]]:
        out = []
        for i in idxs:
            codec, payload = encode(entries[i].payload(), self.elem_size, self.min_ratio)
            out.append((i, codec, payload if codec != CODEC_RAW else None))
        return out

    def _header(self, p: _Pending, codec: int, payload: Any) -> bytes:
        header = pack_entry_header(
            block_hash=p.block_hash,
            parent_hash=p.parent_hash,
            token_ids=p.token_ids,
            layout_id=self.layout_id,
            dtype_code=self._dtype_code,
            codec=codec,
            raw_len=p.nbytes,
            payload=payload,
        )
        assert len(header) == p.header_len
        return header

    def _headers_in_place(self, chunk: _Chunk, entries: list[_Pending]) -> _Batch:
        batch = _Batch(chunk, chunk.view, chunk.fill)
        for p in entries:
            header = self._header(p, CODEC_RAW, p.payload())
            chunk.arr[p.offset : p.offset + p.header_len] = np.frombuffer(header, dtype=np.uint8)
            batch.items.append((p, p.offset, p.header_len + p.nbytes, CODEC_RAW))
        return batch

    def _relayout(
        self,
        chunk: _Chunk,
        out: _Chunk,
        entries: list[_Pending],
        codecs: list[tuple[int, Any]],
        live: list[int],
    ) -> _Batch:
        batch = _Batch(chunk, out.view)
        pos = 0
        for i in live:
            p = entries[i]
            codec, payload = codecs[i]
            if codec == CODEC_RAW:
                payload = p.payload()
            header = self._header(p, codec, payload)
            length = p.header_len + len(payload)
            end = align_up(pos + length)
            out.arr[pos : pos + p.header_len] = np.frombuffer(header, dtype=np.uint8)
            out.arr[pos + p.header_len : pos + length] = np.frombuffer(payload, dtype=np.uint8)
            out.arr[pos + length : end] = 0
            batch.items.append((p, pos, length, codec))
            pos = end
        batch.size = pos
        return batch

    async def _write_batch(self, batch: _Batch) -> None:
        async with self._seg_lock:
            with self._lock:
                doomed, keep = self._make_room_locked(batch)
            await self._delete_segments(doomed)
            if not keep:
                return
            items = batch.items[:keep]
            size = batch.size if keep == len(batch.items) else batch.items[keep][1]
            seg = await self._active_for(size)
            f = self._active_file
            start = seg.size
            with self._lock:  # reserve: the file grows now, whatever happens next
                seg.size += size
                seg.dirty = True
                self._disk_bytes += size
            t0 = time.perf_counter()
            written = await f.write(batch.view[:size])
            if written != size:
                raise OSError(errno.EIO, f"short write to {seg.path} ({written} of {size} bytes)")
            elapsed = time.perf_counter() - t0
            with self._cond:
                for p, offset, length, codec in items:
                    if self._pending.get(p.block_hash) is p:
                        del self._pending[p.block_hash]
                        self._pending_bytes -= p.nbytes
                        self._index[p.block_hash] = _Loc(seg, start + offset, length)
                        seg.live += 1
                        self._c["entries_written"] += 1
                        self._c["raw_bytes_written"] += p.nbytes
                        if codec != CODEC_RAW:
                            self._c["compressed_entries"] += 1
                    else:
                        self._c["dead_entries_written"] += 1
                self._c["bytes_written"] += size
                self._c["write_seconds"] += elapsed
                if seg.live == 0:
                    self._schedule_reclaim_locked()
                self._cond.notify_all()

    def _make_room_locked(self, batch: _Batch) -> tuple[list[_Segment], int]:
        """Evict LRU entries until the batch fits the budget. Returns (segments to delete,
        how many of the batch's entries to write); the rest are dropped by `_recycle`."""
        seg = self._active
        rolls = seg is None or (seg.size > seg.first_entry and seg.size + batch.size > self.segment_bytes)
        need = batch.size + (len(self._seg_header) if rolls else 0)
        doomed = self._collect_empty_locked()  # emptied by reads since the last reclaim
        while self._disk_bytes + need > self._capacity and self._index:
            block_hash, loc = self._index.popitem(last=False)
            loc.seg.live -= 1
            self._dropped.append(block_hash)
            self._c["evictions"] += 1
            if loc.seg.live == 0 and loc.seg.pins == 0:
                doomed.append(self._unlink_locked(loc.seg))
        room = self._capacity - self._disk_bytes - (need - batch.size)
        keep = 0
        for _, offset, length, _ in batch.items:
            if align_up(offset + length) > room:
                break
            keep += 1
        self._c["put_drops"] += sum(
            self._pending.get(p.block_hash) is p for p, *_ in batch.items[keep:]
        )  # nothing left to evict (reads pin it, or a tiny budget)
        return doomed, keep

    async def _active_for(self, nbytes: int) -> _Segment:
        seg = self._active
        if seg is not None and seg.size > seg.first_entry and seg.size + nbytes > self.segment_bytes:
            self._close_active()  # sealed: it stays, read-only from now on; synced in the background
        if self._active is None:
            await self._open_segment()
        assert self._active is not None
        return self._active

    def _start_idle_sync(self) -> None:
        """At most one pending idle sync: a steady trickle of puts must not sync every batch."""
        self._idle_sync = None
        if self._busy:
            self._idle_sync = self._loop.call_later(self.sync_delay_s, self._start_idle_sync)
        elif not self._closing:
            self._loop.create_task(self._sync_now())

    async def _sync_now(self) -> None:
        try:
            async with self._seg_lock:
                await self._sync_active()
            await asyncio.gather(*self._sealing)
        except OSError as exc:
            self._disable("sync failed", exc)

    async def _sync_active(self) -> None:
        seg, f = self._active, self._active_file
        if seg is None or f is None or not seg.dirty or not self.sync:
            return
        fd = f.fileno()
        await asyncio.get_running_loop().run_in_executor(None, os.fdatasync, fd)
        seg.dirty = False
        self._c["syncs"] += 1
        if not self.direct_io:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean now: drop our pages

    def _close_active(self) -> asyncio.Task[None] | None:
        """Seal the active segment: sync and close it in the background (the writer goes on)."""
        if self._active_file is None:
            return None
        seg, f = self._active, self._active_file
        self._active = self._active_file = None
        task = self._loop.create_task(self._seal(seg, f))
        self._sealing.add(task)
        task.add_done_callback(self._sealing.discard)
        return task

    async def _seal(self, seg: _Segment | None, f: Any) -> None:
        try:
            if seg is not None and seg.dirty and self.sync:
                fd = f.fileno()
                await asyncio.get_running_loop().run_in_executor(None, os.fdatasync, fd)
                seg.dirty = False
                self._c["syncs"] += 1
                if not self.direct_io:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            self._disable("sync failed", exc)
        finally:
            await f.close()

    async def _open_segment(self) -> None:
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
        path = str(self.directory / f"seg-{seq:010d}.pkv")
        try:
            # 'x': never clobber an existing file
            f = await aiofiles.open(path, "xb", buffering=0, opener=self._opener)
        except OSError as exc:
            if not (self.direct_io and exc.errno == errno.EINVAL):
                raise
            logger.info("SSD tier: %s does not support O_DIRECT; using buffered I/O", self.directory)
            self.direct_io = False
            f = await aiofiles.open(path, "xb", buffering=0, opener=self._opener)
        try:
            if await f.write(memoryview(self._seg_header)) != len(self._seg_header):
                raise OSError(errno.EIO, f"short write to {path}")
            if self.sync:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, os.fdatasync, f.fileno())
                await loop.run_in_executor(None, _fsync_dir, str(self.directory))
        except BaseException:
            await f.close()
            raise
        size = len(self._seg_header)
        seg = _Segment(seq, path, size=size, first_entry=size)
        with self._lock:
            self._segments[seq] = seg
            self._disk_bytes += seg.size
        self._active, self._active_file = seg, f

    async def _reclaim(self) -> None:
        async with self._seg_lock:
            with self._lock:
                self._reclaim_scheduled = False
                doomed = self._collect_empty_locked()
            await self._delete_segments(doomed)

    async def _delete_segments(self, doomed: list[_Segment]) -> None:
        for seg in doomed:
            await self._close_read_handle(seg.seq)
            if seg is self._active:
                f, self._active, self._active_file = self._active_file, None, None
                await f.close()  # its entries are all gone: no point syncing it
            try:
                await aiofiles.os.remove(seg.path)
                self._c["deleted_segments"] += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("SSD tier: cannot delete %s: %s", seg.path, exc)

    # --- reading -----------------------------------------------------------------------------
    def _fetch(self, block_hashes: Sequence[bytes], remove: bool) -> list[torch.Tensor | None]:
        results: list[torch.Tensor | None] = [None] * len(block_hashes)
        reads: list[tuple[int, bytes, _Loc]] = []
        with self._cond:
            if self._disabled or self._closing:
                return results
            self._c["reads"] += len(block_hashes)
            for i, h in enumerate(block_hashes):
                p = self._pending.get(h)
                if p is not None:  # not on disk yet: serve the copy we hold
                    results[i] = torch.from_numpy(p.payload().copy())
                    if remove:
                        self._remove_locked(h)
                    self._c["read_hits"] += 1
                    continue
                loc = self._index.get(h)
                if loc is None:
                    continue
                if remove:
                    del self._index[h]
                    loc.seg.live -= 1
                else:
                    self._index.move_to_end(h)
                loc.seg.pins += 1
                reads.append((i, h, loc))
        if not reads:
            return results
        t0 = time.perf_counter()
        try:
            arrays = self._run(self._read_entries([(h, loc) for _, h, loc in reads]))
        except Exception as exc:  # the loop is gone (closing): a miss, never a raise
            logger.warning("SSD tier read failed: %s", exc)
            arrays = [None] * len(reads)
        elapsed = time.perf_counter() - t0
        failed: list[tuple[bytes, _Loc, bool]] = []
        for (i, h, loc), arr in zip(reads, arrays, strict=True):
            if isinstance(arr, np.ndarray):
                results[i] = torch.from_numpy(arr)
            else:
                failed.append((h, loc, arr is not None))
        with self._cond:
            for _, _, loc in reads:
                loc.seg.pins -= 1
                if loc.seg.live == 0 and loc.seg.pins == 0:
                    self._schedule_reclaim_locked()
            for h, loc, corrupt in failed:
                self._c["checksum_failures" if corrupt else "read_errors"] += 1
                if not remove and self._index.get(h) is loc:
                    del self._index[h]
                    self._forget_locked(loc)
                self._dropped.append(h)  # lost without being asked: the chain must know
            self._c["read_hits"] += len(reads) - len(failed)
            self._c["bytes_read"] += sum(loc.length for _, _, loc in reads)
            self._c["read_seconds"] += elapsed
        for h, _, corrupt in failed:
            logger.warning(
                "SSD tier: block %s %s; dropped, reported as a miss",
                h.hex()[:16],
                "failed its checksum" if corrupt else "could not be read",
            )
        return results

    async def _read_entries(self, wanted: list[tuple[bytes, _Loc]]) -> list[np.ndarray | str | None]:
        """Read entries: runs of adjacent entries (up to one staging buffer) are read with one
        call, runs in parallel. Per entry: the data, _CORRUPT, or None (could not be read)."""
        out: list[np.ndarray | str | None] = [None] * len(wanted)
        order = sorted(range(len(wanted)), key=lambda i: (wanted[i][1].seg.seq, wanted[i][1].offset))
        runs: list[list[int]] = []
        for i in order:
            loc = wanted[i][1]
            if runs:
                first, last = wanted[runs[-1][0]][1], wanted[runs[-1][-1]][1]
                if (
                    loc.seg is last.seg
                    and loc.offset == align_up(last.offset + last.length)
                    and align_up(loc.offset + loc.length) - first.offset <= self.read_chunk_bytes
                ):
                    runs[-1].append(i)
                    continue
            runs.append([i])
        await asyncio.gather(*(self._read_run(run, wanted, out) for run in runs))
        return out

    async def _read_run(
        self, run: list[int], wanted: list[tuple[bytes, _Loc]], out: list[np.ndarray | str | None]
    ) -> None:
        first, last = wanted[run[0]][1], wanted[run[-1]][1]
        start, end = first.offset, align_up(last.offset + last.length)
        items = [(i, wanted[i][0], wanted[i][1].offset - start, wanted[i][1].length) for i in run]
        buf = await self._rbufs.get()
        handle: _ReadHandle | None = None
        try:
            handle = await self._acquire_read_handle(first.seg)
            decoded = await asyncio.get_running_loop().run_in_executor(
                None, self._pread_decode, handle.f.fileno(), start, end - start, buf, items
            )
            for i, arr in decoded:
                out[i] = arr
        except OSError as exc:
            logger.warning("SSD tier: reading %s failed: %s", first.seg.path, exc)
        finally:
            self._rbufs.put_nowait(buf)
            if handle is not None:
                handle.users -= 1
                await self._trim_read_handles()

    async def _acquire_read_handle(self, seg: _Segment) -> _ReadHandle:
        """A cached read-only aiofiles handle on a segment (opened once, LRU-bounded)."""
        handle = self._rfiles.get(seg.seq)
        if handle is None:
            f = await aiofiles.open(seg.path, "rb", buffering=0, opener=self._opener)
            handle = self._rfiles.get(seg.seq)  # another read may have opened it meanwhile
            if handle is None:
                handle = self._rfiles[seg.seq] = _ReadHandle(f)
            else:
                await f.close()
        self._rfiles.move_to_end(seg.seq)
        handle.users += 1
        return handle

    async def _trim_read_handles(self) -> None:
        idle = [seq for seq, h in self._rfiles.items() if h.users == 0]
        for seq in idle[: max(0, len(self._rfiles) - MAX_READ_HANDLES)]:
            await self._rfiles.pop(seq).f.close()

    async def _close_read_handle(self, seq: int) -> None:
        handle = self._rfiles.pop(seq, None)
        if handle is not None:  # a deleted segment has no reads in flight (pins)
            await handle.f.close()

    def _pread_decode(
        self, fd: int, start: int, length: int, buf: mmap.mmap, items: list[tuple[int, bytes, int, int]]
    ) -> list[tuple[int, np.ndarray | str | None]]:
        """Read a run into the staging buffer, then verify and copy out each entry (executor
        thread: the read, xxhash and numpy copies release the GIL). One hop per run."""
        view = memoryview(buf)[:length]
        got = 0
        while got < length:
            n = os.preadv(fd, [view[got:]], start + got)
            if n <= 0:
                break  # the file ends early (torn)
            got += n
        if not self.direct_io:
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
        out: list[tuple[int, np.ndarray | str | None]] = []
        for i, block_hash, offset, size in items:
            if offset + size > got:
                out.append((i, None))
                continue
            out.append((i, self._verify(block_hash, view[offset : offset + size])))
        return out

    def _verify(self, block_hash: bytes, entry: memoryview) -> np.ndarray | str:
        """Check an entry's header and payload against what we expect; decode it into new memory."""
        try:
            hdr = parse_entry_header(entry)
        except FormatError:
            return _CORRUPT
        if (
            hdr.block_hash != block_hash
            or hdr.layout_id != self.layout_id
            or hdr.raw_len != self.block_bytes
            or hdr.entry_len != len(entry)
        ):
            return _CORRUPT
        payload = entry[hdr.header_len :]
        if checksum(payload) != hdr.payload_xxh:
            return _CORRUPT
        try:
            arr = decode_array(hdr.codec, payload, hdr.raw_len, self.elem_size)
        except ValueError:
            return _CORRUPT
        return arr.copy() if hdr.codec == CODEC_RAW else arr  # raw: a view of the staging buffer

    # --- start-up recovery -------------------------------------------------------------------
    async def _recover(self) -> None:
        names = await aiofiles.os.listdir(self.directory)
        found = sorted((int(m.group(1)), name) for name in names if (m := _SEG_RE.match(name)))
        if found:
            self._next_seq = found[-1][0] + 1
        for seq, name in found:
            path = str(self.directory / name)
            st = await aiofiles.os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                logger.warning("SSD tier: %s is not a regular file; ignored", path)
                continue
            seg = _Segment(seq, path, size=st.st_size)
            entries = await self._scan_segment(seg)
            with self._lock:
                self._segments[seq] = seg
                self._disk_bytes += seg.size
                for hdr, offset in entries:
                    old = self._index.pop(hdr.block_hash, None)
                    if old is not None:  # written again later: the newest copy wins
                        old.seg.live -= 1
                    self._index[hdr.block_hash] = _Loc(seg, offset, hdr.entry_len)
                    seg.live += 1
                    self._recovered[hdr.block_hash] = RecoveredEntry(
                        hdr.block_hash, hdr.parent_hash, hdr.token_ids
                    )
        with self._lock:
            self._c["recovered_entries"] = len(self._index)
            doomed = self._collect_empty_locked()
            # Over budget (it may have shrunk since the last run): evict the oldest, leaving
            # room for the segment this run starts.
            while self._disk_bytes + len(self._seg_header) > self._capacity and self._index:
                h, loc = self._index.popitem(last=False)
                loc.seg.live -= 1
                self._recovered.pop(h, None)
                self._c["evictions"] += 1
                if loc.seg.live == 0:
                    doomed.append(self._unlink_locked(loc.seg))
        await self._delete_segments(doomed)

    async def _scan_segment(self, seg: _Segment) -> list[tuple[EntryHeader, int]]:
        """Headers of the valid entries of one segment, in file order (payloads are not read)."""
        found: list[tuple[EntryHeader, int]] = []
        async with aiofiles.open(seg.path, "rb") as f:
            head = await f.read(min(seg.size, MAX_LAYOUT_LEN + 64))
            try:
                layout_id, _, first_entry, align = parse_segment_header(head)
            except FormatError as exc:
                logger.warning("SSD tier: %s discarded: %s", seg.path, exc)
                self._c["discarded_segments"] += 1
                return found
            if layout_id != self.layout_id:
                logger.warning("SSD tier: %s belongs to another layout; discarded", seg.path)
                self._c["discarded_segments"] += 1
                return found
            seg.first_entry = first_entry
            offset: int | None = first_entry
            while offset is not None and offset < seg.size:
                remaining = seg.size - offset
                await f.seek(offset)
                chunk = await f.read(min(MAX_ENTRY_HEADER_LEN, remaining))
                try:
                    hdr = parse_entry_header(chunk)
                except FormatError:
                    if _is_torn(chunk, remaining):
                        self._c["torn_entries"] += 1
                        logger.warning("SSD tier: %s has a torn tail at %d; ignored", seg.path, offset)
                        break
                    self._c["checksum_failures"] += 1
                    logger.warning("SSD tier: %s has a corrupt entry header at %d; skipped", seg.path, offset)
                    offset = await self._resync(f, seg, offset + align, align)
                    continue
                if hdr.entry_len > remaining:
                    self._c["torn_entries"] += 1
                    logger.warning("SSD tier: %s has a torn tail at %d; ignored", seg.path, offset)
                    break
                if hdr.layout_id == self.layout_id and hdr.raw_len == self.block_bytes:
                    found.append((hdr, offset))
                offset = align_up(offset + hdr.entry_len, align)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # headers are not needed again
        return found

    async def _resync(self, f: Any, seg: _Segment, offset: int, align: int) -> int | None:
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


def _is_torn(chunk: bytes, remaining: int) -> bool:
    """True if an entry header failed to parse because the log ends here: the file ends inside
    it, or the rest is zeros (space allocated but never written before a crash)."""
    if remaining < ENTRY_FIXED_LEN or chunk.count(0) == len(chunk):
        return True
    try:
        return remaining < entry_header_len(chunk)
    except FormatError:
        return False


def _check_entry_fields(block_hash: bytes, parent_hash: bytes | None, tokens: tuple[int, ...]) -> None:
    if not isinstance(block_hash, bytes) or not 0 < len(block_hash) <= MAX_HASH_LEN:
        raise ValueError(f"block hash must be 1..{MAX_HASH_LEN} bytes")
    if parent_hash is not None and not 0 < len(parent_hash) <= MAX_HASH_LEN:
        raise ValueError(f"parent hash must be 1..{MAX_HASH_LEN} bytes or None")
    if len(tokens) > MAX_TOKENS or (tokens and (min(tokens) < 0 or max(tokens) >= 1 << 32)):
        raise ValueError(f"token ids must be at most {MAX_TOKENS} values in [0, 2**32)")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
