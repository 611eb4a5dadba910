"""The interface every offload tier below the KV pool implements.

A tier stores whole blocks: one flat `torch.uint8` tensor of `block_bytes` bytes per block,
keyed by the block's chained hash (`bytes`). Sizes are in bytes. Tiers do not know about the
hash chain; `tiers.chain.TierChain` keeps parent/child links and decides where blocks go.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

import torch

TierMedium = Literal["CPU", "DISK"]

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


class Tier(ABC):
    """One storage level below the pool (DRAM or SSD)."""

    medium: TierMedium
    block_bytes: int

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

    @abstractmethod
    def contains(self, block_hash: bytes) -> bool:
        """True if `get` would find the block (without reading it)."""

    @abstractmethod
    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's data (a copy the caller owns), or None on a miss; the block stays."""

    @abstractmethod
    def pop(self, block_hash: bytes) -> torch.Tensor | None:
        """Remove the block and return its data (a copy the caller owns), or None on a miss."""

    @abstractmethod
    def put(
        self,
        block_hash: bytes,
        data: BlockData,
        parent_hash: bytes | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> bool:
        """Store a block (the data is copied before return). False if the tier refused it."""

    @abstractmethod
    def evict(self) -> bytes | None:
        """Drop the least recently used block; return its hash (None when empty)."""

    @abstractmethod
    def remove(self, block_hash: bytes) -> bool:
        """Drop a block; True if it was there."""

    @abstractmethod
    def keys(self) -> list[bytes]:
        """Hashes of every block held, least recently used first."""

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, bytes) and self.contains(block_hash)

    def __len__(self) -> int:
        return self.num_entries
