"""A hot prefix arriving faster than one pod serves it: always its holder, least loaded with
recompute, least loaded with a cross-pod pull.

Two real pods (SmolLM2-135M-Instruct, one torch thread each: half the 2-core box), an
embedded Redis, and three routers on the same index, one per configuration:

- always the holder:          `--policy prefix --no-kv-pull --cost-queue-per-request 0`: the
                              cached prefix always wins, however long the holder's queue;
- least loaded + recompute:   `--no-kv-pull --cost-queue-per-request Q`, Q large: one more
                              queued request outweighs the whole prefix, so the busy holder is
                              avoided and the other pod recomputes the prefix;
- least loaded + pull:        the same with `--kv-pull`: the other pod is told the holder
                              (kv_source) and pulls the prefix's blocks instead.

The workload: every request is the same long prefix (1,024 tokens) plus its own suffix,
greedy, a fixed number of output tokens, sent open-loop at a fixed rate (constant spacing).
The rate is calibrated first on one pod holding the prefix: its service time one request at a
time, and its capacity (requests/s) closed-loop at its full batch; the rate is `--load` times
that capacity (1.5x by default: more than one pod can serve, less than two). The three
configurations then run back to back on the same request sequence (`--passes` times, the
order rotating); before each run both pods' caches are reset and the prefix is computed on
pod A alone, so there is exactly one holder when the run starts. TTFT is measured from each
request's scheduled arrival (a late send counts against the configuration), to the first
streamed token. The table gives TTFT p50/p90 and throughput per configuration with the ratios
to "always the holder" and to "least loaded + recompute", and how the router placed the
requests (routing reasons, cached tokens pulled from the peer).

    python -m bench.hot_prefix [--quick] [--requests N] [--load X] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from bench.kv_pull import random_tokens, reset, scrape
from bench.machine import machine_info
from bench.stats import pct
from pagekv.deploy.local_cluster import Child, LocalCluster, wait_healthy
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

MODEL = "smollm2-135m-instruct"
BLOCK = 16
HOLDER, RECOMPUTE, PULL = "always the holder", "least loaded + recompute", "least loaded + pull"
PULL_KEYS = ("pagekv_kv_pulled_bytes_total", "pagekv_kv_pulled_blocks_total",
             "pagekv_kv_pull_seconds_sum", "pagekv_kv_pull_seconds_count",
             "pagekv_kv_pull_fallbacks_total")


def arrival_times(n: int, rate: float, kind: str = "constant", seed: int = 0) -> list[float]:
    """Send offsets (s) of n open-loop arrivals at `rate` per second: evenly spaced, or a
    seeded Poisson process (exponential gaps); the first arrival is at 0."""
    if n < 0 or not rate > 0:
        raise ValueError(f"need n >= 0 and rate > 0, got {n}, {rate}")
    if kind == "constant":
        return [i / rate for i in range(n)]
    if kind != "poisson":
        raise ValueError(f"arrivals must be constant or poisson, got {kind!r}")
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        out.append(t)
        if i + 1 < n:
            t += rng.expovariate(rate)
    return out


@dataclass
class Result:
    """One request of one run."""

    arrival_s: float                 # scheduled, from the run's start
    ttft_s: float = float("nan")     # from the scheduled arrival
    done_s: float = float("nan")     # completion, from the run's start
    tokens: list[int] = field(default_factory=list)
    served_by: str = ""
    reason: str = ""
    pull_from: str = ""
    cached: int = 0
    cached_peer: int = 0
    error: str = ""


def summarize(results: list[Result]) -> dict:
    """TTFT percentiles and throughput of one run (failed requests are counted, not timed);
    throughput over the span from the first arrival to the last completion."""
    ok = [r for r in results if not r.error]
    ttfts = [r.ttft_s for r in ok]
    span = max((r.done_s for r in ok), default=0.0) - min(r.arrival_s for r in results)
    tokens = sum(len(r.tokens) for r in ok)
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "ttft_p50_ms": pct(ttfts, 0.5) * 1e3 if ttfts else float("nan"),
        "ttft_p90_ms": pct(ttfts, 0.9) * 1e3 if ttfts else float("nan"),
        "ttft_max_ms": max(ttfts) * 1e3 if ttfts else float("nan"),
        "span_s": span,
        "requests_per_s": len(ok) / span if span > 0 else 0.0,
        "output_tokens_per_s": tokens / span if span > 0 else 0.0,
        "served_by": dict(Counter(r.served_by for r in ok)),
        "reasons": dict(Counter(r.reason for r in ok)),
        "pulls": sum(1 for r in ok if r.cached_peer),
        "cached_tokens_peer": sum(r.cached_peer for r in ok),
        "cached_tokens": sum(r.cached for r in ok),
    }


def request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def one(stub, prompt: list[int], max_tokens: int, t0: float, res: Result) -> None:
    await asyncio.sleep(max(0.0, t0 + res.arrival_s - time.perf_counter()))
    try:
        async for chunk in stub.GenerateStream(request(prompt, max_tokens), timeout=600):
            if chunk.token_ids and res.tokens == []:
                res.ttft_s = time.perf_counter() - t0 - res.arrival_s
            res.tokens.extend(chunk.token_ids)
            if chunk.served_by:
                res.served_by = chunk.served_by
            if chunk.HasField("usage"):
                res.cached = chunk.usage.cached_tokens
                res.cached_peer = chunk.usage.cached_tokens_peer
            if chunk.HasField("routing"):
                res.reason, res.pull_from = chunk.routing.reason, chunk.routing.pull_from
        res.done_s = time.perf_counter() - t0
    except grpc.aio.AioRpcError as e:
        res.error = f"{e.code().name}: {e.details()}"


async def open_loop(address: str, prompts: list[list[int]], arrivals: list[float],
                    max_tokens: int) -> list[Result]:
    results = [Result(a) for a in arrivals]
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        t0 = time.perf_counter() + 0.05
        await asyncio.gather(*(one(stub, p, max_tokens, t0, r)
                               for p, r in zip(prompts, results, strict=True)))
    return results


async def closed_loop(address: str, prompts: list[list[int]], max_tokens: int,
                      concurrency: int) -> tuple[float, list[Result]]:
    """(wall s, results) of the prompts sent `concurrency` at a time, directly to a pod."""
    gate = asyncio.Semaphore(concurrency)
    results = [Result(0.0) for _ in prompts]
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)

        async def guarded(p, r):
            async with gate:
                r.arrival_s = time.perf_counter() - t0
                await one(stub, p, max_tokens, t0, r)

        t0 = time.perf_counter()
        await asyncio.gather(*(guarded(p, r) for p, r in zip(prompts, results, strict=True)))
    return time.perf_counter() - t0, results


def warm(pods: list[Child], holder: Child, prefix: list[int], rng: random.Random) -> None:
    """Both caches emptied, then the prefix computed on the holder alone; wait until the
    index shows it (the pods publish within a fraction of a second)."""
    for pod in pods:
        reset(pod.address)
    time.sleep(1.0)  # the removals reach the index before the prefix is published again
    with grpc.insecure_channel(holder.address) as ch:
        pb_grpc.GenerationStub(ch).Generate(request(prefix + random_tokens(rng, 8), 1),
                                            timeout=300)
    time.sleep(1.5)


def calibrate(holder: Child, prefix: list[int], rng: random.Random, suffix: int,
              max_tokens: int, seq: int, batch: int, concurrency: int) -> dict:
    """One pod holding the prefix: service time one at a time, capacity at full batch."""
    mk = lambda: prefix + random_tokens(rng, suffix)  # noqa: E731
    _, one_by_one = asyncio.run(closed_loop(holder.address, [mk() for _ in range(seq)],
                                            max_tokens, 1))
    wall, batched = asyncio.run(closed_loop(holder.address, [mk() for _ in range(batch)],
                                            max_tokens, concurrency))
    service = [r.done_s - r.arrival_s for r in one_by_one]
    return {"service_s": pct(service, 0.5), "ttft_one_ms": pct([r.ttft_s for r in one_by_one],
                                                                0.5) * 1e3,
            "capacity_rps": batch / wall, "concurrency": concurrency}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and math.isfinite(a) and math.isfinite(b) else "n/a"


def fmt_reasons(s: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(s["reasons"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prefix", type=int, default=1024, help="hot prefix tokens")
    ap.add_argument("--suffix", type=int, default=32, help="unique suffix tokens")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--requests", type=int, default=None, help="default 16 quick, 36 full")
    ap.add_argument("--load", type=float, default=1.5,
                    help="arrival rate as a multiple of one pod's measured capacity")
    ap.add_argument("--rate", type=float, default=None, help="requests/s (skips --load)")
    ap.add_argument("--arrivals", choices=("constant", "poisson"), default="constant")
    ap.add_argument("--passes", type=int, default=None, help="runs of each configuration, "
                    "interleaved; default 1 quick, 2 full")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="each pod's batch")
    ap.add_argument("--queue-cost", type=float, default=10.0,
                    help="--cost-queue-per-request of the two least-loaded routers (s)")
    ap.add_argument("--pull-deadline-s", type=float, default=None,
                    help="the pods' --kv-pull-deadline-s (default: the pods' own, 2 s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per pod")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    n = args.requests or (16 if args.quick else 36)
    passes = args.passes or (1 if args.quick else 2)
    total = args.prefix + args.suffix + args.max_tokens
    node = ["--num-threads", str(args.threads), "--num-gpu-blocks", "512",
            "--max-model-len", str(total + BLOCK), "--max-num-seqs", str(args.max_num_seqs)]
    if args.pull_deadline_s is not None:
        node += ["--kv-pull-deadline-s", str(args.pull_deadline_s)]
    configs = {
        HOLDER: ["--policy", "prefix", "--no-kv-pull", "--cost-queue-per-request", "0"],
        RECOMPUTE: ["--policy", "prefix", "--no-kv-pull",
                    "--cost-queue-per-request", str(args.queue_cost)],
        PULL: ["--policy", "prefix", "--kv-pull", "--cost-queue-per-request",
               str(args.queue_cost)],
    }
    rng = random.Random(args.seed)
    prefix = random_tokens(rng, args.prefix)
    prompts = [prefix + random_tokens(rng, args.suffix) for _ in range(n)]
    print(f"# Hot prefix: always the holder vs least loaded (recompute / pull) ({MODEL}, 2 pods "
          f"of {args.threads} torch thread(s), batch {args.max_num_seqs}, {n} requests of a "
          f"{args.prefix}-token prefix + {args.suffix} unique, {args.max_tokens} out, "
          f"{args.arrivals} open-loop arrivals, {passes} pass(es)) — {machine_info()}",
          flush=True)
    runs: dict[str, list[list[Result]]] = {name: [] for name in configs}
    pulled: dict[str, float] = {}
    cluster = LocalCluster(nodes=2, model=MODEL, node_args=node, start_router=False,
                           run_dir=Path(tempfile.mkdtemp(prefix="pagekv-hot-")))
    cluster.start()
    try:
        routers = {name: cluster.start_router_process(f"router-{i}", extra)
                   for i, (name, extra) in enumerate(configs.items())}
        for r in routers.values():
            wait_healthy(r.address, 60, r.proc)
        holder = cluster.pods[0]
        warm(cluster.pods, holder, prefix, rng)
        cal = calibrate(holder, prefix, rng, args.suffix, args.max_tokens, 3 if args.quick
                        else 5, 2 * args.max_num_seqs, args.max_num_seqs)
        rate = args.rate or args.load * cal["capacity_rps"]
        arrivals = arrival_times(n, rate, args.arrivals, args.seed)
        print(f"calibration on {holder.name} (prefix held): service time one at a time "
              f"{cal['service_s']:.2f} s (TTFT {cal['ttft_one_ms']:.0f} ms, "
              f"{1 / cal['service_s']:.2f} req/s); capacity at {cal['concurrency']} concurrent "
              f"{cal['capacity_rps']:.2f} req/s; arrival rate {rate:.2f} req/s "
              f"({rate / cal['capacity_rps']:.2f}x one pod's capacity), last arrival at "
              f"{arrivals[-1]:.1f} s", flush=True)
        names = list(configs)
        for p in range(passes):
            for name in names[p % 3:] + names[:p % 3]:
                warm(cluster.pods, holder, prefix, rng)
                before = [scrape(pod) for pod in cluster.pods]
                res = asyncio.run(open_loop(routers[name].address, prompts, arrivals,
                                            args.max_tokens))
                after = [scrape(pod) for pod in cluster.pods]
                for key in PULL_KEYS:
                    pulled[f"{name}:{key}"] = pulled.get(f"{name}:{key}", 0.0) + sum(
                        a.get(key, 0.0) - b.get(key, 0.0) for a, b in zip(after, before, strict=True))
                runs[name].append(res)
                s = summarize(res)
                errors = Counter(r.error for r in res if r.error)
                for error, k in errors.items():
                    print(f"  {k} failed: {error[:300]}", flush=True)
                print(f"pass {p + 1}, {name}: TTFT p50 {s['ttft_p50_ms']:.0f} ms, p90 "
                      f"{s['ttft_p90_ms']:.0f} ms, {s['requests_per_s']:.2f} req/s, served by "
                      f"{s['served_by']}, {fmt_reasons(s)}, {s['failed']} failed", flush=True)
    finally:
        cluster.stop()

    summary = {name: summarize([r for run in rs for r in run]) for name, rs in runs.items()}
    for name, rs in runs.items():  # throughput: per run, then averaged
        per = [summarize(run) for run in rs]
        for key in ("requests_per_s", "output_tokens_per_s"):
            summary[name][key] = sum(x[key] for x in per) / len(per)
    same = {name: sum(a.tokens == b.tokens for ra, rb in zip(runs[HOLDER], rs, strict=True)
                      for a, b in zip(ra, rb, strict=True)) for name, rs in runs.items()}
    h, rc = summary[HOLDER], summary[RECOMPUTE]
    print("\n| configuration | TTFT p50 ms | TTFT p90 ms | p90 vs holder | p90 vs recompute "
          "| requests/s | output tok/s | tok/s vs holder | tok/s vs recompute |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['ttft_p50_ms']:.0f} | {s['ttft_p90_ms']:.0f} | "
              f"{ratio(s['ttft_p90_ms'], h['ttft_p90_ms'])} | "
              f"{ratio(s['ttft_p90_ms'], rc['ttft_p90_ms'])} | {s['requests_per_s']:.2f} | "
              f"{s['output_tokens_per_s']:.1f} | "
              f"{ratio(s['output_tokens_per_s'], h['output_tokens_per_s'])} | "
              f"{ratio(s['output_tokens_per_s'], rc['output_tokens_per_s'])} |")
    print("\n| configuration | requests (failed) | served by | routing reasons | pulls done "
          "(fallbacks) | blocks landed | MB pulled | pull s mean | requests with peer tokens "
          "(tokens) | same tokens as holder |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        served = ", ".join(f"{k} {v}" for k, v in sorted(s["served_by"].items()))
        m = {k: pulled[f"{name}:{k}"] for k in PULL_KEYS}
        count = m["pagekv_kv_pull_seconds_count"]
        mean = f"{m['pagekv_kv_pull_seconds_sum'] / count:.2f}" if count else "-"
        print(f"| {name} | {s['requests']} ({s['failed']}) | {served} | {fmt_reasons(s)} | "
              f"{count:.0f} ({m['pagekv_kv_pull_fallbacks_total']:.0f}) | "
              f"{m['pagekv_kv_pulled_blocks_total']:.0f} | "
              f"{m['pagekv_kv_pulled_bytes_total'] / 1e6:.1f} | {mean} | "
              f"{s['pulls']} ({s['cached_tokens_peer']}) | {same[name]}/{s['requests']} |")
    p = summary[PULL]
    print(f"\nGoal (issue #18): pull beats both on p90: {p['ttft_p90_ms']:.0f} ms vs holder "
          f"{h['ttft_p90_ms']:.0f} ms and recompute {rc['ttft_p90_ms']:.0f} ms: "
          f"{'met' if p['ttft_p90_ms'] < min(h['ttft_p90_ms'], rc['ttft_p90_ms']) else 'not met'}"
          f" (ratios are p90 / the other's p90; ratios < 1 are better)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "hot_prefix", "model": MODEL, "machine": machine_info(),
                       "args": vars(args), "requests": n, "passes": passes,
                       "calibration": cal, "rate_rps": rate, "arrivals_s": arrivals,
                       "router_flags": configs, "results": summary, "pull_metrics": pulled,
                       "same_tokens_as_holder": same,
                       "requests_by_run": {name: [[asdict(r) for r in run] for run in rs]
                                           for name, rs in runs.items()},
                       "ttfts_ms": {name: [[r.ttft_s * 1e3 for r in run] for run in rs]
                                    for name, rs in runs.items()}}, f, indent=2)
    return 1 if any(s["failed"] for s in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
