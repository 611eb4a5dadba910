"""TTFT of a long shared prefix: held locally, pulled from a peer pod, or recomputed.

Real pod processes on the real model (SmolLM2-135M-Instruct), each with one torch thread
(half the cores of the 2-core box), requests one at a time, streaming: TTFT is the time to the
first chunk that carries a token. Every round uses a fresh random 2,048-token prefix, computed
once on pod A (a warm request with another suffix), then the same prompt (prefix + a 32-token
suffix) goes:

- local:      to A, which holds the prefix in its pool;
- pull:       to B, told by `kv_source` that A holds the prefix's blocks: B pulls them over
              gRPC (KVNode.PullBlocks) and prefills only the suffix;
- pull, LZ4:  the same from pod C, which serves with `--kv-transfer-compress` (C got the
              prefix from A by a pull of its own, untimed);
- pull over gRPC: to D, a pod that pulls with `--kv-transports grpc` (the blocks in the
              PullBlocks stream, as before the data transports), from A;
- pull from a busy peer: as `pull`, while A decodes `--busy` other requests (streams started
              before, cancelled after): a hot prefix's holder is busy by definition; A
              finds and pins the run on its engine thread (one wait for a step), then reads
              the pool rows off that thread;
- recompute:  to B with no `kv_source`: the baseline, the whole prompt prefilled.

The baseline in the same run: a plain Python socket moving the same bytes between two processes
(bench/plain_socket.py: `sendall` from a preallocated buffer, `recv_into` a preallocated one),
once per round; the pull's GB/s is printed against it. The crossover (the prefix length
above which a pull beats recomputing) is fitted from the measured pulls (a short 8-block pull
per round gives the fixed part: kvnode/engine/pull_costs.fit_line) and the measured prefill
s/token (recompute TTFT minus local-hit TTFT, over the prefix).

B's cache is reset (KVNode.ResetPrefixCache) before each of its requests, so each path is
what it says; the paths' order rotates from round to round (drift on a shared box hits all
alike). Extra repeats per round give the cheap paths more samples (each with its own suffix).
Checked on every request: the cached tokens by source (a pull must bring all the prefix's
blocks: cached_tokens_peer == 2,048, no fallback) and the greedy tokens (all paths of one
prompt agree). B's metrics (`pagekv_kv_pulled_bytes_total`, `pagekv_kv_pull_seconds`) give
the bytes and seconds of each pull: the effective GB/s.

    python -m bench.kv_pull [--quick] [--prefix 2048] [--suffix 32] [--busy N] [--no-compress]
                            [--no-grpc] [--model M] [--json PATH]

A 16,384-token prefix on pagekv-small (its positions stop at 4,096: the bench sets
PAGEKV_ALLOW_LONG_MAX_MODEL_LEN for a longer prefix):

    python -m bench.kv_pull --model pagekv-small --prefix 16384 --busy 0 --no-compress
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.machine import machine_info
from bench.stats import pct
from pagekv.deploy.local_cluster import Child, LocalCluster, wait_healthy
from pagekv.kvnode.engine.pull_costs import fit_line
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.pull_cost import PullCost

MODEL = "smollm2-135m-instruct"
BLOCK = 16
LOCAL, PULL, PULL_LZ4, RECOMPUTE = "local hit", "pulled from peer", "pulled, LZ4", "recompute"
PULL_GRPC = "pulled over gRPC"
SHORT_BLOCKS = 8  # the short pull of each round (the fit's fixed part)
BUSY = "pulled from a busy peer"
PULL_METRICS = ("pagekv_kv_pulled_bytes_total", "pagekv_kv_pulled_blocks_total",
                "pagekv_kv_pull_seconds_sum", "pagekv_kv_pull_seconds_count",
                "pagekv_kv_pull_fallbacks_total")


def scrape(pod: Child) -> dict[str, float]:
    """Every sample on the pod's metrics page, summed over labels, by sample name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics",
                                  timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def delta(before: dict[str, float], after: dict[str, float],
          names=PULL_METRICS) -> dict[str, float]:
    return {n: after.get(n, 0.0) - before.get(n, 0.0) for n in names}


def reset(address: str, timeout_s: float = 60.0) -> None:
    """Drop the pod's cached blocks (pool and tiers); retried while requests still run."""
    with grpc.insecure_channel(address) as ch:
        kv = pb_grpc.KVNodeStub(ch)
        deadline = time.monotonic() + timeout_s
        while not kv.ResetPrefixCache(pb.ResetPrefixCacheRequest(include_tiers=True),
                                      timeout=10).success:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{address}: cache still busy after {timeout_s:.0f} s")
            time.sleep(0.1)


