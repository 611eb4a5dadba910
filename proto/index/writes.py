"""What a pod writes to the index, on a synchronous client (one node's or a cluster's): its
registration and lease, its block claims, and their removal.

Registration and lease are control keys (one hash tag: a MULTI is fine); a claim goes to its
bucket's tag. Claims are written by the CLAIM_WRITES script, CLAIM_RECORDS claims a call and
PIPELINE_CALLS calls a round trip (on a cluster, one bucket a call and one pipeline per
shard); reads and removals in bulk go through pipelines of at most PIPELINE_CHUNK commands.
No single call or reply is large enough to stall Redis or the pod. A bucket enters the
pod's bucket list before its first claim does, so whoever cleans up after the pod finds
every claim.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from redis.exceptions import NoScriptError

from pagekv.proto.index import scripts
from pagekv.proto.index.connect import REDIS_ERRORS, is_cluster
from pagekv.proto.index.mirror import BucketChange
from pagekv.proto.index.schema import POD_KINDS, POD_ROLES, IndexSchema, bucket_name, text

PIPELINE_CHUNK = 4096  # commands per pipeline round trip when writing many claims
# Claim writes per CLAIM_WRITES call: Redis runs a script alone, so each stays ~1 ms long.
CLAIM_RECORDS = 512
PIPELINE_CALLS = 32  # CLAIM_WRITES calls a round trip: ~1 MB of records at most
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
    set_keys = {b: schema.pod_blocks_key(pod_id, b) for b in listed}
    existing = scan_sets(client, [set_keys[b] for b in listed])
    claims = ClaimRecords(len(values))
    for bucket, hashes in wanted.items():
        for hex_hash, mask in hashes.items():
            claims.add(bucket, mask, hex_hash)
    claims.send(client, schema, pod_id, values)
    stale = ClaimRecords(len(values))
    for bucket in listed:
        hashes = wanted.get(bucket, {})
        for hex_hash in existing[set_keys[bucket]]:
            if hex_hash not in hashes:
                stale.add(bucket, 0, hex_hash)
    stale.send(client, schema, pod_id, values)
    emptied = listed - set(wanted)
    if emptied:  # their sets are empty now
        client.srem(schema.pod_buckets_key(pod_id), *(bucket_name(b) for b in emptied))
    return set(wanted)


def write_claim_changes(client: Any, schema: IndexSchema, pod_id: str,
                        changes: Iterable[BucketChange], values: Sequence[str],
                        listed: set[int]) -> None:
    """Write the net effect of one batch of events. `listed` is the pod's bucket list as
    written so far; buckets new to it are added (to Redis, then to `listed`) first."""
    claims = ClaimRecords(len(values))
    add = claims.add
    for h, bucket, _old, new in changes:
        add(bucket, new, h.hex())
    new_buckets = claims.claimed - listed  # (they must be listed before their claims)
    if new_buckets and is_cluster(client):  # (another shard: a round trip first)
        list_buckets(client, schema, pod_id, new_buckets)
        new_buckets = set()
    claims.send(client, schema, pod_id, values, new_buckets)
    listed |= new_buckets


_MASK_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"  # a record's first char (base 36)


class ClaimRecords:
    """Claim writes grouped by bucket, sent as CLAIM_WRITES calls: one record (the new mask
    in one char, the hash in hex) per claim instead of two commands, so that packing and
    parsing in the client cost a string join per call, not a command per block."""

    __slots__ = ("by_bucket", "chars", "claimed")

    def __init__(self, n_values: int) -> None:
        if n_values > len(_MASK_CHARS):
            raise ValueError(f"{n_values} tier masks do not fit one record char")
        self.chars = _MASK_CHARS[:n_values]
        self.by_bucket: dict[int, list[str]] = {}
        self.claimed: set[int] = set()  # buckets that get a claim (not only removals)

    def add(self, bucket: int, mask: int, hex_hash: str) -> None:
        """Set `hex_hash`'s claim to `mask` (0: remove it)."""
        records = self.by_bucket.get(bucket)
        if records is None:
            records = self.by_bucket[bucket] = []
        records.append(self.chars[mask] + hex_hash)
        if mask:
            self.claimed.add(bucket)

    def __len__(self) -> int:
        return sum(len(r) for r in self.by_bucket.values())

    def calls(self, schema: IndexSchema, pod_id: str, one_bucket_each: bool
              ) -> Iterator[tuple[list[str], list[str]]]:
        """(keys, per-bucket args) of each call, at most CLAIM_RECORDS records in one."""
        keys: list[str] = []
        args: list[str] = []
        n = 0
        for bucket, records in self.by_bucket.items():
            base = schema.bucket_base(bucket)
            set_key = schema.pod_blocks_key(pod_id, bucket)
            for i in range(0, len(records), CLAIM_RECORDS):
                part = records[i:i + CLAIM_RECORDS]
                if keys and (one_bucket_each or n + len(part) > CLAIM_RECORDS):
                    yield keys, args
                    keys, args, n = [], [], 0
                keys.append(set_key)
                args += (base, "".join(part))
                n += len(part)
        if keys:
            yield keys, args

    def send(self, client: Any, schema: IndexSchema, pod_id: str, values: Sequence[str],
             list_first: Collection[int] = ()) -> None:
        """The calls pipelined (PIPELINE_CALLS a round trip); on a cluster, per shard.
        `list_first`: buckets to add to the pod's bucket list at the head of the pipeline
        (one node only: a cluster's bucket list is on another shard than the claims)."""
        if not self.by_bucket:
            return
        width = len(next(iter(self.by_bucket.values()))[0]) - 1
        head = [pod_id, str(width), str(len(values) - 1), *values[1:]]
        if not is_cluster(client):
            listing = (schema.pod_buckets_key(pod_id), [bucket_name(b) for b in list_first])
            _pipelined(client, self.calls(schema, pod_id, False), head, listing)
            return
        if list_first:
            raise ValueError("a cluster's bucket list is written before, not in the pipeline")
        by_node: dict[str, tuple[Any, list[tuple[list[str], list[str]]]]] = {}
        for keys, args in self.calls(schema, pod_id, True):
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


def _pipelined(client: Any, calls: Iterable[tuple[list[str], list[str]]],
               head: Sequence[str], listing: tuple[str, list[str]] | None = None) -> None:
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
