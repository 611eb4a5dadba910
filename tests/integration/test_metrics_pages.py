"""Every metrics page passes `promtool check metrics`; /metrics is the only path served;
pods label by model_name; grpc health List answers on pods and the router; the HTTP API
ports serve the same registry on /metrics too (vLLM's place for it)."""

from __future__ import annotations

import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

NODE_ARGS = ["--num-gpu-blocks", "64", "--max-model-len", "512", "--cpu-offload-bytes", "1MiB",
             "--disk-offload-bytes", "8MiB", "--disk-offload-dir", "{run_dir}/{pod_id}-ssd"]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:  # `make install` installs it (Debian's prometheus package)
        pytest.fail("promtool not found: apt-get install -y prometheus")
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(nodes=1, run_dir=tmp_path_factory.mktemp("metrics"), node_args=NODE_ARGS)
    with c:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(c.router.address))
        for _ in range(2):  # a hit, so every family has samples
            stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 60))),
                                             sampling=pb.SamplingParams(max_tokens=3)),
                          timeout=60)
        yield c


def pages(c: LocalCluster) -> dict[str, str]:
    return {child.name: f"http://127.0.0.1:{child.metrics_port}"
            for child in [*c.pods, c.router]}


def fetch(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def test_every_page_passes_promtool(cluster: LocalCluster) -> None:
    for name, base in pages(cluster).items():
        text = fetch(base + "/metrics")
        r = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0, f"{name}: {r.stdout}{r.stderr}"


def test_only_the_metrics_path_is_served(cluster: LocalCluster) -> None:
    for base in pages(cluster).values():
        for path in ("/", "/metricsx", "/v1/models", "/metrics/extra"):
            with pytest.raises(urllib.error.HTTPError) as e:
                fetch(base + path)
            assert e.value.code == 404


def test_pod_metrics_carry_model_name_and_the_publish_lag_histogram(cluster: LocalCluster
                                                                     ) -> None:
    text = fetch(pages(cluster)["node-a"] + "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for fam in families.values():
        if fam.name.startswith("pagekv_"):
            for s in fam.samples:
                assert s.labels.get("model_name") == "pagekv-tiny", (fam.name, s)
    lag = families["pagekv_index_publish_lag_seconds"]
    assert lag.type == "histogram"
    count = next(s.value for s in lag.samples if s.name.endswith("_count"))
    assert count >= 1
    assert not any("publish_lag_p" in name for name in families)  # no quantiles as gauges


def test_health_list_on_pod_and_router(cluster: LocalCluster) -> None:
    for child, services in ((cluster.pods[0], {"", "pagekv.v1.Generation", "pagekv.v1.KVNode"}),
                            (cluster.router, {"", "pagekv.v1.Generation"})):
        with grpc.insecure_channel(child.address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(),
                                                       timeout=10)
        assert set(resp.statuses) >= services, (child.name, dict(resp.statuses))
        assert all(s.status == health_pb2.HealthCheckResponse.SERVING
                   for name, s in resp.statuses.items() if name in services)


def test_rules_files_pass_promtool() -> None:
    rules = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
    files = sorted(str(p) for p in rules.glob("*.rules.yml"))
    assert files, "no rules shipped"
    r = subprocess.run([promtool(), "check", "rules", *files], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    tests = sorted(str(p) for p in rules.glob("*.test.yml"))
    assert tests, "no rule unit tests shipped"
    r = subprocess.run([promtool(), "test", "rules", *tests], capture_output=True, text=True,
                       timeout=60, cwd=rules)
    assert r.returncode == 0, r.stdout + r.stderr


def test_head_is_get_without_a_body(cluster: LocalCluster) -> None:
    """Tools probe a page with HEAD first (aiperf does, over aiohttp, which refuses a HEAD
    answer that carries a body)."""
    import http.client

    for base in pages(cluster).values():
        host, port = base.removeprefix("http://").split(":")
        for path, status in (("/metrics", 200), ("/elsewhere", 404)):
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("HEAD", path)
            resp = conn.getresponse()
            assert resp.status == status and resp.read() == b""
            conn.close()


# -- /metrics on the HTTP API ports too, where vLLM serves it (#26) ----------------------------

def api_pages(c: LocalCluster) -> dict[str, str]:
    return {child.name: f"http://127.0.0.1:{child.http_port}"
            for child in [*c.pods, c.router]}


def families_of(text: str) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """Each family's series, by their labels (values change between scrapes)."""
    out: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = {tuple(sorted(s.labels.items())) for s in fam.samples}
    return out


def test_every_api_port_serves_the_metrics_ports_registry(cluster: LocalCluster) -> None:
    metrics_ports = pages(cluster)
    for name, base in api_pages(cluster).items():
        fetch(base + "/metrics")  # counted once: both pages have that series from here on
        text = fetch(base + "/metrics")  # a scrape over HTTP, as Prometheus does
        r = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0, f"{name}: {r.stdout}{r.stderr}"
        on_api, on_port = families_of(text), families_of(fetch(metrics_ports[name] + "/metrics"))
        assert set(on_api) == set(on_port), (name, set(on_api) ^ set(on_port))
        http_family = "pagekv_router_http_requests" if name == "router" else \
            "pagekv_http_requests"
        for fam in on_api:  # the same series (the scrapes' own count aside)
            if not fam.startswith(http_family):
                assert on_api[fam] == on_port[fam], (name, fam)
        assert any(fam.startswith("pagekv_") for fam in on_api)


def test_api_ports_metrics_page_negotiates_and_answers_head(cluster: LocalCluster) -> None:
    import http.client

    for base in api_pages(cluster).values():
        req = urllib.request.Request(base + "/metrics",
                                     headers={"Accept": "application/openmetrics-text"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            assert resp.read().decode().rstrip().endswith("# EOF")
        host, port = base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("HEAD", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == b""
        conn.close()
