"""The router against a real Redis and in-process fake pods: cold prompts placed by their
first block's rendezvous hash (--cold-placement hash), the same pod from every router, and
the old tie-breaks under --cold-placement least_loaded. Pure scoring:
tests/unit/test_router_cold_placement.py. Fixtures: conftest.py; helpers: router_fixtures.py.
"""

from __future__ import annotations

import random

import pytest

from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.router.placement import rendezvous_weight
from tests.integration.router_fixtures import BS, SCHEMA, tokens_req

pytestmark = pytest.mark.integration

PODS = ("fake-a", "fake-b", "fake-c")


def prompt(seed: int, tail: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(64)] + [tail] * 20


def rendezvous_pod(ids: list[int], salt: str = "") -> str:
    """Where a cold prompt should go, worked out apart from the router: the highest weight
    of its first (salted) block hash over the live pod ids."""
    first = hash_prompt(HashConfig(SCHEMA.hash_algo, SCHEMA.hash_seed), BS, ids, salt or None)[0]
    return max(PODS, key=lambda pod: rendezvous_weight(first, pod))


def test_cold_prompts_go_to_their_first_blocks_rendezvous_pod(redis_server, fake_pods,
                                                               make_router) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    served = []
    for seed in range(12):
        ids = prompt(seed)
        resp = router.stub.Generate(tokens_req(ids, salt="t1"))
        assert resp.routing.reason == "cold_spread"
        assert resp.served_by == rendezvous_pod(ids, "t1")
        served.append(resp.served_by)
    assert len(set(served)) > 1
    assert router.metric("pagekv_router_requests_total",
                         {"pod": served[0], "reason": "cold_spread"}) >= 1


def test_two_routers_send_a_new_prefix_and_its_sibling_to_one_pod(redis_server, fake_pods,
                                                                  make_router) -> None:
    # Without shared burst predictions (test_router_shared_bursts.py): the hash alone.
    one, two = (make_router(redis_server.url, shared_bursts=False) for _ in range(2))
    one.wait_pods(3)
    two.wait_pods(3)
    for seed in range(100, 106):
        first = one.stub.Generate(tokens_req(prompt(seed, 1)))
        # Right away through the other router: it has no burst prediction for this prefix,
        # and the index may not have it yet; the hash still agrees.
        sibling = two.stub.Generate(tokens_req(prompt(seed, 2)))
        assert sibling.served_by == first.served_by
        assert sibling.routing.reason in ("cold_spread", "prefix_hit")


def test_least_loaded_keeps_the_old_tie_breaks(redis_server, fake_pods, make_router) -> None:
    router = make_router(redis_server.url, cold_placement="least_loaded")
    router.wait_pods(3)
    reasons = {router.stub.Generate(tokens_req(prompt(200 + seed))).routing.reason
               for seed in range(6)}
    assert "cold_spread" not in reasons
    assert reasons <= {"tie_least_loaded", "tie_rotation", "least_cost"}
