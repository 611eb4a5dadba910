"""Prefill/decode disaggregation: 1 prefill + 1 decode pod vs 2 mixed pods behind the router.

Two real pods, each bound to its own core (the pod's process inherits this process's CPU mask,
set to one core around its start: pod A on core 0, pod B on core 1) with one torch thread;
Redis, the router and this client share both cores. Each configuration gets a fresh cluster
(Redis, its two pods, its router), so every run starts with empty caches:

- P/D:   pod A `--role prefill`, pod B `--role decode`; the router splits a request whose
         uncached prompt reaches the split threshold (the router's --pd-threshold-tokens,
         1,024 by default, or the decode pod's measured prefill budget where larger,
         published as load.prefill_budget; routing info pd_threshold_tokens);
- mixed: pods A and B `--role mixed` behind the same prefix router (nothing to split).

The workload is one fixed, seeded, open-loop schedule, the same for every run: chat
conversations (Poisson starts; each turn's prompt is the previous turn's plus an answer and a
new message, so turns share prefixes; ~50-300-token openings, 32-128 tokens out) and long
documents (Poisson, 4-8K-token prompts, 16-64 tokens out), bounded by a duration. Requests go
through the router's GenerateStream (asyncio gRPC). Per request: TTFT = scheduled arrival to
the first chunk carrying a token; ITL = the gaps between its streamed token chunks (the
decode's step time as the client sees it). The configurations run alternately (P/D, mixed,
P/D, mixed, ... `--passes`), then optional extra P/D runs with the threshold forced
(`--variants`: the router's threshold forced, and optionally the pods' pull deadline).
Printed: ITL p50/p90 (chat requests' and all), TTFT p50/p90 by class,
output tokens/s (over first arrival to last completion), the P/D / mixed ratios, what the
routing info says of the splits (how many, prefill_ms, handover_ms, fallbacks, threshold), and
why (ITL of the gaps that overlap a long prompt's prefill on the same pod, or not).

The model is pagekv-small: SmolLM2-135M prefills ~9 ms/token on one thread here (a 2K prompt
~18 s: an 8K one would take minutes), pagekv-small an 8K prompt in ~8 s. Its positions stop
at 4,096; the bench sets PAGEKV_ALLOW_LONG_MAX_MODEL_LEN for 8K prompts (dummy weights).

    python -m bench.pd [--quick] [--duration S] [--passes N] [--variants 0,64,4096:10]
                       [--plot PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.hot_prefix import arrival_times
from bench.machine import machine_info
from bench.stats import pct
from pagekv.deploy.local_cluster import Child, LocalCluster, wait_healthy
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

MODEL = "pagekv-small"
BLOCK = 16
TOKENS = (3, 250)  # pagekv-small's byte vocabulary, no BOS/EOS
CHAT, LONG = "chat", "long"
# What a chat's pod was doing for a long prompt during one of its token gaps.
PREFILLING, HANDOVER, OTHER = "long prefill", "long handover", "neither"
PD, MIXED = "P/D", "mixed"
MAX_PROMPT = 8192
MAX_OUT = 128


# -- the workload (pure, seeded) ---------------------------------------------------------------

@dataclass(frozen=True)
class WorkloadSpec:
    duration_s: float = 90.0
    conversation_rate: float = 0.4   # chat conversations started per second (Poisson)
    turns: int = 3
    think_s: tuple[float, float] = (1.5, 4.0)   # between a conversation's turns
    opening_tokens: tuple[int, int] = (50, 200)
    turn_tokens: tuple[int, int] = (20, 60)     # the answer and next message a turn adds
    chat_out: tuple[int, int] = (32, 128)
    long_rate: float = 0.1           # long documents per second (Poisson)
    long_tokens: tuple[int, int] = (4096, MAX_PROMPT)
    long_out: tuple[int, int] = (16, 64)
    long_offset_s: float = 5.0       # the first document's earliest arrival


@dataclass(frozen=True)
class Req:
    arrival_s: float
    kind: str                # CHAT or LONG
    prompt: tuple[int, ...]
    max_tokens: int
    conversation: int = -1   # chat: which conversation; long: -1
    turn: int = 0


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKENS) for _ in range(n)]


def make_workload(spec: WorkloadSpec, seed: int) -> list[Req]:
    """The schedule, sorted by arrival: the same spec and seed give the same requests."""
    rng = random.Random(seed)
    out: list[Req] = []
    n_conv = max(1, round(spec.duration_s * spec.conversation_rate))
    starts = arrival_times(n_conv, spec.conversation_rate, "poisson", seed)
    for c, t in enumerate(starts):
        prompt = _tokens(rng, rng.randint(*spec.opening_tokens))
        for turn in range(spec.turns):
            if t >= spec.duration_s:
                break
            if turn:
                prompt = prompt + _tokens(rng, rng.randint(*spec.turn_tokens))
            out.append(Req(t, CHAT, tuple(prompt), rng.randint(*spec.chat_out), c, turn))
            t += rng.uniform(*spec.think_s)
    n_long = max(1, round(spec.duration_s * spec.long_rate))
    # The first document a few seconds in: chats are decoding when it comes.
    for t in arrival_times(n_long, spec.long_rate, "poisson", seed + 1):
        t += spec.long_offset_s
        if t < spec.duration_s:
            out.append(Req(t, LONG, tuple(_tokens(rng, rng.randint(*spec.long_tokens))),
                           rng.randint(*spec.long_out)))
    out.sort(key=lambda r: r.arrival_s)
    return out


# -- results and their statistics (pure) -------------------------------------------------------

@dataclass
class Result:
    kind: str
    arrival_s: float
    prompt_tokens: int
    ttft_s: float = float("nan")      # from the scheduled arrival
    done_s: float = float("nan")      # from the run's start
    chunk_s: list[float] = field(default_factory=list)  # each token chunk's time, run clock
    tokens: list[int] = field(default_factory=list)
    served_by: str = ""
    prefill_pod: str = ""
    prefill_ms: float = 0.0
    handover_ms: float = 0.0
    handover_tokens: int = 0
    pd_fallback: str = ""
    pd_threshold: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def split(self) -> bool:
        return bool(self.prefill_pod)


def gaps(times: list[float]) -> list[float]:
    """The gaps between consecutive times (a request's inter-token latencies)."""
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def quantiles_ms(values: list[float], qs=(0.5, 0.9, 0.99)) -> list[float]:
    return [pct(values, q) * 1e3 if values else float("nan") for q in qs]


def busy_windows(results: list[Result]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Per pod, when a long prompt kept it busy (run clock): its prefill (a split request's on
    the prefill pod, arrival to prefill_ms; a whole one's on its pod, arrival to first token,
    queue included) and its handover (a split one's on the decode pod, the prefill's end to
    the first token: the pull and the first step)."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in results:
        if r.kind != LONG or r.error or not math.isfinite(r.ttft_s):
            continue
        first = r.arrival_s + r.ttft_s
        if r.split:
            handed = r.arrival_s + r.prefill_ms / 1e3
            out.setdefault(r.prefill_pod, {}).setdefault(PREFILLING, []).append(
                (r.arrival_s, handed))
            out.setdefault(r.served_by, {}).setdefault(HANDOVER, []).append((handed, first))
        else:
            out.setdefault(r.served_by, {}).setdefault(PREFILLING, []).append(
                (r.arrival_s, first))
    return out


def classify_gaps(r: Result, windows: dict[str, dict[str, list[tuple[float, float]]]]
                  ) -> dict[str, list[float]]:
    """A request's ITL gaps by what its own pod was doing for a long prompt meanwhile: a
    prefill, a handover, or neither (OTHER); a gap overlapping both counts as a prefill's."""
    own = windows.get(r.served_by, {})
    out: dict[str, list[float]] = {PREFILLING: [], HANDOVER: [], OTHER: []}
    for a, b in zip(r.chunk_s, r.chunk_s[1:], strict=False):
        cls = next((c for c in (PREFILLING, HANDOVER)
                    if any(s < b and a < e for s, e in own.get(c, ()))), OTHER)
        out[cls].append(b - a)
    return out


def arrived_during_prefill(r: Result, windows: dict[str, dict[str, list[tuple[float, float]]]]
                           ) -> bool:
    """Whether a request arrived while the pod computing its prompt (its prefill pod when
    split) was prefilling a long prompt (another one, for a long request)."""
    own = windows.get(r.prefill_pod or r.served_by, {}).get(PREFILLING, ())
    mine = (r.arrival_s, r.arrival_s + (r.prefill_ms / 1e3 if r.split else r.ttft_s))
    return any(w != mine and w[0] <= r.arrival_s < w[1] for w in own)


def handovers_by_holder_state(run: list[Result]) -> dict[str, list[Result]]:
    """A run's split requests by whether their prefill pod was prefilling another long prompt
    while their decode pod pulled from it ("busy": the pull's open waits for its step)."""
    windows = busy_windows(run)
    out: dict[str, list[Result]] = {"busy": [], "idle": []}
    for r in run:
        if not r.split or r.error or not math.isfinite(r.ttft_s):
            continue
        a = r.arrival_s + r.prefill_ms / 1e3
        b = r.arrival_s + r.ttft_s
        mine = (r.arrival_s, a)
        busy = any(w != mine and w[0] < b and a < w[1]
                   for w in windows.get(r.prefill_pod, {}).get(PREFILLING, ()))
        out["busy" if busy else "idle"].append(r)
    return out


def summarize(runs: list[list[Result]]) -> dict:
    """The figures of one configuration's runs (each on its own clock); failed requests are
    counted, not timed; throughput per run, averaged."""
    results = [r for run in runs for r in run]
    ok = [r for r in results if not r.error]
    chat = [r for r in ok if r.kind == CHAT]
    long_ = [r for r in ok if r.kind == LONG]
    itl_chat = [g for r in chat for g in gaps(r.chunk_s)]
    itl_all = [g for r in ok for g in gaps(r.chunk_s)]
    by_class: dict[str, list[float]] = {PREFILLING: [], HANDOVER: [], OTHER: []}
    for run in runs:
        windows = busy_windows(run)
        for r in run:
            if r.kind == CHAT and not r.error:
                for cls, gs in classify_gaps(r, windows).items():
                    by_class[cls] += gs
    split = [r for r in ok if r.split]
    holder: dict[str, list[Result]] = {"busy": [], "idle": []}
    ttft_during: list[float] = []
    ttft_other: list[float] = []
    for run in runs:
        windows = busy_windows(run)
        for r in run:
            if r.kind == CHAT and not r.error and math.isfinite(r.ttft_s):
                (ttft_during if arrived_during_prefill(r, windows) else ttft_other).append(
                    r.ttft_s)
        for k, rs in handovers_by_holder_state(run).items():
            holder[k] += rs
    out_tokens = sum(len(r.tokens) for r in ok)
    rates = []
    for run in runs:
        span = (max((r.done_s for r in run if not r.error), default=0.0)
                - min((r.arrival_s for r in run), default=0.0))
        rates.append(sum(len(r.tokens) for r in run if not r.error) / span if span > 0 else 0.0)
    chunks = sum(len(r.chunk_s) for r in ok)
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "chat": len(chat), "long": len(long_),
        "itl_chat_ms": quantiles_ms(itl_chat), "itl_all_ms": quantiles_ms(itl_all),
        "itl_chat_mean_ms": 1e3 * sum(itl_chat) / len(itl_chat) if itl_chat else float("nan"),
        "itl_chat_by_class_ms": {c: quantiles_ms(g) for c, g in by_class.items()},
        "gaps_chat_by_class": {c: len(g) for c, g in by_class.items()},
        "ttft_chat_ms": quantiles_ms([r.ttft_s for r in chat]),
        "ttft_long_ms": quantiles_ms([r.ttft_s for r in long_]),
        "ttft_chat_during_prefill_ms": quantiles_ms(ttft_during),
        "ttft_chat_other_ms": quantiles_ms(ttft_other),
        "chats_during_prefill": len(ttft_during),
        "output_tokens": out_tokens,
        "output_tokens_per_s": sum(rates) / len(rates) if rates else 0.0,
        "tokens_per_chunk": out_tokens / chunks if chunks else float("nan"),
        "split": {CHAT: sum(r.kind == CHAT for r in split),
                  LONG: sum(r.kind == LONG for r in split)},
        "prefill_ms": quantiles_ms([r.prefill_ms / 1e3 for r in split]),
        "handover_ms": quantiles_ms([r.handover_ms / 1e3 for r in split]),
        "handover_tokens_mean": (sum(r.handover_tokens for r in split) / len(split)
                                 if split else 0.0),
        "fallbacks": dict(Counter(r.pd_fallback for r in ok if r.pd_fallback)),
        "handover_by_holder": {k: {"n": len(rs),
                                   "handover_ms": quantiles_ms([r.handover_ms / 1e3 for r in rs]),
                                   "fallbacks": sum(bool(r.pd_fallback) for r in rs)}
                               for k, rs in holder.items()},
        "thresholds": dict(Counter(str(r.pd_threshold) for r in ok if r.pd_threshold)),
        "served_by": dict(Counter(r.served_by for r in ok)),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
    }


# -- the client --------------------------------------------------------------------------------

def request(r: Req) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(r.prompt)),
                              sampling=pb.SamplingParams(max_tokens=r.max_tokens,
                                                         temperature=0.0, ignore_eos=True))


