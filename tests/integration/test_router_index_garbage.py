"""The router against an index holding garbage (#27, finding 3), and a burst larger than its
Redis pool (finding 7): a real Redis, in-process fake pods, the garbage written with a raw
client into the keys the schema names. Every call still succeeds, routed on the good
records; pagekv_router_index_bad_records_total says why; the index stays up (no load-only
fallback). Fixtures: conftest.py; helpers: router_fixtures.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import redis

from pagekv.proto.index import bucket_of, claim_field, connect
from pagekv.proto.index.schema import (
    CLAIM_ENTRY_BYTES,
    CLAIM_ID_BYTES,
    namespace_config_key,
    new_claim_id,
)
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from tests.integration.index_fixtures import claim_id_of
from tests.integration.router_fixtures import SCHEMA, FakePod, RouterHandle, tokens_req

pytestmark = pytest.mark.integration

PROMPT = list(range(3, 3 + 16 * 6 + 5))  # 6 full blocks


def _raw(url: str) -> Any:
    return redis.Redis.from_url(url)


def _forge_pod(r: Any, pod_id: str, fields: dict[str, Any], lease: bool = True
               ) -> str:
    """A registration written by hand (as anyone who reaches Redis could): `fields` over
    a complete one, with a lease a minute long. Returns its epoch."""
    epoch = "forged0001"
    record = {"epoch": epoch, "updated": str(time.time()), "claim": new_claim_id().hex(),
              **{f"cfg.{k}": v for k, v in SCHEMA.hash_config().items()},
              "load.waiting": "0", "load.running": "0", "load.free_blocks": "100"}
    record.update(fields)
    record = {k: v for k, v in record.items() if v is not None}
    r.sadd(SCHEMA.pods_key, pod_id)
    r.hset(SCHEMA.pod_key(pod_id), mapping=record)
    if lease:
        r.set(SCHEMA.lease_key(pod_id), epoch, px=60_000)
    return epoch


def _bad(router: RouterHandle, reason: str) -> float:
    return router.metric("pagekv_router_index_bad_records_total", {"reason": reason})


def _wait_bad(router: RouterHandle, reason: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _bad(router, reason) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def _calls_succeed(router: RouterHandle, prompt: list[int], n: int = 4) -> list[str]:
    served = []
    for i in range(n):
        req = tokens_req(prompt if i % 2 else prompt + [i])
        served.append(router.stub.Generate(req, timeout=10).served_by)
        last = list(router.stub.GenerateStream(req, timeout=10))[-1]
        served.append(last.served_by)
    return served


def _index_stayed_up(router: RouterHandle) -> None:
    assert router.metric("pagekv_router_index_up") == 1
    assert router.metric("pagekv_router_fallback_routes_total", {"cause": "index_down"}) == 0
    assert router.server.router.registry.index_up


@pytest.mark.parametrize("field, value, reason", [
    ("load.waiting", "nan", "bad_load"),
    ("load.running", "inf", "bad_load"),
    ("load.free_blocks", "1e308", "bad_load"),
    ("load.waiting", "-3", "bad_load"),
    ("load.running", "lots", "bad_load"),
    ("cost.prefill", "nan", "bad_cost"),
    ("cost.prefill", "1e308", "bad_cost"),
    ("cost.CPU", "-1", "bad_cost"),
    ("cost.prefill", "0", "bad_cost"),  # would win every cold prompt
])
def test_a_pods_garbage_load_or_cost_skips_that_value(redis_server, fake_pods, make_router,
                                                      field, value, reason) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    r = _raw(redis_server.url)
    # Reached at a real pod's address, so a call routed to it is served.
    _forge_pod(r, "forged", {"address": fake_pods[0].address, field: value})
    router.wait_pods(4)
    _wait_bad(router, reason)
    served = _calls_succeed(router, PROMPT)
    assert set(served) <= {"fake-a", "fake-b", "fake-c"}
    assert _bad(router, reason) >= 1
    assert router.server.router.registry.pods["forged"].eligible  # its load unknown, no more
    _index_stayed_up(router)


@pytest.mark.parametrize("fields, reason", [
    ({"address": None}, "bad_registration"),              # truncated: no address
    ({"address": "no port here"}, "bad_registration"),
    ({"kind": "zzz"}, "bad_registration"),
    ({"updated": "yesterday"}, "bad_registration"),
    ({"address": b"\xff\xfe:1"}, "bad_encoding"),
])
def test_a_forged_registration_skips_that_pod(redis_server, fake_pods, make_router, fields,
                                              reason) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    _forge_pod(_raw(redis_server.url), "forged", {"address": fake_pods[0].address, **fields})
    _wait_bad(router, reason)
    served = _calls_succeed(router, PROMPT)
    assert set(served) <= {"fake-a", "fake-b", "fake-c"}
    assert _bad(router, reason) >= 1
    _index_stayed_up(router)


def _home_and_hashes(router: RouterHandle, prompt: list[int]) -> tuple[str, list[bytes]]:
    """Route `prompt` once and wait for its pod's claims: (that pod, the router's hashes)."""
    home = router.stub.Generate(tokens_req(prompt), timeout=10).served_by
    prepared = router.server.router.prepare(tokens_req(prompt))
    hashes = prepared.block_hashes[:prepared.lookup_blocks]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        again = router.stub.Generate(tokens_req(prompt), timeout=10)
        if again.routing.reason == "prefix_hit":
            break
        time.sleep(0.1)
    return home, hashes


def _set_claims(r: redis.Redis, hashes: list[bytes], i: int, value: bytes) -> None:
    """Block i's claims (its field in the chain's bucket's claims HASH) set to `value`."""
    r.hset(SCHEMA.chain_claims_key(hashes), claim_field(hashes[i]), value)


