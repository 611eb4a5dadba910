"""The fleet's pods kept ordered by queue, so a decision reads the least-loaded few without
looking at every pod.

A pod's queue (its published waiting + running, less our calls that finished since it
published, or our own calls in flight where more: `PodEntry.queue`) is an integer that moves
by one at a time: buckets of pods by queue, and the distinct queues in a sorted list, make
every move O(log distinct queues). A pod whose load drops must be touched (a call ends, a
refresh); one whose load rose unannounced (a caller that raised `inflight` directly) is
found when its bucket is read: `least` re-files it before it counts anything, so what it
returns is exact.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Container, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class LoadOrder(Generic[T]):
    """Items (pods) by an integer load, least first; equals in the order they got there,
    so a pod that just took a request and came back to its old queue goes behind its
    equals (a rotation among idle pods for free)."""

    __slots__ = ("_key_of", "_id_of", "_buckets", "_filed", "_keys")

    def __init__(self, key_of: Callable[[T], int], id_of: Callable[[T], str]) -> None:
        self._key_of = key_of
        self._id_of = id_of
        self._buckets: dict[int, dict[str, T]] = {}  # load -> {id: item}, insertion ordered
        self._filed: dict[str, int] = {}             # id -> the load it is filed under
        self._keys: list[int] = []                   # the non-empty loads, sorted

    def __len__(self) -> int:
        return len(self._filed)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._filed

    def reset(self, items: Iterable[T]) -> None:
        self._buckets.clear()
        self._filed.clear()
        self._keys.clear()
        for item in items:
            self.touch(item)

    def touch(self, item: T) -> None:
        """File `item` under its load now (added if new)."""
        item_id = self._id_of(item)
        key = self._key_of(item)
        old = self._filed.get(item_id)
        if old == key:
            return
        if old is not None:
            self._unfile(item_id, old)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = {}
            bisect.insort(self._keys, key)
        bucket[item_id] = item
        self._filed[item_id] = key

    def discard(self, item_id: str) -> None:
        old = self._filed.pop(item_id, None)
        if old is not None:
            self._unfile(item_id, old)

    def _unfile(self, item_id: str, key: int) -> None:
        bucket = self._buckets[key]
        del bucket[item_id]
        if not bucket:
            del self._buckets[key]
            del self._keys[bisect.bisect_left(self._keys, key)]

    def min_load(self) -> int | None:
        """The least load of any item (exact: stale filings are re-filed first)."""
        while self._keys:
            key = self._keys[0]
            stale = [item for item in self._buckets[key].values() if self._key_of(item) != key]
            for item in stale:
                self.touch(item)
            if self._keys and self._keys[0] == key:
                return key
        return None

    def least(self, n: int, skip: Container[str] = ()) -> list[T]:
        """Up to `n` items of the least loads, least first, leaving out ids in `skip`.
        Reads only as far as it needs (O(n + skipped + stale met), not O(items))."""
        if n <= 0:
            return []
        while True:
            out: list[T] = []
            stale: list[T] = []
            for key in self._keys:
                for item_id, item in self._buckets[key].items():
                    if self._key_of(item) != key:
                        stale.append(item)  # its load moved unannounced
                    elif item_id not in skip:
                        out.append(item)
                        if len(out) == n:
                            break
                if len(out) == n:
                    break
            if not stale:
                return out
            for item in stale:  # file them where they are now, and read again
                self.touch(item)
