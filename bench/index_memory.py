"""Bytes per (block, pod) claim in the Redis index, and the lookup's time inside Redis
(issue #30: <= 64 B per claim at 256 pods, on a node and on a cluster).

The synthetic fleet of the issue: 200 chains of 32-128 blocks on 20 shared roots (a root's
chains share its first 8-24 blocks), each chain held whole by 1-4 pods (a pod holding two
chains of one root holds their shared blocks once: the claims are the distinct (block, pod)
pairs, ~29k). Each pod is registered and its claims written through the index's own writes
API, as `IndexPublisher` does at a republish (`writes.register_pod`, `writes.write_all_claims`),
into a fresh redis-server, or a fresh 3-primary Redis Cluster (`deploy/redis_cluster.py`),
then 2,000 lookups (a random prefix of a random chain each, every pod passed live) run
through `queries.lookup`, one EVALSHA each.

Per layout:
* **compact** (layout 2, this tree): one claims HASH per bucket, 8-byte fields, 5-byte
  (claim id, tier mask) entries; Redis's default hash encoding limits (a bucket of more than
  512 fields, or a value over 64 bytes: 12 holders, is a hashtable);
* **compact, listpack**: the same with `hash-max-ziplist-entries` / `-value` raised so every
  bucket stays a listpack (ziplist on Redis 6): smaller, but each HMGET walks the list;
* **old** (layout 1, the commit before it, `OLD_COMMIT`): a HASH per block (pod id ->
  "<tiers>:<epoch>") and a per-pod, per-bucket SET of hex hashes, written as that layout's
  CLAIM_WRITES wrote them, looked up by that commit's LOOKUP script (read with `git show`).

Bytes per claim: `used_memory` after the writes less before (every primary's), over the
claims: everything the fleet costs Redis, registrations included; and `MEMORY USAGE` of the
claim keys alone (compact: the claims HASHes; old: block HASHes + per-pod sets). Lookup:
Redis's own `usec_per_call` of EVALSHA (INFO commandstats, reset before the loop).

    python -m bench.index_memory [--pods 16,64,256,1024] [--redis single,cluster]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402

from pagekv.deploy.redis_cluster import LocalRedisCluster  # noqa: E402
from pagekv.deploy.redis_server import RedisProcess  # noqa: E402
from pagekv.proto.index import IndexSchema, bucket_of, connect, queries, writes  # noqa: E402
from pagekv.proto.index.connect import is_cluster  # noqa: E402
from pagekv.proto.index.queries import LivePods  # noqa: E402
from pagekv.proto.index.schema import new_epoch  # noqa: E402
from pagekv.proto.medium import Medium  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OLD_COMMIT = "1e0eb86"  # the last commit of layout 1 (BENCHMARKS §16 measured it)
GOAL_B = 64
OLD_FIGURE = "226-325 B (BENCHMARKS §16: 318-325 B on one node, ~460 B on the cluster)"
DEFAULTS = {"hash-max-ziplist-entries": "512", "hash-max-ziplist-value": "64"}
LISTPACK = {"hash-max-ziplist-entries": "100000", "hash-max-ziplist-value": "1024"}
SCHEMA = IndexSchema("meta-llama/Llama-3.1-8B-Instruct", 16, "sha256", "bench")


# -- the fleet ---------------------------------------------------------------------------------
@dataclass
class Fleet:
    chains: list[list[bytes]]
    held: list[set[bytes]]  # per pod
    bucket: dict[bytes, int]  # every block's bucket (its chain's block 0's)

    @property
    def claims(self) -> int:
        return sum(len(h) for h in self.held)


def _digest(*parts: object) -> bytes:
    return hashlib.sha256("/".join(map(str, parts)).encode()).digest()


def make_fleet(pods: int, seed: int = 0, chains: int = 200, roots: int = 20) -> Fleet:
    """The issue's fleet; the chains depend on the seed only, the holders on the pod count."""
    rng = random.Random(seed)
    root_chains = []
    for r in range(roots):
        prefix: list[bytes] = []
        for j in range(rng.randint(8, 24)):
            prefix.append(_digest("root", r, j, prefix[-1].hex() if prefix else ""))
        root_chains.append(prefix)
    all_chains = []
    for c in range(chains):
        hashes = list(root_chains[c % roots])
        length = rng.randint(32, 128)
        while len(hashes) < length:
            hashes.append(_digest("chain", c, len(hashes), hashes[-1].hex()))
        all_chains.append(hashes)
    pick = random.Random(f"{seed}-holders-{pods}")
    held: list[set[bytes]] = [set() for _ in range(pods)]
    bucket: dict[bytes, int] = {}
    for hashes in all_chains:
        b = bucket_of(hashes[0])
        for h in hashes:
            bucket[h] = b
        for pod in pick.sample(range(pods), min(pods, pick.randint(1, 4))):
            held[pod].update(hashes)
    return Fleet(all_chains, held, bucket)


