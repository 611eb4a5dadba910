"""The router against a real Redis and in-process fake pods: its routing decisions (prefix
affinity with the reasons it reports, tenant salts, the round-robin and random policies).
The router runs in-process on its own event loop thread; clients are plain synchronous gRPC
stubs. Fixtures: conftest.py; helpers: router_fixtures.py.
"""

from __future__ import annotations

import random
import time

import pytest

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.router.server import OVERHEAD_METADATA_KEY
from tests.integration.router_fixtures import tokens_req

pytestmark = pytest.mark.integration


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

