"""A pod and the router as real processes over mutual TLS with bearer tokens (`pagekv up`'s
flags, through LocalCluster): the right client is served end to end (the router dials the
pod over mTLS with its own pod token); plaintext clients, clients without a certificate and
clients of another CA are refused; the admin and API tokens are enforced and counted; no
secret shows in a child's command line or log."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.kvnode.pod.client import Client
from pagekv.proto.credentials import TlsFiles, bearer
from pagekv.proto.grpc_security import open_channel
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from tests.integration.tls_fixtures import Certs, make_certs

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "adm-7f3c2e91d4b8"
API_TOKEN = "api-5a0e6b27c9f1"
POD_ARGS = ["--num-gpu-blocks", "64", "--max-model-len", "256", "--lease-ttl-s", "2"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, certs: Certs):
    with LocalCluster(nodes=1, run_dir=tmp_path_factory.mktemp("secure-run"),
                      node_args=POD_ARGS, tls_cert=certs.server.cert, tls_key=certs.server.key,
                      tls_ca=certs.ca, tls_client_auth=True, admin_token=ADMIN_TOKEN,
                      api_token=API_TOKEN) as c:
        yield c


def call_code(address: str, tls: TlsFiles | None, token: str | None = API_TOKEN,
              admin: bool = False) -> grpc.StatusCode:
    with open_channel(address, tls) as ch:
        md = bearer(token) if token else None
        try:
            if admin:
                pb_grpc.KVNodeStub(ch).ResetPrefixCache(pb.ResetPrefixCacheRequest(),
                                                        metadata=md, timeout=30)
            else:
                pb_grpc.GenerationStub(ch).Generate(
                    pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=2)),
                    metadata=md, timeout=30)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def metric(port: int, name: str) -> dict[tuple[str, str], float]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.labels["method"], s.labels["code"]): s.value
            for f in text_string_to_metric_families(page) for s in f.samples if s.name == name}


def test_served_over_mutual_tls_with_tokens(cluster: LocalCluster, certs: Certs) -> None:
    with Client(cluster.router.address, 60, tls=certs.client, token=API_TOKEN) as client:
        # (ignore_eos: a sampled EOS would end it short of 3 tokens)
        resp = client.generate("hello", max_tokens=3, ignore_eos=True)
        chunks = list(client.stream("hello", max_tokens=3, ignore_eos=True))
    assert resp.served_by == cluster.pods[0].name and len(resp.completions[0].token_ids) == 3
    assert chunks[-1].served_by == cluster.pods[0].name
    # The pod itself, directly: the same client certificate and the pods' own token.
    assert call_code(cluster.pods[0].address, certs.client, cluster.pod_token) == \
        grpc.StatusCode.OK


def test_wrong_transport_refused(cluster: LocalCluster, certs: Certs) -> None:
    for child in (cluster.router, cluster.pods[0]):
        assert call_code(child.address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
        # TLS, but no client certificate (mTLS), or one from another CA.
        assert call_code(child.address, TlsFiles(ca=certs.ca)) == grpc.StatusCode.UNAVAILABLE
        assert call_code(child.address, certs.other_client) == grpc.StatusCode.UNAVAILABLE
        # A client that does not trust the servers' CA.
        stranger = TlsFiles(certs.client.cert, certs.client.key, certs.other_ca)
        assert call_code(child.address, stranger) == grpc.StatusCode.UNAVAILABLE


def test_tokens_enforced_and_counted(cluster: LocalCluster, certs: Certs) -> None:
    router, pod = cluster.router, cluster.pods[0]
    assert call_code(router.address, certs.client, None) == grpc.StatusCode.UNAUTHENTICATED
    assert call_code(router.address, certs.client, "nope") == grpc.StatusCode.UNAUTHENTICATED
    assert call_code(pod.address, certs.client, None) == grpc.StatusCode.UNAUTHENTICATED
    reset = dict(admin=True)
    assert call_code(pod.address, certs.client, None, **reset) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert call_code(pod.address, certs.client, "nope", **reset) == \
        grpc.StatusCode.UNAUTHENTICATED
    # The clients' token (the router's) does not open a pod: no client bypasses the router.
    assert call_code(pod.address, certs.client, API_TOKEN) == grpc.StatusCode.UNAUTHENTICATED
    assert cluster.pod_token and cluster.pod_token != API_TOKEN
    assert call_code(pod.address, certs.client, cluster.pod_token) == grpc.StatusCode.OK
    # The pods' API token is no admin token.
    assert call_code(pod.address, certs.client, cluster.pod_token, **reset) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert call_code(pod.address, certs.client, ADMIN_TOKEN, **reset) == grpc.StatusCode.OK
    assert metric(router.metrics_port, "pagekv_router_auth_refused_total")[
        ("Generate", "UNAUTHENTICATED")] >= 2
    pod_counts = metric(pod.metrics_port, "pagekv_auth_refused_total")
    assert pod_counts[("ResetPrefixCache", "UNAUTHENTICATED")] >= 2
    assert pod_counts[("ResetPrefixCache", "PERMISSION_DENIED")] >= 1
    assert pod_counts[("Generate", "UNAUTHENTICATED")] >= 1


def test_generate_cli_flags(cluster: LocalCluster, certs: Certs) -> None:
    argv = [sys.executable, "-m", "pagekv", "generate", "hello", "--max-tokens", "2",
            "--router", cluster.router.address]
    tls = ["--tls-ca", certs.ca, "--tls-cert", certs.client.cert, "--tls-key", certs.client.key]
    env = {**os.environ, "PAGEKV_API_TOKEN": API_TOKEN}
    ok = subprocess.run(argv + tls, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert f"served_by={cluster.pods[0].name}" in ok.stderr
    plain = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
    no_token = subprocess.run(argv + tls, env={**os.environ, "PAGEKV_API_TOKEN": ""},
                              capture_output=True, text=True, timeout=120)
    assert no_token.returncode == 1 and "UNAUTHENTICATED" in no_token.stderr


def test_no_secret_in_command_lines_or_logs(cluster: LocalCluster) -> None:
    call_code(cluster.router.address, None)  # something refused, so there is a line to read
    for child in cluster.children:
        cmdline = Path(f"/proc/{child.proc.pid}/cmdline").read_bytes().decode()
        log = child.log_path.read_text(errors="replace")
        for secret in (ADMIN_TOKEN, API_TOKEN, cluster.peer_token, cluster.pod_token):  # (made up: the peer's, the pods')
            assert secret and secret not in cmdline and secret not in log, child.name
    assert "mutual TLS" in cluster.pods[0].log_path.read_text()
    assert "admin calls: token required" in cluster.pods[0].log_path.read_text()
