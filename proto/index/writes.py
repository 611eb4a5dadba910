"""What a pod writes to the index, on a synchronous client (one node's or a cluster's): its
registration and lease, its block claims, and their removal.

Registration and lease are control keys (one hash tag: a MULTI is fine); a claim goes to its
bucket's tag. Claims are written through pipelines of at most PIPELINE_CHUNK commands: one
round trip per chunk (on a cluster, one per shard the chunk touches, sent together), and no
single reply large enough to stall Redis or the pod. A bucket enters the pod's bucket list
before its first claim does, so whoever cleans up after the pod finds every claim.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from pagekv.proto.index import scripts
from pagekv.proto.index.mirror import BucketChange
from pagekv.proto.index.schema import POD_KINDS, IndexSchema, bucket_name, text

PIPELINE_CHUNK = 4096  # commands per pipeline round trip when writing many claims
SET_CHUNK = 1000  # members per SADD / SREM / SSCAN page

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
                 lease_ms: int) -> None:
    """In one MULTI: rewrite the pod HASH, set the lease, join the namespace. A reader
    never sees a lease without its registration (or with another epoch's)."""
    hash_fields = {
        "address": address,
        "epoch": epoch,
        **{f"cfg.{k}": v for k, v in hash_config.items()},
        **fields,
    }
    pipe = client.pipeline(transaction=True)
    pipe.delete(schema.pod_key(pod_id))
    pipe.hset(schema.pod_key(pod_id), mapping=hash_fields)
    pipe.set(schema.lease_key(pod_id), epoch, px=lease_ms)
    pipe.sadd(schema.pods_key, pod_id)
    pipe.hset(schema.config_key, mapping=schema.hash_config())
    pipe.execute()
    # Outside every namespace's tag, so not in the MULTI (a cluster refuses cross-slot ones).
    client.sadd(schema.namespaces_key, schema.namespace)


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
class _Pipe:
    """A non-transactional pipeline sent every PIPELINE_CHUNK commands. Keeps the replies
    only when asked to (`keep`); always adds up the integer ones (`total`)."""

    def __init__(self, client: Any, keep: bool = False) -> None:
        self.pipe = client.pipeline(transaction=False)
        self.queued = 0
        self.keep = keep
        self.replies: list[Any] = []
        self.total = 0

    def add(self, command: str, *args: Any) -> None:
        getattr(self.pipe, command)(*args)
        self.queued += 1
        if self.queued >= PIPELINE_CHUNK:
            self.send()

    def send(self) -> list[Any]:
        if self.queued:
            replies = self.pipe.execute()
            self.queued = 0
            self.total += sum(r for r in replies if isinstance(r, int))
            if self.keep:
                self.replies += replies
        return self.replies


def _chunks(items: Sequence[str], size: int = SET_CHUNK) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def listed_buckets(client: Any, schema: IndexSchema, pod_id: str) -> set[int]:
    """The buckets in `pod_id`'s bucket list."""
    return {int(text(b), 16) for b in client.smembers(schema.pod_buckets_key(pod_id))}


def list_buckets(client: Any, schema: IndexSchema, pod_id: str,
                 buckets: Collection[int]) -> None:
    """Add buckets to the pod's bucket list: before any claim is written there."""
    if buckets:
        client.sadd(schema.pod_buckets_key(pod_id), *(bucket_name(b) for b in buckets))


def scan_sets(client: Any, keys: Sequence[str]) -> dict[str, set[str]]:
    """Every member of each SET in `keys`: SSCAN pages of all the sets sent together, so the
    round trips are the deepest set's pages, not one per set."""
    members: dict[str, set[str]] = {key: set() for key in keys}
    cursors = dict.fromkeys(keys, 0)
    while cursors:
        order = list(cursors)
        pipe = _Pipe(client, keep=True)
        for key in order:
            pipe.add("sscan", key, cursors[key], None, SET_CHUNK)
        cursors = {}
        for key, (cursor, page) in zip(order, pipe.send(), strict=True):
            members[key].update(text(m) for m in page)
            if int(cursor):
                cursors[key] = int(cursor)
    return members


def write_all_claims(client: Any, schema: IndexSchema, pod_id: str,
                     wanted: Mapping[int, Mapping[str, int]], values: Sequence[str]) -> set[int]:
    """Make the index hold exactly `wanted` (bucket -> hex hash -> tier mask) for `pod_id`
    (`values`: claim_values(epoch)). Returns the pod's bucket list as it now is.

    Current claims are written before stale ones are removed: there is no window without
    this pod's claims. Every claim's set member is (re)added, even one already there: a
    reaper still removing this pod id's previous epoch may pop it meanwhile.
    """
    listed = listed_buckets(client, schema, pod_id)
    list_buckets(client, schema, pod_id, set(wanted) - listed)
    set_keys = {b: schema.pod_blocks_key(pod_id, b) for b in listed | set(wanted)}
    existing = scan_sets(client, [set_keys[b] for b in listed])
    pipe = _Pipe(client)
    for bucket, claims in wanted.items():
        for hex_hash, mask in claims.items():
            pipe.add("hset", schema.block_key_hex(hex_hash, bucket), pod_id, values[mask])
        for members in _chunks(list(claims)):
            pipe.add("sadd", set_keys[bucket], *members)
    for bucket in listed:
        claims = wanted.get(bucket, {})
        stale = [h for h in existing[set_keys[bucket]] if h not in claims]
        for hex_hash in stale:
            pipe.add("hdel", schema.block_key_hex(hex_hash, bucket), pod_id)
        for members in _chunks(stale):
            pipe.add("srem", set_keys[bucket], *members)
    pipe.send()
    emptied = listed - set(wanted)
    if emptied:  # their sets are empty now
        client.srem(schema.pod_buckets_key(pod_id), *(bucket_name(b) for b in emptied))
    return set(wanted)


def write_claim_changes(client: Any, schema: IndexSchema, pod_id: str,
                        changes: Iterable[BucketChange], values: Sequence[str],
                        listed: set[int]) -> None:
    """Write the net effect of one batch of events. `listed` is the pod's bucket list as
    written so far; buckets new to it are added (to Redis, then to `listed`) first."""
    changes = list(changes)
    new_buckets = {bucket for _, bucket, _, new in changes if new} - listed
    if new_buckets:
        list_buckets(client, schema, pod_id, new_buckets)
        listed |= new_buckets
    set_keys: dict[int, str] = {}
    pipe = _Pipe(client)
    for h, bucket, old, new in changes:
        hex_hash = h.hex()
        key = schema.block_key_hex(hex_hash, bucket)
        set_key = set_keys.get(bucket) or set_keys.setdefault(
            bucket, schema.pod_blocks_key(pod_id, bucket))
        if new:
            pipe.add("hset", key, pod_id, values[new])
            if not old:
                pipe.add("sadd", set_key, hex_hash)
        else:
            pipe.add("hdel", key, pod_id)
            pipe.add("srem", set_key, hex_hash)
    pipe.send()


def clear_pod_claims(client: Any, schema: IndexSchema, pod_id: str, batch: int = 1000) -> int:
    """Remove every block claim of `pod_id` (any epoch), using its bucket list and per-bucket
    sets, and the bucket list itself.

    Costs work proportional to the pod's own claims (and the buckets it used); never scans
    the keyspace. Returns the number of claims removed. The registration and lease are left
    alone.
    """
    hdels = _Pipe(client)
    buckets = sorted(listed_buckets(client, schema, pod_id))
    for bucket in buckets:
        for member in client.sscan_iter(schema.pod_blocks_key(pod_id, bucket), count=batch):
            hdels.add("hdel", schema.block_key_hex(text(member), bucket), pod_id)
    hdels.send()
    keys = [schema.pod_blocks_key(pod_id, b) for b in buckets]
    deletes = _Pipe(client)
    for key in (*keys, schema.pod_buckets_key(pod_id)):  # one key each: any slot
        deletes.add("delete", key)
    deletes.send()
    return hdels.total
