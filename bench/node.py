"""One pod over gRPC vs. the offline engine on the same requests (the server's overhead).

Concurrent streaming clients against a real pod process on `pagekv-small` (with a real
Redis index): requests/s, TTFT p50/p99, output tokens/s; the offline engine on the same
requests in the same run; and event publishing: events/s and the lag from block stored to
visible in Redis (p50/p99, measured by the pod's publisher per batch).

    python -m bench.node [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.machine import machine_info
from bench.stats import pct
from pagekv.deploy.local_cluster import LocalCluster
from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

MODEL = "pagekv-small"
ENGINE = ["--num-gpu-blocks", "2048", "--max-model-len", "2048"]


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(256)]
    reqs = []
    for _ in range(n):
        head = system if rng.random() < 0.5 else []
        prompt = head + [rng.randrange(256) for _ in range(rng.randint(64, 384))]
        reqs.append((prompt, rng.randint(32, 64)))
    return reqs



def greedy_request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def rates(num_requests: int, output_tokens: int, wall: float) -> dict:
    return {"wall_s": wall, "requests_per_s": num_requests / wall,
            "tokens_per_s": output_tokens / wall, "output_tokens": output_tokens}


def drive(address: str, reqs, concurrency: int) -> dict:
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.GenerationStub(channel)

    def one(item):
        req = greedy_request(*item)
        t0 = time.perf_counter()
        first = None
        n = 0
        for chunk in stub.GenerateStream(req, timeout=600):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            n += len(chunk.token_ids)
        return first, time.perf_counter() - t0, n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, reqs))
    wall = time.perf_counter() - t0
    channel.close()
    ttfts = [r[0] for r in results]
    return {**rates(len(reqs), sum(r[2] for r in results), wall),
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99)}


def drive_all_at_once(address: str, reqs) -> dict:
    """Every request sent at once on one asyncio channel: the pod's own queue refills its
    batch the moment a sequence finishes, as the offline engine's does. What is left of the
    gap to offline is the server's overhead, not the clients' round trips."""
    import asyncio

    async def run() -> list[tuple[float, float, int]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)

            async def one(item) -> tuple[float, float, int]:
                req = greedy_request(*item)
                t0 = time.perf_counter()
                first, n = None, 0
                async for chunk in stub.GenerateStream(req, timeout=600):
                    if first is None and chunk.token_ids:
                        first = time.perf_counter() - t0
                    n += len(chunk.token_ids)
                return first, time.perf_counter() - t0, n

            return list(await asyncio.gather(*(one(r) for r in reqs)))

    t0 = time.perf_counter()
    results = asyncio.run(run())
    return rates(len(reqs), sum(r[2] for r in results), time.perf_counter() - t0)


def offline(reqs, concurrency: int) -> dict:
    """The same requests in-process; at most `concurrency` in the batch, like the clients."""
    llm = LLM(MODEL, num_gpu_blocks=2048, max_model_len=2048, max_num_seqs=concurrency)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in reqs]
    llm.generate([p for p, _ in reqs[:2]], params[:2])  # warm-up, as for the pod
    llm.engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    return rates(len(reqs), sum(len(o.outputs[0].token_ids) for o in outs),
                 time.perf_counter() - t0)


LAG = "pagekv_index_publish_lag_seconds"


def scrape(port: int) -> dict[str, float]:
    """The pod's unlabelled series (besides pod/model_name), and the lag histogram's buckets
    as `<LAG>_bucket:<le>`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            extra = s.labels.keys() - {"pod", "model_name"}
            if not extra:
                out[s.name] = s.value
            elif extra == {"le"} and s.name == LAG + "_bucket":
                out[f"{s.name}:{s.labels['le']}"] = s.value
    return out


