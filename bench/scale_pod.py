"""The scale benchmark's simulated pod: the real memory manager, tiers, scheduler and index
publisher, with the forward pass replaced by a step-time model.

What is real (the pod's own code, unchanged): `KVCacheManager` (pool, prefix cache,
eviction), `TierEvictor` / `TierConnector` / `TierChain` / `DramTier` (demotion into DRAM,
reload at admission, the per-tier hit accounting), the engine's `Scheduler` (continuous
batching, chunked prefill, preemption), the KV events they emit and the `IndexPublisher`
that writes them to Redis (in a process of its own: bench/scale_publishers.py). What is modelled: the time of a step (`StepCost`), the DRAM
copies (8-byte rows instead of the model's K/V: the tiers keep the same books), and a peer
pull (`SimPod._pull`: what `kvnode.engine.peer_pull.PeerPuller` does, without gRPC).

A step computes `tokens` (prefill chunks + one per decoding sequence) and reloads
`dram_tokens` from DRAM:

    step s = step_fixed + tokens × prefill s/token + dram_tokens × DRAM s/token

which is what a pod's step costs on the measured pods (a decode token is one more row
through the same layers; `calibrate` fits the two coefficients on a real `ModelRunner`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pagekv.kvnode.engine.engine import PREFILL_SAMPLE_MIN_TOKENS
from pagekv.kvnode.engine.outputs import RequestMetrics
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.engine.scheduler import Scheduler, Sequence, SequenceGroup
from pagekv.kvnode.engine.tier_connector import TierConnector, TierEvictor
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager, PrefixHit
from pagekv.kvnode.memory.metrics import KVCacheMetrics
from pagekv.kvnode.memory.request import Request
from pagekv.proto.hashing import HashConfig, RequestBlockHasher
from pagekv.proto.medium import PEER_SHARE, Medium
from pagekv.tiers.chain import TierChain
from pagekv.tiers.dram import DramTier

SIM_BLOCK_BYTES = 8  # the DRAM tier's rows: the books are the tier's own, the bytes a token


# -- the step-time model ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StepCost:
    name: str
    step_fixed_s: float
    prefill_s_per_token: float
    dram_s_per_token: float
    peer_s_per_token: float
    source: str  # where each figure comes from

    def step_s(self, tokens: int, dram_tokens: int = 0) -> float:
        return (self.step_fixed_s + tokens * self.prefill_s_per_token
                + dram_tokens * self.dram_s_per_token)


def fit_step(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares (fixed, per token) of step time = fixed + per token × tokens."""
    n = len(points)
    if n < 2 or len({x for x, _ in points}) < 2:
        raise ValueError("need steps of at least two sizes")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return max(0.0, my - slope * mx), slope


def _from_ttft(name: str, cold_ms: float, hit_ms: float, prefix: int, suffix: int,
               dram_ms: float, pool_ms: float, reloaded: int, kv_bytes_per_token: int,
               source: str) -> StepCost:
    """A preset from BENCHMARKS.md's figures: a cold prefill of prefix+suffix tokens and the
    same prompt on a pool hit (suffix tokens) give the two coefficients; the DRAM reload
    of `reloaded` tokens over the pool hit gives DRAM s/token."""
    fixed, per_token = fit_step([(prefix + suffix, cold_ms / 1e3), (suffix, hit_ms / 1e3)])
    # A pull: no measured figure yet. The router's own estimate (6e-5 s/token for
    # pagekv-small's 6 KiB of fp32 K/V per token, router/config.py) scaled by K/V bytes.
    peer = 6e-5 * kv_bytes_per_token / 6144
    return StepCost(name, fixed, per_token, (dram_ms - pool_ms) / 1e3 / reloaded, peer, source)


