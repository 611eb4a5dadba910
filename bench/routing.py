"""Routing benchmark: prefix-aware routing vs round-robin vs random, side by side in one run.

One Redis, N pods (processes, `pagekv node`) and one router process per policy
(`pagekv router --policy prefix|round_robin|random`), all on this machine. Two workloads:

* groups:     G groups × P prompts; every prompt of a group starts with the group's prefix
              (a system prompt / few-shot block) and ends with its own question; they
              arrive in P waves, each wave one prompt per group in random order;
* bursts:     the same prompts, but each group's P prompts arrive together (siblings);
* multi-turn: C conversations × T turns; turn t+1 = turn t's prompt + the answer the pod
              gave + a new user message.

Each pod's pool is sized so that the groups' prefixes fill about 150% of it: one pod cannot
hold them all, the cluster can. Before each (workload, policy) phase every pod's cache is
reset (pool and tiers) and the index is checked empty, so every policy starts cold.

Reported per phase: cluster prefix hit rate (cached / prompt tokens, from the pods' usage),
the oracle hit rate (every group on one pod with an unbounded pool, computed analytically),
TTFT p50/p99, throughput, and the router's own overhead per request (p50/p99 of the
`pagekv-router-overhead-us` trailing metadata: time inside the router, the pod call
excluded), under load and for sequential requests.

    python -m bench.routing [--quick] [--json PATH] [--model pagekv-tiny] [--pods 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import redis  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from bench.stats import pct  # noqa: E402
from pagekv.deploy.local_cluster import Child, pagekv_cmd, spawn, stop_child, wait_healthy  # noqa: E402
from pagekv.deploy.redis_server import RedisProcess, free_port  # noqa: E402
from pagekv.proto.index import IndexSchema, list_live_pods  # noqa: E402
from pagekv.proto.index.queries import count_pod_claims  # noqa: E402
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb  # noqa: E402
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc  # noqa: E402

logger = logging.getLogger(__name__)

from bench.routing_client import (  # noqa: E402
    Result,
    decision_cost,
    generate,
    run_bursts,
    run_groups,
    run_multiturn,
    sequential_overhead,
)
from bench.routing_workloads import (  # noqa: E402
    BOS,
    BS,
    FULL,
    POLICIES,
    QUICK,
    WORKLOADS,
    Workload,
    group_oracle,
    multiturn_oracle,
    pool_blocks,
    rand_tokens,
    scatter_bound,
)

# -- the cluster -----------------------------------------------------------------------------

def start_cluster(run_dir: Path, redis_url: str, model: str, n_pods: int, blocks: int,
                  pod_args: list[str], nice: int, pin: tuple[set[int], set[int]] | None
                  ) -> tuple[list[Child], dict[str, Child]]:
    env = {"OMP_NUM_THREADS": "1"}  # N pods on a few cores: no thread oversubscription
    own = os.sched_getaffinity(0)
    if pin:  # children inherit this process's CPU set at fork
        os.sched_setaffinity(0, pin[1])
    # The pods stand in for GPU machines; at a lower priority they do not starve the router
    # and Redis of the CPU, which in a real cluster they would not share.
    prio = ["nice", "-n", str(nice)] if nice else []
    pods = []
    for i in range(n_pods):
        port, mport = free_port(), free_port()
        argv = prio + pagekv_cmd("node", "--model", model, "--host", "127.0.0.1", "--port",
                          str(port), "--metrics-port", str(mport), "--redis-url", redis_url,
                          "--pod-id", f"node-{chr(ord('a') + i)}", "--num-gpu-blocks",
                          str(blocks), "--max-model-len", "4096", *pod_args)
        child = spawn(f"node-{chr(ord('a') + i)}", argv, run_dir, env)
        child.address = f"127.0.0.1:{port}"
        pods.append(child)
    if pin:
        os.sched_setaffinity(0, pin[0])
    routers = {}
    for policy in POLICIES:
        port = free_port()
        argv = pagekv_cmd("router", "--model", model, "--host", "127.0.0.1", "--port",
                          str(port), "--metrics-port", "0", "--redis-url", redis_url,
                          "--policy", policy, "--random-seed", "7")
        child = spawn(f"router-{policy}", argv, run_dir)
        child.address = f"127.0.0.1:{port}"
        routers[policy] = child
    # This client is load, not part of the router host: it runs beside the pods.
    os.sched_setaffinity(0, pin[1] if pin else own)
    for child in [*pods, *routers.values()]:
        wait_healthy(child.address, 300, child.proc)
    schema = IndexSchema(model, BS, "sha256", "vllm-none-hash")
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 60
    while len(list_live_pods(client, schema)) < n_pods and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # two router refreshes: every router sees every pod
    return pods, routers


def reset_pods(pods: list[Child], redis_url: str, model: str) -> None:
    """Drop every pod's cache (pool and tiers) and wait until the index shows it."""
    schema = IndexSchema(model, BS, "sha256", "vllm-none-hash")
    client = redis.Redis.from_url(redis_url)
    for pod in pods:
        with grpc.insecure_channel(pod.address) as ch:
            stub = pb_grpc.KVNodeStub(ch)
            for _ in range(50):
                if stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(include_tiers=True),
                                         timeout=30).success:
                    break
                time.sleep(0.1)  # requests still running: retry
            else:
                raise RuntimeError(f"{pod.name}: prefix cache reset refused")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(count_pod_claims(client, schema, p.name) == 0 for p in pods):
            return
        time.sleep(0.05)
    raise RuntimeError("index still holds blocks after the reset")


