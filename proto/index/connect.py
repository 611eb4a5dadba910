"""Connections to the index, the same for a pod's publisher thread and the router.

redis-py's own retries are off: each caller already has a loop that owns retries and
backoff (the publisher reconnects with capped exponential backoff and republishes; the
router's registry refresh is its retry), and a hidden retry inside one command would only
stall that loop past its timeout.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

# What a failed index call raises. asyncio.TimeoutError is the builtin TimeoutError, an
# OSError, since Python 3.11: this covers the asyncio client too.
REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)


def connection_options(timeout_s: float) -> dict[str, Any]:
    """`from_url` options: every command and connect bounded by `timeout_s`, no retries."""
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }


def connect(url: str, timeout_s: float) -> redis.Redis:
    """A `redis.Redis` client (the pod's publisher thread)."""
    return redis.Redis.from_url(url, **connection_options(timeout_s))


def connect_async(url: str, timeout_s: float) -> aioredis.Redis:
    """A `redis.asyncio` client (the router; wrap it in an `IndexClient`)."""
    return aioredis.Redis.from_url(url, **connection_options(timeout_s))