PRESETS = {
    # BENCHMARKS §10 (Intel Xeon, 2 cores, torch backend): 2,048-token prefix + 32 new,
    # cold 2260.8 ms, pool hit 106.7 ms; DRAM restore of 1,888 tokens 199.7 ms vs pool
    # 105.9 ms. fp32 K/V 46,080 B/token.
    "smollm2-135m-instruct": _from_ttft(
        "smollm2-135m-instruct", 2260.8, 106.7, 2048, 32, 199.7, 105.9, 1888, 46080,
        "docs/BENCHMARKS.md §10: prefix TTFT cold 2260.8 / hit 106.7 ms (2,048 + 32 "
        "tokens), DRAM restore 199.7 vs pool 105.9 ms (1,888 tokens); peer = the "
        "router's 6e-5 s/token estimate × 46,080/6,144 K/V bytes"),
    # BENCHMARKS §3 and §5 (AMD EPYC, 2 cores, torch backend).
    "pagekv-small": _from_ttft(
        "pagekv-small", 419.1, 16.71, 2048, 32, 26.0, 17.8, 1888, 6144,
        "docs/BENCHMARKS.md §3/§5: prefix TTFT cold 419.1 / hit 16.71 ms, DRAM restore "
        "26.0 vs pool 17.8 ms (1,888 tokens); peer = the router's 6e-5 s/token estimate"),
}