def published_costs(redis_url: str, model: str) -> dict[str, dict[str, float]]:
    """What each pod measured and published (prefill and tier reload, s/token)."""
    schema = IndexSchema(model, BS, "sha256", "vllm-none-hash")
    return {p.pod_id: p.tier_costs
            for p in list_live_pods(redis.Redis.from_url(redis_url), schema)}



def summarize(results: list[Result], wall_s: float) -> dict:
    prompt = sum(r.prompt_tokens for r in results)
    overhead = [r.overhead_us / 1e3 for r in results if r.overhead_us >= 0]
    per_pod: dict[str, int] = {}
    for r in results:
        per_pod[r.served_by] = per_pod.get(r.served_by, 0) + 1
    return {
        "requests": len(results),
        "hit_rate": sum(r.cached_tokens for r in results) / prompt if prompt else 0.0,
        "ttft_p50_ms": 1e3 * pct([r.ttft_s for r in results], 0.5),
        "ttft_p99_ms": 1e3 * pct([r.ttft_s for r in results], 0.99),
        "throughput_rps": len(results) / wall_s,
        "prompt_tokens_per_s": prompt / wall_s,
        "overhead_p50_ms": pct(overhead, 0.5) if overhead else float("nan"),
        "overhead_p99_ms": pct(overhead, 0.99) if overhead else float("nan"),
        "lookup_p50_ms": pct([r.lookup_ms for r in results], 0.5),
        "lookup_p99_ms": pct([r.lookup_ms for r in results], 0.99),
        "per_pod": dict(sorted(per_pod.items())),
        "wall_s": wall_s,
    }


async def run_phases(routers: dict[str, Child], pods: list[Child], redis_url: str,
                     model: str, w: Workload, seed: int) -> dict:
    channels = {p: grpc.aio.insecure_channel(c.address) for p, c in routers.items()}
    stubs = {p: pb_grpc.GenerationStub(ch) for p, ch in channels.items()}
    out: dict = {name: {} for name in WORKLOADS}
    try:
        # Warm-up, not measured: first calls through each router and pod (channels, lazy
        # imports, first allocations) are start-up cost, not per-request overhead.
        rng = random.Random(seed + 4)
        for stub in stubs.values():
            await asyncio.gather(*(generate(stub, [BOS] + rand_tokens(rng, 200), 2)
                                   for _ in range(2 * len(pods))))
        for workload, runner in (("groups", run_groups), ("bursts", run_bursts),
                                 ("multi_turn", run_multiturn)):
            for policy in ("round_robin", "random", "prefix"):
                await asyncio.to_thread(reset_pods, pods, redis_url, model)
                start = time.perf_counter()
                results = await runner(stubs[policy], w, seed)
                out[workload][policy] = summarize(results, time.perf_counter() - start)
                logger.info("%s / %s: %s", workload, policy, out[workload][policy])
        out["sweep"] = {}
        for p in w.sweep:  # the groups workload with fewer or more prompts per group
            wp = replace(w, prompts_per_group=p)
            for policy in ("round_robin", "prefix"):
                await asyncio.to_thread(reset_pods, pods, redis_url, model)
                start = time.perf_counter()
                results = await run_groups(stubs[policy], wp, seed)
                out["sweep"].setdefault(p, {})[policy] = summarize(
                    results, time.perf_counter() - start)
        await asyncio.to_thread(reset_pods, pods, redis_url, model)
        seq = await sequential_overhead(stubs["prefix"], 100, seed)
        ms = [r.overhead_us / 1e3 for r in seq if r.overhead_us >= 0]
        out["decision_ms"] = await decision_cost(redis_url, model, 300, seed)
        out["sequential_overhead_ms"] = {
            "p50": pct(ms, 0.5), "p99": pct(ms, 0.99), "n": len(ms),
            "lookup_p50": pct([r.lookup_ms for r in seq], 0.5),
            "lookup_p99": pct([r.lookup_ms for r in seq], 0.99)}
    finally:
        for ch in channels.values():
            await ch.close()
    return out