def _with_mask(r: redis.Redis, pod: str, hashes: list[bytes], i: int, mask: int) -> bytes:
    """Block i's claims with `pod`'s tier mask byte replaced."""
    value = r.hget(SCHEMA.chain_claims_key(hashes), claim_field(hashes[i]))
    cid = claim_id_of(r, pod, SCHEMA)
    at = next(j for j in range(0, len(value), CLAIM_ENTRY_BYTES)
              if value[j:j + CLAIM_ID_BYTES] == cid)
    return value[:at + CLAIM_ID_BYTES] + bytes((mask,)) + value[at + CLAIM_ENTRY_BYTES:]


def _prediction_key(hashes: list[bytes], i: int) -> str:
    return SCHEMA.chain_prediction_keys(hashes)[i]


GarbageWriter = Callable[[redis.Redis, str, list[bytes]], None]


def _unknown_tier_at_block_0(r: redis.Redis, pod: str, hashes: list[bytes]) -> None:
    _set_claims(r, hashes, 0, _with_mask(r, pod, hashes, 0, 0x40))


def _unknown_tier_at_block_2(r: redis.Redis, pod: str, hashes: list[bytes]) -> None:
    _set_claims(r, hashes, 2, _with_mask(r, pod, hashes, 2, 0))


def _claims_not_whole_entries(r: redis.Redis, pod: str, hashes: list[bytes]) -> None:
    _set_claims(r, hashes, 3, b"garbage")


def _an_unknown_claim_id_at_block_0(r: redis.Redis, pod: str, hashes: list[bytes]) -> None:
    """A claim of no live registration (a dead pod's not reaped yet, or a forged one)."""
    key, field = SCHEMA.chain_claims_key(hashes), claim_field(hashes[0])
    r.hset(key, field, new_claim_id() + b"\x01" + r.hget(key, field))


def _non_numeric_prediction(r: redis.Redis, pod: str, hashes: list[bytes]) -> None:
    r.hset(_prediction_key(hashes, 0), claim_id_of(r, pod, SCHEMA), "soon")  # the pod's key
    r.pexpire(_prediction_key(hashes, 0), 60_000)


def _claims_key_a_list(r: redis.Redis, pod: str, hashes: list[bytes]) -> None:
    r.delete(SCHEMA.chain_claims_key(hashes))
    r.rpush(SCHEMA.chain_claims_key(hashes), "x")


def _prediction_key_a_set(r: redis.Redis, pod: str, hashes: list[bytes]) -> None:
    r.delete(_prediction_key(hashes, 0))
    r.sadd(_prediction_key(hashes, 0), "x")


