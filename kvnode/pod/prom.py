"""Prometheus export of a pod: the engine's plain-Python statistics, read at scrape time.

The engine thread owns the statistics; a scrape reads them through `Engine.stats()` alone
(one typed `EngineStats`: ints and floats, atomic under the GIL, and copies of small dicts
and histograms), so it never takes a lock on the step loop. Request-level latencies
(TTFT, inter-token, queue time) are real `prometheus_client` histograms observed by the
server when a request finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagekv.kvnode.index.publish_stats import INDEX_COUNTERS, histogram_family
from pagekv.kvnode.memory.metrics import Histogram as PlainHistogram
from pagekv.proto.medium import Medium
from pagekv.proto.pull_cost import FIXED_PREFIX, PER_TOKEN_PREFIX
from pagekv.proto.tier_stats import ChainStats

if TYPE_CHECKING:
    from pagekv.kvnode.engine.engine import Engine
    from pagekv.kvnode.engine.engine_stats import EngineStats, PeerPullStats
    from pagekv.kvnode.engine.lora_adapters import AdapterStats
    from pagekv.kvnode.engine.retention import RetentionStats
    from pagekv.kvnode.engine.tenancy import TenancyStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# The cost map's pod-wide keys (Engine.tier_costs) -> the `kind` label of their gauge; each is
# fitted from served work (recent prefill-heavy steps, the tiers' reload copies, complete pulls).
FITTED_COST_KINDS = {"prefill": "prefill_per_token", Medium.CPU: "dram_per_token",
                     Medium.DISK: "ssd_per_token", "peer": "peer_per_token"}


class EngineCollector(Collector):
    def __init__(self, engine: Engine, labels: dict[str, str],
                 extra: Callable[[], dict] | None = None,
                 publish_lag: Callable[[], PlainHistogram] | None = None):
        self.engine = engine
        self.label_names = list(labels)
        self.label_values = list(labels.values())
        self.extra = extra  # e.g. the index publisher's stats
        self.publish_lag = publish_lag  # its lag histogram (the stats only summarise it)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self.label_names)
        g.add_metric(self.label_values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=self.label_names)
        c.add_metric(self.label_values, value)
        return c

    def _pull_metrics(self, st: PeerPullStats) -> Iterable:
        yield self._counter("pagekv_kv_pulls", "Cross-pod KV pulls finished (any outcome)",
                            st.pulls)
        yield self._counter("pagekv_kv_pulled_blocks", "KV blocks pulled from peers and landed "
                            "in the pool", st.blocks)
        yield self._counter("pagekv_kv_pulled_bytes", "Entry bytes received from peers",
                            st.bytes)
        fallbacks = CounterMetricFamily(
            "pagekv_kv_pull_fallbacks", "Pulls that fell back to recompute (for the rest of "
            "the prefix), by reason", labels=[*self.label_names, "reason"])
        for reason, n in st.fallbacks.items():
            fallbacks.add_metric([*self.label_values, reason], n)
        yield fallbacks

    def _role_metrics(self, st: EngineStats) -> Iterable:
        """The pod's P/D role, and what its prefills hold for decode pods."""
        role = GaugeMetricFamily("pagekv_pod_role", "The pod's prefill/decode role (--role): "
                                 "1 for its role", labels=[*self.label_names, "role"])
        role.add_metric([*self.label_values, st.role], 1)
        yield role
        yield self._gauge("pagekv_handover_held_blocks", "Prompt blocks of finished prefills "
                          "held for a decode pod's pull (P/D)", st.handover.held_blocks)
        ended = CounterMetricFamily("pagekv_handover_holds", "Prefill holds ended, by how "
                                    "(served: pulled in full; expired; evicted: room for newer "
                                    "holds; closed)", labels=[*self.label_names, "outcome"])
        for outcome, n in st.handover.ended.items():
            ended.add_metric([*self.label_values, outcome], n)
        yield ended

    def _cost_metrics(self, st: EngineStats) -> Iterable:
        """The costs this pod publishes to the router, as it fitted them; a figure not
        measured yet has no series."""
        fitted = GaugeMetricFamily(
            "pagekv_pod_fitted_cost_seconds", "Costs fitted from served work, as published to "
            "the router: seconds per token (prefill, reload from DRAM or SSD, a pull) or per "
            "step (decode_step: the median decode-only step)", labels=[*self.label_names, "kind"])
        for key, kind in FITTED_COST_KINDS.items():
            if key in st.costs:
                fitted.add_metric([*self.label_values, kind], st.costs[key])
        if st.decode_step_s is not None:
            fitted.add_metric([*self.label_values, "decode_step"], st.decode_step_s)
        yield fitted
        pull = GaugeMetricFamily(
            "pagekv_pod_fitted_pull_cost_seconds", "A pull from one holder as this pod fitted "
            "it (fixed + tokens x per_token): seconds per pull (fixed) or per token",
            labels=[*self.label_names, "holder", "part"])
        for key, value in st.costs.items():
            if key.startswith(FIXED_PREFIX):
                pull.add_metric([*self.label_values, key[len(FIXED_PREFIX):], "fixed"], value)
            elif key.startswith(PER_TOKEN_PREFIX):
                pull.add_metric([*self.label_values, key[len(PER_TOKEN_PREFIX):], "per_token"],
                                value)
        yield pull

    def collect(self) -> Iterable:
        st = self.engine.stats()
        m = st.prefix_cache
        load = st.load
        yield self._counter("pagekv_prefix_cache_queries_tokens",
                            "Prompt tokens looked up in the prefix cache, at admission",
                            m.queries_tokens)
        hits = CounterMetricFamily(
            "pagekv_prefix_cache_hits_tokens",
            "Prompt tokens served from cache instead of prefill, by tier (GPU=pool, CPU=DRAM, DISK=SSD)",
            labels=[*self.label_names, "tier"],
        )
        for tier, v in m.hits_tokens_by_tier.items():
            hits.add_metric([*self.label_values, tier], v)
        yield hits
        yield self._counter("pagekv_prefix_cache_requests", "Requests admitted", m.requests)
        yield self._gauge("pagekv_kv_cache_usage_ratio", "Fraction of pool blocks in use", st.usage)
        yield self._gauge("pagekv_kv_cache_blocks", "Blocks in the pool", load.num_blocks)
        yield self._gauge("pagekv_kv_cache_free_blocks", "Free blocks (incl. cached ones)",
                          load.free_blocks)
        yield self._gauge("pagekv_num_requests_waiting", "Sequences waiting", load.waiting)
        yield self._gauge("pagekv_num_requests_running", "Sequences running", load.running)
        yield self._counter("pagekv_num_preemptions", "Sequences preempted (recompute)",
                            st.num_preemptions)
        pool_small = m.pool_too_small
        yield self._gauge("pagekv_kv_pool_too_small",
                          "1 when P90 reuse gap > P50 idle-before-evict (reuses arrive too late)",
                          float(pool_small) if pool_small is not None else 0.0)
        for name, doc, h in (
            ("pagekv_kv_block_lifetime_seconds", "Block allocation to eviction (sampled)",
             m.block_lifetime_seconds),
            ("pagekv_kv_block_idle_before_evict_seconds", "Block last free to eviction (sampled)",
             m.block_idle_before_evict_seconds),
            ("pagekv_kv_block_reuse_gap_seconds", "Block last free to prefix hit (sampled)",
             m.block_reuse_gap_seconds),
        ):
            yield histogram_family(name, doc, h, self.label_names, self.label_values)
        if st.chain is not None:
            yield from self._tier_metrics(st.chain)
        if st.peer_pull is not None:
            yield from self._pull_metrics(st.peer_pull)
        yield from self._role_metrics(st)
        yield from self._cost_metrics(st)
        if st.retention is not None:
            yield from self._retention_metrics(st.retention)
        if st.tenancy is not None:
            yield from self._tenancy_metrics(st.tenancy)
        if st.adapters is not None and st.adapters.known:
            yield from self._adapter_metrics(st.adapters)
        if self.publish_lag is not None:
            yield histogram_family("pagekv_index_publish_lag_seconds",
                                   "Index publisher: submit to visible in Redis, per batch",
                                   self.publish_lag(), self.label_names, self.label_values)
        if self.extra is not None:
            for key, value in self.extra().items():
                if key.startswith("publish_lag_"):
                    continue  # summary figures of the histogram above
                if isinstance(value, bool):  # connected, superseded: health as 0/1
                    yield self._gauge(f"pagekv_index_{key}", f"Index publisher: {key}", value)
                elif key in INDEX_COUNTERS:
                    yield self._counter(f"pagekv_index_{key}", f"Index publisher: {key}", value)
                elif isinstance(value, (int, float)):
                    yield self._gauge(f"pagekv_index_{key}", f"Index publisher: {key}", value)

    def _retention_metrics(self, st: RetentionStats) -> Iterable:
        """Pins and sessions (kvnode/engine/retention.py): labels are the three tiers only."""
        yield self._gauge("pagekv_pod_retained_marks", "Block hashes pinned or kept for an "
                          "idle session, their time running", st.marks)
        by_tier = [
            ("pagekv_pod_retained_blocks", GaugeMetricFamily, "Retained blocks held in the "
             "tier now", {str(m): v for m, v in st.resident.items()}),
            ("pagekv_pod_retained_cap_blocks", GaugeMetricFamily, "Most retained blocks the "
             "tier keeps from eviction (--retained-*-bytes)",
             {str(m): v for m, v in st.cap_blocks.items()}),
            ("pagekv_pod_retained_spared", CounterMetricFamily, "Retained blocks an eviction "
             "passed over", st.spared),
            ("pagekv_pod_retained_yielded", CounterMetricFamily, "Retained blocks evicted all "
             "the same (over the tier's cap, or nothing else to evict: a pin never refuses a "
             "request)", st.yielded),
        ]
        for name, family, doc, values in by_tier:
            metric = family(name, doc, labels=[*self.label_names, "tier"])
            for tier in ("GPU", "CPU", "DISK"):
                metric.add_metric([*self.label_values, tier], values.get(tier, 0))
            yield metric
        yield self._counter("pagekv_pod_retained_refused", "Marks refused: the pod's table "
                            "of retained blocks was full", st.refused)

    def _tenancy_metrics(self, st: TenancyStats) -> Iterable:
        """Per tenant and tier (kvnode/engine/tenancy.py: the tenant labels are bounded)."""
        labels = [*self.label_names, "tenant", "tier"]
        for name, family, doc, values, scale in (
            ("pagekv_pod_tenant_cached_bytes", GaugeMetricFamily, "Bytes of the tenant's cached "
             "blocks in the tier now (_shared: the shared region; _none: no tenant)",
             st.held_blocks, st.block_bytes),
            ("pagekv_pod_tenant_quota_bytes", GaugeMetricFamily, "The tenant's quota in the "
             "tier (the tenants file's, in whole blocks)", st.quota_blocks, st.block_bytes),
            ("pagekv_pod_tenant_quota_evictions", CounterMetricFamily, "Blocks of the tenant "
             "evicted for being over its quota in the tier (its own, never another's)",
             st.evicted, 1),
        ):
            metric = family(name, doc, labels=labels)
            for (tenant, medium), value in sorted(values.items()):
                metric.add_metric([*self.label_values, tenant, str(medium)], value * scale)
            yield metric

    def _adapter_metrics(self, st: AdapterStats) -> Iterable:
        """LoRA adapters (kvnode/engine/lora_adapters.py): per-adapter labels are bounded."""
        yield self._gauge("pagekv_pod_lora_adapters_known", "LoRA adapters this pod serves",
                          st.known)
        yield self._gauge("pagekv_pod_lora_adapters_resident", "LoRA adapters in its slots "
                          "now (--max-loras)", len(st.resident))
        yield self._counter("pagekv_pod_lora_loads", "Adapter loads into a slot", st.loads)
        yield self._counter("pagekv_pod_lora_evictions", "Adapters evicted from a slot "
                            "(least recently used)", st.evictions)
        yield self._counter("pagekv_pod_lora_load_failures", "Adapter loads that failed",
                            st.load_failures)
        yield self._counter("pagekv_pod_lora_load_seconds", "Seconds spent loading adapters",
                            st.load_seconds_total)
        labels = [*self.label_names, "adapter"]
        for name, doc, values in (
            ("pagekv_pod_lora_requests", "Finished requests per adapter", st.requests),
            ("pagekv_pod_lora_prompt_tokens", "Their prompt tokens", st.prompt_tokens),
            ("pagekv_pod_lora_cached_tokens", "Of them, prefix-cache hits", st.cached_tokens),
        ):
            metric = CounterMetricFamily(name, doc, labels=labels)
            for adapter, value in sorted(values.items()):
                metric.add_metric([*self.label_values, adapter], value)
            yield metric

    def _tier_metrics(self, chain: ChainStats) -> Iterable:
        """The tiers below the pool, one series per medium or direction, read off the chain's
        record field by field (the metric name is `pagekv_tier_<field>`)."""
        labels = [*self.label_names, "tier"]
        tiers = chain.tiers.values()
        for key, family, doc in (
            ("used_bytes", GaugeMetricFamily, "Bytes held by the tier"),
            ("capacity_bytes", GaugeMetricFamily, "Byte budget of the tier"),
            ("entries", GaugeMetricFamily, "Blocks held by the tier"),
            ("hits_tokens", CounterMetricFamily, "Prefix tokens found in the tier"),
            ("queries_tokens", CounterMetricFamily, "Prefix tokens looked up in the tier"),
        ):
            fam = family(f"pagekv_tier_{key}", doc, labels=labels)
            for t in tiers:
                fam.add_metric([*self.label_values, t.medium], getattr(t, key))
            yield fam
        dir_labels = [*self.label_names, "direction"]
        moved_b = CounterMetricFamily("pagekv_tier_moved_bytes", "Bytes moved between tiers",
                                      labels=dir_labels)
        moved_s = CounterMetricFamily("pagekv_tier_moved_seconds",
                                      "Seconds spent moving blocks between tiers", labels=dir_labels)
        for move in chain.moves:
            moved_b.add_metric([*self.label_values, move.name], move.bytes)
            moved_s.add_metric([*self.label_values, move.name], move.seconds)
        yield moved_b
        yield moved_s
        yield self._counter("pagekv_tier_orphans_dropped", "Unreachable descendants dropped",
                            chain.orphans_dropped)
        yield self._counter("pagekv_tier_checksum_failures", "SSD entries failing their checksum",
                            chain.checksum_failures)


