"""Scoring pods by estimated time to first token (pure functions, no I/O).

For one request of `prompt_len` tokens and one pod:

    cost = uncached tokens × prefill s/token          (prefill still to do on that pod)
         + tokens found in DRAM × CPU s/token          (reload from the DRAM tier)
         + tokens found on SSD × DISK s/token          (reload from the SSD tier)
         + queue × queue s/request × speed             (work ahead of it on that pod)

The per-token figures come from what the pod publishes (`cost.prefill`, `cost.CPU`,
`cost.DISK`), else from the router's configuration; `speed` is the pod's prefill s/token
over the configured one, so the queue figure is in units of the configured machine. `queue`
is the larger of the pod's published `waiting + running` (everyone's requests, up to a
second old, less those of ours that finished since) and this router's own requests in
flight to it (exact, but only ours).

Measured prefill speeds are noisy: identical pods sharing a host (or just amortizing a
step's fixed cost over small batches) publish figures that swing 2x within seconds. Pods
within `speed_band` times of the pods' median are therefore scored at that median, as equally
fast; only a pod further off (other hardware) keeps its own figure. Otherwise noise, not
load, would decide where every cold prompt goes.

The pull option (`score_all` with `pull`): a pod C whose predicted prefix is shorter than one
the index confirms on another pod H may pull the blocks in between from H
(GenerateRequest.kv_source) instead of recomputing them:

    pull cost = cost − pulled tokens × prefill s/token + fixed s + pulled tokens × peer s/token

C keeps its own tiers for its own prefix. The pull's price is what C measured pulling from H
(`cost.peer.<H>` and `cost.peer_fixed.<H>`, proto/pull_cost.py), else C's published
`cost.peer` (all-in per token, no fixed part), else the configured one. So a pull is taken
only above its crossover, the token delta where it starts to beat recomputing: fixed /
(prefill − peer), never when a pulled token is no cheaper (`pull_crossover`); and never for
fewer tokens than the configured floor (`--pull-min-token-delta`, 0 by default). The source
is measured by the index only: a burst-predicted block may not exist yet, so it cannot be
pulled.

Each C weighs every holder: the cheapest pull wins, but holders whose pull costs C within
the tie tolerance of that (a few blocks more or less of prefix, or a link a little slower)
are near-tied, and among them the shorter queue serves it (it answers the pull sooner, and
the pulls spread over the holders of a hot prefix instead of all landing on the deepest),
then the cheaper pull, then the pod id.

The cheapest pod wins. Pods whose costs are within the tie tolerance of the best one are
tied; ties go to the pod this router has sent the fewest requests lately (a decayed count),
then the smaller queue, then the larger free pool, then rotate so that cold requests spread
instead of piling onto the first pod id. A cold request (no pod holds any of its prefix) is then
placed by router/placement.py (`--cold-placement hash`): that is where its siblings will go.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagekv.proto.hashing import max_hit_blocks
from pagekv.proto.medium import Medium
from pagekv.proto.pull_cost import PullCost

# Reasons reported in RoutingInfo.reason and as a metric label (a small fixed set).
REASON_PREFIX = "prefix_hit"          # the chosen pod holds a prefix and is cheapest
REASON_BURST = "burst_prediction"     # as above, but the hit is predicted from a recent route
REASON_COST = "least_cost"            # no pod holds a prefix; cost (speed, queue) decided
REASON_TIE_LOAD = "tie_least_loaded"  # costs tied; the lighter queue / freer pool won
REASON_TIE_ROTATE = "tie_rotation"    # costs and load tied; rotated among them
REASON_FALLBACK = "index_down_least_loaded"  # Redis unreachable: load-only routing
REASON_ROUND_ROBIN = "round_robin"    # --policy round_robin
REASON_RANDOM = "random"              # --policy random
REASON_COOLDOWN = "best_pod_cooling_down"  # the best pod was just UNAVAILABLE: next best
REASON_RETRY = "retry_after_unavailable"   # the pod tried before this one was UNAVAILABLE
REASON_PULL = "peer_pull"             # the chosen pod pulls its prefix from a peer (kv_source)
REASON_COLD_SPREAD = "cold_spread"    # no pod holds a prefix: the first block's hash picked
REASON_PD_PREFILL = "pd_prefill"      # the prefill half of a split request (disaggregation)
REASON_SESSION = "session"            # a session's turn, kept on its pod (router/sessions.py)
REASONS = (REASON_PREFIX, REASON_BURST, REASON_COST, REASON_TIE_LOAD, REASON_TIE_ROTATE,
           REASON_FALLBACK, REASON_ROUND_ROBIN, REASON_RANDOM, REASON_COOLDOWN, REASON_RETRY,
           REASON_PULL, REASON_COLD_SPREAD, REASON_SESSION)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Configured per-token and per-request costs (seconds), used when a pod publishes none.

    `tie_rel` / `tie_abs_s`: costs within max(tie_abs_s, tie_rel × best) of the best count as
    tied, so that measurement noise between identical pods does not decide a cold request.
    `speed_band` (>= 1): published prefill speeds within this factor of the median are
    treated as the median (1 = always trust each pod's own figure).
    `pull_min_token_delta`: a floor under the fitted crossover: no pull of fewer tokens
    (as llm-d's minCachedTokenDelta; 0 = the crossover alone decides).
    """

    prefill_per_token: float
    cpu_per_token: float
    disk_per_token: float
    queue_per_request: float
    peer_per_token: float = 6e-5  # a pull from a peer pod; why this figure: router/config.py
    tie_rel: float = 0.05
    tie_abs_s: float = 0.0005
    speed_band: float = 2.0
    pull_min_token_delta: int = 0  # tokens
    # A LoRA adapter load, at least (a pod's measured load time when longer).
    adapter_load_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("prefill_per_token", "cpu_per_token", "disk_per_token",
                     "queue_per_request", "peer_per_token", "tie_rel", "tie_abs_s", "speed_band",
                     "pull_min_token_delta", "adapter_load_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.speed_band < 1:
            raise ValueError(f"speed_band must be >= 1, got {self.speed_band!r}")


@dataclass(slots=True)
class Candidate:
    """One live pod as the scorer sees it for one request."""

    pod_id: str
    address: str
    tiers: Sequence[str] = ()  # tier of each predicted-cached block, from block 0
    waiting: int = 0
    running: int = 0
    inflight: int = 0           # this router's requests in flight to the pod
    finished_since_load: int = 0  # of ours, finished after the pod published its load
    recent: float = 0.0         # requests we routed there lately (decayed count)
    free_blocks: int = 0
    published_costs: Mapping[str, float] = field(default_factory=dict)
    pull_costs: Mapping[str, PullCost] = field(default_factory=dict)  # holder -> measured
    burst_blocks: int = 0       # how many of `tiers` come only from the burst prediction
    held_blocks: int = 0        # the prefix the index confirms (what a peer could pull)
    backlog_tokens: float = 0.0  # prompt tokens ahead of it (`--policy sticky`'s queue)
    lendable: bool = True       # may be a pull source (not while cooling down, not vLLM)
    can_pull: bool = True       # may take the pull option (a vLLM pod cannot pull)
    adapter_load_s: float = 0.0  # loading the request's LoRA adapter first (0: resident)
    eligible: bool = True
    excluded_reason: str = ""

    @property
    def queue(self) -> int:
        # The published load is up to a lease renewal old: requests of ours that finished
        # since then are no longer in it.
        published = self.waiting + self.running - self.finished_since_load
        return max(published, self.inflight, 0)


@dataclass(slots=True)
class Score:
    pod_id: str
    address: str
    cached_gpu: int = 0    # tokens
    cached_cpu: int = 0
    cached_disk: int = 0
    waiting: int = 0
    running: int = 0
    queue: int = 0
    recent: float = 0.0
    free_blocks: int = 0
    cost_s: float = math.inf
    queue_s: float = 0.0   # the queue's share of cost_s (the rest: prefill and reloads)
    adapter_load_s: float = 0.0  # a LoRA adapter load's share of cost_s
    from_burst: bool = False  # the burst prediction extended this pod's hit
    eligible: bool = True
    excluded_reason: str = ""
    # The pull option, when cost_s includes it: blocks up to pull_blocks come from pull_from.
    pull_from: str = ""
    pull_address: str = ""
    pull_blocks: int = 0     # the source's prefix: what KvSource.num_blocks says
    pull_tokens: int = 0     # pulled, not prefilled (not in cached_tokens)
    pull_saving_s: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return self.cached_gpu + self.cached_cpu + self.cached_disk


def merge_prediction(index_tiers: Sequence[str], burst_depth: int, limit: int
                     ) -> tuple[list[str], int]:
    """Combine the index's tiers with a burst prediction of `burst_depth` blocks.

    A recently routed request will have prefilled (or promoted) its blocks into the pod's
    pool, so predicted blocks count as GPU. Returns (tiers, blocks added by the prediction),
    both capped at `limit` blocks.
    """
    depth = min(max(len(index_tiers), burst_depth), limit)
    if burst_depth <= 0:
        return list(index_tiers[:depth]), 0
    covered = min(burst_depth, depth)
    tiers = [Medium.GPU] * covered + list(index_tiers[covered:depth])
    return tiers, max(0, covered - min(len(index_tiers), depth))


def _pod_cost(published: Mapping[str, float], key: str, default: float) -> float:
    value = published.get(key)
    if value is None or not math.isfinite(value) or value < 0:
        return default
    return float(value)


def settle_prefill_costs(published: Mapping[str, float], band: float,
                         unmeasured: Sequence[str] = ()) -> dict[str, float]:
    """Pod id -> the prefill s/token to score it with, from the pods' published figures.

    Figures within `band` times of their median become the median; the others stay.
    Pods that published nothing (or nonsense) are left out — they get the configured cost —
    except those named in `unmeasured` (live pods that have not served a prefill yet): while
    peers have measured, they are scored at the peers' median. Otherwise a pod that starts
    without a figure would look slower than every measured peer, never win a cold request,
    and so never measure anything.
    """
    valid = {pod: v for pod, v in published.items() if math.isfinite(v) and v > 0}
    if not valid:
        return {}
    ordered = sorted(valid.values())
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    settled = {pod: median if max(v / median, median / v) <= band else v
               for pod, v in valid.items()}
    for pod in unmeasured:
        settled.setdefault(pod, median)
    return settled


@dataclass(frozen=True, slots=True)
class PullSource:
    """A peer other pods could pull from: a prefix the index confirms there."""

    pod_id: str
    address: str
    blocks: int
    queue: int = 0  # its requests (Candidate.queue): near-tied sources go to the shorter


def pull_sources(cands: Sequence[Candidate], limit: int) -> list[PullSource]:
    """The eligible, lendable pods with index-confirmed blocks (capped at `limit`), the
    deepest first (a pod stops looking at the first that holds no more than it does)."""
    sources = [PullSource(c.pod_id, c.address, min(c.held_blocks, limit), c.queue)
               for c in cands if c.eligible and c.lendable and min(c.held_blocks, limit) > 0]
    sources.sort(key=lambda src: -src.blocks)
    return sources


def pull_cost(c: Candidate, holder: str, costs: CostModel) -> PullCost:
    """What a pull from `holder` costs `c`: as `c` measured it, else at `c`'s single peer
    figure, else at the configured one (those two all-in per token: no fixed part)."""
    measured = c.pull_costs.get(holder)
    if measured is not None:
        return measured
    return PullCost(0.0, _pod_cost(c.published_costs, "peer", costs.peer_per_token))


def pull_crossover(c: Candidate, holder: str, costs: CostModel) -> float:
    """The token delta a pull from `holder` must exceed to beat recomputing those tokens on
    `c` at its prefill speed (inf: never)."""
    prefill = _pod_cost(c.published_costs, "prefill", costs.prefill_per_token)
    return pull_cost(c, holder, costs).crossover_tokens(prefill)


def score_all(cands: Sequence[Candidate], prompt_len: int, block_size: int, costs: CostModel,
              pull: bool = True, by_tokens: bool = False) -> list[Score]:
    """Every candidate's score; with `pull`, each may take the pull option from a source;
    `by_tokens`: the queue is priced as its prompt tokens (`--policy sticky`)."""
    sources = pull_sources(cands, max_hit_blocks(prompt_len, block_size)) if pull else []
    return [score_candidate(c, prompt_len, block_size, costs, sources, by_tokens)
            for c in cands]


def score_candidate(c: Candidate, prompt_len: int, block_size: int, costs: CostModel,
                    sources: Sequence[PullSource] = (), by_tokens: bool = False) -> Score:
    s = Score(c.pod_id, c.address, waiting=c.waiting, running=c.running, queue=c.queue,
              recent=c.recent, free_blocks=c.free_blocks, eligible=c.eligible,
              excluded_reason=c.excluded_reason)
    if not c.eligible:
        return s
    limit = max_hit_blocks(prompt_len, block_size)
    tiers = c.tiers if len(c.tiers) <= limit else c.tiers[:limit]
    if tiers:  # (count() is a C loop: a 100-block prefix costs no Python loop)
        cpu, disk = tiers.count(Medium.CPU), tiers.count(Medium.DISK)
        s.cached_gpu = (len(tiers) - cpu - disk) * block_size
        s.cached_cpu = cpu * block_size
        s.cached_disk = disk * block_size
    s.from_burst = c.burst_blocks > 0
    pub = c.published_costs
    prefill = _pod_cost(pub, "prefill", costs.prefill_per_token)
    uncached = prompt_len - s.cached_tokens
    # Sticky until saturated: the work ahead is also priced as the prompt tokens queued
    # there at the pod's own measured rate, so a warm pod keeps its prefix until its
    # backlog costs more than its cache saves (the saturation gap, in the pod's measured
    # throughput); the per-request figure stays a floor under it, for the work no prompt
    # token counts (decodes, a step's fixed cost: tokens alone piled a hot prefix onto
    # one pod, TTFT p90 4.0x the oracle's at load 1.1 in bench.scale --sweep --quick).
    per_request = c.queue * queue_cost(costs, prefill)
    s.queue_s = max(c.backlog_tokens * prefill, per_request) if by_tokens else per_request
    s.cost_s = (uncached * prefill
                + s.cached_cpu * _pod_cost(pub, Medium.CPU, costs.cpu_per_token)
                + s.cached_disk * _pod_cost(pub, Medium.DISK, costs.disk_per_token)
                + s.queue_s + c.adapter_load_s)
    s.adapter_load_s = c.adapter_load_s
    if c.can_pull and sources:
        _take_pull(s, c, sources, min(len(c.tiers), limit), block_size, prefill, costs)
    return s


def _take_pull(s: Score, c: Candidate, sources: Sequence[PullSource], own: int,
               block_size: int, prefill: float, costs: CostModel) -> None:
    """The pull option from the best of `sources` (other than `c`; the deepest first), if
    any pull beats recomputing: blocks own..source's pulled instead of prefilled.

    (Per request, every pod against every holder: kept to a few operations per pair.)"""
    single = PullCost(0.0, _pod_cost(c.published_costs, "peer", costs.peer_per_token))
    measured = c.pull_costs
    floor = costs.pull_min_token_delta
    base = s.cost_s
    options: list[tuple[float, PullSource, int]] = []  # (cost with the pull, source, tokens)
    for src in sources:
        pulled = (src.blocks - own) * block_size
        if pulled <= 0 or pulled < floor:
            break  # no more to pull from this one, nor from the shallower ones after it
        if src.pod_id == c.pod_id:
            continue
        price = measured.get(src.pod_id, single) if measured else single
        cost = base - pulled * prefill + price.fixed_s + pulled * price.per_token_s
        # Cheaper than recomputing exactly when `pulled` is above the crossover
        # (`pull_crossover`: fixed / (prefill - per_token)).
        if cost < base:
            options.append((cost, src, pulled))
    if not options:
        return
    best = min(option[0] for option in options)
    tolerance = max(costs.tie_abs_s, costs.tie_rel * best)
    cost, src, pulled = min((o for o in options if o[0] <= best + tolerance),
                            key=lambda o: (o[1].queue, o[0], o[1].pod_id))
    s.pull_saving_s = base - cost
    s.cost_s = cost
    s.pull_from, s.pull_address = src.pod_id, src.address
    s.pull_blocks, s.pull_tokens = src.blocks, pulled


def queue_cost(costs: CostModel, pod_prefill: float) -> float:
    """Seconds one queued request adds on a pod: the configured figure holds for a pod as
    fast as the configured prefill cost, and scales with the pod's measured speed (a queued
    request is mostly prefill work, so a pod twice as fast clears it twice as fast)."""
    if costs.prefill_per_token <= 0:
        return costs.queue_per_request
    return costs.queue_per_request * pod_prefill / costs.prefill_per_token


def _load_key(s: Score) -> tuple[int, int, int]:
    # Recent routing share first: a cold prompt placed now brings its siblings later, so
    # spreading by what each pod has been given lately spreads the groups; the queue
    # itself is a snapshot (and partly a stale one).
    return (round(s.recent), s.queue, -s.free_blocks)


def rank(scores: Sequence[Score], costs: CostModel, rotation: int = 0
         ) -> tuple[list[Score], str]:
    """Eligible scores best first, and the reason the first one won.

    `rotation` (a per-router counter) picks among pods tied on cost and load.
    """
    eligible = sorted((s for s in scores if s.eligible),
                      key=lambda s: (s.cost_s, _load_key(s), s.pod_id))
    if not eligible:
        return [], ""
    best = eligible[0].cost_s
    # Relative to the work, not to an adapter load every pod may pay alike: a wide band would
    # rotate a new adapter over every pod, each loading it.
    tolerance = max(costs.tie_abs_s, costs.tie_rel * (best - eligible[0].adapter_load_s))
    tied = [s for s in eligible if s.cost_s <= best + tolerance]
    rest = eligible[len(tied):]
    reason = REASON_COST
    if len(tied) > 1:
        tied.sort(key=lambda s: (_load_key(s), s.pod_id))
        lightest = _load_key(tied[0])
        equal = [s for s in tied if _load_key(s) == lightest]
        reason = REASON_TIE_LOAD
        if len(equal) > 1:
            k = rotation % len(equal)
            equal = equal[k:] + equal[:k]
            reason = REASON_TIE_ROTATE
        tied = equal + tied[len(equal):]
    chosen = tied[0]
    if chosen.cached_tokens > min(s.cached_tokens for s in eligible):
        # Its cached prefix is what set the chosen pod apart.
        reason = REASON_BURST if chosen.from_burst else REASON_PREFIX
    elif chosen.pull_from:
        # Its own prefix is no longer than anyone's: the pull priced it in.
        reason = REASON_PULL
    return tied + rest, reason


def order_least_loaded(scores: Sequence[Score], rotation: int = 0) -> list[Score]:
    """Eligible pods by load only (smaller queue, then freer pool), rotating among equals.

    Used when the index cannot be read: no prefix knowledge, so spread the load.
    """
    eligible = sorted((s for s in scores if s.eligible), key=lambda s: (_load_key(s), s.pod_id))
    if not eligible:
        return []
    lightest = _load_key(eligible[0])
    equal = [s for s in eligible if _load_key(s) == lightest]
    k = rotation % len(equal)
    return equal[k:] + equal[:k] + eligible[len(equal):]


def order_round_robin(scores: Sequence[Score], counter: int) -> list[Score]:
    eligible = sorted((s for s in scores if s.eligible), key=lambda s: s.pod_id)
    if not eligible:
        return []
    k = counter % len(eligible)
    return eligible[k:] + eligible[:k]


def order_random(scores: Sequence[Score], rng: random.Random) -> list[Score]:
    eligible = [s for s in scores if s.eligible]
    rng.shuffle(eligible)
    return eligible
