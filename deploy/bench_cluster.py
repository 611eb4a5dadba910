"""`pagekv bench-cluster` (and `make demo`): a shared-prefix workload through the router.

Starts a local cluster (embedded Redis, N pods with DRAM and SSD tiers, the router) unless
--router points at a running one, then sends three rounds of requests:
  1. cold   — the first request of each group: nothing is cached anywhere;
  2. warm   — more requests per group: the router sends each to the pod holding its prefix;
  3. revisit — after the pools have overflowed: prefixes come back from DRAM or SSD.
It prints requests per pod, prefix hits per tier, time to first token cold vs. warm, and the
routing decisions, then stops the cluster.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

TIERS = ("gpu", "cpu", "disk")


@dataclass
class Result:
    round: str
    group: int
    ttft_s: float
    served_by: str
    cached: dict[str, int]
    prompt_tokens: int
    reason: str


def group_prompts(groups: int, prefix_tokens: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ("cache block prefix token router tier memory page hash pod evict reuse "
             "stream batch decode prefill layer head value key").split()
    out = []
    for g in range(groups):
        text = f"System prompt {g}: you are assistant number {g}. "
        while len(text.encode()) < prefix_tokens:
            text += rng.choice(words) + " "
        out.append(text[:prefix_tokens])
    return out


def call(stub, prompt: str, max_tokens: int) -> tuple[float, pb.GenerateChunk]:
    req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    ttft = None
    last = None
    for chunk in stub.GenerateStream(req, timeout=300):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - t0
        last = chunk
    return ttft or (time.perf_counter() - t0), last


def run_workload(address: str, groups: int, per_group: int, prefix_tokens: int,
                 max_tokens: int) -> list[Result]:
    prefixes = group_prompts(groups, prefix_tokens)
    plan: list[tuple[str, int, str]] = []
    for g, p in enumerate(prefixes):
        plan.append(("cold", g, p + f" Question 0 for group {g}?"))
    for i in range(1, per_group):
        for g, p in enumerate(prefixes):
            plan.append(("warm", g, p + f" Question {i} for group {g}?"))
    for g, p in enumerate(prefixes):
        plan.append(("revisit", g, p + f" Follow-up for group {g}?"))
    from tqdm import tqdm

    from pagekv.kvnode.pod.cli import CliError

    results = []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for rnd, g, prompt in tqdm(plan, desc="requests", unit="req", file=sys.stderr):
            try:
                ttft, last = call(stub, prompt, max_tokens)
            except grpc.RpcError as e:  # e.g. a prompt past max_model_len: say so, no trace
                raise CliError(f"the {rnd} request of group {g} failed: {e.code().name}: "
                               f"{e.details()}") from None
            u = last.usage
            results.append(Result(rnd, g, ttft, last.served_by,
                                  {"gpu": u.cached_tokens_gpu, "cpu": u.cached_tokens_cpu,
                                   "disk": u.cached_tokens_disk}, u.prompt_tokens,
                                  last.routing.reason or "direct"))
    return results


def report(results: list[Result]) -> str:
    lines = []
    per_pod = Counter(r.served_by for r in results)
    lines.append("\nRequests per pod")
    lines.append("| pod | requests | groups served |")
    lines.append("|---|---|---|")
    for pod, n in sorted(per_pod.items()):
        groups = sorted({r.group for r in results if r.served_by == pod})
        lines.append(f"| {pod} | {n} | {groups} |")

    lines.append("\nPrefix hits per tier (prompt tokens not recomputed)")
    lines.append("| round | requests | prompt tokens | GPU pool | CPU DRAM | SSD | hit rate |")
    lines.append("|---|---|---|---|---|---|---|")
    for rnd in ("cold", "warm", "revisit", "all"):
        rs = [r for r in results if rnd in ("all", r.round)]
        if not rs:
            continue
        prompt = sum(r.prompt_tokens for r in rs)
        hits = {t: sum(r.cached[t] for r in rs) for t in TIERS}
        rate = sum(hits.values()) / prompt if prompt else 0.0
        lines.append(f"| {rnd} | {len(rs)} | {prompt} | {hits['gpu']} | {hits['cpu']} | "
                     f"{hits['disk']} | {rate:.0%} |")

    lines.append("\nTime to first token")
    lines.append("| round | p50 ms | mean ms | vs cold |")
    lines.append("|---|---|---|---|")
    cold = statistics.median(r.ttft_s for r in results if r.round == "cold")
    for rnd in ("cold", "warm", "revisit"):
        ts = [r.ttft_s for r in results if r.round == rnd]
        if ts:
            med = statistics.median(ts)
            lines.append(f"| {rnd} | {med * 1e3:.1f} | {statistics.fmean(ts) * 1e3:.1f} | "
                         f"{cold / med:.1f}x faster |" if rnd != "cold" else
                         f"| {rnd} | {med * 1e3:.1f} | {statistics.fmean(ts) * 1e3:.1f} | 1.0x |")

    lines.append("\nRouting decisions")
    lines.append("| reason | requests |")
    lines.append("|---|---|")
    for reason, n in Counter(r.reason for r in results).most_common():
        lines.append(f"| {reason} | {n} |")
    lines.append("\nPer request: round, group, pod, reason, cached gpu/cpu/disk, TTFT ms")
    for r in results:
        lines.append(f"  {r.round:<7} g{r.group} -> {r.served_by:<7} {r.reason:<28} "
                     f"{r.cached['gpu']:>5}/{r.cached['cpu']:>5}/{r.cached['disk']:>5} "
                     f"{r.ttft_s * 1e3:7.1f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagekv.deploy.local_cluster import add_cluster_arguments

    add_cluster_arguments(p)
    p.set_defaults(model="pagekv-small", router_port=None)
    p.add_argument("--router", default=None, help="use a running router instead of a new cluster")
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--per-group", type=int, default=3)
    p.add_argument("--prefix-tokens", type=int, default=768)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--num-gpu-blocks", type=int, default=112, help="per pod (small: forces spills)")
    p.add_argument("--cpu-offload-bytes", default="2MiB", help="per pod")
    p.add_argument("--disk-offload-bytes", default="256MiB", help="per pod")


def main(args: argparse.Namespace) -> int:
    from pagekv.deploy.local_cluster import LocalCluster

    if args.router:
        results = run_workload(args.router, args.groups, args.per_group, args.prefix_tokens,
                               args.max_tokens)
        print(report(results))
        return 0
    node_args = [
        "--num-gpu-blocks", str(args.num_gpu_blocks), "--max-model-len", "1024",
        "--cpu-offload-bytes", args.cpu_offload_bytes,
        "--disk-offload-bytes", args.disk_offload_bytes,
        "--disk-offload-dir", "{run_dir}/{pod_id}-ssd", *args.node_arg,
    ]
    from pathlib import Path

    cluster = LocalCluster(nodes=args.nodes, model=args.model, redis_url=args.redis_url,
                           run_dir=Path(args.run_dir) if args.run_dir else None,
                           router_port=args.router_port, node_args=node_args)
    t0 = time.perf_counter()
    print(f"starting a local cluster: embedded Redis, {args.nodes} pods ({args.model}), "
          "the router ...", flush=True)
    with cluster:
        print(cluster.describe(), flush=True)
        print(f"cluster ready in {time.perf_counter() - t0:.1f} s; sending "
              f"{args.groups * (args.per_group + 1)} requests ({args.groups} groups sharing "
              f"{args.prefix_tokens}-token prefixes)", flush=True)
        results = run_workload(cluster.router.address, args.groups, args.per_group,
                               args.prefix_tokens, args.max_tokens)
        print(report(results), flush=True)
    print("cluster stopped", flush=True)
    return 0
