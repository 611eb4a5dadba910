"""The cluster at scale, simulated: 16, 64, 256 pods behind the real router and the real index.

A multi-tenant shared-prefix trace (bench/scale_trace.py) is replayed, in simulated time,
against N simulated pods (bench/scale_pod.py): each is the pod's own memory manager, DRAM
tier, scheduler and index publisher, with the forward pass replaced by a step-time model
calibrated on the real pod. Policies, side by side on the same trace and the same pods:

* prefix:       the real `Router` (router/routing.py), `--policy prefix`: per request
                `prepare` (hash chain) and `decide` (one EVALSHA lookup on the real Redis,
                the real scoring); `dispatched` and the in-flight counts as the router's
                server keeps them; its `PodRegistry` refreshes from Redis every 0.5 s;
* round_robin:  the same router with `--policy round_robin` (pods register and renew their
                leases, but publish no claims: round-robin never reads them);
* oracle:       no index: every pod's exact pool, DRAM and queue, and the pod with the
                least estimated time to first token (the step model applied to what is
                queued there and the request's own uncached tokens). It is greedy per
                request, not an optimum: it can trade hits for load.

Simulated time: a heap of events (arrivals, step ends, 50 ms publish ticks, 0.5 s registry
refreshes). The pods' KV events reach Redis at the next 50 ms tick (the publisher's own
flush interval) through their real publishers (one thread each, as in a pod: `submit`, then
`flush` waits until the batch is visible); the router reads Redis as it is at that moment.
The router's clocks (burst predictions' TTL, the half-life of its recent-routing counts,
its refresh and cool-down timers) run on simulated time. Wall-clock measurements: the
lookup (the router's own `lookup_ms`), the publishers' writes, `decide`'s CPU time.

Reported per pod count: hit rate (pool and DRAM) and TTFT against round-robin and the
oracle, the per-pod load spread, index memory per cached block, lookup p50/p99, publish lag,
router decisions/s per core; plots in docs/.

    python -m bench.scale [--quick] [--pods 16,64,256] [--json PATH] [--redis single|cluster]
                          [--cost smollm2-135m-instruct | --calibrate MODEL]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from bench.scale_pod import PRESETS, Oracle, PodConfig, SimPod, StepCost, calibrate  # noqa: E402
from bench.scale_publishers import (  # noqa: E402
    PodSpec,
    PodUpdate,
    ThreadPublishers,
    WorkerPublishers,
)
from bench.scale_sweep import print_sweep  # noqa: E402
from bench.scale_trace import (  # noqa: E402
    ScaleRequest,
    TraceConfig,
    hot_pods,
    num_tenants,
    trace_for_load,
)
from bench.scale_warm import print_warm, warm_figures  # noqa: E402
from bench.stats import pct  # noqa: E402
from pagekv.deploy.redis_server import RedisProcess  # noqa: E402
from pagekv.proto.hashing import HashConfig, RequestBlockHasher  # noqa: E402
from pagekv.proto.index import IndexSchema, connect_async, scripts  # noqa: E402
from pagekv.proto.medium import PEER_SHARE, Medium  # noqa: E402
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb  # noqa: E402
from pagekv.router.burst import BurstTracker  # noqa: E402
from pagekv.router.config import POLICIES as ROUTER_POLICIES  # noqa: E402
from pagekv.router.config import RouterConfig  # noqa: E402
from pagekv.router.metrics import RouterMetrics  # noqa: E402
from pagekv.router.placement import load_spread  # noqa: E402
from pagekv.router.routing import Router  # noqa: E402
from pagekv.router.tokenize import ByteEncoder  # noqa: E402

logger = logging.getLogger(__name__)

POLICIES = (*ROUTER_POLICIES, "oracle")  # every router policy, and the oracle
DEFAULT_POLICIES = ("prefix", "round_robin", "oracle")
NO_CLAIMS = frozenset({"round_robin", "random"})  # never read claims: their pods publish none
PUBLISH_TICK_S = 0.05  # IndexPublisher's default flush interval
REPLAY_LOOKUPS = 500  # the last lookups of a prefix run, replayed alone at its end
GOALS = "prefix >= 90% of the oracle's hit rate at every size; lookup p99 <= 2 ms at 256 " \
        "pods; index memory per block flat in the pod count"


# -- the index -------------------------------------------------------------------------------

@dataclass
class Index:
    kind: str
    url: str
    clients: list[redis.Redis]  # one per primary (memory is summed over them)
    closer: object

    def used_memory(self) -> int:
        return sum(int(c.info("memory")["used_memory"]) for c in self.clients)

    def flush(self) -> None:
        for c in self.clients:
            c.flushall()

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.closer.close()


def start_index(kind: str, run_dir: Path) -> Index:
    if kind == "single":
        rp = RedisProcess(data_dir=run_dir / "redis").start()
        return Index(kind, rp.url, [redis.Redis.from_url(rp.url)], rp)
    # Three primaries, no replicas (they would only add load on the box), on loopback; the
    # pods and the router reach it through its redis+cluster:// URL.
    from pagekv.deploy.redis_cluster import LocalRedisCluster

    cluster = LocalRedisCluster(primaries=3, replicas=0,
                                data_dir=run_dir / "redis-cluster").start()
    return Index(kind, cluster.url, [cluster.client(n) for n in cluster.primaries()], cluster)


# -- the router's clock ----------------------------------------------------------------------

class SimClock:
    """Simulated seconds for the router's timers; wall time where it measures or stamps."""

    OFFSET = 10_000.0  # above every default timestamp (0.0) the router compares against

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.OFFSET + self.now

    perf_counter = staticmethod(time.perf_counter)  # the lookup's own timing: real
    thread_time = staticmethod(time.thread_time)
    time = staticmethod(time.time)  # compared with the pods' wall-clock `updated` stamps


class router_on:
    """`with router_on(clock):` the router modules read `clock` for `time`."""

    MODULES = ("pagekv.router.pods", "pagekv.router.routing")

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self.saved: dict[str, object] = {}

    def __enter__(self) -> SimClock:
        for name in self.MODULES:
            mod = sys.modules[name]
            self.saved[name] = mod.time
            mod.time = self.clock  # type: ignore[attr-defined]
        return self.clock

    def __exit__(self, *exc: object) -> None:
        for name, saved in self.saved.items():
            sys.modules[name].time = saved  # type: ignore[attr-defined]


# -- one simulated run -----------------------------------------------------------------------

