"""The SSD tier's segment files: naming, the active segment, syncing, deletion, read handles.

Files are `<directory>/seg-<seq>.pkv`, written sequentially and never rewritten: a write
appends one batch to the active segment, and a segment that a batch would overflow is sealed
(read-only from then on) and a new one started.

Direct I/O. Segments are opened with O_DIRECT where the filesystem allows it (entries are
4 KiB-aligned, write and read buffers page-aligned and made once at start-up): the page cache
would be a second copy of what the DRAM tier already caches, and the copy into it costs as
much as the disk write. Without O_DIRECT (tmpfs, some network filesystems) the tier falls
back to buffered I/O and drops the pages it wrote or read (POSIX_FADV_DONTNEED).

Durability. A segment is `fdatasync`ed when it is sealed (in the background: the writer goes
on) and on `sync_now` (the writer's idle sync, `flush`, `close`); never per batch, which would
cost a journal commit per write. A crash loses at most the unsynced tail, which the start-up
scan sees as torn (or never sees).

A full disk. Writes are positional (`os.pwrite`); a short one is retried for the rest, which
lands or fails with the real error. On ENOSPC `append` keeps the whole entries that landed,
cuts the torn tail off the file (so the file ends at an entry boundary and a restart finds no
tear), and reports the error in its result: the tier shrinks its budget, it does not stop.

Every coroutine runs on the tier's loop thread; `lock` serialises appends and deletions. The
books (sizes, live entries) are the index's, updated under the tier's lock. A segment left
with no entries is deleted (`schedule_reclaim_locked`): there is no compaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os

from pagekv.proto.loop_thread import LoopThread
from pagekv.tiers.ssd_format import align_up, pack_segment_header
from pagekv.tiers.ssd_index import Segment, SsdIndex

logger = logging.getLogger(__name__)

_SEG_RE = re.compile(r"^seg-(\d{10})\.pkv$")
MAX_READ_HANDLES = 64  # open read-only segment files kept for reuse


def segment_header(layout_bytes: bytes) -> mmap.mmap:
    """A segment's header, zero-padded to the alignment in a page-aligned buffer (O_DIRECT)."""
    header = pack_segment_header(layout_bytes)
    buf = mmap.mmap(-1, align_up(len(header)))
    buf.write(header)
    return buf


class IncompleteWrite(OSError):
    """A write that failed part way: `written` of its bytes landed, from its start."""

    def __init__(self, err: int, message: str, written: int) -> None:
        super().__init__(err, message)
        self.written = written


def pwrite_all(fd: int, data: memoryview, offset: int, path: str) -> None:
    """Write all of `data` at `offset` (blocking). A short write is continued: the rest
    lands, or its error (ENOSPC, typically) is raised as an IncompleteWrite saying how much
    landed, with the errno the system gave (a short count alone is no error)."""
    done = 0
    while done < len(data):
        try:
            n = os.pwrite(fd, data[done:], offset + done)
        except OSError as exc:
            raise IncompleteWrite(exc.errno or errno.EIO, f"{exc.strerror}: writing {path} "
                                  f"({done} of {len(data)} bytes written)", done) from exc
        if n <= 0:  # never for a regular file, by POSIX; do not loop on it
            raise IncompleteWrite(errno.EIO, f"write to {path} made no progress "
                                  f"({done} of {len(data)} bytes written)", done)
        done += n


def held_bytes(directory: Path) -> int:
    """Bytes of the segment files in `directory` (0 if it is not there yet); blocking."""
    try:
        return sum(e.stat().st_size for e in os.scandir(directory) if _SEG_RE.match(e.name))
    except OSError:
        return 0


@dataclass(slots=True)
class Appended:
    """What `append` wrote: `written` bytes at `start` of `seg` (all it was given unless
    `full`, the ENOSPC that stopped it; then only whole entries, and `seg` is None if no
    segment could be started)."""

    seg: Segment | None
    start: int
    written: int
    seconds: float
    full: OSError | None = None


@dataclass(slots=True, eq=False)
class ReadHandle:
    f: Any  # aiofiles handle, read-only; positional reads use its descriptor
    users: int = 0


