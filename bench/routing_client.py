"""The routing benchmark's client side: one streamed Generate call timed, the workloads' drivers,
and the router's decision cost measured in-process."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc

from bench.routing_workloads import BOS, Workload, group_requests, rand_tokens
from bench.stats import pct
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.router.server import OVERHEAD_METADATA_KEY

# -- one request -----------------------------------------------------------------------------

@dataclass(slots=True)
class Result:
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    overhead_us: int
    served_by: str
    lookup_ms: float = 0.0
    answer: list[int] = field(default_factory=list)


async def generate(stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int) -> Result:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    first = 0.0
    answer: list[int] = []
    usage = pb.Usage()
    served_by = ""
    lookup_ms = 0.0
    call = stub.GenerateStream(req, timeout=300)
    async for chunk in call:
        if chunk.token_ids and not first:
            first = time.perf_counter()
        if chunk.index == 0:
            answer.extend(chunk.token_ids)
        if chunk.HasField("usage"):
            usage, served_by = chunk.usage, chunk.served_by
            lookup_ms = chunk.routing.lookup_ms
    end = time.perf_counter()
    meta = dict(await call.trailing_metadata() or ())
    return Result(first - t0, end - t0, usage.prompt_tokens, usage.cached_tokens,
                  usage.completion_tokens, int(meta.get(OVERHEAD_METADATA_KEY, -1)), served_by,
                  lookup_ms, answer)


async def run_groups(stub: pb_grpc.GenerationStub, w: Workload, seed: int,
                     bursts: bool = False) -> list[Result]:
    sem = asyncio.Semaphore(w.concurrency)

    async def one(prompt: list[int]) -> Result:
        async with sem:
            return await generate(stub, prompt, w.max_tokens)

    reqs = group_requests(w, seed, bursts)
    return list(await asyncio.gather(*(one(p) for _, p in reqs)))


async def run_bursts(stub: pb_grpc.GenerationStub, w: Workload, seed: int) -> list[Result]:
    return await run_groups(stub, w, seed, bursts=True)


async def run_multiturn(stub: pb_grpc.GenerationStub, w: Workload, seed: int) -> list[Result]:
    rng = random.Random(seed + 1)
    openings = [[BOS] + rand_tokens(rng, w.context_tokens - 1) for _ in range(w.conversations)]
    messages = [[rand_tokens(rng, w.message_tokens) for _ in range(w.turns)]
                for _ in range(w.conversations)]
    sem = asyncio.Semaphore(w.concurrency)
    results: list[Result] = []

    async def conversation(c: int) -> None:
        history = list(openings[c])
        for t in range(w.turns):
            prompt = history + messages[c][t]
            async with sem:
                r = await generate(stub, prompt, w.max_tokens)
            results.append(r)
            history = prompt + r.answer
            await asyncio.sleep(rng.random() * 0.05)  # the user types

    await asyncio.gather(*(conversation(c) for c in range(w.conversations)))
    return results


async def decision_cost(redis_url: str, model: str, n: int, seed: int) -> dict:
    """The routing decision alone, in this process, with the pods idle: tokenize + hash +
    one Redis lookup + scoring for a prompt whose 1,024-token prefix one pod holds."""
    import redis.asyncio as aioredis

    from pagekv.router.config import RouterConfig
    from pagekv.router.metrics import RouterMetrics
    from pagekv.router.routing import Router
    from pagekv.router.tokenize import load_tokenizer

    client = aioredis.Redis.from_url(redis_url)
    router = Router(RouterConfig(redis_url=redis_url, model=model), client,
                    load_tokenizer(model), RouterMetrics())
    await router.registry.refresh()
    rng = random.Random(seed + 3)
    text = "".join(chr(32 + rng.randrange(90)) for _ in range(1023))
    stub = pb_grpc.GenerationStub(grpc.aio.insecure_channel(
        router.registry.eligible()[0].info.address))
    await generate(stub, [BOS] + list(text.encode()) + [1] * 20, 1)  # one pod holds it
    await asyncio.sleep(0.3)
    prep, total = [], []
    for i in range(n):
        req = pb.GenerateRequest(text=text + f" question {i}: " + "x" * (i % 40))
        t0 = time.perf_counter()
        prepared = router.prepare(req)
        t1 = time.perf_counter()
        decision = await router.decide(prepared)
        t2 = time.perf_counter()
        prep.append(t1 - t0)
        total.append(t2 - t0)
    await client.aclose()
    return {"prepare_p50_ms": 1e3 * pct(prep, 0.5), "prepare_p99_ms": 1e3 * pct(prep, 0.99),
            "decision_p50_ms": 1e3 * pct(total, 0.5), "decision_p99_ms": 1e3 * pct(total, 0.99),
            "n": n, "reason": decision.reason}


async def sequential_overhead(stub: pb_grpc.GenerationStub, n: int, seed: int
                              ) -> list[Result]:
    """Router overhead with one request at a time (no contention from other requests)."""
    rng = random.Random(seed + 2)
    prefix = [BOS] + rand_tokens(rng, 1023)
    return [await generate(stub, prefix + rand_tokens(rng, 16 + i % 7), 1) for i in range(n)]
