"""What a pod writes to the index, on a synchronous client (one node's or a cluster's): its
registration and lease, its block claims, and their removal.

Registration and lease are control keys (one hash tag: a MULTI is fine); a claim goes to its
bucket's tag. Claims are written by the CLAIM_WRITES script, CLAIM_RECORDS claims a call and
PIPELINE_CALLS calls a round trip (on a cluster, one bucket a call and one pipeline per
shard); removals in bulk strip one HSCAN page of a bucket per call (queries.strip). No
single call or reply is large enough to stall Redis or the pod. A bucket enters the pod's
bucket list before its first claim does, so whoever cleans up after the pod finds every
claim.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from redis.exceptions import NoScriptError

from pagekv.proto.index import queries, scripts
from pagekv.proto.index.connect import REDIS_ERRORS, is_cluster
from pagekv.proto.index.mirror import BucketChange
from pagekv.proto.index.schema import (
    POD_KINDS,
    POD_ROLES,
    IndexSchema,
    claim_field,
    claim_field_hex,
    new_claim_id,
    text,
)
from pagekv.proto.medium import ALL_BITS

# Claim writes per CLAIM_WRITES call: Redis runs a script alone, so each stays ~1 ms long.
CLAIM_RECORDS = 512
PIPELINE_CALLS = 32  # CLAIM_WRITES calls a round trip: ~1 MB of records at most

# renew_lease results
RENEWED, REGISTRATION_GONE, SUPERSEDED = 1, 0, -1


# -- the pod HASH ------------------------------------------------------------------------------
def heartbeat_fields(seq: int) -> dict[str, str]:
    """`updated` (unix s) and `seq` (last applied event), written with every renewal."""
    return {"updated": f"{time.time():.3f}", "seq": str(seq)}


def kind_fields(kind: str, http_address: str = "") -> dict[str, str]:
    """Registration fields saying how a router reaches the pod (schema.POD_KINDS), read
    back as `PodInfo.kind` and `PodInfo.http_address`; without them a pod is PageKV's."""
    if kind not in POD_KINDS:
        raise ValueError(f"unknown pod kind {kind!r}; valid: {', '.join(POD_KINDS)}")
    fields = {"kind": kind}
    if http_address:
        fields["http_address"] = http_address
    return fields


def role_fields(role: str) -> dict[str, str]:
    """The registration field of a pod's P/D role (schema.POD_ROLES), read back as
    `PodInfo.role`."""
    if role not in POD_ROLES:
        raise ValueError(f"unknown pod role {role!r}; valid: {', '.join(POD_ROLES)}")
    return {"role": role}


def load_fields(load: Mapping[str, float]) -> Iterator[tuple[str, str]]:
    """`load.<name>` fields (read back as `PodInfo.load`)."""
    for name, value in load.items():
        yield f"load.{name}", repr(float(value))


def cost_fields(costs: Mapping[str, float]) -> Iterator[tuple[str, str]]:
    """`cost.<tier>` fields (read back as `PodInfo.tier_costs`); unknown costs are left out."""
    for tier, cost in costs.items():
        if math.isfinite(float(cost)):
            yield f"cost.{tier}", repr(float(cost))


def registered_epoch(client: Any, schema: IndexSchema, pod_id: str) -> str | None:
    """The epoch that owns `pod_id`'s registration, or None when it is not registered."""
    owner = client.hget(schema.pod_key(pod_id), "epoch")
    return None if owner is None else text(owner)


def register_pod(client: Any, schema: IndexSchema, pod_id: str, epoch: str, address: str,
                 hash_config: Mapping[str, str], fields: Mapping[str, str],
                 lease_ms: int, previous: bytes = b"") -> bytes:
    """In one script: take a new claim id (one no registration of the namespace holds),
    rewrite the pod HASH with it, set the lease, join the namespace. A reader never sees a
    lease without its registration (or with another epoch's). `previous`: the claim id this
    instance registered under last, listed again among the pod's claim ids so that its
    claims are stripped even where the control keys lost it. Returns the claim id."""
    args: list[str] = [address]
    for name, value in {**{f"cfg.{k}": v for k, v in hash_config.items()}, **fields}.items():
        args += (name, value)
    while True:  # a claim id taken (1 in 4e9 per registration): draw another
        claim_id = new_claim_id()
        if scripts.REGISTER.run(client, (schema.pods_key,),
                                (schema.base, pod_id, epoch, claim_id.hex(), lease_ms,
                                 previous.hex(), "address", *args)):
            break
    client.hset(schema.config_key, mapping=schema.hash_config())
    # Outside every namespace's tag, so not in the script (a cluster refuses cross-slot).
    client.sadd(schema.namespaces_key, schema.namespace)
    return claim_id


