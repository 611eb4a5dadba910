"""The router against a real Redis and real pods as processes: prefix affinity, a DRAM tier,
a pod with another hash seed, a killed pod. One cluster (Redis and three pods) serves the
whole module; the router runs in-process (make_router, conftest.py).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import redis

from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.index import lookup_prefix
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from tests.integration.router_fixtures import BS, SCHEMA, SEED, pod_cluster, tokens_req

pytestmark = pytest.mark.integration

POD_ARGS = ["--num-gpu-blocks", "160", "--max-model-len", "2048", "--lease-ttl-s", "1.5",
            "--cpu-offload-bytes", "8MiB", "--max-num-batched-tokens", "2048"]
OTHER_SEED = "seed-2"


@pytest.fixture(scope="module")
def cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """node-a and node-b share the router's hash config; node-c has another seed."""
    run_dir = tmp_path_factory.mktemp("router-run")
    pods = {"node-a": [], "node-b": [], "node-c": ["--hash-seed", OTHER_SEED]}
    with pod_cluster(redis_binary, run_dir, POD_ARGS, pods) as cluster:
        yield cluster


def kv_stub(address: str) -> pb_grpc.KVNodeStub:
    return pb_grpc.KVNodeStub(grpc.insecure_channel(address))


def reset_all(cluster: Any) -> None:
    for pod in cluster.pods:
        if pod.proc.poll() is None:
            assert kv_stub(pod.address).ResetPrefixCache(
                pb.ResetPrefixCacheRequest(include_tiers=True), timeout=30).success


def random_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_shared_system_prompt_sticks_to_one_pod(cluster, make_router) -> None:
    reset_all(cluster)
    router = make_router(cluster.redis_url)
    router.wait_pods(2)
    system = [256] + random_tokens(1, 1023)  # 1,024 tokens: 64 full blocks
    first = router.stub.Generate(tokens_req(system + random_tokens(100, 20)), timeout=60)
    home = first.served_by
    assert home in ("node-a", "node-b") and first.usage.cached_tokens == 0
    for i in range(5):
        resp = router.stub.Generate(tokens_req(system + random_tokens(200 + i, 25)),
                                    timeout=60)
        assert resp.served_by == home
        assert resp.usage.cached_tokens == 1024
        assert resp.routing.predicted_cached_tokens == 1024
    # Another tenant's salt never hits those blocks, wherever it goes.
    salted = router.stub.Generate(tokens_req(system + random_tokens(300, 25), salt="t2"),
                                  timeout=60)
    assert salted.usage.cached_tokens == 0 and salted.routing.predicted_cached_tokens == 0
    assert router.metric("pagekv_router_actual_cached_tokens_sum") == 5 * 1024
    assert router.metric("pagekv_router_predicted_cached_tokens_sum") == 5 * 1024


def test_dram_prefix_routes_back_to_its_pod(cluster, make_router) -> None:
    reset_all(cluster)
    stats = kv_stub(cluster.pods[0].address).Stats(pb.StatsRequest())
    if "CPU" not in {t.tier for t in stats.tiers}:
        pytest.skip("the pod reports no DRAM tier: tiers are not wired into the engine yet")
    router = make_router(cluster.redis_url)
    router.wait_pods(2)
    system = [256] + random_tokens(2, 1023)
    home = router.stub.Generate(tokens_req(system + random_tokens(400, 20)), timeout=60)
    home_pod = next(p for p in cluster.pods if p.name == home.served_by)
    # Evict it from home's pool by sending other prompts straight to that pod.
    gen = pb_grpc.GenerationStub(grpc.insecure_channel(home_pod.address))
    hashes = hash_prompt(HashConfig("sha256", SEED), BS, system)
    client = redis.Redis.from_url(cluster.redis_url)
    tiers: list[str] = []
    for i in range(6):
        gen.Generate(tokens_req([256] + random_tokens(500 + i, 1200)), timeout=60)
        time.sleep(0.2)
        match = lookup_prefix(client, SCHEMA, hashes).get(home.served_by)
        tiers = match.tiers if match else []
        if tiers and tiers[0] != "GPU":
            break
    assert tiers and tiers[0] == "CPU", tiers
    resp = router.stub.Generate(tokens_req(system + random_tokens(600, 20)), timeout=60)
    assert resp.served_by == home.served_by
    assert resp.routing.predicted_cached_tokens > 0
    assert resp.usage.cached_tokens_cpu > 0


def test_other_hash_seed_is_never_chosen_and_logged(cluster, make_router, caplog) -> None:
    reset_all(cluster)
    with caplog.at_level(logging.WARNING, logger="pagekv.router.pods"):
        router = make_router(cluster.redis_url)
        router.wait_pods(2)
        time.sleep(0.5)  # a namespace scan
        for i in range(6):
            resp = router.stub.Generate(tokens_req(random_tokens(700 + i, 100)), timeout=60)
            assert resp.served_by in ("node-a", "node-b")
        time.sleep(0.5)
    lines = [r.getMessage() for r in caplog.records if "node-c" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "hash_seed differs" in lines[0] and OTHER_SEED in lines[0]
    c = next(c for c in resp.routing.candidates if c.pod_id == "node-c")
    assert not c.eligible and OTHER_SEED in c.excluded_reason


def test_killed_pod_is_routed_around_then_forgotten(cluster, make_router) -> None:
    """Last in this module: it kills a pod."""
    reset_all(cluster)
    router = make_router(cluster.redis_url)
    router.wait_pods(2)
    system = [256] + random_tokens(3, 1023)
    home = router.stub.Generate(tokens_req(system + random_tokens(800, 20)),
                                timeout=60).served_by
    victim = next(p for p in cluster.pods if p.name == home)
    results: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set() and i < 200:
            i += 1
            try:
                r = router.stub.Generate(tokens_req(system + random_tokens(900 + i, 20)),
                                         timeout=60)
                results.append(r.served_by)
            except grpc.RpcError as exc:
                errors.append(exc)

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    time.sleep(1.0)
    os.killpg(victim.proc.pid, 9)  # no clean shutdown: only the lease can expire
    victim.proc.wait(10)
    killed_at = len(results)
    time.sleep(2.5)  # lease TTL 1.5 s + a refresh
    stop.set()
    for w in workers:
        w.join(120)
    assert not errors, errors
    survivor = "node-b" if home == "node-a" else "node-a"
    assert results[killed_at:] and set(results[killed_at + 2:]) == {survivor}
    resp = router.stub.Generate(tokens_req(system + random_tokens(999, 20)), timeout=60)
    assert resp.served_by == survivor
    assert home not in {c.pod_id for c in resp.routing.candidates}
