"""Fault scenarios against a real local cluster: each injects one fault under load and measures
what a user of the cluster sees. The fault suite (tests/integration/test_faults.py) runs them
short and asserts the properties; `bench/faults.py` runs them longer and prints the figures.

Every scenario is bounded in calls and time and stops by itself.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from bench.closed_loop import ClosedLoop
from pagekv.deploy.local_cluster import Child, LocalCluster, wait_healthy
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

# The router tried the dead pod first, or skipped it while it cooled down.
ROUTED_AROUND = ("retry_after_unavailable", "best_pod_cooling_down")


def prompts(groups: int, per_group: int, prefix_tokens: int = 96, seed: int = 0
            ) -> list[list[int]]:
    """Prompts of the byte-tokenizer presets sharing one prefix per group, interleaved."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 256) for _ in range(prefix_tokens)] for _ in range(groups)]
    return [prefixes[g] + [rng.randrange(1, 256) for _ in range(8)]
            for _ in range(per_group) for g in range(groups)]


@dataclass
class Call:
    done_at: float  # monotonic
    code: str
    reason: str = ""
    served_by: str = ""
    predicted_cached: int = 0  # tokens the router found in the index for this prompt
    eligible: tuple[str, ...] = ()  # pods the router could have chosen


@dataclass
class Load:
    """Unary Generate calls from `concurrency` threads until stopped or `max_calls` are made."""

    address: str
    prompts: list[list[int]]
    concurrency: int = 2
    max_calls: int = 50_000  # a bound; scenarios stop the load by time first
    max_tokens: int = 2
    _loop: ClosedLoop[Call] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._loop = ClosedLoop(self.address, self.concurrency, self.max_calls, self._call)

    def start(self) -> Load:
        self._loop.start()
        return self

    def _call(self, stub: pb_grpc.GenerationStub, i: int) -> Call:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=self.prompts[i % len(self.prompts)]),
                                 sampling=pb.SamplingParams(max_tokens=self.max_tokens,
                                                            temperature=0.0))
        try:
            resp = stub.Generate(req, timeout=30)
        except grpc.RpcError as e:
            return Call(time.monotonic(), e.code().name)
        r = resp.routing
        return Call(time.monotonic(), "OK", r.reason, resp.served_by, r.predicted_cached_tokens,
                    tuple(c.pod_id for c in r.candidates if c.eligible))

    def stop(self) -> list[Call]:
        return self._loop.stop(60)[0]


def codes(calls: list[Call]) -> Counter:
    return Counter(c.code for c in calls)


def failed(calls: list[Call]) -> int:
    return sum(c.code != "OK" for c in calls)


def first_after(calls: list[Call], t: float, pred) -> float | None:
    """Seconds from `t` to the first call completed after it that satisfies `pred`."""
    hits = [c.done_at for c in calls if c.done_at >= t and pred(c)]
    return min(hits) - t if hits else None


def redis_restart(cluster: LocalCluster, down_s: float = 2.0, warm_s: float = 2.0,
                  after_s: float = 6.0, concurrency: int = 2) -> dict:
    """Redis SIGKILLed under load and restarted on the same port (empty: pods republish)."""
    load = Load(cluster.router.address, prompts(4, 8), concurrency).start()
    time.sleep(warm_s)
    assert cluster.redis is not None
    os.kill(cluster.redis.pid, signal.SIGKILL)
    killed = time.monotonic()
    time.sleep(down_s)
    cluster.redis.start()
    back = time.monotonic()
    time.sleep(after_s)
    calls = load.stop()
    during = [c for c in calls if killed <= c.done_at < back]
    return {"calls": len(calls), "failed": failed(calls), "codes": dict(codes(calls)),
            "calls_while_down": len(during),
            "fallback_while_down": sum(c.reason == "index_down_least_loaded" for c in during),
            # The index answers again with the pods' republished blocks (the reason alone
            # would not say it: both pods may hold every prefix after load-only routing).
            "prefix_routing_back_s": first_after(calls, back, lambda c: c.predicted_cached > 0)}


def pod_kill(cluster: LocalCluster, victim: Child, warm_s: float = 2.0, dead_s: float = 5.0,
             after_s: float = 5.0, concurrency: int = 2) -> dict:
    """A pod SIGKILLed under load, then restarted with the same pod id."""
    load = Load(cluster.router.address, prompts(4, 8), concurrency).start()
    time.sleep(warm_s)
    os.killpg(victim.proc.pid, signal.SIGKILL)  # no clean shutdown: only its lease can expire
    victim.proc.wait(10)
    killed = time.monotonic()
    time.sleep(dead_s)
    cluster.children.remove(victim)
    cluster.pods.remove(victim)
    reborn = cluster.start_pod(victim.name)
    wait_healthy(reborn.address, 120, reborn.proc)
    back = time.monotonic()
    time.sleep(after_s)
    calls = load.stop()
    around = [c.done_at for c in calls if killed <= c.done_at < back and c.reason in ROUTED_AROUND]
    return {"calls": len(calls), "failed": failed(calls), "codes": dict(codes(calls)),
            "routed_around": len(around),
            "dropped_after_s": (max(around) - killed) if around else 0.0,
            "served_by_dead_pod": sum(c.served_by == victim.name
                                      for c in calls if killed <= c.done_at < back),
            # A candidate again (it serves once its load or a prefix makes it the cheapest).
            "rejoined_after_s": first_after(calls, back, lambda c: victim.name in c.eligible),
            "restarted": reborn}


