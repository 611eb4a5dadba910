"""Cache control end to end: real pods as processes (pool, DRAM and SSD tiers), a real Redis,
the router in-process, the OpenAI HTTP API and gRPC. A pinned prefix outlives a flood; a
one-shot flood leaves DRAM and SSD as they were; a session's turns stay on its pod; the pods'
/metrics show it; the greedy tokens of every hit equal the cold run's.
"""

from __future__ import annotations

import random
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
import redis

from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.index import lookup_prefix
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from tests.integration.router_fixtures import SCHEMA, SEED, pod_cluster, stopped, tokens_req

pytestmark = pytest.mark.integration

# pagekv-tiny: 8 KiB a block of 16 tokens. The pool holds 256 blocks (4,096 tokens), DRAM 64,
# the SSD ~256: a flood of 8 prompts of 2,200 tokens (1,100 blocks) passes through all three.
POD_ARGS = ["--num-gpu-blocks", "256", "--max-model-len", "4096", "--lease-ttl-s", "1.5",
            "--cpu-offload-bytes", "512KiB", "--disk-offload-bytes", "2MiB",
            "--retained-pool-bytes", "1536KiB", "--max-num-batched-tokens", "2048",
            "--session-idle-s", "120"]


@pytest.fixture(scope="module")
def cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    run_dir = tmp_path_factory.mktemp("cache-control")
    pods = {name: ["--disk-offload-dir", str(run_dir / f"ssd-{name}")]
            for name in ("node-a", "node-b")}
    with pod_cluster(redis_binary, run_dir, POD_ARGS, pods) as cluster:
        yield cluster


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


def stub(address: str) -> tuple[pb_grpc.GenerationStub, pb_grpc.KVNodeStub]:
    channel = grpc.insecure_channel(address)
    return pb_grpc.GenerationStub(channel), pb_grpc.KVNodeStub(channel)


def reset(cluster: Any) -> None:
    for pod in cluster.pods:
        assert stub(pod.address)[1].ResetPrefixCache(
            pb.ResetPrefixCacheRequest(include_tiers=True), timeout=30).success


def tier_entries(address: str) -> dict[str, int]:
    stats = stub(address)[1].Stats(pb.StatsRequest(), timeout=10)
    return {t.tier: t.entries for t in stats.tiers}


def pod_metric(cluster: Any, pod_name: str, name: str, labels: str = "") -> float:
    pod = next(p for p in cluster.pods if p.name == pod_name)
    host = pod.address.rsplit(":", 1)[0]
    url = f"http://{host}:{pod.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read()
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def complete(router: Any, prompt: list[int], **extra: Any) -> dict[str, Any]:
    """A completion through the router's OpenAI API, with OpenAI's own client (PageKV's
    fields as its extra_body), as a plain dict."""
    client = openai.OpenAI(base_url=router.http_url, api_key="none", timeout=120)
    resp = client.completions.create(model="pagekv-tiny", prompt=prompt, max_tokens=4,
                                     temperature=0,
                                     extra_body={"ignore_eos": True, **extra})
    return resp.model_dump()


