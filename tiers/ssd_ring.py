"""The SSD tier's write-behind backlog: blocks accepted by `put` and not on disk yet.

The backlog is a ring of `batch_bytes` chunks in one anonymous mmap made at start-up (page-
aligned, as O_DIRECT wants). `put` copies each block straight to its place in an entry laid
out exactly as it goes to disk (room for the header, the payload, zero padding), so a batch
that does not compress is written from where it was copied, with no second copy. A chunk fills
until the next entry does not fit and then waits, sealed, for the writer; with no chunk free a
put is refused: the disk is behind, and the backlog must not grow memory. A pending block is
readable from its chunk until its write lands.

Not thread-safe: the tier's lock guards every call.
"""

from __future__ import annotations

import mmap
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pagekv.tiers.codec import U8Array
from pagekv.tiers.ssd_format import align_up


@dataclass(slots=True, eq=False)
class Chunk:
    """One slice of the ring (or a writer's output buffer): entries laid out as on disk."""

    arr: U8Array  # uint8 view of the slice
    view: memoryview  # the same bytes, page-aligned, for the write call
    fill: int = 0  # bytes reserved (aligned)
    entries: list[Pending] = field(default_factory=list)

    @classmethod
    def of(cls, buf: mmap.mmap | memoryview) -> Chunk:
        return cls(np.frombuffer(buf, dtype=np.uint8), memoryview(buf))


@dataclass(slots=True, eq=False)
class Pending:
    """A block accepted by put and not on disk yet: its raw payload sits in a chunk."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    chunk: Chunk
    offset: int  # of the entry (header first) in the chunk
    header_len: int
    nbytes: int

    def payload(self) -> U8Array:
        start = self.offset + self.header_len
        return self.chunk.arr[start : start + self.nbytes]


class PendingRing:
    def __init__(self, batch_bytes: int, max_pending_bytes: int) -> None:
        n_chunks = max(2, max_pending_bytes // batch_bytes)
        self.batch_bytes = batch_bytes
        self.max_bytes = n_chunks * batch_bytes  # the backlog's size, rounded to chunks
        self._mem = mmap.mmap(-1, self.max_bytes)
        view = memoryview(self._mem)
        self._free = [Chunk.of(view[i * batch_bytes : (i + 1) * batch_bytes])
                      for i in reversed(range(n_chunks))]  # fmt: skip
        self._filling: Chunk | None = None
        self._sealed: deque[Chunk] = deque()  # full chunks waiting for the writer
        self.entries: dict[bytes, Pending] = {}
        self.nbytes = 0  # payload bytes pending

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def get(self, block_hash: bytes) -> Pending | None:
        return self.entries.get(block_hash)

    def is_live(self, p: Pending) -> bool:
        """False once `p` was removed while pending (its bytes stay, as a dead entry)."""
        return self.entries.get(p.block_hash) is p

    def free_slots(self, footprint: int) -> int:
        """How many entries of up to `footprint` bytes `reserve` takes before refusing."""
        per_chunk = self.batch_bytes // footprint
        filling = self._filling
        left = (self.batch_bytes - filling.fill) // footprint if filling is not None else 0
        return len(self._free) * per_chunk + left

    def reserve(
        self,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: tuple[int, ...],
        header_len: int,
        data: U8Array,
    ) -> Pending | None:
        """Copy a block into the ring behind room for its header; None if the ring is full."""
        footprint = align_up(header_len + len(data))
        chunk = self._filling
        if chunk is None or chunk.fill + footprint > self.batch_bytes:
            if chunk is not None:
                self._sealed.append(chunk)
                self._filling = None
            if not self._free:
                return None
            chunk = self._filling = self._free.pop()
        p = Pending(block_hash, parent_hash, token_ids, chunk, chunk.fill, header_len, len(data))
        chunk.fill += footprint
        chunk.entries.append(p)
        np.copyto(p.payload(), data)
        chunk.arr[p.offset + header_len + p.nbytes : p.offset + footprint] = 0  # padding
        self.entries[block_hash] = p
        self.nbytes += p.nbytes
        return p

    def take_chunk(self) -> Chunk | None:
        """The next chunk to write: a full one, else the one being filled (so nothing waits)."""
        if self._sealed:
            return self._sealed.popleft()
        if self._filling is not None and self._filling.entries:
            chunk, self._filling = self._filling, None
            return chunk
        return None

    def landed(self, p: Pending) -> bool:
        """`p`'s write landed: it leaves the backlog. False if it was removed meanwhile."""
        if not self.is_live(p):
            return False
        del self.entries[p.block_hash]
        self.nbytes -= p.nbytes
        return True

    def remove(self, block_hash: bytes) -> bool:
        p = self.entries.pop(block_hash, None)
        if p is None:
            return False
        self.nbytes -= p.nbytes  # its bytes stay in the chunk; written, if at all, as dead
        return True

    def recycle(self, chunk: Chunk) -> list[bytes]:
        """A chunk the writer is done with goes back to the free list. Returns the blocks in
        it that were not written (refused or failed) and so are lost."""
        lost = [p.block_hash for p in chunk.entries if self.is_live(p)]
        for block_hash in lost:
            self.remove(block_hash)
        chunk.entries.clear()
        chunk.fill = 0
        self._free.append(chunk)
        return lost

    def drop_all(self) -> list[bytes]:
        """Forget every pending block (the tier is disabled); the writer recycles its chunk."""
        hashes = list(self.entries)
        self.entries.clear()
        self._sealed.clear()
        self._filling = None
        self.nbytes = 0
        return hashes