@dataclass
class Shot:
    ttft_s: float
    tokens: list[int]
    usage: pb.Usage
    pull: dict[str, float] = field(default_factory=dict)  # B's metric deltas, pulls only
    source_step_s: float = 0.0  # the busy row: A's step time (its streams' token gaps)


def stream(address: str, prompt: list[int], max_tokens: int,
           source: pb.KvSource | None = None) -> Shot:
    """One streamed greedy request; TTFT = the first chunk that carries a token."""
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    if source is not None:
        req.kv_source.CopyFrom(source)
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        tokens: list[int] = []
        usage, first = pb.Usage(), None
        t0 = time.perf_counter()
        for chunk in stub.GenerateStream(req, timeout=600):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - t0
            tokens.extend(chunk.token_ids)
            if chunk.HasField("usage"):
                usage = chunk.usage
    if first is None:
        raise RuntimeError(f"{address}: no token streamed")
    return Shot(first, tokens, usage)


# Ordinary vocabulary ids: SmolLM2's special tokens sit at the bottom of its 49,152; the
# pagekv-* presets have a byte vocabulary (main sets this for them).
TOKEN_RANGE = [1000, 40000]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


class BusyLoad:
    """`n` long greedy streams of unrelated prompts on one pod, decoding until stopped."""

    def __init__(self, pod: Child, n: int, rng: random.Random, max_tokens: int) -> None:
        self.channel = grpc.insecure_channel(pod.address)
        stub = pb_grpc.GenerationStub(self.channel)
        self.calls = [stub.GenerateStream(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=random_tokens(rng, 64)), sampling=pb.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)), timeout=600)
            for _ in range(n)]
        started = [threading.Event() for _ in self.calls]
        self.times: list[list[float]] = [[] for _ in self.calls]
        self.threads = [threading.Thread(target=self._drain, args=(c, e, t), daemon=True)
                        for c, e, t in zip(self.calls, started, self.times, strict=True)]
        for t in self.threads:
            t.start()
        for e in started:  # every stream is decoding
            if not e.wait(120):
                raise RuntimeError("a background stream did not start")

    @staticmethod
    def _drain(call, started: threading.Event, times: list[float]) -> None:
        try:
            for _ in call:
                times.append(time.perf_counter())
                started.set()
        except grpc.RpcError:
            pass  # cancelled
        started.set()

    def step_s(self, t0: float, t1: float) -> float:
        """Median gap between consecutive streamed chunks (one per step) within [t0, t1]."""
        gaps = [b - a for ts in self.times for a, b in zip(ts, ts[1:], strict=False)
                if t0 <= a and b <= t1]
        return pct(gaps, 0.5) if gaps else float("nan")

    def stop(self) -> None:
        for c in self.calls:
            c.cancel()
        for t in self.threads:
            t.join(30)
        self.channel.close()


