"""The SSD tier's in-memory index: where each written block is, LRU first, within a byte budget.

`capacity` bounds the bytes of segment files on disk (headers, padding and holes included).
Before a batch is written, LRU entries are evicted until it fits (`evict`, the one eviction
loop, also used at start-up when the budget has shrunk since the last run); a segment whose
entries are all gone is deleted, never compacted. In the exclusive chain an SSD read is a
promotion that removes the entry, so LRU order is write order and eviction frees whole old
segments first.

The index keeps the books of the segment files (sizes, live entries, reads in flight);
`tiers.ssd_files` owns the files themselves. Not thread-safe: the tier's lock guards every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pagekv.proto.medium import Medium
from pagekv.proto.retention import RetentionTable


@dataclass(slots=True)
class Segment:
    seq: int
    path: str
    size: int = 0  # bytes in the file; what counts against the budget
    first_entry: int = 0  # offset of the first entry (after the padded segment header)
    live: int = 0  # indexed entries
    pins: int = 0  # reads in flight: the file must not be deleted under them
    dirty: bool = False  # written since its last fdatasync

    @property
    def reclaimable(self) -> bool:
        return self.live == 0 and self.pins == 0


@dataclass(slots=True)
class Loc:
    seg: Segment
    offset: int  # aligned
    length: int  # header + payload, unpadded


class SsdIndex:
    def __init__(
        self, capacity: int, counters: dict[str, float], on_reclaimable: Callable[[], None],
        retention: RetentionTable | None = None, retained_cap_blocks: int = 0,
    ) -> None:
        """`on_reclaimable` is called when a segment loses its last entry outside `evict`
        (a removal, a finished read): the tier then deletes it on its loop thread.
        `retention`: the LRU entries it holds are passed over by `evict`, up to
        `retained_cap_blocks` (a spared entry keeps its segment file on disk)."""
        self.capacity = capacity
        self.entries: OrderedDict[bytes, Loc] = OrderedDict()  # LRU first
        self.segments: dict[int, Segment] = {}
        self.disk_bytes = 0
        self.dropped: list[bytes] = []  # lost without being asked, for take_dropped()
        self._c = counters
        self._on_reclaimable = on_reclaimable
        self.retention = retention
        self.retained_cap_blocks = retained_cap_blocks

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def lru(self) -> bytes | None:
        return next(iter(self.entries), None)

    def touch(self, block_hash: bytes) -> bool:
        """Make an entry most recently used; False if absent."""
        if block_hash not in self.entries:
            return False
        self.entries.move_to_end(block_hash)
        return True

    # --- segments ------------------------------------------------------------------------
    def add_segment(self, seg: Segment) -> None:
        self.segments[seg.seq] = seg
        self.disk_bytes += seg.size

    def grow(self, seg: Segment, nbytes: int) -> None:
        """A write of `nbytes` to `seg` is under way: it counts from now, whatever happens."""
        seg.size += nbytes
        seg.dirty = True
        self.disk_bytes += nbytes

    def resize(self, seg: Segment, size: int) -> None:
        """A segment's file is now `size` bytes (a short write, cut back to its whole entries)."""
        self.disk_bytes += size - seg.size
        seg.size = size

    def unlink(self, seg: Segment) -> Segment:
        """Take a segment off the books (the caller deletes its file)."""
        del self.segments[seg.seq]
        self.disk_bytes -= seg.size
        return seg

    def collect_empty(self, active: Segment | None) -> list[Segment]:
        """Unlink the segments with no entries left; the caller deletes the files."""
        doomed = []
        for seg in list(self.segments.values()):
            if not seg.reclaimable:
                continue
            if seg is active and seg.size <= seg.first_entry:
                continue  # fresh active segment: nothing to reclaim yet
            doomed.append(self.unlink(seg))
        return doomed

    # --- entries -------------------------------------------------------------------------
    def add(self, block_hash: bytes, seg: Segment, offset: int, length: int) -> None:
        """Index an entry; a copy of the same block indexed before is superseded (at start-up
        the newest copy wins)."""
        old = self.entries.pop(block_hash, None)
        if old is not None:
            old.seg.live -= 1
        self.entries[block_hash] = Loc(seg, offset, length)
        seg.live += 1

    def pin(self, block_hash: bytes, remove: bool) -> Loc | None:
        """An entry about to be read: its segment stays until `unpin`. `remove`: it leaves the
        index now (a pop); else it becomes most recently used (a get)."""
        loc = self.entries.get(block_hash)
        if loc is None:
            return None
        if remove:
            del self.entries[block_hash]
            loc.seg.live -= 1
        else:
            self.entries.move_to_end(block_hash)
        loc.seg.pins += 1
        return loc

    def unpin(self, loc: Loc) -> None:
        loc.seg.pins -= 1
        if loc.seg.reclaimable:
            self._on_reclaimable()

    def remove(self, block_hash: bytes) -> bool:
        loc = self.entries.pop(block_hash, None)
        if loc is None:
            return False
        self._forget(loc)
        return True

    def discard(self, block_hash: bytes, loc: Loc) -> None:
        """Drop the entry at `loc` if it is still the block's (an unreadable copy)."""
        if self.entries.get(block_hash) is loc:
            del self.entries[block_hash]
            self._forget(loc)

    def evict(self, need: int) -> tuple[list[bytes], list[Segment]]:
        """Evict LRU entries until `need` more bytes fit the budget. Returns the evicted hashes
        and the segments they emptied, unlinked from the books (the caller deletes the files)."""
        evicted: list[bytes] = []
        doomed: list[Segment] = []
        retention = self.retention
        cap = self.retained_cap_blocks
        while self.disk_bytes + need > self.capacity and self.entries:
            if retention:
                block_hash = retention.spare_lru(self.entries, cap, Medium.DISK.value)
                loc = self.entries.pop(block_hash)
            else:
                block_hash, loc = self.entries.popitem(last=False)
            loc.seg.live -= 1
            self._c["evictions"] += 1
            evicted.append(block_hash)
            if loc.seg.reclaimable:
                doomed.append(self.unlink(loc.seg))
        return evicted, doomed

    def make_room(self, need: int, active: Segment | None) -> list[Segment]:
        """Before a write of `need` bytes: evict until it fits, reporting the evicted blocks
        dropped. Returns the segments to delete (also those emptied since the last reclaim)."""
        doomed = self.collect_empty(active)
        evicted, emptied = self.evict(need)
        self.dropped.extend(evicted)
        return doomed + emptied

    def drop_all(self) -> list[bytes]:
        """Forget every entry (the tier is disabled: its files are not used again)."""
        hashes = list(self.entries)
        self.entries.clear()
        return hashes

    def _forget(self, loc: Loc) -> None:
        """An entry left the index: its segment may now be reclaimable."""
        loc.seg.live -= 1
        if loc.seg.reclaimable:
            self._on_reclaimable()
