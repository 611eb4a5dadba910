"""The SSD tier's byte budget against the filesystem under it: a full disk shrinks the budget.

The budget is what the operator asked for; the filesystem may hold less (a small volume, other
files on it). At start-up a budget larger than what the filesystem can give the tier (its free
space plus what the tier already holds) gets a warning. When a write fails with ENOSPC the
tier does not stop: its budget shrinks to what fits (what it holds plus what is still free),
so the eviction before every later write makes room on the disk too, and it says so once (one
warning line; the effective budget is the tier's `capacity_bytes`, exported as
`pagekv_tier_capacity_bytes{tier="DISK"}`, and `disk_full_events` counts the occurrences).
The budget never grows back within a process: a restart starts from the configured one.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from pagekv.tiers.ssd_files import SegmentFiles, held_bytes
from pagekv.tiers.ssd_index import SsdIndex

logger = logging.getLogger(__name__)

MiB = 1 << 20


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem of `path` (None: unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def room_for(directory: Path, capacity: int) -> int:
    """The bytes a tier at `directory` can have, at most `capacity`: the filesystem's free space
    plus the segments already there (blocking; sizes segments and batches before start-up)."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = free_bytes(probe)
    return capacity if free is None else min(capacity, free + held_bytes(directory))


def segment_bytes_for(room: int, wanted: int, smallest: int) -> int:
    """A small budget (or disk) gets small segments, so that deleting one frees a useful
    fraction."""
    return max(min(wanted, room // 4), smallest)


class DiskSpace:
    def __init__(
        self,
        directory: Path,
        *,
        index: SsdIndex,
        files: SegmentFiles,
        books_lock: threading.Lock,
        counters: dict[str, float],
        wanted_segment_bytes: int,
        smallest_segment_bytes: int,
    ) -> None:
        self.directory = directory
        self.configured = index.capacity
        self._index = index
        self._files = files
        self._books_lock = books_lock
        self._c = counters
        self._wanted_segment = wanted_segment_bytes
        self._smallest_segment = smallest_segment_bytes
        self._told = False  # the full disk was reported (once per process)

    def check_at_start(self) -> None:
        """Warn if the budget is more than the filesystem can give (after the recovery scan)."""
        free = free_bytes(self.directory)
        held = self._index.disk_bytes
        if free is not None and self._index.capacity > held + free:
            logger.warning(
                "SSD tier at %s: the budget of %.1f MiB is more than the filesystem can give it "
                "(%.1f MiB free + %.1f MiB held); when the disk fills the budget shrinks to what "
                "fits", self.directory, self._index.capacity / MiB, free / MiB, held / MiB)

    def full(self, what: str, exc: OSError) -> None:
        """ENOSPC (any thread, the books lock not held): shrink the budget to what the tier holds
        plus what is still free; segments shrink with it. The tier stays on."""
        free = free_bytes(self.directory) or 0
        with self._books_lock:
            before = self._index.capacity
            self._index.capacity = min(before, self._index.disk_bytes + free)
            after = self._index.capacity
            self._files.segment_bytes = segment_bytes_for(after, self._wanted_segment,
                                                          self._smallest_segment)
            self._c["disk_full_events"] += 1
            first, self._told = not self._told, True
        (logger.warning if first else logger.debug)(
            "SSD tier at %s: disk full (%s: %s); budget shrunk from %.1f to %.1f MiB (held + "
            "free), older blocks are evicted to make room; the tier stays on",
            self.directory, what, exc, before / MiB, after / MiB)
