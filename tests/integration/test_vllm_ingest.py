"""The vLLM ingester against real ZeroMQ sockets on loopback and a real redis-server: a
PageKV pod's publisher in vLLM's format (VllmEventPublisher, driven directly) and a scripted
one (tests/integration/vllm_fixtures.py) that loses batches, restarts and sends garbage.
The ingester runs in-process on its own thread, so its counters and log lines can be read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest
import redis
import zmq

from pagekv.kvnode.index.kv_events_zmq import VllmEventPublisher, ZmqEventsConfig
from pagekv.kvnode.index.vllm_ingest import IngestConfig, VllmIngester
from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.index import PodMatch, list_live_pods, lookup_prefix
from pagekv.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagekv.proto.medium import Medium
from pagekv.proto.vllm_events import (
    WireBlockRemoved,
    WireBlockStored,
    decode_batch,
    seq_from_bytes,
    seq_to_bytes,
    short_hash,
)
from tests.integration.index_fixtures import by_field
from tests.integration.vllm_fixtures import (
    SCHEMA,
    TOPIC,
    ScriptedPublisher,
    chain,
    pod_claims,
    wait_for,
)

pytestmark = pytest.mark.integration

BS = SCHEMA.block_size
TOKENS_A = list(range(1, 1 + 4 * BS))  # 4 blocks
TOKENS_B = list(range(500, 500 + 2 * BS))  # 2 blocks
A, B = chain(TOKENS_A), chain(TOKENS_B)


def wire_stored(hashes: list[bytes], tokens: list[int], first: int, last: int,
                medium: str = "GPU") -> WireBlockStored:
    """Blocks first..last-1 of a chain, as vLLM reports them (short hashes)."""
    parent = short_hash(hashes[first - 1]) if first else None
    return WireBlockStored([short_hash(h) for h in hashes[first:last]], parent,
                           tokens[first * BS:last * BS], BS, None, medium, None)


@pytest.fixture
def rclient(redis_server) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


@pytest.fixture
def make_ingester(redis_server) -> Iterator[Callable[..., VllmIngester]]:
    made: list[VllmIngester] = []

    def make(endpoint: str, replay: str | None, **overrides) -> VllmIngester:
        fields = dict(zmq_endpoint=endpoint, replay_endpoint=replay, topic=TOPIC,
                      pod_id="vllm-a", openai_address="127.0.0.1:8000", model=SCHEMA.model,
                      block_size=SCHEMA.block_size, redis_url=redis_server.url,
                      hash_algo=SCHEMA.hash_algo, hash_seed=SCHEMA.hash_seed,
                      lease_ttl_s=1.5, replay_timeout_s=1.0, health_interval_s=0.0)
        ing = VllmIngester(IngestConfig(**{**fields, **overrides}))
        assert ing.start()
        made.append(ing)
        assert ing.joined.wait(5)
        return ing

    yield make
    for ing in made:
        ing.stop()


@pytest.fixture
def scripted() -> Iterator[ScriptedPublisher]:
    pub = ScriptedPublisher()
    yield pub
    pub.close()


def sync(pub: VllmEventPublisher, ing: VllmIngester) -> None:
    """Until the ingester has applied every batch: a PUB drops what it sends before the
    subscriber is there, so nudge with harmless batches (removals of nothing) until it
    has asked for a replay of whatever it missed."""
    noop = [BlockRemoved([b"\0" * 32], Medium.GPU)]
    for _ in range(50):
        pub.submit(noop)
        if ing.wait_applied(pub.stats()["seq"] - 1, 0.2):
            return
    raise AssertionError(f"ingester at {ing.counters.last_seq}, publisher {pub.stats()}")


@pytest.mark.parametrize("hash_form, wire_form", [("int", "map"), ("bytes", "array")])
def test_stored_removed_cleared_land_in_the_index(make_ingester, rclient, hash_form,
                                                  wire_form) -> None:
    pub = VllmEventPublisher(ZmqEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", TOPIC,
                                             hash_form, wire_form))
    pub.start()
    try:
        # Published before the ingester starts: it finds them in the replay buffer.
        pub.submit([BlockStored(A[:2], None, TOKENS_A[:2 * BS], BS, None, Medium.GPU)])
        ing = make_ingester(pub.endpoint, pub.replay_endpoint)
        pub.submit([BlockStored(A[2:], A[1], TOKENS_A[2 * BS:], BS, None, Medium.GPU),
                    BlockStored(B, None, TOKENS_B, BS, None, Medium.GPU)])
        # A demotion, as a PageKV pod reports it: stored in DRAM (with tokens), gone from
        # the pool.
        pub.submit([BlockStored([A[3]], A[2], TOKENS_A[3 * BS:], BS, None, Medium.CPU),
                    BlockRemoved([A[3]], Medium.GPU)])
        sync(pub, ing)
        match = lookup_prefix(rclient, SCHEMA, A)["vllm-a"]
        assert match == PodMatch(4, ["GPU", "GPU", "GPU", "CPU"])
        assert lookup_prefix(rclient, SCHEMA, B)["vllm-a"].depth == 2
        assert pod_claims(rclient, SCHEMA, "vllm-a") == by_field(
            {**dict.fromkeys(A[:3], "G"), A[3]: "C", **dict.fromkeys(B, "G")})
        (info,) = list_live_pods(rclient, SCHEMA)
        assert (info.pod_id, info.kind, info.http_address) == ("vllm-a", "vllm",
                                                               "127.0.0.1:8000")
        pub.submit([AllBlocksCleared(Medium.GPU)])
        sync(pub, ing)
        assert pod_claims(rclient, SCHEMA, "vllm-a") == by_field({A[3]: "C"})
        pub.submit([AllBlocksCleared()])
        sync(pub, ing)
        assert pod_claims(rclient, SCHEMA, "vllm-a") == by_field({})
        assert not ing.book.refused and ing.counters.garbage == 0
    finally:
        pub.stop()


@pytest.mark.parametrize("replay_with_topic", [True, False])
def test_a_dropped_batch_is_replayed(make_ingester, rclient, replay_with_topic) -> None:
    s = ScriptedPublisher(replay_with_topic=replay_with_topic)
    try:
        ing = make_ingester(s.endpoint, s.replay_endpoint)
        s.wait_subscriber()
        s.send(0, [wire_stored(A, TOKENS_A, 0, 2)])
        s.send(1, [wire_stored(A, TOKENS_A, 2, 3)])
        s.send(2, [wire_stored(A, TOKENS_A, 3, 4)], live=False)  # lost on the way
        s.send(3, [WireBlockRemoved([short_hash(A[0])], "GPU")], form="array")
        assert ing.wait_applied(3)
        assert pod_claims(rclient, SCHEMA, "vllm-a") == by_field(dict.fromkeys(A[1:], "G"))
        assert 2 in s.replay_requests
        c = ing.counters
        assert (c.gaps, c.replays["ok"], c.clears, c.resets) == (1, 1, 0, 0)
    finally:
        s.close()


def test_a_batch_the_replay_no_longer_has_clears_and_waits_for_fresh_state(
        make_ingester, rclient, scripted, caplog) -> None:
    ing = make_ingester(scripted.endpoint, scripted.replay_endpoint)
    scripted.wait_subscriber()
    scripted.send(0, [wire_stored(A, TOKENS_A, 0, 2)])
    assert ing.wait_applied(0)
    with caplog.at_level(logging.WARNING, logger="pagekv.kvnode.index.vllm_ingest"):
        scripted.send(1, [wire_stored(A, TOKENS_A, 2, 3)], live=False, keep=False)
        scripted.send(2, [wire_stored(B, TOKENS_B, 0, 2)])
        assert ing.wait_applied(2)
    assert pod_claims(rclient, SCHEMA, "vllm-a") == by_field(dict.fromkeys(B, "G"))
    (line,) = [r.getMessage() for r in caplog.records if "gone" in r.getMessage()]
    assert "batches 1..1 are gone" in line and "cleared its 2 indexed blocks" in line
    assert ing.counters.replays["failed"] == 1 and ing.counters.clears == 1
    # Fresh state from here on: a block stored again is indexed, on the chain it had.
    scripted.send(3, [wire_stored(A, TOKENS_A, 0, 1)])
    scripted.send(4, [wire_stored(A, TOKENS_A, 1, 2)])
    assert ing.wait_applied(4)
    assert lookup_prefix(rclient, SCHEMA, A)["vllm-a"].depth == 2


def test_a_restarted_publisher_starts_a_new_stream(make_ingester, rclient, scripted,
                                                   caplog) -> None:
    ing = make_ingester(scripted.endpoint, scripted.replay_endpoint)
    scripted.wait_subscriber()
    scripted.send(0, [wire_stored(A, TOKENS_A, 0, 2)])
    scripted.send(1, [wire_stored(A, TOKENS_A, 2, 4)])
    assert ing.wait_applied(1)
    scripted.forget()  # the vLLM pod restarted: empty cache, sequence from 0
    with caplog.at_level(logging.WARNING, logger="pagekv.kvnode.index.vllm_ingest"):
        scripted.send(0, [wire_stored(B, TOKENS_B, 0, 2)])
        wait_for(lambda: ing.counters.resets == 1, what="the reset")
        assert ing.wait_applied(0)
    assert pod_claims(rclient, SCHEMA, "vllm-a") == by_field(dict.fromkeys(B, "G"))
    assert any("restarted" in r.getMessage() for r in caplog.records)
    scripted.send(1, [wire_stored(B, TOKENS_B, 0, 1, medium="CPU")])
    assert ing.wait_applied(1) and ing.counters.resets == 1
    assert pod_claims(rclient, SCHEMA, "vllm-a") == by_field({B[0]: "GC", B[1]: "G"})


def test_garbage_is_counted_logged_once_and_skipped(make_ingester, rclient, scripted,
                                                    caplog) -> None:
    ing = make_ingester(scripted.endpoint, scripted.replay_endpoint)
    scripted.wait_subscriber()
    topic = scripted.topic
    with caplog.at_level(logging.WARNING, logger="pagekv.kvnode.index.vllm_ingest"):
        scripted.send(0, [wire_stored(A, TOKENS_A, 0, 2)])
        scripted.send_frames([topic, b"\x00\x01", b"\x90"])  # a 2-byte sequence number
        scripted.send_frames([topic, b"only two frames"])
        scripted.send_frames([topic, seq_to_bytes(1), b"\xc1 not msgpack"])
        # An event type the ingester does not read, beside one it does: that one counts.
        mixed = msgspec.msgpack.encode(
            [time.time(), [{"type": "TransferInitiated", "id": 1},
                           wire_stored(A, TOKENS_A, 2, 3)], 0])
        scripted.send_frames([topic, seq_to_bytes(2), mixed])
        assert ing.wait_applied(2)
    assert ing.counters.garbage == 3 and ing.book.refused == {"unknown_event": 1}
    assert pod_claims(rclient, SCHEMA, "vllm-a") == by_field(dict.fromkeys(A[:3], "G"))
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1  # throttled: the others are held back, and counted
    assert ing._thread is not None and ing._thread.is_alive()


def test_events_hashed_with_another_seed_are_refused(make_ingester, rclient, scripted,
                                                     caplog) -> None:
    other = hash_prompt(HashConfig(SCHEMA.hash_algo, "another-seed"), BS, TOKENS_A)
    ing = make_ingester(scripted.endpoint, scripted.replay_endpoint)
    scripted.wait_subscriber()
    with caplog.at_level(logging.WARNING, logger="pagekv.kvnode.index.vllm_ingest"):
        scripted.send(0, [wire_stored(other, TOKENS_A, 0, 2)])
        scripted.send(1, [wire_stored(other, TOKENS_A, 2, 4)])
        assert ing.wait_applied(1)
    assert pod_claims(rclient, SCHEMA, "vllm-a") == by_field({})
    assert ing.book.refused == {"hash_mismatch": 1, "unknown_parent": 1}
    (line,) = [r.getMessage() for r in caplog.records if "hash_mismatch" in r.getMessage()]
    assert "--hash-seed" in line


@pytest.mark.parametrize("field, value", [("block_size", 32), ("hash_seed", "other-seed")])
def test_a_pod_of_another_configuration_is_refused_by_the_router(
        make_ingester, make_router, redis_server, caplog, field, value) -> None:
    nowhere = "tcp://127.0.0.1:9"  # no publisher needed: registration alone is checked
    make_ingester(nowhere, None, pod_id="vllm-ok")
    make_ingester(nowhere, None, pod_id="vllm-bad", **{field: value})
    with caplog.at_level(logging.WARNING, logger="pagekv.router.pods"):
        router = make_router(redis_server.url)
        router.wait_pods(1)
        wait_for(lambda: any("vllm-bad" in r.getMessage() for r in caplog.records),
                 what="the router's refusal")
        time.sleep(1.0)  # several namespace checks: still one line
    (line,) = [r.getMessage() for r in caplog.records if "vllm-bad" in r.getMessage()]
    assert f"{field} differs" in line and "never routed to" in line
    (entry,) = router.server.router.registry.eligible()
    assert entry.pod_id == "vllm-ok" and entry.info.kind == "vllm"


def test_the_pods_publisher_keeps_a_dropped_batchs_number_and_replays() -> None:
    pub = VllmEventPublisher(ZmqEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", TOPIC,
                                             max_queue_size=2))
    stored = [BlockStored(A[:1], None, TOKENS_A[:BS], BS, None, Medium.GPU)]
    for _ in range(3):  # the sender is not running yet: the third does not fit
        pub.submit(stored)
    pub.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        pub.submit([BlockRemoved(A[:1], Medium.GPU)])
        wait_for(lambda: pub.stats()["published"] == 3, what="three batches sent")
        assert pub.stats()["dropped"] == 1
        dealer.send_multipart([b"", seq_to_bytes(1)])
        answers = []
        while True:
            assert dealer.poll(5000)
            answers.append(dealer.recv_multipart())
            if answers[-1][2] == b"\xff" * 8:
                break
        *batches, end = answers
        assert end == [b"", TOPIC.encode(), b"\xff" * 8, b""]
        assert [(a[1], seq_from_bytes(a[2])) for a in batches] == [(TOPIC.encode(), 1),
                                                                   (TOPIC.encode(), 3)]
        (event,) = decode_batch(batches[1][3]).events
        assert event == WireBlockRemoved([short_hash(A[0])], "GPU")
    finally:
        dealer.close(0)
        pub.stop()


class _Health(BaseHTTPRequestHandler):
    status = 200
    metrics = ""  # the /metrics page; "" : 404

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/metrics" and type(self).metrics:
            body = type(self).metrics.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(type(self).status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_pod_that_stops_serving_leaves_the_index_and_comes_back(make_ingester, rclient,
                                                                  scripted, caplog) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ing = make_ingester(scripted.endpoint, scripted.replay_endpoint,
                            openai_address=f"127.0.0.1:{server.server_port}",
                            health_interval_s=0.05, health_failures=2)
        scripted.wait_subscriber()
        scripted.send(0, [wire_stored(A, TOKENS_A, 0, 2)])
        assert ing.wait_applied(0)
        assert pod_claims(rclient, SCHEMA, "vllm-a") == by_field(dict.fromkeys(A[:2], "G"))
        with caplog.at_level(logging.WARNING, logger="pagekv.kvnode.index.vllm_ingest"):
            _Health.status = 503
            wait_for(lambda: not rclient.exists(SCHEMA.lease_key("vllm-a")), what="it left")
        assert pod_claims(rclient, SCHEMA, "vllm-a") == by_field({})
        assert not rclient.sismember(SCHEMA.pods_key, "vllm-a")
        (line,) = [r.getMessage() for r in caplog.records if "not serving" in r.getMessage()]
        assert "HTTP 503, 2 times in a row" in line
        # Its events are still followed while it is out, and all of it comes back.
        scripted.send(1, [wire_stored(A, TOKENS_A, 2, 4)])
        assert ing.wait_applied(1)
        _Health.status = 200
        wait_for(lambda: pod_claims(rclient, SCHEMA, "vllm-a") == by_field(dict.fromkeys(A, "G")),
                 what="it came back")
        (info,) = list_live_pods(rclient, SCHEMA)
        assert info.kind == "vllm"
    finally:
        _Health.status = 200
        server.shutdown()
        server.server_close()


def _own_redis_ingester(scripted: ScriptedPublisher, redis_url: str) -> VllmIngester:
    """An ingester on a Redis of the test's own (one it stops and starts)."""
    return VllmIngester(IngestConfig(
        zmq_endpoint=scripted.endpoint, replay_endpoint=scripted.replay_endpoint,
        topic=TOPIC, pod_id="vllm-a", openai_address="127.0.0.1:8000", model=SCHEMA.model,
        block_size=BS, redis_url=redis_url, hash_algo=SCHEMA.hash_algo,
        hash_seed=SCHEMA.hash_seed, lease_ttl_s=1.5, health_interval_s=0.0))