@dataclass
class Record:
    arrival: float
    pod: int
    prompt: int
    cached_gpu: int
    cached_cpu: int
    cached_peer: int
    bound: int
    ttft: float
    done: float


@dataclass
class RunOut:
    policy: str
    records: list[Record] = field(default_factory=list)
    pods: list[SimPod] = field(default_factory=list)
    sim_end: float = 0.0
    wall_s: float = 0.0
    lookup_ms: list[float] = field(default_factory=list)
    decide_cpu_s: list[float] = field(default_factory=list)
    prepare_cpu_s: list[float] = field(default_factory=list)
    decide_wall_ms: list[float] = field(default_factory=list)
    reasons: Counter = field(default_factory=Counter)
    write_lag_s: list[float] = field(default_factory=list)
    visible_lag_s: list[float] = field(default_factory=list)
    publisher: dict = field(default_factory=dict)
    index: dict = field(default_factory=dict)
    replay: dict = field(default_factory=dict)
    fallbacks: float = 0.0
    queued_at_end: int = 0
    late_writes: int = 0       # pods' batches not visible within the tick's timeout
    tick_wall_s: list[float] = field(default_factory=list)  # each tick with writes
    restarts: list[tuple[float, float, int]] = field(default_factory=list)  # (sim t, wall s
    # to build and first read, pods it saw)
    empty_decisions: int = 0   # decisions with no pod (refreshed and decided again)


@dataclass(frozen=True, slots=True)
class SimOptions:
    publishers: str = "process"     # "process": worker processes; "thread": in this one
    workers: int = 0                # worker processes (0: default_workers)
    shared_bursts: bool = False     # the router's --shared-bursts
    restart_at: float | None = None  # simulated s: a fresh router replaces the running one


def default_workers(n_pods: int) -> int:
    """One worker process per 128 pods, 1 to 4 (a 2-core box: more only contend)."""
    return max(1, min(4, round(n_pods / 128)))


