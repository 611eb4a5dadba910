"""One pod on the network: `pagekv node` — the engine behind gRPC, metrics, and the index.

- `pagekv.v1.Generation` (unary and streaming) over the AsyncEngine; a cancelled stream
  aborts its request and frees its blocks.
- `pagekv.v1.KVNode` (Stats, ResetPrefixCache), `pagekv.v1.CacheAdmin` (Locate, DeletePrefix,
  Prewarm: cache_admin.py), grpc.health.v1, server reflection.
- OpenAI's HTTP API on --http-port (proto/openai: it calls GenerateStream above in process),
  with /tokenize, /detokenize and the metrics page (/metrics) beside it.
- Prometheus on --metrics-port (the same registry); KV events published to the Redis index
  (when --redis-url), and on ZeroMQ in vLLM's format (when --kv-events-zmq).
- SIGTERM / SIGINT (the process and its flags: node_cli.py): health goes NOT_SERVING,
  in-flight requests drain (--drain-timeout-s), the pod's index entries are removed, then
  the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Histogram

from pagekv.kvnode.engine.async_engine import AsyncEngine, QueueFull
from pagekv.kvnode.engine.config import EngineArgs
from pagekv.kvnode.engine.engine import DuplicateRequestId, Engine, RequestRejected
from pagekv.kvnode.engine.lora_adapters import AdapterUnavailable
from pagekv.kvnode.engine.peer_pull import NO_ROOM, KvSource, PullResult
from pagekv.kvnode.index.kv_events_zmq import VllmEventPublisher, ZmqEventsConfig
from pagekv.kvnode.index.publisher import IndexPublisher
from pagekv.kvnode.pod.adapter_admin import PodAdapterAdmin
from pagekv.kvnode.pod.cache_admin import CacheAdminServicer
from pagekv.kvnode.pod.kv_pull_client import PeerFetcher
from pagekv.kvnode.pod.kv_transfer import KvTransferService, TransferConfig
from pagekv.kvnode.pod.kv_transports import data_clients, data_servers
from pagekv.kvnode.pod.messages import Completions, engine_request_id, to_sampling_params, usage
from pagekv.kvnode.pod.peer_warmup import PeerWarmup
from pagekv.kvnode.pod.prom import EngineCollector, RequestMetricsExporter
from pagekv.proto.auth_profile import (
    AUTH_CONFIG_FIELD,
    AuthProfile,
    auth_mismatch,
    fleet_auth_key,
)
from pagekv.proto.command_line import CliError
from pagekv.proto.credentials import (
    TlsFiles,
)
from pagekv.proto.grpc_security import TokenGuard, bind, transport
from pagekv.proto.index import REDIS_ERRORS, IndexSchema, check_tls_url
from pagekv.proto.index.connect import connect
from pagekv.proto.index.pod_adapters import EMPTY as EMPTY_ADAPTERS
from pagekv.proto.index.pod_adapters import FIELD as ADAPTERS_FIELD
from pagekv.proto.index.pod_adapters import adapter_fields
from pagekv.proto.index.schema import text
from pagekv.proto.index.writes import role_fields
from pagekv.proto.openai import Backend, HttpServer
from pagekv.proto.openai.limits import HttpLimits
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.redact import redact_url
from pagekv.proto.requests import (
    BadRequest,
    NoSuchAdapter,
    PromptLimits,
    already_in_flight,
    cache_control_of,
    check_request,
    parse_prompt,
    prompt_is_large,
)
from pagekv.proto.serving import HealthServicer, add_servicer, method_paths, serve_metrics
from pagekv.proto.tenant_identity import NoTenant, TenantSalting
from pagekv.proto.tenants import TenantMap

logger = logging.getLogger(__name__)

# What --admin-token guards: the calls that change a pod's state for everyone. Stats is
# read-only (the metrics page shows as much): it is an API call, under --api-token.
ADMIN_METHODS = (
    f"/{pb.DESCRIPTOR.services_by_name['KVNode'].full_name}/ResetPrefixCache",
    *method_paths(pb.DESCRIPTOR.services_by_name["CacheAdmin"]),
)
# What only peer pods call, with the peer token: PullBlocks hands out any tenant's KV blocks.
PEER_METHODS = (f"/{pb.DESCRIPTOR.services_by_name['KVNode'].full_name}/PullBlocks",)


class JoinRefused(CliError):
    """The fleet's auth settings differ from this pod's: it does not join (one line)."""


class PodStarting(RuntimeError):
    """The pod listens while its model loads: there is no engine to ask yet."""


class PodServicer(pb_grpc.GenerationServicer, pb_grpc.KVNodeServicer):
    def __init__(self, pod: PodServer) -> None:
        self.pod = pod

    async def _parse(self, request: pb.GenerateRequest, context):
        eng = self.pod.built_engine()  # (_stream answered "starting" before the engine)
        limits = self.pod.prompt_limits
        check_request(request, limits)  # before any work that grows with the request
        if prompt_is_large(request):  # milliseconds of tokenizing: not on the event loop
            prompt = await asyncio.to_thread(parse_prompt, request, eng.tokenizer.encode, limits)
        else:
            prompt = parse_prompt(request, eng.tokenizer.encode, limits)
        tokens = list(prompt.token_ids)
        params = to_sampling_params(request.sampling, eng.max_model_len - len(tokens))
        rid = request.request_id or uuid.uuid4().hex
        salt, tenant = self.pod.salting.identity(context, prompt.cache_salt,
                                                 request.tenant)  # NoTenant
        return (rid, tokens, params, salt, prompt.lora_id, self._kv_source(request),
                cache_control_of(request), tenant)

    @staticmethod
    def _hold_s(request: pb.GenerateRequest) -> float:
        """A P/D prefill's hold (Handover.hold_ms) in seconds; 0: not a prefill half."""
        return request.handover.hold_ms / 1e3 if request.HasField("handover") else 0.0

    def _kv_source(self, request: pb.GenerateRequest) -> KvSource | None:
        """The request's peer hint, unless it names this pod or nothing to pull."""
        src = request.kv_source
        if not request.HasField("kv_source") or src.num_blocks == 0 or not src.address:
            return None
        if src.pod_id == self.pod.pod_id or src.address == self.pod.address:
            return None
        return KvSource(src.pod_id, src.address, src.num_blocks, src.handover_id)

    async def _stream(self, request, context):
        """The request's deltas; every failure becomes a gRPC status, never a stack trace."""
        pod = self.pod
        await self._started(context)
        rid = request.request_id
        try:
            rid, tokens, params, salt, lora, source, control, tenant = await self._parse(
                request, context)
            # aclosing: a cancelled call aborts its request now, not when collected.
            async with contextlib.aclosing(
                pod.aengine.generate(engine_request_id(rid), tokens, params, salt, lora, source,
                                     hold_s=self._hold_s(request), cache_control=control,
                                     tenant=tenant)
            ) as deltas:
                async for delta in deltas:
                    yield rid, tokens, delta
        except DuplicateRequestId:
            # The client's id, not the engine's escaped one (the router says the same).
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, already_in_flight(rid))
        except NoSuchAdapter as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except (BadRequest, RequestRejected) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except NoTenant as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except AdapterUnavailable as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Exception:
            logger.exception("request %s failed", rid)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request {rid})")

    async def Generate(self, request, context):
        done = Completions()
        rid, tokens, last = request.request_id, [], None
        async with contextlib.aclosing(self._stream(request, context)) as stream:
            async for out_rid, out_tokens, delta in stream:
                done.pieces(delta)
                rid, tokens, last = out_rid, out_tokens, delta
        if last is None:
            await context.abort(grpc.StatusCode.INTERNAL, "request produced no output")
        self.pod.request_metrics.observe(last)
        return pb.GenerateResponse(
            request_id=rid,
            completions=[done.completion(i) for i in sorted(done.tokens)],
            usage=usage(len(tokens), last, done.num_tokens()),
            served_by=self.pod.pod_id,
        )

    async def GenerateStream(self, request, context):
        done = Completions()
        async with contextlib.aclosing(self._stream(request, context)) as stream:
            async for rid, tokens, delta in stream:
                for chunk in self._chunks(rid, tokens, delta, done):
                    yield chunk

    def _chunks(self, rid: str, tokens: list[int], delta,
                done: Completions) -> list[pb.GenerateChunk]:
        """One step's delta as stream chunks; the request's last chunk carries the usage and
        the pod id."""
        chunks = [pb.GenerateChunk(request_id=rid, **piece) for piece in done.pieces(delta)]
        if delta.finished:
            self.pod.request_metrics.observe(delta)
            if not chunks:  # (with the prompt's logprobs, if no piece has taken them)
                chunks.append(pb.GenerateChunk(request_id=rid,
                                               prompt_logprobs=done.take_prompt_logprobs()))
            chunks[-1].usage.CopyFrom(usage(len(tokens), delta, done.num_tokens()))
            chunks[-1].served_by = self.pod.pod_id
        return chunks

    async def PullBlocks(self, request, context):
        # aclosing: a cancelled call releases the served blocks' pins now, not when collected.
        async with contextlib.aclosing(self.pod.transfer.pull_blocks(request, context)) as it:
            async for chunk in it:
                yield chunk

    async def _started(self, context) -> None:
        """Abort the call UNAVAILABLE while the model loads (the pod listens first)."""
        if self.pod.aengine is None:  # set after the engine: both are there
            await context.abort(grpc.StatusCode.UNAVAILABLE, "pod is starting")

    async def Stats(self, request, context):
        await self._started(context)
        return await asyncio.to_thread(self.pod.stats_response)

    async def ResetPrefixCache(self, request, context):
        await self._started(context)
        eng = self.pod.engine
        ok, n = await asyncio.to_thread(
            self.pod.aengine.call, lambda: eng.reset_prefix_cache(request.include_tiers)
        )
        msg = f"cleared {n} blocks" if ok else "refused: requests are running"
        logger.info("reset prefix cache (include_tiers=%s): %s", request.include_tiers, msg)
        return pb.ResetPrefixCacheResponse(success=ok, message=msg, blocks_cleared=n)