async def one(stub, req: Req, t0: float, res: Result) -> None:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    try:
        async for chunk in stub.GenerateStream(request(req), timeout=600):
            if chunk.token_ids:
                now = time.perf_counter() - t0
                if not res.chunk_s:
                    res.ttft_s = now - req.arrival_s
                res.chunk_s.append(now)
                res.tokens.extend(chunk.token_ids)
            if chunk.served_by:
                res.served_by = chunk.served_by
            if chunk.HasField("usage"):
                res.cached_tokens = chunk.usage.cached_tokens
            if chunk.HasField("routing"):
                ri = chunk.routing
                res.prefill_pod, res.prefill_ms = ri.prefill_pod, ri.prefill_ms
                res.handover_ms, res.handover_tokens = ri.handover_ms, ri.handover_tokens
                res.pd_fallback, res.pd_threshold = ri.pd_fallback, ri.pd_threshold_tokens
        res.done_s = time.perf_counter() - t0
    except grpc.aio.AioRpcError as e:
        res.error = f"{e.code().name}: {e.details()}"


async def open_loop(address: str, reqs: list[Req]) -> list[Result]:
    results = [Result(r.kind, r.arrival_s, len(r.prompt)) for r in reqs]
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        t0 = time.perf_counter() + 0.05
        await asyncio.gather(*(one(stub, q, t0, r) for q, r in zip(reqs, results, strict=True)))
    return results