@pytest.mark.parametrize("write, reason, still_hits", [
    (_unknown_tier_at_block_0, "bad_claim", False),
    (_unknown_tier_at_block_2, "bad_claim", True),   # blocks 0-1 still count
    (_claims_not_whole_entries, "bad_claim", True),  # blocks 0-2 still count
    (_an_unknown_claim_id_at_block_0, "", True),     # ignored, and no bad record
    (_non_numeric_prediction, "bad_prediction", True),
    (_claims_key_a_list, "wrong_type", False),       # the bucket's claims: all of them
    (_prediction_key_a_set, "wrong_type", True),
])
def test_a_bad_claim_or_prediction_is_ignored(redis_server, fake_pods, make_router,
                                              write: GarbageWriter, reason: str,
                                              still_hits: bool) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    prompt = [7] + PROMPT
    home, hashes = _home_and_hashes(router, prompt)
    write(_raw(redis_server.url), home, hashes)
    for req in (tokens_req(prompt), tokens_req(prompt + [1])):
        resp = router.stub.Generate(req, timeout=10)
        assert resp.served_by in {"fake-a", "fake-b", "fake-c"}
        assert list(router.stub.GenerateStream(req, timeout=10))[-1].served_by
        if still_hits:
            assert resp.routing.predicted_cached_tokens > 0
    if reason:
        assert _bad(router, reason) >= 1
    else:
        assert not any(_bad(router, why) for why in ("bad_claim", "wrong_type", "bad_reply"))
    _index_stayed_up(router)


@pytest.mark.parametrize("key, make_wrong, pods", [
    (lambda pod: SCHEMA.lease_key(pod), lambda r, k: r.hset(k, "x", "1"), 3),
    (lambda pod: SCHEMA.pod_key(pod), lambda r, k: r.set(k, "x"), 3),
    (lambda pod: SCHEMA.namespaces_key, lambda r, k: r.set(k, "x"), 4),  # all pods stay
    (lambda pod: SCHEMA.namespaces_key,  # another namespace's config key of the wrong type
     lambda r, k: (r.sadd(k, "ffffffffffff"), r.set(namespace_config_key("pagekv",
                                                                        "ffffffffffff"), "x")),
     4),
])
def test_a_control_key_of_the_wrong_type_skips_only_itself(redis_server, fake_pods,
                                                           make_router, key, make_wrong,
                                                           pods: int) -> None:
    router = make_router(redis_server.url, namespace_check_interval_s=0.1)
    router.wait_pods(3)
    r = _raw(redis_server.url)
    _forge_pod(r, "forged", {"address": fake_pods[0].address})
    wrong = key("forged")
    r.delete(wrong)
    make_wrong(r, wrong)
    _wait_bad(router, "wrong_type")
    time.sleep(0.5)  # several refreshes and namespace checks
    served = _calls_succeed(router, PROMPT)
    assert set(served) <= {"fake-a", "fake-b", "fake-c"}
    assert len(router.server.router.registry.eligible()) == pods
    assert _bad(router, "wrong_type") >= 1
    _index_stayed_up(router)
    assert router.metric("pagekv_router_index_errors_total", {"op": "list_pods"}) == 0


def test_bad_records_warn_once_per_reason(redis_server, fake_pods, make_router, caplog
                                          ) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    with caplog.at_level("WARNING", logger="pagekv.proto.index.bad_records"):
        _forge_pod(_raw(redis_server.url), "forged",
                   {"address": fake_pods[0].address, "load.waiting": "nan"})
        time.sleep(1.0)  # ten refreshes, each reading the bad value
        _calls_succeed(router, PROMPT, n=2)
    assert _bad(router, "bad_load") >= 5
    warned = [r for r in caplog.records if "bad_load" in r.getMessage()]
    assert len(warned) == 1 and "load.waiting='nan'" in warned[0].getMessage()


@pytest.mark.parametrize("overrides", [{}, {"redis_max_connections": 4}])
def test_a_burst_larger_than_the_pool_queues_for_it(redis_server, fake_pods, make_router,
                                                    overrides) -> None:
    """300 calls at once while Redis holds every command for 1.5 s (CLIENT PAUSE),
    so every lookup needs its own connection at the same time: redis-py's own pool failed
    past 100 (MaxConnectionsError: the index down, routed by load); now each waits for one
    of the router's (64, or 4 with --redis-max-connections), none fails, none is routed by
    load only."""
    router = make_router(redis_server.url, redis_timeout_s=3.0, **overrides)
    router.wait_pods(3)
    # The fake pods' leases (1 s) would run out during the pause: the same pods again under
    # minute-long leases.
    for i, pod in enumerate(fake_pods):
        _forge_pod(_raw(redis_server.url), f"steady-{i}", {"address": pod.address})
    router.wait_pods(6)
    channel = grpc.insecure_channel(router.address)
    generate = pb_grpc.GenerationStub(channel).Generate
    try:
        _raw(redis_server.url).execute_command("CLIENT", "PAUSE", 1500, "ALL")
        futures = [generate.future(tokens_req([1 + i % 50] + PROMPT), timeout=60)
                   for i in range(300)]
        served = [f.result().served_by for f in futures]
    finally:
        channel.close()
    assert len(served) == 300 and set(served) <= {"fake-a", "fake-b", "fake-c"}
    assert router.metric("pagekv_router_fallback_routes_total", {"cause": "index_down"}) == 0
    assert router.metric("pagekv_router_index_errors_total", {"op": "lookup"}) == 0
    assert router.metric("pagekv_router_index_up") == 1


