"""Tenants (issue #27, finding 2) and the auth check at join (finding 8), with real processes:
a router and a pod started with one tenants file and the fleet's tokens (LocalCluster), a
real Redis, and a pod started without the fleet's auth.

Before the fix `cache_salt` was the client's to choose: tenant B sending tenant A's salt got
A's cached prefix (the issue recovered a secret in 1,000 guesses). Now the salt is derived
from the authenticated tenant, on the router and on a pod called directly alike, and the
router predicts exactly the hit the pod then reports.
"""

from __future__ import annotations

import random
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import Child, LocalCluster, pagekv_cmd, spawn, stop_child
from pagekv.deploy.redis_server import free_port
from pagekv.proto.auth_profile import fleet_auth_key
from pagekv.proto.credentials import ADMIN_TOKEN_ENV, API_TOKEN_ENV, POD_API_TOKEN_ENV, bearer
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.tenants import hash_token
from tests.integration.router_fixtures import BS, SCHEMA, tokens_req

pytestmark = pytest.mark.integration

FLEET_TOKEN = "fleet-2c9d41e7a0b3"  # the pods' --api-token = the router's --pod-api-token
ADMIN_TOKEN = "adm-61f0b8c2d7e4"
TOKEN_A = "tenant-a-9e1f7c3b5d20"
TOKEN_B = "tenant-b-4a8c0e6f2b91"
TOKEN_C = "tenant-c-7d3e9a1c6f08"
SECRET_SALT = "account code 731"
POD_ARGS = ["--num-gpu-blocks", "96", "--max-model-len", "512", "--lease-ttl-s", "2"]


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("tenants")) / "tenants.yaml"
    path.write_text(f"tenants:\n  acme:\n    tokens: ['{hash_token(TOKEN_A)}']\n"
                    f"  globex:\n    tokens: ['{hash_token(TOKEN_B)}']\n"
                    f"  initech:\n    tokens: ['{hash_token(TOKEN_C)}']\n")
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tenants_file: Path
            ) -> Iterator[LocalCluster]:
    with LocalCluster(nodes=1, run_dir=tmp_path_factory.mktemp("tenants-run"),
                      node_args=POD_ARGS, admin_token=ADMIN_TOKEN, api_token=FLEET_TOKEN,
                      pod_token=FLEET_TOKEN,
                      tenants=str(tenants_file),  # `pagekv up --tenants FILE`
                      router_args=["--burst-ttl-s", "0"]) as c:  # the index predicts
        yield c


def generate(address: str, token: str, ids: list[int], salt: str) -> pb.GenerateResponse:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.GenerationStub(ch).Generate(tokens_req(ids, salt), metadata=bearer(token),
                                                   timeout=60)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(4 * BS + 3)]


