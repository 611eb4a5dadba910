"""The router against a real Redis: first with in-process fake pods (the fault paths, fast
and exact), then with real pods as processes (prefix affinity, tiers, a killed pod, a pod
with another hash seed). The router runs in-process on its own event loop thread, so its
log lines can be read with caplog; clients are plain synchronous gRPC stubs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import grpc
import pytest
import redis

from kvnode.pod.publisher import IndexPublisher
from kvnode.pod.redis_server import RedisProcess
from proto.hashing import HashConfig, hash_prompt
from proto.index import IndexSchema, lookup_prefix
from proto.kv_events import BlockStored
from proto.pagekv.v1 import pagekv_pb2 as pb
from proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.scoring import CostModel
from router.server import OVERHEAD_METADATA_KEY, RouterServer

pytestmark = pytest.mark.integration

BS = 16
SEED = "vllm-none-hash"
SCHEMA = IndexSchema("pagekv-tiny", BS, "sha256", SEED)
# Queue nearly free: the tests check prefix decisions, not load balancing.
TEST_COSTS = CostModel(prefill_per_token=1e-3, cpu_per_token=6e-6, disk_per_token=3e-5,
                       queue_per_request=1e-4)


# -- an in-process router on a shared event loop thread ---------------------------------------

@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, name="router-loop", daemon=True)
    thread.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    thread.join(5)


class RouterHandle:
    def __init__(self, lp: asyncio.AbstractEventLoop, config: RouterConfig) -> None:
        self.loop = lp
        self.server = RouterServer(config, host="127.0.0.1", port=0)
        self.port = self.call(self.server.start())
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_pods(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.server.router.registry.eligible()) >= n:
                return
            time.sleep(0.05)
        raise TimeoutError(f"router sees {len(self.server.router.registry.eligible())} pods")

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.server.metrics.registry.get_sample_value(name, labels or {})
        return value or 0.0

    def close(self) -> None:
        self.channel.close()
        self.call(self.server.stop(0.2))


@pytest.fixture
def make_router(loop: asyncio.AbstractEventLoop) -> Iterator[Callable[..., RouterHandle]]:
    made: list[RouterHandle] = []

    def make(redis_url: str, **overrides: Any) -> RouterHandle:
        cfg = RouterConfig(redis_url=redis_url, refresh_interval_s=0.1,
                           namespace_check_interval_s=0.3, costs=TEST_COSTS)
        handle = RouterHandle(loop, replace(cfg, **overrides))
        made.append(handle)
        return handle

    yield make
    for handle in made:
        handle.close()


def tokens_req(ids: list[int], salt: str = "", max_tokens: int = 2) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), cache_salt=salt,
                              sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                         temperature=0.0, ignore_eos=True))


# -- fake pods: a real gRPC server and a real IndexPublisher, no model ------------------------

class FakePod(pb_grpc.GenerationServicer):
    """Caches every full block it is sent (in a dict) and publishes it like a pod does."""

    def __init__(self, pod_id: str, redis_url: str, schema: IndexSchema = SCHEMA) -> None:
        self.pod_id = pod_id
        self.schema = schema
        self.mode = "ok"  # ok | unavailable | invalid | exhausted | slow
        self.calls = 0
        self.cancelled = threading.Event()
        self.state: dict[bytes, str] = {}
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(8))
        pb_grpc.add_GenerationServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()
        self.publisher = IndexPublisher(
            redis_url, schema, pod_id, self.address, schema.hash_config(),
            load_fn=lambda: {"waiting": 0, "running": 0, "free_blocks": 100,
                             "num_blocks": 100},
            full_state_fn=self._snapshot, tier_costs_fn=lambda: {"prefill": 1e-3},
            lease_ttl_s=1.0)
        assert self.publisher.start()

    def _snapshot(self) -> dict[bytes, str]:
        with self._lock:
            return dict(self.state)

    def _serve(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.Usage:
        self.calls += 1
        if self.mode == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.pod_id} is draining")
        if self.mode == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens=100000 exceeds room")
        if self.mode == "exhausted":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (8 requests)")
        ids = list(request.token_ids.ids)
        lora = (str(request.lora_id), "") if request.HasField("lora_id") else None
        cfg = HashConfig(self.schema.hash_algo, self.schema.hash_seed)
        hashes = hash_prompt(cfg, BS, ids, request.cache_salt or None, lora)
        with self._lock:
            hit = 0
            for h in hashes[:(len(ids) - 1) // BS]:
                if h not in self.state:
                    break
                hit += 1
            new = [h for h in hashes if h not in self.state]
            self.state.update(dict.fromkeys(new, "GPU"))
        if new:
            self.publisher.submit([BlockStored(new, None, [], BS)])
        return pb.Usage(prompt_tokens=len(ids), completion_tokens=2, cached_tokens=hit * BS,
                        cached_tokens_gpu=hit * BS)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                 ) -> pb.GenerateResponse:
        usage = self._serve(request, context)
        return pb.GenerateResponse(request_id=request.request_id or "r", usage=usage,
                                   completions=[pb.Completion(index=0, token_ids=[1, 2])],
                                   served_by=self.pod_id)

    def GenerateStream(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                       ) -> Iterator[pb.GenerateChunk]:
        usage = self._serve(request, context)
        if self.mode == "slow":
            for _ in range(200):  # at most 10 s
                if not context.is_active():
                    self.cancelled.set()
                    return
                yield pb.GenerateChunk(index=0, token_ids=[7])
                time.sleep(0.05)
        yield pb.GenerateChunk(index=0, token_ids=[1])
        yield pb.GenerateChunk(index=0, token_ids=[2], usage=usage, served_by=self.pod_id,
                               finish_reason=pb.FINISH_REASON_LENGTH)

    def close(self) -> None:
        self.publisher.stop(clear=True)
        self.server.stop(0)


@pytest.fixture
def fake_pods(redis_server: RedisProcess) -> Iterator[list[FakePod]]:
    pods = [FakePod(f"fake-{c}", redis_server.url) for c in "abc"]
    yield pods
    for pod in pods:
        pod.close()


def test_routes_by_prefix_and_reports_why(redis_server, fake_pods, make_router) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    system = [256] + [random.Random(1).randrange(256) for _ in range(511)]  # 32 blocks
    first = router.stub.Generate(tokens_req(system + [1, 2, 3]))
    home = first.served_by
    assert first.routing.chosen_pod == home and first.routing.prompt_blocks == 32
    assert {c.pod_id for c in first.routing.candidates} == {"fake-a", "fake-b", "fake-c"}
    # Siblings right away (burst prediction) and after the index caught up: same pod.
    for i in range(6):
        resp = router.stub.Generate(tokens_req(system + [10 + i] * 20))
        assert resp.served_by == home and resp.routing.chosen_pod == home
        assert resp.usage.cached_tokens == 512
        assert resp.routing.predicted_cached_tokens == 512
        assert resp.routing.reason in ("prefix_hit", "burst_prediction")
        if i == 0:
            time.sleep(0.3)  # let the publisher's batch land
    chunks = list(router.stub.GenerateStream(tokens_req(system + [99] * 5)))
    assert chunks[-1].served_by == home and chunks[-1].routing.chosen_pod == home
    assert not chunks[0].HasField("routing")
    # The text form is tokenized by the router with the pods' byte tokenizer.
    text = "You are a helpful assistant. " * 20
    a = router.stub.Generate(pb.GenerateRequest(text=text + "Q1"))
    b = router.stub.Generate(pb.GenerateRequest(text=text + "Q2"))
    assert a.served_by == b.served_by and b.usage.cached_tokens >= 16 * ((len(text) + 1) // 16)
    _, call = router.stub.Generate.with_call(tokens_req([5] * 40))
    overhead = dict(call.trailing_metadata())[OVERHEAD_METADATA_KEY]
    assert int(overhead) > 0
    assert router.metric("pagekv_router_requests_total",
                         {"pod": home, "reason": "prefix_hit"}) >= 1
    assert router.metric("pagekv_router_actual_cached_tokens_sum") >= 6 * 512


def test_salt_separates_tenants(redis_server, fake_pods, make_router) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    prompt = list(range(1, 200))
    home = router.stub.Generate(tokens_req(prompt, salt="tenant-1")).served_by
    time.sleep(0.2)
    other = router.stub.Generate(tokens_req(prompt, salt="tenant-2"))
    assert other.usage.cached_tokens == 0 and other.routing.predicted_cached_tokens == 0
    again = router.stub.Generate(tokens_req(prompt, salt="tenant-1"))
    assert again.served_by == home and again.usage.cached_tokens == 192


def test_unavailable_pod_is_retried_on_the_next_best(redis_server, fake_pods, make_router
                                                     ) -> None:
    router = make_router(redis_server.url, unavailable_cooldown_s=0.0)
    router.wait_pods(3)
    retries = 0
    for i, call in enumerate((router.stub.Generate,
                              lambda r: list(router.stub.GenerateStream(r))[-1])):
        prompt = list(range(1 + i, 100 + i))  # held by one pod only: it is the first choice
        for pod in fake_pods:
            pod.mode = "ok"
        home = router.stub.Generate(tokens_req(prompt)).served_by
        next(p for p in fake_pods if p.pod_id == home).mode = "unavailable"
        resp = call(tokens_req(prompt))
        assert resp.served_by != home
        assert resp.routing.reason == "retry_after_unavailable"
        retries += router.metric("pagekv_router_retries_total", {"pod": home})
    assert retries == 2
    pod = next(p for p in fake_pods if p.mode == "unavailable")
    home = pod.pod_id
    # With a cooldown, the failed pod is tried last for a while instead of first every time.
    router.server.router.config.unavailable_cooldown_s = 5.0
    for pod_ in fake_pods:
        pod_.mode = "unavailable" if pod_ is pod else "ok"
    served = []
    for i in range(6):  # cold prompts: without the cooldown, rotation would pick it again
        served.append(router.stub.Generate(tokens_req([i + 1] * 40)).served_by)
    assert home not in served


@pytest.mark.parametrize("mode, code, needle", [
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "exceeds room"),
    ("exhausted", grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
])
def test_client_errors_pass_through(redis_server, fake_pods, make_router, mode, code, needle
                                    ) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    for pod in fake_pods:
        pod.mode = mode
    for call in (router.stub.Generate, lambda r: list(router.stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as err:
            call(tokens_req(list(range(1, 50))))
        assert err.value.code() == code and needle in err.value.details()
    assert sum(p.calls for p in fake_pods) == 2  # no retry for the client's own errors


def test_router_rejects_an_empty_prompt(redis_server, fake_pods, make_router) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    with pytest.raises(grpc.RpcError) as err:
        router.stub.Generate(pb.GenerateRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sum(p.calls for p in fake_pods) == 0


def test_cancelling_a_stream_cancels_the_pod_call(redis_server, fake_pods, make_router
                                                  ) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    for pod in fake_pods:
        pod.mode = "slow"
    call = router.stub.GenerateStream(tokens_req(list(range(1, 40))))
    next(call)
    call.cancel()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(p.cancelled.is_set() for p in fake_pods):
        time.sleep(0.05)
    assert any(p.cancelled.is_set() for p in fake_pods)
    assert router.metric("pagekv_router_inflight_requests") == 0


def test_no_live_pods_is_unavailable_with_a_reason(redis_server, make_router) -> None:
    router = make_router(redis_server.url)
    router.call(router.server.wait_ready(5))
    with pytest.raises(grpc.RpcError) as err:
        router.stub.Generate(tokens_req([1, 2, 3]))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no live pods" in err.value.details() and SCHEMA.namespace in err.value.details()


def test_redis_down_routes_by_load_then_recovers(redis_server, fake_pods, make_router,
                                                 caplog) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    prompt = list(range(1, 100))
    router.stub.Generate(tokens_req(prompt))
    with caplog.at_level(logging.WARNING, logger="router.pods"):
        redis_server.stop()
        served = set()
        for i in range(9):
            resp = router.stub.Generate(tokens_req(prompt + [i]))
            served.add(resp.served_by)
            if i == 0:
                time.sleep(0.3)  # the refresh loop notices too
        assert resp.routing.reason == "index_down_least_loaded"
        assert served == {"fake-a", "fake-b", "fake-c"}  # spread, not stuck
        assert router.metric("pagekv_router_fallback_routes_total", {"cause": "index_down"}) > 0
        assert router.metric("pagekv_router_index_up") == 0
        down = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down) == 1, [r.getMessage() for r in down]  # once per outage
        redis_server.start()  # same port, empty: the pods republish
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and router.metric("pagekv_router_index_up") < 1:
            time.sleep(0.1)
        assert router.metric("pagekv_router_index_up") == 1
    for pod in fake_pods:
        assert pod.publisher.flush(5)
    fresh = list(range(300, 400))
    first = router.stub.Generate(tokens_req(fresh))
    time.sleep(0.3)
    resp = router.stub.Generate(tokens_req(fresh))
    assert resp.routing.reason in ("prefix_hit", "burst_prediction")
    assert resp.served_by == first.served_by and resp.usage.cached_tokens == 96
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_mismatched_pod_config_is_refused_once(redis_server, fake_pods, make_router,
                                               caplog) -> None:
    # A pod whose registration claims another seed inside our namespace (a misconfigured
    # publisher): never routed to, one warning naming the difference.
    client = redis.Redis.from_url(redis_server.url)
    client.hset(SCHEMA.pod_key("fake-c"), "cfg.hash_seed", "other-seed")
    with caplog.at_level(logging.WARNING, logger="router.pods"):
        router = make_router(redis_server.url)
        router.wait_pods(2)
        for i in range(6):
            resp = router.stub.Generate(tokens_req(list(range(i, i + 60))))
            assert resp.served_by != "fake-c"
        time.sleep(0.3)  # several refreshes
    warnings = [r.getMessage() for r in caplog.records if "fake-c" in r.getMessage()]
    assert len(warnings) == 1 and "hash_seed differs" in warnings[0]
    c = next(c for c in resp.routing.candidates if c.pod_id == "fake-c")
    assert not c.eligible and "hash_seed" in c.excluded_reason


def test_dead_pod_is_reaped_from_the_index(redis_server, fake_pods, make_router,
                                           caplog) -> None:
    client = redis.Redis.from_url(redis_server.url)
    router = make_router(redis_server.url, reap_dead_after_s=0.5)
    router.wait_pods(3)
    for i in range(6):  # spread some prefixes over the pods
        router.stub.Generate(tokens_req(list(range(i * 50, i * 50 + 48))))
    for pod in fake_pods:
        assert pod.publisher.flush(5)
    crashed = fake_pods[0]
    claims = client.scard(SCHEMA.pod_blocks_key(crashed.pod_id))
    assert claims > 0
    with caplog.at_level(logging.WARNING, logger="router.pods"):
        crashed.publisher.stop(clear=False)  # a crash: its keys stay, its lease runs out
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and client.sismember(SCHEMA.pods_key,
                                                               crashed.pod_id):
            time.sleep(0.1)
    assert not client.exists(SCHEMA.pod_key(crashed.pod_id),
                             SCHEMA.pod_blocks_key(crashed.pod_id))
    assert not any(client.hexists(k, crashed.pod_id) for k in client.scan_iter("*:b:*"))
    assert client.scard(SCHEMA.pod_blocks_key(fake_pods[1].pod_id)) > 0  # the others stay
    assert router.metric("pagekv_router_reaped_pods_total") == 1
    assert router.metric("pagekv_router_reaped_claims_total") == claims
    lines = [r.getMessage() for r in caplog.records if "no lease" in r.getMessage()]
    assert len(lines) == 1 and f"removed its {claims} block claims" in lines[0]


def test_policies_round_robin_and_random(redis_server, fake_pods, make_router) -> None:
    rr = make_router(redis_server.url, policy="round_robin")
    rr.wait_pods(3)
    prompt = list(range(1, 100))
    served = [rr.stub.Generate(tokens_req(prompt)).served_by for _ in range(6)]
    assert served[:3] == served[3:] and len(set(served)) == 3
    rnd = make_router(redis_server.url, policy="random", random_seed=3)
    rnd.wait_pods(3)
    assert {rnd.stub.Generate(tokens_req(prompt)).served_by for _ in range(20)} == {
        "fake-a", "fake-b", "fake-c"}


# -- real pods as processes ------------------------------------------------------------------

POD_ARGS = ["--num-gpu-blocks", "160", "--max-model-len", "2048", "--lease-ttl-s", "1.5",
            "--cpu-offload-bytes", "8MiB", "--max-num-batched-tokens", "2048"]
OTHER_SEED = "seed-2"


@pytest.fixture(scope="module")
def cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """node-a and node-b share the router's hash config; node-c has another seed."""
    from deploy.local_cluster import LocalCluster, wait_healthy

    run_dir = tmp_path_factory.mktemp("router-run")
    rp = RedisProcess(data_dir=run_dir / "redis", binary=redis_binary).start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # three pods on two cores: no oversubscription
        cluster = LocalCluster(nodes=0, run_dir=run_dir, redis_url=rp.url,
                               node_args=POD_ARGS, start_router=False)
        try:
            for pod_id in ("node-a", "node-b"):
                cluster.start_pod(pod_id)
            cluster.start_pod("node-c", ["--hash-seed", OTHER_SEED])
            for child in cluster.children:
                wait_healthy(child.address, 120, child.proc)
        except BaseException:
            cluster.stop()
            rp.close()
            raise
    try:
        yield cluster
    finally:
        cluster.stop()
        rp.close()


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
    with caplog.at_level(logging.WARNING, logger="router.pods"):
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
