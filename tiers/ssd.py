"""The SSD tier: blocks packed into large append-only segment files, LRU within a byte budget.

Design (see also `tiers/ssd_format.py` for the bytes on disk):

* Files. `<directory>/layout-<layout id>/seg-<seq>.pkv`, one sub-directory per KV layout so a
  pod restarted with another model never mixes blocks. Segments are written sequentially and
  never rewritten; a write batch packs many encoded entries (up to `batch_bytes`) into one
  `writelines` call, then `fdatasync`s and drops the written pages from the page cache
  (`POSIX_FADV_DONTNEED`): the DRAM tier is the cache, the page cache must not be a second one.
* Threads. An asyncio loop runs in one background thread; aiofiles runs the blocking file calls
  on a small executor. `put` copies the block into a pending buffer and wakes the writer: it
  never waits for the disk. Encoding (shuffle + lz4) of batch N+1 overlaps the write of batch N.
  A pending block is readable from the pending buffer until its write lands.
* Manifest. There is none to keep consistent: the segments *are* the log. At start-up every
  segment's entry headers are scanned (headers only; each has its own checksum), which rebuilds
  the index. A torn tail (length past end of file) ends a segment's scan; a header that fails
  its checksum is skipped by re-synchronising on the next valid entry magic. Payload checksums
  are verified on every read; a failure is counted, the entry dropped, and the read is a miss.
  Removals are not logged, so an entry removed before a restart (promoted, evicted) can come
  back after it; its bytes are still the KV of its hash, so that costs disk space, not
  correctness, and LRU eviction takes care of the space.
* Budget. `capacity_bytes` bounds the bytes of segment files on disk (headers and holes
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
import os
import re
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
    MAX_LAYOUT_LEN,
    EntryHeader,
    FormatError,
    canonical_layout,
    checksum,
    entry_header_len,
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


@dataclass(slots=True)
class _Segment:
    seq: int
    path: str
    size: int = 0  # bytes in the file; what counts against the budget
    header_len: int = 0
    live: int = 0  # indexed entries
    pins: int = 0  # reads in flight: the file must not be deleted under them


@dataclass(slots=True)
class _Loc:
    seg: _Segment
    offset: int
    length: int  # header + payload


@dataclass(slots=True)
class _Pending:
    block_hash: bytes
    data: np.ndarray  # the caller's block, copied
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


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
        sync: bool = True,
        drop_cache: bool = True,
        max_read_bytes: int = 32 * MiB,
    ) -> None:
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
        self.drop_cache = drop_cache and hasattr(os, "posix_fadvise")
        self.max_pending_bytes = max_pending_bytes
        self.max_read_bytes = max(max_read_bytes, block_bytes + MAX_ENTRY_HEADER_LEN)
        self.directory = Path(directory) / f"layout-{self.layout_id:016x}"
        self._seg_header = pack_segment_header(self.layout_bytes)
        # A small budget gets small segments, so that deleting one frees a useful fraction.
        min_seg = len(self._seg_header) + block_bytes + MAX_ENTRY_HEADER_LEN
        self.segment_bytes = max(min(segment_bytes, capacity_bytes // 4), min_seg)
        self.batch_bytes = max(block_bytes, min(batch_bytes, self.segment_bytes))

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index: OrderedDict[bytes, _Loc] = OrderedDict()  # LRU first
        self._pending: dict[bytes, _Pending] = {}
        self._queue: deque[_Pending] = deque()  # pending entries not yet taken by the writer
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
                "bytes_written", "raw_bytes_written", "encode_seconds", "write_seconds",
                "reads", "read_hits", "bytes_read", "read_seconds", "evictions",
                "checksum_failures", "torn_entries", "read_errors", "recovered_entries",
                "discarded_segments", "deleted_segments",
            ),
            0,
        )  # fmt: skip

        self._loop = asyncio.new_event_loop()
        self._executor = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="pagekv-ssd-io")
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
        """Queue a block for writing; returns at once. False if refused (disabled, backlog full)."""
        if self._disabled or self._closing:
            return False
        src = as_uint8_tensor(data, self.block_bytes)
        if block_hash in self._pending or block_hash in self._index:
            with self._lock:
                if block_hash in self._index:
                    self._index.move_to_end(block_hash)
            return True  # same hash, same content
        with self._lock:
            if self._pending_bytes + self.block_bytes > self.max_pending_bytes:
                self._c["put_drops"] += 1  # the disk is behind: refuse rather than grow memory
                return False
        # The copy: the caller may overwrite its block as soon as we return.
        arr = src.numpy().copy() if src.device.type == "cpu" else src.cpu().numpy()
        entry = _Pending(block_hash, arr, parent_hash, tuple(token_ids or ()))
        with self._lock:
            if self._disabled or block_hash in self._pending or block_hash in self._index:
                return not self._disabled
            self._pending[block_hash] = entry
            self._queue.append(entry)
            self._pending_bytes += arr.nbytes
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
        """Wait until every accepted put is on disk (or dropped). True unless it timed out."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._disabled or self._closed or (not self._pending and not self._busy), timeout
            )

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
        if p is not None:
            self._pending_bytes -= p.data.nbytes
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
            if seg is self._active and seg.size <= seg.header_len:
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
            self._queue.clear()
            self._pending_bytes = 0
            self._cond.notify_all()
        # One line, no traceback: this is an operating condition, not a bug.
        logger.error(
            "SSD tier at %s disabled, continuing without it (lookups miss, puts are dropped): %s: %s",
            self.directory,
            what,
            exc,
        )

    # --- the loop thread ---------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SsdTier: blocking call from the tier's own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        self._work = asyncio.Event()
        self._seg_lock = asyncio.Lock()  # serialises appends and segment deletion
        try:
            await aiofiles.os.makedirs(self.directory, exist_ok=True)
            await self._recover()
            async with self._seg_lock:
                await self._open_segment()  # eagerly: proves the directory is writable now
        except OSError as exc:
            self._disable("cannot use the directory", exc)
        self._writer_task = asyncio.get_running_loop().create_task(self._writer_main())
        logger.info(
            "SSD tier at %s: %d blocks recovered, %.1f of %.1f MiB used, segments of %.1f MiB",
            self.directory,
            len(self._index),
            self._disk_bytes / MiB,
            self._capacity / MiB,
            self.segment_bytes / MiB,
        )

    async def _shutdown(self) -> None:
        self._work.set()
        await self._writer_task
        async with self._seg_lock:
            if self._active_file is not None:
                await self._active_file.close()
                self._active_file = None
                self._active = None

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

    def _take_batch(self) -> list[_Pending]:
        with self._lock:
            batch: list[_Pending] = []
            size = 0
            while self._queue and size < self.batch_bytes:
                p = self._queue.popleft()
                if self._pending.get(p.block_hash) is p:  # else removed before being written
                    batch.append(p)
                    size += p.data.nbytes
            if batch:
                self._busy = True
            return batch

    async def _drain(self) -> None:
        """Encode batch N+1 on the executor while batch N is written."""
        loop = asyncio.get_running_loop()
        batch = self._take_batch()
        fut = loop.run_in_executor(None, self._encode_batch, batch) if batch else None
        try:
            while fut is not None:
                encoded = await fut
                nxt = self._take_batch()
                fut = loop.run_in_executor(None, self._encode_batch, nxt) if nxt else None
                await self._write_batch(encoded)
        except OSError as exc:
            self._disable("write failed", exc)
        except Exception as exc:  # a bug must not kill the writer silently and leave flush() hanging
            logger.exception("SSD tier writer failed")
            self._disable("writer crashed", exc)
        finally:
            if fut is not None:
                await asyncio.gather(fut, return_exceptions=True)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _encode_batch(self, batch: list[_Pending]) -> list[tuple[_Pending, bytes, Any, int]]:
        t0 = time.perf_counter()
        out = []
        for p in batch:
            if self.compress:
                codec, payload = encode(p.data, self.elem_size, self.min_ratio)
            else:
                codec, payload = CODEC_RAW, memoryview(p.data)
            header = pack_entry_header(
                block_hash=p.block_hash,
                parent_hash=p.parent_hash,
                token_ids=p.token_ids,
                layout_id=self.layout_id,
                dtype_code=self._dtype_code,
                codec=codec,
                raw_len=p.data.nbytes,
                payload=payload,
            )
            out.append((p, header, payload, codec))
        with self._lock:
            self._c["encode_seconds"] += time.perf_counter() - t0
        return out

    async def _write_batch(self, encoded: list[tuple[_Pending, bytes, Any, int]]) -> None:
        async with self._seg_lock:
            with self._lock:
                doomed, kept = self._make_room_locked(encoded)
            await self._delete_segments(doomed)
            if not kept:
                return
            total = sum(len(h) + len(pl) for _, h, pl, _ in kept)
            seg = await self._active_for(total)
            f = self._active_file
            start = pos = seg.size
            buffers: list[Any] = []
            placed: list[tuple[_Pending, int, int, int]] = []
            for p, header, payload, codec in kept:
                buffers += (header, payload)
                length = len(header) + len(payload)
                placed.append((p, pos, length, codec))
                pos += length
            with self._lock:  # reserve: the file grows now, whatever happens next
                seg.size = pos
                self._disk_bytes += pos - start
            t0 = time.perf_counter()
            await f.writelines(buffers)
            fd = f.fileno()
            if os.fstat(fd).st_size != pos:
                raise OSError(errno.EIO, f"short write to {seg.path}")
            if self.sync:
                await asyncio.get_running_loop().run_in_executor(None, os.fdatasync, fd)
            if self.drop_cache:
                os.posix_fadvise(fd, start, pos - start, os.POSIX_FADV_DONTNEED)
            elapsed = time.perf_counter() - t0
            with self._cond:
                for p, offset, length, codec in placed:
                    if self._pending.get(p.block_hash) is p:
                        del self._pending[p.block_hash]
                        self._pending_bytes -= p.data.nbytes
                        self._index[p.block_hash] = _Loc(seg, offset, length)
                        seg.live += 1
                        self._c["entries_written"] += 1
                        self._c["raw_bytes_written"] += p.data.nbytes
                        if codec != CODEC_RAW:
                            self._c["compressed_entries"] += 1
                    else:
                        self._c["dead_entries_written"] += 1
                self._c["bytes_written"] += pos - start
                self._c["write_seconds"] += elapsed
                if seg.live == 0:
                    self._schedule_reclaim_locked()
                self._cond.notify_all()

    def _make_room_locked(
        self, encoded: list[tuple[_Pending, bytes, Any, int]]
    ) -> tuple[list[_Segment], list[tuple[_Pending, bytes, Any, int]]]:
        """Evict LRU entries until the batch fits the budget; drop what still cannot fit."""
        need = sum(len(h) + len(pl) for _, h, pl, _ in encoded) + len(self._seg_header)
        doomed = self._collect_empty_locked()  # emptied by reads since the last reclaim
        while self._disk_bytes + need > self._capacity and self._index:
            block_hash, loc = self._index.popitem(last=False)
            loc.seg.live -= 1
            self._dropped.append(block_hash)
            self._c["evictions"] += 1
            if loc.seg.live == 0 and loc.seg.pins == 0:
                doomed.append(self._unlink_locked(loc.seg))
        if self._disk_bytes + need <= self._capacity:
            return doomed, encoded
        # Nothing left to evict (reads in flight pin segments, or the budget is tiny).
        room = self._capacity - self._disk_bytes - len(self._seg_header)
        kept = []
        for item in encoded:
            p, header, payload, _ = item
            size = len(header) + len(payload)
            if size <= room:
                kept.append(item)
                room -= size
            elif self._pending.get(p.block_hash) is p:
                del self._pending[p.block_hash]
                self._pending_bytes -= p.data.nbytes
                self._dropped.append(p.block_hash)
                self._c["put_drops"] += 1
        return doomed, kept

    async def _active_for(self, nbytes: int) -> _Segment:
        seg = self._active
        if seg is not None and seg.size > seg.header_len and seg.size + nbytes > self.segment_bytes:
            await self._active_file.close()  # sealed: it stays, read-only from now on
            self._active = self._active_file = None
        if self._active is None:
            await self._open_segment()
        assert self._active is not None
        return self._active

    async def _open_segment(self) -> None:
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
        path = str(self.directory / f"seg-{seq:010d}.pkv")
        f = await aiofiles.open(path, "xb", buffering=0)  # 'x': never clobber an existing file
        try:
            await f.write(self._seg_header)
            if self.sync:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, os.fdatasync, f.fileno())
                await loop.run_in_executor(None, _fsync_dir, str(self.directory))
        except BaseException:
            await f.close()
            raise
        seg = _Segment(seq, path, size=len(self._seg_header), header_len=len(self._seg_header))
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
            if seg is self._active:
                await self._active_file.close()
                self._active = self._active_file = None
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
                    if remove:
                        self._remove_locked(h)
                        results[i] = torch.from_numpy(p.data)
                    else:
                        results[i] = torch.from_numpy(p.data.copy())
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
            bufs = self._run(self._read_locs([loc for _, _, loc in reads]))
        except Exception as exc:  # the loop is gone (closing): a miss, never a raise
            logger.warning("SSD tier read failed: %s", exc)
            bufs = [None] * len(reads)
        elapsed = time.perf_counter() - t0
        failed: list[tuple[bytes, _Loc, bool]] = []
        for (i, h, loc), buf in zip(reads, bufs, strict=True):
            if buf is None:
                failed.append((h, loc, False))
                continue
            arr = self._verify(h, buf)
            if arr is None:
                failed.append((h, loc, True))
            else:
                results[i] = torch.from_numpy(arr)
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

    def _verify(self, block_hash: bytes, buf: memoryview) -> np.ndarray | None:
        """Check an entry's header and payload against what we expect; decode it."""
        try:
            hdr = parse_entry_header(buf)
        except FormatError:
            return None
        if (
            hdr.block_hash != block_hash
            or hdr.layout_id != self.layout_id
            or hdr.raw_len != self.block_bytes
            or hdr.entry_len != len(buf)
        ):
            return None
        payload = buf[hdr.header_len :]
        if checksum(payload) != hdr.payload_xxh:
            return None
        try:
            return decode_array(hdr.codec, payload, hdr.raw_len, self.elem_size)
        except ValueError:
            return None

    async def _read_locs(self, locs: list[_Loc]) -> list[memoryview | None]:
        out: list[memoryview | None] = [None] * len(locs)
        by_seg: dict[int, list[int]] = {}
        for i, loc in enumerate(locs):
            by_seg.setdefault(loc.seg.seq, []).append(i)
        await asyncio.gather(*(self._read_segment(idxs, locs, out) for idxs in by_seg.values()))
        return out

    async def _read_segment(self, idxs: list[int], locs: list[_Loc], out: list[memoryview | None]) -> None:
        """One open per segment; runs of adjacent entries are read with one call."""
        idxs.sort(key=lambda i: locs[i].offset)
        runs: list[list[int]] = []
        for i in idxs:
            if runs:
                last = locs[runs[-1][-1]]
                first = locs[runs[-1][0]]
                if (
                    locs[i].offset == last.offset + last.length
                    and locs[i].offset + locs[i].length - first.offset <= self.max_read_bytes
                ):
                    runs[-1].append(i)
                    continue
            runs.append([i])
        path = locs[idxs[0]].seg.path
        try:
            async with aiofiles.open(path, "rb", buffering=0) as f:
                fd = f.fileno()
                for run in runs:
                    start = locs[run[0]].offset
                    end = locs[run[-1]].offset + locs[run[-1]].length
                    buf = bytearray(end - start)
                    view = memoryview(buf)
                    await f.seek(start)
                    got = 0
                    while got < len(buf):
                        n = await f.readinto(view[got:])
                        if not n:
                            break
                        got += n
                    if self.drop_cache:
                        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
                    for i in run:
                        a = locs[i].offset - start
                        b = a + locs[i].length
                        if b <= got:
                            out[i] = view[a:b]
        except OSError as exc:
            logger.warning("SSD tier: reading %s failed: %s", path, exc)

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
            # Over budget (it may have shrunk since the last run): evict the oldest.
            while self._disk_bytes > self._capacity and self._index:
                h, loc = self._index.popitem(last=False)
                loc.seg.live -= 1
                self._recovered.pop(h, None)
                self._c["evictions"] += 1
                if loc.seg.live == 0:
                    doomed.append(self._unlink_locked(loc.seg))
        await self._delete_segments(doomed)

    async def _scan_segment(self, seg: _Segment) -> list[tuple[EntryHeader, int]]:
        """Headers of the valid entries of one segment, in file order."""
        found: list[tuple[EntryHeader, int]] = []
        async with aiofiles.open(seg.path, "rb") as f:
            head = await f.read(min(seg.size, MAX_LAYOUT_LEN + 64))
            try:
                layout_id, _, seg.header_len = parse_segment_header(head)
            except FormatError as exc:
                logger.warning("SSD tier: %s discarded: %s", seg.path, exc)
                self._c["discarded_segments"] += 1
                return found
            if layout_id != self.layout_id:
                logger.warning("SSD tier: %s belongs to another layout; discarded", seg.path)
                self._c["discarded_segments"] += 1
                return found
            offset: int | None = seg.header_len
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
                    offset = await self._resync(f, seg, offset + 1)
                    continue
                if hdr.entry_len > remaining:
                    self._c["torn_entries"] += 1
                    logger.warning("SSD tier: %s has a torn tail at %d; ignored", seg.path, offset)
                    break
                if hdr.layout_id == self.layout_id and hdr.raw_len == self.block_bytes:
                    found.append((hdr, offset))
                offset += hdr.entry_len
        return found

    async def _resync(self, f: Any, seg: _Segment, offset: int) -> int | None:
        """The offset of the next entry whose header verifies, or None (rare: only after corruption)."""
        await f.seek(offset)
        rest = await f.read(seg.size - offset)
        view = memoryview(rest)
        pos = rest.find(ENTRY_MAGIC)
        while pos >= 0:
            try:
                hdr = parse_entry_header(view[pos : pos + MAX_ENTRY_HEADER_LEN])
                if pos + hdr.entry_len <= len(rest):
                    return offset + pos
            except FormatError:
                pass
            pos = rest.find(ENTRY_MAGIC, pos + 1)
        return None


def _is_torn(chunk: bytes, remaining: int) -> bool:
    """True if an entry header failed to parse only because the file ends inside it."""
    if remaining < ENTRY_FIXED_LEN:
        return True
    try:
        return remaining < entry_header_len(chunk)
    except FormatError:
        return False


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