def free_blocks(address: str) -> tuple[int, int]:
    """(free blocks, pool blocks) of a pod."""
    with grpc.insecure_channel(address) as ch:
        st = pb_grpc.KVNodeStub(ch).Stats(pb.StatsRequest(), timeout=10)
    return st.num_free_blocks, st.num_blocks


def burst(address: str, streams: int, pods: list[str], max_tokens: int = 16) -> dict:
    """`streams` concurrent streams at once to `address` (a pod or the router); every one must
    end with OK or RESOURCE_EXHAUSTED, none may hang, and every block of `pods` come back."""
    idle = [free_blocks(p)[0] for p in pods]
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts(1, 1)[0]),
                             sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                        ignore_eos=True))

    def one(_: int) -> str:
        with grpc.insecure_channel(address) as ch:
            try:
                for _chunk in pb_grpc.GenerationStub(ch).GenerateStream(req, timeout=120):
                    pass
                return "OK"
            except grpc.RpcError as e:
                return e.code().name

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=streams) as pool:  # all at once, really
        got = Counter(pool.map(one, range(streams)))
    wall = time.monotonic() - t0
    deadline = time.monotonic() + 10
    while [free_blocks(p)[0] for p in pods] != idle and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"streams": streams, "codes": dict(got), "wall_s": wall,
            "blocks_back": [free_blocks(p)[0] for p in pods] == idle}


def ssd_damage(directory: str, prompts_n: int = 6, flips: int = 200, truncate: bool = True,
               seed: int = 0) -> dict:
    """Fill an engine's SSD tier, close it, flip `flips` random bytes across its segment files
    (and cut the largest one short), restart on the directory and run the same prompts: each
    output must equal a cold run's; damaged entries are detected (checksum, torn) or harmless."""
    from pathlib import Path

    from pagekv.kvnode.engine.llm import LLM
    from pagekv.kvnode.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    work = [[rng.randrange(1, 250) for _ in range(120)] for _ in range(prompts_n)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cold_llm = LLM("pagekv-tiny", num_gpu_blocks=256, max_model_len=400,
                   enable_prefix_caching=False)
    cold = [o.outputs[0].token_ids for o in cold_llm.generate(work, params)]
    kw = {"num_gpu_blocks": 26, "max_model_len": 400, "disk_offload_bytes": 32 << 20,
          "disk_offload_dir": directory}
    first = LLM("pagekv-tiny", **kw)
    for p in work:  # one at a time: the small pool spills each prompt's blocks to the SSD
        first.generate([p], params)
    first.engine.close()
    segments = sorted((p for p in Path(directory).rglob("*") if p.is_file()
                       and p.stat().st_size > 4096), key=lambda p: p.stat().st_size)
    for _ in range(flips):
        seg = rng.choice(segments)
        with open(seg, "r+b") as f:
            off = rng.randrange(seg.stat().st_size)
            f.seek(off)
            byte = f.read(1)
            f.seek(off)
            f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
    if truncate and segments:
        big = segments[-1]
        os.truncate(big, big.stat().st_size * 2 // 3)
    again = LLM("pagekv-tiny", **kw)
    recovered = sum(m == "DISK" for m in again.engine.tiers.full_state().values())
    outs = [again.generate([p], params)[0] for p in work]
    chain = again.engine.stats().chain
    raw = again.engine.tiers.chain.stats()
    again.engine.close()
    return {"prompts": prompts_n, "flips": flips, "truncated": truncate,
            "segments": len(segments), "entries_recovered": recovered,
            "checksum_failures": chain.checksum_failures,
            "torn_entries": int(raw.get("ssd_torn_entries", 0)),
            "from_disk_tokens": sum(o.cached_tokens_by_tier["DISK"] for o in outs),
            "equal_to_cold": all(o.outputs[0].token_ids == c
                                 for o, c in zip(outs, cold, strict=True))}


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def large_prompts(router: Child, n: int = 20, size_mb: float = 1.0) -> dict:
    """`n` text prompts of `size_mb` each (all refused: past max_model_len) through the
    router: its RSS before and after, and how long a small call takes meanwhile."""
    big = pb.GenerateRequest(text="x" * int(size_mb * 2**20),
                             sampling=pb.SamplingParams(max_tokens=1))
    small = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts(1, 1)[0]),
                               sampling=pb.SamplingParams(max_tokens=1))
    before = rss_kb(router.proc.pid)
    got: Counter = Counter()
    small_s: list[float] = []
    with grpc.insecure_channel(router.address, options=[
            ("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.GenerationStub(ch)
        for _ in range(n):
            fut = stub.Generate.future(big, timeout=60)
            t0 = time.monotonic()
            stub.Generate(small, timeout=60)
            small_s.append(time.monotonic() - t0)
            try:
                fut.result()
                got["OK"] += 1
            except grpc.RpcError as e:
                got[e.code().name] += 1
    after = rss_kb(router.proc.pid)
    return {"requests": n, "size_mb": size_mb, "codes": dict(got),
            "rss_before_mb": before / 1024, "rss_after_mb": after / 1024,
            "rss_growth_mb": (after - before) / 1024,
            "small_call_max_ms": 1e3 * max(small_s)}
