"""What a pod writes to the index, on a `redis.Redis` client: its registration and lease,
its block claims, and their removal.

Claims are written through pipelines of at most PIPELINE_CHUNK commands: one round trip per
chunk, and no single reply large enough to stall Redis or the pod.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from pagekv.proto.index import scripts
from pagekv.proto.index.mirror import Change
from pagekv.proto.index.schema import IndexSchema, text

PIPELINE_CHUNK = 4096  # commands per pipeline round trip when writing many claims

# renew_lease results
RENEWED, REGISTRATION_GONE, SUPERSEDED = 1, 0, -1


# -- the pod HASH ------------------------------------------------------------------------------
def heartbeat_fields(seq: int) -> dict[str, str]:
    """`updated` (unix s) and `seq` (last applied event), written with every renewal."""
    return {"updated": f"{time.time():.3f}", "seq": str(seq)}


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
    pipe.sadd(schema.namespaces_key, schema.namespace)
    pipe.execute()


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
def write_all_claims(client: Any, schema: IndexSchema, pod_id: str,
                     masks: Mapping[bytes, int], values: Sequence[str]) -> None:
    """Make the index hold exactly `masks` for `pod_id` (`values`: claim_values(epoch)).

    Current claims are written before stale ones are removed: there is no window without
    this pod's claims.
    """
    set_key = schema.pod_blocks_key(pod_id)
    existing = {text(m) for m in client.sscan_iter(set_key, count=1000)}
    wanted = {h.hex(): mask for h, mask in masks.items()}
    pipe = client.pipeline(transaction=False)
    n = 0
    for hex_hash, mask in wanted.items():
        pipe.hset(schema.block_key_hex(hex_hash), pod_id, values[mask])
        if hex_hash not in existing:
            pipe.sadd(set_key, hex_hash)
        n += 1
        if n % PIPELINE_CHUNK == 0:
            pipe.execute()
    for hex_hash in existing - wanted.keys():
        pipe.hdel(schema.block_key_hex(hex_hash), pod_id)
        pipe.srem(set_key, hex_hash)
        n += 1
        if n % PIPELINE_CHUNK == 0:
            pipe.execute()
    pipe.execute()


def write_claim_changes(client: Any, schema: IndexSchema, pod_id: str,
                        changes: Iterable[Change], values: Sequence[str]) -> None:
    """Write the net effect of one batch of events (`ClaimMirror.apply`)."""
    set_key = schema.pod_blocks_key(pod_id)
    pipe = client.pipeline(transaction=False)
    n = 0
    for h, old, new in changes:
        hex_hash = h.hex()
        key = schema.block_key_hex(hex_hash)
        if new:
            pipe.hset(key, pod_id, values[new])
            if not old:
                pipe.sadd(set_key, hex_hash)
        else:
            pipe.hdel(key, pod_id)
            pipe.srem(set_key, hex_hash)
        n += 1
        if n % PIPELINE_CHUNK == 0:
            pipe.execute()
    if len(pipe):
        pipe.execute()


def clear_pod_claims(client: Any, schema: IndexSchema, pod_id: str, batch: int = 1000) -> int:
    """Remove every block claim of `pod_id` (any epoch), using its per-pod set.

    Costs work proportional to the pod's own blocks; never scans the keyspace. Returns the
    number of claims removed. The registration and lease are left alone.
    """
    set_key = schema.pod_blocks_key(pod_id)
    removed = 0
    pending: list[str] = []

    def _flush() -> None:
        nonlocal removed
        pipe = client.pipeline(transaction=False)
        for hex_hash in pending:
            pipe.hdel(schema.block_key_hex(hex_hash), pod_id)
        removed += sum(int(n) for n in pipe.execute())
        pending.clear()

    for member in client.sscan_iter(set_key, count=batch):
        pending.append(text(member))
        if len(pending) >= batch:
            _flush()
    if pending:
        _flush()
    client.delete(set_key)
    return removed