# -- the clusters ------------------------------------------------------------------------------

def start_pinned(cluster: LocalCluster, name: str, core: int, extra: list[str]) -> Child:
    """A pod whose process (and every thread it starts) runs on `core` only: it inherits the
    mask of the thread that spawns it."""
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        return cluster.start_pod(name, extra)
    finally:
        os.sched_setaffinity(0, mask)


def cpus_allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list"):
                return line.split(":", 1)[1].strip()
    return "?"


def warm_up(pods: list[Child], rng: random.Random) -> None:
    """Each pod's first requests (allocations, kernels) and a decode pod's first measure of its
    prefill budget (decode-only steps and a prefill of >= 256 tokens), untimed."""
    for pod in pods:
        with grpc.insecure_channel(pod.target()) as ch:
            stub = pb_grpc.GenerationStub(ch)
            for n, out in ((64, 8), (600, 24)):
                stub.Generate(pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=_tokens(rng, n)), sampling=pb.SamplingParams(
                        max_tokens=out, temperature=0.0, ignore_eos=True)), timeout=120)


def pd_counters(child: Child) -> dict[str, float]:
    """The router's P/D counters by label (`decision=split`, `reason=deadline`, ...): the
    decisions the routing info does not carry (prefill_busy: no prefill pod free in time)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{child.metrics_port}/metrics",
                                  timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            if smp.name in ("pagekv_router_pd_requests_total",
                            "pagekv_router_pd_fallbacks_total") and smp.value:
                labels = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()))
                key = f"{smp.name.removeprefix('pagekv_router_pd_')}{{{labels}}}"
                out[key] = out.get(key, 0.0) + smp.value
    return out


def code_version() -> str:
    """The commit the pods and router ran, '+edits' when the serving code (router/, kvnode/,
    proto/, deploy/) differs from it in the working tree, which is what the children run."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=root).stdout.strip()
        edited = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "router", "kvnode",
                                 "proto", "deploy"], cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+edits" if edited else "")