class RequestMetricsExporter:
    """Per-request histograms, observed when a request finishes."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        names = list(labels)
        self.labels = labels
        self.ttft = Histogram("pagekv_time_to_first_token_seconds", "Arrival to first token",
                              names, registry=registry, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("pagekv_inter_token_latency_seconds", "Between output tokens",
                             names, registry=registry, buckets=ITL_BUCKETS)
        self.queue = Histogram("pagekv_request_queue_time_seconds", "Arrival to first schedule",
                               names, registry=registry, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("pagekv_request_latency_seconds", "Arrival to finish",
                             names, registry=registry, buckets=LATENCY_BUCKETS)
        self.requests = Counter("pagekv_requests", "Finished requests by finish reason",
                                [*names, "finish_reason"], registry=registry)
        self.cached = Counter("pagekv_request_cached_tokens",
                              "Prompt tokens served from cache, by tier", [*names, "tier"],
                              registry=registry)

    def observe(self, output) -> None:
        lv = self.labels
        m = output.metrics
        if m is not None:
            if m.time_to_first_token is not None:
                self.ttft.labels(**lv).observe(m.time_to_first_token)
            if m.queue_time is not None:
                self.queue.labels(**lv).observe(m.queue_time)
            for gap in m.inter_token_latencies:
                self.itl.labels(**lv).observe(gap)
            if m.finished_time is not None:
                self.e2e.labels(**lv).observe(m.finished_time - m.arrival_time)
        reason = output.outputs[0].finish_reason if output.outputs else None
        self.requests.labels(**lv, finish_reason=reason or "unknown").inc()
        for tier, n in output.cached_tokens_by_tier.items():
            if n:
                self.cached.labels(**lv, tier=tier).inc(n)
