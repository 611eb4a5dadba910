"""KV cache metrics collected as plain Python objects.

The server exports them through `prometheus_client` with `pagekv_` names; keeping the
collection free of any exporter keeps the block pool importable (and fast) anywhere.

Block-lifecycle histograms (sampled, rate configurable):
- lifetime: allocation → eviction of a block;
- idle before evict: last free → eviction (how long a cached block waited in vain);
- reuse gap: last free → prefix hit that revived it.
If the typical reuse gap is longer than the typical idle time before eviction, blocks are
evicted before their reuse arrives: the pool is too small for the workload.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from dataclasses import dataclass, field

from pagekv.proto.medium import MEDIUMS, Medium

# Seconds; spans a hot decode loop (ms) to a long idle conversation (minutes).
LIFECYCLE_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0,
)


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram plus a bounded window of raw samples for quantiles."""

    buckets: tuple[float, ...] = LIFECYCLE_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0
    window: deque[float] = field(default_factory=lambda: deque(maxlen=4096))

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)  # last slot: +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1
        self.window.append(value)

    def quantile(self, q: float) -> float | None:
        if not self.window:
            return None
        ordered = sorted(self.window)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def buckets_copy(self) -> Histogram:
        """The buckets as they are now, for a reader on another thread (the window of raw
        samples is left behind)."""
        return Histogram(self.buckets, list(self.counts), self.total, self.count)


class KVCacheMetrics:
    """Prefix-cache and block-lifecycle statistics of one pool."""

    def __init__(self, sample_rate: float = 0.01, seed: int = 0) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self._rng = random.Random(seed)
        self.prefix_requests = 0
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        # Hits by tier (pool, DRAM, SSD), filled by the manager.
        self.prefix_hits_tokens_by_tier: dict[Medium, int] = dict.fromkeys(MEDIUMS, 0)
        self.block_lifetime_seconds = Histogram()
        self.block_idle_before_evict_seconds = Histogram()
        self.block_reuse_gap_seconds = Histogram()

    def record_admission(self, num_tokens: int, hits_by_tier: dict[Medium, int]) -> None:
        self.prefix_requests += 1
        self.prefix_queries_tokens += num_tokens
        for tier, hits in hits_by_tier.items():
            self.prefix_hits_tokens += hits
            self.prefix_hits_tokens_by_tier[tier] = self.prefix_hits_tokens_by_tier.get(tier, 0) + hits

    # Called per evicted or revived block: the sampling test is written out in each (no call).
    def observe_eviction(self, lifetime_s: float, idle_s: float) -> None:
        if self.sample_rate >= 1.0 or self._rng.random() < self.sample_rate:
            self.block_lifetime_seconds.observe(lifetime_s)
            self.block_idle_before_evict_seconds.observe(idle_s)

    def observe_reuse(self, gap_s: float) -> None:
        if self.sample_rate >= 1.0 or self._rng.random() < self.sample_rate:
            self.block_reuse_gap_seconds.observe(gap_s)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    def pool_too_small(self) -> bool | None:
        """P90 reuse gap above P50 idle-before-evict: reuses arrive after their blocks are gone.

        None until both histograms have samples.
        """
        p90_gap = self.block_reuse_gap_seconds.quantile(0.9)
        p50_idle = self.block_idle_before_evict_seconds.quantile(0.5)
        if p90_gap is None or p50_idle is None:
            return None
        return p90_gap > p50_idle
