"""The routing decision for one request: tokens, hash chain, one index lookup, scores.

Transport-free (no gRPC server here), so the decision can be tested and benchmarked alone.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagekv.proto.auth_profile import AuthProfile
from pagekv.proto.hashing import HashConfig, RequestBlockHasher, lora_key, max_hit_blocks
from pagekv.proto.index import REDIS_ERRORS, IndexClient, IndexSchema, PodMatch, bucket_of
from pagekv.proto.index.bad_records import BadRecords
from pagekv.proto.index.connect import is_cluster
from pagekv.proto.index.schema import POD_KIND_VLLM
from pagekv.proto.pagekv.v1 import pagekv_pb2
from pagekv.proto.requests import NoSuchAdapter, parse_prompt
from pagekv.proto.shared_prefix import SharedPrefixes
from pagekv.router.burst import BurstTracker
from pagekv.router.config import PREFIX_POLICIES, RouterConfig
from pagekv.router.disaggregation import SplitPlan, plan_split, serving_pods
from pagekv.router.fleet_view import FleetView
from pagekv.router.metrics import RouterMetrics
from pagekv.router.placement import BAND_QUEUE_REL, BAND_QUEUE_SLACK, is_cold, place_cold
from pagekv.router.pods import PodEntry, PodRegistry
from pagekv.router.pull_crossovers import PullCrossovers
from pagekv.router.recent_pairs import RecentPairs
from pagekv.router.scoring import (
    REASON_COLD_SPREAD,
    REASON_COOLDOWN,
    REASON_FALLBACK,
    REASON_RANDOM,
    REASON_ROUND_ROBIN,
    REASON_SESSION,
    Candidate,
    Score,
    merge_prediction,
    order_least_loaded,
    order_random,
    order_round_robin,
    rank,
    score_all,
)
from pagekv.router.sessions import KEPT, MOVED, NEW, SessionAffinity
from pagekv.router.shared_bursts import SharedBursts
from pagekv.router.tokenize import PromptTokenizer

logger = logging.getLogger(__name__)

_BUCKET_RETRY_S = 1.0  # a cluster bucket whose lookup failed is read again after this


@dataclass(slots=True)
class Prepared:
    """A request made ready to forward: token ids in place of text, its block hashes."""

    forward: pagekv_pb2.GenerateRequest
    token_ids: Sequence[int]   # forward's own ids: no second copy held for the whole call
    block_hashes: list[bytes]  # every full block of the prompt (what the pod will cache)
    lookup_blocks: int         # the blocks that can hit: (len - 1) // block_size
    # pod -> the prompt tokens it would compute (neither cached nor pulled), by decide
    uncached: dict[str, int] = field(default_factory=dict)
    session: tuple[str, str] | None = None  # (cache salt, session_id): router/sessions.py
    lora_name: str | None = None  # its LoRA adapter (pods that do not serve it are left out)


@dataclass(slots=True)
class Decision:
    order: list[Score]          # pods to try, best first
    reason: str
    scores: list[Score]         # every pod considered, for RoutingInfo.candidates
    prompt_blocks: int
    lookup_ms: float
    predicted: dict[str, int] = field(default_factory=dict)  # pod -> predicted cached tokens
    held: dict[str, int] = field(default_factory=dict)  # pod -> blocks the index confirms
    split: SplitPlan | None = None  # P/D: prefill on one of these pods first, then hand over
    pd_threshold: int = 0  # the threshold order[0]'s split was decided at (0: none considered)

    def routing_info(self, chosen: Score, reason: str | None = None,
                     pulled: bool = True) -> pagekv_pb2.RoutingInfo:
        """`pulled`: the chosen pod was sent its pull option (a retry may drop it)."""
        info = pagekv_pb2.RoutingInfo(
            chosen_pod=chosen.pod_id, chosen_address=chosen.address,
            reason=reason or self.reason, predicted_cached_tokens=chosen.cached_tokens,
            prompt_blocks=self.prompt_blocks, lookup_ms=self.lookup_ms)
        if pulled and chosen.pull_from:
            info.pull_from, info.pull_tokens = chosen.pull_from, chosen.pull_tokens
            info.predicted_pull_saving_s = chosen.pull_saving_s
        for s in self.scores:
            info.candidates.add(
                pod_id=s.pod_id, address=s.address, cached_tokens=s.cached_tokens,
                cached_tokens_gpu=s.cached_gpu, cached_tokens_cpu=s.cached_cpu,
                cached_tokens_disk=s.cached_disk, queue_waiting=s.waiting,
                queue_running=s.running,
                estimated_cost_s=s.cost_s if s.eligible and s.cost_s != float("inf") else 0.0,
                eligible=s.eligible, excluded_reason=s.excluded_reason,
                pull_from=s.pull_from, pull_tokens=s.pull_tokens, pull_saving_s=s.pull_saving_s)
        return info


ADAPTER_PREDICT_S = 5.0  # a few lease renewals: the pod's own report has arrived by then


class Router:
    def __init__(self, config: RouterConfig, redis_client: Any, tokenizer: PromptTokenizer,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.schema = IndexSchema(config.model, config.block_size, config.hash_algo,
                                  config.hash_seed, prefix=config.index_prefix)
        self.hash_config = HashConfig(config.hash_algo, config.hash_seed)
        # redis_client: redis.asyncio, its pool `redis_max_connections` (connect_async)
        self.index = IndexClient(
            redis_client, self.schema, BadRecords(metrics.count_bad_record),
            config.redis_max_connections, config.pool_wait_s())
        self.registry = PodRegistry(self.index, metrics,
                                    config.refresh_interval_s, config.namespace_check_interval_s,
                                    config.reap_dead_after_s, pod_tls=config.pod_tls,
                                    pod_token=config.pod_api_token, vllm_tls=config.vllm_tls,
                                    keepalive=(config.pod_keepalive_s,
                                               config.pod_keepalive_timeout_s))
        metrics.cooling_pods.set_function(self.registry.cooling)
        self.burst = BurstTracker(config.burst_ttl_s)
        self.crossovers = PullCrossovers(metrics.pull_crossover, config.refresh_interval_s)
        self.shared = SharedBursts(self.index, config.burst_ttl_s, metrics) \
            if config.shared_bursts and config.burst_ttl_s > 0 else None
        self.view = FleetView(config.costs)
        self.sessions = SessionAffinity(config.session_idle_s, config.session_max_waiting)
        # An adapter just sent to a pod is loading or loaded there, before its registration
        # says so (renewed with the lease): predicted resident for a while.
        self._adapter_sent = RecentPairs(ADAPTER_PREDICT_S)
        # The tenants file's shared region, hashed without the tenant's salt as pods do.
        self.shared_prefixes = SharedPrefixes.of(
            config.tenants.shared if config.tenants is not None else None, tokenizer.encode,
            config.block_size)
        self._view_of: dict[str, PodEntry] | None = None  # the registry pods it was made of
        self._view_len = 0
        self._view_foreign: object = None
        self.registry.listeners.append(self._fleet)
        self._sharded = is_cluster(redis_client)
        self._bucket_down_until: dict[int, float] = {}  # bucket -> monotonic time
        self._counter = 0
        self._rng = random.Random(config.random_seed)
        self.registry.fleet_auth = AuthProfile.of_fleet(config.pod_api_token, config.pod_tls,
                                                        config.tenants)

    # -- request preparation ---------------------------------------------------------------
    def prepare(self, request: pagekv_pb2.GenerateRequest) -> Prepared:
        """Tokens and block hashes, read as a pod reads them (BadRequest in its words)."""
        prompt = parse_prompt(request, self.tokenizer.encode, self.config.prompt_limits)
        forward = pagekv_pb2.GenerateRequest()
        forward.CopyFrom(request)
        forward.ClearField("handover")  # the router's to set (a prefill half), no client's
        if prompt.kind == "text":
            forward.token_ids.ids.extend(prompt.token_ids)  # setting the oneof clears `text`
        ids = prompt.token_ids[:]  # (a slice copies a protobuf field in C: 1.5x list())
        hashes: list[bytes] = []
        shared = self.shared_prefixes.blocks(ids) if self.shared_prefixes is not None else 0
        lora = None
        aware = self.config.adapter_routing
        if prompt.lora_id is not None and aware:  # hashed with the path its pods publish
            lora = lora_key(prompt.lora_id, self._adapter_path(prompt.lora_id))
        RequestBlockHasher(self.hash_config, self.config.block_size, prompt.cache_salt,
                           lora, (), shared).extend(ids, hashes)
        lookup = min(len(hashes), max_hit_blocks(len(ids), self.config.block_size))
        return Prepared(forward, forward.token_ids.ids, hashes, lookup,
                        session=SessionAffinity.key(request.cache_salt, request.session_id),
                        lora_name=prompt.lora_id if aware else None)

    def adapters(self) -> dict[str, str]:
        """Every LoRA adapter a live pod serves -> the path most of them serve it from."""
        names = {n for p in self.registry.pods.values() for n in p.info.adapters.paths}
        return {n: self._adapter_path(n) for n in sorted(names)}

    def _adapter_path(self, name: str) -> str:
        """The path most live pods serve adapter `name` from; NoSuchAdapter when none does
        (the words the pods use)."""
        paths = Counter(p.info.adapters.paths[name] for p in self.registry.pods.values()
                        if p.info.adapters.knows(name))
        if not paths:
            raise NoSuchAdapter(name)
        return min(paths, key=lambda path: (-paths[path], path))

    # -- the decision ----------------------------------------------------------------------
    def _next_counter(self) -> int:
        self._counter += 1
        return self._counter

    def _candidate(self, p: PodEntry, view: FleetView, match: PodMatch | None,
                   burst_depth: int, limit: int, now: float, lora: str | None = None
                   ) -> Candidate:
        """One pod as the scorer sees it for this request: its load, its settled costs,
        what the index confirms there and what the predictions add."""
        held = match.tiers if match else ()
        # Local and shared predictions alike: the longer one (both count as pool hits).
        predicted = max(burst_depth, match.predicted if match else 0)
        tiers, from_burst = merge_prediction(held, predicted, limit)
        published = view.published.get(p.pod_id, p.info.tier_costs)
        cand = Candidate(p.pod_id, p.info.address, tiers, waiting=p.info.waiting,
                         running=p.info.running, inflight=p.inflight,
                         finished_since_load=p.finished_since_load(), recent=p.recent(now),
                         free_blocks=p.info.free_blocks, published_costs=published,
                         pull_costs=p.info.pull_costs, burst_blocks=from_burst,
                         held_blocks=min(len(held), limit),
                         lendable=p.unavailable_until <= now)  # just UNAVAILABLE: it fails
        if self.config.policy == "sticky":
            cand.backlog_tokens = p.backlog(view.speed(p.pod_id), now)
        if p.info.kind == POD_KIND_VLLM:  # no KVNode.PullBlocks either way
            cand.lendable = cand.can_pull = False
        if lora is not None:  # a pod that must load the adapter first pays for the load
            adapters = p.info.adapters
            if not adapters.knows(lora):
                cand.eligible, cand.excluded_reason = False, f"does not serve adapter {lora}"
            elif lora not in adapters.resident and not self._adapter_sent.recent(p.pod_id, lora):
                # Its measured seconds, at least the configured floor: a load also evicts an
                # adapter another request will load again (bench.lora_routing: priced at a
                # 5 ms measured load alone, the traffic spread and loaded 2.4x as often).
                cand.adapter_load_s = max(adapters.load_s or 0.0,
                                          self.config.costs.adapter_load_s)
        return cand

    def _base_scores(self, pods: list[PodEntry]) -> list[Score]:
        """Load only: no lookup, no costs (baseline policies and the index-down fallback)."""
        return [Score(p.pod_id, p.info.address, waiting=p.info.waiting, running=p.info.running,
                      queue=p.queue(), recent=p.recent(), free_blocks=p.info.free_blocks,
                      cost_s=0.0) for p in pods]

    async def _lookup(self, prepared: Prepared) -> tuple[dict[str, PodMatch] | None, float]:
        if prepared.lookup_blocks == 0:
            return {}, 0.0
        hashes = prepared.block_hashes[:prepared.lookup_blocks]
        bucket = bucket_of(hashes[0])
        if self._bucket_down_until.get(bucket, 0.0) > time.monotonic():
            return None, 0.0  # its shard failed a moment ago: by load, without waiting on it
        start = time.perf_counter()
        try:
            matches = await self.index.lookup_prefix(hashes, self.registry.live_pods(),
                                                     self.shared is not None)
        except REDIS_ERRORS as exc:
            self._lookup_failed(bucket, exc)
            return None, (time.perf_counter() - start) * 1e3
        elapsed = time.perf_counter() - start
        self.metrics.lookup_seconds.observe(elapsed)
        return matches, elapsed * 1e3

    def _lookup_failed(self, bucket: int, exc: BaseException) -> None:
        """A single Redis that fails is down for every request; a cluster's failing shard
        only for the buckets it serves, so only this bucket's requests stop reading it for a
        moment, and the others keep their prefix routing through a failover."""
        if not self._sharded:
            self.registry.index_failed("lookup", exc)
            return
        now = time.monotonic()
        self.metrics.index_errors.labels(op="lookup").inc()
        if not any(t > now for t in self._bucket_down_until.values()):
            logger.warning("redis index shard of bucket %03x unreachable (%s: %s): its requests "
                           "route by load until it answers", bucket, type(exc).__name__, exc)
        self._bucket_down_until[bucket] = now + _BUCKET_RETRY_S

    async def decide(self, prepared: Prepared) -> Decision:
        reg = self.registry
        policy = self.config.policy
        counter = self._next_counter()
        prompt_len = len(prepared.token_ids)
        lora = prepared.lora_name
        if policy not in PREFIX_POLICIES:
            base = self._base_scores(self._serving(serving_pods(reg.eligible()), lora))
            if policy == "round_robin":
                order, reason = order_round_robin(base, counter), REASON_ROUND_ROBIN
            else:
                order, reason = order_random(base, self._rng), REASON_RANDOM
            return self._finish(order, reason, base, prepared, 0.0)

        matches: dict[str, PodMatch] | None = None
        lookup_ms = 0.0
        reg.drop_expired()  # leases run out since the last refresh
        if reg.index_up:
            matches, lookup_ms = await self._lookup(prepared)
        cause = "index_down" if matches is None else ""
        if cause:  # load only, among the last known pods
            base = self._base_scores(self._serving(serving_pods(reg.eligible()), lora))
            self.metrics.fallbacks.labels(cause=cause).inc()
            return self._finish(order_least_loaded(base, counter), REASON_FALLBACK, base,
                                prepared, lookup_ms)
        assert matches is not None
        limit = prepared.lookup_blocks
        bursts = self.burst.depths(prepared.block_hashes[:limit]) if limit else {}
        view = self._fleet()
        now = time.monotonic()
        # The pods that hold (or are predicted to hold) some of the prefix, then a few of
        # the least-loaded others: every pod that could win, not every pod (fleet_view.py).
        entries = view.holders(matches, bursts)
        if lora is None:
            entries += view.others([p.pod_id for p in entries], self.config.pd_split)
        else:  # every pod serving the adapter (few): the others could only refuse it
            held = {p.pod_id for p in entries}
            entries += [p for p in (*view.serving.values(), *view.prefill.values())
                        if p.pod_id not in held and p.info.adapters.knows(lora)]
        cands = [self._candidate(p, view, matches.get(p.pod_id), bursts.get(p.pod_id, 0),
                                 limit, now, lora) for p in entries]
        # Every pod is a pull source; only the serving ones (decode, mixed) take requests.
        scores = score_all(cands, prompt_len, self.config.block_size, self.config.costs,
                           self.config.kv_pull, by_tokens=policy == "sticky")
        order, reason = rank([s for s in scores if s.pod_id in view.serving],
                             self.config.costs, counter)
        # (an adapter's cold prompt: its pods are few, their load costs decide among them)
        if self.config.cold_placement == "hash" and prepared.block_hashes and lora is None:
            order, reason = self._place_cold(order, reason, prepared, view, now)
        if prepared.session is not None and self.config.session_idle_s > 0:
            order, reason = self._keep_session(order, reason, prepared, view, now)
        prefill_order, _ = rank([s for s in scores if s.pod_id in view.prefill],
                                self.config.costs, counter)
        prepared.uncached = {s.pod_id: prompt_len - s.cached_tokens - s.pull_tokens
                             for s in order}
        decision = self._finish(order, reason, scores, prepared, lookup_ms,
                                {c.pod_id: c.held_blocks for c in cands if c.held_blocks})
        split, threshold, outcome = plan_split(decision.order, prefill_order, reg.pods,
                                               prompt_len, self.config)
        if threshold:
            self.metrics.pd_threshold.labels(pod=decision.order[0].pod_id).set(threshold)
            self.metrics.pd_requests.labels(decision=outcome).inc()
        decision.split, decision.pd_threshold = split, threshold
        return decision

    @staticmethod
    def _serving(pods: list[PodEntry], lora: str | None) -> list[PodEntry]:
        """The pods that can serve a request of adapter `lora` (all, for the base model)."""
        return pods if lora is None else [p for p in pods if p.info.adapters.knows(lora)]

    def _fleet(self) -> FleetView:
        """The fleet view, rebuilt when the registry's pods changed (a refresh makes a new
        dict; a lease that ran out shrinks it): O(pods) a refresh, not a request."""
        reg = self.registry
        if self._view_of is not reg.pods or self._view_len != len(reg.pods) or \
                self._view_foreign is not reg.foreign:
            self.view.rebuild(reg.pods, reg.foreign)
            self._view_of, self._view_len, self._view_foreign = \
                reg.pods, len(reg.pods), reg.foreign
            if self.config.kv_pull:
                now = time.monotonic()
                pods = (*self.view.serving.values(), *self.view.prefill.values())
                self.crossovers.update([self._candidate(p, self.view, None, 0, 0, now)
                                        for p in pods], self.config.costs, now)
        return self.view

    def _place_cold(self, order: list[Score], reason: str, prepared: Prepared,
                    view: FleetView, now: float) -> tuple[list[Score], str]:
        """A cold prompt (no pod holds any of it) goes to the first pod of the load band on
        the ring from its first block's hash (router/cold_ring.py); when the walk finds
        none, among the pods scored (router/placement.py)."""
        if len(order) < 2 or not is_cold(order):
            return order, reason
        key = prepared.block_hashes[0]
        prompt_len = len(prepared.token_ids)
        work = order[0].cost_s - order[0].queue_s
        limit = work + max(self.config.costs.tie_abs_s, self.config.costs.tie_rel * work)
        shortest = view.min_queue()
        room = shortest + max(BAND_QUEUE_SLACK, BAND_QUEUE_REL * shortest)
        pick = view.cold_pick(key, int(room), limit, prompt_len)
        if pick is None:
            return place_cold(order, reason, self.config.costs, key)
        chosen = next((s for s in order if s.pod_id == pick.pod_id), None)
        if chosen is None:  # on the ring, not among the few scored: score it as they were
            cand = self._candidate(pick, view, None, 0, 0, now, prepared.lora_name)
            chosen = score_all([cand], prompt_len, self.config.block_size, self.config.costs,
                               False, by_tokens=self.config.policy == "sticky")[0]
        return [chosen, *(s for s in order if s is not chosen)], REASON_COLD_SPREAD

    def _keep_session(self, order: list[Score], reason: str, prepared: Prepared,
                      view: FleetView, now: float) -> tuple[list[Score], str]:
        """A session's turn goes first to the pod of its last turn, unless that pod is
        saturated or no longer serving (router/sessions.py)."""
        assert prepared.session is not None
        pod_id = self.sessions.pod_of(prepared.session)
        outcome = NEW
        if pod_id is not None:
            chosen = next((s for s in order if s.pod_id == pod_id), None)
            entry = view.serving.get(pod_id)
            if chosen is None and entry is not None:  # not among the few scored
                cand = self._candidate(entry, view, None, 0, 0, now, prepared.lora_name)
                chosen = score_all([cand], len(prepared.token_ids), self.config.block_size,
                                   self.config.costs, False,
                                   by_tokens=self.config.policy == "sticky")[0]
            outcome = MOVED
            if chosen is not None and chosen.eligible and \
                    not self.sessions.saturated(chosen.waiting):
                outcome = KEPT
                if order and order[0] is not chosen:
                    order = [chosen, *(s for s in order if s is not chosen)]
                    reason = REASON_SESSION
        self.metrics.session_routes.labels(outcome=outcome).inc()
        return order, reason

    def _finish(self, order: list[Score], reason: str, scores: list[Score], prepared: Prepared,
                lookup_ms: float, held: dict[str, int] | None = None) -> Decision:
        now = time.monotonic()
        # A pod that just failed with UNAVAILABLE is tried last until its cooldown ends.
        pods = self.registry.pods

        def cooling(s: Score) -> bool:
            entry = pods.get(s.pod_id)
            return entry is not None and entry.unavailable_until > now

        if any(cooling(s) for s in order):
            first = order[0]
            order = [s for s in order if not cooling(s)] + [s for s in order if cooling(s)]
            if order[0] is not first:
                reason = REASON_COOLDOWN
        return Decision(order, reason, [*scores, *self._fleet().excluded],
                        prepared.lookup_blocks, lookup_ms,
                        {s.pod_id: s.cached_tokens for s in scores}, held or {})

    async def close(self) -> None:
        """Cancel the shared-burst writes still waiting (before the index client closes)."""
        if self.shared is not None:
            await self.shared.close()

    def dispatched(self, pod_id: str, prepared: Prepared, held_blocks: int = 0) -> None:
        """The request goes to `pod_id`: predict its blocks there for the burst TTL, here
        and, with shared bursts, for the other routers (the blocks past `held_blocks`, the
        prefix the index already confirms there)."""
        if prepared.session is not None:
            self.sessions.record(prepared.session, pod_id)
        if prepared.lora_name is not None:
            self._adapter_sent.record(pod_id, prepared.lora_name)
        entry = self.registry.pods.get(pod_id)
        if entry is not None:
            entry.note_dispatch()
            uncached = prepared.uncached.get(pod_id, len(prepared.token_ids))
            entry.add_backlog(uncached, self.view.speed(pod_id))
        if self.config.policy not in PREFIX_POLICIES:
            return
        self.burst.record(pod_id, prepared.block_hashes)
        hashes = prepared.block_hashes[:prepared.lookup_blocks]
        if self.shared is not None and hashes and self.registry.index_up and \
                self._bucket_down_until.get(bucket_of(hashes[0]), 0.0) <= time.monotonic():
            self.shared.record(pod_id, hashes, held_blocks)
