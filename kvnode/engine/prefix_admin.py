"""An operator's questions about one prefix on this pod: where its blocks are, and delete them.

The prefix is its chain of block hashes, root first (the pod hashes a prompt the way an
admission does; `chain_ending_at` walks back from a last block's hash through the parent
links the pool and the tiers keep). Engine thread only (`Engine.locate` / `delete_prefix`
are called through the async engine's command queue).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagekv.kvnode.engine.tier_connector import TierConnector
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
from pagekv.proto.medium import Medium
from pagekv.proto.retention import RetentionTable

MAX_CHAIN_BLOCKS = 8192  # the longest prefix asked about (as PullBlocksRequest's)


@dataclass(frozen=True, slots=True)
class PrefixHolding:
    prefix_blocks: int  # the blocks looked for
    by_tier: dict[Medium, int]  # of them, held in each tier (deleted: that went from each)
    retained: int  # pinned or a session's (deleted: marks released)

    @property
    def total(self) -> int:
        return sum(self.by_tier.values())


class PrefixAdmin:
    def __init__(self, manager: KVCacheManager, tiers: TierConnector | None,
                 retention: RetentionTable) -> None:
        self.manager = manager
        self.tiers = tiers
        self.retention = retention

    def chain_ending_at(self, block_hash: bytes) -> list[bytes]:
        """The chain from its root to `block_hash`, as far back as this pod knows it (empty
        when it holds no such block)."""
        chain: list[bytes] = []
        h: bytes | None = block_hash
        while h is not None and len(chain) < MAX_CHAIN_BLOCKS:
            found, parent = self.manager.parent_of(h)
            if not found and self.tiers is not None:
                found, parent = self.tiers.parent_of(h)
            if not found:
                break
            chain.append(h)
            h = parent
        chain.reverse()
        return chain

    def locate(self, hashes: Sequence[bytes]) -> PrefixHolding:
        cached = self.manager.cached_hashes()
        by_tier = {Medium.GPU: 0, Medium.CPU: 0, Medium.DISK: 0}
        below: list[bytes] = []
        for h in hashes:
            if h in cached:
                by_tier[Medium.GPU] += 1
            else:
                below.append(h)
        if below and self.tiers is not None:
            for medium in self.tiers.media_below(below):
                if medium is not None:
                    by_tier[medium] += 1
        retained = sum(1 for h in hashes if self.retention.holds(h))
        return PrefixHolding(len(hashes), by_tier, retained)

    def delete(self, hashes: Sequence[bytes]) -> PrefixHolding:
        """Every copy of these blocks goes (a block a running request holds stays its,
        uncached), their marks too; the index hears it from the events."""
        by_tier = {Medium.GPU: self.manager.forget_cached(hashes), Medium.CPU: 0,
                   Medium.DISK: 0}
        if self.tiers is not None:
            by_tier.update(self.tiers.discard(hashes))
        released = self.retention.release(hashes)
        return PrefixHolding(len(hashes), by_tier, released)
