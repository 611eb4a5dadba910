"""The router's Prometheus metrics, in a registry of their own (`pagekv_router_*`)."""

from __future__ import annotations

import contextlib
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagekv.proto.serving import serve_metrics

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025,
                    0.05, 0.1, 0.25, 1.0)
_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# Signed: predicted minus actual cached tokens (positive = the router was too optimistic).
_ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)
# Predicted over measured TTFT (1 = exact; 1.25 = 25% too pessimistic).
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.87, 0.95, 1.05, 1.15, 1.25, 1.5, 2.0, 4.0)
# The TTFT predictors compared (router/ttft_tracker.py): the model, and the scorer's cost_s
# (the naive baseline).
TTFT_PREDICTORS = ("model", "cost_s")
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.token: str | None = None  # --metrics-token: the page needs it as a bearer token
        r = self.registry
        self.requests = Counter(
            "pagekv_router_requests_total", "Requests forwarded, by pod and routing reason",
            ["pod", "reason"], registry=r)
        self.failures = Counter(
            "pagekv_router_request_failures_total",
            "Requests that ended in an error returned to the client, by gRPC code",
            ["code"], registry=r)
        self.retries = Counter(
            "pagekv_router_retries_total",
            "Calls moved to the next-best pod after the first one was UNAVAILABLE",
            ["pod"], registry=r)
        self.stalls = Counter(
            "pagekv_router_pod_stalls_total",
            "Pod calls abandoned for making no progress within their bound, by pod and phase "
            "(first_chunk: moved to the next-best pod; mid_stream: ended UNAVAILABLE)",
            ["pod", "phase"], registry=r)
        self.cooling_pods = Gauge(
            "pagekv_router_cooling_pods",
            "Pods tried last for now because a call there stalled", registry=r)
        self.pull_hints = Counter(
            "pagekv_router_pull_hints_total",
            "Calls forwarded with a kv_source hint: the pod pulls its prefix from a peer",
            registry=r)
        self.pull_crossover = Gauge(
            "pagekv_router_pull_crossover_tokens",
            "The token delta above which pod pulling from peer beats recomputing, from the "
            "pod's measured pull cost from that peer (+Inf: never); no pull of fewer tokens "
            "than --pull-min-token-delta either", ["pod", "peer"], registry=r)
        # Prefill/decode disaggregation (router/disaggregation.py).
        self.pd_requests = Counter(
            "pagekv_router_pd_requests_total",
            "Requests with prefill pods live, by what the router did (split: prefilled on a "
            "prefill pod, handed over; local: the decode pod computes its own, short or hit; "
            "prefill_busy: long enough, but the prefill pods' queues would delay it longer)",
            ["decision"], registry=r)
        self.pd_fallbacks = Counter(
            "pagekv_router_pd_fallbacks_total",
            "Split requests whose decode pod computed (part of) the prompt itself, by reason "
            "(prefill_unavailable, prefill_stalled, prefill_failed, or the decode pod's pull "
            "fallback: deadline, peer_unavailable, ...)", ["reason"], registry=r)
        self.pd_threshold = Gauge(
            "pagekv_router_pd_threshold_tokens",
            "The uncached prompt length from which a request for this pod is split (its "
            "measured prefill budget, or the configured threshold)", ["pod"], registry=r)
        self.pd_prefill_seconds = Histogram(
            "pagekv_router_pd_prefill_seconds", "Split requests: the prefill pod's call",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), registry=r)
        self.pd_handover_seconds = Histogram(
            "pagekv_router_pd_handover_seconds",
            "Split requests: the decode pod's wait for the prompt's KV (its pull), as it reports",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r)
        self.predicted_tokens = Histogram(
            "pagekv_router_predicted_cached_tokens", "Predicted cached prompt tokens per request",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.actual_tokens = Histogram(
            "pagekv_router_actual_cached_tokens",
            "Cached prompt tokens per request, as reported by the pod's usage",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.prediction_error = Histogram(
            "pagekv_router_cached_tokens_prediction_error_tokens",
            "Predicted minus actual cached tokens per request", buckets=_ERROR_BUCKETS,
            registry=r)
        # The histograms' _sum series are the totals (hit rate = actual _sum / prompt).
        self.prompt_tokens_total = Counter(
            "pagekv_router_prompt_tokens_total", "Prompt tokens of the requests routed",
            registry=r)
        self.lookup_seconds = Histogram(
            "pagekv_router_lookup_seconds", "Redis prefix lookup latency (one round trip)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.overhead_seconds = Histogram(
            "pagekv_router_overhead_seconds",
            "Time spent inside the router per request, excluding the pod call",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.index_errors = Counter(
            "pagekv_router_index_errors_total", "Failed Redis operations, by operation",
            ["op"], registry=r)
        self.reaped_pods = Counter(
            "pagekv_router_reaped_pods_total",
            "Dead pod ids (no lease for --reap-dead-after-s) removed from the index",
            registry=r)
        self.reaped_claims = Counter(
            "pagekv_router_reaped_claims_total",
            "Block claims removed from the index with dead pods", registry=r)
        self.shared_predictions = Counter(
            "pagekv_router_shared_predictions_total",
            "Burst predictions written to the index for the other routers (--shared-bursts), "
            "by result: written, error (Redis failed), dropped (too many writes waiting)",
            ["result"], registry=r)
        self.session_routes = Counter(
            "pagekv_router_session_routes_total",
            "Requests with a session_id, by outcome: kept (its session's pod), moved (that "
            "pod saturated or gone), new (no turn of it seen in --session-idle-s)",
            ["outcome"], registry=r)
        self.fallbacks = Counter(
            "pagekv_router_fallback_routes_total",
            "Requests routed without prefix knowledge, by cause", ["cause"], registry=r)
        self.index_up = Gauge(
            "pagekv_router_index_up", "1 while the Redis index answers, else 0", registry=r)
        self.index_bad_records = Counter(
            "pagekv_router_index_bad_records_total",
            "Records read from the index that did not parse and were skipped (the rest of "
            "the index still used), by reason (proto/index/bad_records.py)", ["reason"],
            registry=r)
        self.live_pods = Gauge(
            "pagekv_router_live_pods", "Live pods in this namespace that the router may use",
            registry=r)
        self.excluded_pods = Gauge(
            "pagekv_router_excluded_pods",
            "Live pods the router refuses: hash configuration mismatch (any namespace)",
            registry=r)
        self.join_refused = Counter(
            "pagekv_router_join_refused_total",
            "Pods refused at join because an auth setting differs from the fleet's, by the "
            "setting (api_token, admin_token, tls, tenants, unreadable)", ["setting"],
            registry=r)
        self.inflight = Gauge(
            "pagekv_router_inflight_requests", "Requests being forwarded right now",
            registry=r)
        self.auth_refused = Counter(
            "pagekv_router_auth_refused_total",
            "Calls refused for a missing or wrong bearer token (--api-token, --admin-token), "
            "by method and gRPC code", ["method", "code"], registry=r)
        self.http_responses = Counter(
            "pagekv_router_http_requests",
            "OpenAI API (HTTP) responses by route and status", ["route", "status"],
            registry=r)

        # The TTFT predictors against the first tokens measured here (router/ttft_tracker.py).
        self.ttft_seconds = Histogram(
            "pagekv_router_ttft_seconds",
            "Time to first token as the router measured it, from sending the call to the "
            "pod's first chunk (unary: its response less its decode steps), by pod",
            ["pod"], buckets=_TTFT_BUCKETS, registry=r)
        self.ttft_mape = Gauge(
            "pagekv_router_ttft_prediction_mape",
            "Mean absolute percentage error of the predicted TTFT over the pod's last 100 "
            "measured calls, a fraction (0.15 = 15%), by predictor (model: the TTFT model; "
            "cost_s: the routing cost, the naive baseline)",
            ["pod", "predictor"], registry=r)
        self.ttft_ratio = Histogram(
            "pagekv_router_ttft_predicted_over_measured",
            "Predicted over measured TTFT per call (1 = exact), by pod and predictor",
            ["pod", "predictor"], buckets=_RATIO_BUCKETS, registry=r)

    def forget_ttft_pod(self, pod: str) -> None:
        """A pod's TTFT series go (the tracker forgot it to bound its memory)."""
        with contextlib.suppress(KeyError):
            self.ttft_seconds.remove(pod)
        for family in (self.ttft_mape, self.ttft_ratio):
            for predictor in TTFT_PREDICTORS:
                with contextlib.suppress(KeyError):
                    family.remove(pod, predictor)

    def count_bad_record(self, reason: str, n: int) -> None:
        self.index_bad_records.labels(reason=reason).inc(n)

    def observe_cached(self, predicted: int, actual: int, prompt_tokens: int) -> None:
        self.predicted_tokens.observe(predicted)
        self.actual_tokens.observe(actual)
        self.prediction_error.observe(predicted - actual)
        self.prompt_tokens_total.inc(prompt_tokens)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Expose /metrics on `port` (0 = not served)."""
        if port:
            self.http = serve_metrics(self.registry, host, port, self.token)
            logger.info("router metrics on http://%s:%d/metrics (%s)", host, port,
                        "bearer token required" if self.token else "open")
