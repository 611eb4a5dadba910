"""Reading blocks below the pool without moving them: what a peer's pull is served from.

A reload *moves* a block up (promote). Serving a peer copies it instead: the block stays
where it is for this pod's own next hit. DRAM copies are taken under the tier's lock, so an
eviction cannot tear one; SSD reads are checksum-verified like every SSD read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagekv.proto.medium import Medium
from pagekv.tiers.chain import TierChain


def media_below(chain: TierChain, block_hashes: Sequence[bytes]) -> list[Medium | None]:
    """Where each block is below the pool (None: not there); not counted as a lookup."""
    with chain._lock:
        chain._sync_ssd_locked()
        return [chain._find_locked(h) for h in block_hashes]


def read_run(chain: TierChain, block_hashes: Sequence[bytes]) -> list[torch.Tensor]:
    """Copies of the leading run of `block_hashes` held in DRAM or on SSD; it ends at the
    first block that is in neither (evicted meanwhile) or cannot be read."""
    found: list[torch.Tensor | None] = [
        chain.dram.get(h) if chain.dram is not None else None for h in block_hashes]
    missing = [i for i, data in enumerate(found) if data is None]
    if missing and chain.ssd is not None:
        for i, data in zip(missing, chain.ssd.get_many([block_hashes[i] for i in missing]),
                           strict=True):
            found[i] = data
    out: list[torch.Tensor] = []
    for data in found:
        if data is None:
            break
        out.append(data)
    return out