def test_redis_going_away_loses_nothing_and_never_stalls_the_stop(scripted, tmp_path) -> None:
    """The ingest thread drives its publisher: while Redis is down the publisher backs off
    there, batches keep being applied to the book between its tries, and when Redis is back
    the whole book is republished. A stop during the outage returns at once."""
    from pagekv.deploy.redis_server import RedisProcess

    server = RedisProcess(data_dir=tmp_path / "redis").start()  # its own: it is stopped
    client = redis.Redis.from_url(server.url)
    ing = _own_redis_ingester(scripted, server.url)
    try:
        assert ing.start()
        scripted.wait_subscriber()
        scripted.send(0, [wire_stored(A, TOKENS_A, 0, 2)])
        assert ing.wait_applied(0)
        assert pod_claims(client, SCHEMA, "vllm-a") == by_field(dict.fromkeys(A[:2], "G"))
        server.stop()
        scripted.send(1, [wire_stored(A, TOKENS_A, 2, 4), wire_stored(B, TOKENS_B, 0, 2)])
        wait_for(lambda: ing.counters.last_seq == 1, what="batch 1 applied while Redis is down")
        assert len(ing.book) == 6
        server.start()  # the same port
        wait_for(lambda: pod_claims(client, SCHEMA, "vllm-a")
                 == by_field(dict.fromkeys(A + B, "G")),
                 timeout=15, what="the book republished")
        assert ing.publisher.stats()["republishes"] >= 2
        server.stop()  # and once more, to stop while it is away
        scripted.send(2, [WireBlockRemoved([short_hash(B[1])], "GPU")])
        wait_for(lambda: ing.counters.last_seq == 2, what="batch 2 applied")
        t0 = time.monotonic()
        ing.stop(clear=False, timeout=5)
        assert time.monotonic() - t0 < 3.0
        assert ing._thread is None
    finally:
        ing.stop(clear=False)
        server.close()


