"""Publishes one pod's KV events to the Redis index, and keeps it registered under a lease.

The engine's step loop calls `submit(events)`, which only appends to an in-memory queue. A
background thread applies the events in order to a local mirror (block hash -> tier bitmask)
and writes the net change of each batch in pipelined round trips, at least every
`flush_interval_s` while there is something to send. The same thread renews the lease every
second with the pod's current load.

Failure policy: the index is a hint, the pod keeps serving. When Redis is unreachable the
queued deltas are dropped (nothing grows without bound) and the state is marked dirty; the
thread reconnects with capped exponential backoff and then republishes the FULL state from
`full_state_fn()` instead of trusting a partial index.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from proto.index_schema import (
    TIER_BIT,
    IndexSchema,
    claim_value,
    clear_pod_claims,
    config_mismatch,
)
from proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

_PIPELINE_CHUNK = 4096  # commands per pipeline round trip when writing many claims
_BACKOFF_START_S = 0.05
_BACKOFF_CAP_S = 2.0
_ALL_BITS = 7

# KEYS[1] lease, KEYS[2] pod hash. ARGV[1] epoch, ARGV[2] ttl ms, ARGV[3..] field/value pairs.
# Returns 1 renewed, 0 registration gone (the caller must re-register and republish),
# -1 another instance of this pod id took over (the caller must stop publishing).
_RENEW_LUA = """
local owner = redis.call('HGET', KEYS[2], 'epoch')
if not owner then return 0 end
if owner ~= ARGV[1] then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if #ARGV > 2 then redis.call('HSET', KEYS[2], unpack(ARGV, 3)) end
return 1
"""

_ERRORS = (redis.exceptions.RedisError, OSError)


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def new_epoch() -> str:
    """Milliseconds since 1970 in base 36 plus 4 random base-36 digits (11-12 chars)."""
    def b36(n: int, width: int = 0) -> str:
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"
        out = ""
        while n:
            n, r = divmod(n, 36)
            out = digits[r] + out
        return out.rjust(width, "0")

    return b36(time.time_ns() // 1_000_000) + b36(secrets.randbelow(36**4), 4)


class _Superseded(Exception):
    """Another instance registered the same pod id with a newer epoch."""


class IndexPublisher:
    """One pod's writer to the index. Thread-safe `submit`; everything else on one thread.

    `full_state_fn()` must be callable from the publisher thread and return every hashed
    block the pod holds (hash -> "GPU" | "CPU" | "DISK"), reflecting at least every event
    already submitted. `load_fn()` returns numbers such as waiting, running, free_blocks.
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
        full_state_fn: Callable[[], dict[bytes, str]],
        tier_costs_fn: Callable[[], dict[str, float]] | None = None,
        lease_ttl_s: float = 3.0,
        flush_interval_s: float = 0.05,
        *,
        max_pending: int = 100_000,
        socket_timeout_s: float = 1.0,
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
        self.hash_config = {**schema.hash_config(), **config}
        self._load_fn = load_fn
        self._full_state_fn = full_state_fn
        self._tier_costs_fn = tier_costs_fn
        self.lease_ttl_s = lease_ttl_s
        self.flush_interval_s = flush_interval_s
        self.renew_interval_s = min(1.0, lease_ttl_s / 3.0)
        self.max_pending = max_pending
        self.epoch = ""

        self._client = redis.Redis.from_url(
            redis_url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),  # our loop owns retries and backoff
            health_check_interval=0,
        )
        self._renew_script = self._client.register_script(_RENEW_LUA)

        # Shared with submit(): guarded by _lock.
        self._lock = threading.Lock()
        self._queue: deque[tuple[int, float, KVEvent]] = deque()
        self._seq = 0  # last sequence number handed out
        self._discarding = True  # until the first full sync, the snapshot covers everything
        self._dropped = 0
        self._submitted = 0

        # Owned by the publisher thread.
        self._mirror: dict[bytes, int] = {}  # hash -> tier bitmask, as written to Redis
        self._values: list[str] = []
        self._applied_seq = 0
        self._needs_resync = True
        self._registered_once = False
        self._connected = False
        self._down_since = 0.0
        self._backoff = _BACKOFF_START_S
        self._next_renew = 0.0

        self._visible = threading.Condition()
        self._visible_seq = 0
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._superseded = False

        self._lags: deque[float] = deque(maxlen=10_000)  # recent batch lags, for quantiles
        self._counters: dict[str, float] = dict.fromkeys(
            ("events_published", "batches", "errors", "reconnects", "republishes",
             "lease_renewals", "publish_lag_last_s", "publish_lag_max_s", "_lag_sum",
             "_lag_n"), 0)

    # -- engine side ---------------------------------------------------------------------
    def submit(self, events: Iterable[KVEvent]) -> None:
        """Queue events for publication, in order. Never blocks on Redis."""
        now = time.monotonic()
        with self._lock:
            if self._discarding:
                n = 0
                for _ in events:
                    n += 1
                self._seq += n
                self._submitted += n
                self._dropped += n
                return
            for ev in events:
                self._seq += 1
                self._queue.append((self._seq, now, ev))
                self._submitted += 1
            if len(self._queue) > self.max_pending:
                # The thread cannot keep up: drop and resync rather than grow.
                self._dropped += len(self._queue)
                self._queue.clear()
                self._discarding = True
                overflow = True
            else:
                overflow = False
        if overflow:
            logger.warning("index publisher %s: more than %d events pending; dropping them "
                           "and republishing the full state", self.pod_id, self.max_pending)
            self._wake.set()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 5.0) -> bool:
        """New epoch, register, republish the full state (dropping the previous epoch's
        claims of this pod id). Returns whether that first sync finished within `timeout`;
        if Redis is down it keeps trying in the background and never raises for it."""
        if self._thread is not None:
            raise RuntimeError("IndexPublisher already started")
        self.epoch = new_epoch()
        self._values = [claim_value(m, self.epoch) if m else "" for m in range(8)]
        self._thread = threading.Thread(
            target=self._run, name=f"index-publisher-{self.pod_id}", daemon=True)
        self._thread.start()
        ok = self._synced.wait(timeout)
        if not ok:
            logger.warning("index publisher %s: first sync not done after %.1fs; retrying in "
                           "the background", self.pod_id, timeout)
        return ok

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every event submitted so far is visible in Redis."""
        with self._lock:
            target = self._seq
        self._wake.set()
        deadline = time.monotonic() + timeout
        with self._visible:
            while self._visible_seq < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._visible.wait(min(left, 0.05))
                self._wake.set()
        return True

    def stop(self, clear: bool = True, timeout: float = 5.0) -> None:
        """Stop the thread. clear=True also removes this pod's claims and registration
        (only if this instance still owns the pod id); clear=False flushes what is queued
        and leaves everything to expire with the lease."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            self._wake.set()
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("index publisher %s: thread did not stop in %.1fs",
                               self.pod_id, timeout)
        if clear and self.epoch:
            try:
                self._clear_registration()
            except _ERRORS as exc:
                logger.warning("index publisher %s: could not clear its claims (%s); they "
                               "expire with the lease", self.pod_id, exc)
        self._client.close()

    def __enter__(self) -> IndexPublisher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(clear=True)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            pending = len(self._queue)
            submitted, dropped, seq = self._submitted, self._dropped, self._seq
        c = self._counters
        lag_n = c["_lag_n"]
        lags = sorted(self._lags)
        return {
            "pod_id": self.pod_id,
            "epoch": self.epoch,
            "connected": self._connected,
            "superseded": self._superseded,
            "events_submitted": submitted,
            "events_published": int(c["events_published"]),
            "events_dropped": dropped,
            "pending": pending,
            "seq": seq,
            "visible_seq": self._visible_seq,
            "claims": len(self._mirror),
            "batches": int(c["batches"]),
            "errors": int(c["errors"]),
            "reconnects": int(c["reconnects"]),
            "republishes": int(c["republishes"]),
            "lease_renewals": int(c["lease_renewals"]),
            "publish_lag_last_s": c["publish_lag_last_s"],
            "publish_lag_max_s": c["publish_lag_max_s"],
            "publish_lag_mean_s": c["_lag_sum"] / lag_n if lag_n else 0.0,
            "publish_lag_p50_s": _quantile(lags, 0.5),
            "publish_lag_p99_s": _quantile(lags, 0.99),
        }

    # -- publisher thread ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._superseded:
                self._stop.wait(self.renew_interval_s)
                continue
            try:
                if self._needs_resync:
                    self._resync()
                now = time.monotonic()
                if now >= self._next_renew:
                    self._renew()
                    self._next_renew = now + self.renew_interval_s
                self._publish_pending()
            except _Superseded as exc:
                self._superseded = True
                self._drop_pending()  # and keep dropping: this instance is done
                logger.error("index publisher %s epoch %s: %s; no longer publishing",
                             self.pod_id, self.epoch, exc)
                continue
            except _ERRORS as exc:
                self._on_error(exc)
                self._stop.wait(self._backoff)
                self._backoff = min(self._backoff * 2, _BACKOFF_CAP_S)
                continue
            except Exception:  # a bug or a bad event must not kill the thread: rebuild
                logger.exception("index publisher %s: unexpected error; republishing",
                                 self.pod_id)
                self._counters["errors"] += 1
                self._drop_pending()
                self._stop.wait(self._backoff)
                self._backoff = min(self._backoff * 2, _BACKOFF_CAP_S)
                continue
            wait = min(self.flush_interval_s, max(0.0, self._next_renew - time.monotonic()))
            self._wake.wait(wait)
            self._wake.clear()
        # Last flush on a clean stop, so that clear=False leaves the index current.
        if not self._needs_resync and not self._superseded:
            try:
                self._publish_pending()
            except _ERRORS as exc:
                logger.debug("index publisher %s: final flush failed: %s", self.pod_id, exc)

    def _drop_pending(self) -> None:
        """Forget queued deltas and stop queueing until the next full republish."""
        with self._lock:
            self._dropped += len(self._queue)
            self._queue.clear()
            self._discarding = True
        self._needs_resync = True

    def _on_error(self, exc: BaseException) -> None:
        self._counters["errors"] += 1
        self._drop_pending()
        self._client.connection_pool.disconnect()
        if self._connected or not self._down_since:
            self._down_since = time.monotonic()
            logger.warning("index publisher %s: redis unavailable (%s: %s); dropping deltas, "
                           "will republish the full state", self.pod_id,
                           type(exc).__name__, exc)
        self._connected = False

    def _pod_fields(self) -> dict[str, str]:
        fields = {"updated": f"{time.time():.3f}", "seq": str(self._applied_seq)}
        try:
            for name, value in self._load_fn().items():
                fields[f"load.{name}"] = repr(float(value))
        except Exception:  # a broken load_fn must not stop the lease
            logger.exception("index publisher %s: load_fn failed", self.pod_id)
        if self._tier_costs_fn is not None:
            try:
                for tier, cost in self._tier_costs_fn().items():
                    if math.isfinite(float(cost)):
                        fields[f"cost.{tier}"] = repr(float(cost))
            except Exception:
                logger.exception("index publisher %s: tier_costs_fn failed", self.pod_id)
        return fields

    def _register(self) -> None:
        s, pod = self.schema, self.pod_id
        owner = self._client.hget(s.pod_key(pod), "epoch")
        if self._registered_once and owner is not None and owner.decode() != self.epoch:
            raise _Superseded(f"pod id re-registered with epoch {owner.decode()}")
        fields = {
            "address": self.address,
            "epoch": self.epoch,
            **{f"cfg.{k}": v for k, v in self.hash_config.items()},
            **self._pod_fields(),
        }
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(s.pod_key(pod))
        pipe.hset(s.pod_key(pod), mapping=fields)
        pipe.set(s.lease_key(pod), self.epoch, px=int(self.lease_ttl_s * 1000))
        pipe.sadd(s.pods_key, pod)
        pipe.hset(s.config_key, mapping=s.hash_config())
        pipe.sadd(s.namespaces_key, s.namespace)
        pipe.execute()
        self._registered_once = True
        self._next_renew = time.monotonic() + self.renew_interval_s

    def _resync(self) -> None:
        """Register, then make Redis hold exactly full_state_fn() for this pod id."""
        t0 = time.monotonic()
        self._client.ping()
        if self._down_since and self._registered_once:
            self._counters["reconnects"] += 1
            logger.info("index publisher %s: redis reachable again after %.1fs", self.pod_id,
                        t0 - self._down_since)
        self._connected = True
        self._down_since = 0.0
        self._backoff = _BACKOFF_START_S
        self._register()
        with self._lock:
            # Events from here on are queued and replayed on top of the snapshot. Replaying
            # one the snapshot already reflects is harmless: every event sets tier bits to
            # a constant, so applying a suffix twice gives the same state as once.
            self._queue.clear()
            self._discarding = False
            snap_seq = self._seq
        state = self._full_state_fn()
        mirror: dict[bytes, int] = {}
        for block_hash, tier in state.items():
            mirror[block_hash] = mirror.get(block_hash, 0) | TIER_BIT[tier]
        self._write_full(mirror)
        self._mirror = mirror
        self._applied_seq = snap_seq
        self._needs_resync = False
        self._counters["republishes"] += 1
        self._set_visible(snap_seq)
        self._synced.set()
        logger.info("index publisher %s epoch %s: republished %d blocks in %.3fs",
                    self.pod_id, self.epoch, len(mirror), time.monotonic() - t0)

    def _write_full(self, mirror: dict[bytes, int]) -> None:
        s, pod = self.schema, self.pod_id
        set_key = s.pod_blocks_key(pod)
        existing = {m.decode() for m in self._client.sscan_iter(set_key, count=1000)}
        wanted = {h.hex(): mask for h, mask in mirror.items()}
        pipe = self._client.pipeline(transaction=False)
        n = 0
        # Write current claims before removing stale ones: no window without our claims.
        for hex_hash, mask in wanted.items():
            pipe.hset(s.block_prefix + hex_hash, pod, self._values[mask])
            if hex_hash not in existing:
                pipe.sadd(set_key, hex_hash)
            n += 1
            if n % _PIPELINE_CHUNK == 0:
                pipe.execute()
        for hex_hash in existing - wanted.keys():
            pipe.hdel(s.block_prefix + hex_hash, pod)
            pipe.srem(set_key, hex_hash)
            n += 1
            if n % _PIPELINE_CHUNK == 0:
                pipe.execute()
        pipe.execute()

    def _renew(self) -> None:
        s = self.schema
        args: list[str] = [self.epoch, str(int(self.lease_ttl_s * 1000))]
        for name, value in self._pod_fields().items():
            args += (name, value)
        result = int(self._renew_script(keys=[s.lease_key(self.pod_id),
                                              s.pod_key(self.pod_id)], args=args))
        if result == -1:
            raise _Superseded("another instance renewed this pod id")
        if result == 0:
            # Registration vanished (FLUSHALL, a restart we did not see): start over.
            logger.warning("index publisher %s: registration missing; republishing",
                           self.pod_id)
            self._drop_pending()
            return
        self._counters["lease_renewals"] += 1

    def _publish_pending(self) -> None:
        with self._lock:
            if not self._queue:
                return
            batch = list(self._queue)
            self._queue.clear()
        if batch[0][0] != self._applied_seq + 1:
            # A gap means deltas were lost: the index cannot be patched, only rebuilt.
            logger.warning("index publisher %s: sequence gap (%d after %d); republishing",
                           self.pod_id, batch[0][0], self._applied_seq)
            self._drop_pending()
            return
        before: dict[bytes, int] = {}  # first-seen mask of each touched hash in this batch
        mirror = self._mirror
        for _, _, ev in batch:
            if isinstance(ev, BlockStored):
                bit = TIER_BIT[ev.medium]
                for h in ev.block_hashes:
                    old = mirror.get(h, 0)
                    before.setdefault(h, old)
                    mirror[h] = old | bit
            elif isinstance(ev, BlockRemoved):
                bit = TIER_BIT[ev.medium]
                for h in ev.block_hashes:
                    old = mirror.get(h, 0)
                    before.setdefault(h, old)
                    if old & ~bit:
                        mirror[h] = old & ~bit
                    elif old:
                        del mirror[h]
            elif isinstance(ev, AllBlocksCleared):
                keep = 0 if ev.medium is None else _ALL_BITS & ~TIER_BIT[ev.medium]
                for h in list(mirror):
                    old = mirror[h]
                    before.setdefault(h, old)
                    if old & keep:
                        mirror[h] = old & keep
                    else:
                        del mirror[h]
        self._write_delta(before)
        last_seq = batch[-1][0]
        self._applied_seq = last_seq
        lag = time.monotonic() - batch[0][1]
        c = self._counters
        c["events_published"] += len(batch)
        c["batches"] += 1
        c["publish_lag_last_s"] = lag
        c["publish_lag_max_s"] = max(c["publish_lag_max_s"], lag)
        c["_lag_sum"] += lag
        c["_lag_n"] += 1
        self._lags.append(lag)
        self._set_visible(last_seq)

    def _write_delta(self, before: dict[bytes, int]) -> None:
        """Write the net effect of one batch: only hashes whose mask changed."""
        s, pod, mirror, values = self.schema, self.pod_id, self._mirror, self._values
        set_key = s.pod_blocks_key(pod)
        pipe = self._client.pipeline(transaction=False)
        n = 0
        for h, old in before.items():
            new = mirror.get(h, 0)
            if new == old:
                continue
            hex_hash = h.hex()
            key = s.block_prefix + hex_hash
            if new:
                pipe.hset(key, pod, values[new])
                if not old:
                    pipe.sadd(set_key, hex_hash)
            else:
                pipe.hdel(key, pod)
                pipe.srem(set_key, hex_hash)
            n += 1
            if n % _PIPELINE_CHUNK == 0:
                pipe.execute()
        if len(pipe):
            pipe.execute()

    def _set_visible(self, seq: int) -> None:
        with self._visible:
            if seq > self._visible_seq:
                self._visible_seq = seq
            self._visible.notify_all()

    def _clear_registration(self) -> None:
        s, pod = self.schema, self.pod_id
        owner = self._client.hget(s.pod_key(pod), "epoch")
        if owner is not None and owner.decode() != self.epoch:
            logger.info("index publisher %s: pod id now owned by epoch %s; leaving its keys",
                        pod, owner.decode())
            return
        removed = clear_pod_claims(self._client, s, pod)
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(s.pod_key(pod), s.lease_key(pod))
        pipe.srem(s.pods_key, pod)
        pipe.execute()
        self._mirror = {}
        logger.info("index publisher %s: cleared %d claims and the registration", pod, removed)
