"""The router against real pods that hang (SIGSTOP), issue #27 finding 6: a call on a pod that
stops before it answers is moved to the next-best pod within the stall bound, with the tokens
of a cold run; the stopped pod cools (tried last) and is chosen again once it is resumed and
its cooldown is over; a stream whose pod stops mid-way ends UNAVAILABLE naming the stall,
well before the client's deadline; with no stall bound at all, the pod channels' keepalive
notices a stopped pod; and the pods accept those pings on an idle channel.

Two pods (processes) and Redis serve the module; the router runs in-process (make_router).
The pods' leases are long, so a stopped pod stays listed: only the router's own handling keeps
calls off it (with the default 3 s lease it would also drop out once the lease ran out).
"""

from __future__ import annotations

import os
import signal
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
from pagekv.router.pods import keepalive_options
from tests.integration.router_fixtures import BS, SCHEMA, SEED, pod_cluster, stopped, tokens_req
from tests.integration.test_router_real_pods import random_tokens, reset_all

pytestmark = pytest.mark.integration

POD_ARGS = ["--num-gpu-blocks", "160", "--max-model-len", "2048", "--lease-ttl-s", "60",
            "--max-num-batched-tokens", "2048"]
DEADLINE_S = 20.0  # the client's: every rescue below must come well within it
# Bounds for a tiny model on shared CPUs: a stopped pod is given up on after ~1-2 s.
STALL = {"pod_stall_floor_s": 1.5, "pod_stall_factor": 2.0, "pod_stall_cap_s": 4.0,
         "pod_stall_cooldown_s": 3.0}
PROMPT = 320  # tokens: 20 blocks, so the pod that holds them is the clear first choice


@pytest.fixture(scope="module")
def cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    run_dir = tmp_path_factory.mktemp("hung-pods")
    with pod_cluster(redis_binary, run_dir, POD_ARGS, {"node-a": [], "node-b": []}) as cluster:
        yield cluster


