"""Persist on shutdown: the blocks in DRAM and in the pool are written down to the SSD.

Only the SSD survives a restart, and the hottest prefixes are the ones still in the pool or in
DRAM; without this a restarted pod's lookup misses on a prefix's first block and never reaches
the rest of it on disk. DRAM goes first, least recently used first (its blocks move: the index
hears CPU -> DISK), then the pool's cached blocks, which stay the pool's until it is gone and
so are not published. The SSD's backlog is waited for when full: at shutdown, nothing else is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from pagekv.proto.medium import Medium
from pagekv.tiers.base import BlockData, Tier
from pagekv.tiers.chain_tree import BlockTree

# What a pool batch yields: (block hash, parent hash, row of block_bytes), LRU first.
PoolBatches = Iterable[Sequence[tuple[bytes, bytes | None, torch.Tensor]]]


def persist_locked(ssd: Tier, dram: Tier | None, tree: BlockTree, pool_batches: PoolBatches
                   ) -> dict[Medium, int]:
    """Write DRAM and then the pool to `ssd` (the chain's lock held). Returns the blocks
    written per source tier; the caller flushes the SSD."""
    written = {Medium.GPU: 0, Medium.CPU: 0}
    for block_hash in dram.keys() if dram is not None else ():
        node = tree.get(block_hash)
        data = dram.get(block_hash) if node is not None else None
        if data is None or not _put_waiting(ssd, block_hash, data, node.parent_hash):
            continue
        dram.remove(block_hash)
        tree.moved(block_hash, node, Medium.DISK)
        written[Medium.CPU] += 1
    for batch in pool_batches:
        for block_hash, parent_hash, row in batch:
            if block_hash in tree:
                continue  # already below the pool: one copy is enough
            if _put_waiting(ssd, block_hash, row, parent_hash):
                written[Medium.GPU] += 1
    return written


def _put_waiting(ssd: Tier, block_hash: bytes, data: BlockData, parent_hash: bytes | None) -> bool:
    """`ssd.put`, waiting for the writer once when its backlog is full."""
    if ssd.put(block_hash, data, parent_hash):
        return True
    ssd.flush()
    return ssd.put(block_hash, data, parent_hash)
