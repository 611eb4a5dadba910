"""The router's client of the index: every read and clean-up it makes, on an asyncio client
(one node's or a cluster's).

One object per namespace the router routes for. The queries themselves (keys, scripts,
reply parsing) live in `proto.index.queries`, shared with the pods' synchronous side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagekv.proto.index import queries, scripts
from pagekv.proto.index.queries import LivePods, PodInfo, PodMatch
from pagekv.proto.index.schema import IndexSchema, text


class IndexClient:
    """`redis` is an asyncio client (see `proto.index.connect.connect_async`)."""

    def __init__(self, redis_client: Any, schema: IndexSchema) -> None:
        self.redis = redis_client
        self.schema = schema

    async def register_scripts(self) -> None:
        """SCRIPT LOAD up front so that even the first lookup is one round trip."""
        for script in scripts.PRELOADED:
            await self.redis.script_load(script.source)

    async def lookup_prefix(self, block_hashes: Sequence[bytes],
                            live: Mapping[str, str] | LivePods,
                            predictions: bool = False) -> dict[str, PodMatch]:
        """The pods of `live` (pod id -> its live epoch, from the registry, best packed once:
        `LivePods`) that hold a consecutive prefix of `block_hashes` (or, with
        `predictions`, are predicted to by a router's recent dispatch), with that prefix;
        absent: none. One EVALSHA, one shard."""
        if not block_hashes or not live:
            return {}
        return await queries.lookup(self.schema, block_hashes, live,
                                    predictions).run_async(self.redis)

    async def predict(self, pod_id: str, block_hashes: Sequence[bytes], start: int,
                      ttl_ms: int, max_pods: int) -> int:
        """Predict `pod_id` holding blocks `start`... of the chain for `ttl_ms`, for the
        other routers' lookups: one EVALSHA on the chain's shard."""
        return await queries.predict(self.schema, pod_id, block_hashes, start, ttl_ms,
                                     max_pods).run_async(self.redis)

    async def list_live_pods(self, schema: IndexSchema | None = None) -> list[PodInfo]:
        """The live pods of this namespace (or of `schema`'s, to name foreign pods)."""
        return await queries.live_pods(schema or self.schema).run_async(self.redis)

    async def has_config(self) -> bool:
        """Whether this namespace's config key exists: a pod has registered here since
        Redis last started empty."""
        return bool(await self.redis.exists(self.schema.config_key))

    async def other_namespaces(self) -> dict[str, dict[str, str]]:
        """Every other namespace pods registered in, with its hash config (to name pods
        that can never match this router's hashes)."""
        ids = sorted(text(n) for n in await self.redis.smembers(self.schema.namespaces_key))
        others = [ns for ns in ids if ns != self.schema.namespace]
        if not others:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for key in queries.namespace_config_keys(self.schema.prefix, others):
            pipe.hgetall(key)
        return queries.parse_namespaces(others, await pipe.execute())

    async def dead_pods(self) -> dict[str, str]:
        """Pod ids registered here without a lease -> their registered epoch ("" if none)."""
        return await queries.dead_pods(self.schema).run_async(self.redis)

    async def reap_pod(self, pod_id: str, epoch: str, batch: int = 1000) -> int | None:
        """Remove a dead pod's claims and registration: bucket by bucket, `batch` claims
        per script call so Redis is never blocked for long. Returns the claims removed, or
        None when the pod id came back (a lease, or another epoch) before it was gone."""
        s, r = self.schema, self.redis
        buckets = await queries.reap_start(s, pod_id, epoch).run_async(r)
        if buckets is None:
            return None
        removed = 0
        for bucket in buckets:
            while True:
                step = await queries.reap_bucket(s, pod_id, epoch, bucket, batch).run_async(r)
                if step is None:
                    return None
                removed += step[0]
                if step[1]:
                    break
        if not await queries.reap_finish(s, pod_id, epoch).run_async(r):
            return None
        return removed

    async def aclose(self) -> None:
        await self.redis.aclose()
