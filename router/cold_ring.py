"""Where a cold prompt may go, found without weighing every pod: a consistent-hash ring.

`--cold-placement hash` puts a prompt that no pod holds on the pod of the load band with
the highest rendezvous weight of its first block's hash (router/placement.py says why). A
weight for every pod of the band costs a hash per pod per request; the ring narrows it to a
few: each pod owns `VNODES` points at fixed hashes of its id, and the prompt's candidates
are the first `NEIGHBOURS` band pods clockwise from its key (all of the band in a fleet that
small: then the choice is exactly the rendezvous one). The same key finds the same pods on
every router while the fleet is the same; a pod that leaves moves the prompts it won, and
about as many more (each neighbourhood it left takes in the next pod, which may outweigh
the old winner: test_router_fleet_view.py measures it); `VNODES` points a pod keep the shares within ~1/sqrt(VNODES) of even. The ring is rebuilt
only when the fleet's membership changes, not per refresh.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")

VNODES = 32            # points per pod
NEIGHBOURS = 8         # band pods a cold prompt's rendezvous is taken among
MAX_WALK = 16 * VNODES  # points visited before the band is deemed too thin to walk


def _point(pod_id: str, i: int) -> int:
    data = i.to_bytes(2, "big") + pod_id.encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def key_point(key: bytes) -> int:
    """A prompt's place on the ring: its first block's hash is uniform already, but a
    short or foreign key is hashed again."""
    if len(key) >= 8:
        return int.from_bytes(key[:8], "big")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


class ColdRing(Generic[T]):
    __slots__ = ("_id_of", "_points", "_owners", "_items", "_members", "_cache")

    def __init__(self, id_of: Callable[[T], str]) -> None:
        self._id_of = id_of
        self._points: list[int] = []
        self._owners: list[str] = []
        self._items: dict[str, T] = {}
        self._members: frozenset[str] = frozenset()
        self._cache: dict[str, list[int]] = {}  # pod id -> its points (hashes are not free)

    def __len__(self) -> int:
        return len(self._items)

    def update(self, items: Iterable[T]) -> None:
        """The pods on the ring from now on (a rebuild only when the set changed)."""
        self._items = {self._id_of(item): item for item in items}
        members = frozenset(self._items)
        if members == self._members:
            return
        self._members = members
        self._cache = {pod: self._cache.get(pod) or [_point(pod, i) for i in range(VNODES)]
                       for pod in members}
        ring = sorted((p, pod) for pod, points in self._cache.items() for p in points)
        self._points = [p for p, _ in ring]
        self._owners = [pod for _, pod in ring]

    def neighbours(self, key: bytes, accept: Callable[[T], bool]) -> list[T]:
        """The first NEIGHBOURS distinct pods clockwise from `key` that `accept`s (fewer
        when the walk of MAX_WALK points, or the whole ring, has no more)."""
        n = len(self._points)
        start = bisect.bisect_left(self._points, key_point(key))
        tried: set[str] = set()
        out: list[T] = []
        for step in range(min(n, MAX_WALK)):
            pod = self._owners[(start + step) % n]
            if pod in tried:
                continue
            tried.add(pod)
            item = self._items[pod]
            if accept(item):
                out.append(item)
                if len(out) == NEIGHBOURS:
                    break
            if len(tried) == len(self._items):
                break
        return out
