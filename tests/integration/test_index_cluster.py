"""The index on a real Redis Cluster (3 primaries, 3 replicas, on loopback): block claims
spread over the shards while every key of one chain shares one slot and the control keys
share another; a router routes by prefix through it; a primary killed (SIGKILL): its replica
takes over, the pods republish and routing by prefix recovers, within bounded time; real
pod and router processes given a redis+cluster:// URL. The lookup and lifecycle tests also
run on the cluster (test_index_lookup.py,
test_index_lifecycle.py). Fixtures: conftest.py; helpers: index_fixtures.py,
router_fixtures.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.deploy.redis_cluster import LocalRedisCluster
from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.index import connect, count_pod_claims, list_live_pods, lookup_prefix
from pagekv.proto.index.queries import LivePods
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from tests.integration.index_fixtures import SCHEMA, chain, primaries
from tests.integration.router_fixtures import BS, SEED, FakePod, tokens_req
from tests.integration.router_fixtures import SCHEMA as ROUTER_SCHEMA

pytestmark = pytest.mark.integration


def wait_until(cond: Callable[[], object], timeout: float, what: str) -> float:
    """Poll; returns the seconds it took. The deadline only bounds a hang."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize("index_redis", ["cluster"], indirect=True)
def test_claims_spread_over_the_shards_and_each_chain_stays_on_one(make_pod, client,
                                                                   index_redis):
    pod = make_pod("pod-a")
    chains = [chain(3, f"root-{i}") for i in range(300)]
    for c in chains:
        pod.store(c)
    assert pod.pub.flush(10)
    nodes = list(primaries(client))
    assert len(nodes) == 3
    held = [{k.decode(): node.hlen(k) for k in node.keys(f"{SCHEMA.prefix}:*:c")}
            for node in nodes]
    per_shard = [sum(keys.values()) for keys in held]
    assert sum(per_shard) == 900
    assert min(per_shard) > 0.2 * 900, per_shard  # about a third each (1024 buckets)
    assert count_pod_claims(client, SCHEMA, "pod-a") == 900
    for c in chains:  # all of a chain in one key, on one shard: a lookup is one call
        key = SCHEMA.chain_claims_key(c)
        assert sum(key in shard for shard in held) == 1
    slot = index_redis.cluster.key_slot  # the control keys: one slot, the namespace's
    control = [SCHEMA.pods_key, SCHEMA.config_key, SCHEMA.pod_key("pod-a"),
               SCHEMA.lease_key("pod-a"), SCHEMA.pod_buckets_key("pod-a"),
               SCHEMA.pod_claim_ids_key("pod-a"), SCHEMA.claim_ids_key]
    assert len({slot(k) for k in control}) == 1
    live = LivePods.of(list_live_pods(client, SCHEMA))
    assert all(lookup_prefix(client, SCHEMA, c, live)["pod-a"].depth == 3 for c in chains)


def test_primary_killed_replica_takes_over_and_routing_recovers(redis_binary, tmp_path,
                                                                 make_router):
    cluster = LocalRedisCluster(3, 1, data_dir=tmp_path / "cluster", binary=redis_binary,
                                node_timeout_ms=1000).start()
    pods: list[FakePod] = []
    try:
        pods += [FakePod(f"fake-{c}", cluster.url) for c in "ab"]
        router = make_router(cluster.url, burst_ttl_s=0.0)  # the index alone decides
        router.wait_pods(2)
        system = list(range(3, 3 + 20 * BS))  # a 20-block prefix
        home = router.stub.Generate(tokens_req(system + [1])).served_by
        holder = next(p for p in pods if p.pod_id == home)
        assert holder.publisher.flush(5)
        again = router.stub.Generate(tokens_req(system + [2]))
        assert again.served_by == home and again.routing.reason == "prefix_hit"
        # Kill the primary of the chain's bucket: the shard every lookup of it goes to.
        root_key = ROUTER_SCHEMA.chain_claims_key(
            hash_prompt(HashConfig("sha256", SEED), BS, system)[:1])
        slot = cluster.key_slot(root_key)
        victim = cluster.primary_of(slot)
        killed_at = time.monotonic()
        cluster.kill(victim)
        # Meanwhile the pods keep serving; a request that lands writes into the dead shard.
        router.stub.Generate(tokens_req(system + [3] * 40), timeout=10)
        failover_s = wait_until(lambda: cluster.primary_of(slot) is not victim, 20,
                                "a replica to take the slot over")
        cluster.wait_ok(20)

        def prefix_routed() -> bool:
            try:  # while the control shard fails over, no pod may have a lease to route to
                resp = router.stub.Generate(tokens_req(system + [4]), timeout=10)
            except grpc.RpcError:
                return False
            # Predicted from the index (no burst predictions here) and true: whichever pod
            # holds it (both may by now: a tie is not a prefix_hit reason, still a hit).
            return min(resp.routing.predicted_cached_tokens, resp.usage.cached_tokens) >= 20 * BS

        wait_until(prefix_routed, 20, "routing by prefix again")
        recovered_s = time.monotonic() - killed_at
        assert failover_s < 20 and recovered_s < 30
        writers = [p for p in pods if p.publisher.stats()["errors"]]
        assert writers  # the pod that stored into the dead shard saw it, and republished
        for p in writers:
            wait_until(lambda p=p: p.publisher.stats()["reconnects"] >= 1, 10, "a reconnect")
            assert p.publisher.stats()["republishes"] >= 2
        fresh = connect(cluster.url, 5.0)  # what any new client of the cluster sees
        hashes = hash_prompt(HashConfig("sha256", SEED), BS, system + [3] * 40)
        got = lookup_prefix(fresh, ROUTER_SCHEMA, hashes)
        assert max(m.depth for m in got.values()) == len(hashes)
        fresh.close()
    finally:
        for p in pods:
            p.close()
        cluster.close()


@pytest.mark.parametrize("index_redis", ["cluster"], indirect=True)
def test_pod_and_router_processes_on_a_cluster_url(index_redis, client, tmp_path):
    """`pagekv up --redis-url redis+cluster://...`: the URL reaches the pod and the router
    processes, which publish to and look up in the cluster."""
    args = ["--num-gpu-blocks", "64", "--max-model-len", "512"]
    with LocalCluster(nodes=1, run_dir=tmp_path, node_args=args, redis_url=index_redis.url,
                      router_args=["--burst-ttl-s", "0"]) as cluster:  # the index decides
        prompt = list(range(5, 5 + 4 * BS + 1))
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
        with grpc.insecure_channel(cluster.router.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            first = stub.Generate(request, timeout=60)
            hashes = hash_prompt(HashConfig("sha256", SEED), BS, prompt)
            pod = first.served_by
            wait_until(lambda: lookup_prefix(client, ROUTER_SCHEMA, hashes)[pod].depth == 4,
                       10, "the pod's claims in the cluster")
            again = stub.Generate(request, timeout=60)
        assert again.served_by == pod
        assert again.routing.predicted_cached_tokens == again.usage.cached_tokens == 4 * BS
        assert count_pod_claims(client, ROUTER_SCHEMA, pod) == 4
