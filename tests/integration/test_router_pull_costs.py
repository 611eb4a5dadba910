"""A pod's measured pull costs per holder through a real Redis (#28): what the engine's model
(kvnode/engine/pull_costs.py) publishes in the pod's record is what the index reads back, a
new fit reaches the index with the next lease renewal, the router derives each pair's
crossover from it (pagekv_router_pull_crossover_tokens), and a forged per-holder figure is
skipped and counted while the pod stays routed to. Pure logic: tests/unit/
test_pull_costs.py and test_router_pull_crossover.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from pagekv.kvnode.engine.pull_costs import PeerPullCosts
from pagekv.kvnode.index.publisher import IndexPublisher
from pagekv.proto.index.queries import list_live_pods
from pagekv.proto.pull_cost import PullCost
from tests.integration.router_fixtures import SCHEMA, tokens_req

pytestmark = pytest.mark.integration

LENGTHS = (128, 512, 1024, 2048)
PROMPT = list(range(3, 3 + 16 * 6 + 5))


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or cond}")
        time.sleep(0.02)


def measured(model: PeerPullCosts, holder: str, fixed: float, per_token: float) -> None:
    for n in LENGTHS:
        model.note(holder, n, fixed + n * per_token)


@pytest.fixture
def publish() -> Iterator[Callable[..., IndexPublisher]]:
    """A pod registration whose cost map is `costs()` (a puller pod's, as the engine's)."""
    started: list[IndexPublisher] = []

    def _publish(url: str, pod_id: str, address: str, costs: Callable[[], dict[str, float]]
                 ) -> IndexPublisher:
        pub = IndexPublisher(url, SCHEMA, pod_id, address, SCHEMA.hash_config(),
                             load_fn=lambda: {"waiting": 0, "running": 0, "free_blocks": 100},
                             full_state_fn=dict, tier_costs_fn=costs, lease_ttl_s=1.0,
                             flush_interval_s=0.01)
        started.append(pub)
        assert pub.start(timeout=10)
        return pub

    yield _publish
    for pub in started:
        pub.stop(clear=True, timeout=2)


def test_the_published_fit_is_read_back_and_follows_new_pulls(redis_server, publish) -> None:
    model = PeerPullCosts()
    measured(model, "pod-b", 0.02, 5e-5)
    measured(model, "pod.c", 0.1, 2e-4)  # a pod id with dots: the key's rest is the id
    publish(redis_server.url, "pod-a", "127.0.0.1:5999",
            lambda: {"prefill": 1e-3, **model.cost_map()})
    client = redis.Redis.from_url(redis_server.url)
    (info,) = list_live_pods(client, SCHEMA)
    assert info.pull_costs == model.costs()
    assert info.pull_costs["pod-b"].fixed_s == pytest.approx(0.02)
    assert info.pull_costs["pod.c"].per_token_s == pytest.approx(2e-4)
    assert set(info.tier_costs) == {"prefill", "peer"}
    # The link to pod-b got slower: the next renewal publishes the new fit.
    measured(model, "pod-b", 0.3, 5e-4)
    measured(model, "pod-b", 0.3, 5e-4)
    measured(model, "pod-b", 0.3, 5e-4)
    slower = model.cost("pod-b")
    assert slower is not None and slower.per_token_s > 1e-4

    def read_back() -> PullCost | None:
        (pod,) = list_live_pods(client, SCHEMA)
        return pod.pull_costs.get("pod-b")

    wait_until(lambda: read_back() == slower, what="the new fit in the index")
    client.close()


def _forge(url: str, pod_id: str, address: str, costs: dict[str, str]) -> None:
    """A registration written by hand (as anyone who reaches Redis could)."""
    r: Any = redis.Redis.from_url(url)
    record = {"epoch": "forged0001", "updated": str(time.time()), "address": address,
              **{f"cfg.{k}": v for k, v in SCHEMA.hash_config().items()},
              "load.waiting": "0", "load.running": "0", "load.free_blocks": "100", **costs}
    r.sadd(SCHEMA.pods_key, pod_id)
    r.hset(SCHEMA.pod_key(pod_id), mapping=record)
    r.set(SCHEMA.lease_key(pod_id), "forged0001", px=60_000)
    r.close()


def test_the_router_exports_the_crossover_of_what_a_pod_measured(
        redis_server, fake_pods, make_router, publish) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    model = PeerPullCosts()
    measured(model, "fake-b", 0.05, 1e-4)  # crossover 0.05 / (1e-3 - 1e-4) = 55.6 tokens
    measured(model, "fake-c", 0.0, 2e-3)   # slower than recomputing: never
    # Reached at a fake pod's address, so calls routed to it are served.
    publish(redis_server.url, "puller", fake_pods[0].address,
            lambda: {"prefill": 1e-3, **model.cost_map()})
    router.wait_pods(4)
    for i in range(3):
        router.stub.Generate(tokens_req(PROMPT + [i]), timeout=10)
        time.sleep(0.15)  # past the router's refresh interval: the crossovers are exported

    def crossover(pod: str, peer: str) -> float:
        return router.metric("pagekv_router_pull_crossover_tokens", {"pod": pod, "peer": peer})

    assert crossover("puller", "fake-b") == pytest.approx(0.05 / (1e-3 - 1e-4), rel=1e-6)
    assert crossover("puller", "fake-c") == float("inf")
    # fake-a measured nothing and publishes no peer figure: the configured one, no fixed
    # part, for any peer (one series, not one per peer).
    assert crossover("fake-a", "*") == 0.0
    assert router.metric("pagekv_router_index_bad_records_total", {"reason": "bad_cost"}) == 0


@pytest.mark.parametrize("costs", [
    {"cost.peer.fake-b": "nan", "cost.peer_fixed.fake-b": "0.01"},
    {"cost.peer.fake-b": "1e-4", "cost.peer_fixed.fake-b": "-1"},
    {"cost.peer.fake-b": "1e308", "cost.peer_fixed.fake-b": "0.01"},
    {"cost.peer.fake-b": "1e-4"},
])
def test_a_forged_holder_figure_is_skipped_and_counted(redis_server, fake_pods, make_router,
                                                       costs) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    _forge(redis_server.url, "forged", fake_pods[0].address, costs)
    router.wait_pods(4)
    wait_until(lambda: router.metric("pagekv_router_index_bad_records_total",
                                     {"reason": "bad_cost"}) >= 1, what="a bad_cost count")
    for i in range(4):
        assert router.stub.Generate(tokens_req(PROMPT + [i]), timeout=10).served_by
    pods = router.server.router.registry.pods
    assert pods["forged"].eligible and pods["forged"].info.pull_costs == {}
    assert router.metric("pagekv_router_index_up") == 1