def cold_run_on(cluster: Any, pod: Any, ids: list[int], max_tokens: int) -> list[int]:
    """Serve `ids` on `pod` itself (a cold run: its greedy tokens are the reference), then
    wait until the index lists the pod holding the prompt's blocks."""
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(pod.address))
    resp = stub.Generate(tokens_req(ids, max_tokens=max_tokens), timeout=60)
    assert resp.usage.cached_tokens == 0
    hashes = hash_prompt(HashConfig("sha256", SEED), BS, ids)[:(len(ids) - 1) // BS]
    client = redis.Redis.from_url(cluster.redis_url)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        match = lookup_prefix(client, SCHEMA, hashes).get(pod.name)
        if match and len(match.tiers) == len(hashes):
            return list(resp.completions[0].token_ids)
        time.sleep(0.05)
    raise AssertionError(f"the index never listed {pod.name} holding the prompt")


@pytest.fixture
def pods(cluster: Any) -> tuple[Any, Any]:
    reset_all(cluster)
    a, b = cluster.pods
    return a, b


def stream_tokens(chunks: list[pb.GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.mark.parametrize("kind", ["stream", "unary"])
def test_a_call_on_a_stopped_pod_is_served_by_the_other(cluster, pods, make_router, kind
                                                        ) -> None:
    a, b = pods
    router = make_router(cluster.redis_url, **STALL)
    router.wait_pods(2)
    seed = 10 if kind == "stream" else 20
    first, second, later, probe = (random_tokens(seed + i, PROMPT) for i in range(4))
    want = {i: cold_run_on(cluster, a, ids, 6)
            for i, ids in enumerate((first, second, later, probe))}

    def call(ids: list[int]) -> tuple[str, str, list[int]]:
        req = tokens_req(ids, max_tokens=6)
        if kind == "stream":
            chunks = list(router.stub.GenerateStream(req, timeout=DEADLINE_S))
            return chunks[-1].served_by, chunks[-1].routing.reason, stream_tokens(chunks)
        resp = router.stub.Generate(req, timeout=DEADLINE_S)
        return resp.served_by, resp.routing.reason, list(resp.completions[0].token_ids)

    # Through the router while node-a is up: its channel is open, its step time measured.
    assert call(probe) == ("node-a", "prefix_hit", want[3])
    stalls = {"pod": "node-a", "phase": "first_chunk"}
    with stopped(a):
        t0 = time.monotonic()
        served_by, reason, tokens = call(first)  # node-a holds it: tried first
        took = time.monotonic() - t0
        assert (served_by, reason, tokens) == ("node-b", "retry_after_unavailable", want[0])
        assert took < DEADLINE_S / 3, f"rescued after {took:.1f} s"
        assert router.metric("pagekv_router_pod_stalls_total", stalls) == 1
        assert router.metric("pagekv_router_cooling_pods") == 1
        # Cooling: the next call goes to node-b at once, though only node-a holds its prompt.
        served_by, reason, tokens = call(second)
        assert (served_by, reason, tokens) == ("node-b", "best_pod_cooling_down", want[1])
        assert router.metric("pagekv_router_pod_stalls_total", stalls) == 1
    deadline = time.monotonic() + 10
    while router.metric("pagekv_router_cooling_pods") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert router.metric("pagekv_router_cooling_pods") == 0
    # Resumed and cooled down: node-a is chosen again for what it holds.
    assert call(later) == ("node-a", "prefix_hit", want[2])


def test_a_stream_whose_pod_stops_midway_ends_with_an_error(cluster, pods, make_router
                                                            ) -> None:
    a, _ = pods
    router = make_router(cluster.redis_url, **STALL)
    router.wait_pods(2)
    ids = random_tokens(30, PROMPT)
    cold_run_on(cluster, a, ids, 1)
    stream = router.stub.GenerateStream(tokens_req(ids, max_tokens=1500), timeout=DEADLINE_S)
    got = 0
    stopped_at = 0.0
    with pytest.raises(grpc.RpcError) as err:
        try:
            for _ in stream:
                got += 1
                if got == 3:
                    os.killpg(a.proc.pid, signal.SIGSTOP)
                    stopped_at = time.monotonic()
        finally:
            os.killpg(a.proc.pid, signal.SIGCONT)
    took = time.monotonic() - stopped_at
    assert stopped_at, "the stream ended before the pod could be stopped"
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "node-a stopped mid-stream" in err.value.details()
    assert took < DEADLINE_S / 3, f"ended {took:.1f} s after the stop"
    assert router.metric("pagekv_router_pod_stalls_total",
                         {"pod": "node-a", "phase": "mid_stream"}) == 1
    assert router.metric("pagekv_router_request_failures_total", {"code": "UNAVAILABLE"}) == 1


def test_keepalive_notices_a_stopped_pod_without_a_stall_bound(cluster, pods, make_router
                                                               ) -> None:
    a, _ = pods
    router = make_router(cluster.redis_url, pod_stall_floor_s=0.0, pod_keepalive_s=2.0,
                         pod_keepalive_timeout_s=1.0)
    router.wait_pods(2)
    warm, ids = random_tokens(40, PROMPT), random_tokens(41, PROMPT)
    cold_run_on(cluster, a, warm, 1)
    want = cold_run_on(cluster, a, ids, 6)
    # The router's channel to node-a is up (a call went there) when the pod stops.
    assert router.stub.Generate(tokens_req(warm, max_tokens=1), timeout=60).served_by == "node-a"
    with stopped(a):
        t0 = time.monotonic()
        resp = router.stub.Generate(tokens_req(ids, max_tokens=6), timeout=DEADLINE_S)
        took = time.monotonic() - t0
    assert resp.served_by == "node-b" and list(resp.completions[0].token_ids) == want
    assert resp.routing.reason == "retry_after_unavailable"
    assert took < DEADLINE_S / 2, f"rescued after {took:.1f} s"
    assert router.metric("pagekv_router_retries_total", {"pod": "node-a"}) == 1


def test_pods_accept_the_routers_keepalive_pings(pods) -> None:
    """An idle channel pinging every 2 s stays connected: a pod that refused the pings would
    answer the fourth with GOAWAY (too_many_pings) and the channel would drop to IDLE."""
    _, b = pods
    channel = grpc.insecure_channel(b.address, options=keepalive_options(2.0, 1.0))
    states: list[grpc.ChannelConnectivity] = []
    lock = threading.Lock()

    def seen(state: grpc.ChannelConnectivity) -> None:
        with lock:
            states.append(state)

    try:
        channel.subscribe(seen, try_to_connect=True)
        grpc.channel_ready_future(channel).result(timeout=10)
        time.sleep(11)
        with lock:
            after_ready = states[states.index(grpc.ChannelConnectivity.READY):]
        assert after_ready == [grpc.ChannelConnectivity.READY], after_ready
    finally:
        channel.unsubscribe(seen)
        channel.close()