class Sim:
    ARRIVE, STEP, WAKE, PUBLISH, REFRESH, RESTART = range(6)

    def __init__(self, policy: str, n_pods: int, trace: list[ScaleRequest], cost: StepCost,
                 pcfg: PodConfig, index: Index, model: str, kv_pull: bool,
                 opts: SimOptions | None = None) -> None:
        self.policy = policy
        self.opts = opts or SimOptions()
        self.trace = trace
        self.cost = cost
        self.pcfg = pcfg
        self.index = index
        self.model = model
        self.kv_pull = kv_pull
        self.pods = [SimPod(i, f"pod-{i:03d}", pcfg, cost) for i in range(n_pods)]
        self.by_id = {p.pod_id: p for p in self.pods}
        self.heap: list = []
        self.seq = itertools.count()
        self.clock = SimClock()
        self.out = RunOut(policy, pods=self.pods)
        self.router: Router | None = None
        self.publishers: WorkerPublishers | ThreadPublishers | None = None
        self.claims = policy not in NO_CLAIMS  # its pods publish their KV events
        self.oracle = Oracle()
        self.hash_config = HashConfig(pcfg.hash_algo, pcfg.hash_seed)
        self.schema = IndexSchema(model, pcfg.block_size, pcfg.hash_algo, pcfg.hash_seed)
        self.pending = len(trace)
        self.recent_lookups: deque = deque(maxlen=REPLAY_LOOKUPS)  # Prepared requests
        # pod -> ((requests, steps), load, costs) when its load and costs were last read
        self._sent: dict[int, tuple[tuple[int, int], dict, dict]] = {}

    def push(self, t: float, kind: int, obj: object = None) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, obj))

    # -- set-up and tear-down --------------------------------------------------------------
    async def start(self) -> None:
        if self.policy == "oracle":
            return
        self.index.flush()
        mem0 = self.index.used_memory()
        if self.opts.publishers == "thread":
            self.publishers = ThreadPublishers(self.index.url, self.schema, self.pods)
        else:
            workers = self.opts.workers or default_workers(len(self.pods))
            self.publishers = WorkerPublishers(
                self.index.url, self.schema, [PodSpec(p.pod_id, p.address) for p in self.pods],
                workers)
        self.out.index["publishers_start_s"] = self.publishers.start()
        self.out.index["publishers_where"] = self.publishers.where
        self.publishers.tick(self._updates())  # every pod's load, before the first renewal
        self.out.index["used_memory_empty"] = mem0
        if self.claims:  # what N idle publishers cost (lease renewals), wherever they run
            c0, k0, w0 = time.process_time(), self.publishers.cpu_s(), time.perf_counter()
            await asyncio.sleep(2.0)
            wall = time.perf_counter() - w0
            self.out.index["idle_publishers_cpu"] = (time.process_time() - c0) / wall
            self.out.index["idle_publishers_cpu_workers"] = (
                self.publishers.cpu_s() - k0) / wall
        self.router = await self._new_router()
        deadline = time.monotonic() + 30
        while len(self.router.registry.eligible()) < len(self.pods):
            await self.router.registry.refresh()
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(self.router.registry.eligible())} of "
                                   f"{len(self.pods)} pods live in the index")
            await asyncio.sleep(0.05)

    async def _new_router(self) -> Router:
        """A router as its server builds one: config, Redis client, scripts, then (as the
        registry's task does first, and before health says SERVING) one read of the pods."""
        cfg = RouterConfig(redis_url=self.index.url, model=self.model,
                           block_size=self.pcfg.block_size, hash_algo=self.pcfg.hash_algo,
                           hash_seed=self.pcfg.hash_seed, policy=self.policy,
                           kv_pull=self.kv_pull, random_seed=7,
                           # One router by default: its own predictions are all there are,
                           # and they run on simulated time; the index's TTLs (shared
                           # predictions') run on the wall clock.
                           shared_bursts=self.opts.shared_bursts)
        client = connect_async(cfg.redis_url, cfg.redis_timeout_s)
        router = Router(cfg, client, ByteEncoder(), RouterMetrics())
        router.burst = BurstTracker(cfg.burst_ttl_s, clock=self.clock.monotonic)
        await router.index.register_scripts()
        await router.registry.refresh()
        return router

    async def _close_router(self, router: Router) -> None:
        self.out.fallbacks += sum(s.value for m in router.metrics.fallbacks.collect()
                                  for s in m.samples if s.name.endswith("_total"))
        await router.close()
        await router.registry.close()
        await router.index.aclose()

    async def stop(self) -> None:
        if self.router is not None:
            await self._close_router(self.router)
        if self.publishers is not None:
            self.publishers.stop()

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> RunOut:
        for r in self.trace:
            self.push(r.arrival, self.ARRIVE, r)
        if self.router is not None:
            self.push(PUBLISH_TICK_S, self.PUBLISH)
            self.push(self.router.config.refresh_interval_s, self.REFRESH)
            if self.opts.restart_at is not None:
                self.push(self.opts.restart_at, self.RESTART)
        t0 = time.perf_counter()
        while self.heap:
            t, _, kind, obj = heapq.heappop(self.heap)
            self.clock.now = t
            if kind == self.ARRIVE:
                await self._arrive(t, obj)
            elif kind == self.STEP:
                self._step_end(t, obj)
            elif kind == self.WAKE:
                if obj.stepping_until is None:
                    self._kick(t, obj)
            elif kind == self.RESTART:
                await self._restart(t)
            elif kind in (self.PUBLISH, self.REFRESH):
                if self.pending or any(p.busy for p in self.pods):
                    if kind == self.PUBLISH:
                        self._publish(t)
                        self.push(t + PUBLISH_TICK_S, kind)
                    else:
                        await self.router.registry.refresh()
                        self.push(t + self.router.config.refresh_interval_s, kind)
        if self.router is not None:
            self._publish(self.clock.now)
        self.out.wall_s = time.perf_counter() - t0
        self.out.sim_end = self.clock.now
        if self.claims and self.router is not None:
            self._index_figures()
            await self.router.registry.refresh()
            await self._replay_lookups()
        return self.out

    async def _restart(self, t: float) -> None:
        """The router goes away mid-run and a new one (nothing remembered: no burst
        predictions, no recent or in-flight counts) starts into the live fleet. The calls
        the old one sent keep running on their pods."""
        assert self.router is not None
        old, self.router = self.router, None
        await self._close_router(old)
        w0 = time.perf_counter()
        self.router = await self._new_router()
        self.out.restarts.append((t, time.perf_counter() - w0,
                                  len(self.router.registry.eligible())))

    async def _replay_lookups(self) -> None:
        """The run's last requests' decisions again, back to back on the final index (the
        pods idle), with Redis's slow log recording every command: the server's own time per
        lookup (what Redis spends, whatever the box's other load does to the round trip),
        and the router's lookup time again."""
        if not self.recent_lookups:
            return
        clients = self.index.clients
        for c in clients:
            c.config_set("slowlog-max-len", 8 * REPLAY_LOOKUPS)
            c.config_set("slowlog-log-slower-than", 0)
            c.slowlog_reset()
        wall = []
        try:
            for prepared in self.recent_lookups:  # decide's own lookup, as in the run
                wall.append((await self.router.decide(prepared)).lookup_ms)
            sha = scripts.LOOKUP.sha.encode()
            server = [e["duration"] / 1e3 for c in clients
                      for e in c.slowlog_get(8 * REPLAY_LOOKUPS)
                      if e["command"].startswith(b"EVALSHA " + sha)]
        finally:
            for c in clients:
                c.config_set("slowlog-log-slower-than", 10000)
                c.slowlog_reset()
        self.out.replay = {"n": len(wall), "wall_p50_ms": pct(wall, 0.5),
                           "wall_p99_ms": pct(wall, 0.99),
                           "server_p50_ms": pct(server, 0.5) if server else float("nan"),
                           "server_p99_ms": pct(server, 0.99) if server else float("nan"),
                           "server_n": len(server)}

    def _kick(self, t: float, pod: SimPod) -> None:
        end = pod.start_step(t)
        if end is not None:
            self.push(end, self.STEP, pod)
        elif pod.wake_at is not None:
            self.push(pod.wake_at, self.WAKE, pod)

    async def _arrive(self, t: float, r: ScaleRequest) -> None:
        self.pending -= 1
        if not self.pending:  # the last arrival: what is still queued (before this one)
            self.out.queued_at_end = sum(len(p.scheduler.waiting) for p in self.pods)
        prompt = r.prompt()
        if self.router is None:
            hashes: list[bytes] = []
            RequestBlockHasher(self.hash_config, self.pcfg.block_size).extend(prompt, hashes)
            pod, uncached = self.oracle.pick(self.pods, hashes, len(prompt),
                                             self.pcfg.max_num_batched_tokens)
            sim = pod.add(r.rid, prompt, r.output, t, hashes)
            sim.est_uncached = uncached
            sim.tag = r
        else:
            router = self.router
            request = pb.GenerateRequest(request_id=r.rid, token_ids=pb.TokenIds(ids=prompt),
                                         sampling=pb.SamplingParams(max_tokens=len(r.output)))
            c0 = time.thread_time()
            prepared = router.prepare(request)
            c1 = time.thread_time()
            w1 = time.perf_counter()
            decision = await router.decide(prepared)
            w2 = time.perf_counter()
            c2 = time.thread_time()
            if not decision.order:  # RouterService: maybe pods joined; look once
                await router.registry.refresh()
                decision = await router.decide(prepared)
                self.out.empty_decisions += 1
            out = self.out
            out.prepare_cpu_s.append(c1 - c0)
            out.decide_cpu_s.append(c2 - c1)
            out.decide_wall_ms.append((w2 - w1) * 1e3)
            if self.claims and prepared.lookup_blocks:
                out.lookup_ms.append(decision.lookup_ms)
                self.recent_lookups.append(prepared)
            out.reasons[decision.reason] += 1
            score = decision.order[0]
            entry = router.registry.pods[score.pod_id]
            router.dispatched(score.pod_id, prepared)
            entry.inflight += 1  # as the router's server counts a call in flight
            pod = self.by_id[score.pod_id]
            sim = pod.add(r.rid, prompt, r.output, t, list(prepared.block_hashes))
            sim.est_uncached = len(prompt) - score.cached_tokens
            if score.pull_from and score.pull_from != score.pod_id:  # RouterService._aim
                sim.pull_source = (self.by_id[score.pull_from], score.pull_blocks)
            sim.tag = (r, entry)
        if pod.stepping_until is None:
            self._kick(t, pod)

    def _step_end(self, t: float, pod: SimPod) -> None:
        for sim in pod.end_step(t):
            if self.router is not None:
                r, entry = sim.tag
                entry.inflight -= 1
                entry.call_finished()
            else:
                r = sim.tag
            by_tier = sim.seq.group.cached_tokens_by_tier
            self.out.records.append(Record(
                r.arrival, pod.index, sim.prompt_len, by_tier.get(Medium.GPU, 0),
                by_tier.get(Medium.CPU, 0), by_tier.get(PEER_SHARE, 0),
                r.bound_blocks * self.pcfg.block_size, sim.first_token - r.arrival,
                sim.finished - r.arrival))
        if pod.busy:
            self._kick(t, pod)

    def _updates(self) -> dict[str, PodUpdate]:
        """Each pod's KV events since the last tick (where its policy reads claims) and its
        load and measured costs where they changed since the last one sent."""
        updates: dict[str, PodUpdate] = {}
        for pod in self.pods:
            u = PodUpdate()
            if pod.events:
                events = pod.take_events()
                if self.claims:
                    u.events = events
            # Load and costs change only with a request added or a step: read them then.
            mark = (pod.stats.requests, pod.stats.steps)
            sent = self._sent.get(pod.index)
            if sent is None or sent[0] != mark:
                load, costs = pod.load(), pod.tier_costs()
                if sent is None or sent[1] != load:
                    u.load = load
                if sent is None or sent[2] != costs:
                    u.costs = costs
                self._sent[pod.index] = (mark, load, costs)
            if u.events or u.load is not None or u.costs is not None:
                updates[pod.pod_id] = u
        return updates

    def _publish(self, t: float) -> None:
        """The 50 ms tick: each pod's events since the last one go to its publisher; the
        tick returns once every batch is visible (simulated time waits for it)."""
        since = {p.pod_id: p.events_since for p in self.pods if p.events}
        updates = self._updates()
        w0 = time.perf_counter()
        lags, late = self.publishers.tick(updates)
        tick = time.perf_counter() - w0
        out = self.out
        out.write_lag_s += lags
        out.late_writes += len(late)
        if lags:
            out.tick_wall_s.append(tick)
        for pod_id, u in updates.items():
            if u.events:
                out.visible_lag_s.append(t - since[pod_id] + tick)

    def _index_figures(self) -> None:
        states = [p.full_state() for p in self.pods]
        claims = sum(len(s) for s in states)
        distinct = len(set().union(*states))
        used = self.index.used_memory() - self.out.index["used_memory_empty"]
        stats = self.publishers.stats()
        self.out.index.update({
            "claims": claims, "distinct_blocks": distinct, "used_memory_delta": used,
            "bytes_per_claim": used / claims if claims else float("nan"),
            "bytes_per_block": used / distinct if distinct else float("nan"),
            "published_claims": sum(s["claims"] for s in stats),
        })
        self.out.publisher = {
            "batches": sum(s["batches"] for s in stats),
            "events": sum(s["events_published"] for s in stats),
            "dropped": sum(s["events_dropped"] for s in stats),
            "errors": sum(s["errors"] for s in stats),
            "republishes": sum(s["republishes"] for s in stats),
            "lag_p99_max_s": max(s["publish_lag_p99_s"] for s in stats),
            "lease_renewals": sum(s["lease_renewals"] for s in stats),
        }


