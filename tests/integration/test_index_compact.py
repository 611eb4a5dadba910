"""The compact index (layout 2: one claims HASH per bucket, each block's field holding its
holders' packed (claim id, tier mask) entries) through its lifecycle, on a real redis-server
and a real Redis Cluster (every test runs on both): claims of two pods packed in one field,
a tier change rewriting one mask byte, a removal leaving the other pod's entry, claim ids
unique per registration, a republish after a flush, a dead pod reaped page by page, and
forged values in the packed HASH counted as bad records, never an error. The restart (new
claim id, the old claims ignored then stripped) and the failover are in
test_index_lifecycle.py and test_index_cluster.py. Fixtures: conftest.py; helpers:
index_fixtures.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from pagekv.proto.index import (
    IndexClient,
    IndexSchema,
    PodMatch,
    claim_field,
    config_mismatch,
    connect_async,
    count_pod_claims,
    list_live_pods,
    lookup_prefix,
    queries,
    writes,
)
from pagekv.proto.index.bad_records import BAD_CLAIM, WRONG_TYPE, BadRecords
from pagekv.proto.index.connect import is_cluster
from pagekv.proto.index.queries import LivePods
from pagekv.proto.index.schema import (
    CLAIM_ENTRY_BYTES,
    LAYOUT_FIELD,
    new_claim_id,
)
from pagekv.proto.kv_events import BlockRemoved, BlockStored
from pagekv.proto.medium import Medium
from tests.integration.index_fixtures import (
    SCHEMA,
    by_field,
    chain,
    claim_id_of,
    claims_by_id,
    held,
    primaries,
)

pytestmark = pytest.mark.integration

GPU, CPU, DISK = Medium.GPU.bit, Medium.CPU.bit, Medium.DISK.bit


def wait_until(cond: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or cond}")
        time.sleep(0.02)


def packed(client: Any, h: bytes, chain_root: bytes) -> bytes | None:
    """The claims field of block `h` (of the chain whose block 0 is `chain_root`)."""
    value = client.hget(SCHEMA.chain_claims_key([chain_root]), claim_field(h))
    return None if value is None else bytes(value)


def node_of(client: Any, key: str) -> Any:
    """A plain client of the node that serves `key` (the node itself, or its primary)."""
    if not is_cluster(client):
        return client
    return client.get_redis_connection(client.get_node_from_key(key))


def entries(value: bytes | None) -> dict[bytes, int]:
    value = value or b""
    return {value[i:i + 4]: value[i + 4] for i in range(0, len(value), CLAIM_ENTRY_BYTES)}


def test_two_pods_claims_pack_into_one_field_and_change_alone(make_pod, client):
    a, b = make_pod("pod-a"), make_pod("pod-b")
    blocks = chain(4, "pack")
    a.store(blocks)
    b.store(blocks[:2])
    assert a.pub.flush() and b.pub.flush()
    ida, idb = claim_id_of(client, "pod-a"), claim_id_of(client, "pod-b")
    assert ida != idb and len(ida) == len(idb) == 4
    root = blocks[0]
    assert entries(packed(client, blocks[0], root)) == {ida: GPU, idb: GPU}
    assert len(packed(client, blocks[0], root) or b"") == 2 * CLAIM_ENTRY_BYTES
    assert entries(packed(client, blocks[3], root)) == {ida: GPU}
    # One key for the whole chain: every block is a field of its bucket's claims HASH.
    assert client.hlen(SCHEMA.chain_claims_key(blocks)) == 4
    # A demotion (two events): pod-a's mask byte becomes CPU's, pod-b's entry untouched.
    a.emit([BlockRemoved(blocks[:1], Medium.GPU),
            BlockStored(blocks[:1], None, [], 16, medium="CPU")])  # type: ignore[arg-type]
    assert a.pub.flush()
    assert entries(packed(client, blocks[0], root)) == {ida: CPU, idb: GPU}
    got = lookup_prefix(client, SCHEMA, blocks)
    assert got == {"pod-a": PodMatch(4, ["CPU", "GPU", "GPU", "GPU"]),
                   "pod-b": PodMatch(2, ["GPU", "GPU"])}
    # A second tier on the same block: both bits, the best tier first in the lookup.
    a.store(blocks[:1], medium="DISK")
    assert a.pub.flush()
    assert entries(packed(client, blocks[0], root))[ida] == CPU | DISK
    # pod-b drops block 1: its entry goes, pod-a's stays; pod-a drops block 3: the field goes.
    b.emit([BlockRemoved(blocks[1:2], Medium.GPU)])
    a.emit([BlockRemoved(blocks[3:], Medium.GPU)])
    assert a.pub.flush() and b.pub.flush()
    assert entries(packed(client, blocks[1], root)) == {ida: GPU}
    assert packed(client, blocks[3], root) is None
    assert lookup_prefix(client, SCHEMA, blocks)["pod-b"].depth == 1
    assert count_pod_claims(client, SCHEMA, "pod-a") == 3
    assert count_pod_claims(client, SCHEMA, "pod-b") == 1
    # A clean stop leaves the other's entries exactly, and no empty key behind.
    b.pub.stop(clear=True)
    assert entries(packed(client, blocks[0], root)) == {ida: CPU | DISK}
    a.pub.stop(clear=True)
    assert not client.exists(SCHEMA.chain_claims_key(blocks), SCHEMA.claim_ids_key)


def test_bucket_lists_are_integers(make_pod, client):
    pod = make_pod("pod-a")
    pod.store(chain(2, "int-list"))
    assert pod.pub.flush()
    (member,) = client.smembers(SCHEMA.pod_buckets_key("pod-a"))
    assert int(member) == queries.bucket_of(chain(1, "int-list")[0])
    # A node keeps such a set as an intset (a cluster's nodes alike).
    node = node_of(client, SCHEMA.pod_buckets_key("pod-a"))
    assert node.object("encoding", SCHEMA.pod_buckets_key("pod-a")) in (b"intset", "intset")


def test_a_claim_id_in_use_is_never_taken_again(make_pod, client, monkeypatch):
    make_pod("pod-a")
    taken = claim_id_of(client, "pod-a")
    fresh = new_claim_id()
    draws = iter([taken, fresh])
    monkeypatch.setattr(writes, "new_claim_id", lambda: next(draws))
    got = writes.register_pod(client, SCHEMA, "pod-b", "e-b", "127.0.0.1:9", {}, {}, 5000)
    assert got == fresh  # the taken one was refused, the next draw registered
    ids = {p.pod_id: p.claim_id for p in list_live_pods(client, SCHEMA)}
    assert ids == {"pod-a": taken, "pod-b": fresh}
    assert client.hget(SCHEMA.claim_ids_key, taken.hex()) == b"pod-a"


def test_a_flushed_index_is_republished_under_a_new_claim_id(make_pod, client):
    pod = make_pod("pod-a", lease_ttl_s=0.6)
    blocks = chain(6, "flushed")
    pod.store(blocks[:4])
    pod.store(blocks[4:], medium="CPU")
    assert pod.pub.flush()
    before = claim_id_of(client, "pod-a")
    for node in primaries(client):
        node.flushall()
    wait_until(lambda: claim_id_of(client, "pod-a") not in (b"", before),
               what="the pod to register again")
    wait_until(lambda: held(client, "pod-a") == by_field(pod.full_state()),
               what="the full state republished")
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"] == PodMatch(
        6, ["GPU"] * 4 + ["CPU"] * 2)
    assert set(claims_by_id(client)) == {claim_id_of(client, "pod-a")}


def _reap(url: str, pod: str, epoch: str) -> int | None:
    async def go() -> int | None:
        index = IndexClient(connect_async(url, 5.0), SCHEMA)
        try:
            return await index.reap_pod(pod, epoch)
        finally:
            await index.aclose()
    return asyncio.run(go())


def test_a_dead_pod_is_reaped_page_by_page(make_pod, client, index_redis, monkeypatch):
    monkeypatch.setattr(queries, "STRIP_PAGE", 16)  # many pages of a large bucket
    alive, dead = make_pod("pod-b"), make_pod("pod-a", lease_ttl_s=0.3)
    big = chain(600, "big")  # > 512 fields (Redis's default bound): a hashtable, in pages
    alive.store(big[:100])
    dead.store(big)
    dead.store(chain(5, "small"), medium="DISK")
    assert alive.pub.flush() and dead.pub.flush()
    dead_id, epoch = claim_id_of(client, "pod-a"), dead.pub.epoch
    dead.pub.stop(clear=False)
    wait_until(lambda: not client.exists(SCHEMA.lease_key("pod-a")), what="lease expiry")
    node = node_of(client, SCHEMA.chain_claims_key(big))
    node.config_resetstat()
    assert node.object("encoding", SCHEMA.chain_claims_key(big)) in (b"hashtable", "hashtable")
    assert _reap(index_redis.url, "pod-a", epoch) == 605
    assert int(node.info("commandstats")["cmdstat_evalsha"]["calls"]) >= 600 // 16
    assert dead_id not in claims_by_id(client)
    assert held(client, "pod-b") == by_field(dict.fromkeys(big[:100], Medium.GPU))
    assert not client.exists(SCHEMA.pod_key("pod-a"), SCHEMA.pod_buckets_key("pod-a"),
                             SCHEMA.pod_claim_ids_key("pod-a"))
    assert not client.hexists(SCHEMA.claim_ids_key, dead_id.hex())
    assert lookup_prefix(client, SCHEMA, big)["pod-b"].depth == 100


def test_forged_values_in_the_packed_hash_are_counted_never_an_error(make_pod, client):
    pod = make_pod("pod-a")
    blocks = chain(8, "forged")
    pod.store(blocks)
    assert pod.pub.flush()
    key = SCHEMA.chain_claims_key(blocks)
    mine = claim_id_of(client, "pod-a")
    client.hset(key, claim_field(blocks[5]), b"abc")  # not whole entries
    client.hset(key, claim_field(blocks[2]),  # a stranger's claim first, then ours
                new_claim_id() + bytes((GPU,)) + packed(client, blocks[2], blocks[0]))
    bad = BadRecords()
    live = LivePods.of(list_live_pods(client, SCHEMA))
    got = queries.lookup(SCHEMA, blocks, live, bad=bad).run(client)
    assert got == {"pod-a": PodMatch(5, ["GPU"] * 5)}  # ends at the garbled block 5
    assert bad.counts[BAD_CLAIM] == 1 and not bad.counts[WRONG_TYPE]
    # A mask no pod writes ends the prefix there (the reply's '?'), counted.
    client.hset(key, claim_field(blocks[1]), mine + b"\x40")
    bad = BadRecords()
    assert queries.lookup(SCHEMA, blocks, live, bad=bad).run(client) == {
        "pod-a": PodMatch(1, ["GPU"])}
    assert bad.counts[BAD_CLAIM] == 1
    # The pod's next write over the garbage repairs its field; the strip leaves what it
    # cannot read alone, and the stranger's entry too.
    pod.emit([BlockRemoved(blocks[5:6], Medium.GPU), BlockRemoved(blocks[1:2], Medium.GPU)])
    pod.store(blocks[5:6], medium="CPU")
    assert pod.pub.flush()
    pod.store(blocks[1:2], medium="GPU")
    assert pod.pub.flush()
    assert entries(packed(client, blocks[5], blocks[0])) == {mine: CPU}
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"].depth == 8
    client.hset(key, claim_field(blocks[7]), b"abcdefg")
    pod.pub.stop(clear=True)
    left = client.hgetall(key)
    assert left == {claim_field(blocks[7]): b"abcdefg",
                    claim_field(blocks[2]): left[claim_field(blocks[2])]}
    assert len(left[claim_field(blocks[2])]) == CLAIM_ENTRY_BYTES  # the stranger's


def test_the_claims_key_of_another_type_is_counted_and_the_pod_keeps_publishing(make_pod,
                                                                                client):
    pod = make_pod("pod-a")
    blocks, other = chain(3, "typed"), chain(3, "elsewhere")
    assert queries.bucket_of(blocks[0]) != queries.bucket_of(other[0])
    pod.store(blocks)
    assert pod.pub.flush()
    key = SCHEMA.chain_claims_key(blocks)
    client.delete(key)
    client.rpush(key, "x")
    bad = BadRecords()
    live = LivePods.of(list_live_pods(client, SCHEMA))
    assert queries.lookup(SCHEMA, blocks, live, bad=bad).run(client) == {}
    assert bad.counts[WRONG_TYPE] == 1
    pod.store(other)  # the other bucket's writes, and this one's skipped, raise nothing
    pod.emit([BlockRemoved(blocks[2:], Medium.GPU)])
    assert pod.pub.flush()
    assert pod.pub.stats()["errors"] == 0
    assert lookup_prefix(client, SCHEMA, other)["pod-a"].depth == 3


def test_the_layout_is_part_of_the_namespace_and_named_in_a_mismatch():
    old = IndexSchema(SCHEMA.model, SCHEMA.block_size, SCHEMA.hash_algo, SCHEMA.hash_seed,
                      index_layout="1")
    assert old.namespace != SCHEMA.namespace
    layout_1_id = hashlib.sha256("\x1f".join(
        (SCHEMA.model, str(SCHEMA.block_size), SCHEMA.hash_algo, SCHEMA.hash_seed)).encode())
    assert old.namespace == layout_1_id.hexdigest()[:12]  # what layout 1's processes use
    legacy = {k: v for k, v in SCHEMA.hash_config().items() if k != LAYOUT_FIELD}
    assert IndexSchema.from_config(legacy).namespace == old.namespace  # a layout-1 config
    assert config_mismatch(SCHEMA, IndexSchema.from_config(legacy)) == \
        "index_layout differs: '2' vs '1'"
    assert SCHEMA.hash_config()[LAYOUT_FIELD] == "2"


def test_live_pods_map_only_valid_claim_ids_back_to_pods():
    a, b = new_claim_id(), new_claim_id()
    live = LivePods({"pod-a": a, "pod-b": b"", "pod-d": b, "pod-c": b"\x00\x01ab"})
    assert list(live) == ["pod-a", "pod-b", "pod-d", "pod-c"]
    assert live.pods_of == {a: "pod-a", b: "pod-d"}  # no valid claim id: matches nothing
    assert live.claim_id("pod-a") == a and live.claim_id("pod-b") is None
    assert live.claim_id("pod-c") is None and live.claim_id("pod-x") is None


def test_claims_of_a_registration_the_control_keys_lost_are_still_stripped(make_pod, client):
    """A failover of the control shard (or its wipe) may lose a registration, its claim id
    included, while the claims, on other shards, remain: the instance lists its previous id
    again as it re-registers, so those claims are stripped like any retired id's."""
    pod = make_pod("pod-a", lease_ttl_s=0.6, retire_after_s=0.2)
    blocks = chain(5, "lost")
    pod.store(blocks)
    assert pod.pub.flush()
    lost = claim_id_of(client, "pod-a")
    client.delete(SCHEMA.pod_key("pod-a"), SCHEMA.lease_key("pod-a"), SCHEMA.claim_ids_key,
                  SCHEMA.pod_claim_ids_key("pod-a"))  # the control keys only (one slot)
    assert len(claims_by_id(client)[lost]) == 5
    wait_until(lambda: claim_id_of(client, "pod-a") not in (b"", lost),
               what="the pod to register again")
    wait_until(lambda: lost not in claims_by_id(client), what="the lost id's claims stripped")
    assert held(client, "pod-a") == by_field(dict.fromkeys(blocks, Medium.GPU))
    assert client.hkeys(SCHEMA.claim_ids_key) == [claim_id_of(client, "pod-a").hex().encode()]


