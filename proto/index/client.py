"""The router's client of the index: every read and clean-up it makes, on an asyncio client
(one node's or a cluster's).

One object per namespace the router routes for. The queries themselves (keys, scripts,
reply parsing) live in `proto.index.queries`, shared with the pods' synchronous side.

Every call holds one of `max_in_flight` slots (`IndexSlots`) while it runs, as many as the
client's connection pool holds: a burst of requests queues for a connection, however many
arrive at once, instead of failing with MaxConnectionsError (as redis-py's pool does past
its size). Records that do not parse are skipped and counted in `bad_records`, never an
error (proto/index/bad_records.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from redis.exceptions import ResponseError

from pagekv.proto.index import queries, scripts
from pagekv.proto.index.bad_records import BAD_ENCODING, WRONG_TYPE, BadRecords
from pagekv.proto.index.connect import DEFAULT_MAX_CONNECTIONS, DEFAULT_POOL_WAIT_S
from pagekv.proto.index.index_slots import IndexSlots
from pagekv.proto.index.pod_record import PodInfo
from pagekv.proto.index.queries import Call, LivePods, PodMatch
from pagekv.proto.index.schema import IndexSchema, text

T = TypeVar("T")


def _is_wrong_type(exc: ResponseError) -> bool:
    return str(exc).startswith("WRONGTYPE")


class IndexClient:
    """`redis` is an asyncio client (see `proto.index.connect.connect_async`).
    `max_in_flight`: calls at once, the client's pool size (connect_async's
    `max_connections`); a call waits at most `wait_s` for one of them."""

    def __init__(self, redis_client: Any, schema: IndexSchema,
                 bad_records: BadRecords | None = None,
                 max_in_flight: int = DEFAULT_MAX_CONNECTIONS,
                 wait_s: float = DEFAULT_POOL_WAIT_S) -> None:
        self.redis = redis_client
        self.schema = schema
        self.bad_records = bad_records if bad_records is not None else BadRecords()
        self.slots = IndexSlots(max_in_flight, wait_s)
        # The live pods of the last lookup (the registry's): the claim ids predictions take.
        self.live = LivePods({})

    async def _run(self, call: Call[T]) -> T:
        async with self.slots.held():
            return await call.run_async(self.redis)

    async def register_scripts(self) -> None:
        """SCRIPT LOAD up front so that even the first lookup is one round trip."""
        for script in scripts.PRELOADED:
            async with self.slots.held():
                await self.redis.script_load(script.source)

    async def lookup_prefix(self, block_hashes: Sequence[bytes], live: LivePods,
                            predictions: bool = False) -> dict[str, PodMatch]:
        """The pods of `live` (pod id -> its registration's claim id, from the registry,
        packed once: `LivePods.of`) that hold a consecutive prefix of `block_hashes` (or, with
        `predictions`, are predicted to by a router's recent dispatch), with that prefix;
        absent: none. One EVALSHA, one shard. A request cancelled while it waits for a
        connection (its deadline passed: gRPC cancels it) stops waiting there."""
        self.live = live
        if not block_hashes or not live:
            return {}
        return await self._run(queries.lookup(self.schema, block_hashes, live, predictions,
                                              self.bad_records))

    def claim_id_of(self, pod_id: str) -> bytes | None:
        """`pod_id`'s claim id as the last lookup's live pods (the registry's) have it: what
        a prediction for it is keyed by; None when it has no valid one."""
        return self.live.claim_id(pod_id)

    async def predict(self, claim_id: bytes, block_hashes: Sequence[bytes], start: int,
                      ttl_ms: int, max_pods: int) -> int:
        """Predict the pod registered under `claim_id` (`claim_id_of`) holding blocks
        `start`... of the chain for `ttl_ms`, for the other routers' lookups: one EVALSHA on
        the chain's shard."""
        return await self._run(queries.predict(self.schema, claim_id, block_hashes, start,
                                               ttl_ms, max_pods))

    async def list_live_pods(self, schema: IndexSchema | None = None) -> list[PodInfo]:
        """The live pods of this namespace (or of `schema`'s, to name foreign pods)."""
        return await self._run(queries.live_pods(schema or self.schema, self.bad_records))

    async def has_config(self) -> bool:
        """Whether this namespace's config key exists: a pod has registered here since
        Redis last started empty."""
        async with self.slots.held():
            return bool(await self.redis.exists(self.schema.config_key))

    async def other_namespaces(self) -> dict[str, dict[str, str]]:
        """Every other namespace pods registered in, with its hash config (to name pods
        that can never match this router's hashes). Keys of another type, or not UTF-8,
        are skipped (counted)."""
        async with self.slots.held():
            try:
                members = await self.redis.smembers(self.schema.namespaces_key)
            except ResponseError as exc:
                if not _is_wrong_type(exc):
                    raise
                self.bad_records.note(WRONG_TYPE, f"{self.schema.namespaces_key}: {exc}")
                return {}
        ids: list[str] = []
        for member in members:
            try:
                ids.append(text(member))
            except UnicodeDecodeError:
                self.bad_records.note(BAD_ENCODING, f"a namespace id not UTF-8: {member!r}")
        others = sorted(ns for ns in ids if ns != self.schema.namespace)
        if not others:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for key in queries.namespace_config_keys(self.schema.prefix, others):
            pipe.hgetall(key)
        async with self.slots.held():
            replies = await pipe.execute(raise_on_error=False)
        for reply in replies:  # a real failure (not a key's type) is the index's, as before
            if isinstance(reply, ResponseError) and not _is_wrong_type(reply):
                raise reply
        return queries.parse_namespaces(others, replies, self.bad_records)

    async def dead_pods(self) -> dict[str, str]:
        """Pod ids registered here without a lease -> their registered epoch ("" if none)."""
        return await self._run(queries.dead_pods(self.schema, self.bad_records))

    async def reap_pod(self, pod_id: str, epoch: str) -> int | None:
        """Remove a dead pod's claims and registration: bucket by bucket, one HSCAN page of
        the bucket's claims (queries.STRIP_PAGE fields) per script call so Redis is never
        blocked for long; the work is the size of the buckets it used, never the keyspace.
        Returns the claims removed, or None when the pod id came back (a lease, or another
        epoch) before it was gone (its new claim id's claims are never touched)."""
        s = self.schema
        start = await self._run(queries.reap_start(s, pod_id, epoch))
        if start is None:
            return None
        buckets, claim_ids = start
        removed = 0
        for bucket in buckets if claim_ids else ():
            cursor = 0
            while True:
                cursor, n, _ = await self._run(queries.strip(s, bucket, cursor, claim_ids))
                removed += n
                if not cursor:
                    break
        if not await self._run(queries.reap_finish(s, pod_id, epoch, claim_ids)):
            return None
        return removed

    async def aclose(self) -> None:
        await self.redis.aclose()