async def simulate(policy: str, n_pods: int, trace: list[ScaleRequest], cost: StepCost,
                   pcfg: PodConfig, index: Index, model: str, kv_pull: bool,
                   opts: SimOptions | None = None) -> RunOut:
    sim = Sim(policy, n_pods, trace, cost, pcfg, index, model, kv_pull, opts)
    with router_on(sim.clock):  # the router is made, runs and stops on simulated time
        try:
            await sim.start()
            gc.collect()
            gc.freeze()  # the pods' blocks and the trace: no full collection walks them
            try:
                return await sim.run()
            finally:
                gc.unfreeze()
        finally:
            await sim.stop()


# -- figures ---------------------------------------------------------------------------------

def summarize(out: RunOut, warm_from: float, duration: float) -> dict:
    recs = [r for r in out.records if r.arrival >= warm_from]
    # Queues that keep growing: the last fifth of the arrivals waits far longer than the rest.
    late = [r.ttft for r in recs if r.arrival >= 0.8 * duration]
    early = [r.ttft for r in recs if r.arrival < 0.8 * duration]
    prompt = sum(r.prompt for r in recs) or 1
    ttft = [r.ttft for r in recs]
    n = len(out.pods)
    counts = [p.stats.requests for p in out.pods]
    busy = [p.stats.busy_s for p in out.pods]
    work = [p.stats.tokens * p.cost.prefill_s_per_token for p in out.pods]
    mean_work = sum(work) / n
    s = {
        "requests": len(recs),
        "completed_all": len(out.records),
        # Cached = not recomputed, as the pod's usage counts it: pool, DRAM and pulled.
        "hit_rate": sum(r.cached_gpu + r.cached_cpu + r.cached_peer for r in recs) / prompt,
        "local_hit_rate": sum(r.cached_gpu + r.cached_cpu for r in recs) / prompt,
        "hit_pool": sum(r.cached_gpu for r in recs) / prompt,
        "hit_dram": sum(r.cached_cpu for r in recs) / prompt,
        "peer_share": sum(r.cached_peer for r in recs) / prompt,
        "bound_hit_rate": sum(r.bound for r in recs) / prompt,
        "ttft_p50_s": pct(ttft, 0.5) if ttft else float("nan"),
        "ttft_p90_s": pct(ttft, 0.9) if ttft else float("nan"),
        "ttft_p99_s": pct(ttft, 0.99) if ttft else float("nan"),
        "busy": sum(busy) / (n * out.sim_end) if out.sim_end else 0.0,
        "compute": sum(work) / (n * out.sim_end) if out.sim_end else 0.0,
        "spread_requests": load_spread(counts),
        "spread_compute": max(work) / mean_work if mean_work else 1.0,
        "preemptions": sum(p.scheduler.num_preemptions for p in out.pods),
        "pulls": sum(p.stats.pulls for p in out.pods),
        "ttft_late_ratio": (pct(late, 0.5) / pct(early, 0.5)
                            if late and early and pct(early, 0.5) > 0 else float("nan")),
        "queued_per_pod_at_end": out.queued_at_end / n,
        "sim_s": out.sim_end,
        "wall_s": out.wall_s,
        "reasons": dict(out.reasons),
        "fallbacks": out.fallbacks,
        "late_writes": out.late_writes,
        "empty_decisions": out.empty_decisions,
    }
    # Throughput over the window [warm_from, duration): prompt tokens (cached or not) of the
    # requests whose first token came in it, requests that finished in it, and what arrived.
    window = duration - warm_from
    if window > 0:
        s["input_tokens_per_s"] = sum(r.prompt for r in out.records
                                      if warm_from <= r.arrival + r.ttft < duration) / window
        s["requests_per_s"] = sum(1 for r in out.records
                                  if warm_from <= r.arrival + r.done < duration) / window
        s["offered_tokens_per_s"] = sum(r.prompt for r in recs if r.arrival < duration) / window
    if out.restarts:
        s["restarts"] = [list(r) for r in out.restarts]
    if out.tick_wall_s:
        s["tick_wall_p50_ms"] = 1e3 * pct(out.tick_wall_s, 0.5)
        s["tick_wall_p99_ms"] = 1e3 * pct(out.tick_wall_s, 0.99)
    if out.lookup_ms:
        s["lookup_p50_ms"] = pct(out.lookup_ms, 0.5)
        s["lookup_p99_ms"] = pct(out.lookup_ms, 0.99)
        s["lookups"] = len(out.lookup_ms)
    if out.decide_cpu_s:
        decide = sum(out.decide_cpu_s) / len(out.decide_cpu_s)
        both = decide + sum(out.prepare_cpu_s) / len(out.prepare_cpu_s)
        s["decide_cpu_us"] = decide * 1e6
        s["prepare_decide_cpu_us"] = both * 1e6
        s["decisions_per_core_s"] = 1 / decide if decide else float("inf")
        s["prepared_decisions_per_core_s"] = 1 / both if both else float("inf")
        s["decide_wall_p99_ms"] = pct(out.decide_wall_ms, 0.99)
    if out.write_lag_s:
        s["write_lag_p50_ms"] = 1e3 * pct(out.write_lag_s, 0.5)
        s["write_lag_p99_ms"] = 1e3 * pct(out.write_lag_s, 0.99)
        s["visible_lag_p99_ms"] = 1e3 * pct(out.visible_lag_s, 0.99)
        s["flushes"] = len(out.write_lag_s)
    if out.index:
        s["index"] = dict(out.index)
    if out.replay:
        s["replay"] = dict(out.replay)
    if out.publisher:
        s["publisher"] = dict(out.publisher)
    return s


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def print_header(args: argparse.Namespace, cost: StepCost, pcfg: PodConfig,
                 tcfg: TraceConfig) -> None:
    print(f"scale: simulated pods behind the real router and index ({args.redis} Redis), "
          f"cost model {cost.name}")
    print(f"machine: {machine_info()}; load average {args.loadavg[0]:.2f} at the start, "
          f"{args.loadavg[1]:.2f} at the end")
    print(f"step model: {cost.step_fixed_s * 1e3:.1f} ms + {cost.prefill_s_per_token * 1e6:.0f}"
          f" us/token computed + {cost.dram_s_per_token * 1e6:.1f} us/token from DRAM; pull "
          f"{cost.peer_s_per_token * 1e6:.0f} us/token ({cost.source})")
    print(f"pod: pool {pcfg.pool_blocks} blocks ({pcfg.pool_blocks * pcfg.block_size} tokens), "
          f"DRAM {pcfg.dram_blocks} blocks, block {pcfg.block_size}, max {pcfg.max_num_seqs} "
          f"seqs, {pcfg.max_num_batched_tokens} tokens/step; kv pull "
          f"{'on' if args.kv_pull else 'off'}")
    print(f"trace: {tcfg.tenants_per_pod:g} tenants/pod x {tcfg.prompts_per_tenant[0]}-"
          f"{tcfg.prompts_per_tenant[1]} system prompts of {tcfg.system_tokens[0]}-"
          f"{tcfg.system_tokens[1]} tokens (Zipf {tcfg.tenant_zipf:g} / {tcfg.prompt_zipf:g}), "
          f"sessions of ~{tcfg.mean_turns:g} turns (max {tcfg.max_turns}), messages "
          f"{tcfg.message_tokens[0]}-{tcfg.message_tokens[1]}, answers "
          f"{tcfg.output_tokens[0]}-{tcfg.output_tokens[1]} tokens, think "
          f"{tcfg.think_s[0]:g}-{tcfg.think_s[1]:g} s; "
          + (f"a hot prefix: {tcfg.hot_share:.0%} of the sessions open with one "
             f"{tcfg.hot_tokens}-token system prompt; " if tcfg.hot_share else "")
          + f"Poisson sessions at load "
          f"{', '.join(f'{x:g}' for x in args.loads) if args.sweep else f'{args.load:g}'}; "
          f"{args.duration:g} simulated s, figures over arrivals after "
          f"{args.warmup:.0%} of it")
    workers = ", ".join(f"{args.publisher_workers or default_workers(n)} at {n} pods"
                        for n in args.pods)
    where = ("in the router's process (a thread each)" if args.publishers == "thread" else
             f"in worker processes ({workers})")
    print(f"pods' index publishers {where}; router policies: {', '.join(ROUTER_POLICIES)}"
          f"{'; shared burst predictions (their TTL on the wall clock)' if args.shared_bursts else ''}")
    print()


