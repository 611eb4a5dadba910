"""How many index calls may run at once: as many as the client has connections.

A burst of requests larger than the pool queues here for a slot, in arrival order, instead
of failing in redis-py's pool (MaxConnectionsError). A wait is bounded: past `wait_s` the
index is too slow to serve this router's load and the call fails as a Redis timeout would
(`SlotWaitTimeout`, a redis TimeoutError, so `REDIS_ERRORS` covers it). A caller cancelled
while waiting (a request whose deadline passed) leaves the queue then.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from redis.exceptions import TimeoutError as RedisTimeoutError


class SlotWaitTimeout(RedisTimeoutError):
    """No connection to the index came free within the wait."""


class IndexSlots:
    def __init__(self, size: int, wait_s: float) -> None:
        if size < 1 or wait_s <= 0:
            raise ValueError(f"index slots need size >= 1 and wait_s > 0, got {size} and "
                             f"{wait_s}")
        self.size = size
        self.wait_s = wait_s
        self._free = asyncio.Semaphore(size)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self.wait_s):
                await self._free.acquire()
        except TimeoutError:
            raise SlotWaitTimeout(f"no Redis connection free within {self.wait_s:g}s "
                                  f"({self.size} in use)") from None
        try:
            yield
        finally:
            self._free.release()
