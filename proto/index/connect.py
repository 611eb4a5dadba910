"""Connections to the index, the same for a pod's publisher thread and the router: one Redis
node, or a Redis Cluster through redis-py's own cluster client.

    redis://[:password@]host:port/0                 one node (rediss:// for TLS)
    redis+cluster://[:password@]h1:p1,h2:p2,...     a Redis Cluster, from any seed nodes
    rediss+cluster://...                            the same over TLS

The cluster client discovers every node and slot from the seeds, follows MOVED/ASK
redirections, and refreshes its slot map after a connection error (a failover); both clients
speak the same commands, so the rest of the index code has one path.

redis-py's own retries are off: each caller already has a loop that owns retries and
backoff (the publisher reconnects with capped exponential backoff and republishes; the
router's registry refresh is its retry), and a hidden retry inside one command would only
stall that loop past its timeout. Redirections are not retries: the cluster client follows
them within the one call.

The router's asyncio client has a bounded pool (`max_connections`, per node on a cluster):
redis-py's own pool raises MaxConnectionsError past its size (100), which a burst of
requests reached. One node's pool is a BlockingConnectionPool, so a command past the size
waits up to `pool_wait_s` for a connection; in front of either kind, `IndexClient` lets at
most that many calls run at once (proto/index/index_slots.py), and a cluster client's nodes
(redis-py has no blocking pool for them) never see more.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.backoff import NoBackoff
from redis.connection import SSLConnection, parse_url
from redis.retry import Retry

from pagekv.proto.credentials import TlsFiles
from pagekv.proto.redact import redact_url

# What a failed index call raises. asyncio.TimeoutError is the builtin TimeoutError, an
# OSError, since Python 3.11: this covers the asyncio client too. A cluster client also
# raises RedisClusterException (not a RedisError) when no node answers or a slot is unserved.
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

# The router's connections to Redis (per node of a cluster), and how long a call waits for
# one. Lookups take well under a millisecond: 64 serve tens of thousands a second.
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_POOL_WAIT_S = 1.0
TLS_SCHEMES = ("rediss", "rediss+cluster")


def is_cluster_url(url: str | None) -> bool:
    return (url or "").partition("://")[0].lower() in CLUSTER_SCHEMES


def cluster_seeds(url: str) -> tuple[list[tuple[str, int]], str]:
    """The seed nodes of a redis+cluster:// URL, and the plain redis:// (or rediss://) URL
    of the first one, which carries the credentials and options for every node."""
    scheme, _, rest = url.partition("://")
    at = rest.rfind("@")  # a password may hold ',' '/' '?': only the part after '@' is hosts
    userinfo, after = rest[:at + 1], rest[at + 1:]
    end = min((i for i in (after.find("/"), after.find("?")) if i >= 0), default=len(after))
    hosts, tail = after[:end], after[end:]
    seeds = [_host_port(h) for h in hosts.split(",") if h.strip()]
    if not seeds:
        raise ValueError(f"a cluster URL needs at least one host:port, got {redact_url(url)}")
    plain = scheme.lower().removesuffix("+cluster")
    return seeds, f"{plain}://{userinfo}{hosts.split(',')[0].strip()}{tail}"


def _host_port(text: str) -> tuple[str, int]:
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep or host.endswith(":"):  # no port (or a bare IPv6 address)
        host, port = text, "6379"
    host = host.strip("[]")
    try:
        return host, int(port)
    except ValueError:
        raise ValueError(f"bad cluster seed {text!r}: expected host:port") from None


def connection_options(timeout_s: float, url: str = "", tls: TlsFiles | None = None
                       ) -> dict[str, Any]:
    """Client options: every command and connect bounded by `timeout_s`, no retries; with
    `tls` (a rediss:// URL only) the CA to verify the server by and our certificate.
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
    if (url or "").partition("://")[0].lower() not in TLS_SCHEMES:
        raise ValueError(f"--redis-ca/--redis-cert/--redis-key need a rediss:// URL "
                         f"(rediss+cluster:// for a cluster), got {redact_url(url) or 'none'}")
    tls.read()


def _cluster_options(url: str, timeout_s: float, tls: TlsFiles | None
                     ) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Seeds and keyword arguments for either cluster client. `retry` is the cluster
    client's own argument there (it refuses one meant for the nodes' connections)."""
    seeds, first = cluster_seeds(url)
    options = connection_options(timeout_s, first, tls)
    parsed = parse_url(first)
    for name in ("host", "port"):
        parsed.pop(name, None)
    if parsed.pop("db", 0) not in (0, "0"):
        raise ValueError(f"a Redis Cluster has only database 0: {redact_url(url)}")
    return seeds, {**options, **parsed}


def connect(url: str, timeout_s: float, tls: TlsFiles | None = None
            ) -> redis.Redis | redis.cluster.RedisCluster:
    """A synchronous client (the pod's publisher thread, tests, tools)."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **connection_options(timeout_s, url, tls))
    seeds, options = _cluster_options(url, timeout_s, tls)
    nodes = [redis.cluster.ClusterNode(host, port) for host, port in seeds]
    return redis.cluster.RedisCluster(startup_nodes=nodes, **options)


def connect_async(url: str, timeout_s: float, tls: TlsFiles | None = None,
                  max_connections: int = DEFAULT_MAX_CONNECTIONS,
                  pool_wait_s: float = DEFAULT_POOL_WAIT_S
                  ) -> aioredis.Redis | aiocluster.RedisCluster:
    """An asyncio client (the router; wrap it in an `IndexClient` with the same
    `max_connections` as its `max_in_flight`)."""
    if max_connections < 1 or pool_wait_s <= 0:
        raise ValueError(f"max_connections must be >= 1 and pool_wait_s > 0, got "
                         f"{max_connections} and {pool_wait_s}")
    if not is_cluster_url(url):
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_wait_s,
            **connection_options(timeout_s, url, tls))
        return aioredis.Redis(connection_pool=pool)
    seeds, options = _cluster_options(url, timeout_s, tls)
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True  # the asyncio cluster client's own spelling of rediss://
    nodes = [aiocluster.ClusterNode(host, port, max_connections=max_connections)
             for host, port in seeds]
    return aiocluster.RedisCluster(startup_nodes=nodes, max_connections=max_connections,
                                   **options)


def is_cluster(client: Any) -> bool:
    return isinstance(client, (redis.cluster.RedisCluster, aiocluster.RedisCluster))


def drop_connections(client: Any) -> None:
    """Close a synchronous client's sockets (they may be half-broken after an error); the
    next command opens fresh ones. (A cluster client re-reads its slot map by itself after
    a connection error.)"""
    if isinstance(client, redis.cluster.RedisCluster):
        client.disconnect_connection_pools()
    else:
        client.connection_pool.disconnect()
