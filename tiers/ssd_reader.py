"""The SSD tier's reads: from the write-behind ring, or from the segment files.

A block still pending is served from its copy in the ring. The others are read with their
segments pinned (a segment emptied meanwhile is not deleted under the read); a block that
fails verification is dropped, reported lost (`take_dropped`) and returned as a miss, never
as wrong data.

The entries to read are sorted by (segment, offset) and split into runs of adjacent entries,
up to one staging buffer each; the runs are read concurrently. A run is one executor job that
reads with `os.preadv` on a cached read-only handle's descriptor, then verifies and copies out
every entry (`ssd_format.decode_entry`): aiofiles has no positional read, a shared handle's
seek+read would race between concurrent reads, and one hop per run instead of five (open,
seek, read, close, verify) is what keeps reads near device speed on a busy host. The read,
xxhash and the numpy copies release the GIL.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pagekv.proto.loop_thread import LoopThread
from pagekv.tiers.codec import U8Array
from pagekv.tiers.ssd_files import ReadHandle, SegmentFiles
from pagekv.tiers.ssd_format import align_up, decode_entry
from pagekv.tiers.ssd_index import Loc, SsdIndex
from pagekv.tiers.ssd_ring import PendingRing

logger = logging.getLogger(__name__)

CORRUPT = "corrupt"  # a read's result: the bytes arrived but failed verification
ReadResult = U8Array | str | None  # the block, CORRUPT, or None (could not be read)


class SsdReader:
    def __init__(
        self,
        loop: LoopThread,
        files: SegmentFiles,
        *,
        cond: threading.Condition,
        ring: PendingRing,
        index: SsdIndex,
        remove_locked: Callable[[bytes], bool],
        counters: dict[str, float],
        block_bytes: int,
        layout_id: int,
        elem_size: int,
        read_chunk_bytes: int,
        buffers: int,
    ) -> None:
        """`buffers` staging buffers of `read_chunk_bytes` (one per I/O thread), made once.
        `remove_locked` is the tier's removal (a pop of a pending block)."""
        self._loop = loop
        self._files = files
        self._cond = cond
        self._ring = ring
        self._index = index
        self._remove_locked = remove_locked
        self._c = counters
        self.block_bytes = block_bytes
        self.layout_id = layout_id
        self.elem_size = elem_size
        self.read_chunk_bytes = read_chunk_bytes
        self._bufs: asyncio.Queue[mmap.mmap] = asyncio.Queue()
        for _ in range(buffers):
            self._bufs.put_nowait(mmap.mmap(-1, read_chunk_bytes))

    def fetch(self, block_hashes: Sequence[bytes], remove: bool) -> list[torch.Tensor | None]:
        """The blocks' data (None: a miss); `remove`: they leave the tier (from any thread but
        the loop's)."""
        results: list[torch.Tensor | None] = [None] * len(block_hashes)
        reads: list[tuple[int, bytes, Loc]] = []
        with self._cond:
            self._c["reads"] += len(block_hashes)
            for i, h in enumerate(block_hashes):
                p = self._ring.get(h)
                if p is not None:  # not on disk yet: serve the copy we hold
                    results[i] = torch.from_numpy(p.payload().copy())
                    if remove:
                        self._remove_locked(h)
                    self._c["read_hits"] += 1
                    continue
                loc = self._index.pin(h, remove)
                if loc is not None:
                    reads.append((i, h, loc))
        if not reads:
            return results
        t0 = time.perf_counter()
        try:
            arrays = self._loop.run(self.read([(h, loc) for _, h, loc in reads]))
        except Exception as exc:  # the loop is gone (closing): a miss, never a raise
            logger.warning("SSD tier read failed: %s", exc)
            arrays = [None] * len(reads)
        elapsed = time.perf_counter() - t0
        failed: list[tuple[bytes, Loc, bool]] = []
        for (i, h, loc), arr in zip(reads, arrays, strict=True):
            if isinstance(arr, np.ndarray):
                results[i] = torch.from_numpy(arr)
            else:
                failed.append((h, loc, arr is not None))
        with self._cond:
            for _, _, loc in reads:
                self._index.unpin(loc)
            for h, loc, corrupt in failed:
                self._c["checksum_failures" if corrupt else "read_errors"] += 1
                if not remove:
                    self._index.discard(h, loc)
                self._index.dropped.append(h)  # lost without being asked: the chain must know
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

    async def read(self, wanted: list[tuple[bytes, Loc]]) -> list[ReadResult]:
        """One result per wanted (hash, location), in order (loop thread)."""
        out: list[ReadResult] = [None] * len(wanted)
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
        self, run: list[int], wanted: list[tuple[bytes, Loc]], out: list[ReadResult]
    ) -> None:
        first, last = wanted[run[0]][1], wanted[run[-1]][1]
        start, end = first.offset, align_up(last.offset + last.length)
        items = [(i, wanted[i][0], wanted[i][1].offset - start, wanted[i][1].length) for i in run]
        buf = await self._bufs.get()
        handle: ReadHandle | None = None
        try:
            handle = await self._files.acquire_read(first.seg)
            decoded = await asyncio.get_running_loop().run_in_executor(
                None, self._pread_decode, handle.f.fileno(), start, end - start, buf, items
            )
            for i, arr in decoded:
                out[i] = arr
        except OSError as exc:
            logger.warning("SSD tier: reading %s failed: %s", first.seg.path, exc)
        finally:
            self._bufs.put_nowait(buf)
            if handle is not None:
                await self._files.release_read(handle)

    def _pread_decode(
        self, fd: int, start: int, length: int, buf: mmap.mmap, items: list[tuple[int, bytes, int, int]]
    ) -> list[tuple[int, ReadResult]]:
        """Read a run into the staging buffer, then verify and copy out each entry (executor
        thread). One hop per run."""
        view = memoryview(buf)[:length]
        got = 0
        while got < length:
            n = os.preadv(fd, [view[got:]], start + got)
            if n <= 0:
                break  # the file ends early (torn)
            got += n
        if not self._files.direct_io:
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
        out: list[tuple[int, ReadResult]] = []
        for i, block_hash, offset, size in items:
            if offset + size > got:
                out.append((i, None))
                continue
            arr = decode_entry(view[offset : offset + size], block_hash, self.layout_id,
                               self.block_bytes, self.elem_size)
            out.append((i, CORRUPT if arr is None else arr))
        return out
