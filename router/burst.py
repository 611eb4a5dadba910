"""Short-lived predicted hits for requests the router has just sent somewhere.

A pod publishes a block only after it has prefilled it (plus the publisher's batching delay).
Fifty siblings of one prompt arriving together would otherwise all see an empty index and
scatter. So each routed request leaves, for `ttl_s`, a claim "pod P will hold these blocks";
the scorer treats them as pool hits on P for any request sharing that prefix.

The block hashes are a chain (each hash covers the whole prefix before it), so a request's
predicted depth on a pod is the number of its leading hashes the pod has a claim on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)


class BurstTracker:
    """Not thread-safe: the router calls it from its event loop only."""

    __slots__ = ("ttl_s", "max_entries", "_clock", "_claims", "_order")

    def __init__(self, ttl_s: float = 2.0, max_entries: int = 500_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s!r}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        # hash -> {pod_id: expiry}; `_order` lists (expiry, hash, pod) oldest first, which is
        # also expiry order because the TTL is constant.
        self._claims: dict[bytes, dict[str, float]] = {}
        self._order: deque[tuple[float, bytes, str]] = deque()

    def __len__(self) -> int:
        return len(self._order)

    def _expire(self, now: float) -> None:
        order, claims = self._order, self._claims
        while order and (order[0][0] <= now or len(order) > self.max_entries):
            expiry, block_hash, pod = order.popleft()
            pods = claims.get(block_hash)
            if pods is not None and pods.get(pod) == expiry:
                del pods[pod]
                if not pods:
                    del claims[block_hash]

    def record(self, pod_id: str, block_hashes: Sequence[bytes]) -> None:
        """`pod_id` is about to compute (and then cache) these blocks."""
        if self.ttl_s <= 0 or not block_hashes:
            return
        now = self._clock()
        expiry = now + self.ttl_s
        claims, order = self._claims, self._order
        for block_hash in block_hashes:
            claims.setdefault(block_hash, {})[pod_id] = expiry
            order.append((expiry, block_hash, pod_id))
        self._expire(now)

    def depths(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Pod id -> how many leading blocks of `block_hashes` it is predicted to hold."""
        now = self._clock()
        self._expire(now)
        if not block_hashes:
            return {}
        first = self._claims.get(block_hashes[0])
        if not first:
            return {}
        active = [pod for pod, expiry in first.items() if expiry > now]
        depths = dict.fromkeys(active, 1)
        for block_hash in block_hashes[1:]:
            if not active:
                break
            pods = self._claims.get(block_hash)
            if not pods:
                break
            active = [pod for pod in active if pods.get(pod, 0.0) > now]
            for pod in active:
                depths[pod] += 1
        return depths
