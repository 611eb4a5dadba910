"""The index publisher's counters and its publish lag (submit -> visible in Redis).

Plain numbers owned by the publisher thread; `stats()` of the publisher reads them, as does
Prometheus through it (kvnode.pod.prom, the ingester's page): `INDEX_COUNTERS` names the
monotonic ones and `histogram_family` turns a plain histogram into Prometheus's form.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prometheus_client.core import HistogramMetricFamily

from pagekv.kvnode.memory.metrics import Histogram

# Seconds from a batch's first event to its visibility in Redis (normally a few ms).
LAG_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

# Monotonic index-publisher statistics (exported as counters; the rest are gauges).
INDEX_COUNTERS = frozenset({
    "events_submitted", "events_published", "events_dropped", "batches", "errors",
    "reconnects", "republishes", "lease_renewals",
})


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@dataclass(slots=True)
class PublishLag:
    """Lag of each published batch (its oldest event's wait): last, max, mean over all,
    and quantiles over the most recent `keep` batches; `histogram` is what Prometheus gets."""

    keep: int = 10_000
    last: float = 0.0
    max: float = 0.0
    total: float = 0.0
    count: int = 0
    recent: deque[float] = field(init=False)
    histogram: Histogram = field(default_factory=lambda: Histogram(LAG_BUCKETS))

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.keep)

    def record(self, lag_s: float) -> None:
        self.last = lag_s
        self.max = max(self.max, lag_s)
        self.total += lag_s
        self.count += 1
        self.recent.append(lag_s)
        self.histogram.observe(lag_s)

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.recent)
        return {
            "publish_lag_last_s": self.last,
            "publish_lag_max_s": self.max,
            "publish_lag_mean_s": self.total / self.count if self.count else 0.0,
            "publish_lag_p50_s": _quantile(ordered, 0.5),
            "publish_lag_p99_s": _quantile(ordered, 0.99),
        }


@dataclass(slots=True)
class PublishCounters:
    """Monotonic counts (exported as Prometheus counters)."""

    events_published: int = 0
    batches: int = 0
    errors: int = 0
    reconnects: int = 0
    republishes: int = 0
    lease_renewals: int = 0
    lag: PublishLag = field(default_factory=PublishLag)

    def as_dict(self) -> dict[str, float]:
        """The counts and the lag summary, as the publisher's stats() reports them."""
        return {
            "events_published": self.events_published,
            "batches": self.batches,
            "errors": self.errors,
            "reconnects": self.reconnects,
            "republishes": self.republishes,
            "lease_renewals": self.lease_renewals,
            **self.lag.summary(),
        }

    def published(self, events: int, lag_s: float) -> None:
        """One batch of `events` is visible, `lag_s` after its first event was submitted."""
        self.events_published += events
        self.batches += 1
        self.lag.record(lag_s)


def histogram_family(name: str, doc: str, h: Histogram, label_names: list[str],
                     label_values: list[str]) -> HistogramMetricFamily:
    """A plain histogram as Prometheus's cumulative buckets (the pod's and the ingester's pages)."""
    cumulative = []
    running = 0
    for bound, count in zip(h.buckets, h.counts, strict=False):
        running += count
        cumulative.append((repr(float(bound)), running))
    cumulative.append(("+Inf", running + h.counts[-1]))
    fam = HistogramMetricFamily(name, doc, labels=label_names)
    fam.add_metric(label_values, cumulative, h.total)
    return fam