def lookups(fleet: Fleet, n: int = 2000, seed: int = 1) -> list[list[bytes]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        hashes = rng.choice(fleet.chains)
        out.append(hashes[:rng.randint(1, len(hashes))])
    return out


# -- Redis ---------------------------------------------------------------------------------------
def nodes(client: Any) -> list[redis.Redis]:
    if not is_cluster(client):
        return [client]
    return [client.get_redis_connection(n) for n in client.get_primaries()]


def used_memory(client: Any) -> int:
    return sum(int(n.info("memory")["used_memory"]) for n in nodes(client))


def key_bytes(client: Any, patterns: list[str]) -> int:
    total = 0
    for node in nodes(client):
        for pattern in patterns:
            for key in node.scan_iter(match=pattern, count=1000):
                total += int(node.memory_usage(key, samples=0) or 0)
    return total


def encodings(client: Any, pattern: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in nodes(client):
        for key in node.scan_iter(match=pattern, count=1000):
            enc = node.object("encoding", key)
            name = enc.decode() if isinstance(enc, bytes) else str(enc)
            out[name] = out.get(name, 0) + 1
    return out


def reset(client: Any, config: dict[str, str]) -> None:
    for node in nodes(client):
        node.flushall()
        for name, default in DEFAULTS.items():  # (Redis's own defaults)
            node.config_set(name, config.get(name, default))
        node.config_resetstat()
        node.script_flush()


def evalsha_usec(client: Any) -> tuple[int, float]:
    calls, usec = 0, 0.0
    for node in nodes(client):
        stat = node.info("commandstats").get("cmdstat_evalsha")
        if stat:
            calls += int(stat["calls"])
            usec += float(stat["usec"])
    return calls, usec


def reset_stats(client: Any) -> None:
    for node in nodes(client):
        node.config_resetstat()


# -- the compact layout (this tree) -----------------------------------------------------------
def write_compact(client: Any, fleet: Fleet, pods: list[str]) -> LivePods:
    ids: dict[str, bytes] = {}
    for i, pod in enumerate(pods):
        ids[pod] = writes.register_pod(client, SCHEMA, pod, new_epoch(), f"127.0.0.1:{i + 1}",
                                       SCHEMA.hash_config(), {}, 600_000)
        wanted: dict[int, dict[str, int]] = {}
        for h in fleet.held[i]:
            wanted.setdefault(fleet.bucket[h], {})[h.hex()] = Medium.GPU.bit
        writes.write_all_claims(client, SCHEMA, pod, wanted, ids[pod])
    return LivePods(ids)


def lookup_compact(client: Any, chains: list[list[bytes]], live: LivePods) -> int:
    found = 0
    for hashes in chains:
        found += len(queries.lookup(SCHEMA, hashes, live).run(client))
    return found


# -- the old layout (OLD_COMMIT) -----------------------------------------------------------------
def old_scripts() -> types.ModuleType:
    """OLD_COMMIT's proto/index/scripts.py, as a module of its own."""
    source = subprocess.run(["git", "show", f"{OLD_COMMIT}:proto/index/scripts.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("old_index_scripts")
    sys.modules[module.__name__] = module  # (its dataclass looks its module up)
    exec(compile(source, f"{OLD_COMMIT}:proto/index/scripts.py", "exec"), module.__dict__)
    return module


def write_old(client: Any, old: types.ModuleType, fleet: Fleet, pods: list[str]) -> bytes:
    """Layout 1's keys as its CLAIM_WRITES wrote them (one call per bucket), its pods
    registered as it did; returns its lookup's packed live pods."""
    epochs = {}
    base = SCHEMA.base
    for i, pod in enumerate(pods):
        epoch = epochs[pod] = new_epoch()
        key = base + "p:" + pod
        client.hset(key, mapping={"address": f"127.0.0.1:{i + 1}", "epoch": epoch,
                                  **{f"cfg.{k}": v for k, v in SCHEMA.hash_config().items()
                                     if k != "index_layout"}})
        client.set(base + "l:" + pod, epoch, px=600_000)
        client.sadd(base + "pods", pod)
        by_bucket: dict[int, list[str]] = {}
        for h in fleet.held[i]:
            by_bucket.setdefault(fleet.bucket[h], []).append("1" + h.hex())
        if by_bucket:
            client.sadd(base + "pbk:" + pod, *(f"{b:03x}" for b in by_bucket))
        values = ["G:" + epoch]  # mask 1 only: every claim here is the pool's
        for b, records in by_bucket.items():
            bucket_base = SCHEMA.bucket_base(b)
            for j in range(0, len(records), 512):
                old.CLAIM_WRITES.run(client, [bucket_base + "pb:" + pod],
                                     [pod, "64", "1", *values, bucket_base,
                                      "".join(records[j:j + 512])])
    return ("".join(f"\0{p}\1{e}" for p, e in epochs.items()) + "\0").encode()


def lookup_old(client: Any, old: types.ModuleType, chains: list[list[bytes]],
               live: bytes) -> int:
    found = 0
    for hashes in chains:
        base = SCHEMA.bucket_base(bucket_of(hashes[0]))
        reply = old.LOOKUP.run(client, [base + "b:" + hashes[0].hex()],
                               [base, b"".join(hashes).hex(), live, ""])
        found += (len(reply) - 3) // 3
    return found


# -- one measurement ---------------------------------------------------------------------------
def measure(client: Any, layout: str, fleet: Fleet, n_pods: int,
            chains: list[list[bytes]], old: types.ModuleType) -> dict[str, Any]:
    pods = [f"pod-{i:04d}" for i in range(n_pods)]
    reset(client, LISTPACK if layout == "compact-listpack" else {})
    time.sleep(0.2)
    mem0 = used_memory(client)
    t0 = time.perf_counter()
    if layout == "old":
        live_old = write_old(client, old, fleet, pods)
    else:
        live = write_compact(client, fleet, pods)
    write_s = time.perf_counter() - t0
    mem1 = used_memory(client)
    ns = SCHEMA.namespace
    if layout == "old":
        claim_keys = [f"pagekv:{{{ns}.*}}:b:*", f"pagekv:{{{ns}.*}}:pb:*"]
        enc = encodings(client, f"pagekv:{{{ns}.*}}:b:*")
    else:
        claim_keys = [f"pagekv:{{{ns}.*}}:c"]
        enc = encodings(client, claim_keys[0])
    claims_b = key_bytes(client, claim_keys)
    reset_stats(client)
    t0 = time.perf_counter()
    if layout == "old":
        found = lookup_old(client, old, chains, live_old)
    else:
        found = lookup_compact(client, chains, live)
    loop_s = time.perf_counter() - t0
    calls, usec = evalsha_usec(client)
    return {
        "layout": layout, "pods": n_pods, "claims": fleet.claims,
        "distinct_blocks": len(fleet.bucket), "used_memory_delta": mem1 - mem0,
        "b_per_claim": (mem1 - mem0) / fleet.claims, "claim_keys_b": claims_b,
        "claim_keys_b_per_claim": claims_b / fleet.claims, "encodings": enc,
        "write_s": write_s, "lookups": calls, "holders_found": found,
        "lookup_usec": usec / calls if calls else 0.0,
        "lookup_round_trip_us": loop_s / max(1, len(chains)) * 1e6,
    }


def run(kind: str, pod_counts: list[int], layouts: list[str], n_lookups: int,
        data_dir: Path) -> list[dict[str, Any]]:
    old = old_scripts()
    server: RedisProcess | LocalRedisCluster
    if kind == "single":
        server = RedisProcess(data_dir=data_dir / "single").start()
    else:
        server = LocalRedisCluster(3, 0, data_dir=data_dir / "cluster").start()
    rows = []
    try:
        client = connect(server.url, 30.0)
        if kind == "cluster":
            server.wait_ok()  # type: ignore[union-attr]
        version = nodes(client)[0].info("server")["redis_version"]
        for n in pod_counts:
            fleet = make_fleet(n)
            chains = lookups(fleet, n_lookups)
            for layout in layouts:
                row = measure(client, layout, fleet, n, chains, old)
                row.update(redis=kind, redis_version=version, load=os.getloadavg()[0])
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        client.close()
    finally:
        server.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        f"Goal: <= {GOAL_B} B per claim at 256 pods. Old layout's figure: {OLD_FIGURE}.",
        "",
        "| Redis | pods | claims | layout | B per claim (used_memory) | B per claim (claim keys, "
        "MEMORY USAGE) | encoding | lookup inside Redis µs | round trip µs | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        enc = ", ".join(f"{k} {v}" for k, v in sorted(r["encodings"].items()))
        goal = " ✓" if r["layout"] != "old" and r["b_per_claim"] <= GOAL_B else ""
        out.append(f"| {r['redis']} | {r['pods']} | {r['claims']:,} | {r['layout']} | "
                   f"{r['b_per_claim']:.1f}{goal} | {r['claim_keys_b_per_claim']:.1f} | {enc} | "
                   f"{r['lookup_usec']:.1f} | {r['lookup_round_trip_us']:.0f} | "
                   f"{r['load']:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", default="16,64,256,1024")
    ap.add_argument("--redis", default="single,cluster")
    ap.add_argument("--layouts", default="compact,compact-listpack,old")
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args(argv)
    pod_counts = [int(p) for p in args.pods.split(",")]
    layouts = args.layouts.split(",")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="index-memory-") as tmp:
        for kind in args.redis.split(","):
            rows += run(kind, pod_counts, layouts, args.lookups, Path(tmp))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