@dataclass
class Run:
    config: str
    label: str
    results: list[Result]
    wall_s: float
    pinning: dict[str, str]
    router_pd: dict[str, float] = field(default_factory=dict)
    version: str = ""
    load: float = float("nan")  # the 1-minute load average as the schedule ended


def run_config(config: str, label: str, reqs: list[Req], node: list[str],
               router_extra: list[str], seed: int) -> Run:
    cluster = LocalCluster(nodes=0, model=MODEL, node_args=node, start_router=False,
                           run_dir=Path(tempfile.mkdtemp(prefix="pagekv-pd-")))
    cluster.start()
    try:
        roles = (["--role", "prefill"], ["--role", "decode"]) if config == PD else \
            (["--role", "mixed"], ["--role", "mixed"])
        names = ("prefill-a", "decode-b") if config == PD else ("mixed-a", "mixed-b")
        pods = [start_pinned(cluster, n, core, r)
                for core, (n, r) in enumerate(zip(names, roles, strict=True))]
        for pod in pods:
            wait_healthy(pod.target(), 180, pod.proc)
        pinning = {p.name: cpus_allowed(p.proc.pid) for p in pods}
        warm_up(pods, random.Random(seed + 99))
        router = cluster.start_router_process("router", router_extra)
        wait_healthy(router.target(), 60, router.proc)
        time.sleep(3.5)  # the router sees both pods and the decode pod's published budget
        version = code_version()
        t = time.perf_counter()
        results = asyncio.run(open_loop(router.target(), reqs))
        wall = time.perf_counter() - t
        return Run(config, label, results, wall, pinning, pd_counters(router), version,
                   os.getloadavg()[0])
    finally:
        cluster.stop()