def print_tables(results: dict, args: argparse.Namespace, cost: StepCost, pcfg: PodConfig,
                 tcfg: TraceConfig) -> None:
    print_header(args, cost, pcfg, tcfg)
    for n, res in results.items():
        t = res["trace"]
        print(f"### {n} pods: {t['requests']} requests ({t['tenants']} tenants, "
              f"{t['sessions_per_s']:.2f} sessions/s, {t['requests_per_s']:.1f} requests/s); "
              f"bound hit rate {res['prefix']['bound_hit_rate']:.1%}"
              if "prefix" in res else f"### {n} pods")
        print()
        print("| policy | cached | pool / DRAM / pulled | cached / oracle | local / oracle | "
              "cached / RR | TTFT p50 s | TTFT p90 s | p50 / oracle | p90 / oracle | "
              "p50 / RR | p90 / RR | busy / compute | load max/mean (requests / compute) | "
              "preempted |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        orc, rr = res.get("oracle"), res.get("round_robin")

        def vs(r: dict, base: dict | None, key: str, base_key: str | None = None) -> str:
            return _ratio(r[key], base[base_key or key]) if base else "-"

        for policy in POLICIES:
            r = res.get(policy)
            if r is None:
                continue
            print(f"| {policy} | {r['hit_rate']:.1%} | {r['hit_pool']:.1%} / "
                  f"{r['hit_dram']:.1%} / {r['peer_share']:.1%} | "
                  f"{vs(r, orc, 'hit_rate')} | {vs(r, orc, 'local_hit_rate', 'hit_rate')} | "
                  f"{vs(r, rr, 'hit_rate')} | {r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | "
                  f"{vs(r, orc, 'ttft_p50_s')} | {vs(r, orc, 'ttft_p90_s')} | "
                  f"{vs(r, rr, 'ttft_p50_s')} | {vs(r, rr, 'ttft_p90_s')} | "
                  f"{r['busy']:.0%} / {r['compute']:.0%} | {r['spread_requests']:.2f} / "
                  f"{r['spread_compute']:.2f} | {r['preemptions']} |")
        print()
        p = res.get("prefix")
        if p and "lookup_p50_ms" in p:
            ix = p.get("index", {})
            print(f"prefix router: lookup p50 {p['lookup_p50_ms']:.2f} ms, p99 "
                  f"{p['lookup_p99_ms']:.2f} ms ({p['lookups']} lookups); decide "
                  f"{p['decide_cpu_us']:.0f} us CPU = {p['decisions_per_core_s']:.0f} "
                  f"decisions/s per core ({p['prepared_decisions_per_core_s']:.0f}/s with "
                  f"prepare's hashing); reasons "
                  + ", ".join(f"{k} {v}" for k, v in sorted(p["reasons"].items()))
                  + f"; index-down fallbacks {p['fallbacks']:.0f}")
            rp = p.get("replay")
            if rp:
                print(f"lookups replayed alone on the final index (the last {rp['n']}): round "
                      f"trip p50 {rp['wall_p50_ms']:.2f} ms, p99 {rp['wall_p99_ms']:.2f} ms; "
                      f"Redis's own time (slow log) p50 {rp['server_p50_ms']:.3f} ms, p99 "
                      f"{rp['server_p99_ms']:.3f} ms")
            print(f"index: {ix.get('bytes_per_claim', float('nan')):.0f} B per claim, "
                  f"{ix.get('bytes_per_block', float('nan')):.0f} B per distinct block "
                  f"({ix.get('claims', 0)} claims, {ix.get('distinct_blocks', 0)} blocks, "
                  f"used_memory +{ix.get('used_memory_delta', 0) / 2**20:.1f} MiB; the "
                  f"publishers' mirrors equal the pods' state: "
                  f"{ix.get('published_claims') == ix.get('claims')}); publish: "
                  f"write p50 {p.get('write_lag_p50_ms', float('nan')):.2f} ms, p99 "
                  f"{p.get('write_lag_p99_ms', float('nan')):.2f} ms; submit-to-visible "
                  f"p99 {p.get('visible_lag_p99_ms', float('nan')):.1f} ms with the 50 ms "
                  f"flush interval, tick wall p50 {p.get('tick_wall_p50_ms', float('nan')):.1f}"
                  f" / p99 {p.get('tick_wall_p99_ms', float('nan')):.1f} ms "
                  f"({p.get('flushes', 0)} flushes, {p.get('late_writes', 0)} late); {n} "
                  f"idle publishers {ix.get('publishers_where', '')}: "
                  f"{ix.get('idle_publishers_cpu', 0):.1%} of a core in the router's process"
                  f", {ix.get('idle_publishers_cpu_workers', 0):.1%} in the workers")
            print("at the last arrival: " + ", ".join(
                f"{k} {res[k]['queued_per_pod_at_end']:.1f} queued per pod, done "
                f"{res[k]['sim_s'] - args.duration:.0f} s later, late arrivals' TTFT p50 "
                f"{res[k]['ttft_late_ratio']:.1f}x the earlier ones'"
                for k in POLICIES if k in res))
            rr_wall = rr["wall_s"] if rr else float("nan")
            orc_wall = orc["wall_s"] if orc else float("nan")
            print(f"wall: prefix {p['wall_s']:.0f} s, round_robin {rr_wall:.0f} s, oracle "
                  f"{orc_wall:.0f} s for {p['sim_s']:.0f} simulated s")
        print()
    print("(cached = prompt tokens not recomputed: pool + DRAM + pulled from a peer, as the "
          "pod's usage counts them; local = pool + DRAM only; TTFT in simulated s, the "
          "router's own time not included; busy = share of the time a pod steps, compute = "
          "its tokens x prefill s/token over the time; load max/mean over the pods; figures "
          "over the arrivals after the warm-up)")
    print()
    if len(results) > 1 and all("lookup_p50_ms" in r.get("prefix", {})
                                for r in results.values()):
        print("| pods | cached / oracle | local / oracle | cached / RR | TTFT p50 / oracle | "
              "TTFT p90 / oracle | TTFT p50 / RR | lookup p50 / p99 ms | replayed p99 ms | "
              "inside Redis p99 ms | B per claim | B per block | decisions/s per core | "
              "publish write p99 ms | load max/mean |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for n, res in results.items():
            p, orc, rr = res["prefix"], res.get("oracle"), res.get("round_robin")
            rp, ix = p.get("replay", {}), p.get("index", {})

            def vs(base: dict | None, key: str, base_key: str | None = None,
                   p: dict = p) -> str:
                return _ratio(p[key], base[base_key or key]) if base else "-"

            print(f"| {n} | {vs(orc, 'hit_rate')} | {vs(orc, 'local_hit_rate', 'hit_rate')} | "
                  f"{vs(rr, 'hit_rate')} | {vs(orc, 'ttft_p50_s')} | {vs(orc, 'ttft_p90_s')} | "
                  f"{vs(rr, 'ttft_p50_s')} | {p['lookup_p50_ms']:.2f} / "
                  f"{p['lookup_p99_ms']:.2f} | {rp.get('wall_p99_ms', float('nan')):.2f} | "
                  f"{rp.get('server_p99_ms', float('nan')):.2f} | "
                  f"{ix.get('bytes_per_claim', float('nan')):.0f} | "
                  f"{ix.get('bytes_per_block', float('nan')):.0f} | "
                  f"{p['decisions_per_core_s']:.0f} | {p.get('write_lag_p99_ms', 0):.2f} | "
                  f"{p['spread_requests']:.2f} |")
        print(f"(goals: {GOALS})")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for policy, style in (("prefix", "o-"), ("round_robin", "s--"), ("oracle", "^:")):
        pts = [(n, results[n][policy]["hit_rate"]) for n in ns if policy in results[n]]
        if pts:
            a.plot([x for x, _ in pts], [100 * y for _, y in pts], style, label=policy)
    pts = [(n, results[n]["prefix"]["bound_hit_rate"]) for n in ns if "prefix" in results[n]]
    if pts:
        a.plot([x for x, _ in pts], [100 * y for _, y in pts], "k-", lw=0.8,
               label="bound (one unbounded cache)")
    a.set_xscale("log", base=2)
    a.set_xticks(ns, [str(n) for n in ns])
    a.set_xlabel("pods")
    a.set_ylabel("prefix hit rate, % of prompt tokens")
    a.set_ylim(0, 100)
    a.legend()
    a.set_title("hit rate")
    pre = [(n, results[n]["prefix"]) for n in ns if "lookup_p50_ms" in results[n].get("prefix", {})]
    if pre:
        xs = [n for n, _ in pre]
        b.plot(xs, [r["lookup_p99_ms"] for _, r in pre], "o-", label="p99 (round trip)")
        b.plot(xs, [r["lookup_p50_ms"] for _, r in pre], "o--", label="p50 (round trip)")
        server = [(n, r["replay"]["server_p99_ms"]) for n, r in pre if "replay" in r]
        if server:
            b.plot([n for n, _ in server], [y for _, y in server], "s:",
                   label="p99 inside Redis (slow log)")
    b.axhline(2.0, color="grey", lw=0.8, ls=":", label="goal p99 2 ms")
    b.set_xscale("log", base=2)
    b.set_xticks(ns, [str(n) for n in ns])
    b.set_xlabel("pods")
    b.set_ylabel("index lookup, ms")
    b.set_ylim(bottom=0)
    b.legend()
    b.set_title("index lookup (the router's one EVALSHA)")
    fig.suptitle("bench.scale: simulated pods, the real router and Redis index")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------

def sim_options(args: argparse.Namespace, **kw: object) -> SimOptions:
    return SimOptions(publishers=args.publishers, workers=args.publisher_workers,
                      shared_bursts=args.shared_bursts, **kw)  # type: ignore[arg-type]


def make_trace_for(args: argparse.Namespace, cost: StepCost, pcfg: PodConfig,
                   tcfg: TraceConfig, n: int, load: float) -> tuple[list[ScaleRequest], dict]:
    trace, rate = trace_for_load(tcfg, n, load, args.duration, cost.step_fixed_s,
                                 cost.prefill_s_per_token, pcfg.pool_blocks * pcfg.block_size,
                                 pcfg.max_num_seqs, args.seed)
    warm_from = args.warmup * args.duration
    info = {"requests": len(trace), "tenants": num_tenants(tcfg, n), "sessions_per_s": rate,
            "requests_per_s": len(trace) / args.duration, "load": load,
            "hot_share": tcfg.hot_share,
            "hot_pods": hot_pods([r for r in trace if r.arrival >= warm_from], tcfg, n,
                                 cost.step_fixed_s, cost.prefill_s_per_token,
                                 pcfg.pool_blocks * pcfg.block_size, pcfg.max_num_seqs,
                                 args.duration - warm_from)}
    return trace, info


async def run_policies(args: argparse.Namespace, cost: StepCost, pcfg: PodConfig,
                       index: Index, n: int, trace: list[ScaleRequest], label: str,
                       res: dict) -> None:
    for policy in args.policies:
        out = await simulate(policy, n, trace, cost, pcfg, index, cost.name, args.kv_pull,
                             sim_options(args))
        res[policy] = summarize(out, args.warmup * args.duration, args.duration)
        logger.info("%s, %s: %s", label, policy, res[policy])
        print(f"[{label}, {policy}: hit {res[policy]['hit_rate']:.1%}, TTFT p50 "
              f"{res[policy]['ttft_p50_s']:.3f} s p90 {res[policy]['ttft_p90_s']:.3f} s, "
              f"wall {out.wall_s:.0f} s]", flush=True)


async def run_all(args: argparse.Namespace, cost: StepCost, pcfg: PodConfig,
                  tcfg: TraceConfig, index: Index) -> dict:
    results: dict = {}
    for n in args.pods:
        trace, info = make_trace_for(args, cost, pcfg, tcfg, n, args.load)
        res: dict = {"trace": info}
        await run_policies(args, cost, pcfg, index, n, trace, f"{n} pods", res)
        results[n] = res
    return results


async def run_sweep(args: argparse.Namespace, cost: StepCost, pcfg: PodConfig,
                    tcfg: TraceConfig, index: Index) -> dict:
    """--sweep: every policy on one hot-prefix trace per load, at the first pod count."""
    n = args.pods[0]
    results: dict = {}
    for load in args.loads:
        trace, info = make_trace_for(args, cost, pcfg, tcfg, n, load)
        res: dict = {"trace": info}
        await run_policies(args, cost, pcfg, index, n, trace, f"{n} pods, load {load:g}", res)
        results[load] = res
    return results


async def run_warm(args: argparse.Namespace, cost: StepCost, pcfg: PodConfig,
                   tcfg: TraceConfig, index: Index) -> dict:
    """--warm-start: per router policy, the trace with one router (the control) and with
    a fresh router from `restart_at`; the hit rate per second since the restart."""
    n = args.pods[0]
    trace, info = make_trace_for(args, cost, pcfg, tcfg, n, args.load)
    warm_from = args.warmup * args.duration
    results: dict = {"trace": info}
    for policy in [p for p in args.policies if p != "oracle"]:
        runs = {}
        for restart in (None, args.restart_at):
            out = await simulate(policy, n, trace, cost, pcfg, index, cost.name, args.kv_pull,
                                 sim_options(args, restart_at=restart))
            runs[restart] = out
            what = f"restart at {restart:g} s" if restart else "control"
            print(f"[{n} pods, {policy}, {what}: wall {out.wall_s:.0f} s]", flush=True)
        restarted, control = runs[args.restart_at], runs[None]
        fig = warm_figures(restarted.records, control.records, args.restart_at, warm_from,
                           args.warm_seconds)
        fig["restart"] = list(restarted.restarts[0]) if restarted.restarts else None
        fig["summary"] = summarize(restarted, warm_from, args.duration)
        fig["summary_control"] = summarize(control, warm_from, args.duration)
        results[policy] = fig
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="8 and 16 pods, 60 simulated s (< 1 min); with --sweep 8 pods, "
                         "loads 0.5,1.1, 40 s; with --warm-start 16 pods, 40 s")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--pods", type=lambda s: [int(x) for x in s.split(",")],
                    help="pod counts (default 16,64,256; --quick 8,16; --sweep and "
                         "--warm-start use the first: default 32 and 64)")
    ap.add_argument("--policies", type=lambda s: s.split(","),
                    help=f"of {', '.join(POLICIES)} (default {','.join(DEFAULT_POLICIES)}; "
                         f"--sweep: all; --warm-start: prefix)")
    ap.add_argument("--redis", choices=("single", "cluster"), default="single")
    ap.add_argument("--cost", choices=sorted(PRESETS), default="smollm2-135m-instruct",
                    help="step-time model from docs/BENCHMARKS.md's figures of this model")
    ap.add_argument("--calibrate", metavar="MODEL",
                    help="fit the step-time model on this machine with a real ModelRunner")
    ap.add_argument("--load", type=float, default=0.7,
                    help="the pods' time the trace needs at the bound's hit rate, as a "
                         "fraction of theirs (bench/scale_trace.py pod_seconds)")
    ap.add_argument("--duration", type=float, help="simulated seconds (default 120; quick 60)")
    ap.add_argument("--warmup", type=float, default=0.3,
                    help="fraction of the trace before the figures start (cold start)")
    ap.add_argument("--pool-blocks", type=int, default=PodConfig().pool_blocks)
    ap.add_argument("--dram-blocks", type=int, default=PodConfig().dram_blocks)
    ap.add_argument("--tenants-per-pod", type=float, default=TraceConfig().tenants_per_pod)
    ap.add_argument("--kv-pull", action=argparse.BooleanOptionalAction, default=True,
                    help="the router's pull option (its default: on)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=str,
                    help="PNG of hit rate and lookup p99 against pod count (default "
                         "docs/scale.png; none with --quick unless given; '' for none)")
    ap.add_argument("--publishers", choices=("process", "thread"), default="process",
                    help="where the pods' index publishers run: worker processes (default) "
                         "or threads in the router's process (bench.scale before issue #30)")
    ap.add_argument("--publisher-workers", type=int, default=0,
                    help="worker processes for the publishers (0: one per 128 pods, 1-4)")
    ap.add_argument("--shared-bursts", action="store_true",
                    help="the router's shared burst predictions in Redis (their TTL runs on "
                         "the wall clock, not simulated time)")
    ap.add_argument("--sweep", action="store_true",
                    help="a load sweep on a hot-prefix trace: TTFT, throughput and the knee "
                         "per policy (bench/scale_sweep.py)")
    ap.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")],
                    help="--sweep's loads (default 0.5,0.7,0.9,1.1,1.3; --quick 0.5,1.1)")
    ap.add_argument("--hot-share", type=float,
                    help="share of the sessions opening with the one hot system prompt "
                         "(default 0.3 with --sweep, else 0)")
    ap.add_argument("--hot-tokens", type=int, default=TraceConfig().hot_tokens)
    ap.add_argument("--warm-start", action="store_true",
                    help="restart the router mid-run: the hit rate per second since "
                         "(bench/scale_warm.py)")
    ap.add_argument("--restart-at", type=float,
                    help="--warm-start's restart, simulated s (default: half the duration)")
    ap.add_argument("--warm-seconds", type=int, default=10,
                    help="--warm-start: seconds after the restart reported one by one")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.sweep and args.warm_start:
        ap.error("--sweep and --warm-start are separate runs")
    if args.sweep:
        args.pods = args.pods or ([8] if args.quick else [32])
        args.loads = args.loads or ([0.5, 1.1] if args.quick else [0.5, 0.7, 0.9, 1.1, 1.3])
        args.policies = args.policies or list(POLICIES)
        args.duration = args.duration or (40.0 if args.quick else 90.0)
    elif args.warm_start:
        args.pods = args.pods or ([16] if args.quick else [64])
        args.policies = args.policies or ["prefix"]
        args.duration = args.duration or (40.0 if args.quick else 90.0)
        args.restart_at = args.restart_at or args.duration / 2
    args.pods = args.pods or ([8, 16] if args.quick else [16, 64, 256])
    args.policies = args.policies or list(DEFAULT_POLICIES)
    args.duration = args.duration or (60.0 if args.quick else 120.0)
    args.loads = args.loads or [args.load]
    if args.hot_share is None:
        args.hot_share = 0.3 if args.sweep else 0.0
    if args.plot is None and not args.quick and not (args.sweep or args.warm_start):
        args.plot = "docs/scale.png"
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    cost = calibrate(args.calibrate) if args.calibrate else PRESETS[args.cost]
    pcfg = replace(PodConfig(), pool_blocks=args.pool_blocks, dram_blocks=args.dram_blocks)
    tcfg = replace(TraceConfig(), tenants_per_pod=args.tenants_per_pod,
                   hot_share=args.hot_share, hot_tokens=args.hot_tokens)
    # A SIGTERM unwinds like an error: the Redis server and the publisher workers stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_dir = Path(tempfile.mkdtemp(prefix="pagekv-bench-scale-"))
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    index = start_index(args.redis, run_dir)
    runner = run_sweep if args.sweep else run_warm if args.warm_start else run_all
    try:
        results = asyncio.run(runner(args, cost, pcfg, tcfg, index))
    finally:
        index.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    args.loadavg = (load_start, os.getloadavg()[0])
    print()
    extra: dict = {}
    if args.sweep:
        print_header(args, cost, pcfg, tcfg)
        extra["knees"] = print_sweep(results, args.policies, args.pods[0])
    elif args.warm_start:
        print_header(args, cost, pcfg, tcfg)
        t = results["trace"]
        print(f"{args.pods[0]} pods: {t['requests']} requests ({t['requests_per_s']:.1f}/s)")
        print()
        for policy, fig in results.items():
            if policy != "trace":
                print_warm(policy, args.pods[0], fig, fig.get("restart"))
    else:
        print_tables(results, args, cost, pcfg, tcfg)
        if args.plot and len(results) > 1 and "prefix" in args.policies:
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            plot(results, Path(args.plot))
            print(f"plot: {args.plot}")
    print(f"(total {time.perf_counter() - t0:.0f} s; load average {args.loadavg[0]:.2f} at "
          f"the start, {args.loadavg[1]:.2f} at the end)")
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "scale", "machine": machine_info(), "redis": args.redis,
            "mode": "sweep" if args.sweep else "warm_start" if args.warm_start else "sizes",
            "cost": asdict(cost), "pod": asdict(pcfg), "trace": asdict(tcfg),
            "load": args.load, "loads": args.loads, "duration_s": args.duration,
            "warmup": args.warmup, "loadavg": args.loadavg, "publishers": args.publishers,
            "publisher_workers": args.publisher_workers, "shared_bursts": args.shared_bursts,
            "kv_pull": args.kv_pull, "results": {str(k): v for k, v in results.items()},
            **extra}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
