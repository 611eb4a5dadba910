"""The routers' shared burst predictions in the index, on a real redis-server and a real
Redis Cluster (every test runs on both): a prediction one router writes is what another's
lookup reads, in the same single EVALSHA to the chain's one shard; it extends a pod's
claimed prefix, expires after its TTL, counts only for live pods and keeps a bounded number
of pods per key. Fixtures: conftest.py; helpers: index_fixtures.py.
"""

from __future__ import annotations

import time

import pytest

from pagekv.proto.index import PodMatch, list_live_pods, lookup_prefix, queries
from pagekv.proto.index.queries import LivePods
from tests.integration.index_fixtures import SCHEMA, chain
from tests.integration.test_index_lookup import counting_from_now, evalsha_calls

pytestmark = pytest.mark.integration

# Live pods as a router passes them (registered, no claims written: none needed).
FAR = LivePods({"pod-a": b"\x02aaa", "pod-b": b"\x02bbb"})
MANY = LivePods({f"pod-{i}": bytes([2 + i]) * 4 for i in range(12)})
CLAIM_IDS = {**FAR, **MANY}


def predict(client, pod: str, blocks: list[bytes], start: int = 0, ttl_ms: int = 30_000,
            cap: int = 8, live: LivePods | None = None) -> int:
    """What a router's SharedBursts writes for `pod`: keyed by its claim id."""
    cid = (live or CLAIM_IDS)[pod]
    return queries.predict(SCHEMA, cid, blocks, start, ttl_ms, cap).run(client)


def test_a_prediction_is_read_by_the_next_lookup(client):
    blocks = chain(6, "p1")
    assert predict(client, "pod-a", blocks[:4]) == 4
    got = lookup_prefix(client, SCHEMA, blocks, FAR, predictions=True)
    assert got == {"pod-a": PodMatch(0, [], 4), "pod-b": PodMatch(0, [])}
    # A router that does not share bursts reads none.
    assert lookup_prefix(client, SCHEMA, blocks, FAR)["pod-a"] == PodMatch(0, [])
    # Only live pods count: a claim id the caller does not pass is never reported.
    assert lookup_prefix(client, SCHEMA, blocks, LivePods({"pod-b": FAR["pod-b"]}),
                         predictions=True) == {"pod-b": PodMatch(0, [])}
    # Nor a pod listed without a valid claim id (a garbled registration): it is unknown.
    assert lookup_prefix(client, SCHEMA, blocks, {"pod-a": "e2"}, predictions=True) == \
        {"pod-a": PodMatch(0, [])}
    # The key names the claim id, not the pod.
    assert client.hgetall(SCHEMA.chain_prediction_keys(blocks)[0]).keys() == {FAR["pod-a"]}


def test_predictions_extend_the_claimed_prefix(make_pod, client):
    pod = make_pod("pod-a")
    blocks = chain(8, "p2")
    pod.store(blocks[:3], medium="CPU")
    assert pod.pub.flush()
    live = LivePods.of(list_live_pods(client, SCHEMA))
    # What a router writes: the blocks past what the index confirms there.
    assert predict(client, "pod-a", blocks[:6], start=3, live=live) == 3
    got = lookup_prefix(client, SCHEMA, blocks, live, predictions=True)["pod-a"]
    assert got == PodMatch(3, ["CPU"] * 3, 6)
    # A run of predictions that does not start where the claims end adds nothing.
    other = chain(8, "p3")
    pod.store(other[:2])
    assert pod.pub.flush()
    predict(client, "pod-a", other[:6], start=3, live=live)
    assert lookup_prefix(client, SCHEMA, other, live, predictions=True)["pod-a"] == \
        PodMatch(2, ["GPU"] * 2)


def test_a_prediction_expires_after_its_ttl(client):
    blocks = chain(3, "p4")
    predict(client, "pod-a", blocks, ttl_ms=300)
    predict(client, "pod-b", blocks[:1], ttl_ms=30_000)
    assert lookup_prefix(client, SCHEMA, blocks, FAR, predictions=True)["pod-a"].predicted == 3
    time.sleep(0.4)
    got = lookup_prefix(client, SCHEMA, blocks, FAR, predictions=True)
    assert got == {"pod-a": PodMatch(0, []), "pod-b": PodMatch(0, [], 1)}
    # Keys expire with their last entry: nothing is left of pod-a's past block 0.
    keys = SCHEMA.chain_prediction_keys(blocks)
    assert [client.exists(k) for k in keys] == [1, 0, 0]
    assert 29_000 < client.pttl(keys[0]) <= 30_000


def test_a_key_keeps_at_most_the_cap_latest_pods(client):
    blocks = chain(2, "p5")
    live = MANY
    for pod in live:
        predict(client, pod, blocks, cap=4)
    got = lookup_prefix(client, SCHEMA, blocks, live, predictions=True)
    assert {p for p, m in got.items() if m.predicted} == {"pod-8", "pod-9", "pod-10", "pod-11"}
    assert client.hlen(SCHEMA.chain_prediction_keys(blocks)[0]) == 4


def test_write_and_lookup_are_one_round_trip_each_to_one_node(client):
    blocks = chain(16, "p6")
    counting, nodes = counting_from_now(client)
    predict(counting, "pod-a", blocks)
    got = lookup_prefix(counting, SCHEMA, blocks, FAR, predictions=True)
    assert got["pod-a"].predicted == 16
    assert counting.sent == ["EVALSHA", "EVALSHA"]
    assert evalsha_calls(nodes) == [0] * (len(nodes) - 1) + [2]  # both on the bucket's shard
    counting.close()
