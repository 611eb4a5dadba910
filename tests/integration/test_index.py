"""The Redis index against a real redis-server: publisher, lookup, leases, epochs, failures."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from kvnode.pod.publisher import IndexPublisher
from kvnode.pod.redis_server import RedisProcess
from proto.index import (
    IndexClient,
    IndexSchema,
    PodMatch,
    config_mismatch,
    list_live_pods,
    list_namespaces,
    lookup_prefix,
    register_scripts,
)
from proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from proto.medium import Medium

pytestmark = pytest.mark.integration

SCHEMA = IndexSchema("tiny-llama", 16, "sha256", "seed-1")


def chain(n: int, tag: str = "a") -> list[bytes]:
    """n distinct 32-byte block hashes (stand-ins for a real hash chain)."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll for a state change; the deadline only bounds a hang, it decides nothing."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or cond}")
        time.sleep(0.02)


class PodState:
    """What an engine would hold: hash -> tier, updated before events are submitted."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, str] = {}
        self.lock = threading.Lock()
        self.pub: IndexPublisher | None = None

    def emit(self, events: list[KVEvent]) -> None:
        with self.lock:
            for ev in events:
                if isinstance(ev, BlockStored):
                    for h in ev.block_hashes:
                        self.blocks[h] = ev.medium
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        if self.blocks.get(h) == ev.medium:
                            del self.blocks[h]
                else:
                    self.blocks = {h: t for h, t in self.blocks.items()
                                   if ev.medium is not None and t != ev.medium}
        assert self.pub is not None
        self.pub.submit(events)

    def full_state(self) -> dict[bytes, str]:
        with self.lock:
            return dict(self.blocks)

    def store(self, hashes: list[bytes], medium: str = "GPU") -> None:
        self.emit([BlockStored(hashes, None, [], 16, medium=medium)])  # type: ignore[arg-type]


@pytest.fixture
def client(redis_server: RedisProcess) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_server.url)
    yield r
    r.close()


@pytest.fixture
def make_pod(redis_server: RedisProcess) -> Iterator[Callable[..., PodState]]:
    started: list[IndexPublisher] = []

    def _make(pod_id: str, schema: IndexSchema = SCHEMA, start: bool = True,
              **kwargs: object) -> PodState:
        state = PodState()
        kwargs.setdefault("flush_interval_s", 0.01)
        pub = IndexPublisher(
            redis_server.url, schema, pod_id, f"127.0.0.1:{5000 + len(started)}",
            hash_config=schema.hash_config(),
            load_fn=lambda: {"waiting": 2, "running": 3, "free_blocks": 100},
            full_state_fn=state.full_state,
            tier_costs_fn=lambda: {"GPU": 0.0, "CPU": 2e-6, "DISK": 5e-5},
            **kwargs,  # type: ignore[arg-type]
        )
        state.pub = pub
        started.append(pub)
        if start:
            assert pub.start(timeout=10)
        return state

    yield _make
    for pub in started:
        pub.stop(clear=False, timeout=2)


def index_claims(r: redis.Redis, schema: IndexSchema, pod: str, epoch: str) -> dict[bytes, str]:
    """What Redis says this pod holds: hash -> best tier, only claims of this epoch."""
    out: dict[bytes, str] = {}
    for member in r.smembers(schema.pod_blocks_key(pod)):
        value = r.hget(schema.block_prefix + member.decode(), pod)
        if value is not None and value.decode().endswith(":" + epoch):
            out[bytes.fromhex(member.decode())] = Medium.from_code(value.decode()[0])
    return out


def test_stored_gpu_blocks_are_found_with_depth_and_tiers(make_pod, client):
    pod = make_pod("pod-a")
    blocks = chain(6)
    pod.store(blocks[:4])
    assert pod.pub.flush()
    got = lookup_prefix(client, SCHEMA, blocks)
    assert got == {"pod-a": PodMatch(4, ["GPU"] * 4)}
    assert got["pod-a"].tier_counts() == {"GPU": 4, "CPU": 0, "DISK": 0}
    assert pod.pub.stats()["events_published"] == 1


def test_medium_change_moves_the_claim_to_cpu(make_pod, client):
    pod = make_pod("pod-a")
    blocks = chain(3)
    pod.store(blocks)
    # Demotion of block 1 reported as store-then-remove in one batch: order must not matter.
    pod.emit([BlockStored([blocks[1]], None, [], 16, medium="CPU"),
              BlockRemoved([blocks[1]], medium="GPU")])
    pod.emit([BlockRemoved([blocks[2]], medium="GPU"),
              BlockStored([blocks[2]], None, [], 16, medium="DISK")])
    assert pod.pub.flush()
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"] == PodMatch(3, ["GPU", "CPU", "DISK"])


def test_two_pods_with_different_depths(make_pod, client):
    a, b = make_pod("pod-a"), make_pod("pod-b")
    blocks = chain(8)
    a.store(blocks[:2])
    b.store(blocks[:5])
    b.emit([BlockRemoved(blocks[3:5]), BlockStored(blocks[3:5], None, [], 16, medium="CPU")])
    assert a.pub.flush() and b.pub.flush()
    got = lookup_prefix(client, SCHEMA, blocks)
    assert got["pod-a"] == PodMatch(2, ["GPU", "GPU"])
    assert got["pod-b"] == PodMatch(5, ["GPU", "GPU", "GPU", "CPU", "CPU"])


def test_lookup_stops_at_first_miss(make_pod, client):
    a, b = make_pod("pod-a"), make_pod("pod-b")
    blocks = chain(6)
    a.store([blocks[0], blocks[1], blocks[3], blocks[4]])  # hole at block 2
    b.store(blocks[1:6])  # everything but block 0
    assert a.pub.flush() and b.pub.flush()
    got = lookup_prefix(client, SCHEMA, blocks)
    assert got["pod-a"].depth == 2
    assert got["pod-b"] == PodMatch(0, [])
    assert lookup_prefix(client, SCHEMA, []) == {"pod-a": PodMatch(0, []),
                                                 "pod-b": PodMatch(0, [])}


def test_all_blocks_cleared(make_pod, client):
    pod = make_pod("pod-a")
    blocks = chain(4)
    pod.store(blocks[:2])
    pod.store(blocks[2:], medium="CPU")
    pod.emit([AllBlocksCleared(medium="GPU")])
    assert pod.pub.flush()
    assert lookup_prefix(client, SCHEMA, blocks[2:])["pod-a"].depth == 2
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"].depth == 0
    pod.emit([AllBlocksCleared()])
    assert pod.pub.flush()
    assert lookup_prefix(client, SCHEMA, blocks[2:])["pod-a"].depth == 0
    assert client.scard(SCHEMA.pod_blocks_key("pod-a")) == 0


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
    assert client.hget(SCHEMA.block_key(blocks[0]), "pod-a") is not None  # claims remain
    assert lookup_prefix(client, SCHEMA, blocks) == {}
    assert list_live_pods(client, SCHEMA) == []


def test_restarted_pod_does_not_inherit_old_claims(make_pod, client):
    old = make_pod("pod-a")
    blocks = chain(4)
    old.store(blocks)
    assert old.pub.flush()
    old_epoch = old.pub.epoch
    old.pub.stop(clear=False)  # crashed; its lease is still alive for a while
    new = make_pod("pod-a")
    assert new.pub.epoch != old_epoch
    # The restarted pod holds nothing: the previous epoch's claims were dropped at start.
    assert lookup_prefix(client, SCHEMA, blocks) == {"pod-a": PodMatch(0, [])}
    assert client.scard(SCHEMA.pod_blocks_key("pod-a")) == 0
    # And a claim that still carries the old epoch is not trusted either.
    client.hset(SCHEMA.block_key(blocks[0]), "pod-a", f"G:{old_epoch}")
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"].depth == 0
    new.store(blocks[:3])
    assert new.pub.flush()
    assert lookup_prefix(client, SCHEMA, blocks)["pod-a"].depth == 3


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


def dump(r: redis.Redis) -> dict[bytes, object]:
    out: dict[bytes, object] = {}
    for key in r.keys("*"):
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

    import redis.asyncio as aioredis

    async def go() -> object:
        index = IndexClient(aioredis.Redis.from_url(url), schema)
        try:
            return await getattr(index, method)(*args)
        finally:
            await index.aclose()

    return asyncio.run(go())


def test_dead_pod_is_reaped_in_batches_leaving_others_exactly(make_pod, client, redis_server):
    other = make_pod("pod-b")
    blocks = chain(25)
    other.store(blocks[:10])
    assert other.pub.flush()
    before = dump(client)
    dead = make_pod("pod-a", lease_ttl_s=0.3)
    dead.store(blocks)
    assert dead.pub.flush()
    epoch = dead.pub.epoch
    dead.pub.stop(clear=False)  # a crash
    wait_until(lambda: not client.exists(SCHEMA.lease_key("pod-a")), what="lease expiry")
    assert _run("dead_pods", redis_server.url, SCHEMA) == {"pod-a": epoch}
    removed = _run("reap_pod", redis_server.url, SCHEMA, "pod-a", epoch, 7)
    assert removed == 25
    assert dump(client) == before  # every key of pod-a gone, pod-b's untouched
    assert _run("dead_pods", redis_server.url, SCHEMA) == {}


def test_reap_is_refused_once_the_pod_id_is_back(make_pod, client, redis_server):
    dead = make_pod("pod-a", lease_ttl_s=0.3)
    dead.store(chain(3))
    assert dead.pub.flush()
    epoch = dead.pub.epoch
    dead.pub.stop(clear=False)
    wait_until(lambda: not client.exists(SCHEMA.lease_key("pod-a")), what="lease expiry")
    back = make_pod("pod-a")  # restarted under the same id before the reaper ran
    back.store(chain(2))
    assert back.pub.flush()
    assert _run("reap_pod", redis_server.url, SCHEMA, "pod-a", epoch) is None
    assert lookup_prefix(client, SCHEMA, chain(3))["pod-a"].depth == 2


def test_config_mismatch_messages():
    base = {"model": "m", "block_size": 16, "hash_algo": "sha256", "hash_seed": "x"}
    assert config_mismatch(base, dict(base, block_size="16")) is None
    assert config_mismatch(base, dict(base, hash_seed="y")) == "hash_seed differs: 'x' vs 'y'"
    assert (config_mismatch(base, dict(base, block_size=32, hash_algo="xxhash"))
            == "block_size differs: '16' vs '32'; hash_algo differs: 'sha256' vs 'xxhash'")
    no_seed = {k: v for k, v in base.items() if k != "hash_seed"}
    assert config_mismatch(base, no_seed) == "hash_seed differs: 'x' vs missing"
    # Extra fields count only when both sides publish them.
    assert config_mismatch(dict(base, kv_dtype="fp8"), base) is None
    assert (config_mismatch(dict(base, lora="1"), dict(base, lora="2"))
            == "lora differs: '1' vs '2'")
    assert config_mismatch(IndexSchema("m", 16, "sha256", "x"), base) is None
    with pytest.raises(ValueError, match="hash_seed differs"):
        IndexPublisher("redis://127.0.0.1:1/0", SCHEMA, "p", "a", dict(base, hash_seed="z"),
                       dict, dict)


def test_namespaces_isolate_hash_configurations(make_pod, client):
    pod = make_pod("pod-a")
    blocks = chain(3)
    pod.store(blocks)
    assert pod.pub.flush()
    other_seed = IndexSchema("tiny-llama", 16, "sha256", "seed-2")
    assert other_seed.namespace != SCHEMA.namespace
    assert lookup_prefix(client, other_seed, blocks) == {}
    assert list_live_pods(client, other_seed) == []
    # A router in the other namespace can still find out why it sees nobody.
    spaces = list_namespaces(client)
    assert spaces == {SCHEMA.namespace: SCHEMA.hash_config()}
    assert (config_mismatch(other_seed, spaces[SCHEMA.namespace])
            == "hash_seed differs: 'seed-2' vs 'seed-1'")
    assert IndexSchema.from_config(spaces[SCHEMA.namespace]) == SCHEMA


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
    assert index_claims(client, SCHEMA, "pod-a", pub.epoch) == pod.full_state()
    stats = pub.stats()
    assert stats["republishes"] >= 2 and stats["events_dropped"] >= 1
    got = lookup_prefix(client, SCHEMA, blocks)["pod-a"]
    assert got.depth == 38
    assert got.tier_counts() == {"GPU": 28, "CPU": 5, "DISK": 5}
    assert [p.pod_id for p in list_live_pods(client, SCHEMA)] == ["pod-a"]


class CountingRedis(redis.Redis):
    """Counts top-level commands sent by this client (each is one round trip here)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sent: list[str] = []

    def execute_command(self, *args: object, **options: object) -> object:
        self.sent.append(str(args[0]).upper())
        return super().execute_command(*args, **options)


def test_lookup_is_one_round_trip(make_pod, redis_server, client):
    pod, other = make_pod("pod-a"), make_pod("pod-b")
    blocks = chain(64)
    pod.store(blocks[:50])
    other.store(blocks[:3])
    assert pod.pub.flush() and other.pub.flush()
    counting = CountingRedis.from_url(redis_server.url)
    register_scripts(counting)
    client.config_resetstat()
    counting.sent.clear()
    got = lookup_prefix(counting, SCHEMA, blocks)
    assert got["pod-a"].depth == 50 and got["pod-b"].depth == 3
    assert counting.sent == ["EVALSHA"]
    stats = client.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 1
    assert "cmdstat_eval" not in stats and "cmdstat_script" not in stats
    counting.close()
