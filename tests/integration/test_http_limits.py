"""The HTTP front end's limits against hostile and broken clients (issue #27, findings 4-6):
a pod and a router as real processes (their RSS read from /proc), raw sockets for what no
well-behaved client sends — huge or trickled headers, stalled or abandoned bodies — and a
completion that outlives the request deadline."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagekv.deploy.local_cluster import Child, LocalCluster
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from tests.integration.openai_fixtures import error_of, wait_until

pytestmark = pytest.mark.integration

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 1.0
REQUEST_TIMEOUT_S = 1.5
LIMITS = ["--http-max-header-bytes", "16384", "--http-header-timeout-s", str(HEADER_TIMEOUT_S),
          "--http-body-timeout-s", str(BODY_TIMEOUT_S),
          "--http-request-timeout-s", str(REQUEST_TIMEOUT_S)]
POD_ARGS = ["--num-gpu-blocks", "320", "--max-model-len", "4096", "--num-threads", "1", *LIMITS]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(nodes=1, run_dir=tmp_path_factory.mktemp("http-limits"),
                     node_args=POD_ARGS, router_args=["--refresh-interval-s", "0.2", *LIMITS])
    with c:
        yield c


@pytest.fixture(params=["pod", "router"])
def server(request: pytest.FixtureRequest, cluster: LocalCluster) -> Child:
    return cluster.pods[0] if request.param == "pod" else cluster.router


def _rss_kib(child: Child) -> int:
    status = Path(f"/proc/{child.proc.pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))  # type: ignore[union-attr]


def _connect(child: Child, timeout: float = 10.0) -> socket.socket:
    assert child.http_port is not None
    return socket.create_connection(("127.0.0.1", child.http_port), timeout=timeout)


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (or resets) the connection."""
    got = b""
    try:
        while piece := sock.recv(65536):
            got += piece
    except ConnectionResetError:
        pass
    return got