# -- report ----------------------------------------------------------------------------------

def print_report(res: dict, w: Workload, args: argparse.Namespace) -> None:
    oracles = {"groups": group_oracle(w), "bursts": group_oracle(w),
               "multi_turn": multiturn_oracle(w)}
    print(f"routing: {args.pods} pods × {args.model}, block size {BS}, "
          f"pool {res['pool_blocks']} blocks/pod ({res['pool_blocks'] * BS} tokens), "
          f"concurrency {w.concurrency}, Redis on loopback, pods at nice {args.pod_nice}")
    print(f"cores: {res['placement']}")
    print(f"machine: {machine_info()}")
    print(f"groups/bursts: {w.groups} × {w.prompts_per_group} prompts, prefix {w.prefix_tokens} + "
          f"suffix {w.suffix_tokens} tokens (prefixes = 150% of one pool); multi-turn: "
          f"{w.conversations} conversations × {w.turns} turns, context {w.context_tokens}, "
          f"+{w.message_tokens}/turn; max_tokens {w.max_tokens}")
    head = (f"{'workload':<11} {'policy':<12} {'hit rate':>8} {'/oracle':>8} {'x RR':>6} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'req/s':>7} {'rtr p50':>8} {'rtr p99':>8}  "
            "requests per pod")
    print(head)
    for workload in WORKLOADS:
        rr = res[workload]["round_robin"]["hit_rate"]
        for policy in POLICIES:
            r = res[workload][policy]
            ratio = r["hit_rate"] / rr if rr else float("inf")
            print(f"{workload:<11} {policy:<12} {r['hit_rate']:>8.1%} "
                  f"{r['hit_rate'] / oracles[workload]:>8.1%} {ratio:>5.1f}x "
                  f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms "
                  f"{r['throughput_rps']:>7.2f} {r['overhead_p50_ms']:>6.2f}ms "
                  f"{r['overhead_p99_ms']:>6.2f}ms  "
                  + " ".join(f"{k[-1]}:{v}" for k, v in r["per_pod"].items()))
        print(f"{workload:<11} {'oracle':<12} {oracles[workload]:>8.1%}")
    if res["sweep"]:
        print(f"groups workload, {w.groups} groups, same pools, prompts per group swept "
              "(x RR = prefix / round_robin hit rate; scatter bound = best any random-pod "
              "policy can do with unbounded pools):")
        print(f"{'P':>3} {'requests':>8} {'prefix':>7} {'/oracle':>8} {'rr':>6} {'x RR':>5} "
              f"{'oracle':>7} {'oracle x bound':>14} {'bound':>6} {'TTFT p50 prefix/rr':>19}")
        for p, r in res["sweep"].items():
            wp = replace(w, prompts_per_group=int(p))
            oracle, bound = group_oracle(wp), scatter_bound(wp, args.pods)
            pre, rr = r["prefix"], r["round_robin"]
            print(f"{p:>3} {pre['requests']:>8} {pre['hit_rate']:>7.1%} "
                  f"{pre['hit_rate'] / oracle:>8.1%} {rr['hit_rate']:>6.1%} "
                  f"{pre['hit_rate'] / rr['hit_rate'] if rr['hit_rate'] else float('inf'):>4.1f}x"
                  f" {oracle:>7.1%} {oracle / bound if bound else float('inf'):>13.1f}x "
                  f"{bound:>6.1%} {pre['ttft_p50_ms']:>9.0f}/{rr['ttft_p50_ms']:.0f} ms")
    for pod, costs in res["published_costs"].items():
        print(f"published by {pod}: " + ", ".join(
            f"{k} {v * 1e6:.1f} us/token" for k, v in sorted(costs.items())))
    s = res["sequential_overhead_ms"]
    print(f"router overhead, one request at a time (prefix policy, 1,024-token prefix, "
          f"n={s['n']}): p50 {s['p50']:.2f} ms, p99 {s['p99']:.2f} ms (of which Redis lookup "
          f"p50 {s['lookup_p50']:.2f} ms, p99 {s['lookup_p99']:.2f} ms)")
    d = res["decision_ms"]
    print(f"routing decision alone, in-process, pods idle (text prompt, tokenize + hash + "
          f"lookup + score, n={d['n']}): p50 {d['decision_p50_ms']:.2f} ms, p99 "
          f"{d['decision_p99_ms']:.2f} ms (tokenize + hash p50 {d['prepare_p50_ms']:.2f} ms)")
    for workload in WORKLOADS:
        r = res[workload]["prefix"]
        print(f"{workload} / prefix under load: Redis lookup p50 {r['lookup_p50_ms']:.2f} ms, "
              f"p99 {r['lookup_p99_ms']:.2f} ms")
    print("(hit rate = cached / prompt tokens from the pods' usage; rtr = time inside the "
          "router per request, pod call excluded; targets: prefix >= 3x round_robin and >= "
          "90% of oracle, router p99 <= 5 ms)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller workload (< 3 min)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--model", default="pagekv-tiny",
                    help="built-in preset (the workload is made of byte-tokenizer ids)")
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pod-arg", action="append", default=[],
                    help="extra flag for every pod, e.g. --pod-arg=--cpu-offload-bytes=64MiB")
    ap.add_argument("--pod-nice", type=int, default=10,
                    help="run the pods at this nice level (0: same priority as the router)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="router and Redis on core 0, the pods and this client on the other "
                         "cores (a router host of its own; needs >= 2 cores)")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    w = QUICK if args.quick else FULL
    blocks = pool_blocks(w)
    run_dir = Path(tempfile.mkdtemp(prefix="pagekv-bench-routing-"))
    pod_args = [a for arg in args.pod_arg for a in arg.split("=", 1)]
    cpus = sorted(os.sched_getaffinity(0))
    pin = ({cpus[0]}, set(cpus[1:])) if args.pin and len(cpus) >= 2 else None
    if pin:
        os.sched_setaffinity(0, pin[0])  # Redis, started next, inherits it
    rp = RedisProcess(data_dir=run_dir / "redis").start()
    pods: list[Child] = []
    routers: dict[str, Child] = {}
    t0 = time.perf_counter()
    try:
        pods, routers = start_cluster(run_dir, rp.url, args.model, args.pods, blocks, pod_args,
                                      args.pod_nice, pin)
        startup = time.perf_counter() - t0
        res = asyncio.run(run_phases(routers, pods, rp.url, args.model, w, args.seed))
        res["pool_blocks"] = blocks
        res["placement"] = (f"router and Redis on cores {sorted(pin[0])}; pods and the client "
                            f"on cores {sorted(pin[1])}" if pin else "all processes share all cores")
        res["published_costs"] = published_costs(rp.url, args.model)
        res["startup_s"] = startup
    except BaseException:
        for child in [*pods, *routers.values()]:
            if child.proc.poll() is not None:
                print(f"{child.name} exited; log tail:\n{child.log_tail()}", file=sys.stderr)
        raise
    finally:
        for child in [*routers.values(), *pods]:
            stop_child(child, grace=10)
        rp.close()
    print_report(res, w, args)
    print(f"(total {time.perf_counter() - t0:.0f} s, cluster start-up {res['startup_s']:.0f} s;"
          f" logs in {run_dir})" if args.keep_logs else
          f"(total {time.perf_counter() - t0:.0f} s, cluster start-up {res['startup_s']:.0f} s)")
    if not args.keep_logs:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "routing", "model": args.model, "pods": args.pods,
            "machine": machine_info(), "workload": asdict(w),
            "oracle": {"groups": group_oracle(w), "bursts": group_oracle(w),
                       "multi_turn": multiturn_oracle(w)},
            "results": res}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