def test_the_pods_queue_from_its_metrics_is_published_with_its_lease(make_ingester,
                                                                     rclient) -> None:
    """The router scores a vLLM pod's queue from its lease, as a PageKV pod's."""
    _Health.metrics = "\n".join([
        'vllm:num_requests_running{engine="0"} 5', 'vllm:num_requests_waiting{engine="0"} 3',
        'vllm:kv_cache_usage_perc{engine="0"} 0.5',
        'vllm:cache_config_info{engine="0",num_gpu_blocks="800"} 1'])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pub = ScriptedPublisher()
    try:
        ing = make_ingester(pub.endpoint, None,
                            openai_address=f"127.0.0.1:{server.server_port}",
                            health_interval_s=0.05)
        info = wait_for(lambda: next((p for p in list_live_pods(rclient, SCHEMA)
                                      if p.waiting == 3), None), what="the load published")
        assert (info.waiting, info.running, info.free_blocks) == (3, 5, 400)
        assert ing.published_load() == {"waiting": 3.0, "running": 5.0, "free_blocks": 400.0}
    finally:
        _Health.metrics = ""
        pub.close()
        server.shutdown()
        server.server_close()


def test_an_ingester_started_before_redis_catches_up_once_it_is_there(scripted,
                                                                      tmp_path) -> None:
    from pagekv.deploy.redis_server import RedisProcess, free_port

    server = RedisProcess(port=free_port(), data_dir=tmp_path / "redis")  # not started yet
    ing = _own_redis_ingester(scripted, server.url)
    try:
        t0 = time.monotonic()
        assert not ing.start(timeout=0.5)  # no Redis: says so, does not raise
        assert time.monotonic() - t0 < 3.0
        scripted.wait_subscriber()
        scripted.send(0, [wire_stored(A, TOKENS_A, 0, 3)])
        wait_for(lambda: ing.counters.last_seq == 0, what="batch 0 applied without Redis")
        server.start()
        client = redis.Redis.from_url(server.url)
        wait_for(lambda: pod_claims(client, SCHEMA, "vllm-a")
                 == by_field(dict.fromkeys(A[:3], "G")),
                 timeout=15, what="the book published once Redis is there")
    finally:
        ing.stop()
        server.close()
