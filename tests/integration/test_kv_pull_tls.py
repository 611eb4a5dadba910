"""A pull between pods that serve mutual TLS (issue #28): the tcp data transport is TLS with
the pods' own files, so KV never crosses the wire in the clear where the fleet's gRPC does not;
a plaintext or wrongly-certified connection to the data port gets nothing."""

from __future__ import annotations

import socket
import ssl
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import LocalCluster, wait_healthy
from pagekv.proto.credentials import bearer, client_ssl_context
from pagekv.proto.grpc_security import open_channel
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from tests.integration.tls_fixtures import Certs, make_certs

pytestmark = pytest.mark.integration

API_TOKEN = "api-9d04e7b15c2a"
BLOCK = 16
PROMPT = [(i * 13 + 7) % 250 for i in range(300)]
FULL = (len(PROMPT) - 1) // BLOCK
POD_ARGS = ["--num-gpu-blocks", "128", "--max-model-len", "320", "--num-threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, certs: Certs):
    cluster = LocalCluster(nodes=0, start_router=False, node_args=POD_ARGS,
                           run_dir=tmp_path_factory.mktemp("kv-pull-tls"),
                           tls_cert=certs.server.cert, tls_key=certs.server.key,
                           tls_ca=certs.ca, tls_client_auth=True, api_token=API_TOKEN,
                           pod_token=API_TOKEN)
    cluster.start()
    try:
        data_port = free_port()
        pods = {"a": cluster.start_pod("node-a", ["--kv-data-port", str(data_port)]),
                "b": cluster.start_pod("node-b"),
                "c": cluster.start_pod("node-c", ["--no-enable-prefix-caching"])}
        for child in pods.values():
            wait_healthy(child.address, 120, child.proc, tls=certs.client)
        yield pods, data_port
    finally:
        cluster.stop()


def generate(address: str, certs: Certs, source=None) -> pb.GenerateResponse:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True))
    if source is not None:
        request.kv_source.CopyFrom(source)
    with open_channel(address, certs.client) as ch:
        return pb_grpc.GenerationStub(ch).Generate(request, metadata=bearer(API_TOKEN),
                                                   timeout=60)


def pulls_by_transport(metrics_port: int) -> dict[tuple[str, str], float]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=10).read().decode()
    return {(s.labels["transport"], s.labels["outcome"]): s.value
            for f in text_string_to_metric_families(page) for s in f.samples
            if s.name == "pagekv_kv_pulls_by_transport_total"}


def test_pull_over_tls_data_transport_gives_cold_tokens(fleet, certs: Certs) -> None:
    pods, _ = fleet
    cold = generate(pods["c"].address, certs).completions[0].token_ids
    assert generate(pods["a"].address, certs).completions[0].token_ids == cold
    got = generate(pods["b"].address, certs, pb.KvSource(
        pod_id="node-a", address=pods["a"].address, num_blocks=FULL))
    assert got.completions[0].token_ids == cold
    assert got.usage.cached_tokens_peer == FULL * BLOCK
    assert pulls_by_transport(pods["b"].metrics_port) == {("tcp", "ok"): 1.0}


def test_data_port_refuses_plaintext_and_foreign_certificates(fleet, certs: Certs) -> None:
    _, port = fleet
    # Plaintext: a hello in the clear is not a TLS handshake; the server closes, sends nothing.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"PKVT\x01\x00" + bytes(32))
        sock.settimeout(10)
        try:
            got = sock.recv(64)
        except ConnectionResetError:
            got = b""
        assert not got.startswith(b"PKVB") and b"PKVE" not in got
    # A client certificate of another CA: the TLS handshake fails.
    context = client_ssl_context(certs.other_client)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"PKVT\x01\x00" + bytes(32))
                if not tls.recv(64):
                    raise ConnectionError("closed")
    # With the right certificate but no valid token: nothing either.
    context = client_ssl_context(certs.client)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"PKVT\x01\x00" + bytes(32))
            tls.settimeout(10)
            try:
                assert tls.recv(64) == b""
            except (ssl.SSLError, ConnectionError):
                pass
