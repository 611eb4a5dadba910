"""The measured figures of docs/INDEX.md (the bucketed layout, one node and a Redis Cluster):
memory per block, lookup cost against the number of live pods a router passes, the registry
read, one shard's lookup rate, and how the 1024 buckets spread over S shards.

    .venv/bin/python scripts/index_figures.py            # ~1 min, private servers on loopback

Everything runs on private redis-servers (RedisProcess, LocalRedisCluster); server-side
times are Redis's own `INFO commandstats` (usec_per_call), round trips are this client's.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from redis.crc import key_slot  # noqa: E402

from pagekv.deploy.redis_cluster import LocalRedisCluster, slot_ranges  # noqa: E402
from pagekv.deploy.redis_server import RedisProcess  # noqa: E402
from pagekv.proto.index import (  # noqa: E402
    BUCKETS,
    IndexSchema,
    bucket_of,
    connect,
    queries,
    writes,
)
from pagekv.proto.index.queries import LivePods  # noqa: E402
from pagekv.proto.index.schema import claim_field, new_epoch  # noqa: E402

SCHEMA = IndexSchema("meta-llama/Llama-3.1-8B-Instruct", 16, "sha256", "vllm-none-hash")


def chains(n_chains: int, length: int, tag: str = "c") -> list[list[bytes]]:
    return [[hashlib.sha256(f"{tag}{c}/{i}".encode()).digest() for i in range(length)]
            for c in range(n_chains)]


def publish(client: Any, pod: str, blocks: list[list[bytes]], epoch: str) -> bytes:
    """What a pod's full republish writes: its registration, then its claims (GPU).
    Returns its claim id."""
    claim_id = writes.register_pod(client, SCHEMA, pod, epoch, "127.0.0.1:1",
                                   SCHEMA.hash_config(), {}, 600_000)
    wanted: dict[int, dict[str, int]] = {}
    for chain in blocks:
        bucket = bucket_of(chain[0])
        wanted.setdefault(bucket, {}).update((h.hex(), 1) for h in chain)
    writes.write_all_claims(client, SCHEMA, pod, wanted, claim_id)
    return claim_id


def memory(r: Any) -> None:
    n_chains, length = 1000, 100  # 100 000 blocks
    blocks = chains(n_chains, length)
    base = r.info("memory")["used_memory"]
    publish(r, "pod-a", blocks, new_epoch())
    one = r.info("memory")["used_memory"]
    publish(r, "pod-b", blocks, new_epoch())
    two = r.info("memory")["used_memory"]
    n = n_chains * length
    key = SCHEMA.chain_claims_key(blocks[0])
    fields = r.hlen(key)
    print(f"memory, {n} blocks in {n_chains} chains (a bucket's claims HASH: {fields} fields, "
          f"{r.object('encoding', key)}):")
    print(f"  claims HASH per field, 2 claims (MEMORY USAGE): "
          f"{r.memory_usage(key, samples=0) / fields:.0f} B")
    print(f"  a field's value: {len(r.hget(key, claim_field(blocks[0][0])))} B")
    print(f"  used_memory per block: 1 pod {(one - base) / n:.0f} B, 2 pods {(two - base) / n:.0f} B")
    for pod in ("pod-a", "pod-b"):
        writes.clear_pod_claims(r, SCHEMA, pod)
        writes.unregister_pod(r, SCHEMA, pod)
    print(f"  after both clean stops: {r.info('memory')['used_memory'] - base:+d} B")


def usec_per_call(nodes: list[Any], command: str) -> float:
    calls = usec = 0
    for node in nodes:
        stat = node.info("commandstats").get(f"cmdstat_{command}")
        if stat:
            calls += stat["calls"]
            usec += stat["usec"]
    return usec / calls if calls else float("nan")


def lookups(client: Any, nodes: list[Any], label: str) -> None:
    """Lookup of a 32-block chain with N live pods passed: one pod holding it all, or all."""
    chain = chains(1, 32, "lookup")[0]
    print(f"lookup, 32 blocks, {label} (round trip p50/p99, server time per call):")
    for n_pods in (16, 64, 256):
        pods = [f"pod-{i:03d}" for i in range(n_pods)]
        ids: dict[str, bytes] = dict.fromkeys(pods, b"")
        for holders in (1, n_pods):
            for pod in pods[:holders]:
                ids[pod] = ids[pod] or publish(client, pod, [chain], new_epoch())
            live = LivePods(ids)
            call = queries.lookup(SCHEMA, chain, live)
            for node in nodes:
                node.config_resetstat()
            times = []
            for _ in range(1000):
                t0 = time.perf_counter()
                got = call.run(client)
                times.append((time.perf_counter() - t0) * 1e6)
            assert sum(m.depth == 32 for m in got.values()) == holders
            times.sort()
            args = sum(len(a) for a in call.args)  # no pods among them
            print(f"  {n_pods:3d} pods, {holders:3d} holding: {times[500]:6.0f} / "
                  f"{times[990]:6.0f} us, server {usec_per_call(nodes, 'evalsha'):6.0f} us "
                  f"(ARGV {args} B)")
        for pod in pods:
            writes.clear_pod_claims(client, SCHEMA, pod)
            writes.unregister_pod(client, SCHEMA, pod)


def registry_read(client: Any, nodes: list[Any]) -> None:
    print("registry refresh (LIVE_PODS: every registration, one script on the control shard):")
    for n_pods in (16, 64, 256):
        for i in range(n_pods):
            writes.register_pod(client, SCHEMA, f"pod-{i:03d}", new_epoch(), "127.0.0.1:1",
                                SCHEMA.hash_config(), {"load.waiting": "1", "cost.GPU": "0"},
                                600_000)
        for node in nodes:
            node.config_resetstat()
        t0 = time.perf_counter()
        for _ in range(200):
            assert len(queries.list_live_pods(client, SCHEMA)) == n_pods
        wall = (time.perf_counter() - t0) / 200 * 1e6
        print(f"  {n_pods:3d} pods: {wall:6.0f} us round trip, "
              f"server {usec_per_call(nodes, 'evalsha'):6.0f} us")
        for i in range(n_pods):
            writes.unregister_pod(client, SCHEMA, f"pod-{i:03d}")


def spread() -> None:
    """Buckets per shard (S shards with equal slot ranges): max / mean, over 20 namespaces."""
    print(f"spread of the {BUCKETS} bucket tags over S shards (max / mean buckets per shard, "
          "worst of 20 namespaces):")
    for shards in (3, 6, 12, 24, 48, 96, 192):
        ranges = slot_ranges(shards)
        worst = 0.0
        for seed in range(20):
            ns = IndexSchema("m", 16, "sha256", f"seed-{seed}")
            counts = [0] * shards
            for bucket in range(BUCKETS):
                slot = key_slot(ns.bucket_base(bucket).encode())
                counts[next(i for i, r in enumerate(ranges) if slot in r)] += 1
            worst = max(worst, max(counts) / statistics.mean(counts))
        print(f"  S={shards:3d}: {BUCKETS / shards:6.1f} buckets each, max/mean {worst:.2f}")


def main() -> None:
    spread()
    with RedisProcess() as single:
        r = connect(single.url, 10.0)
        memory(r)
        lookups(r, [r], "one node")
        registry_read(r, [r])
        r.close()
    with LocalRedisCluster(3, 0) as cluster:
        c = connect(cluster.url, 10.0)
        nodes = [cluster.client(n) for n in cluster.primaries()]
        lookups(c, nodes, "3-shard cluster")
        c.close()


if __name__ == "__main__":
    main()
