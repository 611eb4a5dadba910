"""The interface every offload tier below the KV pool implements: what `TierChain` calls.

A tier stores whole blocks: one flat `torch.uint8` tensor of `block_bytes` bytes per block,
keyed by the block's chained hash (`bytes`). Sizes are in bytes. Tiers do not know about the
hash chain; `tiers.chain.TierChain` keeps parent/child links and decides where blocks go, so
`Tier` declares exactly the calls the chain makes on a tier, and nothing else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagekv.proto.medium import Medium

# What `put` accepts: a uint8 tensor (any device) or any bytes-like object.
BlockData = torch.Tensor | bytes | bytearray | memoryview


def as_uint8_tensor(data: BlockData, block_bytes: int) -> torch.Tensor:
    """A flat uint8 view of `data` (no copy where possible); checks the size."""
    if isinstance(data, torch.Tensor):
        t = data
        if t.dtype != torch.uint8:
            # Packed blocks are uint8; a typed tensor is reinterpreted, not converted.
            t = t.contiguous().view(torch.uint8)
        t = t.reshape(-1)
    else:
        mv = memoryview(data).cast("B")
        if mv.readonly:
            # torch.frombuffer warns on read-only buffers; numpy gives a read-only view instead.
            import numpy as np

            t = torch.from_numpy(np.frombuffer(mv, dtype=np.uint8).copy())
        else:
            t = torch.frombuffer(mv, dtype=torch.uint8) if mv.nbytes else torch.empty(0, dtype=torch.uint8)
    if t.numel() != block_bytes:
        raise ValueError(f"block data is {t.numel()} bytes, this tier stores blocks of {block_bytes} bytes")
    return t


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for one block. On CPU a plain single-threaded memcpy (through numpy): a
    block is ~100 KB, and torch's intra-op thread pool turns each such copy into a parallel
    region whose barrier stalls for a whole scheduler slice when the cores are busy."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        dst.numpy()[...] = src.numpy()
    else:
        dst.copy_(src)


def clone_block(src: torch.Tensor) -> torch.Tensor:
    """A copy of one block (see copy_block for why not `Tensor.clone`)."""
    if src.device.type == "cpu":
        return torch.from_numpy(src.numpy().copy())
    return src.clone()


@dataclass(slots=True, frozen=True)
class RecoveredEntry:
    """A block a tier found at start-up (handed to the chain once, for its tree and events)."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


class Tier(ABC):
    """One storage level below the pool (DRAM or SSD), as the chain sees it."""

    medium: Medium
    block_bytes: int

    # --- sizes -------------------------------------------------------------------------
    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """The byte budget of this tier."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes counted against the budget right now."""

    @property
    @abstractmethod
    def num_entries(self) -> int:
        """Blocks held (readable) right now."""

    @property
    @abstractmethod
    def num_free_slots(self) -> int:
        """How many more blocks `put` takes right now without evicting or refusing one."""

    @property
    def disabled(self) -> bool:
        """True once the tier has failed: it then holds nothing and refuses every put."""
        return False

    # --- lookups -----------------------------------------------------------------------
    @abstractmethod
    def contains(self, block_hash: bytes) -> bool:
        """True if `get` would find the block (without reading it)."""

    @abstractmethod
    def keys(self) -> list[bytes]:
        """Hashes of every block held, least recently used first."""

    @abstractmethod
    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's data (a copy the caller owns), or None on a miss; the block stays."""

    def get_many(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        """`get` for several blocks (a peer's pull reads the SSD's in one batch); they stay.
        The SSD tier reads adjacent entries together; any other tier asks one at a time."""
        return [self.get(h) for h in block_hashes]

    @abstractmethod
    def pop(self, block_hash: bytes) -> torch.Tensor | None:
        """Remove the block and return its data (a copy the caller owns), or None on a miss."""

    @abstractmethod
    def pop_many(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        """`pop` for several blocks at once (one gather or one batch of reads)."""

    # --- updates -----------------------------------------------------------------------
    @abstractmethod
    def put(
        self,
        block_hash: bytes,
        data: BlockData,
        parent_hash: bytes | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> bool:
        """Store a block (the data is copied before return). False if the tier refused it."""

    def put_rows(self, block_hashes: Sequence[bytes], rows: torch.Tensor) -> int:
        """Store new blocks from the rows of one [n, block_bytes] tensor, copied before return.
        The caller made room first (`num_free_slots`). Returns how many were stored."""
        return sum(self.put(h, row) for h, row in zip(block_hashes, rows, strict=True))

    @abstractmethod
    def pop_lru(self) -> tuple[bytes, torch.Tensor] | None:
        """Remove the least recently used block; (hash, data), None when empty. The data may
        be a view the next `put` overwrites: the caller copies it at once or not at all."""

    def take(self, block_hash: bytes) -> torch.Tensor | None:
        """Remove this block and return its data (None if absent), which may be a view as
        `pop_lru`'s is (the tier chain moves it down at once)."""
        return self.pop(block_hash)

    @abstractmethod
    def touch(self, block_hash: bytes) -> bool:
        """Mark a block most recently used; False if absent."""

    @abstractmethod
    def remove(self, block_hash: bytes) -> bool:
        """Drop a block; True if it was there."""

    @abstractmethod
    def clear(self) -> list[bytes]:
        """Drop every block; return their hashes."""

    # --- what the tier did on its own (defaults: it loses nothing, keeps nothing) ------
    def take_dropped(self) -> list[bytes]:
        """Hashes of blocks the tier lost without being asked since the last call."""
        return []

    def take_recovered(self) -> list[RecoveredEntry]:
        """Blocks found at start-up and still held (returned once)."""
        return []

    # --- lifetime ----------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted put is durable. False on timeout."""
        return True

    def close(self) -> None:
        """Release the tier's threads and files. Idempotent."""
        return None

    def stats(self) -> dict[str, float]:
        """Counters and sizes, for the chain's stats."""
        return {
            "entries": self.num_entries,
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
        }

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, bytes) and self.contains(block_hash)

    def __len__(self) -> int:
        return self.num_entries
