"""The DRAM tier: a fixed slab of block-sized slots in host memory, LRU by block hash.

Every slot is allocated once at start-up (one tensor, pinned when CUDA is present and asked
for) so demoting a block never allocates: `put` is one memcpy into a free slot. The copy is
synchronous, so the pool may overwrite its block as soon as `put` returns.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from pagekv.proto.medium import Medium
from pagekv.tiers.base import BlockData, Tier, as_uint8_tensor, clone_block, copy_block

logger = logging.getLogger(__name__)


class DramTier(Tier):
    medium = Medium.CPU

    def __init__(self, capacity_bytes: int, block_bytes: int, pin_memory: bool = False) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.block_bytes = block_bytes
        self.num_slots = capacity_bytes // block_bytes
        pinned = bool(pin_memory and torch.cuda.is_available())
        # One allocation for the tier's lifetime; rows are slots.
        self._slab = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8, pin_memory=pinned)
        self.pinned = pinned
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))  # stack: slot 0 first
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, LRU first
        self._lock = threading.Lock()
        self.evictions = 0
        logger.info(
            "DRAM tier: %d slots x %d B = %.1f MiB%s",
            self.num_slots,
            block_bytes,
            self.num_slots * block_bytes / 2**20,
            " (pinned)" if pinned else "",
        )

    # --- sizes -------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    @property
    def used_bytes(self) -> int:
        return len(self._lru) * self.block_bytes

    @property
    def num_entries(self) -> int:
        return len(self._lru)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def is_full(self) -> bool:
        return not self._free

    # --- lookups -----------------------------------------------------------------------
    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._lru)

    def slot_of(self, block_hash: bytes) -> int | None:
        return self._lru.get(block_hash)

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """A copy of the block's data; the block becomes most recently used."""
        with self._lock:
            slot = self._lru.get(block_hash)
            if slot is None:
                return None
            self._lru.move_to_end(block_hash)
            return clone_block(self._slab[slot])

    def pop(self, block_hash: bytes) -> torch.Tensor | None:
        """Remove the block and return a copy (the slot is reused by the next put)."""
        with self._lock:
            slot = self._lru.pop(block_hash, None)
            if slot is None:
                return None
            out = clone_block(self._slab[slot])
            self._free.append(slot)
            return out

    def pop_many(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Remove blocks and return their data (None for a miss): the rows of one tensor,
        gathered in a single copy (a prefix reload takes many blocks at once)."""
        with self._lock:
            found = [(i, slot) for i, h in enumerate(block_hashes)
                     if (slot := self._lru.pop(h, None)) is not None]
            out: list[torch.Tensor | None] = [None] * len(block_hashes)
            if not found:
                return out
            slots = [slot for _, slot in found]
            if self._slab.device.type == "cpu":
                rows = torch.from_numpy(self._slab.numpy()[slots])
            else:
                rows = self._slab[torch.tensor(slots)].cpu()
            self._free.extend(slots)
            for (i, _), row in zip(found, rows, strict=True):
                out[i] = row
            return out

    # --- updates -----------------------------------------------------------------------
    def put(
        self,
        block_hash: bytes,
        data: BlockData,
        parent_hash: bytes | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> bool:
        """Copy `data` into a slot; when full, the LRU block is dropped first (see pop_lru)."""
        src = as_uint8_tensor(data, self.block_bytes)
        with self._lock:
            if self.num_slots == 0:
                return False
            slot = self._lru.get(block_hash)
            if slot is not None:
                # Same hash means same content: just refresh recency.
                self._lru.move_to_end(block_hash)
                return True
            if not self._free:
                _, victim_slot = self._lru.popitem(last=False)
                self._free.append(victim_slot)
                self.evictions += 1
            slot = self._free.pop()
            copy_block(self._slab[slot], src)  # synchronous, also from a CUDA tensor
            self._lru[block_hash] = slot
            return True

    def put_rows(self, block_hashes: Sequence[bytes], rows: torch.Tensor) -> int:
        """Store new blocks (absent, with enough free slots: the caller made room) from the
        rows of one [n, block_bytes] tensor in a single scatter copy."""
        with self._lock:
            if len(block_hashes) > len(self._free):
                raise ValueError(f"{len(block_hashes)} blocks but {len(self._free)} free slots")
            slots = [self._free.pop() for _ in block_hashes]
            if self._slab.device.type == "cpu" and rows.device.type == "cpu":
                self._slab.numpy()[slots] = rows.numpy()
            else:
                self._slab[torch.tensor(slots)] = rows.to(self._slab.device)
            for h, slot in zip(block_hashes, slots, strict=True):
                self._lru[h] = slot
            return len(slots)

    def pop_lru(self) -> tuple[bytes, torch.Tensor] | None:
        """Remove the LRU block and return (hash, view of its slot).

        The view stays valid only until the next `put` (which may reuse the slot); the chain
        uses it to hand the victim to the SSD tier, which copies it at once.
        """
        with self._lock:
            if not self._lru:
                return None
            block_hash, slot = self._lru.popitem(last=False)
            self._free.append(slot)
            self.evictions += 1
            return block_hash, self._slab[slot]

    def evict(self) -> bytes | None:
        """Drop the least recently used block; return its hash (None when empty)."""
        victim = self.pop_lru()
        return None if victim is None else victim[0]

    def remove(self, block_hash: bytes) -> bool:
        with self._lock:
            slot = self._lru.pop(block_hash, None)
            if slot is None:
                return False
            self._free.append(slot)
            return True

    def touch(self, block_hash: bytes) -> bool:
        """Mark a block most recently used; False if absent."""
        with self._lock:
            if block_hash not in self._lru:
                return False
            self._lru.move_to_end(block_hash)
            return True

    def clear(self) -> list[bytes]:
        """Drop every block; return their hashes."""
        with self._lock:
            dropped = list(self._lru)
            self._lru.clear()
            self._free = list(range(self.num_slots - 1, -1, -1))
            return dropped