def renew_lease(client: Any, schema: IndexSchema, pod_id: str, epoch: str, lease_ms: int,
                fields: Mapping[str, str]) -> int:
    """Extend the lease and update `fields`, only while `epoch` owns the registration:
    RENEWED, REGISTRATION_GONE (re-register and republish) or SUPERSEDED (stop)."""
    args: list[str] = [epoch, str(lease_ms)]
    for name, value in fields.items():
        args += (name, value)
    keys = [schema.lease_key(pod_id), schema.pod_key(pod_id)]
    return int(scripts.RENEW_LEASE.run(client, keys, args))


def unregister_pod(client: Any, schema: IndexSchema, pod_id: str) -> None:
    """Remove the pod HASH, the lease and the `pods` entry (claims: clear_pod_claims)."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(schema.pod_key(pod_id), schema.lease_key(pod_id))
    pipe.srem(schema.pods_key, pod_id)
    pipe.execute()


# -- claims ----------------------------------------------------------------------------------
def listed_buckets(client: Any, schema: IndexSchema, pod_id: str) -> set[int]:
    """The buckets in `pod_id`'s bucket list."""
    return set(queries.parse_buckets(client.smembers(schema.pod_buckets_key(pod_id))))


def list_buckets(client: Any, schema: IndexSchema, pod_id: str,
                 buckets: Collection[int]) -> None:
    """Add buckets to the pod's bucket list: before any claim is written there."""
    if buckets:
        client.sadd(schema.pod_buckets_key(pod_id), *buckets)


def write_all_claims(client: Any, schema: IndexSchema, pod_id: str,
                     wanted: Mapping[int, Mapping[str, int]], claim_id: bytes) -> set[int]:
    """Write every claim of `wanted` (bucket -> hex hash -> tier mask) under `claim_id`, a
    claim id just registered (so it has no claims yet). Returns the pod's bucket list as it
    now is. The claims of the pod's earlier claim ids stay until strip_retired removes them
    (their pod's registration no longer names them: no lookup counts them)."""
    listed = listed_buckets(client, schema, pod_id)
    list_buckets(client, schema, pod_id, set(wanted) - listed)
    claims = ClaimRecords()
    for bucket, hashes in wanted.items():
        for hex_hash, mask in hashes.items():
            claims.add(bucket, mask, claim_field_hex(hex_hash))
    claims.send(client, schema, pod_id, claim_id)
    return listed | set(wanted)


def write_claim_changes(client: Any, schema: IndexSchema, pod_id: str,
                        changes: Iterable[BucketChange], claim_id: bytes,
                        listed: set[int]) -> None:
    """Write the net effect of one batch of events. `listed` is the pod's bucket list as
    written so far; buckets new to it are added (to Redis, then to `listed`) first."""
    claims = ClaimRecords()
    add = claims.add
    for h, bucket, _old, new in changes:
        add(bucket, new, claim_field(h))
    new_buckets = claims.claimed - listed  # (they must be listed before their claims)
    if new_buckets and is_cluster(client):  # (another shard: a round trip first)
        list_buckets(client, schema, pod_id, new_buckets)
        new_buckets = set()
    claims.send(client, schema, pod_id, claim_id, new_buckets)
    listed |= new_buckets


_MASK_BYTES = tuple(bytes((m,)) for m in range(256))  # a record's first byte


class ClaimRecords:
    """Claim writes grouped by bucket, sent as CLAIM_WRITES calls: one record (the new mask
    in one byte, the block's claim field) per claim instead of a command, so that packing in
    the client costs a join per call, not a command per block."""

    __slots__ = ("by_bucket", "claimed")

    def __init__(self) -> None:
        self.by_bucket: dict[int, list[bytes]] = {}
        self.claimed: set[int] = set()  # buckets that get a claim (not only removals)

    def add(self, bucket: int, mask: int, field: bytes) -> None:
        """Set the claim of the block whose claim field is `field` to `mask` (0: remove)."""
        if not 0 <= mask <= ALL_BITS:
            raise ValueError(f"tier mask {mask} out of range")
        records = self.by_bucket.get(bucket)
        if records is None:
            records = self.by_bucket[bucket] = []
        records.append(_MASK_BYTES[mask] + field)
        if mask:
            self.claimed.add(bucket)

    def __len__(self) -> int:
        return sum(len(r) for r in self.by_bucket.values())

    def calls(self, schema: IndexSchema, one_bucket_each: bool
              ) -> Iterator[tuple[list[str], list[bytes]]]:
        """(keys, per-bucket records) of each call, at most CLAIM_RECORDS records in one."""
        keys: list[str] = []
        args: list[bytes] = []
        n = 0
        for bucket, records in self.by_bucket.items():
            key = schema.claims_key(bucket)
            for i in range(0, len(records), CLAIM_RECORDS):
                part = records[i:i + CLAIM_RECORDS]
                if keys and (one_bucket_each or n + len(part) > CLAIM_RECORDS):
                    yield keys, args
                    keys, args, n = [], [], 0
                keys.append(key)
                args.append(b"".join(part))
                n += len(part)
        if keys:
            yield keys, args

    def send(self, client: Any, schema: IndexSchema, pod_id: str, claim_id: bytes,
             list_first: Collection[int] = ()) -> None:
        """The calls pipelined (PIPELINE_CALLS a round trip); on a cluster, per shard.
        `list_first`: buckets to add to `pod_id`'s bucket list at the head of the pipeline
        (one node only: a cluster's bucket list is on another shard than the claims)."""
        if not self.by_bucket:
            return
        head = [claim_id]
        if not is_cluster(client):
            listing = (schema.pod_buckets_key(pod_id), sorted(list_first))
            _pipelined(client, self.calls(schema, False), head, listing)
            return
        if list_first:
            raise ValueError("a cluster's bucket list is written before, not in the pipeline")
        by_node: dict[str, tuple[Any, list[tuple[list[str], list[bytes]]]]] = {}
        for keys, args in self.calls(schema, True):
            node = client.get_node_from_key(keys[0])
            by_node.setdefault(node.name, (node, []))[1].append((keys, args))
        for node, calls in by_node.values():
            try:
                _pipelined(node.redis_connection, calls, head)
            except REDIS_ERRORS:
                # A slot moved or a primary failed over since the client's slot map was
                # read: one call at a time through the cluster client, which follows the
                # redirections and refreshes its map (and raises if the shard is down).
                for keys, args in calls:
                    scripts.CLAIM_WRITES.run(client, keys, [*head, *args])


