"""Turn one chunk of the write-behind ring into the bytes of one write call.

Uncompressed (the common case: KV rarely passes the ratio threshold), each entry's header is
written into the room its put reserved and the chunk is written as it is. When some blocks
compress, or some were removed while pending (not worth writing), the live entries are laid
out again, compressed where that pays, in an output buffer. Encoding runs on the loop's
executor, split across the I/O threads (lz4, numpy and xxhash release the GIL).
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagekv.tiers.codec import CODEC_RAW, encode
from pagekv.tiers.ssd_format import align_up, pack_entry_header
from pagekv.tiers.ssd_ring import Chunk, Pending


@dataclass(slots=True)
class Batch:
    """What one write call sends: `view[:size]`, holding `items` (p, offset, length, codec)."""

    chunk: Chunk  # the ring chunk the entries came from (recycled after the write)
    view: memoryview
    size: int = 0
    items: list[tuple[Pending, int, int, int]] = field(default_factory=list)

    def size_of_first(self, n: int) -> int:
        """Bytes of the batch's first `n` entries (with their padding)."""
        return self.size if n == len(self.items) else self.items[n][1]

    def fitting(self, room: int) -> int:
        """How many leading entries fit in `room` bytes."""
        n = 0
        for _, offset, length, _ in self.items:
            if align_up(offset + length) > room:
                break
            n += 1
        return n


class BatchEncoder:
    def __init__(
        self,
        *,
        layout_id: int,
        dtype_code: int,
        elem_size: int,
        compress: bool,
        min_ratio: float,
        threads: int,
        batch_bytes: int,
    ) -> None:
        self.layout_id = layout_id
        self.dtype_code = dtype_code
        self.elem_size = elem_size
        self.compress = compress
        self.min_ratio = min_ratio
        self.threads = threads
        # Two output buffers (anonymous mmaps: page-aligned, as O_DIRECT wants), so that
        # batch N+1 is prepared while batch N is written.
        self._out = [Chunk.of(mmap.mmap(-1, batch_bytes)) for _ in range(2)]
        self._turn = 0

    async def prepare(self, chunk: Chunk, live_of: Callable[[list[Pending]], list[int]]) -> Batch:
        """The batch for `chunk`; `live_of(entries)` says which entries are still pending (it
        takes the tier's lock). Alternates between the output buffers."""
        self._turn += 1
        out = self._out[self._turn % 2]
        loop = asyncio.get_running_loop()
        entries = list(chunk.entries)
        if self.compress and entries:
            live = live_of(entries)
            codecs: list[tuple[int, Any]] = [(CODEC_RAW, None)] * len(entries)
            groups = [live[k :: self.threads] for k in range(self.threads)]
            parts = await asyncio.gather(
                *(loop.run_in_executor(None, self._encode_group, entries, g) for g in groups if g)
            )
            for part in parts:
                for i, codec, payload in part:
                    codecs[i] = (codec, payload)
            if any(c != CODEC_RAW for c, _ in codecs) or len(live) != len(entries):
                return await loop.run_in_executor(
                    None, self._relayout, chunk, out, entries, codecs, live
                )
        return await loop.run_in_executor(None, self._headers_in_place, chunk, entries)

    def _encode_group(self, entries: list[Pending], idxs: list[int]) -> list[tuple[int, int, Any]]:
        out = []
        for i in idxs:
            codec, payload = encode(entries[i].payload(), self.elem_size, self.min_ratio)
            out.append((i, codec, payload if codec != CODEC_RAW else None))
        return out

    def _header(self, p: Pending, codec: int, payload: Any) -> bytes:
        header = pack_entry_header(
            block_hash=p.block_hash,
            parent_hash=p.parent_hash,
            token_ids=p.token_ids,
            layout_id=self.layout_id,
            dtype_code=self.dtype_code,
            codec=codec,
            raw_len=p.nbytes,
            payload=payload,
        )
        assert len(header) == p.header_len
        return header

    def _headers_in_place(self, chunk: Chunk, entries: list[Pending]) -> Batch:
        batch = Batch(chunk, chunk.view, chunk.fill)
        for p in entries:
            header = self._header(p, CODEC_RAW, p.payload())
            chunk.arr[p.offset : p.offset + p.header_len] = np.frombuffer(header, dtype=np.uint8)
            batch.items.append((p, p.offset, p.header_len + p.nbytes, CODEC_RAW))
        return batch

    def _relayout(
        self,
        chunk: Chunk,
        out: Chunk,
        entries: list[Pending],
        codecs: list[tuple[int, Any]],
        live: list[int],
    ) -> Batch:
        batch = Batch(chunk, out.view)
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
