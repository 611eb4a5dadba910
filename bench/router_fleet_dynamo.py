"""bench.router_fleet's Dynamo side: NVIDIA Dynamo's KV router (ai-dynamo-runtime 1.6.1) on
the same fleet, in a process of its own, run by the Python of Dynamo's venv (the standard
library and `dynamo` only: no PageKV import here).

The parent writes the fleet as JSON (the requests' tokens; per pod its BlockStored runs with
vLLM's 64-bit block hashes and their tokens; per pod probes: a held chain and its length)
and sends one JSON command a line on stdin; each answer is one JSON line on stdout.

* `load_tree`: a `RadixTree` fed every run as a Dynamo KvCacheEvent (`apply_event`): its
  RSS before and after, for the bytes per claim of the index alone;
* `upsert`: workers added to an in-process `SelectionService`, each subscribed to its pod's
  ZeroMQ endpoint, where the parent publishes the pod's events in vLLM's wire format;
* `verify`: which pods' probes the service does not see whole yet (events still on their way);
* `select_pass`: `SelectionService.select` (hashing, the indexer's lookup, the scoring of
  every worker, no booking) on every request, timed: the process's CPU time (every thread of
  it, Dynamo's own included) and each call's wall time; the chosen pods;
* `radix_pass`: `RadixTree.find_matches` alone on every request's block hashes (hashed
  before the clock starts, that hashing timed apart); the deepest match, for a check against
  the oracle.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from typing import Any

from dynamo.llm import RadixTree, SelectionService, compute_block_hash_for_seq

MODEL = "fleet"


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class DynamoSide:
    def __init__(self, fleet: dict[str, Any], indexer_threads: int) -> None:
        self.bs = int(fleet["block_size"])
        self.requests: list[list[int]] = fleet["requests"]
        self.runs: list[list[list[Any]]] = fleet["runs"]  # pod -> [hashes, parent, tokens]
        self.probes: list[list[list[Any]]] = fleet["probes"]  # pod -> [tokens, blocks]
        self.service = SelectionService(indexer_threads=indexer_threads)
        self.tree: RadixTree | None = None

    def load_tree(self) -> dict[str, Any]:
        """The events are built before the first RSS reading and kept past the second, so
        that its growth is the tree's alone."""
        payloads: list[tuple[int, bytes]] = []
        for pod, runs in enumerate(self.runs):
            for hashes, parent, tokens in runs:
                local = compute_block_hash_for_seq(tokens, self.bs)
                event = {"event_id": len(payloads), "data": {"stored": {
                    "parent_hash": parent,
                    "blocks": [{"block_hash": h, "tokens_hash": t}
                               for h, t in zip(hashes, local, strict=True)]}}}
                payloads.append((pod + 1, json.dumps(event).encode()))
        probe = compute_block_hash_for_seq(self.requests[0], self.bs)
        tree = RadixTree()
        tree.find_matches(probe)  # its thread up
        gc.collect()
        before = rss_bytes()
        t0 = time.perf_counter()
        for worker, payload in payloads:
            tree.apply_event(worker, payload)
        tree.find_matches(probe)  # (after every event: one thread applies them in order)
        seconds = time.perf_counter() - t0
        after = rss_bytes()
        self.tree = tree
        return {"rss_before": before, "rss_after": after, "seconds": seconds,
                "events": len(payloads)}

    async def upsert(self, workers: list[dict[str, Any]]) -> dict[str, Any]:
        for w in workers:
            rec = await self.service.upsert_worker({
                "worker_id": w["pod"] + 1, "model_name": MODEL,
                "endpoint": f"http://pod-{w['pod']}.fleet.invalid:8000",
                "kv_events_endpoint": w["kv"], "replay_endpoint": w.get("replay"),
                "block_size": self.bs})
            if rec.get("lifecycle") != "schedulable":
                return {"error": f"worker {w['pod']}: {rec}"}
        return {"ok": True}

    async def verify(self, pods: list[int]) -> dict[str, Any]:
        missing = []
        for pod in pods:
            for tokens, blocks in self.probes[pod]:
                r = await self.service.overlap_scores({"model_name": MODEL, "token_ids": tokens})
                got = next((w["device_blocks"] for w in r["workers"]
                            if w["worker_id"] == pod + 1), 0)
                if got < blocks:
                    missing.append(pod)
                    break
        return {"missing": missing}

    async def select_pass(self) -> dict[str, Any]:
        select = self.service.select
        chosen: list[int] = []
        lat: list[float] = []
        gc.collect()
        c0, w0 = time.process_time(), time.perf_counter()
        for tokens in self.requests:
            t = time.perf_counter()
            r = await select({"model_name": MODEL, "token_ids": tokens})
            lat.append((time.perf_counter() - t) * 1e3)
            chosen.append(int(r["worker_id"]) - 1)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        return {"cpu_s": cpu, "wall_s": wall, "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99),
                "chosen": chosen}

    def radix_pass(self) -> dict[str, Any]:
        assert self.tree is not None, "load_tree first"
        c0 = time.process_time()
        seqs = [compute_block_hash_for_seq(t, self.bs) for t in self.requests]
        hash_cpu = time.process_time() - c0
        find = self.tree.find_matches
        best: list[int] = []
        gc.collect()
        c0, w0 = time.process_time(), time.perf_counter()
        for seq in seqs:
            best.append(max(find(seq).scores.values(), default=0))
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        return {"cpu_s": cpu, "wall_s": wall, "hash_cpu_s": hash_cpu, "best": best}


async def serve(side: DynamoSide) -> None:
    loop = asyncio.get_running_loop()
    out = sys.stdout
    out.write(json.dumps({"ready": True, "rss": rss_bytes()}) + "\n")
    out.flush()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "quit":
                break
            if op == "load_tree":
                reply = side.load_tree()
            elif op == "upsert":
                reply = await side.upsert(cmd["workers"])
            elif op == "verify":
                reply = await side.verify(cmd["pods"])
            elif op == "select_pass":
                reply = await side.select_pass()
            elif op == "radix_pass":
                reply = side.radix_pass()
            elif op == "rss":
                reply = {"rss": rss_bytes()}
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # noqa: BLE001 - told to the parent, which fails the run
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    side.service.shutdown()


def main() -> int:
    path, threads = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4
    with open(path) as f:
        fleet = json.load(f)
    asyncio.run(serve(DynamoSide(fleet, threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
