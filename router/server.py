"""The router's gRPC server: the pods' own `Generation` service, forwarded by prefix.

A client cannot tell a router from a pod: same service, same messages. The router adds
`routing` (why this pod, the candidates and their scores) to the response or to the stream's
last chunk, and the trailing metadata `pagekv-router-overhead-us` (time spent in the router,
the pod call excluded). Once the chosen pod answers, the initial metadata names it
(`pagekv-served-by`, `pagekv-routing-reason`, `pagekv-predicted-cached-tokens`) — what the
HTTP front end (proto/openai, on --http-port) turns into response headers.

A pod whose score carries the pull option gets `kv_source` (the peer to pull its prefix
from) on its own attempt only: each attempt sets or clears the field on the one forwarded
message, so no hint outlives its attempt, none names the pod it goes to, none a pod that
failed this request, and a client's own `kv_source` never reaches a pod.

A request the decision splits (router/disaggregation.py) is first prefilled on a prefill pod
(`_handover`: one greedy token, the prompt's blocks held there under the call's id; the next
prefill pod on UNAVAILABLE, a stall or a full queue); its decode attempts then carry a
`kv_source` naming that hold, whichever decode pod they go to. A prefill that fails
everywhere leaves the decode pod to compute the prompt; either way the routing info says
which pods served, the prefill's and the handover's time, and any fallback. A client's own
`handover` never reaches a pod (Router.prepare clears it).

Faults: a pod that fails with UNAVAILABLE before anything reached the client is replaced by
the next-best pod (up to `max_attempts` pods); any other status from a pod, including the
client's own errors (INVALID_ARGUMENT, RESOURCE_EXHAUSTED), is passed through unchanged. A
client that cancels cancels the upstream call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagekv.proto.grpc_security import TokenGuard, bind, transport
from pagekv.proto.index import REDIS_ERRORS, connect_async
from pagekv.proto.model_files import Tokenizer
from pagekv.proto.openai import Backend, HttpServer
from pagekv.proto.openai.backend import HandlerContext
from pagekv.proto.pagekv.v1 import pagekv_pb2, pagekv_pb2_grpc
from pagekv.proto.redact import redact_url
from pagekv.proto.requests import (
    BadRequest,
    NoSuchAdapter,
    already_in_flight,
    check_request,
    prompt_is_large,
)
from pagekv.proto.serving import HealthServicer, add_servicer, method_paths
from pagekv.proto.tenant_identity import NoTenant, TenantSalting
from pagekv.router.cache_admin import RouterCacheAdmin
from pagekv.router.config import RouterConfig
from pagekv.router.disaggregation import (
    PREFILL_FAILED,
    PREFILL_STALLED,
    PREFILL_UNAVAILABLE,
    fallback_label,
)
from pagekv.router.metrics import RouterMetrics
from pagekv.router.pods import PodEntry
from pagekv.router.routing import Decision, Prepared, Router
from pagekv.router.scoring import REASON_PD_PREFILL, REASON_RETRY, Score
from pagekv.router.tokenize import load_tokenizer
from pagekv.router.ttft_tracker import TtftTicket, TtftTracker

logger = logging.getLogger(__name__)

OVERHEAD_METADATA_KEY = "pagekv-router-overhead-us"
# The chosen pod's predicted TTFT for the call (router/ttft_tracker.py), in the trailer too.
PREDICTED_TTFT_METADATA_KEY = "pagekv-predicted-ttft-us"
STOP_STEP_TIMEOUT_S = 5.0  # each clean-up step of stop(): the process exits regardless
_STOP_STEP_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *REDIS_ERRORS)
SERVICE_NAME = "pagekv.v1.Generation"
_ADMIN_SERVICE = pagekv_pb2.DESCRIPTOR.services_by_name["CacheAdmin"]
CACHE_ADMIN_METHODS = method_paths(_ADMIN_SERVICE)


class _Attempt:
    """One pod call's bookkeeping: in-flight counters and the routing metrics."""

    __slots__ = ("entry", "metrics")

    def __init__(self, entry: PodEntry, metrics: RouterMetrics) -> None:
        self.entry = entry
        self.metrics = metrics

    def __enter__(self) -> _Attempt:
        self.entry.inflight += 1
        self.metrics.inflight.inc()
        return self

    def __exit__(self, *exc: object) -> None:
        self.entry.inflight -= 1
        self.entry.call_finished()
        self.metrics.inflight.dec()


