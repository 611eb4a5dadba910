"""Routing LoRA traffic: 16 adapters over 4 pods, adapter-aware routing vs adapter-blind prefix
routing, in the same run (issue #32).

Four real pods (`pagekv-small` by default, the 2-core box's cores split among them), each
serving all 16 adapters (`--lora-modules`, rank 16 on all seven projections, PEFT's files)
with 4 slots (`--max-loras 4`: a pod holds a quarter of them at once), an embedded Redis, and
two routers on the same index:

- adapter-aware (the default): an adapter's request is hashed with the adapter (vLLM's
  ("lora", name, path) key) so its cached prefix is found, and a pod that would have to load
  the adapter pays its measured load time in the score;
- adapter-blind (`--no-adapter-routing`): the same prefix router, hashing and scoring as if
  there were no adapters (what a router without LoRA support does: its hashes never match an
  adapter's blocks, so each request is placed by load alone).

Two workloads, each run by both routers: "own prompts" — each adapter has its own system
prompt (`--system` tokens) shared by its requests; "one prompt" — every adapter's requests
start with the same system prompt (one application, an adapter per customer). Each request
adds its own tail; the 16 adapters' requests interleave at random, one output token (the
latency is the TTFT), `--concurrency` at once, closed loop. The two routers take turns on
the same sequence (`--passes`, the order alternating); before each pass every pod's cache is
reset. Figures per router: prefix hit rate (cached prompt tokens /
prompt tokens), adapter loads on the pods (`pagekv_pod_lora_loads_total`), TTFT p50/p90, and
the ratios.

    python -m bench.lora_routing [--quick] [--requests N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.kv_pull import reset, scrape
from bench.lora_batch import write_adapter
from bench.machine import machine_info
from bench.stats import pct
from pagekv.deploy.local_cluster import LocalCluster, wait_healthy
from pagekv.kvnode.model.runner import ModelRunner
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

ADAPTERS = 16
PODS = 4
CONFIGS = {"adapter-aware": [], "adapter-blind": ["--no-adapter-routing"]}


def run_pass(router: str, requests: list[tuple[str, list[int]]], concurrency: int
             ) -> tuple[list[float], int, int]:
    """(latencies, cached tokens, prompt tokens) of the whole sequence through `router`."""
    latencies: list[float] = []
    cached = prompt = 0
    lock = threading.Lock()
    queue = list(reversed(requests))

    def worker() -> None:
        nonlocal cached, prompt
        with grpc.insecure_channel(router) as ch:
            stub = pb_grpc.GenerationStub(ch)
            while True:
                with lock:
                    if not queue:
                        return
                    name, ids = queue.pop()
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), lora_name=name,
                                         sampling=pb.SamplingParams(max_tokens=1,
                                                                    temperature=0.0))
                t0 = time.perf_counter()
                resp = stub.Generate(req, timeout=300)
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
                    cached += resp.usage.cached_tokens
                    prompt += resp.usage.prompt_tokens

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, cached, prompt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="pagekv-small")
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--system", type=int, default=256)
    ap.add_argument("--tail", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="pagekv-tiny, 64 requests, 1 pass each")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.requests, args.passes = "pagekv-tiny", 64, 1
    run_dir = Path(tempfile.mkdtemp(prefix="pagekv-lora-routing-"))
    probe = ModelRunner(args.model, block_size=16, num_gpu_blocks=64, device="cpu",
                        max_model_len=512)
    modules = []
    for k in range(ADAPTERS):
        write_adapter(run_dir / f"adapter-{k}", probe, args.rank, 500 + k)
        modules.append(f"a{k}={run_dir / f'adapter-{k}'}")
    vocab = probe.model_config.vocab_size
    del probe
    rng = random.Random(7)
    own = {f"a{k}": [rng.randrange(1, vocab) for _ in range(args.system)]
           for k in range(ADAPTERS)}
    common = [rng.randrange(1, vocab) for _ in range(args.system)]
    workloads: dict[str, list[tuple[str, list[int]]]] = {"own prompts": [], "one prompt": []}
    for _ in range(args.requests):
        name = f"a{rng.randrange(ADAPTERS)}"
        tail = [rng.randrange(1, vocab) for _ in range(args.tail)]
        workloads["own prompts"].append((name, own[name] + tail))
        workloads["one prompt"].append((name, common + tail))
    node = ["--num-gpu-blocks", "1024", "--max-model-len", "1024", "--max-loras", "4",
            "--lora-modules", *modules]
    cluster = LocalCluster(nodes=PODS, model=args.model, node_args=node, start_router=False,
                           run_dir=run_dir)
    cluster.start()
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        routers = {name: cluster.start_router_process(f"router-{i}", extra)
                   for i, (name, extra) in enumerate(CONFIGS.items())}
        for r in routers.values():
            wait_healthy(r.address, 120, r.proc)
        time.sleep(2.0)  # the routers' first registry refresh sees every pod's adapters
        for workload, requests in workloads.items():
            lat: dict[str, list[float]] = {n: [] for n in CONFIGS}
            cached = dict.fromkeys(CONFIGS, 0)
            prompt = dict.fromkeys(CONFIGS, 0)
            loads = dict.fromkeys(CONFIGS, 0.0)
            for p in range(args.passes):
                order = list(CONFIGS) if p % 2 == 0 else list(reversed(CONFIGS))
                for name in order:
                    for pod in cluster.pods:
                        reset(pod.address)
                    before = sum(scrape(pod).get("pagekv_pod_lora_loads_total", 0.0)
                                 for pod in cluster.pods)
                    got, c, n = run_pass(routers[name].address, requests, args.concurrency)
                    after = sum(scrape(pod).get("pagekv_pod_lora_loads_total", 0.0)
                                for pod in cluster.pods)
                    lat[name] += got
                    cached[name] += c
                    prompt[name] += n
                    loads[name] += after - before
            results[workload] = {
                name: {"hit_rate": cached[name] / max(1, prompt[name]),
                       "adapter_loads": loads[name] / args.passes,
                       "ttft_p50_s": pct(lat[name], 0.5), "ttft_p90_s": pct(lat[name], 0.9)}
                for name in CONFIGS}
    finally:
        cluster.stop()
    print(f"model {args.model}; {PODS} pods x 4 adapter slots, {ADAPTERS} adapters (rank "
          f"{args.rank}, all projections); {args.requests} requests (system {args.system} + "
          f"tail {args.tail} tokens, 1 output token), {args.concurrency} at once, "
          f"{args.passes} passes each; {machine_info()}")
    print("| workload | router | prefix hit rate | adapter loads per pass | TTFT p50 s | "
          "TTFT p90 s |")
    print("|---|---|---|---|---|---|")
    for workload, by_router in results.items():
        for name in CONFIGS:
            r = by_router[name]
            print(f"| {workload} | {name} | {r['hit_rate']:.3f} | {r['adapter_loads']:.0f} | "
                  f"{r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} |")
    for workload, by_router in results.items():
        aware, blind = by_router["adapter-aware"], by_router["adapter-blind"]
        print(f"{workload}: aware / blind: hit rate "
              f"{aware['hit_rate'] / max(1e-9, blind['hit_rate']):.2f}x, loads "
              f"{aware['adapter_loads'] / max(1.0, blind['adapter_loads']):.2f}x, TTFT p90 "
              f"{aware['ttft_p90_s'] / blind['ttft_p90_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None},
                                         "results": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