def test_a_burst_larger_than_a_cluster_nodes_pool_queues_for_it(redis_cluster, make_router
                                                                ) -> None:
    """The same on a Redis Cluster (redis-py's pool there: 100 per node), every call's
    lookup on one shard (one chain, so one bucket), that shard paused 1.5 s."""
    redis_cluster.wait_ok()
    redis_cluster.flush()
    pods = [FakePod(f"fake-{c}", redis_cluster.url) for c in "abc"]
    try:
        router = make_router(redis_cluster.url, redis_timeout_s=3.0)
        router.wait_pods(3)
        raw = connect(redis_cluster.url, 5.0)
        for i, pod in enumerate(pods):
            _forge_pod(raw, f"steady-{i}", {"address": pod.address})
        router.wait_pods(6)
        prepared = router.server.router.prepare(tokens_req(PROMPT + [0]))
        shard = redis_cluster.primary_of(redis_cluster.key_slot(
            SCHEMA.chain_claims_key(prepared.block_hashes)))
        channel = grpc.insecure_channel(router.address)
        generate = pb_grpc.GenerationStub(channel).Generate
        try:
            with redis_cluster.client(shard) as node:
                node.execute_command("CLIENT", "PAUSE", 1500, "ALL")
            futures = [generate.future(tokens_req(PROMPT + [i]), timeout=60)
                       for i in range(300)]
            served = [f.result().served_by for f in futures]
        finally:
            channel.close()
        assert len(served) == 300 and set(served) <= {"fake-a", "fake-b", "fake-c"}
        assert router.metric("pagekv_router_fallback_routes_total",
                             {"cause": "index_down"}) == 0
        assert router.metric("pagekv_router_index_errors_total", {"op": "lookup"}) == 0
    finally:
        for pod in pods:
            pod.close()


@pytest.mark.parametrize("garbage", ["bucket_list", "claim_ids", "claims", "members"])
def test_a_dead_pods_garbage_keys_are_reaped_with_it(redis_server, fake_pods, make_router,
                                                     caplog, garbage: str) -> None:
    """A dead pod (registration, no lease) whose bucket list, claim id set or a bucket's
    claims HASH is a key of another type, or whose lists hold members that are not buckets
    or claim ids: reaped all the same, at the first try (a failure would warn and retry)."""
    r = _raw(redis_server.url)
    _forge_pod(r, "dead", {"address": "127.0.0.1:1"}, lease=False)
    h = bytes.fromhex("ab" * 32)
    bucket = bucket_of(h)
    cid = new_claim_id()
    if garbage == "bucket_list":
        r.set(SCHEMA.pod_buckets_key("dead"), "x")
    else:
        r.sadd(SCHEMA.pod_buckets_key("dead"), bucket)
        if garbage == "claim_ids":
            r.set(SCHEMA.pod_claim_ids_key("dead"), "x")
        elif garbage == "claims":
            r.sadd(SCHEMA.pod_claim_ids_key("dead"), cid.hex())
            r.set(SCHEMA.claims_key(bucket), "x")
        else:
            r.sadd(SCHEMA.pod_buckets_key("dead"), "zz", 5000)
            r.sadd(SCHEMA.pod_claim_ids_key("dead"), cid.hex(), "nothex", "0001")
            r.hset(SCHEMA.claims_key(bucket), claim_field(h), cid + b"\x01")
    with caplog.at_level("WARNING", logger="pagekv.router.pods"):
        router = make_router(redis_server.url, reap_dead_after_s=0.2)
        router.wait_pods(3)
        deadline = time.monotonic() + 10
        while r.exists(SCHEMA.pod_key("dead")) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not [rec for rec in caplog.records if "reaping pod dead failed" in rec.getMessage()]
    assert not r.exists(SCHEMA.pod_key("dead"), SCHEMA.pod_buckets_key("dead"),
                        SCHEMA.pod_claim_ids_key("dead"))
    if garbage == "members":  # its one claim stripped (its field with it)
        assert not r.exists(SCHEMA.claims_key(bucket))
    assert not r.sismember(SCHEMA.pods_key, "dead")
    assert router.metric("pagekv_router_reaped_pods_total") == 1
    assert _calls_succeed(router, PROMPT, n=1)
    _index_stayed_up(router)