def calibrate(model: str, repeats: int = 3, seed: int = 0) -> StepCost:
    """Fit the step model on this machine: a real `ModelRunner` of `model` runs cold
    2,048-token prefills, 32-token steps on a 2,048-token cached prefix and 8-sequence
    decode steps; the real DRAM tier (`TierChain` + `DramTier`) evicts and reloads 128 of
    its blocks (read from and written to the pool as the pod's tier path does)."""
    import random

    from pagekv.kvnode.engine.tier_connector import _as_rows
    from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem

    bs, n, suffix, dec, ctx = 16, 2048, 32, 8, 256
    need = -(-(n + suffix) // bs)
    dec_blocks = -(-(ctx + 1) // bs)
    runner = ModelRunner(model, block_size=bs, num_gpu_blocks=2 * need + dec * dec_blocks + 8,
                         max_model_len=4096, device="cpu")
    rng = random.Random(seed)
    vocab = min(runner.model_config.vocab_size, 32000)
    tokens = [rng.randrange(vocab) for _ in range(n + suffix)]
    cold, hit = list(range(need)), list(range(need, 2 * need))
    base = 2 * need
    decs = [list(range(base + i * dec_blocks, base + (i + 1) * dec_blocks)) for i in range(dec)]
    runner.execute([SeqBatchItem(tokens[:64], 0, cold)])  # warm-up
    runner.execute([SeqBatchItem(tokens[:n], 0, hit)])  # the cached prefix, written once
    for blocks in decs:
        runner.execute([SeqBatchItem(tokens[:ctx], 0, blocks)])

    def timed(batch: list) -> float:
        t0 = time.perf_counter()
        runner.execute(batch)
        return time.perf_counter() - t0

    points: dict[int, list[float]] = {n: [], suffix: [], dec: []}
    for _ in range(repeats):
        points[n].append(timed([SeqBatchItem(tokens[:n], 0, cold)]))
        points[suffix].append(timed([SeqBatchItem(tokens[n:n + suffix], n, hit)]))
        points[dec].append(timed([SeqBatchItem([tokens[ctx]], ctx, b) for b in decs]))
    fixed, per_token = fit_step([(k, statistics.median(v)) for k, v in points.items()])

    moved = 128
    dram = DramTier(2 * moved * runner.block_bytes, runner.block_bytes)
    chain = TierChain(dram, None, block_size=bs)
    reload = []
    for r in range(repeats + 1):  # the first round touches the slab's pages: not timed
        hashes = [f"cal-{r}-{i}".encode() for i in range(moved)]
        ids = cold[:moved]
        t0 = time.perf_counter()
        chain.demote_many(hashes, [None] * moved, runner.read_blocks(ids))
        rows = chain.promote_many(hashes)
        runner.write_blocks(ids, _as_rows(rows))
        if r:
            reload.append((time.perf_counter() - t0) / (moved * bs))
    kv_bytes_token = runner.block_bytes // bs
    return StepCost(
        model, fixed, per_token, statistics.median(reload), 6e-5 * kv_bytes_token / 6144,
        f"calibrated here on {model}: median of {repeats} cold {n}-token prefills, "
        f"{suffix}-token steps on a {n}-token prefix, {dec}-sequence decode steps; DRAM: "
        f"{moved} blocks demoted and reloaded through TierChain; peer = the router's "
        f"6e-5 s/token estimate × {kv_bytes_token}/6,144 K/V bytes")


# -- the pod ---------------------------------------------------------------------------------

class _SimRunner:
    """What the tier path asks of a model runner, on CPU, with SIM_BLOCK_BYTES-byte blocks."""

    block_bytes = SIM_BLOCK_BYTES
    device = torch.device("cpu")

    def read_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        n = len(block_ids)
        if out is None or out.shape[0] < n:
            out = torch.zeros((n, self.block_bytes), dtype=torch.uint8)
        return out[:n]

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        pass


@dataclass(frozen=True, slots=True)
class PodConfig:
    pool_blocks: int = 1456          # SmolLM2's CPU pod: "KV cache size: 23296 tokens"
    dram_blocks: int = 4 * 1456      # a DRAM tier four times the pool
    block_size: int = 16
    max_num_seqs: int = 64           # EngineArgs' defaults
    max_num_batched_tokens: int = 2048
    hash_algo: str = "sha256"
    hash_seed: str = "vllm-none-hash"


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request's life on a pod; times are simulated seconds."""

    rid: str
    arrival: float
    prompt_len: int
    output: list[int]
    seq: Sequence
    est_uncached: int = 0        # for the oracle: the uncached tokens when it was placed
    admitted: bool = False
    first_token: float | None = None
    finished: float | None = None
    pull_source: tuple[SimPod, int] | None = None  # (peer, blocks) from the router's hint
    peer_tokens: int = 0
    tag: object = None           # the caller's (the trace request, the router's entry)


@dataclass(slots=True)
class _Pull:
    start: int
    hashes: list[bytes]
    available: int
    done_at: float
    pinned: list


@dataclass(slots=True)
class PodStats:
    steps: int = 0
    busy_s: float = 0.0
    tokens: int = 0
    prefill_tokens: int = 0
    dram_tokens: int = 0
    pulls: int = 0
    pulled_tokens: int = 0
    requests: int = 0


class SimPod:
    def __init__(self, index: int, pod_id: str, cfg: PodConfig, cost: StepCost) -> None:
        self.index = index
        self.pod_id = pod_id
        self.address = f"{pod_id}.sim.invalid:50051"
        self.cfg = cfg
        self.cost = cost
        self.runner = _SimRunner()
        dram = DramTier(cfg.dram_blocks * SIM_BLOCK_BYTES, SIM_BLOCK_BYTES) \
            if cfg.dram_blocks > 0 else None
        chain = TierChain(dram, None, block_size=cfg.block_size)
        self.chain = chain
        self.manager = KVCacheManager(
            cfg.pool_blocks, cfg.block_size, hash_algo=cfg.hash_algo, hash_seed=cfg.hash_seed,
            metrics=KVCacheMetrics(0.0), on_evict_many=TierEvictor(chain, self.runner))
        self.tiers = TierConnector(chain, self.manager, self.runner)
        self.scheduler = Scheduler(self.manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   True, prefix_loader=self._load_prefix)
        self.hash_config = HashConfig(cfg.hash_algo, cfg.hash_seed)
        self.now = 0.0
        self.stepping_until: float | None = None  # end of the step in progress
        self.wake_at: float | None = None
        self._scheduled: list[tuple[Sequence, int]] = []
        self._reqs: dict[str, SimRequest] = {}
        self._pulls: dict[str, _Pull] = {}
        self._landed: dict[str, int] = {}
        self._prefill_samples: deque[float] = deque(maxlen=32)
        self._pulled_s_per_token: float | None = None
        self.events: list = []          # KV events not yet handed to the publisher
        self.events_since: float | None = None  # when the oldest of them was produced
        self.stats = PodStats()

    # -- the index (bench/scale_publishers.py publishes what these return) ---------------
    def load(self) -> dict[str, float]:  # PodServicer.load
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "free_blocks": self.manager.get_num_free_blocks(),
                "num_blocks": self.manager.num_blocks}

    def tier_costs(self) -> dict[str, float]:  # PodServicer.tier_costs: what it measured
        costs: dict[str, float] = {}
        if self._prefill_samples:
            costs["prefill"] = statistics.median(self._prefill_samples)
        if self.cfg.dram_blocks > 0:
            costs[Medium.CPU] = self.cost.dram_s_per_token
        if self._pulled_s_per_token is not None:
            costs["peer"] = self._pulled_s_per_token
        return costs

    def full_state(self) -> dict[bytes, str]:  # Engine.full_state
        state = dict.fromkeys(self.manager.cached_hashes(), Medium.GPU)
        state.update(self.tiers.full_state())
        return state

    def take_events(self) -> list:
        events, self.events, self.events_since = self.events, [], None
        return events

    # -- requests -----------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], output: list[int], arrival: float,
            hashes: list[bytes] | None = None) -> SimRequest:
        """Queue a request. `hashes`: its prompt's block hashes, when the router already
        computed them with this pod's configuration (the pod would compute the same)."""
        req = Request(rid, prompt)
        if hashes is not None:
            req.hasher = RequestBlockHasher(self.hash_config, self.cfg.block_size)
            req.block_hashes = hashes
        group = SequenceGroup(rid, req.prompt_token_ids,
                              SamplingParams(max_tokens=len(output), ignore_eos=True),
                              RequestMetrics(arrival))
        seq = Sequence(req, group, 0)
        group.seqs.append(seq)
        sim = SimRequest(rid, arrival, len(prompt), output, seq)
        self._reqs[rid] = sim
        self.scheduler.add(seq)
        self.stats.requests += 1
        return sim

    def exact_hit(self, hashes: list[bytes], prompt_len: int) -> tuple[int, int]:
        """(pool blocks, DRAM blocks) of the prompt's prefix this pod holds now: what a
        lookup + reload at admission would find (the oracle reads it; nothing changes)."""
        limit = min(len(hashes), max(0, (prompt_len - 1) // self.cfg.block_size))
        cached = self.manager.block_pool.cached_block_hash_to_block
        i = 0
        while i < limit and hashes[i] in cached:
            i += 1
        pool = i
        dram = self.chain.dram
        if dram is not None:
            while i < limit and dram.contains(hashes[i]):
                i += 1
        return pool, i - pool

    def backlog(self) -> tuple[int, int]:
        """(prefill tokens ahead of a new arrival, sequences decoding)."""
        ahead = decoding = 0
        for seq in self.scheduler.running:
            left = seq.req.num_prompt_tokens - seq.req.num_computed_tokens
            if left > 0:
                ahead += left
            else:
                decoding += 1
        for seq in self.scheduler.waiting:
            ahead += self._reqs[seq.req.request_id].est_uncached
        return ahead, decoding

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- admission hooks ----------------------------------------------------------------
    def _load_prefix(self, req: Request, hit: PrefixHit) -> bool:
        """Engine._load_prefix: the tiers extend the pool hit, then a peer pull."""
        if not self.tiers.load_prefix(req, hit):
            return False
        return self._pull(req, hit)

    def _pull(self, req: Request, hit: PrefixHit) -> bool:
        """PeerPuller.load_prefix: with a hint, pull the blocks the peer holds past the pool
        hit (its pool and DRAM, cut at the first it lacks, as the peer's export is), while
        the request waits; land them as a tier reload lands blocks."""
        rid = req.request_id
        pull = self._pulls.get(rid)
        if pull is not None:
            if self.now < pull.done_at:
                return False
            del self._pulls[rid]
            skip = len(hit.blocks) - pull.start  # blocks the pool gained meanwhile
            todo = pull.hashes[skip:pull.available] if skip >= 0 else []
            landed = 0
            if todo:
                landed = self.manager.load_cached_blocks(
                    req, pull.start + skip, [(h, None) for h in todo],
                    lambda ids, datas: None, hit)
            self.manager.unpin(pull.pinned)
            self._landed[rid] = landed * self.cfg.block_size
        else:
            sim = self._reqs[rid]
            source, sim.pull_source = sim.pull_source, None  # one attempt per request
            start = len(hit.blocks)
            end = min(source[1], hit.max_blocks) if source is not None else 0
            if source is not None and end > start:
                peer = source[0]
                hashes = list(req.block_hashes[start:end])
                have, below = peer.exact_hit(req.block_hashes[:end], req.num_tokens)
                available = max(0, min(have + below, end) - start)
                tokens = available * self.cfg.block_size
                pinned = list(hit.blocks)
                self.manager.pin(pinned)
                done = self.now + tokens * self.cost.peer_s_per_token + 0.002  # + a round trip
                self._pulls[rid] = _Pull(start, hashes, available, done, pinned)
                self.stats.pulls += 1
                self.stats.pulled_tokens += tokens
                if tokens:
                    self._pulled_s_per_token = self.cost.peer_s_per_token
                self.wake_at = done if self.wake_at is None else min(self.wake_at, done)
                return False
        pulled = min(self._landed.get(rid, 0), hit.num_tokens)
        if pulled:  # PeerPuller._share: the pulled tokens are the hit's peer share
            by_tier = dict(hit.by_tier())
            by_tier[Medium.GPU] = by_tier.get(Medium.GPU, 0) - pulled
            by_tier[PEER_SHARE] = pulled
            hit.tokens_by_tier = by_tier
        return True

    # -- steps --------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Schedule one step at `now`; its end time, or None when nothing can run (requests
        waiting for pulls: `wake_at` says when to try again)."""
        self.now = now
        self.wake_at = None
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            self._scheduled = []
            return None
        dram = 0
        for seq, _ in sched.scheduled:
            sim = self._reqs[seq.req.request_id]
            if not sim.admitted:
                sim.admitted = True
                dram += seq.group.cached_tokens_by_tier.get(Medium.CPU, 0)
                sim.peer_tokens = seq.group.cached_tokens_by_tier.get(PEER_SHARE, 0)
        tokens = sched.num_batched_tokens
        dt = self.cost.step_s(tokens, dram)
        if tokens >= PREFILL_SAMPLE_MIN_TOKENS:  # Engine.step's prefill-speed sample
            self._prefill_samples.append(dt / tokens)
        s = self.stats
        s.steps += 1
        s.busy_s += dt
        s.tokens += tokens
        s.dram_tokens += dram
        self._scheduled = sched.scheduled
        self.stepping_until = now + dt
        return now + dt

    def end_step(self, now: float) -> list[SimRequest]:
        """The step's tokens are computed: sample (the trace's answer), finish, take the KV
        events. Returns the requests that finished."""
        self.now = now
        self.stepping_until = None
        done = []
        for seq, n in self._scheduled:
            req = seq.req
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.stats.prefill_tokens += min(n, req.num_prompt_tokens
                                                 - req.num_computed_tokens)
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk
            sim = self._reqs[req.request_id]
            k = len(req.output_token_ids)
            req.append_output_token_ids(sim.output[k])
            if sim.first_token is None:
                sim.first_token = now
            if k + 1 >= len(sim.output):
                seq.finish_reason = "length"
                self.scheduler.remove(seq)
                self.tiers.forget(req.request_id)
                self._landed.pop(req.request_id, None)
                sim.finished = now
                del self._reqs[req.request_id]
                done.append(sim)
        self._scheduled = []
        events = self.manager.take_events()
        events.extend(self.tiers.take_events())
        if events:
            if self.events_since is None:
                self.events_since = now
            self.events.extend(events)
        return done


# -- the oracle ------------------------------------------------------------------------------

def oracle_estimate(pod: SimPod, hashes: list[bytes], prompt_len: int,
                    budget: int) -> tuple[float, int]:
    """Time to first token on `pod` with perfect knowledge of its pool, DRAM and queue
    (the step model applied to the prefill ahead of the request and its own), and the
    request's uncached tokens there."""
    pool, dram = pod.exact_hit(hashes, prompt_len)
    bs = pod.cfg.block_size
    own = prompt_len - (pool + dram) * bs
    ahead, decoding = pod.backlog()
    c = pod.cost
    steps = max(1, math.ceil((ahead + own) / max(1, budget - decoding)))
    est = (steps * (c.step_fixed_s + decoding * c.prefill_s_per_token)
           + (ahead + own) * c.prefill_s_per_token + dram * bs * c.dram_s_per_token)
    return est, own


@dataclass(slots=True)
class Oracle:
    rotation: int = 0
    picks: list[int] = field(default_factory=list)

    def pick(self, pods: list[SimPod], hashes: list[bytes], prompt_len: int,
             budget: int) -> tuple[SimPod, int]:
        self.rotation += 1
        n = len(pods)
        best: tuple[float, int, int] | None = None
        chosen = pods[0]
        uncached = prompt_len
        for k in range(n):
            pod = pods[(self.rotation + k) % n]  # ties rotate
            est, own = oracle_estimate(pod, hashes, prompt_len, budget)
            key = (est, own, k)
            if best is None or key < best:
                best, chosen, uncached = key, pod, own
        return chosen, uncached