def _counts(child: Child, metric: str) -> dict[tuple[str, str], float]:
    """(route, status) -> count, from the child's metrics port."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{child.metrics_port}/metrics",
                                  timeout=10).read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in page.splitlines():
        if line.startswith(metric + "{"):
            route = re.search(r'route="([^"]*)"', line).group(1)  # type: ignore[union-attr]
            status = re.search(r'status="([^"]*)"', line).group(1)  # type: ignore[union-attr]
            out[route, status] = float(line.rsplit(" ", 1)[1])
    return out


def _metric(child: Child) -> str:
    return "pagekv_router_http_requests_total" if child.name == "router" \
        else "pagekv_http_requests_total"


def _health_ok(child: Child) -> bool:
    url = f"http://127.0.0.1:{child.http_port}/health"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status == 200


def test_a_64_mb_header_is_refused_before_it_is_read(server: Child) -> None:
    before = _rss_kib(server)
    sock = _connect(server)
    started = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
    piece, sent, refused = b"a" * (1 << 20), 0, False
    try:
        while sent < 64 << 20:
            sock.sendall(piece)
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError):
        refused = True
    reply = _read_all(sock) if not refused else b""
    sock.close()
    took = time.monotonic() - started
    assert refused or reply.startswith(b"HTTP/1.1 431"), reply[:200]
    if reply:
        assert error_of(reply.split(b"\r\n\r\n", 1)[1])["code"] == "headers_too_large"
    assert took < 10, took
    assert sent < 64 << 20  # cut off long before the whole header went out
    grown_mib = (_rss_kib(server) - before) / 1024
    assert grown_mib < 8, f"RSS grew by {grown_mib:.1f} MiB"
    assert _health_ok(server)


def test_too_many_headers_is_431_and_counted(server: Child) -> None:
    before = _counts(server, _metric(server)).get(("other", "431"), 0)
    sock = _connect(server)
    fields = b"".join(b"X-F%d: v\r\n" % k for k in range(150))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
    reply = _read_all(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert error_of(reply.split(b"\r\n\r\n", 1)[1])["code"] == "too_many_headers"
    assert _counts(server, _metric(server)).get(("other", "431"), 0) == before + 1


def test_slowloris_connections_are_cut_and_others_served_meanwhile(server: Child) -> None:
    socks = []
    for _ in range(200):
        s = _connect(server, timeout=HEADER_TIMEOUT_S + 8)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    started = time.monotonic()
    assert _health_ok(server)  # a normal request is served while they trickle
    open_socks = list(socks)
    while open_socks and time.monotonic() - started < HEADER_TIMEOUT_S + 6:
        still = []
        for s in open_socks:
            try:
                s.sendall(b"X-A: b\r\n")  # one header at a time, never the blank line
                s.setblocking(False)
                try:
                    s.recv(65536)  # the server's 408, or its close
                    closed = True
                except BlockingIOError:
                    closed = False
                finally:
                    s.setblocking(True)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if not closed:
                still.append(s)
        open_socks = still
        time.sleep(0.25)
    took = time.monotonic() - started
    for s in socks:
        s.close()
    assert not open_socks, f"{len(open_socks)} of 200 still open after {took:.1f} s"
    assert took < HEADER_TIMEOUT_S + 6
    assert _health_ok(server)


def test_a_stalled_body_is_408(server: Child) -> None:
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
    started = time.monotonic()
    reply = _read_all(sock)  # the socket's own timeout (10 s) fails this without a limit
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"connection: close" in reply.lower()
    assert error_of(reply.split(b"\r\n\r\n", 1)[1])["code"] == "body_timeout"
    assert time.monotonic() - started < BODY_TIMEOUT_S + 3


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_client_gone_mid_body_is_one_499_and_no_traceback(server: Child, path: str) -> None:
    metric = _metric(server)
    before = _counts(server, metric)
    sock = _connect(server)
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"ab")
    time.sleep(0.3)
    sock.close()

    def counted() -> bool:
        now = _counts(server, metric)
        return now.get((path, "499"), 0) - before.get((path, "499"), 0) == 1

    wait_until(counted, "one 499", timeout=10)
    now = _counts(server, metric)
    assert now.get((path, "500"), 0) == before.get((path, "500"), 0)
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "ClientDisconnect" not in log


def test_a_client_gone_mid_stream_is_one_499_and_no_traceback(server: Child) -> None:
    metric = _metric(server)
    before = _counts(server, metric).get(("/v1/completions", "499"), 0)
    body = json.dumps({"model": "pagekv-tiny", "prompt": "a story " * 10, "max_tokens": 3000,
                       "ignore_eos": True, "stream": True}).encode()
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/"
                 b"json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    seen = b""
    while b"data:" not in seen:
        seen += sock.recv(65536)
    assert seen.startswith(b"HTTP/1.1 200"), seen[:200]
    sock.close()  # mid-stream
    wait_until(lambda: _counts(server, metric).get(("/v1/completions", "499"), 0)
               == before + 1, "one 499", timeout=10)
    assert "Traceback" not in server.log_path.read_text(errors="replace")


def _free_blocks(pod: Child) -> tuple[int, int]:
    with grpc.insecure_channel(pod.target()) as channel:
        st = pb_grpc.KVNodeStub(channel).Stats(pb.StatsRequest(), timeout=5)
    return st.num_free_blocks, st.num_running


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_past_the_default_deadline_is_504_and_frees_its_blocks(
        server: Child, cluster: LocalCluster, stream: bool) -> None:
    pod = cluster.pods[0]
    idle_free, _ = _free_blocks(pod)
    body = json.dumps({"model": "pagekv-tiny", "prompt": "tell me a long story " * 20,
                       "max_tokens": 3500, "ignore_eos": True, "temperature": 0,
                       "stream": stream}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/completions",
                                 body, {"Content-Type": "application/json"})
    started = time.monotonic()
    if stream:
        with urllib.request.urlopen(req, timeout=30) as resp:
            events = resp.read().decode().split("\n\n")
        took = time.monotonic() - started
        data = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
        assert data[-1] == "[DONE]", data[-3:]
        err = json.loads(data[-2])["error"]
    else:
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=30)
        took = time.monotonic() - started
        assert caught.value.code == 504
        err = error_of(caught.value.read())
    assert err["code"] == "deadline_exceeded" and err["type"] == "timeout_error", err
    assert REQUEST_TIMEOUT_S - 0.2 < took < REQUEST_TIMEOUT_S + 3, took
    wait_until(lambda: _free_blocks(pod) == (idle_free, 0), "the pod's blocks back",
               timeout=10)
    assert _counts(server, _metric(server)).get(("/v1/completions", "504"), 0) >= 1


def test_a_client_may_shorten_the_deadline(cluster: LocalCluster) -> None:
    pod = cluster.pods[0]
    body = json.dumps({"model": "pagekv-tiny", "prompt": "story " * 20, "max_tokens": 3500,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{pod.http_port}/v1/completions", body,
                                 {"Content-Type": "application/json",
                                  "x-pagekv-timeout-s": "0.3"})
    started = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=30)
    assert caught.value.code == 504
    assert time.monotonic() - started < REQUEST_TIMEOUT_S