def test_a_pinned_prefix_outlives_a_flood_of_every_tier(cluster, make_router) -> None:
    reset(cluster)
    router = make_router(cluster.redis_url)
    router.wait_pods(2)
    prefix = [256] + tokens(1, 2047)  # 2,048 tokens: 128 blocks
    question = tokens(2, 20)
    cold = complete(router, prefix + question, cache_control={"type": "ephemeral", "ttl": "1h",
                                                              "tokens": 2048})
    home = cold["pagekv"]["served_by"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    address = next(p.address for p in cluster.pods if p.name == home)
    gen = stub(address)[0]
    for i in range(8):  # straight to the pod: 8 x 2,200 tokens, more than pool + DRAM + SSD
        gen.Generate(tokens_req([256] + tokens(100 + i, 2199)), timeout=120)
    entries = tier_entries(address)
    assert entries.get("CPU", 0) > 0 and entries.get("DISK", 0) > 0  # the flood went below
    again = complete(router, prefix + question)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 2048
    assert again["choices"][0]["text"] == cold["choices"][0]["text"]
    assert pod_metric(cluster, home, "pagekv_pod_retained_blocks", 'tier="GPU"') == 128
    assert pod_metric(cluster, home, "pagekv_pod_retained_spared_total") > 0
    # An unpinned prefix of the same size, sent the same way, does not survive it.
    other = [256] + tokens(3, 2047)
    gen.Generate(tokens_req(other + question), timeout=120)
    for i in range(8):
        gen.Generate(tokens_req([256] + tokens(200 + i, 2199)), timeout=120)
    lost = gen.Generate(tokens_req(other + question), timeout=120)
    assert lost.usage.cached_tokens < 2048


def settled_entries(address: str) -> dict[str, int]:
    """The tiers' entries once the SSD's write-behind has caught up (two equal reads)."""
    last = tier_entries(address)
    for _ in range(50):
        time.sleep(0.2)
        now = tier_entries(address)
        if now == last:
            return now
        last = now
    return last


def test_one_shot_requests_leave_dram_and_ssd_as_they_were(cluster) -> None:
    reset(cluster)
    pod = cluster.pods[0]
    gen = stub(pod.address)[0]
    for i in range(3):  # some of everything below the pool first
        gen.Generate(tokens_req([256] + tokens(300 + i, 2199)), timeout=120)
    prompts = [[256] + tokens(400 + i, 2199) for i in range(7)]

    def one_shot(prompt: list[int]) -> None:
        req = tokens_req(prompt)
        req.one_shot = True
        gen.Generate(req, timeout=120)

    # The first one makes room in a full pool as any request does (others' LRU blocks go
    # down a tier); from then on each one-shot reuses the last one's blocks first.
    one_shot(prompts[0])
    before = settled_entries(pod.address)
    for prompt in prompts[1:]:  # 6 x 2,200 tokens: 3x the pool
        one_shot(prompt)
    after = settled_entries(pod.address)
    assert (after.get("CPU", 0), after.get("DISK", 0)) == (before.get("CPU", 0),
                                                           before.get("DISK", 0))
    # None of their blocks is held below the pool (nor in it: the next one took them).
    client = redis.Redis.from_url(cluster.redis_url)
    for prompt in prompts[:-1]:
        held = lookup_prefix(client, SCHEMA, hash_prompt(HashConfig("sha256", SEED), 16,
                                                        prompt))
        assert all(m.depth == 0 for m in held.values()), held
    bad = tokens_req([1, 2, 3])
    bad.one_shot, bad.session_id = True, "s"
    with pytest.raises(grpc.RpcError) as err:
        gen.Generate(bad, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one_shot" in err.value.details()


def test_a_sessions_turns_stay_on_its_pod(cluster, make_router) -> None:
    reset(cluster)
    router = make_router(cluster.redis_url, session_idle_s=120.0)
    router.wait_pods(2)
    history = [256] + tokens(7, 300)
    served = []
    for turn in range(4):
        req = tokens_req(history + tokens(500 + turn, 30), max_tokens=4)
        req.session_id = "agent-1"
        resp = router.stub.Generate(req, timeout=120)
        served.append(resp.served_by)
        history = history + tokens(500 + turn, 30) + list(resp.completions[0].token_ids)
        if turn:
            assert resp.usage.cached_tokens >= 300
        time.sleep(0.2)
    assert len(set(served)) == 1
    assert router.metric("pagekv_router_session_routes_total", {"outcome": "kept"}) == 3
    assert router.metric("pagekv_router_session_routes_total", {"outcome": "new"}) == 1
    assert pod_metric(cluster, served[0], "pagekv_pod_retained_marks") > 0


def admin(address: str) -> pb_grpc.CacheAdminStub:
    return pb_grpc.CacheAdminStub(grpc.insecure_channel(address))


def prefix_query(ids: list[int]) -> pb.PrefixQuery:
    return pb.PrefixQuery(token_ids=pb.TokenIds(ids=ids))


def test_where_is_it_and_delete_through_the_router(cluster, make_router) -> None:
    reset(cluster)
    router = make_router(cluster.redis_url)
    router.wait_pods(2)
    prefix = [256] + tokens(11, 1023)  # 64 blocks
    first = router.stub.Generate(tokens_req(prefix + tokens(12, 10)), timeout=120)
    home = first.served_by
    pinned = tokens_req(prefix[:512] + tokens(13, 5))
    pinned.cache_control.ttl_s = 600
    pinned.cache_control.tokens = 512
    admin_stub = admin(router.address)
    home_address = next(p.address for p in cluster.pods if p.name == home)
    stub(home_address)[0].Generate(pinned, timeout=120)
    where = admin_stub.Locate(prefix_query(prefix), timeout=60)
    by_pod = {h.pod_id: h for h in where.pods}
    assert set(by_pod) == {"node-a", "node-b"} and not any(h.error for h in where.pods)
    assert by_pod[home].prefix_blocks == 64 and by_pod[home].gpu_blocks == 64
    assert by_pod[home].pinned_blocks == 32
    assert where.total_blocks == 64
    for pod in cluster.pods:  # each pod's own answer is the router's line for it
        own = admin(pod.address).Locate(prefix_query(prefix), timeout=60).pods[0]
        assert own == by_pod[pod.name]
    assert pod_metric(cluster, home, "pagekv_pod_retained_blocks", 'tier="GPU"') == 32
    # By the hash of its last block: the pod walks the chain back to the root.
    last = hash_prompt(HashConfig("sha256", SEED), 16, prefix)[-1]
    by_hash = admin_stub.Locate(pb.PrefixQuery(prefix_hash=last), timeout=60)
    assert {h.pod_id: h.gpu_blocks for h in by_hash.pods}[home] == 64

    gone = admin_stub.DeletePrefix(prefix_query(prefix), timeout=60)
    assert gone.total_blocks == 64
    assert {h.pod_id: h.pinned_blocks for h in gone.pods}[home] == 32  # marks released
    assert admin_stub.Locate(prefix_query(prefix), timeout=60).total_blocks == 0
    client = redis.Redis.from_url(cluster.redis_url)
    hashes = hash_prompt(HashConfig("sha256", SEED), 16, prefix)
    deadline = time.monotonic() + 10
    while any(m.depth for m in lookup_prefix(client, SCHEMA, hashes).values()):
        assert time.monotonic() < deadline, "the index still holds the deleted prefix"
        time.sleep(0.1)
    again = stub(home_address)[0].Generate(tokens_req(prefix + tokens(12, 10)), timeout=120)
    assert again.usage.cached_tokens == 0
    assert list(again.completions[0].token_ids) == list(first.completions[0].token_ids)
    with pytest.raises(grpc.RpcError) as err:
        admin_stub.Locate(pb.PrefixQuery(), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_prewarm_pulls_from_a_holder_and_the_first_call_is_a_full_hit(cluster,
                                                                     make_router) -> None:
    reset(cluster)
    router = make_router(cluster.redis_url)
    router.wait_pods(2)
    prefix = [256] + tokens(21, 1535)  # 96 blocks
    a, b = cluster.pods[0], cluster.pods[1]
    cold = stub(a.address)[0].Generate(tokens_req(prefix + tokens(22, 9)), timeout=120)
    client = redis.Redis.from_url(cluster.redis_url)
    hashes = hash_prompt(HashConfig("sha256", SEED), 16, prefix)
    deadline = time.monotonic() + 10
    while (m := lookup_prefix(client, SCHEMA, hashes).get(a.name)) is None or m.depth < 95:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    warmed = admin(router.address).Prewarm(
        pb.PrewarmRequest(pod_id=b.name, token_ids=pb.TokenIds(ids=prefix)), timeout=300)
    assert warmed.pod_id == b.name and warmed.source == a.name
    assert warmed.pulled_tokens >= 95 * 16 and warmed.prompt_tokens == 1536
    first = stub(b.address)[0].Generate(tokens_req(prefix + tokens(22, 9)), timeout=120)
    assert first.usage.cached_tokens == 1536  # the request's first call: every prefix block
    assert list(first.completions[0].token_ids) == list(cold.completions[0].token_ids)
    # A cold fleet: the pod computes it, and says so.
    fresh = [256] + tokens(23, 511)
    computed = admin(router.address).Prewarm(
        pb.PrewarmRequest(pod_id=b.name, token_ids=pb.TokenIds(ids=fresh)), timeout=300)
    assert computed.source == "" and computed.computed_tokens == 512
    with pytest.raises(grpc.RpcError) as err:
        admin(router.address).Prewarm(pb.PrewarmRequest(pod_id="nobody",
                                                        token_ids=pb.TokenIds(ids=fresh)))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_admin_calls_need_the_admin_token_and_refusals_are_counted(cluster,
                                                                  make_router) -> None:
    router = make_router(cluster.redis_url, admin_token="s3cret-admin")
    router.wait_pods(2)
    admin_stub = admin(router.address)
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as err:
            admin_stub.Locate(prefix_query([1, 2, 3]), metadata=metadata, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ok = admin_stub.Locate(prefix_query([256] + tokens(31, 40)),
                           metadata=(("authorization", "Bearer s3cret-admin"),), timeout=30)
    assert len(ok.pods) == 2
    refused = sum(router.metric("pagekv_router_auth_refused_total",
                                {"method": "Locate", "code": code})
                  for code in ("UNAUTHENTICATED", "PERMISSION_DENIED"))
    assert refused == 2
    # Generation stays open (no --api-token on this router).
    assert router.stub.Generate(tokens_req([256, 1, 2]), timeout=60).served_by


def test_the_cache_command_locates_prewarms_and_deletes(cluster, make_router) -> None:
    import subprocess
    import sys

    reset(cluster)
    router = make_router(cluster.redis_url)
    router.wait_pods(2)
    ids = ",".join(str(t) for t in [256] + tokens(41, 319))  # 20 blocks

    def cache(*argv: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pagekv", "cache", *argv, "--target",
                               router.address, "--token-ids", ids],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    warmed = cache("prewarm", "--pod", "node-b", "--pin-ttl-s", "600")
    assert warmed.startswith("node-b: 320 tokens ready") and "320 computed" in warmed
    where = cache("locate")
    assert "node-b: 20 of 20 blocks held (pool 20, DRAM 0, SSD 0; pinned 20)" in where
    assert "node-a: 0 of 20 blocks held" in where
    assert "total: 20 blocks" in cache("delete")
    assert "total: 0 blocks" in cache("locate")


def test_a_stopped_pod_is_listed_with_its_error_not_waited_on(cluster, make_router) -> None:
    router = make_router(cluster.redis_url)
    router.wait_pods(2)
    start = time.monotonic()
    with stopped(cluster.pods[1]):
        where = admin(router.address).Locate(prefix_query([256] + tokens(51, 40)), timeout=60)
    assert time.monotonic() - start < 20
    by_pod = {h.pod_id: h for h in where.pods}
    # (the call's deadline, or the channel's keepalive ping first: either is the pod's error)
    assert by_pod["node-b"].error.split(":")[0] in ("DEADLINE_EXCEEDED", "UNAVAILABLE")
    assert not by_pod["node-a"].error and by_pod["node-a"].prefix_blocks == 2


def test_a_scale_out_pod_prewarms_its_peers_hottest_prefixes(cluster, make_router) -> None:
    from pagekv.deploy.local_cluster import stop_child, wait_healthy

    reset(cluster)
    a = cluster.pods[0]
    gen = stub(a.address)[0]
    hot = [256] + tokens(61, 639)  # 40 blocks, hit three times
    cold = gen.Generate(tokens_req(hot + tokens(62, 9)), timeout=120)
    for i in range(3):
        gen.Generate(tokens_req(hot + tokens(63 + i, 9)), timeout=120)
    cool = [256] + tokens(70, 319)  # 20 blocks, hit once
    for i in range(2):
        gen.Generate(tokens_req(cool + tokens(71 + i, 9)), timeout=120)
    listed = admin(a.address).HotPrefixes(pb.HotPrefixesRequest(limit=4), timeout=30)
    assert [(list(p.token_ids.ids), p.hits) for p in listed.prefixes] == [(hot, 3), (cool, 1)]
    router = make_router(cluster.redis_url)
    router.wait_pods(2)
    merged = admin(router.address).HotPrefixes(pb.HotPrefixesRequest(limit=1), timeout=30)
    assert [(p.pod_id, p.hits) for p in merged.prefixes] == [(a.name, 3)]
    # A scale-out: a new pod warms the hottest prefix of its peers by pulling it.
    c = cluster.start_pod("node-c", ["--disk-offload-dir", str(cluster.run_dir / "ssd-node-c"),
                                     "--prewarm-hottest", "1"])
    try:
        wait_healthy(c.address, 120, c.proc)
        deadline = time.monotonic() + 60
        while pod_metric(cluster, "node-c", "pagekv_pod_prewarm_peer_prefixes_total",
                         'outcome="warmed"') < 1:
            assert time.monotonic() < deadline, "node-c did not pre-warm"
            time.sleep(0.2)
        assert pod_metric(cluster, "node-c", "pagekv_pod_prewarm_peer_tokens_total",
                          'source="pulled"') >= 39 * 16
        first = stub(c.address)[0].Generate(tokens_req(hot + tokens(62, 9)), timeout=120)
        assert first.usage.cached_tokens == 640  # its first call: the whole hot prefix
        assert list(first.completions[0].token_ids) == list(cold.completions[0].token_ids)
    finally:
        stop_child(c)
        cluster.pods.remove(c)
        cluster.children.remove(c)