def test_a_router_says_an_old_layout_pod_is_in_another_namespace_and_why(
        redis_server, fake_pods, make_router, caplog):
    """A pod of layout 1 (a process not upgraded) registers under its own namespace id,
    without the layout field: the router never reads its keys and says why, once."""
    import logging

    import redis

    from tests.integration.router_fixtures import SCHEMA as ROUTER

    old = IndexSchema(ROUTER.model, ROUTER.block_size, ROUTER.hash_algo, ROUTER.hash_seed,
                      index_layout="1")
    legacy = {k: v for k, v in old.hash_config().items() if k != LAYOUT_FIELD}
    r = redis.Redis.from_url(redis_server.url)
    r.hset(old.config_key, mapping=legacy)  # as layout 1 wrote them
    r.sadd(old.namespaces_key, old.namespace)
    r.sadd(old.pods_key, "old-pod")
    r.hset(old.pod_key("old-pod"), mapping={
        "address": "127.0.0.1:1", "epoch": "e1", **{f"cfg.{k}": v for k, v in legacy.items()}})
    r.set(old.lease_key("old-pod"), "e1", px=60_000)
    with caplog.at_level(logging.WARNING, logger="pagekv.router.pods"):
        router = make_router(redis_server.url)
        router.wait_pods(3)
        time.sleep(1.0)  # several namespace checks
    lines = [m.getMessage() for m in caplog.records if "old-pod" in m.getMessage()]
    assert len(lines) == 1, lines
    assert old.namespace in lines[0] and "index_layout differs: '2' vs '1'" in lines[0]
    assert "old-pod" not in router.server.router.registry.pods
