"""One pod, the same requests at the same concurrency: gRPC streaming vs OpenAI's HTTP API.

Closed-loop streaming clients (asyncio, one process) against one real pod process: output
tokens/s, TTFT p50/p90 and inter-token latency p50 (TTFT and ITL by the chunks that carry
text, alike for all three: a token whose text is held back, part of a character, is not yet
something a reader sees) for
- gRPC: `GenerateStream` on one grpc.aio channel (the baseline);
- HTTP, official client: `openai.AsyncOpenAI` streaming /v1/completions, every chunk parsed
  into the client's objects (what an application pays);
- HTTP, raw lines: the same client's `with_streaming_response`, each SSE line read and
  json-decoded (the server's cost without the client's object building).
The three run in turns, twice each (drift on a shared box cancels); the table gives each
one's mean and its ratio to gRPC.

    python -m bench.http_vs_grpc [--quick] [--model M] [--concurrency C] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable

import grpc
import openai

from bench.machine import machine_info
from bench.stats import pct
from pagekv.deploy.local_cluster import LocalCluster
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

Result = tuple[float, list[float], int]  # TTFT, token arrival times, output tokens


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Prompts of 64-256 random token ids (no shared prefix, and the pod's cache is reset
    before every run: this measures transport, not caching), 32-64 output tokens each."""
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(64, 256))], rng.randint(32, 64))
            for _ in range(n)]


async def closed_loop(reqs, concurrency: int, one: Callable[..., Awaitable[Result]]) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def guarded(item) -> Result:
        async with gate:
            return await one(*item)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(guarded(r) for r in reqs))
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    itls = [b - a for r in results for a, b in zip(r[1], r[1][1:], strict=False)]
    tokens = sum(r[2] for r in results)
    return {"wall_s": wall, "tokens_per_s": tokens / wall, "output_tokens": tokens,
            "ttft_p50_ms": pct(ttfts, 0.5) * 1e3, "ttft_p90_ms": pct(ttfts, 0.9) * 1e3,
            "itl_p50_ms": pct(itls, 0.5) * 1e3 if itls else 0.0}


def grpc_client(address: str):
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.GenerationStub(channel)

    async def one(prompt: list[int], max_tokens: int) -> Result:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        times, n = [], 0
        async for chunk in stub.GenerateStream(req, timeout=600):
            if chunk.text:  # as the HTTP clients count: text a reader sees
                times.append(time.perf_counter())
            n += len(chunk.token_ids)
        return times[0] - t0, times, n

    return one, channel.close


def http_body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def openai_client(base_url: str, model: str):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                timeout=600)

    async def one(prompt: list[int], max_tokens: int) -> Result:
        body = http_body(prompt, max_tokens)
        t0 = time.perf_counter()
        times, n = [], 0
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options=body["stream_options"], extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        return times[0] - t0, times, n

    return one, client.close


def raw_lines_client(base_url: str, model: str):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                timeout=600)

    async def one(prompt: list[int], max_tokens: int) -> Result:
        t0 = time.perf_counter()
        times, n = [], 0
        async with client.completions.with_streaming_response.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        ) as resp:
            async for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["text"]:
                    times.append(time.perf_counter())
                if event.get("usage"):
                    n = event["usage"]["completion_tokens"]
        return times[0] - t0, times, n

    return one, client.close


async def measure(cluster: LocalCluster, model: str, reqs, concurrency: int,
                  rounds: int) -> dict[str, list[dict]]:
    pod = cluster.pods[0]
    base_url = f"http://127.0.0.1:{pod.http_port}/v1"
    clients = {"gRPC GenerateStream": grpc_client(pod.address),
               "HTTP, official openai client": openai_client(base_url, model),
               "HTTP, raw SSE lines": raw_lines_client(base_url, model)}
    for one, _ in clients.values():  # warm-up: connections, kernels, first allocations
        await closed_loop(reqs[:2], 2, one)
    out: dict[str, list[dict]] = {name: [] for name in clients}
    async with grpc.aio.insecure_channel(pod.address) as channel:
        kv = pb_grpc.KVNodeStub(channel)
        for _ in range(rounds):
            for name, (one, _) in clients.items():
                # Every run cold: the same prompts must not hit the previous run's cache.
                reset = await kv.ResetPrefixCache(pb.ResetPrefixCacheRequest(include_tiers=True))
                assert reset.success, reset.message
                out[name].append(await closed_loop(reqs, concurrency, one))
    for _, close in clients.values():
        await close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    n = 16 if args.quick else 48
    from pagekv.proto.model_files import prompt_tokenizer

    vocab = prompt_tokenizer(args.model).vocab_size
    reqs = workload(n, min(vocab, 32000))
    engine = ["--num-gpu-blocks", "1024", "--max-model-len", "1024",
              "--max-num-seqs", str(args.concurrency)]
    print(f"# HTTP vs gRPC on one pod ({args.model}, {n} requests, {args.concurrency} "
          f"concurrent streams, 2 rounds each, interleaved) — {machine_info()}")
    with LocalCluster(nodes=1, model=args.model, node_args=engine, start_router=False) as c:
        runs = asyncio.run(measure(c, args.model, reqs, args.concurrency, 2))
    base = statistics.mean(r["tokens_per_s"] for r in runs["gRPC GenerateStream"])
    print("\n| client | output tokens/s (per round) | vs gRPC | TTFT p50 ms | TTFT p90 ms "
          "| ITL p50 ms |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for name, rs in runs.items():
        tps = statistics.mean(r["tokens_per_s"] for r in rs)
        row = {k: statistics.mean(r[k] for r in rs) for k in rs[0]}
        summary[name] = {**row, "ratio_vs_grpc": tps / base, "rounds": rs}
        per = " / ".join(f"{r['tokens_per_s']:.0f}" for r in rs)
        print(f"| {name} | {tps:.1f} ({per}) | {tps / base:.2f}x | {row['ttft_p50_ms']:.0f} | "
              f"{row['ttft_p90_ms']:.0f} | {row['itl_p50_ms']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "requests": n, "concurrency": args.concurrency,
                       "machine": machine_info(), "results": summary}, f, indent=2)


if __name__ == "__main__":
    main()
