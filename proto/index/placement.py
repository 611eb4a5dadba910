"""Which bucket each of a pod's blocks is published in: the bucket of its chain's block 0.

The router hashes whole prompts, so it knows a request's bucket from its first hash. A pod
only sees KV events, and learns each block's bucket from their parent links, the way vLLM's
events define them: a run stored with no parent starts at block 0 (its first hash is the
chain's root); a run with a parent continues the parent's chain, hence its bucket. A run
whose parent is unknown here waits for it and is placed when the parent is, never guessed: a
block in the wrong bucket could never be found, and would spread its wrong bucket to every
block stored after it.

A hash's bucket never changes (it is a function of its chain), so learning is idempotent:
replaying events, or learning the same run twice, changes nothing. Pure; the publisher thread
owns it.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from pagekv.proto.index.schema import bucket_of
from pagekv.proto.kv_events import BlockStored, KVEvent


class ChainBuckets:
    __slots__ = ("buckets", "waiting", "waits_on")

    def __init__(self) -> None:
        self.buckets: dict[bytes, int] = {}
        self.waits_on: dict[bytes, bytes] = {}  # a hash waiting -> the hash before it
        self.waiting: dict[bytes, list[bytes]] = {}  # an unplaced hash -> hashes waiting on it

    def __len__(self) -> int:
        return len(self.buckets) + len(self.waits_on)

    def get(self, block_hash: bytes) -> int | None:
        return self.buckets.get(block_hash)

    def learn(self, events: Iterable[KVEvent]) -> list[bytes]:
        """Learn the buckets of stored runs. Returns every hash placed by this call (its
        claim can be written from now on), in the order placed."""
        placed: list[bytes] = []
        buckets = self.buckets
        for ev in events:
            if not isinstance(ev, BlockStored) or not ev.block_hashes:
                continue
            hashes = ev.block_hashes
            parent = ev.parent_block_hash
            bucket = bucket_of(hashes[0]) if parent is None else buckets.get(parent)
            if bucket is None:  # one of the run may be placed already: same chain
                bucket = next((buckets[h] for h in hashes if h in buckets), None)
            if bucket is None:
                if parent is not None:  # (a run without a parent is always placed)
                    self._wait(hashes, parent)
                continue
            for h in hashes:
                if h not in buckets:
                    self._place(h, bucket, placed)
        return placed

    def _wait(self, hashes: list[bytes], parent: bytes) -> None:
        """Each hash of the run waits on the one before it, the first on the parent."""
        before = parent
        for h in hashes:
            if h not in self.waits_on:
                self.waits_on[h] = before
                self.waiting.setdefault(before, []).append(h)
            before = h

    def _place(self, block_hash: bytes, bucket: int, placed: list[bytes]) -> None:
        """Place one hash, then whatever waited on it (iteratively: chains can be long)."""
        stack = [block_hash]
        while stack:
            h = stack.pop()
            if h in self.buckets:
                continue
            self.buckets[h] = bucket
            self.waits_on.pop(h, None)
            placed.append(h)
            stack.extend(self.waiting.pop(h, ()))

    def compact(self, held: Container[bytes]) -> None:
        """Forget every hash not in `held` (the pod's current claims). Kept until then, so a
        block that leaves a tier in one batch and arrives in another in the next keeps its
        bucket; the publisher compacts when this grows to twice its claims."""
        self.buckets = {h: b for h, b in self.buckets.items() if h in held}
        self.waits_on = {h: p for h, p in self.waits_on.items() if h in held}
        waiting: dict[bytes, list[bytes]] = {}
        for h, p in self.waits_on.items():
            waiting.setdefault(p, []).append(h)
        self.waiting = waiting