def _pipelined(client: Any, calls: Iterable[tuple[list[str], list[bytes]]],
               head: Sequence[bytes], listing: tuple[str, list[int]] | None = None) -> None:
    """CLAIM_WRITES calls on a single node's client, PIPELINE_CALLS a round trip (a full
    republish of millions of claims never sits in one buffer), after the SADD of `listing`
    (key, buckets) if it names any: a node runs a pipeline in order."""
    sha = scripts.CLAIM_WRITES.sha
    pending = iter(calls)
    pre = listing if listing and listing[1] else None
    while True:
        chunk = list(itertools.islice(pending, PIPELINE_CALLS))
        if not chunk and pre is None:
            return
        if len(chunk) == 1 and pre is None:  # the usual flush: no pipeline
            keys, args = chunk[0]
            scripts.CLAIM_WRITES.run(client, keys, [*head, *args])
            continue
        for attempt in (0, 1):
            pipe = client.pipeline(transaction=False)
            if pre is not None:
                pipe.sadd(pre[0], *pre[1])
            for keys, args in chunk:
                pipe.evalsha(sha, len(keys), *keys, *head, *args)
            try:
                pipe.execute()
                break
            except NoScriptError:  # a restarted or flushed Redis: load it, send again
                if attempt:
                    raise
                client.script_load(scripts.CLAIM_WRITES.source)
        pre = None


def pod_claim_ids(client: Any, schema: IndexSchema, pod_id: str) -> list[str]:
    """The claim ids (hex) this pod id registered under whose claims may remain."""
    return queries.parse_claim_ids(client.smembers(schema.pod_claim_ids_key(pod_id)))


def strip_retired(client: Any, schema: IndexSchema, pod_id: str, claim_id: bytes,
                  listed: set[int]) -> int:
    """Remove the claims of `pod_id`'s claim ids other than `claim_id` (its current one)
    from its listed buckets, page by page, then release those ids; a bucket left without a
    claim of `claim_id` leaves `listed` and the bucket list. Returns the claims removed. Only
    the publisher's own thread calls it (nothing writes this pod's claims meanwhile)."""
    current = claim_id.hex()
    retired = [c for c in pod_claim_ids(client, schema, pod_id) if c != current]
    if not retired:
        return 0
    removed = 0
    empty: list[int] = []
    for bucket in sorted(listed_buckets(client, schema, pod_id)):
        n, kept = queries.strip_bucket(client, schema, bucket, retired, keep_id=current)
        removed += n
        if not kept:
            empty.append(bucket)
    if empty:
        client.srem(schema.pod_buckets_key(pod_id), *empty)
        listed.difference_update(empty)
    scripts.RELEASE_CLAIM_IDS.run(client, (schema.pods_key,),
                                  (schema.base, pod_id, *retired))
    return removed


def clear_pod_claims(client: Any, schema: IndexSchema, pod_id: str) -> int:
    """Remove every block claim of `pod_id` (any of its claim ids), using its bucket list
    (each listed bucket's claims read page by page: work proportional to the buckets it
    used, never the keyspace), then release its claim ids and delete its bucket list.
    Returns the number of claims removed. The registration and lease are left alone."""
    claim_ids = pod_claim_ids(client, schema, pod_id)
    removed = 0
    if claim_ids:
        for bucket in sorted(listed_buckets(client, schema, pod_id)):
            removed += queries.strip_bucket(client, schema, bucket, claim_ids)[0]
        scripts.RELEASE_CLAIM_IDS.run(client, (schema.pods_key,),
                                      (schema.base, pod_id, *claim_ids))
    client.delete(schema.pod_buckets_key(pod_id))
    client.delete(schema.pod_claim_ids_key(pod_id))
    return removed
