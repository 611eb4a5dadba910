"""The Redis index against a real redis-server and a real Redis Cluster (every test runs on
both, but the Redis restart's) through a pod's lifetime: its registration and lease, epochs
across restarts, a second instance under the same id, a clean stop, a dead pod reaped, the
publisher across a Redis restart (a primary's failover: test_index_cluster.py). Fixtures:
conftest.py (client, make_pod, index_redis); helpers: index_fixtures.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from pagekv.kvnode.index.publisher import IndexPublisher
from pagekv.proto.index import (
    IndexClient,
    IndexSchema,
    PodMatch,
    bucket_of,
    config_mismatch,
    connect_async,
    list_live_pods,
    lookup_prefix,
)
from pagekv.proto.kv_events import BlockRemoved, BlockStored
from pagekv.proto.medium import Medium
from tests.integration.index_fixtures import (
    SCHEMA,
    PodState,
    all_keys,
    by_field,
    chain,
    claim_id_of,
    claims_by_id,
    held,
    primaries,
)

pytestmark = pytest.mark.integration


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll for a state change; the deadline only bounds a hang, it decides nothing."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or cond}")
        time.sleep(0.02)


def test_live_pods_expose_address_load_config_and_costs(make_pod, client):
    make_pod("pod-a")
    (info,) = list_live_pods(client, SCHEMA)
    assert info.pod_id == "pod-a" and info.address.startswith("127.0.0.1:")
    assert (info.waiting, info.running, info.free_blocks) == (2, 3, 100)
    assert info.hash_config == SCHEMA.hash_config()
    assert config_mismatch(info, SCHEMA) is None
    assert info.tier_costs == {"GPU": 0.0, "CPU": 2e-6, "DISK": 5e-5}
    assert 0 < info.lease_ms <= 3000


def test_expired_lease_no_longer_counts(make_pod, client):
    pod = make_pod("pod-a", lease_ttl_s=0.3)
    blocks = chain(2)
    pod.store(blocks)
    assert pod.pub.flush()
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"].depth == 2
    pod.pub.stop(clear=False)  # a crash: nothing removed, the lease is just not renewed
    wait_until(lambda: not client.exists(SCHEMA.lease_key("pod-a")), what="lease expiry")
    assert held(client, "pod-a") == by_field(dict.fromkeys(blocks, Medium.GPU))  # claims remain
    assert lookup_prefix(client, SCHEMA, blocks) == {}
    assert list_live_pods(client, SCHEMA) == []


def test_restarted_pod_does_not_inherit_old_claims(make_pod, client):
    old = make_pod("pod-a")
    blocks = chain(4)
    old.store(blocks)
    assert old.pub.flush()
    old_epoch, old_id = old.pub.epoch, claim_id_of(client, "pod-a")
    old.pub.stop(clear=False)  # crashed; its lease is still alive for a while
    new = make_pod("pod-a", retire_after_s=0.3)
    new_id = claim_id_of(client, "pod-a")
    assert new.pub.epoch != old_epoch and new_id != old_id and new_id
    # The restarted pod holds nothing: the previous instance's claims carry its claim id,
    # which the registration no longer names.
    assert len(claims_by_id(client)[old_id]) == 4
    assert lookup_prefix(client, SCHEMA, blocks) == {"pod-a": PodMatch(0, [])}
    new.store(blocks[:3])
    assert new.pub.flush()
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"].depth == 3
    # And once no router can still count them, they are stripped and the id released.
    wait_until(lambda: old_id not in claims_by_id(client), what="the old claims' strip")
    assert client.smembers(SCHEMA.pod_claim_ids_key("pod-a")) == {new_id.hex().encode()}
    assert client.hkeys(SCHEMA.claim_ids_key) == [new_id.hex().encode()]
    assert held(client, "pod-a") == by_field(dict.fromkeys(blocks[:3], Medium.GPU))


def test_second_instance_supersedes_the_first(make_pod, client):
    first = make_pod("pod-a", lease_ttl_s=0.3)
    second = make_pod("pod-a")
    wait_until(lambda: first.pub.stats()["superseded"], what="first instance to step down")
    first.store(chain(2))  # ignored: it no longer owns the pod id
    second.store(chain(1))
    assert second.pub.flush()
    assert lookup_prefix(client, SCHEMA, chain(2))["pod-a"].depth == 1
    first.pub.stop(clear=True)  # must not wipe the owner's keys
    assert lookup_prefix(client, SCHEMA, chain(2))["pod-a"].depth == 1


def dump(r: Any) -> dict[bytes, object]:
    """Every key and its content, on every primary."""
    out: dict[bytes, object] = {}
    for key in all_keys(r):
        kind = r.type(key)
        if kind == b"hash":
            fields = r.hgetall(key)
            fields.pop(b"updated", None)  # the other pod's renewals keep moving these
            fields.pop(b"seq", None)
            out[key] = fields
        elif kind == b"set":
            out[key] = r.smembers(key)
        else:
            out[key] = r.get(key)
    return out


def test_stop_clear_removes_exactly_its_keys(make_pod, client):
    other = make_pod("pod-b")
    blocks = chain(5)
    other.store(blocks[:3])
    assert other.pub.flush()
    before = dump(client)
    mine = make_pod("pod-a")
    mine.store(blocks[1:5])
    mine.store(chain(2, "x"), medium="DISK")
    assert mine.pub.flush()
    assert dump(client) != before
    mine.pub.stop(clear=True)
    assert dump(client) == before
    assert lookup_prefix(client, SCHEMA, blocks) == {"pod-b": PodMatch(3, ["GPU"] * 3)}


def _run(method: str, url: str, schema: IndexSchema, *args: object) -> object:
    """Run one IndexClient coroutine on a fresh asyncio client (the router's kind)."""
    import asyncio

    async def go() -> object:
        index = IndexClient(connect_async(url, 5.0), schema)
        try:
            return await getattr(index, method)(*args)
        finally:
            await index.aclose()

    return asyncio.run(go())


def test_dead_pod_is_reaped_in_batches_leaving_others_exactly(make_pod, client, index_redis):
    other = make_pod("pod-b")
    blocks = chain(25)
    other.store(blocks[:10])
    assert other.pub.flush()
    before = dump(client)
    dead = make_pod("pod-a", lease_ttl_s=0.3)
    dead.store(blocks)
    dead.store(chain(9, "other-root"), medium="DISK")  # claims in a second bucket
    assert bucket_of(chain(1, "other-root")[0]) != bucket_of(blocks[0])
    assert dead.pub.flush()
    epoch = dead.pub.epoch
    dead.pub.stop(clear=False)  # a crash
    wait_until(lambda: not client.exists(SCHEMA.lease_key("pod-a")), what="lease expiry")
    url = index_redis.url
    assert _run("dead_pods", url, SCHEMA) == {"pod-a": epoch}
    removed = _run("reap_pod", url, SCHEMA, "pod-a", epoch)
    assert removed == 34
    assert dump(client) == before  # every key of pod-a gone, pod-b's untouched
    assert _run("dead_pods", url, SCHEMA) == {}


def test_reap_is_refused_once_the_pod_id_is_back(make_pod, client, index_redis):
    dead = make_pod("pod-a", lease_ttl_s=0.3)
    dead.store(chain(3))
    assert dead.pub.flush()
    epoch = dead.pub.epoch
    dead.pub.stop(clear=False)
    wait_until(lambda: not client.exists(SCHEMA.lease_key("pod-a")), what="lease expiry")
    back = make_pod("pod-a")  # restarted under the same id before the reaper ran
    back.store(chain(2))
    assert back.pub.flush()
    assert _run("reap_pod", index_redis.url, SCHEMA, "pod-a", epoch) is None
    assert lookup_prefix(client, SCHEMA, chain(3))["pod-a"].depth == 2


@pytest.mark.parametrize("index_redis", ["single"], indirect=True)
def test_publisher_survives_redis_restart_and_republishes(make_pod, redis_server, client):
    pod = make_pod("pod-a")
    pub = pod.pub
    blocks = chain(40)
    pod.store(blocks[:20])
    assert pub.flush()
    redis_server.stop()
    # The engine keeps running while the index is gone; submit must not block or raise.
    pod.store(blocks[20:30])
    pod.emit([BlockRemoved(blocks[:5]), BlockStored(blocks[:5], None, [], 16, medium="CPU")])
    pod.store(blocks[30:35], medium="DISK")
    wait_until(lambda: pub.stats()["errors"] >= 1, what="the publisher to notice")
    pod.store(blocks[35:38])
    assert pub.stats()["pending"] == 0  # deltas are dropped while disconnected
    redis_server.start()  # same port, empty
    wait_until(lambda: pub.stats()["connected"] and pub.stats()["reconnects"] >= 1,
               what="reconnect")
    assert pub.flush()
    assert held(client, "pod-a") == by_field(pod.full_state())
    stats = pub.stats()
    assert stats["republishes"] >= 2 and stats["events_dropped"] >= 1
    got = lookup_prefix(client, SCHEMA, blocks)["pod-a"]
    assert got.depth == 38
    assert got.tier_counts() == {"GPU": 28, "CPU": 5, "DISK": 5}
    assert [p.pod_id for p in list_live_pods(client, SCHEMA)] == ["pod-a"]


def test_claim_writes_survive_a_flushed_script_cache(make_pod, client):
    """Claims go through one Lua script per bucket: a Redis that forgot it (SCRIPT FLUSH,
    a restart the publisher did not notice) gets it loaded again, and nothing is lost."""
    pod = make_pod("pod-a")
    first, second = chain(3, "s1"), chain(2, "s2")
    pod.store(first)
    assert pod.pub.flush()
    for node in primaries(client):
        node.script_flush()
    pod.store(second, medium="CPU")
    pod.emit([BlockRemoved(first[2:], Medium.GPU)])
    assert pod.pub.flush()
    assert held(client, "pod-a") == by_field({
        **dict.fromkeys(first[:2], Medium.GPU), **dict.fromkeys(second, Medium.CPU)})


def test_a_driven_publisher_does_its_work_only_in_step(index_redis, client):
    """start(thread=False): the owner's loop calls step(); nothing is written between."""
    state = PodState()
    pub = IndexPublisher(index_redis.url, SCHEMA, "pod-d", "127.0.0.1:5999",
                         hash_config=SCHEMA.hash_config(), load_fn=dict,
                         full_state_fn=state.full_state, flush_interval_s=0.01)
    state.pub = pub
    woken: list[int] = []
    pub.on_wake = lambda: woken.append(1)
    try:
        assert pub.start(timeout=10, thread=False)
        blocks = chain(2, "d")
        state.store(blocks)
        time.sleep(0.1)
        assert held(client, "pod-d") == {}  # no thread wrote
        assert not woken  # a submit needs no wake: the owner steps after it
        wait = pub.step(write=True)
        assert 0 < wait <= pub.renew_interval_s
        assert held(client, "pod-d") == by_field(dict.fromkeys(blocks, Medium.GPU))
        pub.pause()
        assert woken  # another thread's request wakes the owner's loop
        pub.step()
        assert not client.exists(SCHEMA.lease_key("pod-d"))
        pub.resume()
        pub.step()
        assert held(client, "pod-d") == by_field(dict.fromkeys(blocks, Medium.GPU))
    finally:
        pub.stop(clear=True)
    assert not client.exists(SCHEMA.pod_key("pod-d"))


def test_a_republish_larger_than_one_round_trip_is_written_whole(make_pod, client,
                                                                  monkeypatch):
    """Claims go CLAIM_RECORDS a call and PIPELINE_CALLS calls a round trip: a republish of
    many times that (tiny bounds here) writes every claim, stale ones removed."""
    from pagekv.proto.index import writes

    monkeypatch.setattr(writes, "CLAIM_RECORDS", 4)
    monkeypatch.setattr(writes, "PIPELINE_CALLS", 3)
    pod = make_pod("pod-a")
    chains = [chain(7, f"r{i}") for i in range(6)]
    for blocks in chains:
        pod.store(blocks)
    assert pod.pub.flush()
    expected = {h: Medium.GPU for blocks in chains for h in blocks}
    assert held(client, "pod-a") == by_field(expected)
    pod.emit([BlockRemoved(chains[0], Medium.GPU)])
    assert pod.pub.flush()
    pod.pub._drop_pending()  # as after a lost connection: the full state again, in full
    wait_until(lambda: pod.pub.stats()["republishes"] >= 2, what="a republish")
    assert pod.pub.flush()
    expected = {h: Medium.GPU for blocks in chains[1:] for h in blocks}
    assert held(client, "pod-a") == by_field(expected)
