"""Publishes one pod's KV events to the Redis index, and keeps it registered under a lease.

The engine's step loop calls `submit(events)`, which only appends to an in-memory queue. A
background thread applies the events in order to a local mirror (block hash -> tier bitmask)
and writes the net change of what was queued in one pipelined round trip, `flush_interval_s`
after the previous write at the earliest (submits in between are coalesced); each claim goes
to the bucket of its chain's block 0, learned from the events' parent links
(proto.index.placement). The same thread renews the lease every second with the pod's
current load. Between those it sleeps: the first submit after a write wakes it, the others
do not, so an idle pod's publisher costs one wake-up per renewal.

An owner that places its blocks itself (`placed=True`: the vLLM ingester) submits lists of
claim changes instead of events, and its full state is already what to publish
(proto.index.mirror.PlacedClaims). An owner with a loop of its own may also drive the
publisher from it (`start(thread=False)`, then `step()` when due) instead of giving it a
thread: one wake-up serves both (a wake-up costs more CPU than a small batch's writes).

Failure policy: the index is a hint, the pod keeps serving. When Redis is unreachable the
queued deltas are dropped (nothing grows without bound) and the state is marked dirty; the
thread reconnects with capped exponential backoff, jittered (proto/backoff.py: pods that lost
Redis together do not retry in lockstep), and then republishes the FULL state from
`full_state_fn()` instead of trusting a partial index.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pagekv.kvnode.index.publish_queue import EventQueue, Publishable
from pagekv.kvnode.index.publish_stats import PublishCounters
from pagekv.kvnode.memory.metrics import Histogram
from pagekv.proto.backoff import jittered_backoff_s
from pagekv.proto.credentials import TlsFiles
from pagekv.proto.index import writes
from pagekv.proto.index.connect import REDIS_ERRORS, check_tls_url, connect, drop_connections
from pagekv.proto.index.handshake import config_mismatch
from pagekv.proto.index.mirror import PlacedClaims, PodClaims
from pagekv.proto.index.schema import IndexSchema, new_epoch

logger = logging.getLogger(__name__)

_BACKOFF_START_S = 0.05
_BACKOFF_CAP_S = 2.0


class _Superseded(Exception):
    """Another instance registered the same pod id with a newer epoch."""


class IndexPublisher:
    """One pod's writer to the index. Thread-safe `submit`; everything else on one thread.

    `full_state_fn()` must be callable from the publisher thread and return every hashed
    block the pod holds (hash -> "GPU" | "CPU" | "DISK"; with `placed=True`, bucket -> hex
    hash -> tier mask), reflecting at least every event already submitted. `load_fn()`
    returns numbers such as waiting, running, free_blocks.
    `tier_costs_fn()` returns seconds per token to reload a block from each tier.
    """

    def __init__(
        self,
        redis_url: str,
        schema: IndexSchema,
        pod_id: str,
        address: str,
        hash_config: dict[str, Any],
        load_fn: Callable[[], dict[str, float]],
        full_state_fn: Callable[[], Mapping[Any, Any]],  # (see the class docstring)
        tier_costs_fn: Callable[[], dict[str, float]] | None = None,
        lease_ttl_s: float = 3.0,
        flush_interval_s: float = 0.05,
        *,
        max_pending: int = 100_000,
        socket_timeout_s: float = 1.0,
        redis_tls: TlsFiles | None = None,
        registration: Mapping[str, str] | None = None,
        placed: bool = False,
        renew_every_third: bool = False,
        retire_after_s: float | None = None,
        extra_fields_fn: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        if not pod_id or any(c in pod_id for c in " \t\r\n"):
            raise ValueError(f"pod_id must be non-empty without whitespace, got {pod_id!r}")
        if lease_ttl_s <= 0 or flush_interval_s <= 0:
            raise ValueError("lease_ttl_s and flush_interval_s must be positive")
        config = {str(k): str(v) for k, v in hash_config.items()}
        diff = config_mismatch(schema, {**schema.hash_config(), **config})
        if diff:
            raise ValueError(f"hash_config disagrees with the index namespace: {diff}")
        self.redis_url = redis_url
        self.schema = schema
        self.pod_id = pod_id
        self.address = address
        # Fields written once per registration (writes.kind_fields: how the pod is reached).
        self.registration = dict(registration or {})
        self.hash_config = {**schema.hash_config(), **config}
        self._load_fn = load_fn
        self._full_state_fn = full_state_fn
        self._tier_costs_fn = tier_costs_fn
        # More fields renewed with the lease (a pod's LoRA adapters: proto/index/pod_adapters).
        self._extra_fields_fn = extra_fields_fn
        self.lease_ttl_s = lease_ttl_s
        self.flush_interval_s = flush_interval_s
        # Every second at least, for the load it carries; a pod without load to tell (the
        # vLLM ingester's) may renew only every third of its lease (`renew_every_third`).
        self.renew_interval_s = lease_ttl_s / 3.0 if renew_every_third else min(
            1.0, lease_ttl_s / 3.0)
        self._lease_ms = int(lease_ttl_s * 1000)
        self.max_pending = max_pending
        self.epoch = ""

        # Our loop owns the retries. TLS files: rediss:// only (checked there). A cluster
        # client reads the slot map as it is built, so it is built by the thread's first
        # sync (and retried like any command): a pod starts while its Redis is down.
        check_tls_url(redis_url, redis_tls)
        self._connect: Callable[[], Any] = lambda: connect(redis_url, socket_timeout_s,
                                                           redis_tls)
        self._client: Any = None

        self._events = EventQueue(max_pending)  # shared with submit()

        # Owned by the publisher thread.
        # What `placed` decides twice: what the owner submits (KV events; lists of claim
        # changes when placed) and the claims that read it. The two calls that hand the
        # queued items to the claims are unchecked for it (the ignores below).
        self._claims: PodClaims | PlacedClaims = PlacedClaims() if placed else PodClaims()
        self._listed: set[int] = set()  # the pod's bucket list as written
        # This registration's claim id: every resync registers anew under a new one (what
        # landed under the last is uncertain), and the last ones' claims are stripped
        # `retire_after_s` later, once no router counts them any more (their registries
        # refresh at least twice per lease).
        self._claim_id = b""
        self.retire_after_s = lease_ttl_s if retire_after_s is None else retire_after_s
        self._strip_at = 0.0  # monotonic time the retired claim ids are due to go (0: none)
        self._applied_seq = 0
        self._needs_resync = True
        self._registered_once = False
        self._connected = False
        self._down_since = 0.0
        self._retries = 0  # waits since the last successful sync (the backoff's exponent)
        self._next_renew = 0.0
        self._last_write = 0.0
        # Set by the first submit after the thread took the queue (so only that one wakes
        # it), and by flush() (write now, whatever the interval).
        self._woken = False
        self._flush_asked = False
        self._driven = False  # start(thread=False): the owner calls step()
        # Called (from any thread) when a driven publisher wants its owner to step soon.
        self.on_wake: Callable[[], None] | None = None

        self._visible = threading.Condition()
        self._visible_seq = 0
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._superseded = False
        self._pause = False  # asked for (pause/resume)
        self._left = False  # done: out of the index while paused

        self._counters = PublishCounters()

    # -- engine side ---------------------------------------------------------------------
    def submit(self, events: Iterable[Publishable]) -> None:
        """Queue events (placed: lists of claim changes) for publication, in order. Never
        blocks on Redis."""
        if self._events.submit(events):
            logger.warning("index publisher %s: more than %d events pending; dropping them "
                           "and republishing the full state", self.pod_id, self.max_pending)
            self._poke()
        elif not self._woken:  # read after the append: see _publish_pending
            self._woken = True
            if not self._driven:  # (a driven one's owner steps after submitting)
                self._wake.set()

    def _poke(self) -> None:
        self._wake.set()
        if self.on_wake is not None:
            self.on_wake()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 5.0, *, thread: bool = True) -> bool:
        """New epoch, register, republish the full state (dropping the previous epoch's
        claims of this pod id). Returns whether that first sync finished within `timeout`;
        if Redis is down it keeps trying (in the background, or at each step()) and never
        raises for it. thread=False: no thread; the caller's loop calls step() when it is
        due (it tries the first sync here, for `timeout` at most)."""
        if self._thread is not None or self.epoch:
            raise RuntimeError("IndexPublisher already started")
        self.epoch = new_epoch()
        if thread:
            self._thread = threading.Thread(
                target=self._run, name=f"index-publisher-{self.pod_id}", daemon=True)
            self._thread.start()
            ok = self._synced.wait(timeout)
        else:
            self._driven = True
            deadline = time.monotonic() + timeout
            while (not self._synced.is_set() and not self._stop.is_set()
                   and time.monotonic() < deadline):
                self.step()
            ok = self._synced.is_set()
        if not ok:
            logger.warning("index publisher %s: first sync not done after %.1fs; retrying in "
                           "the background", self.pod_id, timeout)
        return ok

    def pause(self) -> None:
        """Leave the index until resume(): the thread removes this pod's claims and
        registration and drops what is submitted meanwhile, keeping what it learned of the
        chains; resume() re-registers and republishes the full state. For a pod that does
        not serve for a while (the vLLM ingester's, when its /health fails)."""
        self._pause = True
        self._poke()

    def resume(self) -> None:
        self._pause = False
        self._poke()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every event submitted so far is visible in Redis. (Driven: from
        another thread than the owner's loop, which must step meanwhile.)"""
        target = self._events.seq
        self._flush_asked = True
        self._poke()
        deadline = time.monotonic() + timeout
        with self._visible:
            while self._visible_seq < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._visible.wait(min(left, 0.05))
                self._flush_asked = True
                self._poke()
        return True

    def request_stop(self) -> None:
        """Make a back-off in progress return (a driven publisher's owner, stopping)."""
        self._stop.set()
        self._wake.set()

    def stop(self, clear: bool = True, timeout: float = 5.0) -> None:
        """Stop the thread. clear=True also removes this pod's claims and registration
        (only if this instance still owns the pod id); clear=False flushes what is queued
        and leaves everything to expire with the lease."""
        thread, self._thread = self._thread, None
        self.request_stop()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("index publisher %s: thread did not stop in %.1fs",
                               self.pod_id, timeout)
        elif self._driven and self.epoch:
            self._final_flush()
        if clear and self.epoch and self._client is not None:
            try:
                self._clear_registration()
            except REDIS_ERRORS as exc:
                logger.warning("index publisher %s: could not clear its claims (%s); they "
                               "expire with the lease", self.pod_id, exc)
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> IndexPublisher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(clear=True)

    @property
    def lag_histogram(self) -> Histogram:
        """Publish lag of every batch, for Prometheus (`stats()` has its summary)."""
        return self._counters.lag.histogram

    def stats(self) -> dict[str, Any]:
        q = self._events.counts()
        return {
            "pod_id": self.pod_id,
            "epoch": self.epoch,
            "connected": self._connected,
            "superseded": self._superseded,
            "paused": self._left,
            "events_submitted": q.submitted,
            "events_dropped": q.dropped,
            "pending": q.pending,
            "seq": q.seq,
            "visible_seq": self._visible_seq,
            "claims": len(self._claims),
            "claims_unplaced": len(self._claims.unplaced),
            **self._counters.as_dict(),
        }

    # -- publisher thread ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            # Cleared before the work, never after it: a submit that sets it meanwhile is
            # seen by the wait below.
            self._wake.clear()
            wait = self.step()
            if wait > 0:
                self._wake.wait(wait)
        self._final_flush()

    def step(self, write: bool = False) -> float:
        """One round of the publisher's work: rejoin or republish if needed, renew the lease
        when due, write what is queued once the flush interval is up (`write`: now).
        Returns the seconds until the next round is due (0: at once). The thread's loop, or
        a driven publisher's owner, calls it; never two threads at once. While Redis fails
        it backs off here (up to 2 s), renewing the lease when due."""
        if write:
            self._flush_asked = True
        if self._superseded:
            return self.renew_interval_s
        try:
            if (self._pause or self._left) and self._paused_step():
                return self.renew_interval_s  # resume() pokes
            if self._needs_resync:
                self._resync()
            now = time.monotonic()
            if now >= self._next_renew:
                self._renew()
                self._next_renew = now + self.renew_interval_s
            if self._flush_asked or now >= self._last_write + self.flush_interval_s:
                self._publish_pending()
            if self._strip_at and now >= self._strip_at:
                self._strip_retired()
        except _Superseded as exc:
            self._superseded = True
            self._drop_pending()  # and keep dropping: this instance is done
            logger.error("index publisher %s epoch %s: %s; no longer publishing",
                         self.pod_id, self.epoch, exc)
            return 0.0
        except REDIS_ERRORS as exc:
            self._on_error(exc)
            self._back_off()
            return 0.0
        except Exception:  # a bug or a bad event must not kill the thread: rebuild
            logger.exception("index publisher %s: unexpected error; republishing",
                             self.pod_id)
            self._counters.errors += 1
            self._drop_pending()
            self._back_off()
            return 0.0
        now = time.monotonic()
        until = self._next_renew
        if self._strip_at:
            until = min(until, self._strip_at)
        if self._woken:  # something queued: write it once the interval is up
            until = min(until, self._last_write + self.flush_interval_s)
        return max(0.0, until - now)

    def _final_flush(self) -> None:
        """Last write on a clean stop, so that clear=False leaves the index current."""
        if not self._needs_resync and not self._superseded:
            try:
                self._publish_pending()
            except REDIS_ERRORS as exc:
                logger.debug("index publisher %s: final flush failed: %s", self.pod_id, exc)

    def _paused_step(self) -> bool:
        """While paused: leave once, then drop what is submitted. False once resumed: the
        way back is a full republish."""
        if not self._pause:
            self._left = False
            self._needs_resync = True
            return False
        if not self._left:
            if self._client is not None:
                self._clear_registration()
            self._left = True
        self._drop_pending()
        return True

    def _back_off(self) -> None:
        """Wait before the next try: a random time up to twice the last bound (capped; full
        jitter). The lease is still renewed when due: on a cluster it sits on the control
        shard, and a claim shard that fails must not take the pod out of routing."""
        until = time.monotonic() + jittered_backoff_s(self._retries, _BACKOFF_START_S,
                                                      _BACKOFF_CAP_S)
        self._retries += 1
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= until:
                return
            if self._registered_once and now >= self._next_renew:
                self._next_renew = now + self.renew_interval_s
                with contextlib.suppress(*REDIS_ERRORS):  # the next try reports it
                    self._renew(between_tries=True)
            self._stop.wait(max(0.0, min(until, self._next_renew) - time.monotonic()))

    def _drop_pending(self) -> None:
        """Forget queued deltas and stop queueing until the next full republish."""
        self._events.discard()
        self._needs_resync = True

    def _on_error(self, exc: BaseException) -> None:
        self._counters.errors += 1
        self._drop_pending()
        if self._client is not None:
            drop_connections(self._client)
        if self._connected or not self._down_since:
            self._down_since = time.monotonic()
            logger.warning("index publisher %s: redis unavailable (%s: %s); dropping deltas, "
                           "will republish the full state", self.pod_id,
                           type(exc).__name__, exc)
        self._connected = False

    def _pod_fields(self) -> dict[str, str]:
        fields = writes.heartbeat_fields(self._applied_seq)
        try:
            fields.update(writes.load_fields(self._load_fn()))
        except Exception:  # a broken load_fn must not stop the lease
            logger.exception("index publisher %s: load_fn failed", self.pod_id)
        if self._tier_costs_fn is not None:
            try:
                fields.update(writes.cost_fields(self._tier_costs_fn()))
            except Exception:
                logger.exception("index publisher %s: tier_costs_fn failed", self.pod_id)
        if self._extra_fields_fn is not None:
            try:
                fields.update(self._extra_fields_fn())
            except Exception:
                logger.exception("index publisher %s: extra_fields_fn failed", self.pod_id)
        return fields

    def _register(self) -> None:
        owner = writes.registered_epoch(self._client, self.schema, self.pod_id)
        if self._registered_once and owner is not None and owner != self.epoch:
            raise _Superseded(f"pod id re-registered with epoch {owner}")
        self._claim_id = writes.register_pod(
            self._client, self.schema, self.pod_id, self.epoch, self.address,
            self.hash_config, {**self.registration, **self._pod_fields()}, self._lease_ms,
            previous=self._claim_id)
        self._registered_once = True
        self._next_renew = time.monotonic() + self.renew_interval_s

    def _resync(self) -> None:
        """Register, then make Redis hold exactly full_state_fn() for this pod id."""
        t0 = time.monotonic()
        was_registered = self._registered_once
        if self._client is None:
            self._client = self._connect()
        self._register()  # (its first read is the probe)
        # Events from here on are queued and replayed on top of the snapshot. Replaying one
        # the snapshot already reflects is harmless: every event sets tier bits to a
        # constant, so applying a suffix twice gives the same state as once.
        snap_seq, dropped_runs = self._events.reopen()
        claims = self._claims
        claims.learn(dropped_runs)
        state = self._full_state_fn()
        # (the state may reflect these already) Items of this publisher's kind: see _claims.
        claims.learn(self._events.queued_events())  # type: ignore[arg-type]
        wanted = claims.reset(state)
        self._listed = writes.write_all_claims(self._client, self.schema, self.pod_id, wanted,
                                               self._claim_id)
        self._strip_at = time.monotonic() + self.retire_after_s
        self._applied_seq = snap_seq
        self._needs_resync = False
        self._counters.republishes += 1
        # Reachable again only now: on a cluster, one shard may answer while another fails.
        if self._down_since and was_registered:
            self._counters.reconnects += 1
            logger.info("index publisher %s: redis reachable again after %.1fs", self.pod_id,
                        t0 - self._down_since)
        self._connected = True
        self._down_since = 0.0
        self._retries = 0
        self._set_visible(snap_seq)
        self._synced.set()
        unplaced = len(claims.unplaced)
        logger.info("index publisher %s epoch %s: republished %d blocks in %d buckets in "
                    "%.3fs%s", self.pod_id, self.epoch, len(claims) - unplaced, len(wanted),
                    time.monotonic() - t0, f" ({unplaced} held back: their chain's block 0 "
                    "is unknown)" if unplaced else "")

    def _renew(self, between_tries: bool = False) -> None:
        result = writes.renew_lease(self._client, self.schema, self.pod_id, self.epoch,
                                    self._lease_ms, self._pod_fields())
        if between_tries and result != writes.RENEWED:
            return  # the resync being retried re-registers, or finds it superseded
        if result == writes.SUPERSEDED:
            raise _Superseded("another instance renewed this pod id")
        if result == writes.REGISTRATION_GONE:
            # Registration vanished (FLUSHALL, a restart we did not see): start over.
            logger.warning("index publisher %s: registration missing; republishing",
                           self.pod_id)
            self._drop_pending()
            return
        self._counters.lease_renewals += 1

    def _publish_pending(self) -> None:
        # Reset before the take: a submit after it finds False and wakes the thread again.
        self._woken = False
        self._flush_asked = False
        batch = self._events.take()
        if not batch:
            return
        self._last_write = time.monotonic()
        if batch[0][0] != self._applied_seq + 1:
            # A gap means deltas were lost: the index cannot be patched, only rebuilt.
            logger.warning("index publisher %s: sequence gap (%d after %d); republishing",
                           self.pod_id, batch[0][0], self._applied_seq)
            self._drop_pending()
            return
        items = [ev for _, _, ev in batch]  # of this publisher's kind: see _claims
        changes = self._claims.apply(items)  # type: ignore[arg-type]
        writes.write_claim_changes(self._client, self.schema, self.pod_id, changes,
                                   self._claim_id, self._listed)
        last_seq = batch[-1][0]
        self._applied_seq = last_seq
        self._counters.published(len(batch), time.monotonic() - batch[0][1])
        self._set_visible(last_seq)

    def _strip_retired(self) -> None:
        """Remove the claims of this pod id's earlier claim ids (a previous instance's, or
        this one's before a resync), page by page."""
        removed = writes.strip_retired(self._client, self.schema, self.pod_id, self._claim_id,
                                       self._listed)
        self._strip_at = 0.0
        if removed:
            logger.info("index publisher %s: removed %d claims of its earlier claim ids",
                        self.pod_id, removed)

    def _set_visible(self, seq: int) -> None:
        with self._visible:
            if seq > self._visible_seq:
                self._visible_seq = seq
            self._visible.notify_all()

    def _clear_registration(self) -> None:
        s, pod = self.schema, self.pod_id
        owner = writes.registered_epoch(self._client, s, pod)
        if owner is not None and owner != self.epoch:
            logger.info("index publisher %s: pod id now owned by epoch %s; leaving its keys",
                        pod, owner)
            return
        removed = writes.clear_pod_claims(self._client, s, pod)
        writes.unregister_pod(self._client, s, pod)
        self._claims.clear()
        self._listed = set()
        self._strip_at = 0.0
        logger.info("index publisher %s: cleared %d claims and the registration", pod, removed)