class PodServer:
    def __init__(
        self,
        engine_args: EngineArgs,
        pod_id: str,
        host: str = "127.0.0.1",
        port: int = 50051,
        metrics_port: int | None = None,
        redis_url: str | None = None,
        advertise_address: str | None = None,
        max_queue: int = 1024,
        lease_ttl_s: float = 3.0,
        *,
        tls: TlsFiles | None = None,
        admin_token: str | None = None,
        api_token: str | None = None,
        metrics_token: str | None = None,
        redis_tls: TlsFiles | None = None,
        prompt_limits: PromptLimits | None = None,
        http_port: int | None = None,
        http_limits: HttpLimits | None = None,
        served_model_names: list[str] | None = None,
        transfer: TransferConfig | None = None,
        kv_events: ZmqEventsConfig | None = None,
        tenants: TenantMap | None = None,
        prewarm_hottest: int = 0,
    ) -> None:
        """`prewarm_hottest` > 0: once serving, pre-warm that many of the peers' hottest
        prefixes (kvnode/pod/peer_warmup.py)."""
        self.args = engine_args
        self.pod_id = pod_id
        self.host = host
        self.port = port
        self.metrics_port = metrics_port
        self.redis_url = redis_url
        self.advertise_address = advertise_address
        self.address = advertise_address or f"{host}:{port}"
        self.max_queue = max_queue
        self.lease_ttl_s = lease_ttl_s
        self.prompt_limits = prompt_limits or PromptLimits()
        self.engine: Engine | None = None
        self.aengine: AsyncEngine | None = None
        self.publisher: IndexPublisher | None = None
        self.server: grpc.aio.Server | None = None
        self.health: HealthServicer | None = None  # made in start(): it needs the running loop
        self.registry = CollectorRegistry()
        # model_name as vLLM labels its pod metrics, so dashboards can select by model.
        self.metric_labels = {"pod": pod_id, "model_name": engine_args.model}
        self.request_metrics = RequestMetricsExporter(self.registry, self.metric_labels)
        self.metrics_server: WSGIServer | None = None
        self.schema: IndexSchema | None = None
        self.http_port = http_port
        self.http: HttpServer | None = None
        self.http_limits = http_limits or HttpLimits()
        self.served_model_names = served_model_names or [engine_args.model]
        self.api_token = api_token
        self.metrics_token = metrics_token  # the metrics port's bearer token (None: open)
        self.serving = False  # the engine is up and the pod not draining: HTTP's /health
        check_tls_url(redis_url, redis_tls)
        self.tls = tls
        self.redis_tls = redis_tls
        refused = Counter("pagekv_auth_refused", "Calls refused for a missing or wrong bearer "
                          "token, by method and gRPC code",
                          [*self.metric_labels, "method", "code"], registry=self.registry)
        self.guard = TokenGuard(
            api_token, admin_token, ADMIN_METHODS,
            lambda method, code: refused.labels(**self.metric_labels, method=method,
                                                code=code).inc(), tenants=tenants)
        # The fleet's credentials (the router's --pod-api-token is this --api-token) carry a
        # salt already derived from the router's client's tenant (proto/tenant_identity.py).
        self.salting = TenantSalting(tenants, (api_token, admin_token))
        self.tenants = tenants  # the engine's quotas and shared region (engine/tenancy.py)
        self.auth_profile = AuthProfile.of_pod(api_token, admin_token, tls, tenants)
        self.kv_events_config = kv_events
        self.kv_events: VllmEventPublisher | None = None
        self.transfer_config = transfer or TransferConfig()
        self.guard.serve_peers(self.transfer_config.peer_token, PEER_METHODS)
        self.transfer = KvTransferService(self, self.transfer_config)
        self.fetcher: PeerFetcher | None = None
        self.pull_seconds = Histogram(
            "pagekv_kv_pull_seconds", "Cross-pod KV pull: admission to landed in the pool "
            "(failed pulls included)", [*self.metric_labels], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
        self.pulls_by_transport = Counter(
            "pagekv_kv_pulls_by_transport", "Cross-pod KV pulls by the data transport the "
            "pair used (grpc: the blocks in the PullBlocks stream) and outcome (ok, fallback)",
            [*self.metric_labels, "transport", "outcome"], registry=self.registry)
        self.handover_seconds = Histogram(
            "pagekv_handover_seconds", "P/D handovers pulled by this decode pod: admission to "
            "landed (fallbacks included)", [*self.metric_labels], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
        self.handover_bytes = Counter(
            "pagekv_handover_bytes", "P/D handovers: entry bytes received from prefill pods",
            [*self.metric_labels], registry=self.registry)
        self.handover_fallbacks = Counter(
            "pagekv_handover_fallbacks", "P/D handovers that fell back to computing (the rest "
            "of) the prompt here, by reason", [*self.metric_labels, "reason"],
            registry=self.registry)
        self.http_responses = Counter(
            "pagekv_http_requests", "OpenAI API (HTTP) responses by route and status",
            [*self.metric_labels, "route", "status"], registry=self.registry)
        self.prewarm_hottest = prewarm_hottest
        self._published_adapters = False
        self.admin_token = admin_token  # also what it asks its peers' hottest prefixes with
        self.warmup: asyncio.Task | None = None
        self.prewarm_peer_prefixes = Counter(
            "pagekv_pod_prewarm_peer_prefixes", "Peers' hottest prefixes this pod pre-warmed "
            "at start (--prewarm-hottest), by outcome (warmed, failed)",
            [*self.metric_labels, "outcome"], registry=self.registry)
        self.prewarm_peer_tokens = Counter(
            "pagekv_pod_prewarm_peer_tokens", "Tokens of those pre-warms, by source (pulled "
            "from the peer, computed here)", [*self.metric_labels, "source"],
            registry=self.registry)

    def built_engine(self) -> Engine:
        """The engine, once start() has built it (the pod listens first); PodStarting before.
        What can be asked while the model loads checks first: the gRPC calls answer
        UNAVAILABLE, the HTTP API 503."""
        if self.engine is None:
            raise PodStarting(f"pod {self.pod_id} is starting: its engine is not built yet")
        return self.engine

    def http_backend(self, servicer: PodServicer) -> Backend:
        """The pod as the HTTP front end sees it: its own GenerateStream handler."""
        return Backend(
            kind="pod", model_names=self.served_model_names, root=self.args.model,
            tokenizer=lambda: self.built_engine().tokenizer,
            generate_stream=servicer.GenerateStream, ready=lambda: self.serving,
            max_model_len=lambda: self.built_engine().max_model_len,
            api_token=self.api_token, max_body_bytes=8 * self.prompt_limits.max_message_bytes,
            accepts_token=self.salting.names_tenant if self.salting.active else None,
            prompt_limits=self.prompt_limits, metrics=self.registry, limits=self.http_limits,
            headers={"x-pagekv-served-by": self.pod_id},
            on_response=lambda route, status: self.http_responses.labels(
                **self.metric_labels, route=route, status=str(status)).inc(),
            adapters=lambda: self.built_engine().adapters.names(),
            adapter_admin=PodAdapterAdmin(self), admin_token=self.admin_token)

    def load(self) -> dict[str, float]:
        """The load the index lease carries (Engine.load: no full stats per renewal)."""
        return self.built_engine().load().as_fields()

    def adapter_fields(self) -> dict[str, str]:
        """The LoRA adapters this pod serves, for its registration (proto/index/
        pod_adapters.py); once it had some, an empty set is written too (it replaces them)."""
        paths, resident, load_s = self.built_engine().adapters.snapshot()
        if not paths and not self._published_adapters:
            return {}
        self._published_adapters = True
        return adapter_fields(paths, resident, load_s) or {ADAPTERS_FIELD: EMPTY_ADAPTERS}

    def tier_costs(self) -> dict[str, float]:
        """Measured seconds per token (prefill, each tier's reload, a peer pull)."""
        return self.built_engine().tier_costs()

    def wire_hash_config(self, namespace: str = "") -> pb.HashConfig:
        """This pod's hash configuration as the contract carries it (Stats, a pull's ask)."""
        a = self.args
        return pb.HashConfig(algo=a.hash_algo, block_size=a.block_size,
                             seed_fingerprint=self.built_engine().hash_config.fingerprint(),
                             namespace=namespace)

    def stats_response(self) -> pb.StatsResponse:
        st = self.built_engine().stats()
        a = self.args
        tiers = [pb.TierStats(tier=t.medium, used_bytes=t.used_bytes,
                              capacity_bytes=t.capacity_bytes, entries=t.entries)
                 for t in st.tiers.values()]  # the pool, then the chain's tiers
        load = st.load
        return pb.StatsResponse(
            pod_id=self.pod_id, model=a.model, block_size=a.block_size,
            num_blocks=load.num_blocks, num_free_blocks=load.free_blocks, usage=st.usage,
            tiers=tiers, num_waiting=load.waiting, num_running=load.running,
            hash_config=self.wire_hash_config(
                namespace=self.schema.namespace if self.schema else ""),
            epoch=(self.publisher.epoch or "") if self.publisher else "",
            role=a.role, handover_held_blocks=st.handover.held_blocks,
        )

    async def start(self) -> None:
        """Listen first (health NOT_SERVING while the model loads), then join the index, then
        report SERVING: the router never sees an address that refuses connections."""
        self.server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 0),
            # A bigger request could only be refused: gRPC does it before reading it.
            ("grpc.max_receive_message_length", self.prompt_limits.max_message_bytes),
            # The router pings its pod channels (router/pods.py keepalive_options), calls or
            # none, every 2 s at the most (POD_KEEPALIVE_MIN_S): accepted, not answered with
            # GOAWAY too_many_pings (by default: a ping in 5 min without calls).
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        ], interceptors=[self.guard] if self.guard.active or self.guard.peer_token else [])
        servicer = PodServicer(self)
        for service in ("Generation", "KVNode"):
            add_servicer(self.server, pb.DESCRIPTOR.services_by_name[service], servicer)
        self.cache_admin = CacheAdminServicer(self)
        add_servicer(self.server, pb.DESCRIPTOR.services_by_name["CacheAdmin"],
                     self.cache_admin)
        logger.info("limits: %s", self.prompt_limits.describe())
        self.health = pod_health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(pod_health, self.server)
        names = (
            pb.DESCRIPTOR.services_by_name["Generation"].full_name,
            pb.DESCRIPTOR.services_by_name["KVNode"].full_name,
            pb.DESCRIPTOR.services_by_name["CacheAdmin"].full_name,
            health.SERVICE_NAME,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        bound = bind(self.server, f"{self.host}:{self.port}", self.tls)
        if bound == 0:
            raise RuntimeError(f"cannot bind {self.host}:{self.port}")
        self.port = bound
        if self.advertise_address is None:
            self.address = f"{self.host}:{self.port}"
        for data_server in data_servers(self.transfer_config, self.host, self.tls):
            self.transfer.add_data_server(data_server)
            logger.info("KV data transport %s on %s:%s", data_server.name, self.host,
                        getattr(data_server, "port", "-"))
        for name in ("", *names[:2]):
            await pod_health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        try:
            if self.http_port is not None:  # listening already: 503 while the model loads
                self.http = HttpServer(self.http_backend(servicer), self.host, self.http_port,
                                       self.tls)
                self.http_port = await self.http.start()
            await self._start_engine()
        except BaseException:
            await self.stop(0.0)  # no registration or half-started threads left behind
            raise
        self.serving = True
        # The overall status ("") last: a client that sees it SERVING finds start() done,
        # so a SIGTERM from then on takes the draining path, not the stopped-while-starting one.
        for name in (*names[:2], ""):
            await pod_health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("pod %s serving gRPC on %s:%d (%s); %s", self.pod_id, self.host, self.port,
                    transport(self.tls), self.guard.describe())
        if self.prewarm_hottest > 0:  # a scale-out: serve at once, warm in the background
            self.warmup = asyncio.create_task(
                PeerWarmup(self, self.cache_admin, self.prewarm_hottest).run())

    def _enable_pull(self, engine: Engine) -> None:
        """Pull prefixes from the peer a request names (its kv_source), over gRPC."""
        cfg = self.transfer_config
        if not cfg.pull or not self.args.enable_prefix_caching:
            logger.info("cross-pod KV pull: off")
            return
        # The peer token only: a client's API token never opens a peer's PullBlocks.
        self.fetcher = PeerFetcher(self.wire_hash_config(), engine.kv_layout, self.tls,
                                   cfg.peer_token, data_clients(cfg, self.tls))
        labels = self.metric_labels

        def observe(result: PullResult) -> None:
            if result.handover:
                self._observe_handover(result)
            if result.failure == NO_ROOM and not result.transport:
                return  # never started: no time, no transport
            self.pull_seconds.labels(**labels).observe(result.seconds)
            self.pulls_by_transport.labels(
                **labels, transport=result.transport or "none",
                outcome="ok" if result.failure is None else "fallback").inc()

        engine.enable_peer_pull(self.fetcher, cfg.pull_max_concurrent, cfg.pull_deadline_s,
                                observe)
        logger.info("cross-pod KV pull: on (%d at once, %.1fs deadline, transports %s); "
                    "serving peers: %d at once, %d MiB per call, %s", cfg.pull_max_concurrent,
                    cfg.pull_deadline_s, ", ".join(self.fetcher.clients) or "grpc",
                    cfg.serve_max_concurrent, cfg.serve_max_bytes >> 20,
                    "peer token required" if cfg.peer_token else
                    "refused to all (no --peer-api-token)" if self.guard.active else
                    "OPEN to anyone who reaches the port")

    def _observe_handover(self, result: PullResult) -> None:
        """A P/D handover this decode pod pulled (or failed to): its time, bytes, outcome."""
        labels = self.metric_labels
        self.handover_seconds.labels(**labels).observe(result.seconds)
        self.handover_bytes.labels(**labels).inc(result.nbytes)
        if result.failure is not None:
            self.handover_fallbacks.labels(**labels, reason=result.failure).inc()

    async def _start_engine(self) -> None:
        # Building the engine loads weights: keep the event loop free meanwhile. It is built
        # on the thread that will step it (see AsyncEngine.build).
        aengine = await asyncio.to_thread(AsyncEngine.build,
                                          lambda: Engine(self.args, tenants=self.tenants),
                                          self.max_queue)
        engine = self.engine = aengine.engine
        self.aengine = aengine  # from here on stop() shuts it down, started or not
        self._enable_pull(engine)
        if self.redis_url:
            self.schema = IndexSchema(self.args.model, self.args.block_size,
                                      self.args.hash_algo, self.args.hash_seed)
            await asyncio.to_thread(self._check_fleet_auth, self.schema)
            self.publisher = IndexPublisher(
                self.redis_url, self.schema, self.pod_id, self.address,
                {**self.schema.hash_config(), AUTH_CONFIG_FIELD: self.auth_profile.encode()},
                self.load,
                lambda: aengine.call(engine.full_state), self.tier_costs,
                lease_ttl_s=self.lease_ttl_s, redis_tls=self.redis_tls,
                registration=role_fields(self.args.role),
                extra_fields_fn=self.adapter_fields,
            )
            engine.event_sinks.append(self.publisher.submit)
        if self.kv_events_config is not None:
            self.kv_events = VllmEventPublisher(self.kv_events_config)
            await asyncio.to_thread(self.kv_events.start)  # binds: a taken port fails here
            engine.event_sinks.append(self.kv_events.submit)
        aengine.start()
        # One registry for both pages: the metrics port and the HTTP API's /metrics.
        pub = self.publisher
        self.registry.register(EngineCollector(
            engine, self.metric_labels, pub.stats if pub else None,
            (lambda: pub.lag_histogram) if pub else None,
        ))
        if self.kv_events is not None:
            self.registry.register(self.kv_events.collector(self.metric_labels))
        if self.metrics_port is not None:
            self.metrics_server = metrics = serve_metrics(self.registry, self.host,
                                                          self.metrics_port, self.metrics_token)
            self.metrics_port = metrics.server_port
            logger.info("metrics on http://%s:%d/metrics (%s)", self.host, self.metrics_port,
                        "bearer token required" if self.metrics_token else "open")
        if self.publisher is not None and not await asyncio.to_thread(self.publisher.start):
            logger.warning("Redis index at %s unreachable; serving anyway, will retry",
                           redact_url(self.redis_url))

    def _check_fleet_auth(self, schema: IndexSchema) -> None:
        """JoinRefused when the routers' fleet auth (written to the index) differs from this
        pod's: it would be open where the fleet is not, or derive other salts. Redis
        unreachable: not checked here; every router still checks the published settings."""
        assert self.redis_url is not None
        try:
            client = connect(self.redis_url, 2.0, self.redis_tls)
            try:
                written = client.get(fleet_auth_key(schema))
            finally:
                client.close()
        except REDIS_ERRORS:
            return
        if written is None:
            return  # no router has started on this namespace yet: routers check at join
        fleet = AuthProfile.decode(text(written))
        diff = None if fleet is None else auth_mismatch(fleet, self.auth_profile)
        if diff:
            raise JoinRefused(f"pod {self.pod_id} refused at join: its auth settings differ "
                              f"from the fleet's: {diff}")

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Leave the index first (routers stop sending here), then stop the gRPC server:
        new calls get UNAVAILABLE — a router retries them elsewhere — while in-flight
        requests finish within the drain timeout."""
        self.serving = False  # new HTTP requests get 503, as new gRPC calls UNAVAILABLE
        if self.warmup is not None and not self.warmup.done():
            self.warmup.cancel()
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.stop, True)
        draining = []
        if self.server is not None:
            draining.append(self.server.stop(grace=drain_timeout_s))
        if self.http is not None:
            draining.append(self.http.stop(drain_timeout_s))
        await asyncio.gather(*draining)
        if self.aengine is not None:
            self.aengine.shutdown()
        if self.kv_events is not None:
            self.kv_events.stop()
        if self.fetcher is not None:
            self.fetcher.close()
        self.transfer.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()  # a restarted pod in this process rebinds the port
            self.metrics_server.server_close()
        logger.info("pod %s stopped", self.pod_id)
