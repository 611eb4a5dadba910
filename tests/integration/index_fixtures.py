"""Shared by the Redis index's integration tests (tests/integration/test_index_*.py): the
test schema, stand-in block hashes and PodState, what an engine would hold. The client and
make_pod fixtures are in conftest.py.
"""

from __future__ import annotations

import hashlib
import threading

from pagekv.kvnode.pod.publisher import IndexPublisher
from pagekv.proto.index import IndexSchema
from pagekv.proto.kv_events import BlockRemoved, BlockStored, KVEvent

SCHEMA = IndexSchema("tiny-llama", 16, "sha256", "seed-1")


def chain(n: int, tag: str = "a") -> list[bytes]:
    """n distinct 32-byte block hashes (stand-ins for a real hash chain)."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


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
        self.emit([BlockStored(hashes, None, [], 16, medium=medium)])  # type: ignore[arg-type]

