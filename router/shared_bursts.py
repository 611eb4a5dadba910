"""Burst predictions shared between routers through the index (--shared-bursts).

A router's BurstTracker only knows its own dispatches: siblings of one prompt that arrive at
different routers before the pod has published the prefix would scatter. So each dispatch
also writes short-lived prediction keys beside the chain's claims (same hash tag, one slot:
one script, one round trip), and every router's lookup reads them in its own EVALSHA
(proto/index/scripts.py). The write runs as a task of its own: the forward never waits for
it, and a failure is counted, never raised. Only the blocks the pod does not already hold by
the index are written, and each key keeps a few pods, so a request costs at most one key
per lookup block.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from pagekv.proto.index import REDIS_ERRORS, IndexClient
from pagekv.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

MAX_PODS_PER_KEY = 8  # a block sent to more pods within the TTL keeps the latest 8
MAX_IN_FLIGHT = 256   # writes waiting on Redis; past this a slow index drops predictions


class SharedBursts:
    """Not thread-safe: the router calls it from its event loop only."""

    def __init__(self, index: IndexClient, ttl_s: float, metrics: RouterMetrics) -> None:
        self.index = index
        self.ttl_ms = int(ttl_s * 1000)
        self.metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()

    def record(self, pod_id: str, block_hashes: Sequence[bytes], start: int) -> None:
        """`pod_id` is about to compute blocks `start`... of this chain (the index already
        shows it holding the ones before): tell the other routers, without waiting."""
        if self.ttl_ms <= 0 or start >= len(block_hashes):
            return
        # Predictions are keyed by the pod's registration's claim id, as the lookup names
        # holders: a pod without a valid one is not predicted.
        claim_id = self.index.claim_id_of(pod_id)
        if claim_id is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test calling in from another thread): local only
            return
        if len(self._tasks) >= MAX_IN_FLIGHT:
            self.metrics.shared_predictions.labels(result="dropped").inc()
            return
        task = loop.create_task(self._write(pod_id, claim_id, block_hashes, start))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, pod_id: str, claim_id: bytes, block_hashes: Sequence[bytes],
                     start: int) -> None:
        try:
            await self.index.predict(claim_id, block_hashes, start, self.ttl_ms,
                                     MAX_PODS_PER_KEY)
        except REDIS_ERRORS as exc:
            logger.debug("shared burst prediction for %s not written: %r", pod_id, exc)
            self.metrics.shared_predictions.labels(result="error").inc()
        else:
            self.metrics.shared_predictions.labels(result="written").inc()

    async def close(self) -> None:
        """Cancel the writes still waiting (the router is stopping)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
