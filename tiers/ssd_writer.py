"""The SSD tier's writer: one task on the loop thread that drains the write-behind ring.

`put` never waits for the disk: it copies into the ring (`tiers.ssd_ring`) and wakes the
writer, at most one wake-up in flight. The writer takes the ring's chunks in order, prepares
chunk N+1 (headers, compression: `tiers.ssd_batch`) while batch N is written, and writes each
batch (`write_batch`: evict to fit the budget, append, index). A chunk goes back to the ring
after its write, whatever happened; what it held and did not write (refused by the budget, cut
short by a full disk) is reported lost. When it runs
out of work it syncs once, `sync_delay_s` later (at most one idle sync pending: a steady
trickle of puts must not sync every batch).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from pagekv.proto.loop_thread import LoopThread
from pagekv.tiers.codec import CODEC_RAW
from pagekv.tiers.ssd_batch import Batch, BatchEncoder
from pagekv.tiers.ssd_files import SegmentFiles
from pagekv.tiers.ssd_index import Segment, SsdIndex
from pagekv.tiers.ssd_ring import Chunk, Pending, PendingRing

logger = logging.getLogger(__name__)


class SsdWriter:
    def __init__(
        self,
        loop: LoopThread,
        *,
        cond: threading.Condition,
        ring: PendingRing,
        index: SsdIndex,
        encoder: BatchEncoder,
        files: SegmentFiles,
        closing: Callable[[], bool],
        on_error: Callable[[str, BaseException], None],
        counters: dict[str, float],
        sync_delay_s: float,
    ) -> None:
        self._loop = loop
        self._cond = cond  # the tier's lock, and waiters on the backlog (flush)
        self._ring = ring
        self._index = index
        self._encoder = encoder
        self._files = files
        self._closing = closing
        self._on_error = on_error
        self._c = counters
        self.sync_delay_s = sync_delay_s
        self.busy = False  # a chunk is out of the ring, being written (under the tier's lock)
        self._wake_scheduled = False
        self._work = asyncio.Event()
        self._idle_sync: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the writer task (on the loop thread)."""
        self._task = asyncio.get_running_loop().create_task(self._main())

    async def stop(self) -> None:
        """Let the writer finish what it has and end (once the tier is closing)."""
        self._work.set()
        if self._task is not None:
            await self._task

    def wake_needed_locked(self) -> bool:
        """After a put, under the tier's lock: True if the caller must `wake()` the writer."""
        wake = not self._wake_scheduled
        self._wake_scheduled = True
        return wake

    def wake(self) -> None:
        self._loop.call_soon(self._work.set)

    async def _main(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            with self._cond:
                self._wake_scheduled = False
            await self._drain()
            if self._closing():
                return

    def _take_chunk(self) -> Chunk | None:
        with self._cond:
            chunk = self._ring.take_chunk()
            if chunk is not None:
                self.busy = True
            return chunk

    def _recycle(self, chunk: Chunk) -> None:
        with self._cond:
            lost = self._ring.recycle(chunk)
            if lost:
                self._index.dropped.extend(lost)
                self._cond.notify_all()

    def _live_of(self, entries: list[Pending]) -> list[int]:
        with self._cond:  # popped while pending: not worth compressing or writing
            return [i for i, p in enumerate(entries) if self._ring.is_live(p)]

    async def _prepare(self, chunk: Chunk) -> Batch:
        t0 = time.perf_counter()
        batch = await self._encoder.prepare(chunk, self._live_of)
        self._c["encode_seconds"] += time.perf_counter() - t0
        return batch

    async def _drain(self) -> None:
        """Write every chunk there is, preparing the next while one is written; then schedule
        the idle sync."""

        def start(chunk: Chunk | None) -> asyncio.Task[Batch] | None:
            return None if chunk is None else asyncio.ensure_future(self._prepare(chunk))

        task = start(self._take_chunk())
        try:
            while task is not None:
                batch = await task
                task = start(self._take_chunk())
                try:
                    await self.write_batch(batch)
                finally:
                    self._recycle(batch.chunk)
            if self._idle_sync is None:
                self._idle_sync = asyncio.get_running_loop().call_later(
                    self.sync_delay_s, self._start_idle_sync
                )
        except OSError as exc:
            self._on_error("write failed", exc)
        except Exception as exc:  # a bug must not kill the writer silently and leave flush() hanging
            logger.exception("SSD tier writer failed")
            self._on_error("writer crashed", exc)
        finally:
            if task is not None:
                done = await asyncio.gather(task, return_exceptions=True)
                if isinstance(done[0], Batch):
                    self._recycle(done[0].chunk)
            with self._cond:
                self.busy = False
                self._cond.notify_all()

    async def write_batch(self, batch: Batch) -> None:
        """Make room in the budget, append the batch to the active segment, then move its
        entries from the ring to the index. A full disk keeps what landed whole and is
        reported to `on_error` (which shrinks the budget) without stopping the writer."""
        async with self._files.lock:
            with self._cond:
                doomed, keep = self._make_room_locked(batch)
            await self._files.delete(doomed)
            if not keep:
                return
            done = await self._files.append(batch.view[: batch.size_of_first(keep)],
                                            lambda n: batch.size_of_first(batch.fitting(n)))
            if done.full is not None:
                self._on_error("write", done.full)
            seg, start, keep = done.seg, done.start, batch.fitting(done.written)
            if seg is None:
                return
            with self._cond:
                for p, offset, length, codec in batch.items[:keep]:
                    if self._ring.landed(p):
                        self._index.add(p.block_hash, seg, start + offset, length)
                        self._c["entries_written"] += 1
                        self._c["raw_bytes_written"] += p.nbytes
                        if codec != CODEC_RAW:
                            self._c["compressed_entries"] += 1
                    else:
                        self._c["dead_entries_written"] += 1
                self._c["bytes_written"] += done.written
                self._c["write_seconds"] += done.seconds
                if seg.live == 0:
                    self._files.schedule_reclaim_locked()
                self._cond.notify_all()

    def _make_room_locked(self, batch: Batch) -> tuple[list[Segment], int]:
        """Evict until the batch fits the budget. Returns (segments to delete, how many of the
        batch's entries to write); the rest are dropped when its chunk is recycled."""
        header = self._files.header_len if self._files.rolls_for(batch.size) else 0
        doomed = self._index.make_room(batch.size + header, self._files.active)
        keep = batch.fitting(self._index.capacity - self._index.disk_bytes - header)
        # Nothing left to evict (reads pin it, or a tiny budget): the rest is refused.
        self._c["put_drops"] += sum(self._ring.is_live(p) for p, *_ in batch.items[keep:])
        return doomed, keep

    def _start_idle_sync(self) -> None:
        self._idle_sync = None
        loop = asyncio.get_running_loop()
        if self.busy:
            self._idle_sync = loop.call_later(self.sync_delay_s, self._start_idle_sync)
        elif not self._closing():
            loop.create_task(self._files.sync_now())
