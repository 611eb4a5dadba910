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

from pagekv.proto.credentials import TlsFiles
from pagekv.proto.redact import redact_url

# What a failed index call raises. asyncio.TimeoutError is the builtin TimeoutError, an
# OSError, since Python 3.11: this covers the asyncio client too.
REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)


def connection_options(timeout_s: float, url: str = "", tls: TlsFiles | None = None
                       ) -> dict[str, Any]:
    """`from_url` options: every command and connect bounded by `timeout_s`, no retries;
    with `tls` (a rediss:// URL only) the CA to verify the server by and our certificate.
    redis-py also reads `ssl_ca_certs` & co. from the URL's query; these are the flags'."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    if tls is not None:
        check_tls_url(url, tls)
        options.update(ssl_ca_certs=tls.ca, ssl_certfile=tls.cert, ssl_keyfile=tls.key)
    return options


def check_tls_url(url: str | None, tls: TlsFiles | None) -> None:
    """TLS files need a rediss:// URL, and files that can be read: a ValueError naming them
    now (at start-up), not at the first command."""
    if tls is None:
        return
    if not (url or "").startswith("rediss://"):
        raise ValueError(f"--redis-ca/--redis-cert/--redis-key need a rediss:// URL, "
                         f"got {redact_url(url) or 'none'}")
    tls.read()


def connect(url: str, timeout_s: float, tls: TlsFiles | None = None) -> redis.Redis:
    """A `redis.Redis` client (the pod's publisher thread)."""
    return redis.Redis.from_url(url, **connection_options(timeout_s, url, tls))


def connect_async(url: str, timeout_s: float, tls: TlsFiles | None = None) -> aioredis.Redis:
    """A `redis.asyncio` client (the router; wrap it in an `IndexClient`)."""
    return aioredis.Redis.from_url(url, **connection_options(timeout_s, url, tls))