class SegmentFiles:
    def __init__(
        self,
        loop: LoopThread,
        directory: Path,
        header: mmap.mmap,
        segment_bytes: int,
        *,
        books_lock: threading.Lock,
        index: SsdIndex,
        sync: bool,
        direct_io: bool,
        counters: dict[str, float],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        """`on_error` disables the tier (a failed background sync has no caller to raise to)."""
        self._loop = loop
        self.directory = directory
        self._header = header
        self.header_len = len(header)
        self.segment_bytes = segment_bytes
        self.sync = sync
        self.direct_io = direct_io
        self._books_lock = books_lock
        self._index = index
        self._c = counters
        self._on_error = on_error
        self.lock = asyncio.Lock()
        self.active: Segment | None = None
        self._active_file: Any = None  # aiofiles handle of the active segment
        self._next_seq = 1
        self._sealing: set[asyncio.Task[None]] = set()  # segments being synced and closed
        self._rfiles: OrderedDict[int, ReadHandle] = OrderedDict()  # seq -> handle, LRU first
        self._reclaim_scheduled = False  # under the books lock
        self._shut = False

    def opener(self, path: str, flags: int) -> int:
        return os.open(path, flags | (os.O_DIRECT if self.direct_io else 0))

    async def list_segments(self) -> list[tuple[int, str]]:
        """(seq, path) of the segment files already there, oldest first; new ones follow them."""
        names = await aiofiles.os.listdir(self.directory)
        found = sorted((int(m.group(1)), name) for name in names if (m := _SEG_RE.match(name)))
        if found:
            self._next_seq = found[-1][0] + 1
        return [(seq, str(self.directory / name)) for seq, name in found]

    # --- writing (callers hold `lock`) -------------------------------------------------
    def rolls_for(self, nbytes: int) -> bool:
        """True if appending `nbytes` starts a new segment (whose header counts too)."""
        return self.active is None or self._full_for(nbytes)

    def _full_for(self, nbytes: int) -> bool:
        seg = self.active
        return seg is not None and seg.size > seg.first_entry and seg.size + nbytes > self.segment_bytes

    async def append(self, data: memoryview, whole: Callable[[int], int]) -> Appended:
        """Write `data` at the end of the active segment (a new one if it would overflow).
        `whole(n)`: how many of the first `n` bytes of `data` are whole entries. ENOSPC is
        reported in the result; any other error raises."""
        if self._full_for(len(data)):
            self.close_active()  # sealed: it stays, read-only from now on
        if self.active is None:
            try:
                await self.open_segment()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return Appended(None, 0, 0, 0.0, exc)
        seg, f = self.active, self._active_file
        assert seg is not None
        start = seg.size
        with self._books_lock:  # reserve: the file grows now, whatever happens next
            self._index.grow(seg, len(data))
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, pwrite_all, f.fileno(), data, start, seg.path)
        except IncompleteWrite as exc:
            if exc.errno != errno.ENOSPC:
                raise
            kept = whole(exc.written)
            await self._cut(seg, f, start + kept)
            return Appended(seg, start, kept, time.perf_counter() - t0, exc)
        return Appended(seg, start, len(data), time.perf_counter() - t0)

    async def _cut(self, seg: Segment, f: Any, size: int) -> None:
        """After a short write: the file and its books end at `size`, the end of its last whole
        entry (the torn tail would only cost a warning at the next start)."""
        with self._books_lock:
            self._index.resize(seg, size)
        try:
            await asyncio.get_running_loop().run_in_executor(None, os.ftruncate, f.fileno(), size)
        except OSError as exc:  # harmless: the start-up scan stops at a torn tail
            logger.warning("SSD tier: cannot cut the torn tail off %s: %s", seg.path, exc)

    async def open_segment(self) -> None:
        seq = self._next_seq
        self._next_seq += 1
        path = str(self.directory / f"seg-{seq:010d}.pkv")
        try:
            # 'x': never clobber an existing file
            f = await aiofiles.open(path, "xb", buffering=0, opener=self.opener)
        except OSError as exc:
            if not (self.direct_io and exc.errno == errno.EINVAL):
                raise
            logger.info("SSD tier: %s does not support O_DIRECT; using buffered I/O", self.directory)
            self.direct_io = False
            f = await aiofiles.open(path, "xb", buffering=0, opener=self.opener)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, pwrite_all, f.fileno(), memoryview(self._header), 0, path)
            if self.sync:
                await loop.run_in_executor(None, os.fdatasync, f.fileno())
                await loop.run_in_executor(None, _fsync_dir, str(self.directory))
        except BaseException:
            await f.close()
            with contextlib.suppress(OSError):  # a headless file only costs a warning at start
                await aiofiles.os.remove(path)
            raise
        seg = Segment(seq, path, size=self.header_len, first_entry=self.header_len)
        with self._books_lock:
            self._index.add_segment(seg)
        self.active, self._active_file = seg, f

    def close_active(self) -> None:
        """Seal the active segment: sync and close it in the background."""
        if self._active_file is None:
            return
        seg, f = self.active, self._active_file
        self.active = self._active_file = None
        task = asyncio.get_running_loop().create_task(self._seal(seg, f))
        self._sealing.add(task)
        task.add_done_callback(self._sealing.discard)

    async def _seal(self, seg: Segment | None, f: Any) -> None:
        try:
            await self._datasync(seg, f)
        except OSError as exc:
            self._on_error("sync failed", exc)
        finally:
            await f.close()

    async def sync_now(self) -> None:
        """Make everything written so far durable: the active segment and the ones sealing."""
        try:
            async with self.lock:
                await self._datasync(self.active, self._active_file)
            await asyncio.gather(*self._sealing)
        except OSError as exc:
            self._on_error("sync failed", exc)

    async def _datasync(self, seg: Segment | None, f: Any) -> None:
        """fdatasync a segment written since its last sync, then drop its (clean) pages."""
        if seg is None or f is None or not seg.dirty or not self.sync:
            return
        fd = f.fileno()
        await asyncio.get_running_loop().run_in_executor(None, os.fdatasync, fd)
        seg.dirty = False
        self._c["syncs"] += 1
        if not self.direct_io:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    async def delete(self, doomed: list[Segment]) -> None:
        """Delete the files of segments already taken off the books."""
        for seg in doomed:
            await self._close_read_handle(seg.seq)
            if seg is self.active:
                f, self.active, self._active_file = self._active_file, None, None
                await f.close()  # its entries are all gone: no point syncing it
            try:
                await aiofiles.os.remove(seg.path)
                self._c["deleted_segments"] += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("SSD tier: cannot delete %s: %s", seg.path, exc)

    def schedule_reclaim_locked(self) -> None:
        """A segment has no entries left (the books lock held, any thread): delete it, and any
        others by then, on the loop thread."""
        if self._reclaim_scheduled or self._shut or self._loop.loop.is_closed():
            return
        self._reclaim_scheduled = True
        self._loop.submit(self._reclaim())

    async def _reclaim(self) -> None:
        async with self.lock:
            with self._books_lock:
                self._reclaim_scheduled = False
                doomed = self._index.collect_empty(self.active)
            await self.delete(doomed)

    async def shutdown(self) -> None:
        async with self.lock:
            self.close_active()
        await asyncio.gather(*self._sealing)
        for seq in list(self._rfiles):
            await self._close_read_handle(seq)
        with self._books_lock:
            self._shut = True  # the loop stops next: nothing more may be scheduled on it

    # --- reading -----------------------------------------------------------------------
    async def acquire_read(self, seg: Segment) -> ReadHandle:
        """A cached read-only handle on a segment (opened once, LRU-bounded)."""
        handle = self._rfiles.get(seg.seq)
        if handle is None:
            f = await aiofiles.open(seg.path, "rb", buffering=0, opener=self.opener)
            handle = self._rfiles.get(seg.seq)  # another read may have opened it meanwhile
            if handle is None:
                handle = self._rfiles[seg.seq] = ReadHandle(f)
            else:
                await f.close()
        self._rfiles.move_to_end(seg.seq)
        handle.users += 1
        return handle

    async def release_read(self, handle: ReadHandle) -> None:
        handle.users -= 1
        idle = [seq for seq, h in self._rfiles.items() if h.users == 0]
        for seq in idle[: max(0, len(self._rfiles) - MAX_READ_HANDLES)]:
            await self._rfiles.pop(seq).f.close()

    async def _close_read_handle(self, seq: int) -> None:
        handle = self._rfiles.pop(seq, None)
        if handle is not None:  # a deleted segment has no reads in flight (pins)
            await handle.f.close()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
