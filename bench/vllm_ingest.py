"""vLLM event ingestion: what `pagekv ingest-vllm` costs, against the published figure to
stay below (event ingestion at 0.16% of a router CPU).

A publisher in vLLM's format (XPUB on loopback, payloads encoded before the clock starts:
int hashes, tagged-map events, as vLLM sends by default) feeds a real `pagekv ingest-vllm`
process writing into a real redis-server. The workload is a vLLM pod's: each batch stores a
run of blocks (a new prompt, or the continuation of one: the ingester recomputes every full
hash from tokens and parent) and, once the pool is full, removes as many of the oldest.

* throughput — every batch at once: ingester CPU seconds (user + system, from /proc) per
  event and per block, i.e. events/s on one core;
* idle — the process with no events (its lease, its timers);
* paced — a realistic rate (default 100 batches/s of one store and one removal of 8 blocks:
  1,600 block changes/s, a pod prefilling ~12,800 tokens/s at block size 16): the ingester's
  share of one core, and the index lag, a batch's send to its first block visible in Redis
  (measured by polling Redis), p50/p99.

    python -m bench.vllm_ingest [--quick] [--rate 100] [--seconds 10] [--batches 20000]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402
import zmq  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from bench.stats import pct  # noqa: E402
from pagekv.deploy.local_cluster import pagekv_cmd, spawn, stop_child  # noqa: E402
from pagekv.kvnode.pod.redis_server import RedisProcess, free_port  # noqa: E402
from pagekv.proto.hashing import DEFAULT_HASH_SEED, HashConfig, RequestBlockHasher  # noqa: E402
from pagekv.proto.index import IndexSchema  # noqa: E402
from pagekv.proto.index.schema import bucket_of  # noqa: E402
from pagekv.proto.vllm_events import (  # noqa: E402
    WireBlockRemoved,
    WireBlockStored,
    encode_batch,
    seq_to_bytes,
    short_hash,
)

PUBLISHED_SHARE = 0.0016  # event ingestion at 0.16% of a router CPU
BS = 16
SCHEMA = IndexSchema("pagekv-tiny", BS, "sha256", DEFAULT_HASH_SEED)
TOPIC = b"kv-events"
POD = "vllm-bench"


class Workload:
    """A vLLM pod's batches: runs stored on new or continued chains, the oldest removed
    once `pool` blocks are held. Each batch remembers the block key of its first stored
    block (to see it land in Redis)."""

    def __init__(self, blocks_per_event: int, pool: int, seed: int = 0) -> None:
        self.k = blocks_per_event
        self.pool = pool
        self.rng = random.Random(seed)
        self.hasher = RequestBlockHasher(HashConfig(SCHEMA.hash_algo, SCHEMA.hash_seed), BS)
        self.chains: list[tuple[list[int], list[bytes]]] = []
        self.held: deque[bytes] = deque()
        self.events = self.blocks = 0

    def batch(self) -> tuple[list, str]:
        k, rng = self.k, self.rng
        if not self.chains or rng.random() < 0.5 or len(self.chains[-1][1]) >= 64:
            self.chains.append(([], []))
            if len(self.chains) > 32:
                self.chains.pop(0)
            tokens, hashes = self.chains[-1]
        else:
            tokens, hashes = self.chains[rng.randrange(len(self.chains))]
        start = len(hashes)
        tokens += [rng.randrange(1, 32000) for _ in range(k * BS)]
        self.hasher.extend(tokens, hashes)
        new = hashes[start:]
        parent = short_hash(hashes[start - 1]) if start else None
        events: list = [WireBlockStored([short_hash(h) for h in new], parent,
                                        tokens[start * BS:], BS, None, "GPU", None)]
        self.held.extend(new)
        if len(self.held) > self.pool:
            gone = [self.held.popleft() for _ in range(k)]
            events.append(WireBlockRemoved([short_hash(h) for h in gone], "GPU"))
        self.events += len(events)
        self.blocks += sum(len(e.block_hashes) for e in events)
        return events, SCHEMA.block_key(new[0], bucket_of(hashes[0]))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def last_seq(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    for line in text.decode().splitlines():
        if line.startswith("pagekv_ingest_last_seq"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def metric_sum(metrics_port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith(name))


class LagWatcher(threading.Thread):
    """Polls Redis for each sent batch's first block: send -> visible, in seconds."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.pending: deque[tuple[str, float]] = deque()
        self.lags: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() or self.pending:
            batch = list(self.pending)[:256]
            if not batch:
                time.sleep(0.0005)
                continue
            pipe = self.client.pipeline(transaction=False)
            for key, _ in batch:
                pipe.hexists(key, POD)
            seen = pipe.execute()
            now = time.time()
            for (key, sent), there in zip(batch, seen, strict=True):
                if there:
                    self.lags.append(now - sent)
                    self.pending.remove((key, sent))
            time.sleep(0.0005)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run of each phase")
    ap.add_argument("--batches", type=int, default=20_000, help="the throughput phase")
    ap.add_argument("--rate", type=float, default=100.0, help="batches/s, the paced phase")
    ap.add_argument("--seconds", type=float, default=10.0, help="the paced phase")
    ap.add_argument("--blocks-per-event", type=int, default=8)
    ap.add_argument("--pool", type=int, default=20_000, help="blocks the pod holds")
    ap.add_argument("--idle-seconds", type=float, default=5.0, help="the idle phase")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.seconds, args.idle_seconds = 3000, 3.0, 2.0
    run_dir = Path(tempfile.mkdtemp(prefix="pagekv-bench-ingest-"))
    work = Workload(args.blocks_per_event, args.pool)
    n_paced = int(args.rate * args.seconds)
    t_gen = time.perf_counter()
    batches = [work.batch() for _ in range(args.batches + n_paced)]
    payloads = [encode_batch(0.0, events) for events, _ in batches[:args.batches]]
    gen_s = time.perf_counter() - t_gen
    fast_events, fast_blocks = 0, 0
    for events, _ in batches[:args.batches]:
        fast_events += len(events)
        fast_blocks += sum(len(e.block_hashes) for e in events)

    rds = RedisProcess(data_dir=run_dir / "redis").start()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the throughput phase sends all at once
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    mport = free_port()
    child = spawn("ingest", pagekv_cmd(
        "ingest-vllm", "--zmq-endpoint", endpoint, "--topic", TOPIC.decode(), "--pod-id", POD,
        "--openai-address", "127.0.0.1:8000", "--model", SCHEMA.model, "--block-size", str(BS),
        "--redis-url", rds.url, "--metrics-port", str(mport), "--log-level", "WARNING",
        "--health-interval-s", "0"),  # no OpenAI server here: the pod is taken as up
        run_dir)
    try:
        assert pub.poll(60_000), "the ingester did not subscribe"
        pub.recv()
        time.sleep(0.5)  # its metrics server and index registration
        pid = child.proc.pid
        # -- idle: what the process costs with no events (lease renewals, timers) ----------
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        time.sleep(args.idle_seconds)
        idle_share = (cpu_seconds(pid) - cpu0) / (time.perf_counter() - t0)
        # -- throughput: everything at once ------------------------------------------------
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        for seq, payload in enumerate(payloads):
            pub.send_multipart((TOPIC, seq_to_bytes(seq), payload), copy=False)
        last_key = batches[args.batches - 1][1]
        client = redis.Redis.from_url(rds.url)
        while last_seq(mport) < args.batches - 1 or not client.hexists(last_key, POD):
            if child.proc.poll() is not None:
                raise RuntimeError(child.log_tail())
            time.sleep(0.01)
        fast_wall, fast_cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
        # -- paced: a realistic rate ---------------------------------------------------------
        watcher = LagWatcher(rds.url)
        watcher.start()
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        paced_events = paced_blocks = 0
        for i in range(n_paced):
            due = t0 + i / args.rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            events, key = batches[args.batches + i]
            paced_events += len(events)
            paced_blocks += sum(len(e.block_hashes) for e in events)
            now = time.time()
            pub.send_multipart((TOPIC, seq_to_bytes(args.batches + i),
                                encode_batch(now, events)))
            watcher.pending.append((key, now))
        paced_wall = time.perf_counter() - t0
        paced_cpu = cpu_seconds(pid) - cpu0
        watcher.stop.set()
        watcher.join(30)
        refused = metric_sum(mport, "pagekv_ingest_refused_events_total")
        gaps = metric_sum(mport, "pagekv_ingest_gaps_total")
    finally:
        stop_child(child)
        pub.close(0)
        rds.close()

    share = paced_cpu / paced_wall
    print(f"# vLLM event ingestion, pagekv ingest-vllm ({machine_info()})")
    print(f"# {args.blocks_per_event} blocks per event, pool {args.pool} blocks, int hashes "
          f"recomputed (sha256); workload generated in {gen_s:.1f}s; refused {refused:.0f}, "
          f"gaps {gaps:.0f}")
    print("| phase | batches | events | blocks | wall s | ingester CPU s | events/s per core "
          "| blocks/s per core |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| throughput | {args.batches} | {fast_events} | {fast_blocks} | {fast_wall:.2f} | "
          f"{fast_cpu:.2f} | {fast_events / fast_cpu:,.0f} | {fast_blocks / fast_cpu:,.0f} |")
    print(f"| paced {args.rate:g}/s | {n_paced} | {paced_events} | {paced_blocks} | "
          f"{paced_wall:.2f} | {paced_cpu:.2f} | {paced_events / max(paced_cpu, 1e-9):,.0f} | "
          f"{paced_blocks / max(paced_cpu, 1e-9):,.0f} |")
    print()
    print(f"paced: {paced_events / paced_wall:,.0f} events/s ({paced_blocks / paced_wall:,.0f} "
          f"block changes/s): ingester at {share:.2%} of one core (the figure to stay below: "
          f"{PUBLISHED_SHARE:.2%}; {'below' if share <= PUBLISHED_SHARE else 'above'} it, "
          f"x{share / PUBLISHED_SHARE:.1f}); idle, the process takes {idle_share:.2%}")
    if watcher.lags:
        print(f"index lag (send -> visible in Redis), {len(watcher.lags)} batches: p50 "
              f"{pct(watcher.lags, 0.5) * 1e3:.1f} ms, p99 {pct(watcher.lags, 0.99) * 1e3:.1f} ms, "
              f"max {max(watcher.lags) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
