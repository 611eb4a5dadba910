"""The vLLM pod's /health probe (kvnode/index/vllm_health.py) against real HTTP servers on
loopback: one kept-alive connection for every check, a new one after the pod closes it or
goes away, and the answer or the failure said in words; an https:// pod that asks for a client
certificate (vLLM's --ssl-cert-reqs 2) checked with the ingester's --vllm-tls-* files."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pagekv.kvnode.index.vllm_health import HealthProbe, health_url
from pagekv.proto.credentials import TlsFiles, client_ssl_context
from tests.integration.tls_fixtures import Certs, make_certs


class _Server(ThreadingHTTPServer):
    def __init__(self, http11: bool, tls: ssl.SSLContext | None = None) -> None:
        self.connections = 0
        self.status = 200
        self.cut = False
        self.metrics: str | None = None  # the /metrics page; None: 404
        self.paths: list[str] = []
        handler = type("H", (_Handler,), {"protocol_version":
                                          "HTTP/1.1" if http11 else "HTTP/1.0"})
        super().__init__(("127.0.0.1", 0), handler)
        if tls is not None:  # the handshake runs at accept; a refused client is an OSError
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def process_request(self, request, client_address) -> None:
        self.connections += 1
        super().process_request(request, client_address)

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.server.cut:
            self.close_connection = True
            return
        self.server.paths.append(self.path)
        body = b""
        if self.path == "/health":
            self.send_response(self.server.status)
        elif self.path == "/metrics" and self.server.metrics is not None:
            self.send_response(200)
            body = self.server.metrics.encode()
        else:
            self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _probe(port: int) -> HealthProbe:
    return HealthProbe(health_url(f"127.0.0.1:{port}"), lambda why: None, lambda: None,
                       interval_s=1.0, failures=2)


@pytest.mark.parametrize("http11", [True, False])
def test_checks_answer_the_status_over_as_few_connections_as_the_server_allows(
        http11: bool) -> None:
    server = _Server(http11)
    try:
        probe = _probe(server.server_port)
        assert [probe.check() for _ in range(5)] == [None] * 5
        server.status = 503
        assert probe.check() == "HTTP 503"
        # HTTP/1.1 keeps one connection for all of them; HTTP/1.0 closes each.
        assert server.connections == (1 if http11 else 6)
    finally:
        server.close()


def test_a_connection_the_pod_cuts_is_opened_again() -> None:
    server = _Server(True)
    try:
        probe = _probe(server.server_port)
        assert probe.check() is None
        server.cut = True  # the next request: the connection closed, no answer
        why = probe.check()
        assert why is not None and "RemoteDisconnected" in why
        server.cut = False
        assert probe.check() is None and probe.check() is None
        assert server.connections == 2
    finally:
        server.close()


def test_nothing_listening_is_a_failure_not_a_hang() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    why = _probe(port).check()
    assert why is not None and "Refused" in why


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match=r"http\(s\)://"):
        HealthProbe("ftp://x:1/health", lambda why: None, lambda: None)


def test_the_health_url_keeps_the_scheme_the_pod_is_registered_with() -> None:
    assert health_url("10.0.0.5:8000") == "http://10.0.0.5:8000/health"
    assert health_url("http://10.0.0.5:8000") == "http://10.0.0.5:8000/health"
    # Was http://https://...: an HTTPS pod was never found up and left the index.
    assert health_url("https://vllm-0:8443/") == "https://vllm-0:8443/health"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


def _mutual_tls_server(certs: Certs) -> _Server:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(certs.server.cert), str(certs.server.key))
    context.load_verify_locations(cafile=certs.ca)
    context.verify_mode = ssl.CERT_REQUIRED
    return _Server(True, context)


def test_an_https_pod_is_checked_with_the_ca_and_the_client_certificate(
        certs: Certs) -> None:
    server = _mutual_tls_server(certs)
    url = health_url(f"https://127.0.0.1:{server.server_port}")
    try:
        probe = HealthProbe(url, lambda why: None, lambda: None, interval_s=1.0,
                            ssl_context=client_ssl_context(certs.client))
        assert [probe.check(), probe.check()] == [None, None]
        server.status = 503
        assert probe.check() == "HTTP 503"
        assert server.connections == 1  # kept alive over TLS too
        # Without a client certificate, or trusting another CA: a failure that says so.
        for tls in (TlsFiles(ca=certs.ca), TlsFiles(ca=certs.other_ca)):
            why = HealthProbe(url, lambda why: None, lambda: None, interval_s=1.0,
                              ssl_context=client_ssl_context(tls)).check()
            assert why is not None and ("SSL" in why or "Connection" in why or
                                        "Disconnected" in why), why
    finally:
        server.close()


def test_a_bad_tls_file_stops_the_ingester_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    proc = subprocess.run(
        [sys.executable, "-m", "pagekv", "ingest-vllm", "--zmq-endpoint", "tcp://127.0.0.1:1",
         "--pod-id", "v0", "--openai-address", "https://127.0.0.1:1", "--model", "m",
         "--block-size", "16", "--redis-url", "redis://127.0.0.1:1",
         "--vllm-tls-ca", str(bad)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(bad) in lines[0] and "Traceback" not in proc.stderr, \
        proc.stderr


def test_the_load_is_read_from_metrics_on_the_same_connection() -> None:
    server = _Server(True)
    server.metrics = ("vllm:num_requests_running{engine=\"0\"} 4\n"
                      "vllm:num_requests_waiting{engine=\"0\"} 2\n")
    try:
        probe = HealthProbe(health_url(f"127.0.0.1:{server.server_port}"), lambda why: None,
                            lambda: None, interval_s=1.0, load_path="/metrics")
        assert probe.fresh_load() == {}  # nothing read yet
        assert probe.check() is None
        assert probe.fresh_load() == {"waiting": 2.0, "running": 4.0}
        server.metrics = "vllm:num_requests_running 0\nvllm:num_requests_waiting 9\n"
        assert probe.check() is None
        assert probe.load == {"waiting": 9.0, "running": 0.0}
        assert server.paths == ["/health", "/metrics"] * 2 and server.connections == 1
        probe.load_at -= 10  # three checks' time without a new reading: stale, not used
        assert probe.fresh_load() == {}
    finally:
        server.close()


def test_a_pod_without_a_metrics_page_is_not_asked_again() -> None:
    server = _Server(True)  # metrics None: /metrics is a 404
    try:
        probe = HealthProbe(health_url(f"127.0.0.1:{server.server_port}"), lambda why: None,
                            lambda: None, interval_s=1.0, load_path="/metrics")
        assert probe.check() is None and probe.check() is None
        assert server.paths == ["/health", "/metrics", "/health"]
        assert probe.load_path is None and probe.fresh_load() == {}
    finally:
        server.close()


def test_a_probe_never_started_stops_quietly() -> None:
    _probe(1).stop()  # an ingester stopped before it started