@dataclass(slots=True)
class _Handover:
    """A split request's prefill half, as its decode attempts see it: where its prompt's KV
    is held (`source`, None when the prefill failed), and the figures of the routing info."""

    source: pagekv_pb2.KvSource | None = None
    prefill: Score | None = None
    prefill_ms: float = 0.0
    fallback: str = ""  # why the decode pod computes the prompt itself ("" : it does not)

    def expected_tokens(self, block_size: int) -> int:
        return self.source.num_blocks * block_size if self.source is not None else 0


class RouterService(pagekv_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router, metrics: RouterMetrics) -> None:
        self.router = router
        self.metrics = metrics
        # Client request ids in flight through this router. A pod refuses an id it is already
        # serving, but two calls with one id may be routed to different pods: refuse here too.
        self.inflight_ids: set[str] = set()
        # No fleet token: a router's callers are clients, each of its tenant.
        self.salting = TenantSalting(router.config.tenants)
        # Each call's predicted TTFT against the one measured (the MAPE gauge per pod).
        self.ttft = TtftTracker(metrics, router.config.costs)

    def _predict(self, entry: PodEntry, score: Score, prepared: Prepared,
                 handover: _Handover | None) -> TtftTicket | None:
        """The call's TTFT prediction; None for a split request (its first token waits for
        the prefill pod and the handover, which the prediction does not cover)."""
        if handover is not None:
            return None
        return self.ttft.start(score, entry.info, len(prepared.token_ids), entry.inflight)

    async def _claim_id(self, request: pagekv_pb2.GenerateRequest,
                        context: HandlerContext) -> str:
        """Reserve the request's id (release it with `inflight_ids.discard`); '' when the
        client left it empty (the pod generates one)."""
        rid = request.request_id
        if rid:
            if rid in self.inflight_ids:
                self.metrics.failures.labels(code="ALREADY_EXISTS").inc()
                # The pod's words, so the two cannot be told apart.
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, already_in_flight(rid))
            self.inflight_ids.add(rid)
        return rid

    # -- shared steps ----------------------------------------------------------------------
    async def _route(self, request: pagekv_pb2.GenerateRequest,
                     context: HandlerContext) -> tuple[Prepared, Decision]:
        try:
            check_request(request, self.router.config.prompt_limits)  # before any real work
            if self.salting.active:  # the tenant's salt, hashed here and sent to the pod
                salt, request.tenant = self.salting.identity(context, request.cache_salt)
                request.cache_salt = salt or ""
            else:
                request.ClearField("tenant")  # (no tenants: no quota to count against)
            if prompt_is_large(request):  # milliseconds of tokenizing and hashing: not here
                prepared = await asyncio.to_thread(self.router.prepare, request)
            else:
                prepared = self.router.prepare(request)
        except NoSuchAdapter as exc:  # (no live pod serves it: the pods' words)
            self.metrics.failures.labels(code="NOT_FOUND").inc()
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except BadRequest as exc:
            self.metrics.failures.labels(code="INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoTenant as exc:
            self.metrics.failures.labels(code="PERMISSION_DENIED").inc()
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except ValueError as exc:  # hashing rejected a field (e.g. a salt it cannot encode)
            self.metrics.failures.labels(code="INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {exc}")
        except Exception:  # a bug must not reach the client as a stack trace
            logger.exception("routing failed for request %r", request.request_id)
            self.metrics.failures.labels(code="INTERNAL").inc()
            await context.abort(grpc.StatusCode.INTERNAL, "internal router error")
        decision = await self.router.decide(prepared)
        if not decision.order:
            # Maybe pods joined since the last refresh (a router just started): look once.
            await self.router.registry.refresh()
            decision = await self.router.decide(prepared)
        if not decision.order:
            self.metrics.failures.labels(code="UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._no_pods_message(decision))
        return prepared, decision

    def _no_pods_message(self, decision: Decision) -> str:
        s = self.router.schema
        msg = (f"no live pods for model {s.model!r} (block size {s.block_size}, "
               f"{s.hash_algo}, index namespace {s.namespace})")
        refused = [sc for sc in decision.scores if not sc.eligible]
        if refused:
            msg += "; refused: " + "; ".join(
                f"{sc.pod_id}: {sc.excluded_reason}" for sc in refused[:5])
        if not self.router.registry.index_up:
            msg += "; the Redis index is unreachable"
        return msg

    def _entry(self, score: Score) -> PodEntry | None:
        return self.router.registry.pods.get(score.pod_id)

    def _dispatch(self, score: Score, attempt: int, decision: Decision,
                  prepared: Prepared) -> tuple[PodEntry | None, str]:
        entry = self._entry(score)
        reason = decision.reason if attempt == 0 else REASON_RETRY
        if entry is not None:
            self.metrics.requests.labels(pod=score.pod_id, reason=reason).inc()
            self.router.dispatched(score.pod_id, prepared, decision.held.get(score.pod_id, 0))
        return entry, reason

    def _aim(self, prepared: Prepared, score: Score, failed: set[str],
             handover: _Handover | None = None) -> bool:
        """Point this attempt's request at its pod's pull source, or at none; True: a hint.
        A split request's decode pod pulls from the prefill pod that holds the prompt."""
        if handover is not None and handover.source is not None and \
                handover.source.pod_id not in failed:
            prepared.forward.kv_source.CopyFrom(handover.source)
            return True
        if not _point(prepared.forward, score, failed):
            return False
        self.metrics.pull_hints.inc()
        logger.debug("pull hint: %s pulls %d tokens (blocks to %d) from %s at %s, saving "
                     "%.4f s", score.pod_id, score.pull_tokens, score.pull_blocks,
                     score.pull_from, score.pull_address, score.pull_saving_s)
        return True

    def _on_unavailable(self, score: Score, exc: grpc.aio.AioRpcError) -> None:
        logger.warning("pod %s at %s UNAVAILABLE (%s); trying the next-best pod",
                       score.pod_id, score.address, exc.details())
        self.metrics.retries.labels(pod=score.pod_id).inc()
        self.router.registry.mark_unavailable(score.pod_id,
                                              self.router.config.unavailable_cooldown_s)

    def _on_stall(self, score: Score, bound_s: float, chunks: int, retrying: bool) -> None:
        """A call on `score`'s pod made no progress in `bound_s` (after `chunks` chunks):
        counted, logged, and the pod cools (tried last) for a while."""
        registry = self.router.registry
        cooldown, stalls = registry.mark_stalled(score.pod_id, self.router.config.stall_bound())
        phase = "mid_stream" if chunks else "first_chunk"
        self.metrics.stalls.labels(pod=score.pod_id, phase=phase).inc()
        what = f"no chunk for {bound_s:.1f} s after {chunks}" if chunks else \
            f"no first chunk in {bound_s:.1f} s"
        logger.warning("pod %s at %s made no progress (%s; stall bound for an estimated TTFT "
                       "of %.3f s): call cancelled, pod cooling %.1f s (stall %d in a row)%s",
                       score.pod_id, score.address, what, score.cost_s, cooldown, stalls,
                       "; trying the next-best pod" if retrying else "")

    async def _fail_stalled(self, context: HandlerContext, score: Score, bound_s: float,
                            chunks: int) -> None:
        self.metrics.failures.labels(code="UNAVAILABLE").inc()
        if chunks:
            msg = (f"pod {score.pod_id} stopped mid-stream: no chunk for {bound_s:.1f} s after "
                   f"{chunks} chunks (stall bound); the tokens sent stand, the rest is lost")
        else:
            msg = (f"pod {score.pod_id} made no progress: no answer in {bound_s:.1f} s (stall "
                   f"bound), and no other pod is left to try")
        await context.abort(grpc.StatusCode.UNAVAILABLE, msg)

    async def _fail(self, context: HandlerContext, exc: grpc.aio.AioRpcError) -> None:
        code = exc.code()
        self.metrics.failures.labels(code=code.name).inc()
        # The pod's trailing metadata too: rich error details travel there.
        trailing = tuple((k, v) for k, v in (exc.trailing_metadata() or ()))
        await context.abort(code, exc.details() or "", trailing)

    # -- P/D: the prefill half of a split request ------------------------------------------
    async def _handover(self, context: HandlerContext, prepared: Prepared,
                        decision: Decision) -> _Handover | None:
        """Prefill a split request's prompt on a prefill pod (the next one on UNAVAILABLE,
        a stall or a full queue) and say where its KV is held; None: not split. A prefill
        that fails everywhere leaves the decode pod to compute the prompt (same tokens)."""
        plan = decision.split
        if plan is None:
            return None
        cfg = self.router.config
        request = _prefill_request(prepared, cfg.pd_hold_ms)
        stall = cfg.stall_bound()
        fallback = PREFILL_UNAVAILABLE
        failed: set[str] = set()
        t0 = time.perf_counter()
        for score in plan.prefill_order[:cfg.max_attempts]:
            entry = self._entry(score)
            if entry is None:
                continue
            _point(request, score, failed)  # the prefill pod's own pull option, as any pod's
            self.metrics.requests.labels(pod=score.pod_id, reason=REASON_PD_PREFILL).inc()
            bound_s = stall.unary_s(score.cost_s, 1, entry.step_s)
            t_call = time.perf_counter()
            with _Attempt(entry, self.metrics):
                call = entry.stub.Generate(request, timeout=context.time_remaining())
                watch = asyncio.timeout(bound_s)
                try:
                    async with watch:
                        await call
                except TimeoutError:
                    if not watch.expired():
                        raise
                    call.cancel()
                    assert bound_s is not None
                    self._on_stall(score, bound_s, 0, True)
                    failed.add(score.pod_id)
                    fallback = PREFILL_STALLED
                    continue
                except grpc.aio.AioRpcError as exc:
                    failed.add(score.pod_id)
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        self._on_unavailable(score, exc)
                        fallback = PREFILL_UNAVAILABLE
                        continue
                    fallback = PREFILL_FAILED
                    logger.warning("P/D: prefill pod %s answered %s (%s)", score.pod_id,
                                   exc.code().name, exc.details())
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        continue  # its queue is full: another prefill pod may take it
                    break
                except asyncio.CancelledError:
                    call.cancel()  # the client went away
                    raise
            entry.made_progress()
            seconds = time.perf_counter() - t_call
            self.metrics.pd_prefill_seconds.observe(seconds)
            self.router.dispatched(score.pod_id, prepared, decision.held.get(score.pod_id, 0))
            return _Handover(pagekv_pb2.KvSource(
                pod_id=score.pod_id, address=score.address,
                num_blocks=len(prepared.block_hashes), handover_id=request.request_id),
                score, seconds * 1e3)
        self.metrics.pd_fallbacks.labels(reason=fallback).inc()
        logger.warning("P/D: the prefill of a %d-token prompt failed (%s) on %s; its decode "
                       "pod computes it", len(prepared.token_ids), fallback,
                       ", ".join(sorted(failed)) or "no prefill pod")
        return _Handover(fallback=fallback, prefill_ms=(time.perf_counter() - t0) * 1e3)

    def _note_handover(self, info: pagekv_pb2.RoutingInfo, decision: Decision,
                       handover: _Handover | None, usage: pagekv_pb2.Usage) -> None:
        """The split's figures in the routing info, and in the metrics."""
        info.pd_threshold_tokens = decision.pd_threshold
        if handover is None:
            return
        if handover.prefill is not None:
            info.prefill_pod = handover.prefill.pod_id
            info.prefill_address = handover.prefill.address
        info.prefill_ms = handover.prefill_ms
        info.handover_ms, info.handover_tokens = usage.kv_pull_ms, usage.cached_tokens_peer
        fallback = handover.fallback
        if handover.source is not None:
            if usage.kv_pull_fallback:
                fallback = fallback_label(usage.kv_pull_fallback)
                self.metrics.pd_fallbacks.labels(reason=fallback).inc()
            self.metrics.pd_handover_seconds.observe(usage.kv_pull_ms / 1e3)
        info.pd_fallback = fallback

    def _hinted_tokens(self, decision: Decision, score: Score, hinted: bool,
                       handover: _Handover | None) -> int:
        """Tokens the attempt's hint should add to the pod's cached prefix."""
        if not hinted:
            return 0
        if handover is not None and handover.source is not None:
            lookup = decision.prompt_blocks * self.router.config.block_size
            return max(0, lookup - decision.predicted.get(score.pod_id, 0))
        return score.pull_tokens

    def _finish(self, context: HandlerContext, prepared: Prepared,
                decision: Decision, score: Score, usage: pagekv_pb2.Usage,
                overhead_s: float, hinted_tokens: int, ticket: TtftTicket | None = None
                ) -> None:
        # The pod's usage counts pulled tokens as cached: so does the prediction here.
        predicted = decision.predicted.get(score.pod_id, 0) + hinted_tokens
        self.metrics.observe_cached(predicted, usage.cached_tokens, len(prepared.token_ids))
        self.metrics.overhead_seconds.observe(overhead_s)
        trailer = [(OVERHEAD_METADATA_KEY, str(int(overhead_s * 1e6)))]
        if ticket is not None:
            trailer.append((PREDICTED_TTFT_METADATA_KEY, str(int(ticket.predicted_s * 1e6))))
        context.set_trailing_metadata(tuple(trailer))

    # -- unary -----------------------------------------------------------------------------
    async def Generate(self, request: pagekv_pb2.GenerateRequest,
                       context: HandlerContext) -> pagekv_pb2.GenerateResponse:
        t0 = time.perf_counter()
        prepared, decision = await self._route(request, context)
        rid = await self._claim_id(request, context)
        try:
            return await self._generate(context, prepared, decision, t0)
        finally:
            self.inflight_ids.discard(rid)

    async def _generate(self, context: HandlerContext, prepared: Prepared,
                        decision: Decision, t0: float) -> pagekv_pb2.GenerateResponse:
        attempts = decision.order[:self.router.config.max_attempts]
        in_pods = 0.0  # time spent in failed pod calls: not the router's overhead
        failed: set[str] = set()  # pods UNAVAILABLE for this request: no pull source either
        stall = self.router.config.stall_bound()
        handover = await self._handover(context, prepared, decision)
        for i, score in enumerate(attempts):
            entry, reason = self._dispatch(score, i, decision, prepared)
            if entry is None:
                continue  # dropped from the registry since the decision
            hinted = self._aim(prepared, score, failed, handover)
            ticket = self._predict(entry, score, prepared, handover)
            t_call = time.perf_counter()
            bound_s = stall.unary_s(score.cost_s, _max_tokens(prepared.forward), entry.step_s)
            with _Attempt(entry, self.metrics), _closing(self.ttft, ticket):
                call = entry.stub.Generate(prepared.forward, timeout=context.time_remaining())
                watch = asyncio.timeout(bound_s)  # bound_s None: the client's deadline only
                try:
                    async with watch:
                        response = await call
                    entry.made_progress()
                    if ticket is not None:
                        self.ttft.unary_done(ticket, _steps(response.usage, prepared.forward))
                    entry.note_steps(time.perf_counter() - t_call,
                                     _steps(response.usage, prepared.forward))
                except TimeoutError:
                    if not watch.expired():
                        raise
                    call.cancel()
                    retrying = i + 1 < len(attempts)
                    assert bound_s is not None
                    self._on_stall(score, bound_s, 0, retrying)
                    if retrying:
                        failed.add(score.pod_id)
                        in_pods += time.perf_counter() - t_call
                        continue
                    await self._fail_stalled(context, score, bound_s, 0)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAVAILABLE and i + 1 < len(attempts):
                        self._on_unavailable(score, exc)
                        failed.add(score.pod_id)
                        in_pods += time.perf_counter() - t_call
                        continue
                    await self._fail(context, exc)
                except asyncio.CancelledError:
                    call.cancel()  # the client went away: stop the pod's work too
                    raise
            t_back = time.perf_counter()
            response.routing.CopyFrom(decision.routing_info(score, reason, hinted))
            self._note_handover(response.routing, decision, handover, response.usage)
            if not response.served_by:
                response.served_by = score.pod_id
            overhead = (t_call - t0 - in_pods) + (time.perf_counter() - t_back)
            if handover is not None:
                overhead -= handover.prefill_ms / 1e3  # the prefill pod's time, not ours
            self._finish(context, prepared, decision, score, response.usage, overhead,
                         self._hinted_tokens(decision, score, hinted, handover), ticket)
            return response
        self.metrics.failures.labels(code="UNAVAILABLE").inc()
        await context.abort(grpc.StatusCode.UNAVAILABLE, self._no_pods_message(decision))
        raise AssertionError("unreachable")  # abort raises

    # -- streaming -------------------------------------------------------------------------
    async def GenerateStream(self, request: pagekv_pb2.GenerateRequest,
                             context: HandlerContext
                             ) -> AsyncGenerator[pagekv_pb2.GenerateChunk, None]:
        t0 = time.perf_counter()
        prepared, decision = await self._route(request, context)
        rid = await self._claim_id(request, context)
        try:
            # aclosing: a client that goes away cancels the pod call now, not when collected.
            async with contextlib.aclosing(
                    self._generate_stream(context, prepared, decision, t0)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.inflight_ids.discard(rid)

    async def _generate_stream(self, context: HandlerContext, prepared: Prepared,
                               decision: Decision, t0: float
                               ) -> AsyncGenerator[pagekv_pb2.GenerateChunk, None]:
        attempts = decision.order[:self.router.config.max_attempts]
        in_pods = 0.0  # time spent in failed pod calls: not the router's overhead
        failed: set[str] = set()  # pods UNAVAILABLE for this request: no pull source either
        stall = self.router.config.stall_bound()
        handover = await self._handover(context, prepared, decision)
        if handover is not None:
            in_pods += handover.prefill_ms / 1e3  # the prefill pod's time, not ours
        for i, score in enumerate(attempts):
            entry, reason = self._dispatch(score, i, decision, prepared)
            if entry is None:
                continue
            hinted = self._aim(prepared, score, failed, handover)
            ticket = self._predict(entry, score, prepared, handover)
            t_call = time.perf_counter()
            overhead = t_call - t0 - in_pods
            sent = 0  # chunks passed on to the client
            bound_s = stall.chunk_s(score.cost_s)  # None: the client's deadline only
            watch = asyncio.timeout(None)
            with _Attempt(entry, self.metrics), _closing(self.ttft, ticket):
                call = entry.stub.GenerateStream(prepared.forward,
                                                 timeout=context.time_remaining())
                chunks = aiter(call)
                try:
                    while True:
                        # Each wait on the pod bounded on its own: the client's reads
                        # (the yield below) are not the pod's stall.
                        watch = asyncio.timeout(bound_s)
                        try:
                            async with watch:
                                chunk = await anext(chunks)
                        except StopAsyncIteration:
                            break
                        if not sent:  # this pod answers: no failover from here on
                            if ticket is not None:
                                self.ttft.first_token(ticket)
                            entry.made_progress()
                            await context.send_initial_metadata(
                                _decision_metadata(decision, score, reason))
                        if chunk.served_by or chunk.HasField("usage"):
                            # The very last chunk: it carries usage, so routing goes here too.
                            t_last = time.perf_counter()
                            chunk.routing.CopyFrom(
                                decision.routing_info(score, reason, hinted))
                            self._note_handover(chunk.routing, decision, handover,
                                                chunk.usage)
                            if not chunk.served_by:
                                chunk.served_by = score.pod_id
                            overhead += time.perf_counter() - t_last
                            entry.note_steps(t_last - t_call, _steps(chunk.usage,
                                                                     prepared.forward))
                            self._finish(context, prepared, decision, score, chunk.usage,
                                         overhead,
                                         self._hinted_tokens(decision, score, hinted, handover),
                                         ticket)
                        sent += 1
                        yield chunk
                except TimeoutError:
                    if not watch.expired():
                        raise
                    call.cancel()
                    retrying = not sent and i + 1 < len(attempts)
                    assert bound_s is not None
                    self._on_stall(score, bound_s, sent, retrying)
                    if retrying:
                        failed.add(score.pod_id)
                        in_pods += time.perf_counter() - t_call
                        continue
                    await self._fail_stalled(context, score, bound_s, sent)
                except grpc.aio.AioRpcError as exc:
                    if (exc.code() == grpc.StatusCode.UNAVAILABLE and not sent
                            and i + 1 < len(attempts)):
                        self._on_unavailable(score, exc)
                        failed.add(score.pod_id)
                        in_pods += time.perf_counter() - t_call
                        continue
                    await self._fail(context, exc)
                finally:
                    # A no-op when the call finished; cancels it when the client went away
                    # (the handler is cancelled or closed while waiting for the pod).
                    call.cancel()
            return
        self.metrics.failures.labels(code="UNAVAILABLE").inc()
        await context.abort(grpc.StatusCode.UNAVAILABLE, self._no_pods_message(decision))


@contextlib.contextmanager
def _closing(tracker: TtftTracker, ticket: TtftTicket | None) -> Iterator[None]:
    """A call's TTFT ticket is closed however the call ends (a no-op once measured)."""
    try:
        yield
    finally:
        tracker.close(ticket)


def _point(request: pagekv_pb2.GenerateRequest, score: Score, failed: set[str]) -> bool:
    """Set the request's kv_source to `score`'s pull option, or clear it when it has none
    usable (none, itself, a pod that failed this request); True when set."""
    source = score.pull_from
    if not source or source == score.pod_id or source in failed:
        request.ClearField("kv_source")
        return False
    request.kv_source.CopyFrom(pagekv_pb2.KvSource(
        pod_id=source, address=score.pull_address, num_blocks=score.pull_blocks))
    return True


def _prefill_request(prepared: Prepared, hold_ms: int) -> pagekv_pb2.GenerateRequest:
    """The prefill half of a split request: its prompt, salt and adapter, one greedy token
    (what is sampled does not matter: the decode pod samples the request's own), and the
    hold that keeps the prompt's blocks for the decode pod's pull."""
    forward = prepared.forward
    request = pagekv_pb2.GenerateRequest(
        request_id=f"pd-{uuid.uuid4().hex}", cache_salt=forward.cache_salt,
        handover=pagekv_pb2.Handover(hold_ms=hold_ms))
    request.token_ids.ids.extend(prepared.token_ids)
    request.lora_name = forward.lora_name
    request.sampling.max_tokens = 1
    request.sampling.temperature = 0.0
    return request


def _max_tokens(request: pagekv_pb2.GenerateRequest) -> int | None:
    sampling = request.sampling
    return sampling.max_tokens if sampling.HasField("max_tokens") else None


def _steps(usage: pagekv_pb2.Usage, request: pagekv_pb2.GenerateRequest) -> int:
    """Generation steps a call took: its tokens per completion (n of them in parallel)."""
    return usage.completion_tokens // max(1, request.sampling.n)


def _decision_metadata(decision: Decision, score: Score, reason: str
                       ) -> tuple[tuple[str, str], ...]:
    return (("pagekv-served-by", score.pod_id), ("pagekv-routing-reason", reason),
            ("pagekv-predicted-cached-tokens", str(decision.predicted.get(score.pod_id, 0))))


async def _bounded_step(what: str, step: Awaitable[object], timeout_s: float) -> None:
    """One step of a stop, given `timeout_s`: on time, its Redis or timeout error is logged
    and the stop goes on; late, it is cancelled and left behind, not awaited (a step that
    swallows its cancellation, as a Redis read mid-command can, must not hold the stop:
    asyncio.wait_for would wait for it). Other errors are the caller's."""
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        logger.warning("router stop: %s did not end in %.1f s; going on", what, timeout_s)
        return
    exc = None if task.cancelled() else task.exception()
    if isinstance(exc, _STOP_STEP_ERRORS):
        logger.warning("router stop: %s failed (%r); going on", what, exc)
    elif exc is not None:
        raise exc


class RouterServer:
    """The whole router process: Redis client, registry, gRPC server, health, metrics, and
    (with http_port) OpenAI's HTTP API over the same GenerateStream handler, with the
    router's own tokenizer behind /tokenize and the metrics page on /metrics too."""

    def __init__(self, config: RouterConfig, host: str = "127.0.0.1", port: int = 0,
                 metrics_port: int = 0, metrics_host: str = "127.0.0.1",
                 http_port: int | None = None) -> None:
        self.config = config
        self.host = host
        self.http_port = http_port
        self.http: HttpServer | None = None
        self.stopping = False
        self.port = port
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.metrics = RouterMetrics()
        self.router: Router | None = None
        self.health = HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._ready_task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind and serve; returns the bound port. Health turns SERVING after the first
        successful read of the index."""
        cfg = self.config
        tokenizer = load_tokenizer(cfg.model)
        # The registry's refresh loop is the retry: the connection itself never retries.
        redis = connect_async(cfg.redis_url, cfg.redis_timeout_s, cfg.redis_tls,
                              cfg.redis_max_connections, cfg.pool_wait_s())
        self.router = router = Router(cfg, redis, tokenizer, self.metrics)
        try:
            await router.index.register_scripts()
        except REDIS_ERRORS as exc:
            logger.warning("redis index %s not reachable at start-up (%s); retrying",
                           redact_url(cfg.redis_url), exc)
        # Its admin calls are CacheAdmin's (router/cache_admin.py), under --admin-token.
        guard = TokenGuard(cfg.api_token, cfg.admin_token, CACHE_ADMIN_METHODS,
                           on_refused=lambda method, code:
                           self.metrics.auth_refused.labels(method=method, code=code).inc(),
                           tenants=cfg.tenants)
        server = grpc.aio.server(options=[
            # gRPC's default SO_REUSEPORT would let a second router bind this port and take a
            # share of its clients: refused instead, as pods do.
            ("grpc.so_reuseport", 0),
            # A bigger request could only be refused: gRPC does it before reading it.
            ("grpc.max_receive_message_length", cfg.prompt_limits.max_message_bytes),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ], interceptors=[guard] if guard.active else [])
        service = RouterService(router, self.metrics)
        add_servicer(server, pagekv_pb2.DESCRIPTOR.services_by_name["Generation"], service,
                     self.metrics.failures.labels(code="INVALID_ARGUMENT").inc)
        add_servicer(server, pagekv_pb2.DESCRIPTOR.services_by_name["CacheAdmin"],
                     RouterCacheAdmin(router))
        logger.info("limits: %s", cfg.prompt_limits.describe())
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        # Like a pod: grpcurl-style clients discover the API by reflection.
        reflection.enable_server_reflection(
            (SERVICE_NAME, _ADMIN_SERVICE.full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME), server)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.host}:{self.port}"
        try:
            self.port = bind(server, address, cfg.tls)
        except RuntimeError:  # newer grpc raises where older ones returned 0
            self.port = 0
        if not self.port:
            raise RuntimeError(f"could not bind {address} (in use?)")
        await server.start()
        self._server = server
        self.metrics.serve(self.metrics_port, self.metrics_host)
        router.registry.start()
        if self.http_port is not None:
            self.http = HttpServer(self._http_backend(service, tokenizer), self.host,
                                   self.http_port, cfg.tls)
            self.http_port = await self.http.start()
        self._ready_task = asyncio.get_running_loop().create_task(self._mark_ready())
        s = router.schema
        logger.info("router on %s:%d (%s; generation %s): model %s, block size %d, %s seed %r "
                    "-> index namespace %s; policy %s, burst TTL %.1fs", self.host, self.port,
                    transport(cfg.tls), "needs the API token" if cfg.api_token else "open",
                    cfg.model, cfg.block_size, cfg.hash_algo, cfg.hash_seed, s.namespace,
                    cfg.policy, cfg.burst_ttl_s)
        return self.port

    def _http_backend(self, service: RouterService, tokenizer: Tokenizer) -> Backend:
        cfg = self.config
        registry = service.router.registry
        return Backend(
            kind="router", model_names=cfg.served_model_names or [cfg.model], root=cfg.model,
            tokenizer=lambda: tokenizer, generate_stream=service.GenerateStream,
            ready=lambda: registry.ready.is_set() and not self.stopping,
            api_token=cfg.api_token, max_body_bytes=8 * cfg.prompt_limits.max_message_bytes,
            accepts_token=service.salting.names_tenant if service.salting.active else None,
            prompt_limits=cfg.prompt_limits, metrics=self.metrics.registry,
            limits=cfg.http_limits,
            on_response=lambda route, status: self.metrics.http_responses.labels(
                route=route, status=str(status)).inc(),
            adapters=service.router.adapters)

    async def _mark_ready(self) -> None:
        assert self.router is not None
        await self.router.registry.ready.wait()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("router ready: %d live pods", len(self.router.registry.eligible()))

    async def wait_ready(self, timeout: float = 10.0) -> None:
        assert self.router is not None
        await asyncio.wait_for(self.router.registry.ready.wait(), timeout)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Drain the servers, then close the router's parts: each step bounded, so the stop
        returns within (grace + 5 s) + 3 x 5 s however a step hangs."""
        self.stopping = True
        if self._ready_task is not None:
            self._ready_task.cancel()
        if self._server is not None:
            await self.health.enter_graceful_shutdown()
            draining = [self._server.stop(grace)]
            if self.http is not None:
                draining.append(self.http.stop(grace or 0.0))
            await _bounded_step("the servers' drain", asyncio.gather(*draining),
                                (grace or 0.0) + STOP_STEP_TIMEOUT_S)
            self._server = None
        if self.router is not None:
            # A Redis connection stuck mid-command must not hang the shutdown.
            for what, closing in (("burst writes", self.router.close()),
                                  ("pod registry", self.router.registry.close()),
                                  ("index client", self.router.index.aclose())):
                await _bounded_step(f"closing the {what}", closing, STOP_STEP_TIMEOUT_S)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
