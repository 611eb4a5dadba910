"""Several routers over one real Redis share their burst predictions (--shared-bursts,
issue #19): siblings of a prompt that arrive at different routers before the pod has
published the prefix still meet on the pod that got the first one. The fake pods here
publish late (a slow publisher), so during a run every hit comes from predictions. Cold
prompts are placed least-loaded: the default rendezvous hash sends a new prefix to one pod
from every router already, so it would hide what the shared predictions do. Index side:
test_index_predictions.py. Fixtures: conftest.py; helpers: router_fixtures.py.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from bench.routing_workloads import QUICK, group_requests
from tests.integration.router_fixtures import FakePod, RouterHandle, tokens_req

pytestmark = pytest.mark.integration

# Groups of siblings sharing a 16-block prefix; each group's requests in a row (a burst).
WORKLOAD = replace(QUICK, groups=12, prompts_per_group=6, prefix_tokens=256, suffix_tokens=24)
WRITTEN = "pagekv_router_shared_predictions_total"


@pytest.fixture
def slow_pods(redis_server) -> Iterator[list[FakePod]]:
    """Three pods whose blocks reach the index only after every test here has ended."""
    pods = [FakePod(f"fake-{c}", redis_server.url, publish_delay_s=600.0) for c in "abc"]
    yield pods
    for pod in pods:
        pod.close()


def routers(make_router, url: str, n: int, shared: bool) -> list[RouterHandle]:
    made = [make_router(url, cold_placement="least_loaded", shared_bursts=shared)
            for _ in range(n)]
    for r in made:
        r.wait_pods(3)
    return made


def sibling_hit_rate(via: list[RouterHandle], seed: int) -> float:
    """The grouped workload, each request through a router picked at random (clients spread
    over the routers' addresses; a strict rotation would keep the routers' tie-breaks in
    step, which independent routers are not): the share of siblings served by the pod that
    served their group's first request."""
    rng = random.Random(seed)
    home: dict[int, str] = {}
    hits = siblings = 0
    for group, ids in group_requests(WORKLOAD, seed, bursts=True):
        served = rng.choice(via).stub.Generate(tokens_req(ids)).served_by
        if group not in home:
            home[group] = served
        else:
            siblings += 1
            hits += served == home[group]
    return hits / siblings


def test_three_routers_sharing_bursts_keep_one_routers_hit_rate(redis_server, slow_pods,
                                                                make_router) -> None:
    url = redis_server.url
    one = sibling_hit_rate(routers(make_router, url, 1, shared=True), seed=1)
    shared = sibling_hit_rate(routers(make_router, url, 3, shared=True), seed=2)
    alone = sibling_hit_rate(routers(make_router, url, 3, shared=False), seed=3)
    print(f"sibling hit rate: 1 router {one:.2f}, 3 sharing {shared:.2f}, 3 not {alone:.2f}")
    assert one >= 0.9  # the local predictions alone: the pods have published nothing
    assert shared >= one - 0.05
    assert alone <= one - 0.25  # without sharing the siblings scatter


def test_a_dispatch_through_one_router_is_predicted_by_another(redis_server, slow_pods,
                                                               make_router) -> None:
    first_router, other, off = routers(make_router, redis_server.url, 2, shared=True) + \
        routers(make_router, redis_server.url, 1, shared=False)
    (_, a), (_, b) = group_requests(WORKLOAD, 4, bursts=True)[:2]
    home = first_router.stub.Generate(tokens_req(a)).served_by
    deadline = time.monotonic() + 5
    while first_router.metric(WRITTEN, {"result": "written"}) < 1:
        assert time.monotonic() < deadline, "the prediction was never written"
        time.sleep(0.01)
    blocks = (len(b) - 1) // 16
    for router, predicted in ((other, True), (off, False)):
        r = router.server.router
        decision = router.call(r.decide(r.prepare(tokens_req(b))))
        got = {s.pod_id: (s.cached_tokens, s.from_burst) for s in decision.scores}
        if predicted:  # the shared prefix, as the pod will hold it
            assert decision.reason == "burst_prediction"
            assert got[home] == (WORKLOAD.prefix_tokens, True) and decision.order[0].pod_id == home
        else:
            assert all(v == (0, False) for v in got.values()), got
        assert blocks > WORKLOAD.prefix_tokens // 16  # b's own blocks are not predicted
    assert first_router.metric(WRITTEN, {"result": "error"}) == 0
