"""Shared by the Redis index's integration tests (tests/integration/test_index_*.py): the
test schema, stand-in hash chains and PodState, what an engine would hold, and reading every
key of a single node or a cluster. The client and make_pod fixtures are in conftest.py.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import redis

from pagekv.kvnode.index.publisher import IndexPublisher
from pagekv.proto.index import IndexSchema
from pagekv.proto.index.connect import is_cluster
from pagekv.proto.index.schema import CLAIM_ENTRY_BYTES, CLAIM_ID_BYTES, claim_field
from pagekv.proto.kv_events import BlockRemoved, BlockStored, KVEvent
from pagekv.proto.medium import MEDIUMS, Medium

SCHEMA = IndexSchema("tiny-llama", 16, "sha256", "seed-1")

PARENT: dict[bytes, bytes | None] = {}  # every chain() hash -> the one before it


def chain(n: int, tag: str = "a") -> list[bytes]:
    """n distinct 32-byte block hashes (stand-ins for a real hash chain, block 0 first)."""
    hashes = [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]
    for i, h in enumerate(hashes):
        PARENT[h] = hashes[i - 1] if i else None
    return hashes


def primaries(client: Any) -> Iterator[redis.Redis]:
    """A plain client per primary: the node itself, or each primary of a cluster."""
    if not is_cluster(client):
        yield client
        return
    for node in client.get_primaries():
        yield client.get_redis_connection(node)


def all_keys(client: Any) -> list[bytes]:
    """Every key, on every primary."""
    return [k for node in primaries(client) for k in node.keys("*")]


def claims_by_id(client: Any, schema: IndexSchema = SCHEMA) -> dict[bytes, dict[bytes, int]]:
    """Every claim of the namespace, by claim id: claim field -> tier mask (every bucket's
    claims HASH, on every primary; a value that is not whole entries is left out)."""
    out: dict[bytes, dict[bytes, int]] = {}
    pattern = f"{schema.prefix}:{{{schema.namespace}.*}}:c"
    for node in primaries(client):
        for key in node.scan_iter(match=pattern, count=1000):
            for field, value in node.hgetall(key).items():
                if len(value) % CLAIM_ENTRY_BYTES:
                    continue
                for i in range(0, len(value), CLAIM_ENTRY_BYTES):
                    entry = value[i:i + CLAIM_ENTRY_BYTES]
                    out.setdefault(entry[:CLAIM_ID_BYTES], {})[field] = entry[CLAIM_ID_BYTES]
    return out


def claim_id_of(client: Any, pod: str, schema: IndexSchema = SCHEMA) -> bytes:
    """The claim id `pod`'s registration names (b"": not registered)."""
    value = client.hget(schema.pod_key(pod), "claim")
    return bytes.fromhex(value.decode()) if value else b""


def best(mask: int) -> Medium:
    return next(m for m in MEDIUMS if mask & m.bit)


def held(client: Any, pod: str, schema: IndexSchema = SCHEMA) -> dict[bytes, Medium]:
    """What the index says `pod`'s registration holds: claim field -> best tier."""
    mine = claims_by_id(client, schema).get(claim_id_of(client, pod, schema), {})
    return {field: best(mask) for field, mask in mine.items()}


def by_field(blocks: dict[bytes, Any]) -> dict[bytes, Any]:
    """hash -> x as the index keys it: claim field -> x."""
    return {claim_field(h): x for h, x in blocks.items()}


class PodState:
    """What an engine would hold: hash -> tier, updated before events are submitted."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, str] = {}
        self.lock = threading.Lock()
        self.pub: IndexPublisher | None = None

    def emit(self, events: list[KVEvent]) -> None:
        with self.lock:
            for ev in events:
                if isinstance(ev, BlockStored):
                    for h in ev.block_hashes:
                        self.blocks[h] = ev.medium
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        if self.blocks.get(h) == ev.medium:
                            del self.blocks[h]
                else:
                    self.blocks = {h: t for h, t in self.blocks.items()
                                   if ev.medium is not None and t != ev.medium}
        assert self.pub is not None
        self.pub.submit(events)

    def full_state(self) -> dict[bytes, str]:
        with self.lock:
            return dict(self.blocks)

    def store(self, hashes: list[bytes], medium: str = "GPU") -> None:
        """A stored run, with its parent link as an engine reports it (chain() order)."""
        parent = PARENT.get(hashes[0])
        self.emit([BlockStored(hashes, parent, [], 16, medium=medium)])  # type: ignore[arg-type]