def wait_for(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_another_tenant_sending_the_salt_gets_no_hit(cluster: LocalCluster) -> None:
    router = cluster.router_child().target()
    ids = prompt(1)
    first = generate(router, TOKEN_A, ids, SECRET_SALT)
    assert first.usage.cached_tokens == 0
    hits: list[pb.GenerateResponse] = []

    def a_hits() -> bool:  # once the pod's claims are in the index, the router predicts them
        hits.append(generate(router, TOKEN_A, ids, SECRET_SALT))
        return hits[-1].routing.predicted_cached_tokens > 0

    wait_for(a_hits, "the router to predict tenant A's cached prefix")
    again = hits[-1]
    assert again.usage.cached_tokens == 4 * BS
    assert again.routing.predicted_cached_tokens == again.usage.cached_tokens
    # Tenant B with A's salt through the router, and C on the pod directly: nothing cached,
    # and the router predicts nothing either.
    stolen = generate(router, TOKEN_B, ids, SECRET_SALT)
    assert stolen.usage.cached_tokens == 0 and stolen.routing.predicted_cached_tokens == 0
    direct = generate(cluster.pods[0].address, TOKEN_C, ids, SECRET_SALT)
    assert direct.usage.cached_tokens == 0
    # B's own request is now cached, in B's partition: B hits it, predicted right.
    owns: list[pb.GenerateResponse] = []
    wait_for(lambda: owns.append(generate(router, TOKEN_B, ids, SECRET_SALT))
             or owns[-1].routing.predicted_cached_tokens > 0, "B's own prefix predicted")
    assert owns[-1].usage.cached_tokens == owns[-1].routing.predicted_cached_tokens == 4 * BS
    # A, directly on the pod with its own token: the pod derives the router's salt.
    assert generate(cluster.pods[0].address, TOKEN_A, ids, SECRET_SALT).usage.cached_tokens \
        == 4 * BS
    # Within a tenant, another salt is another partition.
    assert generate(router, TOKEN_A, ids, "other").usage.cached_tokens == 0


def test_no_salt_is_still_per_tenant(cluster: LocalCluster) -> None:
    router = cluster.router_child().target()
    ids = prompt(2)
    generate(router, TOKEN_B, ids, "")
    wait_for(lambda: generate(router, TOKEN_B, ids, "").usage.cached_tokens == 4 * BS,
             "tenant B's own hit")
    assert generate(router, TOKEN_A, ids, "").usage.cached_tokens == 0


def test_a_credential_of_no_tenant_is_refused(cluster: LocalCluster) -> None:
    router = cluster.router_child().target()
    for token, code in (("not-a-token", grpc.StatusCode.UNAUTHENTICATED),
                        # the fleet token names no tenant at the router: a client never has it
                        (FLEET_TOKEN, grpc.StatusCode.PERMISSION_DENIED)):
        with pytest.raises(grpc.RpcError) as err:
            generate(router, token, prompt(3), SECRET_SALT)
        assert err.value.code() == code


def start_open_pod(cluster: LocalCluster, name: str) -> Child:
    """A pod on the fleet's index without any token or tenants file."""
    port = free_port(cluster.host)
    argv = pagekv_cmd("node", "--model", cluster.model, "--host", cluster.host, "--port",
                      str(port), "--pod-id", name, *POD_ARGS)
    env = {API_TOKEN_ENV: "", ADMIN_TOKEN_ENV: "", POD_API_TOKEN_ENV: "",
           "PAGEKV_REDIS_URL": cluster.redis_url or ""}
    assert cluster.run_dir is not None
    child = spawn(name, argv, cluster.run_dir, env)
    child.address = f"{cluster.host}:{port}"
    return child


def join_refusals(cluster: LocalCluster) -> dict[str, float]:
    port = cluster.router_child().metrics_port
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.labels["setting"]: s.value for f in text_string_to_metric_families(page)
            for s in f.samples if s.name == "pagekv_router_join_refused_total"}


def test_a_pod_without_the_fleets_auth_is_refused_at_join(cluster: LocalCluster) -> None:
    # The router wrote the fleet's auth to the index: the pod reads it and does not join.
    pod = start_open_pod(cluster, "open-pod")
    try:
        assert pod.proc.wait(120) == 2
        line = pod.log_tail(3).strip().splitlines()[-1]
        assert "open-pod refused at join" in line
        assert "--api-token: fleet token required, pod none" in line
        assert "--admin-token" in line and "--tenants" in line
    finally:
        stop_child(pod)
    # A pod that registered before any router wrote it: the router refuses it (log, metric)
    # and never routes to it.
    client = redis.Redis.from_url(cluster.redis_url or "")
    client.delete(fleet_auth_key(SCHEMA))
    late = start_open_pod(cluster, "late-open-pod")
    try:
        wait_for(lambda: join_refusals(cluster).get("api_token", 0) >= 1,
                 "the router to refuse the open pod", 120)
        assert join_refusals(cluster).get("tenants", 0) >= 1
        router_log = cluster.router_child().log_tail(200)
        assert "pod late-open-pod at " in router_log and "refused at join: auth settings " \
            "differ from the fleet's: --api-token: fleet token required, pod none" in router_log
        for seed in range(10, 16):  # every request goes to the fleet's pod
            resp = generate(cluster.router_child().target(), TOKEN_A, prompt(seed), "")
            assert resp.served_by == cluster.pods[0].name
    finally:
        stop_child(late)
        client.close()


