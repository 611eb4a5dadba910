"""KV cache events: what the pool and the tiers tell the index.

Field names follow vLLM's `kv_events` (BlockStored / BlockRemoved / AllBlocksCleared) so an
index fed by unmodified vLLM pods reads the same shape. `medium` is the tier a block is in
(`proto.medium.Medium`, whose members equal vLLM's strings "GPU", "CPU", "DISK").
No torch import: the router and the index publisher read these too.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagekv.proto.medium import Medium


@dataclass(slots=True, frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: Medium = Medium.GPU


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: Medium = Medium.GPU


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    medium: Medium | None = None  # None: every tier was cleared


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
