"""Per-tenant quotas and the shared region (issue #31), with real processes: a router and a pod
with DRAM and SSD tiers started by `pagekv up` with one tenants file, a real Redis, every call
through the router or the pod's gRPC port with a tenant's own token.

- a tenant flooding past its quota evicts its own blocks, never another's: the other tenant's
  prefix is still a full pool hit, and the pod's /metrics shows each tenant's bytes per tier
  within its quota and the evictions counted against the flooder alone;
- the shared region (a common system prompt) is computed once and hit by every tenant, while
  what follows it stays each tenant's own; the router predicts those hits too;
- the `tenant` field is the router's to set: a client's forged one is ignored, and over the
  fleet credential a tenant the file does not name is refused.
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.proto.credentials import bearer
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.tenants import hash_token
from tests.integration.router_fixtures import BS, tokens_req
from tests.integration.test_tenants_cluster import wait_for

pytestmark = pytest.mark.integration

FLEET_TOKEN = "fleet-q-5b1e0c93d2a7"
ADMIN_TOKEN = "adm-q-0d6f3b8e1c54"
TOKEN_A = "tenant-a-q-3f9b2e7c1d60"
TOKEN_B = "tenant-b-q-8c4a1f0e6b27"
BLOCK_BYTES = 8192  # pagekv-tiny: 2 layers x K,V x 2 KV heads x 16 dims x 16 tokens x fp32
QUOTA_BLOCKS = {"pool": 4, "dram": 4, "ssd": 8}
SYSTEM = [(i * 11) % 200 + 1 for i in range(4 * BS)]  # the shared region: 4 blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    run = tmp_path_factory.mktemp("quota-run")
    quota = ", ".join(f"{tier}: {n * BLOCK_BYTES}" for tier, n in QUOTA_BLOCKS.items())
    tenants = Path(run) / "tenants.yaml"
    tenants.write_text(
        f"tenants:\n  acme:\n    tokens: ['{hash_token(TOKEN_A)}']\n    quota: {{{quota}}}\n"
        f"  globex:\n    tokens: ['{hash_token(TOKEN_B)}']\n"
        f"shared:\n  prefixes:\n    - token_ids: {SYSTEM}\n")
    pod_args = ["--num-gpu-blocks", "40", "--max-model-len", "256", "--lease-ttl-s", "2",
                "--cpu-offload-bytes", str(16 * BLOCK_BYTES),
                "--disk-offload-bytes", str(64 * BLOCK_BYTES),
                "--disk-offload-dir", str(Path(run) / "ssd")]
    with LocalCluster(nodes=1, run_dir=run, node_args=pod_args, admin_token=ADMIN_TOKEN,
                      api_token=FLEET_TOKEN, pod_token=FLEET_TOKEN, tenants=str(tenants),
                      router_args=["--burst-ttl-s", "0"]) as c:
        yield c


def generate(address: str, token: str, ids: list[int], tenant: str = "") -> pb.GenerateResponse:
    req = tokens_req(ids)
    req.tenant = tenant
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.GenerationStub(ch).Generate(req, metadata=bearer(token), timeout=60)


def tenant_metrics(cluster: LocalCluster) -> dict[tuple[str, str, str], float]:
    """(metric, tenant, tier) -> value, off the pod's /metrics."""
    port = cluster.pods[0].metrics_port
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, s.labels["tenant"], s.labels["tier"]): s.value
            for f in text_string_to_metric_families(page) for s in f.samples
            if s.name.startswith("pagekv_pod_tenant_")}


def private(seed: int, n: int = 6 * BS + 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def test_a_tenant_over_its_quota_evicts_its_own_blocks_never_anothers(cluster: LocalCluster
                                                                      ) -> None:
    router = cluster.router_child().target()
    theirs = private(1)
    cold = generate(router, TOKEN_B, theirs)
    assert cold.usage.cached_tokens == 0
    for seed in range(100, 112):  # acme: 72 blocks, past its pool, DRAM and SSD quotas
        generate(router, TOKEN_A, private(seed))
    again = generate(router, TOKEN_B, theirs)
    assert again.usage.cached_tokens == again.usage.cached_tokens_gpu == 6 * BS
    assert list(again.completions[0].token_ids) == list(cold.completions[0].token_ids)
    m = tenant_metrics(cluster)
    for tier, medium in (("pool", "GPU"), ("dram", "CPU"), ("ssd", "DISK")):
        quota = QUOTA_BLOCKS[tier] * BLOCK_BYTES
        assert m[("pagekv_pod_tenant_quota_bytes", "acme", medium)] == quota
        assert m.get(("pagekv_pod_tenant_cached_bytes", "acme", medium), 0) <= quota
        assert m[("pagekv_pod_tenant_quota_evictions_total", "acme", medium)] > 0
        assert ("pagekv_pod_tenant_quota_evictions_total", "globex", medium) not in m
    assert m[("pagekv_pod_tenant_cached_bytes", "globex", "GPU")] >= 6 * BLOCK_BYTES


def test_the_shared_region_is_hit_by_every_tenant(cluster: LocalCluster) -> None:
    router = cluster.router_child().target()
    first = generate(router, TOKEN_A, SYSTEM + private(7, 2 * BS + 1))
    assert first.usage.cached_tokens == 0
    hits: list[pb.GenerateResponse] = []

    def globex_hits() -> bool:  # once the pod's claims are in the index, the router predicts
        tail = private(1000 + len(hits), 2 * BS + 1)  # a new one each try: not its own hit
        hits.append(generate(router, TOKEN_B, SYSTEM + tail))
        return hits[-1].routing.predicted_cached_tokens > 0

    wait_for(globex_hits, "the router to predict globex's hit on the shared region")
    # Exactly the shared blocks: what follows them is each tenant's own.
    assert hits[-1].usage.cached_tokens == hits[-1].routing.predicted_cached_tokens == 4 * BS
    # acme's private blocks after the region are not globex's, even with the same tokens.
    same = SYSTEM + private(7, 2 * BS + 1)
    assert generate(router, TOKEN_B, same).usage.cached_tokens == 4 * BS
    assert generate(router, TOKEN_A, same).usage.cached_tokens == 6 * BS
    m = tenant_metrics(cluster)
    assert m[("pagekv_pod_tenant_cached_bytes", "_shared", "GPU")] == 4 * BLOCK_BYTES


def test_the_tenant_field_is_only_believed_from_the_fleet(cluster: LocalCluster) -> None:
    pod = cluster.pods[0].address
    before = tenant_metrics(cluster).get(("pagekv_pod_tenant_cached_bytes", "acme", "GPU"), 0)
    # globex's token claiming to be acme, on the pod directly: counted as globex's.
    generate(pod, TOKEN_B, private(20), tenant="acme")
    after = tenant_metrics(cluster)
    assert after.get(("pagekv_pod_tenant_cached_bytes", "acme", "GPU"), 0) <= before
    # The fleet credential is believed, but only for a tenant the file names.
    with pytest.raises(grpc.RpcError) as err:
        generate(pod, FLEET_TOKEN, private(21), tenant="nobody")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not in the tenants file" in (err.value.details() or "")
    generate(pod, FLEET_TOKEN, private(22), tenant="globex")  # (as the router forwards)