def lag_quantile(before: dict[str, float], after: dict[str, float], q: float) -> float:
    """q-quantile of the batches published between two scrapes, interpolated inside its
    bucket as Prometheus' histogram_quantile does."""
    edges = sorted((float(k.split(":", 1)[1]), after[k] - before.get(k, 0.0))
                   for k in after if k.startswith(LAG + "_bucket:"))
    total = edges[-1][1] if edges else 0.0
    if total <= 0:
        return 0.0
    rank, prev_le, prev_n = q * total, 0.0, 0.0
    for le, n in edges:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-12)
        prev_le, prev_n = le, n
    return prev_le


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    n = 24 if args.quick else 96
    reqs = workload(n)
    info = machine_info()
    print(f"# Pod benchmark ({MODEL}, {n} requests, {args.concurrency} concurrent clients) — "
          f"{info}")
    # The offline engine runs before and after the pod (the mean is the baseline): this
    # shared box drifts by 10-20% between minutes.
    before_pod = offline(reqs, args.concurrency)
    # The pod batches at most `concurrency` sequences, like the offline engine.
    engine = [*ENGINE, "--max-num-seqs", str(args.concurrency)]
    with LocalCluster(nodes=1, model=MODEL, node_args=engine, start_router=False) as cluster:
        pod = cluster.pods[0]
        drive(pod.address, reqs[:2], 2)  # warm-up (kernel load, first allocations)
        with grpc.insecure_channel(pod.address) as ch:
            pb_grpc.KVNodeStub(ch).ResetPrefixCache(pb.ResetPrefixCacheRequest())
        before = scrape(pod.metrics_port)
        served = drive(pod.address, reqs, args.concurrency)
        time.sleep(0.3)
        after = scrape(pod.metrics_port)
        with grpc.insecure_channel(pod.address) as ch:
            pb_grpc.KVNodeStub(ch).ResetPrefixCache(pb.ResetPrefixCacheRequest())
        queued = drive_all_at_once(pod.address, reqs)
    after_pod = offline(reqs, args.concurrency)
    local = {k: (before_pod[k] + after_pod[k]) / 2 for k in before_pod}
    published = "pagekv_index_events_published_total"  # a counter: the sample has _total
    events = after.get(published, 0) - before.get(published, 0)
    print("\n| path | wall s | requests/s | output tokens/s | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|")
    print(f"| offline engine (mean of before/after: {before_pod['tokens_per_s']:.0f} / "
          f"{after_pod['tokens_per_s']:.0f} tokens/s) | {local['wall_s']:.1f} | "
          f"{local['requests_per_s']:.2f} | {local['tokens_per_s']:.1f} | - | - |")
    print(f"| pod over gRPC | {served['wall_s']:.1f} | {served['requests_per_s']:.2f} | "
          f"{served['tokens_per_s']:.1f} | {served['ttft_p50_s'] * 1e3:.0f} | "
          f"{served['ttft_p99_s'] * 1e3:.0f} |")
    print(f"| pod over gRPC, all {n} sent at once | {queued['wall_s']:.1f} | "
          f"{queued['requests_per_s']:.2f} | {queued['tokens_per_s']:.1f} | - | - |")
    print(f"server throughput / offline: {served['tokens_per_s'] / local['tokens_per_s']:.2f}x "
          f"with {args.concurrency} closed-loop clients, "
          f"{queued['tokens_per_s'] / local['tokens_per_s']:.2f}x with every request queued")
    batches = after.get(LAG + "_count", 0) - before.get(LAG + "_count", 0)
    lag_sum = after.get(LAG + "_sum", 0) - before.get(LAG + "_sum", 0)
    print("\n| index events published | events/s | batches | publish lag p50 ms | p99 ms | "
          "mean ms |")
    print("|---|---|---|---|---|---|")
    print(f"| {events:.0f} | {events / served['wall_s']:.0f} | {batches:.0f} | "
          f"{lag_quantile(before, after, 0.5) * 1e3:.1f} | "
          f"{lag_quantile(before, after, 0.99) * 1e3:.1f} | "
          f"{lag_sum / batches * 1e3 if batches else 0.0:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "served": served, "queued": queued, "offline": local,
                       "events": events, "lag": {k: v for k, v in after.items() if "lag" in k}},
                      f, indent=2)


if __name__ == "__main__":
    main()