class PlainSocket:
    """The baseline: bench/plain_socket.py's two ends, as processes, moving `nbytes`."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.port = port = free_port()
        self.server = subprocess.Popen(
            [sys.executable, "-m", "bench.plain_socket", "serve", "127.0.0.1", str(port),
             str(nbytes)], stdout=subprocess.PIPE, text=True)
        assert self.server.stdout is not None
        self.server.stdout.readline()  # listening
        self.seconds: list[float] = []
        self.once()  # warm-up: the processes' first pages

    def once(self) -> float:
        out = subprocess.run([sys.executable, "-m", "bench.plain_socket", "fetch", "127.0.0.1",
                              str(self.port), str(self.nbytes)], capture_output=True,
                             text=True, check=True)
        return float(json.loads(out.stdout)["seconds"][0])

    def measure(self) -> None:
        self.seconds.append(self.once())

    def close(self) -> None:
        self.server.kill()
        self.server.wait(10)


def free_port() -> int:
    """A free loopback port (bound and released: the baseline's server takes it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Bench:
    a: Child
    b: Child
    c: Child | None
    prefix_len: int
    suffix_len: int
    max_tokens: int
    busy: int = 0
    d: Child | None = None  # pulls over gRPC only
    shots: dict[str, list[Shot]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    short_pulls: list[tuple[int, float]] = field(default_factory=list)  # (tokens, s)
    baseline: PlainSocket | None = None

    @property
    def prefix_blocks(self) -> int:
        return self.prefix_len // BLOCK

    def source(self, pod: Child) -> pb.KvSource:
        return pb.KvSource(pod_id=pod.name, address=pod.address, num_blocks=self.prefix_blocks)

    def path(self, name: str, prompt: list[int]) -> Shot:
        if name == LOCAL:
            shot = stream(self.a.address, prompt, self.max_tokens)
        else:
            puller = self.d if name == PULL_GRPC and self.d is not None else self.b
            reset(puller.address)
            src = {PULL: self.a, BUSY: self.a, PULL_LZ4: self.c, PULL_GRPC: self.a}.get(name)
            load = BusyLoad(self.a, self.busy, random.Random(len(prompt) + prompt[-1]),
                            1024) if name == BUSY else None
            try:
                before = scrape(puller) if src else {}
                t0 = time.perf_counter()
                shot = stream(puller.address, prompt, self.max_tokens,
                              self.source(src) if src else None)
                if src:
                    shot.pull = delta(before, scrape(puller))
                if load:
                    shot.source_step_s = load.step_s(t0, time.perf_counter())
            finally:
                if load is not None:
                    load.stop()
        self.check(name, shot)
        self.shots.setdefault(name, []).append(shot)
        return shot

    def check(self, name: str, shot: Shot) -> None:
        u, want = shot.usage, self.prefix_blocks * BLOCK
        expect = {LOCAL: (want, 0), RECOMPUTE: (0, 0)}.get(name, (want, want))
        got = (u.cached_tokens, u.cached_tokens_peer)
        if got != expect:
            self.problems.append(f"{name}: cached/peer tokens {got}, expected {expect}")
        if shot.pull and (shot.pull["pagekv_kv_pull_fallbacks_total"]
                          or shot.pull["pagekv_kv_pulled_blocks_total"] != self.prefix_blocks):
            self.problems.append(f"{name}: pull metrics {shot.pull}")

    def short_pull(self, prefix: list[int], rng: random.Random) -> None:
        """A pull of the prefix's first blocks: the fit's short point."""
        reset(self.b.address)
        before = scrape(self.b)
        stream(self.b.address, prefix[:SHORT_BLOCKS * BLOCK] + random_tokens(rng, 5), 1,
               pb.KvSource(pod_id=self.a.name, address=self.a.address,
                           num_blocks=SHORT_BLOCKS))
        got = delta(before, scrape(self.b))
        if got["pagekv_kv_pulled_blocks_total"] == SHORT_BLOCKS:
            self.short_pulls.append((SHORT_BLOCKS * BLOCK, got["pagekv_kv_pull_seconds_sum"]))

    def round(self, r: int, rng: random.Random, repeats: int) -> None:
        paths = [LOCAL, PULL, *([PULL_LZ4] if self.c else []), *([BUSY] if self.busy else []),
                 *([PULL_GRPC] if self.d else []), RECOMPUTE]
        prefix = random_tokens(rng, self.prefix_len)
        # The prefix computed once on A (its own suffix: the measured prompt's is not cached).
        stream(self.a.address, prefix + random_tokens(rng, self.suffix_len), 1)
        if self.c is not None:  # C gets it from A by a pull (untimed): a second holder
            stream(self.c.address, prefix + random_tokens(rng, self.suffix_len), 1,
                   self.source(self.a))
        for j in range(repeats):
            prompt = prefix + random_tokens(rng, self.suffix_len)
            todo = paths if j == 0 else [p for p in paths if p != RECOMPUTE]
            k = r % len(todo)
            outs = {name: self.path(name, prompt).tokens for name in todo[k:] + todo[:k]}
            if len({tuple(t) for t in outs.values()}) != 1:
                self.problems.append(f"round {r}.{j}: greedy tokens differ: {outs}")
            if self.baseline is not None:
                self.baseline.measure()
        self.short_pull(prefix, rng)


def warm_up(bench: Bench, rng: random.Random) -> None:
    """First requests of each pod (allocations, threads) and one small pull, untimed."""
    prompt = random_tokens(rng, 8 * BLOCK + 5)
    for pod in filter(None, (bench.a, bench.b, bench.c, bench.d)):
        stream(pod.address, random_tokens(rng, 64), 2)
    stream(bench.a.address, prompt, 2)
    for puller in filter(None, (bench.b, bench.d)):
        stream(puller.address, prompt, 2, pb.KvSource(pod_id=bench.a.name,
                                                      address=bench.a.address, num_blocks=8))
        reset(puller.address)


def summarize(bench: Bench) -> dict[str, dict]:
    base = pct([s.ttft_s for s in bench.shots[RECOMPUTE]], 0.5)
    rows = {}
    for name, shots in bench.shots.items():
        ttfts = [s.ttft_s for s in shots]
        row = {"n": len(shots), "ttft_p50_ms": pct(ttfts, 0.5) * 1e3,
               "ttft_p90_ms": pct(ttfts, 0.9) * 1e3,
               "speedup_vs_recompute": base / pct(ttfts, 0.5),
               "cached_tokens": shots[0].usage.cached_tokens,
               "cached_tokens_peer": shots[0].usage.cached_tokens_peer}
        if shots[0].pull:
            secs = [s.pull["pagekv_kv_pull_seconds_sum"] for s in shots]
            wire = sum(s.pull["pagekv_kv_pulled_bytes_total"] for s in shots)
            row.update(pulls=sum(s.pull["pagekv_kv_pull_seconds_count"] for s in shots),
                       wire_bytes_per_pull=wire / len(shots),
                       pull_p50_ms=pct(secs, 0.5) * 1e3, pull_p90_ms=pct(secs, 0.9) * 1e3,
                       wire_gb_per_s=wire / sum(secs) / 1e9)
        if shots[0].source_step_s:
            row["source_step_ms"] = pct([s.source_step_s for s in shots], 0.5) * 1e3
        rows[name] = row
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=32, help="unique suffix tokens")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=None, help="fresh prefixes (recompute "
                    "samples); default 3 quick, 8 full")
    ap.add_argument("--repeats", type=int, default=None, help="prompts per prefix for the "
                    "local and pull paths; default 2 quick, 3 full")
    ap.add_argument("--busy", type=int, default=4, help="requests decoding on the source "
                    "during the busy-peer row (0: no such row)")
    ap.add_argument("--compress", action=argparse.BooleanOptionalAction, default=True,
                    help="the LZ4 row (a third pod)")
    ap.add_argument("--grpc", action=argparse.BooleanOptionalAction, default=True,
                    help="the row of a pod pulling over gRPC (--kv-transports grpc)")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--pull-deadline-s", type=float, default=10.0,
                    help="B's --kv-pull-deadline-s (the pod default is 2 s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per pod")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.prefix % BLOCK:
        ap.error(f"--prefix must be a multiple of the block size {BLOCK}")
    rounds = args.rounds or (3 if args.quick else 8)
    repeats = args.repeats or (2 if args.quick else 3)
    total = args.prefix + args.suffix + args.max_tokens
    per_prompt = -(-total // BLOCK)
    # Room on A for a few rounds' prompts (older ones are evicted LRU) beside the busy row's
    # streams (64 + 1,024 tokens each), and for one prompt plus a landed pull on B.
    blocks = 4 * per_prompt + args.busy * (1088 // BLOCK + 1) + 16
    node = ["--num-threads", str(args.threads), "--num-gpu-blocks", str(blocks),
            "--max-model-len", str(max(total, 1088) + BLOCK)]
    if args.model.startswith("pagekv-"):
        TOKEN_RANGE[:] = [3, 250]
    if total > 4096:  # beyond pagekv-small's positions (SmolLM2 has 8,192)
        os.environ["PAGEKV_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    print(f"# Cross-pod KV pull vs local hit vs recompute ({args.model}, {args.prefix}-token "
          f"prefix "
          f"+ {args.suffix}-token suffix, {args.max_tokens} tokens out, {rounds} prefixes x "
          f"{repeats} prompts, pods of {args.threads} torch thread(s), streaming, one request "
          f"at a time) — {machine_info()}", flush=True)
    cluster = LocalCluster(nodes=0, model=args.model, node_args=node, start_router=False,
                           run_dir=Path(tempfile.mkdtemp(prefix="pagekv-kvpull-")))
    cluster.start()
    try:
        a = cluster.start_pod("node-a")
        b = cluster.start_pod("node-b", ["--kv-pull-deadline-s", str(args.pull_deadline_s)])
        c = cluster.start_pod("node-c", ["--kv-transfer-compress"]) if args.compress else None
        d = cluster.start_pod("node-d", ["--kv-pull-deadline-s", str(args.pull_deadline_s),
                                         "--kv-transports", "grpc"]) if args.grpc else None
        for pod in filter(None, (a, b, c, d)):
            wait_healthy(pod.address, 180, pod.proc)
        bench = Bench(a, b, c, args.prefix, args.suffix, args.max_tokens, args.busy, d)
        rng = random.Random(args.seed)
        before = scrape(b)
        warm_up(bench, rng)
        warm = delta(before, scrape(b))
        block_bytes = round(warm["pagekv_kv_pulled_bytes_total"] / SHORT_BLOCKS)
        bench.baseline = PlainSocket(block_bytes * bench.prefix_blocks)
        for r in range(rounds):
            bench.round(r, rng, repeats)
            print(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {s[-1].ttft_s * 1e3:.0f} ms" for n, s in bench.shots.items()), flush=True)
    finally:
        cluster.stop()
        if bench.baseline is not None:
            bench.baseline.close()
    rows = summarize(bench)
    print("\n| path | requests | TTFT p50 ms | TTFT p90 ms | recompute / this (p50) "
          "| cached tokens (peer) |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['n']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | "
              f"{r['speedup_vs_recompute']:.2f}x | {r['cached_tokens']} "
              f"({r['cached_tokens_peer']}) |")
    print("\n| pull | pulls | MB on the wire per pull | pull s p50 ms | pull s p90 ms "
          "| effective GB/s (wire) |")
    print("|---|---|---|---|---|---|")
    base = bench.baseline
    socket_gbs = base.nbytes / pct(base.seconds, 0.5) / 1e9 if base and base.seconds else 0.0
    for name in (PULL, PULL_LZ4, BUSY, PULL_GRPC):
        if name in rows:
            r = rows[name]
            r["gb_per_s_p50"] = r["wire_bytes_per_pull"] / (r["pull_p50_ms"] / 1e3) / 1e9
            print(f"| {name} | {r['pulls']:.0f} | {r['wire_bytes_per_pull'] / 1e6:.1f} | "
                  f"{r['pull_p50_ms']:.1f} | {r['pull_p90_ms']:.1f} | "
                  f"{r['gb_per_s_p50']:.2f} ({r['gb_per_s_p50'] / socket_gbs:.2f}x socket) |")
    if base and base.seconds:
        print(f"| plain socket (the baseline) | {len(base.seconds)} | {base.nbytes / 1e6:.1f} | "
              f"{pct(base.seconds, 0.5) * 1e3:.1f} | {pct(base.seconds, 0.9) * 1e3:.1f} | "
              f"{socket_gbs:.2f} (1.00x) |")
    if PULL in rows and RECOMPUTE in rows and bench.short_pulls:
        long_pulls = [(args.prefix, s.pull["pagekv_kv_pull_seconds_sum"])
                      for s in bench.shots[PULL]]
        cost = PullCost(*fit_line(bench.short_pulls + long_pulls))
        prefill = (rows[RECOMPUTE]["ttft_p50_ms"] - rows[LOCAL]["ttft_p50_ms"]) / 1e3 / args.prefix
        cross = cost.crossover_tokens(prefill)
        rows["crossover"] = {"fixed_s": cost.fixed_s, "per_token_s": cost.per_token_s,
                             "prefill_per_token_s": prefill, "crossover_tokens": cross}
        print(f"\ncrossover: pull = {cost.fixed_s * 1e3:.1f} ms + {cost.per_token_s * 1e6:.2f} "
              f"us/token (fitted over {len(bench.short_pulls)} {SHORT_BLOCKS * BLOCK}-token and "
              f"{len(long_pulls)} {args.prefix}-token pulls), prefill {prefill * 1e6:.0f} "
              f"us/token: pulling beats recomputing above **{cross:.0f} tokens**")
    if PULL in rows:
        block_bytes = rows[PULL]["wire_bytes_per_pull"] / (args.prefix // BLOCK)
        print(f"\npull seconds: B's pagekv_kv_pull_seconds (admission to landed in the pool); "
              f"{block_bytes / 1e3:.0f} kB per {BLOCK}-token block uncompressed; GB/s at the "
              f"p50 pull. "
              f"Goal (issue #18): pull >= 5x faster than recompute: "
              f"{rows[PULL]['speedup_vs_recompute']:.1f}x")
    if BUSY in rows:
        r, per_message = rows[BUSY], max(1, (4 << 20) // round(block_bytes))
        messages = -(-(args.prefix // BLOCK) // per_message)
        print(f"busy peer: {args.busy} requests decoding on A, its step (the gap between their "
              f"streamed tokens) {r['source_step_ms']:.0f} ms during the pulls; the pull "
              f"waits for A's engine thread once (to find and pin the run), then reads its "
              f"{messages} messages' pool rows (4 MiB each) off that thread: pull p50 / step = "
              f"{r['pull_p50_ms'] / r['source_step_ms']:.1f}")
    for p in bench.problems:
        print(f"PROBLEM: {p}")
    if not bench.problems:
        print("checks: every pull brought all prefix blocks (no fallback); the greedy tokens "
              "of every path agree")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "kv_pull", "model": MODEL, "machine": machine_info(),
                       "args": vars(args), "rounds": rounds, "repeats": repeats,
                       "results": rows, "problems": bench.problems,
                       "ttfts_ms": {n: [s.ttft_s * 1e3 for s in ss]
                                    for n, ss in bench.shots.items()}}, f, indent=2)
    return 1 if bench.problems else 0


if __name__ == "__main__":
    sys.exit(main())
