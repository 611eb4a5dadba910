"""--metrics-token (issue #27: /metrics was open): a pod's, the router's and the vLLM
ingester's metrics ports, as real processes, answer 401 without `Authorization: Bearer
<token>` and the page with it; the Prometheus configuration `pagekv up` writes sends it
(authorization.credentials_file, a file only its owner reads)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from pagekv.deploy.local_cluster import LocalCluster, pagekv_cmd, spawn, stop_child
from pagekv.deploy.redis_server import free_port
from pagekv.proto.credentials import METRICS_TOKEN_ENV

pytestmark = pytest.mark.integration

TOKEN = "mtok-5d1e9a0c7f"


def status(port: int, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        assert exc.code != 401 or exc.headers["WWW-Authenticate"].startswith("Bearer")
        return exc.code, exc.read().decode()


def guarded(port: int, metric: str) -> None:
    for token in (None, "wrong", ""):
        code, body = status(port, token)
        assert code == 401 and metric not in body, (port, token)
    code, body = status(port, TOKEN)
    assert code == 200 and metric in body


def test_pod_and_router_metrics_need_the_token(tmp_path: Path) -> None:
    cluster = LocalCluster(nodes=1, run_dir=tmp_path, metrics_token=TOKEN,
                           node_args=["--num-gpu-blocks", "64", "--max-model-len", "256"])
    cluster.start(timeout=120)
    try:
        guarded(cluster.pods[0].metrics_port, "pagekv_kv_cache_blocks")
        guarded(cluster.router.metrics_port, "pagekv_router_requests_total")
        config = yaml.safe_load(cluster.prometheus_config.read_text())
        jobs = {job["job_name"]: job for job in config["scrape_configs"]}
        for name in ("pagekv-pods", "pagekv-router"):
            auth = jobs[name]["authorization"]
            assert auth["type"] == "Bearer"
            token_file = Path(auth["credentials_file"])
            assert token_file.read_text() == TOKEN and token_file.stat().st_mode & 0o077 == 0
        assert TOKEN not in cluster.prometheus_config.read_text()
    finally:
        cluster.stop()


def test_ingester_metrics_need_the_token(redis_server, tmp_path: Path) -> None:
    port = free_port()
    ingester = spawn("ingest", pagekv_cmd(
        "ingest-vllm", "--zmq-endpoint", f"tcp://127.0.0.1:{free_port()}", "--pod-id", "v",
        "--openai-address", f"127.0.0.1:{free_port()}", "--model", "pagekv-tiny",
        "--block-size", "16",
        "--redis-url", redis_server.url, "--metrics-port", str(port)), tmp_path,
        {METRICS_TOKEN_ENV: TOKEN})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status(port, None)
                break
            except OSError:
                assert ingester.proc.poll() is None, ingester.log_tail()
                assert time.monotonic() < deadline, "the ingester's metrics port never opened"
                time.sleep(0.2)
        guarded(port, "pagekv_ingest_batches_total")
    finally:
        stop_child(ingester)


def test_without_a_token_the_page_stays_open(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, Counter

    from pagekv.proto.serving import serve_metrics

    registry = CollectorRegistry()
    Counter("probe", "a probe", registry=registry).inc()
    server = serve_metrics(registry, "127.0.0.1", 0)
    try:
        assert status(server.server_port, None)[0] == 200
    finally:
        server.shutdown()
        server.server_close()
