"""`pagekv ingest-vllm`: write one vLLM pod's KV events into the Redis index (the ingester is
vllm_ingest.py), with its metrics on --metrics-port. No torch: it runs on a router's host as
well as next to the vLLM pod.

On the vLLM side: `vllm serve MODEL --kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
"topic": "kv-events"}'` (README "Routing an existing vLLM fleet").
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagekv.kvnode.index.publish_stats import INDEX_COUNTERS, histogram_family
from pagekv.kvnode.index.vllm_ingest import IngestConfig, VllmIngester
from pagekv.proto.credentials import (
    add_metrics_token_argument,
    add_redis_arguments,
    add_tls_arguments,
    metrics_token_from,
    redis_url_from,
    tls_from,
)
from pagekv.proto.hashing import DEFAULT_HASH_SEED, HASH_ALGOS
from pagekv.proto.serving import serve_metrics
from pagekv.proto.vllm_chain import REFUSAL_REASONS

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = IngestConfig("", "", "", "", 0, "")
    g = p.add_argument_group("the vLLM pod's KV events (its --kv-events-config)")
    g.add_argument("--zmq-endpoint", required=True, metavar="tcp://HOST:PORT",
                   help="its publisher (`endpoint`, e.g. tcp://vllm-0:5557)")
    g.add_argument("--replay-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="its replay socket (`replay_endpoint`); without one, a missed batch "
                        "clears the pod's claims until fresh events arrive")
    g.add_argument("--topic", default=d.topic, help="its `topic`")
    g.add_argument("--replay-timeout-s", type=float, default=d.replay_timeout_s,
                   help="how long a replay may take before the missed batches count as gone")
    g.add_argument("--flush-interval-s", type=float, default=d.flush_interval_s,
                   help="batches arriving within this long are applied and written to the "
                        "index together (the index lag is at most about this much)")
    g = p.add_argument_group("the pod in the index")
    g.add_argument("--pod-id", required=True, help="its id in the index (one per vLLM pod)")
    g.add_argument("--openai-address", required=True, metavar="HOST:PORT",
                   help="its OpenAI server, as the router should reach it (https://HOST:PORT "
                        "for one served over TLS: see --vllm-tls-*)")
    g.add_argument("--lease-ttl-s", type=float, default=d.lease_ttl_s,
                   help="the pod's lease in the index, renewed every third of it: how long "
                        "its claims outlive a dead ingester")
    g.add_argument("--health-interval-s", type=float, default=d.health_interval_s,
                   help="how often to ask the OpenAI server's /health; while it fails the pod "
                        "is kept out of the index (0: never ask)")
    g.add_argument("--health-failures", type=int, default=d.health_failures,
                   help="failed /health answers in a row that take the pod out")
    g.add_argument("--load-from-metrics", action=argparse.BooleanOptionalAction,
                   default=d.load_from_metrics,
                   help="with each health check, read the pod's queue (waiting, running, "
                        "free KV blocks) from its /metrics and publish it with the lease, "
                        "for the router's load scoring")
    g.add_argument("--max-blocks", type=int, default=d.max_blocks,
                   help="blocks indexed for the pod at most (GPU and offloaded tiers)")
    g.add_argument("--recent-blocks", type=int, default=d.recent_blocks,
                   help="blocks it no longer holds whose full hash is remembered (a child "
                        "stored later needs its parent's)")
    add_redis_arguments(p, None)
    add_tls_arguments(p, "vllm-tls", "TLS to the pod's OpenAI server (an https:// "
                      "--openai-address), for the /health probe, as the router's --vllm-tls-*",
                      "CA the pod's certificate must be signed by (default: the system's CAs); "
                      "--vllm-tls-cert/--vllm-tls-key: the ingester's client certificate, for a "
                      "vLLM started with --ssl-cert-reqs 2")
    g = p.add_argument_group("hashing (the vLLM pod's; the router refuses a mismatch)")
    g.add_argument("--model", required=True,
                   help="the model name, as the router and PageKV pods are given it")
    g.add_argument("--block-size", type=int, required=True, help="vLLM's --block-size")
    g.add_argument("--hash-algo", default=d.hash_algo, choices=HASH_ALGOS,
                   help="vLLM's --prefix-caching-hash-algo")
    g.add_argument("--hash-seed", default=DEFAULT_HASH_SEED,
                   help="the seed of the chain's root (vLLM's fixed default for sha256, or "
                        "its PYTHONHASHSEED)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    add_metrics_token_argument(p)


def config_from(args: argparse.Namespace) -> IngestConfig:
    redis_url = redis_url_from(args)
    if not redis_url:
        raise ValueError("--redis-url (or $PAGEKV_REDIS_URL) is required")
    return IngestConfig(
        zmq_endpoint=args.zmq_endpoint, replay_endpoint=args.replay_endpoint, topic=args.topic,
        pod_id=args.pod_id, openai_address=args.openai_address, model=args.model,
        block_size=args.block_size, redis_url=redis_url, hash_algo=args.hash_algo,
        hash_seed=args.hash_seed, lease_ttl_s=args.lease_ttl_s,
        replay_timeout_s=args.replay_timeout_s, max_blocks=args.max_blocks,
        flush_interval_s=args.flush_interval_s,
        recent_blocks=args.recent_blocks, redis_tls=tls_from(args, "redis"),
        openai_tls=tls_from(args, "vllm-tls"),
        health_interval_s=args.health_interval_s, health_failures=args.health_failures,
        load_from_metrics=args.load_from_metrics)


class IngestCollector(Collector):
    """The ingester's counters (pagekv_ingest_*) and its index publisher's (pagekv_index_*),
    read at scrape time."""

    def __init__(self, ingester: VllmIngester) -> None:
        self.ingester = ingester
        self.labels = {"pod": ingester.config.pod_id}

    def _one(self, family: type, name: str, doc: str, value: float):
        fam = family(name, doc, labels=list(self.labels))
        fam.add_metric(list(self.labels.values()), value)
        return fam

    def _by(self, name: str, doc: str, label: str, values: dict[str, float]):
        fam = CounterMetricFamily(name, doc, labels=[*self.labels, label])
        for key, value in values.items():
            fam.add_metric([*self.labels.values(), key], value)
        return fam

    def collect(self) -> Iterable:
        ing = self.ingester
        c, book = ing.counters, ing.book
        names, values = list(self.labels), list(self.labels.values())
        yield self._one(CounterMetricFamily, "pagekv_ingest_batches",
                        "Event batches read from the vLLM pod and applied", c.batches)
        yield self._by("pagekv_ingest_events", "Events read, by vLLM event type", "type",
                       {t: c.events.get(t, 0) for t in
                        ("BlockStored", "BlockRemoved", "AllBlocksCleared")})
        yield self._by("pagekv_ingest_blocks", "Blocks stored and removed in the index",
                       "op", {"stored": book.blocks_stored, "removed": book.blocks_removed})
        yield self._by("pagekv_ingest_refused_events",
                       "Events (or blocks of a tokenless store) not indexed, by reason",
                       "reason", {r: book.refused.get(r, 0) for r in REFUSAL_REASONS})
        yield self._one(CounterMetricFamily, "pagekv_ingest_ignored_removals",
                        "Removals of blocks never indexed (e.g. refused ones)",
                        book.ignored_removals)
        yield self._one(CounterMetricFamily, "pagekv_ingest_garbage_frames",
                        "Messages or payloads that could not be read, skipped", c.garbage)
        yield self._one(CounterMetricFamily, "pagekv_ingest_gaps",
                        "Sequence gaps (batches missed on the live stream)", c.gaps)
        yield self._by("pagekv_ingest_replays", "Replay requests, by outcome", "result",
                       {r: c.replays.get(r, 0) for r in ("ok", "partial", "failed")})
        yield self._one(CounterMetricFamily, "pagekv_ingest_resets",
                        "Publisher restarts seen (the sequence went back)", c.resets)
        yield self._one(CounterMetricFamily, "pagekv_ingest_duplicates",
                        "Live copies of batches already replayed, skipped", c.duplicates)
        yield self._one(CounterMetricFamily, "pagekv_ingest_clears",
                        "Times the pod's claims were cleared (lost batches, restarts)",
                        c.clears)
        yield self._one(GaugeMetricFamily, "pagekv_ingest_last_seq",
                        "Sequence number of the last batch applied", c.last_seq)
        yield self._one(GaugeMetricFamily, "pagekv_ingest_indexed_blocks",
                        "Blocks the pod holds, as indexed", len(book))
        yield histogram_family("pagekv_ingest_lag_seconds",
                                "The batch's timestamp at the vLLM pod to its events queued "
                                "for the index", c.lag, names, values)
        yield self._one(GaugeMetricFamily, "pagekv_ingest_pod_up",
                        "1 while the pod answers /health (and is in the index)",
                        ing.health is None or ing.health.up)
        load = GaugeMetricFamily("pagekv_ingest_pod_load",
                                 "The pod's queue as read from its /metrics and published "
                                 "with its lease", labels=[*names, "field"])
        for field_name, value in ing.published_load().items():
            load.add_metric([*values, field_name], value)
        yield load
        pub = ing.publisher
        yield histogram_family("pagekv_index_publish_lag_seconds",
                                "Index publisher: submit to visible in Redis, per batch",
                                pub.lag_histogram, names, values)
        for key, value in pub.stats().items():
            if key.startswith("publish_lag_") or not isinstance(value, (int, float)):
                continue
            family = CounterMetricFamily if key in INDEX_COUNTERS else GaugeMetricFamily
            yield self._one(family, f"pagekv_index_{key}", f"Index publisher: {key}", value)


# The book holds a few hundred thousand small long-lived objects and every block stored makes
# a few more: at Python's default thresholds the cyclic GC took ~20% of the per-block CPU
# (none of them form cycles). Fewer, larger young collections: 1.9 instead of 2.3 us a block.
_GC_THRESHOLDS = (50_000, 20, 100)


def main(args: argparse.Namespace) -> int:
    gc.set_threshold(*_GC_THRESHOLDS)
    ingester = VllmIngester(config_from(args))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    metrics = None
    if args.metrics_port is not None:
        registry = CollectorRegistry()
        registry.register(IngestCollector(ingester))
        metrics = serve_metrics(registry, args.metrics_host, args.metrics_port,
                                metrics_token_from(args))
        logger.info("metrics on http://%s:%d/metrics", args.metrics_host, metrics.server_port)
    if not ingester.start():
        logger.warning("Redis index unreachable; ingesting anyway, will retry")
    stop.wait()
    logger.info("shutting down: removing the pod's claims")
    ingester.stop(clear=True)
    if metrics is not None:
        metrics.shutdown()
    return 0