# -- the report --------------------------------------------------------------------------------

def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and math.isfinite(a) and math.isfinite(b) else "n/a"


def f0(x: float) -> str:
    return f"{x:.0f}" if math.isfinite(x) else "-"


def f1(x: float) -> str:
    return f"{x:.1f}" if math.isfinite(x) else "-"


def print_tables(summary: dict[str, dict], base: str) -> None:
    print("\n| configuration | chat ITL p50 ms | chat ITL p90 ms | chat ITL p99 ms | all ITL p50 "
          "ms | all ITL p90 ms | chat TTFT p50 ms | chat TTFT p90 ms | long TTFT p50 ms | "
          "long TTFT p90 ms | output tok/s | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {f1(s['itl_chat_ms'][0])} | {f1(s['itl_chat_ms'][1])} | "
              f"{f0(s['itl_chat_ms'][2])} | {f1(s['itl_all_ms'][0])} | {f1(s['itl_all_ms'][1])} "
              f"| {f0(s['ttft_chat_ms'][0])} | {f0(s['ttft_chat_ms'][1])} | "
              f"{f0(s['ttft_long_ms'][0])} | {f0(s['ttft_long_ms'][1])} | "
              f"{s['output_tokens_per_s']:.1f} | {s['failed']}/{s['requests']} |")
    b = summary[base]
    print(f"\nratios vs {base} (ITL and TTFT: {base} / this, > 1 is better; tok/s: this / "
          f"{base}):\n")
    print("| configuration | chat ITL p50 | chat ITL p90 | all ITL p90 | chat TTFT p50 | "
          "chat TTFT p90 | long TTFT p50 | long TTFT p90 | output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        if name == base:
            continue
        print(f"| {name} | {ratio(b['itl_chat_ms'][0], s['itl_chat_ms'][0])} | "
              f"{ratio(b['itl_chat_ms'][1], s['itl_chat_ms'][1])} | "
              f"{ratio(b['itl_all_ms'][1], s['itl_all_ms'][1])} | "
              f"{ratio(b['ttft_chat_ms'][0], s['ttft_chat_ms'][0])} | "
              f"{ratio(b['ttft_chat_ms'][1], s['ttft_chat_ms'][1])} | "
              f"{ratio(b['ttft_long_ms'][0], s['ttft_long_ms'][0])} | "
              f"{ratio(b['ttft_long_ms'][1], s['ttft_long_ms'][1])} | "
              f"{ratio(s['output_tokens_per_s'], b['output_tokens_per_s'])} |")
    print("\n| configuration | split chat / long | split threshold (requests) | prefill_ms "
          "p50 / p90 | handover_ms p50 / p90 | handover tokens (mean) | fallbacks | served by |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        th = ", ".join(f"{k} ({v})" for k, v in sorted(s["thresholds"].items())) or "-"
        fb = ", ".join(f"{k} {v}" for k, v in sorted(s["fallbacks"].items())) or "0"
        served = ", ".join(f"{k} {v}" for k, v in sorted(s["served_by"].items()))
        print(f"| {name} | {s['split'][CHAT]} / {s['split'][LONG]} | {th} | "
              f"{f0(s['prefill_ms'][0])} / {f0(s['prefill_ms'][1])} | "
              f"{f1(s['handover_ms'][0])} / {f1(s['handover_ms'][1])} | "
              f"{s['handover_tokens_mean']:.0f} | {fb} | {served} |")
    print("\nhandovers by the prefill pod's state during the pull (busy: prefilling another long "
          "prompt, its step in the way of the pull's open on its engine thread):\n")
    print("| configuration | handovers, holder idle | handover_ms p50 / p90 | fallbacks | "
          "handovers, holder busy | handover_ms p50 / p90 | fallbacks |")
    print("|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        if not s["split"][CHAT] + s["split"][LONG]:
            continue
        cells = []
        for k in ("idle", "busy"):
            h = s["handover_by_holder"][k]
            cells.append(f"{h['n']} | {f1(h['handover_ms'][0])} / {f1(h['handover_ms'][1])} | "
                         f"{h['fallbacks']}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nwhy (TTFT): chat TTFT by whether the pod computing its prompt (the prefill pod "
          "when split) was prefilling a long prompt when it arrived (its scheduler gives a "
          "running prefill the step's prompt budget first):\n")
    print("| configuration | chats arriving during a long prefill | TTFT p50 / p90 ms | other "
          "chats | TTFT p50 / p90 ms |")
    print("|---|---|---|---|---|")
    for name, s in summary.items():
        d, o = s["ttft_chat_during_prefill_ms"], s["ttft_chat_other_ms"]
        print(f"| {name} | {s['chats_during_prefill']} | {f0(d[0])} / {f0(d[1])} | "
              f"{s['chat'] - s['chats_during_prefill']} | {f0(o[0])} / {f0(o[1])} |")
    print("\nwhy: chat ITL by what the chat's own pod was doing for a long prompt during the "
          "gap (its prefill, queue included; its handover: the pull and first step):\n")
    print("| configuration | " + " | ".join(f"gaps: {c} | ITL p50 / p90 / p99 ms: {c}"
                                            for c in (PREFILLING, HANDOVER, OTHER))
          + " | chat ITL mean ms | tokens per chunk |")
    print("|---|" + "---|---|" * 3 + "---|---|")
    for name, s in summary.items():
        cells = []
        for c in (PREFILLING, HANDOVER, OTHER):
            q = s["itl_chat_by_class_ms"][c]
            cells.append(f"{s['gaps_chat_by_class'][c]} | {f1(q[0])} / {f1(q[1])} / {f0(q[2])}")
        print(f"| {name} | " + " | ".join(cells) + f" | {f1(s['itl_chat_mean_ms'])} | "
              f"{s['tokens_per_chunk']:.2f} |")


def plot(runs_by: dict[str, list[Run]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, kind in zip(axes, (CHAT, None), strict=True):
        for name, runs in runs_by.items():
            xs = sorted(g * 1e3 for run in runs for r in run.results
                        if not r.error and (kind is None or r.kind == kind)
                        for g in gaps(r.chunk_s))
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xscale("log")
        ax.set_xlabel("inter-token latency, ms (log)")
        ax.set_ylabel("fraction of gaps")
        ax.axhline(0.9, color="grey", lw=0.6, ls=":")
        ax.set_title("chat requests" if kind else "all requests")
        ax.grid(True, which="both", lw=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(runs: list[Run], plot_path: str, title: str) -> dict[str, dict]:
    """The tables, the goal's line and the plot of these runs; their summaries by label."""
    by_label: dict[str, list[Run]] = {}
    for run in runs:
        by_label.setdefault(run.label, []).append(run)
    summary = {label: summarize([run.results for run in rs]) for label, rs in by_label.items()}
    print_tables(summary, MIXED)
    pd_s, mx = summary[PD], summary[MIXED]
    itl_gain = mx["itl_chat_ms"][1] / pd_s["itl_chat_ms"][1]
    tput = pd_s["output_tokens_per_s"] / mx["output_tokens_per_s"]
    met = itl_gain >= 2.0 and tput >= 0.9
    print(f"\nGoal (issue #29): decode (chat) ITL p90 >= 2x better than mixed at >= 0.9x its "
          f"output tokens/s: {itl_gain:.2f}x at {tput:.2f}x — {'met' if met else 'not met'}")
    same = sum(a.tokens == b.tokens for ra, rb in zip(by_label[PD], by_label[MIXED], strict=False)
               for a, b in zip(ra.results, rb.results, strict=True) if not a.error and not b.error)
    print(f"greedy outputs identical between P/D and mixed (paired runs): {same} of "
          f"{sum(len(r.results) for r in by_label[MIXED][:len(by_label[PD])])}")
    if plot_path:
        plot(by_label, plot_path, title)
        print(f"ITL CDFs: {plot_path}")
    return summary


def runs_from_json(path: str) -> tuple[list[Run], str]:
    """A saved run (--json) back as runs, and its title line."""
    with open(path) as f:
        saved = json.load(f)
    runs = [Run(r["config"], r["label"], [Result(**x) for x in r["results"]], r["wall_s"],
                r["pinning"], r.get("router_pd", {}), r.get("version", ""), r.get("load", float("nan")))
            for r in saved["runs"]]
    return runs, saved.get("title", f"bench.pd, {len(runs)} runs") + f" — {saved['machine']}"


def parse_variant(text: str) -> tuple[int, float]:
    """'T' or 'T:S' -> (threshold tokens, pull deadline s; 0: the pods' own)."""
    t, _, deadline = text.partition(":")
    return int(t), float(deadline) if deadline else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="30 s of workload, one pass")
    ap.add_argument("--duration", type=float, default=None, help="schedule seconds; default "
                    "30 quick, 90 full")
    ap.add_argument("--passes", type=int, default=None, help="runs of each configuration, "
                    "alternating; default 1 quick, 2 full")
    ap.add_argument("--conversation-rate", type=float, default=WorkloadSpec.conversation_rate)
    ap.add_argument("--long-rate", type=float, default=WorkloadSpec.long_rate)
    ap.add_argument("--variants", default=None, help="extra P/D runs (one pass each), "
                    "comma-separated: T (the router's --pd-threshold-tokens T) or T:S (also the "
                    "pods' --kv-pull-deadline-s S); default none quick, '64,1024' full "
                    "(the measured threshold is ~16-40 here, chats' prompts are 50-320 tokens)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="every pod's (default: the pods' own, 2048)")
    ap.add_argument("--pull-deadline-s", type=float, default=None,
                    help="every pod's --kv-pull-deadline-s (default: the pods' own, 2 s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="PNG of the ITL CDFs; default docs/pd_itl.png "
                    "full, none quick ('' for none)")
    ap.add_argument("--json")
    ap.add_argument("--report", metavar="JSON", help="print the tables (and --plot) of a run "
                    "saved with --json, running nothing")
    args = ap.parse_args(argv)
    if args.report:
        saved, saved_title = runs_from_json(args.report)
        print(f"# {saved_title}")
        report(saved, args.plot or "", saved_title)
        return 0
    if len(os.sched_getaffinity(0)) < 2:
        ap.error("needs two cores (one per pod)")
    # A kill stops the run's cluster too (its `finally`), not just this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    duration = args.duration or (30.0 if args.quick else 90.0)
    passes = args.passes or (1 if args.quick else 2)
    variants = [parse_variant(v) for v in (args.variants if args.variants is not None else
                                           ("" if args.quick else "0,64")).split(",")
                if v]
    plot_path = args.plot if args.plot is not None else ("" if args.quick else "docs/pd_itl.png")
    spec = WorkloadSpec(duration_s=duration, conversation_rate=args.conversation_rate,
                        long_rate=args.long_rate)
    reqs = make_workload(spec, args.seed)
    os.environ["PAGEKV_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # pagekv-small's positions stop at 4K
    max_len = MAX_PROMPT + spec.long_out[1] + BLOCK
    # Room for three 8K documents and the chats at once on either pod.
    node = ["--num-threads", "1", "--num-gpu-blocks", str(3 * max_len // BLOCK + 512),
            "--max-model-len", str(max_len)]
    if args.max_num_batched_tokens:
        node += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.pull_deadline_s:
        node += ["--kv-pull-deadline-s", str(args.pull_deadline_s)]
    kinds = Counter(r.kind for r in reqs)
    load = os.getloadavg()
    title = (f"P/D (1 prefill + 1 decode) vs 2 mixed pods ({MODEL}, one core and one torch "
             f"thread per pod, {duration:.0f} s open-loop schedule: {kinds[CHAT]} chat turns "
             f"+ {kinds[LONG]} long documents, {passes} pass(es))")
    print(f"# {title} — {machine_info()}; load average at start {load[0]:.2f} / {load[1]:.2f}",
          flush=True)
    print(f"workload: {spec}; prompt tokens chat {sum(len(r.prompt) for r in reqs if r.kind == CHAT)}"
          f", long {sum(len(r.prompt) for r in reqs if r.kind == LONG)}; node flags {node}",
          flush=True)
    plan: list[tuple[str, str, list[str], list[str]]] = [
        (c, c, [], node) for _ in range(passes) for c in (PD, MIXED)]
    for t, deadline in variants:
        label = (f"P/D, threshold {t}" if t else "P/D, threshold = measured budget") + (
            f", pull deadline {deadline:g} s" if deadline else "")
        plan.append((PD, label, ["--pd-threshold-tokens", str(t)],
                     node + (["--kv-pull-deadline-s", str(deadline)] if deadline else [])))
    runs: list[Run] = []
    for i, (config, label, extra, pod_flags) in enumerate(plan):
        run = run_config(config, label, reqs, pod_flags, extra, args.seed + i)
        runs.append(run)
        s = summarize([run.results])
        print(f"run {i + 1}/{len(plan)} {label} (pods on cores {run.pinning}, load "
              f"{os.getloadavg()[0]:.2f}): chat ITL p50/p90 {f1(s['itl_chat_ms'][0])}/"
              f"{f1(s['itl_chat_ms'][1])} ms, chat TTFT p50/p90 {f0(s['ttft_chat_ms'][0])}/"
              f"{f0(s['ttft_chat_ms'][1])} ms, long TTFT p50 {f0(s['ttft_long_ms'][0])} ms, "
              f"{s['output_tokens_per_s']:.1f} tok/s, split {s['split']}, thresholds "
              f"{s['thresholds']}, fallbacks {s['fallbacks']}, {s['failed']} failed; router "
              f"P/D counters {run.router_pd}; code {run.version}", flush=True)
        for err, k in Counter(r.error for r in run.results if r.error).items():
            print(f"  {k} failed: {err[:300]}", flush=True)
    summary = report(runs, plot_path, title)
    print(f"load average at the end {os.getloadavg()[0]:.2f} / {os.getloadavg()[1]:.2f} (this "
          f"run's own two pods, router and client make ~2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "pd", "model": MODEL, "machine": machine_info(),
                       "title": title,
                       "args": vars(args), "spec": asdict(spec), "node_flags": node,
                       "summary": summary,
                       "runs": [{"config": r.config, "label": r.label, "wall_s": r.wall_s,
                                 "pinning": r.pinning, "router_pd": r.router_pd,
                                 "version": r.version, "load": r.load,
                                 "results": [asdict(x) for x in r.results]} for r in runs]},
                      f)
    return 1 if any(s["failed"] for s in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
