"""A cluster whose parts run on separate simulated hosts: Redis, the router and each pod in a
network namespace of its own (deploy/netns_mesh.py), every pair joined by a shaped link the
caller can cut and restore. The caller (a test, a benchmark) is the client host, in the root
namespace, with a link to every part.

The parts are the real programs: `redis-server` (the binary deploy/redis_server.py finds),
`pagekv router` and `pagekv node`, each bound to its own host's address with fixed ports
(namespaces do not share ports). Leaving the bed (or a failed start) stops every process and
deletes every namespace; a bed whose process was killed is removed by the next one's start.

    with NetnsBed(pods=2, run_dir=tmp).start() as bed:
        bed.mesh.cut("router", "node-a"); ...; bed.mesh.restore("router", "node-a")
"""

from __future__ import annotations

import atexit
import contextlib
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from pagekv.deploy.local_cluster import Child, pagekv_cmd, spawn, stop_child, wait_healthy
from pagekv.deploy.netns_mesh import DEFAULT_RATE, NetnsMesh
from pagekv.deploy.redis_server import find_redis_server

REDIS_PORT = 6379
ROUTER_PORT = 50050
POD_PORT = 50051
METRICS_PORT = 9100
ROUTER_HTTP_PORT = 8000  # the router's OpenAI API
CLIENT = "client"


def wait_tcp(host: str, port: int, timeout: float, child: Child) -> None:
    """Until something accepts on host:port; RuntimeError when `child` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited: {child.exit_reason()}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{child.name} not accepting on {host}:{port} after {timeout:.0f} s")


class NetnsBed:
    """`pods` pods named node-a, node-b, ...; `rate`: every link's bandwidth."""

    def __init__(self, pods: int, run_dir: Path, model: str = "pagekv-tiny",
                 pod_args: Sequence[str] = (), router_args: Sequence[str] = (),
                 rate: str = DEFAULT_RATE) -> None:
        self.pod_names = [f"node-{chr(ord('a') + i)}" for i in range(pods)]
        self.run_dir = run_dir
        self.model = model
        self.pod_args = list(pod_args)
        self.router_args = list(router_args)
        self.mesh = NetnsMesh([CLIENT, "redis", "router", *self.pod_names], rate=rate)
        self.children: dict[str, Child] = {}

    # addresses, as the client dials them ------------------------------------------------
    def address(self, host: str) -> str:
        port = {"redis": REDIS_PORT, "router": ROUTER_PORT}.get(host, POD_PORT)
        return f"{self.mesh.address(host)}:{port}"

    def redis_url(self) -> str:
        return f"redis://{self.address('redis')}/0"

    def router_http(self) -> tuple[str, int]:
        return self.mesh.address("router"), ROUTER_HTTP_PORT

    def metrics_url(self, host: str) -> str:
        return f"http://{self.mesh.address(host)}:{METRICS_PORT}/metrics"

    def pod(self, name: str) -> Child:
        return self.children[name]

    # lifecycle --------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> NetnsBed:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)  # an exception the caller does not catch, Ctrl-C
        try:
            self.mesh.create()
            self._start_redis()
            for name in self.pod_names:
                self.start_pod(name)
            self._start_router()
            for child in self.children.values():
                if child.name != "redis":
                    wait_healthy(child.target(), timeout, child.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, host: str, argv: list[str]) -> Child:
        child = spawn(host, self.mesh.exec_argv(host, argv), self.run_dir)
        child.address = self.address(host)
        child.metrics_port = METRICS_PORT
        self.children[host] = child
        return child

    def _start_redis(self) -> None:
        data = self.run_dir / "redis"
        data.mkdir(exist_ok=True)
        child = self._spawn("redis", [
            find_redis_server(), "--bind", self.mesh.address("redis"), "--port",
            str(REDIS_PORT), "--save", "", "--appendonly", "no", "--protected-mode", "no",
            "--dir", str(data)])
        wait_tcp(self.mesh.address("redis"), REDIS_PORT, 30, child)

    def start_pod(self, name: str) -> Child:
        """(Re)start pod `name` on its host (after `stop_pod`, with the same id)."""
        return self._spawn(name, pagekv_cmd(
            "node", "--model", self.model, "--host", self.mesh.address(name), "--port",
            str(POD_PORT), "--advertise-address", self.address(name), "--metrics-port",
            str(METRICS_PORT), "--pod-id", name, "--redis-url", self.redis_url(),
            "--num-threads", "1", *self.pod_args))

    def _start_router(self) -> None:
        self._spawn("router", pagekv_cmd(
            "router", "--model", self.model, "--host", self.mesh.address("router"), "--port",
            str(ROUTER_PORT), "--metrics-port", str(METRICS_PORT), "--http-port",
            str(ROUTER_HTTP_PORT), "--redis-url",
            self.redis_url(), *self.router_args))

    def stop_pod(self, name: str, grace: float = 10.0) -> None:
        child = self.children.pop(name, None)
        if child is not None:
            stop_child(child, grace)

    def stop(self) -> None:
        """Every process (router first), then every namespace; safe to call twice."""
        for name in ["router", *self.pod_names, "redis"]:
            self.stop_pod(name, grace=10.0)
        self.mesh.destroy()
        atexit.unregister(self.stop)

    def __enter__(self) -> NetnsBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
