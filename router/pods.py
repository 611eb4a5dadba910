"""Pod discovery from the index, the configuration handshake, and one channel per pod.

Every `refresh_interval_s` the registry reads the live pods of the router's namespace (one
script, one round trip) and keeps a grpc.aio channel per pod address. Lookups read no lease
(on a Redis Cluster the leases sit on another shard than a request's claims): they take
the pods and epochs from here, so the registry is the bound on staleness. It refreshes at
least twice per lease's remaining time, and a pod whose lease, as last read, has run out is
dropped at once, refresh or not. A pod whose published
hash configuration differs from the router's is kept but marked ineligible, with one warning
line per pod. Pods registered under another namespace (another seed, algorithm, block size
or model) cannot appear in ours at all; every few seconds the registry also lists the
namespaces and warns once per such pod, so an operator sees why it is never chosen.

When Redis cannot be read the registry keeps the last known pods, flags the index as down
(the router then routes by load only) and keeps probing; the first successful read flips it
back.

Pod channels use the router's own pod credentials (`RouterConfig.pod_tls`,
`pod_api_token`), never a client's: a client's token authenticates it to the router only.
A vLLM pod (registered `kind=vllm` by `pagekv ingest-vllm`) is reached over its OpenAI HTTP
server instead (router/openai_forward.py, with the pod token as its API key): its stub has
the same two methods. An https:// one is checked against `RouterConfig.vllm_tls`'s CA (else
the system's), and gets the router's client certificate from there when it asks for one.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import redis.exceptions

from pagekv.proto.auth_profile import (
    AUTH_CONFIG_FIELD,
    AuthProfile,
    auth_mismatch,
    fleet_auth_key,
    mismatched_settings,
)
from pagekv.proto.credentials import TlsFiles, bearer, client_ssl_context
from pagekv.proto.grpc_security import channel_credentials, open_channel
from pagekv.proto.index import REDIS_ERRORS, IndexClient, IndexSchema, PodInfo, config_mismatch
from pagekv.proto.index.queries import LivePods
from pagekv.proto.index.schema import POD_KIND_VLLM
from pagekv.proto.pagekv.v1 import pagekv_pb2, pagekv_pb2_grpc
from pagekv.router.metrics import RouterMetrics
from pagekv.router.openai_forward import VllmStub
from pagekv.router.stall import StallBound

logger = logging.getLogger(__name__)

_FINISHED_KEEP = 4096  # completion times kept per pod
_RECENT_HALF_LIFE_S = 10.0  # memory of "how much have we sent there lately"
_WIPED_GRACE_S = 30.0  # keep the last known pods this long while the index is empty
_CHANNEL_IDLE_CLOSE_S = 30.0  # close a departed pod's channel once unused this long
_MIN_REFRESH_S = 0.05  # however short a lease: not a busy loop
_STEP_EWMA = 0.3  # weight of the newest call in a pod's measured step time
_CHANNEL_OPTIONS = [
    ("grpc.enable_retries", 0),  # the router decides retries itself (next-best pod)
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


def keepalive_options(interval_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """HTTP/2 pings on a pod channel, calls or none: a pod that acks none within
    `timeout_s` (stopped, its host gone, the path cut) has its connection closed, and the
    calls on it fail UNAVAILABLE (retried on the next-best pod before the first token)
    instead of waiting out their deadlines. `interval_s` 0: no pings."""
    if interval_s <= 0:
        return []
    return [("grpc.keepalive_time_ms", int(interval_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
            # gRPC core times out the ping's ack by this one (grpc/grpc#39239): set both.
            ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]  # an idle channel keeps pinging too


class BearerStub:
    """A pod's Generation stub that sends the router's token with every call."""

    __slots__ = ("_metadata", "_stub")

    def __init__(self, stub: pagekv_pb2_grpc.GenerationStub, token: str) -> None:
        self._stub = stub
        self._metadata = bearer(token)

    # The calls are Any: grpcio-tools generates the stub's module without types.
    def Generate(self, request: pagekv_pb2.GenerateRequest, **kwargs: Any  # noqa: N802
                 ) -> Any:  # (the stub's method names)
        return self._stub.Generate(request, metadata=self._metadata, **kwargs)

    def GenerateStream(self, request: pagekv_pb2.GenerateRequest, **kwargs: Any  # noqa: N802
                       ) -> Any:
        return self._stub.GenerateStream(request, metadata=self._metadata, **kwargs)


@dataclass(slots=True)
class PodEntry:
    info: PodInfo
    stub: pagekv_pb2_grpc.GenerationStub | BearerStub | VllmStub
    excluded_reason: str = ""  # non-empty: never routed to (hash configuration mismatch)
    inflight: int = 0
    unavailable_until: float = 0.0  # monotonic time; tried last until then
    stalled_until: float = 0.0  # monotonic time; cooling after a stall (router/stall.py)
    stalls_in_a_row: int = 0  # stalls since its last call that made progress
    step_s: float = 0.0  # seconds per generation step as measured here (0: not yet)
    finished: list[float] = field(default_factory=list)  # unix times our calls ended
    lease_until: float = 0.0  # monotonic time its lease, as last read, runs out
    # Told when this pod's queue drops (a call of ours ended): router/fleet_view.py.
    on_load: Callable[[PodEntry], None] | None = field(default=None, repr=False)
    _recent: float = 0.0  # requests routed here, decayed with _RECENT_HALF_LIFE_S
    _recent_at: float = 0.0
    _published: int = 0  # waiting + running of `_published_of` (the info it was read from)
    _published_of: PodInfo | None = field(default=None, repr=False)
    _backlog: float = 0.0  # prompt tokens we sent here to compute, as of _backlog_at
    _backlog_at: float = 0.0

    def backlog(self, per_token_s: float, now: float | None = None) -> float:
        """Prompt tokens waiting to be computed here: what we sent (each request's
        uncached part), drained at the pod's measured prefill rate since, or what the pod
        published (`load.prefill_backlog`, everyone's, up to a lease renewal old) where
        more. A prefill's tokens are gone once the pod has had the time to compute them, or
        once none of our calls there is left in flight (`call_finished`)."""
        now = time.monotonic() if now is None else now
        return max(self._ours(per_token_s, now), self.info.load.get("prefill_backlog", 0.0))

    def add_backlog(self, tokens: int, per_token_s: float) -> None:
        now = time.monotonic()
        self._backlog = self._ours(per_token_s, now) + max(tokens, 0)
        self._backlog_at = now

    def _ours(self, per_token_s: float, now: float) -> float:
        if self._backlog <= 0 or per_token_s <= 0:
            return self._backlog
        return max(0.0, self._backlog - (now - self._backlog_at) / per_token_s)

    def recent(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        decay: float = 0.5 ** ((now - self._recent_at) / _RECENT_HALF_LIFE_S)
        return self._recent * decay

    def note_dispatch(self) -> None:
        now = time.monotonic()
        self._recent = self.recent(now) + 1.0
        self._recent_at = now

    def call_finished(self) -> None:
        now = time.time()
        self.finished.append(now)
        if len(self.finished) > _FINISHED_KEEP:  # keep a few lease renewals' worth
            cut = bisect.bisect_right(self.finished, now - 5.0)
            del self.finished[:max(cut, len(self.finished) - _FINISHED_KEEP)]
        # None of ours left in flight: every prompt we sent here is computed.
        if self.inflight <= 0:
            self._backlog = 0.0
        if self.on_load is not None:
            self.on_load(self)

    def finished_since_load(self) -> int:
        """Our calls that ended after the pod last published its load."""
        return len(self.finished) - bisect.bisect_right(self.finished, self.info.updated_at)

    def queue(self) -> int:
        """Requests ahead of a new one here: the published load less ours that finished
        since it was published, or our own calls in flight where more (scoring.Candidate's)."""
        info = self.info
        if self._published_of is not info:  # read once per registration read, not per call
            self._published = info.waiting + info.running
            self._published_of = info
        published = self._published
        if self.finished:
            published -= self.finished_since_load()
        return max(published, self.inflight, 0)

    def note_steps(self, seconds: float, steps: int) -> None:
        """A call here took `seconds` for `steps` generated tokens (per completion): the
        step time the unary stall bound counts with, prefill included (an overestimate)."""
        if steps <= 0:
            return
        measured = seconds / (steps + 1)
        self.step_s = measured if not self.step_s else \
            (1 - _STEP_EWMA) * self.step_s + _STEP_EWMA * measured

    def made_progress(self) -> None:
        """A call here got its first chunk (or response) in time: the next stall starts
        the cooldowns from the shortest again."""
        self.stalls_in_a_row = 0

    @property
    def pod_id(self) -> str:
        return self.info.pod_id

    @property
    def eligible(self) -> bool:
        return not self.excluded_reason


@dataclass(frozen=True, slots=True)
class ForeignPod:
    """A live pod registered under another namespace: listed, never routed to."""

    pod_id: str
    address: str
    namespace: str
    reason: str


@dataclass(slots=True)
class _Channel:
    channel: grpc.aio.Channel | VllmStub  # what close() closes
    stub: pagekv_pb2_grpc.GenerationStub | BearerStub | VllmStub
    last_seen: float = field(default_factory=time.monotonic)


class PodRegistry:
    def __init__(self, index: IndexClient, metrics: RouterMetrics,
                 refresh_interval_s: float = 0.5, namespace_check_interval_s: float = 2.0,
                 reap_dead_after_s: float = 60.0, *, pod_tls: TlsFiles | None = None,
                 pod_token: str | None = None, vllm_tls: TlsFiles | None = None,
                 keepalive: tuple[float, float] = (0.0, 0.0)) -> None:
        """`keepalive`: (interval, timeout) seconds of the pod channels' pings (0: none)."""
        self.index = index
        self.schema = index.schema
        self.metrics = metrics
        self.refresh_interval_s = refresh_interval_s
        self.namespace_check_interval_s = namespace_check_interval_s
        self.pods: dict[str, PodEntry] = {}
        self.foreign: list[ForeignPod] = []
        self._live: LivePods | None = None  # live_pods(), for this `pods` dict and size
        self._live_of: dict[str, PodEntry] | None = None
        self._live_len = 0
        self._next_expiry = 0.0  # monotonic: no lease, as last read, runs out before this
        self._expiry_of: dict[str, PodEntry] | None = None  # the pods it was computed for
        # Called after every change of `pods` (a refresh, a lease that ran out), so what the
        # router derives from the whole fleet is rebuilt there, off a decision's clock.
        self.listeners: list[Callable[[], object]] = []
        self.index_up = False
        self.ready = asyncio.Event()  # set after the first successful read of the index
        self._channels: dict[str, _Channel] = {}
        self._warned: set[tuple[str, str]] = set()
        self._down_since = 0.0
        self._next_ns_check = 0.0
        self.reap_dead_after_s = reap_dead_after_s  # 0: never
        self._dead_since: dict[tuple[str, str], float] = {}  # (pod, epoch) -> first seen
        self._task: asyncio.Task[None] | None = None
        self._reaping: asyncio.Task[None] | None = None  # one reap at a time, off the refresh
        # What pods must publish as their auth settings (proto/auth_profile.py); None: not
        # checked. Written to the index once read, for pods to check themselves at join.
        self.fleet_auth: AuthProfile | None = None
        self._fleet_auth_written = False
        # Read once: a bad file fails the router's start, not each new pod's channel.
        self._pod_credentials = channel_credentials(pod_tls) if pod_tls is not None else None
        try:  # for https:// vLLM pods only
            self._vllm_ssl = client_ssl_context(vllm_tls)
        except ValueError as exc:
            raise ValueError(f"TLS to vLLM pods: {exc}") from None
        self._pod_token = pod_token
        self._channel_options = _CHANNEL_OPTIONS + keepalive_options(*keepalive)
        logger.info("pod channels: %s%s", "TLS, " + pod_tls.describe() if pod_tls else
                    "plaintext", "; with the router's pod token" if pod_token else "")
        if vllm_tls is not None:
            logger.info("https:// vLLM pods: %s", vllm_tls.describe())

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pod-registry")

    async def close(self) -> None:
        for task in (self._task, self._reaping):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._task = self._reaping = None
        for ch in self._channels.values():
            await ch.channel.close()
        self._channels.clear()

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or a malformed registration must not stop discovery
                logger.exception("pod registry refresh failed; keeping the last known pods")
            await asyncio.sleep(self.next_refresh_s())

    def next_refresh_s(self) -> float:
        """`refresh_interval_s`, or half the shortest lease time left when that is sooner:
        a renewed lease is seen before the one last read runs out."""
        leases = [p.info.lease_ms / 2000 for p in self.pods.values() if p.info.lease_ms > 0]
        return max(_MIN_REFRESH_S, min([self.refresh_interval_s, *leases]))

    # -- index state -----------------------------------------------------------------------
    def index_failed(self, op: str, exc: BaseException) -> None:
        """Record a failed Redis operation (here or in a lookup); warn once per outage."""
        self._index_down(op, f"unreachable ({type(exc).__name__}: {exc})")

    def _index_down(self, op: str, why: str) -> None:
        self.metrics.index_errors.labels(op=op).inc()
        if self.index_up or not self._down_since:
            self._down_since = time.monotonic()
            logger.warning("redis index %s: routing by load only among the %d last known "
                           "pods until it answers again", why,
                           sum(1 for p in self.pods.values() if p.eligible))
        self.index_up = False
        self.metrics.index_up.set(0)

    async def _index_wiped(self) -> bool:
        """No live pod, while we know some, and either not even our namespace's config key
        (Redis restarted empty or was flushed) or an outage just ended (a failover: the
        leases ran out while no pod could renew them). The pods have not re-registered yet;
        they are most likely fine: keep routing to them by load for a grace period."""
        if not self.pods or (not self._down_since and await self.index.has_config()):
            return False
        if self._down_since and time.monotonic() - self._down_since > _WIPED_GRACE_S:
            return False  # nobody came back: believe the empty index
        self._index_down("empty_index", "lists no live pod (restarted, flushed or failed "
                         "over?)")
        return True

    def _index_ok(self) -> None:
        if not self.index_up and self._down_since:
            logger.warning("redis index reachable again after %.1fs: prefix routing resumed",
                           time.monotonic() - self._down_since)
        self._down_since = 0.0
        self.index_up = True
        self.metrics.index_up.set(1)

    async def refresh(self) -> bool:
        """Read the live pods once; False (and state kept) when Redis fails."""
        read_at = time.monotonic()  # leases are counted from before the read: never late
        try:
            infos = await self.index.list_live_pods()
            if not infos and await self._index_wiped():
                return False
            now = time.monotonic()
            if now >= self._next_ns_check:
                self._next_ns_check = now + self.namespace_check_interval_s
                await self._check_namespaces()
                if self.reap_dead_after_s > 0:
                    await self._reap_dead(now)
        except REDIS_ERRORS as exc:
            self.index_failed("list_pods", exc)
            return False
        self._index_ok()
        self._apply(infos, read_at)
        self.ready.set()
        await self._write_fleet_auth()
        return True

    async def _write_fleet_auth(self) -> None:
        """Write the fleet's auth settings once, for pods to check at join. Redis may
        refuse a router's write (the ACL `router` role is read-only): said once, not
        retried, and never an index failure; the router still checks every pod."""
        if self.fleet_auth is None or self._fleet_auth_written:
            return
        try:
            await self.index.redis.set(fleet_auth_key(self.schema), self.fleet_auth.encode())
        except redis.exceptions.ResponseError as exc:  # NOPERM: this user may not write
            logger.warning("cannot write the fleet's auth settings to the index (%s): pods "
                           "cannot check theirs at join; this router still refuses a pod "
                           "that differs", exc)
        except REDIS_ERRORS:
            return  # unreachable now: the next refresh tries again
        self._fleet_auth_written = True

    def drop_expired(self, now: float | None = None) -> None:
        """Forget pods whose lease, as last read, has run out (dead since the last refresh).
        Only while the index answers: when it does not, the last known pods are all there
        is, and they are routed to by load."""
        if not self.index_up:
            return
        now = time.monotonic() if now is None else now
        if now < self._next_expiry and self._expiry_of is self.pods:
            return  # the per-request case: O(1)
        gone = [p for p in self.pods.values() if p.lease_until <= now]
        for entry in gone:
            del self.pods[entry.pod_id]
            logger.info("pod %s at %s: lease ran out; no longer routed to", entry.pod_id,
                        entry.info.address)
        if gone:
            self._changed()
        else:
            self._note_expiry()

    def _note_expiry(self) -> None:
        self._next_expiry = min((p.lease_until for p in self.pods.values()),
                                default=float("inf"))
        self._expiry_of = self.pods

    def _changed(self) -> None:
        self._note_expiry()
        self._update_gauges()
        for listener in self.listeners:
            listener()

    def live_epochs(self) -> dict[str, str]:
        """Pod id -> live epoch of every eligible pod: what a lookup matches claims with."""
        return {p.pod_id: p.info.epoch for p in self.pods.values() if p.eligible}

    def live_pods(self) -> LivePods:
        """live_epochs() packed for the lookup script: built once until the pods change (a
        refresh or a lease that ran out), not per request."""
        # Every refresh builds a new pods dict; a lease that runs out removes an entry.
        if self._live is None or self._live_of is not self.pods or \
                self._live_len != len(self.pods):
            self._live = LivePods.of(p.info for p in self.pods.values() if p.eligible)
            self._live_of, self._live_len = self.pods, len(self.pods)
        return self._live

    def _apply(self, infos: list[PodInfo], read_at: float) -> None:
        now = time.monotonic()
        mine = self.schema.hash_config()
        fresh: dict[str, PodEntry] = {}
        for info in infos:
            old = self.pods.get(info.pod_id)
            reason = self._mismatch(info, mine)
            ch = self._channel(info, now)
            if old is not None and old.info.address == info.address:
                old.info, old.stub, old.excluded_reason = info, ch.stub, reason
                entry = fresh[info.pod_id] = old
            else:
                entry = fresh[info.pod_id] = PodEntry(info, ch.stub, reason)
                if not reason:
                    logger.info("pod %s at %s (epoch %s) joined", info.pod_id, info.address,
                                info.epoch)
            # (A lease without a TTL, PTTL -1, never runs out: no pod of ours writes one.)
            entry.lease_until = read_at + info.lease_ms / 1000 if info.lease_ms >= 0 \
                else float("inf")
        for pod_id, entry in self.pods.items():
            if pod_id not in fresh:
                logger.info("pod %s at %s: lease expired; no longer routed to", pod_id,
                            entry.info.address)
        self.pods = fresh
        self._close_idle_channels(now)
        self._changed()

    def _update_gauges(self) -> None:
        eligible = sum(1 for p in self.pods.values() if p.eligible)
        self.metrics.live_pods.set(eligible)
        self.metrics.excluded_pods.set(len(self.pods) - eligible + len(self.foreign))

    def _mismatch(self, info: PodInfo, mine: dict[str, str]) -> str:
        diff = config_mismatch(mine, info.hash_config)
        if not diff:
            return self._auth_refusal(info)
        reason = f"hash config mismatch: {diff} (router vs pod)"
        if (info.pod_id, reason) not in self._warned:
            self._warned.add((info.pod_id, reason))
            logger.warning("pod %s at %s refused: %s; its block hashes cannot match this "
                           "router's", info.pod_id, info.address, reason)
        return reason

    def _auth_refusal(self, info: PodInfo) -> str:
        """Why a pod whose auth settings differ from the fleet's is refused ('' if they
        agree, or it publishes none: a vLLM pod's ingester, an older publisher)."""
        published = info.hash_config.get(AUTH_CONFIG_FIELD)
        if self.fleet_auth is None or published is None or info.kind == POD_KIND_VLLM:
            return ""
        pod = AuthProfile.decode(published)
        diff = auth_mismatch(self.fleet_auth, pod)
        if not diff:
            return ""
        reason = f"auth settings differ from the fleet's: {diff}"
        if (info.pod_id, reason) not in self._warned:
            self._warned.add((info.pod_id, reason))
            for setting in mismatched_settings(self.fleet_auth, pod):
                self.metrics.join_refused.labels(setting=setting).inc()
            logger.warning("pod %s at %s refused at join: %s; it is never routed to",
                           info.pod_id, info.address, reason)
        return reason

    async def _check_namespaces(self) -> None:
        """Find live pods under other namespaces and warn once per pod about why."""
        s = self.schema
        foreign: list[ForeignPod] = []
        for ns, config in (await self.index.other_namespaces()).items():
            try:
                other = IndexSchema.from_config(config, prefix=s.prefix)
            except ValueError:
                continue  # an incomplete config key: nothing we can look up
            diff = config_mismatch(s, other) or "namespace differs"
            for info in await self.index.list_live_pods(other):
                foreign.append(ForeignPod(info.pod_id, info.address, ns, diff))
        for pod in foreign:
            key = (pod.pod_id, f"{pod.namespace}:{pod.reason}")
            if key not in self._warned:
                self._warned.add(key)
                logger.warning(
                    "pod %s at %s is registered under index namespace %s, not this router's "
                    "%s: %s (router vs pod); it is never routed to", pod.pod_id, pod.address,
                    pod.namespace, s.namespace, pod.reason)
        self.foreign = foreign

    async def _reap_dead(self, now: float) -> None:
        """Remove the claims and registration of pod ids that have had no lease for
        `reap_dead_after_s` (by this router's clock). A pod that stops cleanly removes its
        own; one that crashed and never came back under the same id would otherwise leave
        them in Redis for good. Several routers may reap at once: each step is conditional.
        The removal runs as its own task (a round trip per bucket the pod used), so the
        refresh, which bounds how stale the pods of a lookup are, never waits for it."""
        dead = await self.index.dead_pods()
        seen = set(dead.items())
        self._dead_since = {k: t for k, t in self._dead_since.items() if k in seen}
        if self._reaping is not None and not self._reaping.done():
            return
        due = [(pod_id, epoch, now - self._dead_since.setdefault((pod_id, epoch), now))
               for pod_id, epoch in dead.items()]
        due = [d for d in due if d[2] >= self.reap_dead_after_s]
        if due:
            self._reaping = asyncio.get_running_loop().create_task(self._reap(due),
                                                                   name="reap-dead-pods")

    async def _reap(self, due: list[tuple[str, str, float]]) -> None:
        for pod_id, epoch, dead_s in due:
            try:
                removed = await self.index.reap_pod(pod_id, epoch)
            except REDIS_ERRORS as exc:  # the next check tries again
                logger.warning("reaping pod %s failed (%s); will retry", pod_id, exc)
                return
            self._dead_since.pop((pod_id, epoch), None)
            if removed is None:
                continue  # it came back meanwhile
            self.metrics.reaped_pods.inc()
            self.metrics.reaped_claims.inc(removed)
            logger.warning("pod %s (epoch %s) has had no lease for %.0fs: removed its %d block "
                           "claims and its registration from the index", pod_id,
                           epoch or "unregistered", dead_s, removed)

    # -- channels --------------------------------------------------------------------------
    def _channel(self, info: PodInfo, now: float) -> _Channel:
        vllm = info.kind == POD_KIND_VLLM
        address = (info.http_address or info.address) if vllm else info.address
        key = f"openai:{address}" if vllm else address
        ch = self._channels.get(key)
        if ch is None and vllm:
            http = VllmStub(address, self._pod_token, ssl_context=self._vllm_ssl)
            ch = self._channels[key] = _Channel(http, http, now)
        elif ch is None:
            channel = open_channel(address, options=self._channel_options, aio=True,
                                   credentials=self._pod_credentials)
            stub = pagekv_pb2_grpc.GenerationStub(channel)
            ch = _Channel(channel, BearerStub(stub, self._pod_token) if self._pod_token
                          else stub, now)
            self._channels[key] = ch
        ch.last_seen = now
        return ch

    def admin_stub(self, pod_id: str) -> Any:
        """A CacheAdmin stub on a PageKV pod's channel (None: unknown, or a vLLM pod, which
        has no such service). The caller passes the admin credential with each call."""
        entry = self.pods.get(pod_id)
        if entry is None or entry.info.kind == POD_KIND_VLLM:
            return None
        ch = self._channel(entry.info, time.monotonic())
        assert not isinstance(ch.channel, VllmStub)
        return pagekv_pb2_grpc.CacheAdminStub(ch.channel)

    def _close_idle_channels(self, now: float) -> None:
        # Closed late, so calls still running on a departed pod's channel can finish.
        for address, ch in list(self._channels.items()):
            if now - ch.last_seen > _CHANNEL_IDLE_CLOSE_S:
                del self._channels[address]
                asyncio.get_running_loop().create_task(ch.channel.close())

    # -- per-request helpers ---------------------------------------------------------------
    def eligible(self) -> list[PodEntry]:
        return [p for p in self.pods.values() if p.eligible]

    def mark_unavailable(self, pod_id: str, cooldown_s: float) -> None:
        entry = self.pods.get(pod_id)
        if entry is not None:
            entry.unavailable_until = max(entry.unavailable_until, time.monotonic() + cooldown_s)

    def mark_stalled(self, pod_id: str, bound: StallBound) -> tuple[float, int]:
        """A call there made no progress within its bound: tried last (and lent nothing)
        for a cooldown doubled per stall in a row. Returns (cooldown seconds, stalls)."""
        entry = self.pods.get(pod_id)
        if entry is None:
            return 0.0, 0
        entry.stalls_in_a_row += 1
        cooldown = bound.cooldown_after(entry.stalls_in_a_row)
        until = time.monotonic() + cooldown
        entry.stalled_until = until
        entry.unavailable_until = max(entry.unavailable_until, until)
        return cooldown, entry.stalls_in_a_row

    def cooling(self) -> int:
        """Pods cooling after a stall right now (the cooling gauge)."""
        now = time.monotonic()
        return sum(1 for p in self.pods.values() if p.stalled_until > now)
