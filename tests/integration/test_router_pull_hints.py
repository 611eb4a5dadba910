"""The router's pull option against a real Redis and in-process fake pods: Router.decide
over the real index (sources confirmed by the index only), and the kv_source each attempt
carries (set for the pod that pulls, cleared on a retry elsewhere, never the client's own).
Fixtures: conftest.py; helpers: router_fixtures.py. Pure scoring:
tests/unit/test_router_pull.py.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace

import pytest

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from tests.integration.router_fixtures import TEST_COSTS, tokens_req

pytestmark = pytest.mark.integration

BLOCKS = 32  # the shared prefix, in full blocks


def prompt(seed: int, tail: int) -> list[int]:
    rng = random.Random(seed)
    return [256] + [rng.randrange(256) for _ in range(BLOCKS * 16 - 1)] + [tail] * 20


def wait_held(router, request: pb.GenerateRequest, pod_id: str, timeout: float = 10.0):
    """Decide until the index confirms `pod_id` holding the whole shared prefix."""
    r = router.server.router
    prepared = r.prepare(request)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        decision = router.call(r.decide(prepared))
        held = {s.pod_id: s.cached_tokens for s in decision.scores}
        if held.get(pod_id) == BLOCKS * 16:
            return decision
        time.sleep(0.05)
    raise TimeoutError(f"the index never showed {pod_id} holding the prefix: {held}")


def home_of(router, seed: int) -> str:
    """Send the prefix once; its pod holds it in the index afterwards."""
    home = router.stub.Generate(tokens_req(prompt(seed, 1))).served_by
    wait_held(router, tokens_req(prompt(seed, 2)), home)
    return home


def busy(router, pod_id: str, n: int = 200) -> None:
    # The router's own calls in flight count as the pod's queue: the holder looks expensive.
    router.server.router.registry.pods[pod_id].inflight = n


def make(make_router, redis_server, **kw):
    # A fast peer (the fake pods publish none): pulling 512 tokens beats 200 queued calls.
    kw.setdefault("burst_ttl_s", 0.0)  # the index alone, no predictions
    router = make_router(redis_server.url, costs=replace(TEST_COSTS, peer_per_token=1e-5),
                         **kw)
    router.wait_pods(3)
    return router


def test_decide_offers_the_pull_from_the_index_confirmed_holder(redis_server, fake_pods,
                                                                make_router) -> None:
    router = make(make_router, redis_server)
    home = home_of(router, 1)
    busy(router, home)
    decision = wait_held(router, tokens_req(prompt(1, 3)), home)
    chosen = decision.order[0]
    assert chosen.pod_id != home and decision.reason == "peer_pull"
    assert (chosen.pull_from, chosen.pull_blocks, chosen.pull_tokens) == (home, BLOCKS,
                                                                          BLOCKS * 16)
    assert chosen.pull_address == router.server.router.registry.pods[home].info.address
    assert chosen.cached_tokens == 0 and chosen.pull_saving_s > 0
    assert all(s.pull_from == home for s in decision.scores if s.pod_id != home)
    # A holder cooling down after UNAVAILABLE is no source: the pull would fail too.
    router.server.router.registry.mark_unavailable(home, 30.0)
    cooling = wait_held(router, tokens_req(prompt(1, 3)), home)
    assert not any(s.pull_from for s in cooling.scores)
    router.server.router.registry.pods[home].unavailable_until = 0.0
    # The same index, pull off: today's decision, no option anywhere.
    plain = make(make_router, redis_server, kv_pull=False)
    busy(plain, home)
    off = wait_held(plain, tokens_req(prompt(1, 3)), home)
    assert off.order[0].pod_id == home and off.reason == "prefix_hit"
    assert not any(s.pull_from for s in off.scores)


def test_a_burst_predicted_holder_is_no_source(redis_server, fake_pods, make_router) -> None:
    router = make(make_router, redis_server, burst_ttl_s=30.0)
    r = router.server.router
    prepared = r.prepare(tokens_req(prompt(5, 1)))
    r.dispatched("fake-a", prepared)  # predicted there; the index has never seen it
    decision = router.call(r.decide(r.prepare(tokens_req(prompt(5, 2)))))
    held = {s.pod_id: (s.cached_tokens, s.from_burst) for s in decision.scores}
    assert held == {"fake-a": (BLOCKS * 16, True), "fake-b": (0, False), "fake-c": (0, False)}
    assert not any(s.pull_from for s in decision.scores)


def test_each_attempt_carries_its_own_pods_hint(redis_server, fake_pods, make_router,
                                                caplog) -> None:
    router = make(make_router, redis_server, unavailable_cooldown_s=0.0)
    pods = {p.pod_id: p for p in fake_pods}

    def fresh(seed: int) -> tuple[str, list[str]]:
        """A new prefix held by one pod only; every pod ok and its hints forgotten."""
        for p in pods.values():
            p.mode = "ok"
        home = home_of(router, seed)
        for p in pods.values():
            p.kv_sources.clear()
        return home, sorted(p for p in pods if p != home)

    # A client's own hint is replaced by the router's.
    home, others = fresh(2)
    busy(router, home)
    request = tokens_req(prompt(2, 4))
    request.kv_source.CopyFrom(pb.KvSource(pod_id="elsewhere", address="10.9.9.9:1",
                                           num_blocks=3))
    predicted = router.metric("pagekv_router_predicted_cached_tokens_sum")
    with caplog.at_level(logging.DEBUG, logger="pagekv.router.server"):
        resp = router.stub.Generate(request)
    puller = resp.served_by
    hints = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pull hint")]
    assert len(hints) == 1 and puller in hints[0] and home in hints[0]
    # The pod's usage will count the pulled tokens as cached: the prediction does too.
    assert router.metric("pagekv_router_predicted_cached_tokens_sum") == predicted + BLOCKS * 16
    assert puller in others
    assert pods[puller].kv_sources == [pb.KvSource(pod_id=home, address=pods[home].address,
                                                   num_blocks=BLOCKS)]
    assert resp.routing.reason == "peer_pull" and resp.routing.pull_from == home
    assert resp.routing.pull_tokens == BLOCKS * 16 and resp.routing.predicted_pull_saving_s > 0
    cand = {c.pod_id: c for c in resp.routing.candidates}
    assert cand[puller].pull_from == home and cand[home].pull_from == ""
    assert router.metric("pagekv_router_pull_hints_total") == 1
    busy(router, home, 0)

    # Both pods without the prefix fail, each with its own hint; then the holder gets none
    # (the one forwarded message must not carry the previous attempt's hint to it).
    home, others = fresh(3)
    busy(router, home)
    for p in others:
        pods[p].mode = "unavailable"
    chunks = list(router.stub.GenerateStream(tokens_req(prompt(3, 4))))
    assert chunks[-1].served_by == home
    assert chunks[-1].routing.reason == "retry_after_unavailable"
    assert chunks[-1].routing.pull_from == ""
    assert pods[home].kv_sources == [None]
    for p in others:
        assert [s.pod_id for s in pods[p].kv_sources] == [home]
    assert router.metric("pagekv_router_pull_hints_total") == 3
    busy(router, home, 0)

    # The holder first and UNAVAILABLE: the retry's option names it, so no hint goes out.
    home, others = fresh(4)
    pods[home].mode = "unavailable"
    request = tokens_req(prompt(4, 4))
    request.kv_source.CopyFrom(pb.KvSource(pod_id="elsewhere", address="10.9.9.9:1"))
    resp = router.stub.Generate(request)
    assert pods[home].kv_sources == [None]
    assert resp.served_by in others and resp.routing.pull_from == ""
    assert pods[resp.served_by].kv_sources == [None]
    cand = {c.pod_id: c for c in resp.routing.candidates}
    assert cand[resp.served_by].pull_from == home  # the option was there, the hint was not
    assert router.metric("pagekv_router_pull_hints_total") == 3