def test_a_client_certificate_names_its_tenant(tmp_path_factory: pytest.TempPathFactory
                                               ) -> None:
    """Mutual TLS: the client certificate's subject maps to a tenant, no token sent; a token
    still wins over it (the same certificate with globex's token is globex)."""
    from pagekv.proto.grpc_security import open_channel
    from tests.integration.tls_fixtures import make_certs

    certs = make_certs(Path(tmp_path_factory.mktemp("tenant-certs")))
    path = Path(tmp_path_factory.mktemp("tenants-mtls")) / "tenants.json"
    path.write_text('{"tenants": {"acme": {"cert_subjects": ["CN=client"]}, '
                    f'"globex": {{"tokens": ["{hash_token(TOKEN_B)}"]}}}}}}')
    with LocalCluster(nodes=1, run_dir=tmp_path_factory.mktemp("tenants-mtls-run"),
                      node_args=POD_ARGS, admin_token=ADMIN_TOKEN, api_token=FLEET_TOKEN,
                      pod_token=FLEET_TOKEN,
                      tls_cert=certs.server.cert, tls_key=certs.server.key, tls_ca=certs.ca,
                      tls_client_auth=True, tenants=str(path),
                      router_args=["--burst-ttl-s", "0"]) as cluster:
        ids = prompt(7)

        def call(token: str | None) -> pb.GenerateResponse:
            with open_channel(cluster.router_child().target(), certs.client) as ch:
                return pb_grpc.GenerationStub(ch).Generate(
                    tokens_req(ids, SECRET_SALT), timeout=60,
                    metadata=bearer(token) if token else None)

        assert call(None).usage.cached_tokens == 0
        hits: list[pb.GenerateResponse] = []
        wait_for(lambda: hits.append(call(None)) or hits[-1].usage.cached_tokens > 0,
                 "acme's hit by its certificate")
        assert hits[-1].usage.cached_tokens == hits[-1].routing.predicted_cached_tokens == 4 * BS
        assert call(TOKEN_B).usage.cached_tokens == 0  # globex, by its token


def _http_completion(port: int, token: str, ids: list[int], salt: str) -> dict:
    import json

    body = {"model": "pagekv-tiny", "prompt": ids, "max_tokens": 2, "temperature": 0,
            "cache_salt": salt}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_tenants_call_the_openai_api_with_their_own_tokens(cluster: LocalCluster) -> None:
    """The HTTP front end reads the tenant from the request's token as gRPC does (its
    in-process calls carried no credential, so every tenant call was refused)."""
    router_http = cluster.router_child().http_port
    pod_http = cluster.pods[0].http_port
    assert router_http and pod_http
    ids = prompt(7)

    def cached(port: int, token: str, salt: str) -> int:
        usage = _http_completion(port, token, ids, salt)["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    assert cached(router_http, TOKEN_A, SECRET_SALT) == 0
    wait_for(lambda: cached(router_http, TOKEN_A, SECRET_SALT) == 4 * BS,
             "tenant A's hit over HTTP")
    # Another tenant with A's salt, through the router and on the pod directly: no hit.
    assert cached(router_http, TOKEN_B, SECRET_SALT) == 0
    assert cached(pod_http, TOKEN_C, SECRET_SALT) == 0
    assert cached(pod_http, TOKEN_A, SECRET_SALT) == 4 * BS  # the pod derives A's salt
    for port in (router_http, pod_http):  # a token the file does not list
        with pytest.raises(urllib.error.HTTPError) as info:
            _http_completion(port, "not-a-tenant", ids, SECRET_SALT)
        assert info.value.code == 401
