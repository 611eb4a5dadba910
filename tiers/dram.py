"""The DRAM tier: a fixed slab of block-sized slots in host memory, LRU by block hash.

Every slot is allocated once at start-up (one tensor; pinned when the pool is on CUDA) so
demoting a block never allocates: `put` is one memcpy into a free slot. Without a copy stream
every copy is synchronous, so the pool may overwrite its block as soon as `put` returns.

With a copy stream (the pool on CUDA: tiers.copy_stream) the pool's blocks move in and out of
slots asynchronously, a batch at a time: `reserve` gives slots to blocks a copy will write,
`hold` takes blocks out for a copy to read and `release` frees their slots after it. Each
slot remembers the event of the last copy that touched it, and every CPU read or write of a
slot waits for that event first (`_settle`); copies on the stream itself run in order, so
they need no wait.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from pagekv.proto.medium import Medium
from pagekv.proto.retention import RetentionTable
from pagekv.tiers.base import BlockData, Tier, as_uint8_tensor, clone_block, copy_block
from pagekv.tiers.copy_stream import CopyEvent, CopyStream

logger = logging.getLogger(__name__)


class DramTier(Tier):
    medium = Medium.CPU

    def __init__(self, capacity_bytes: int, block_bytes: int, pin_memory: bool = False,
                 copy_stream: CopyStream | None = None,
                 retention: RetentionTable | None = None, retained_cap_bytes: int = 0) -> None:
        """`retention`: LRU victims it holds are passed over, up to `retained_cap_bytes` of
        them (proto/retention.py)."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.block_bytes = block_bytes
        self.num_slots = capacity_bytes // block_bytes
        want_pinned = pin_memory or (copy_stream is not None and copy_stream.pin_memory)
        pinned = bool(want_pinned and torch.cuda.is_available())
        # One allocation for the tier's lifetime; rows are slots.
        self._slab = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8, pin_memory=pinned)
        self.pinned = pinned
        self.copy_stream = copy_stream
        # The last copy-stream event per slot (None: no copy pending); only with a stream.
        self._events: list[CopyEvent | None] | None = (
            [None] * self.num_slots if copy_stream is not None else None)
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))  # stack: slot 0 first
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, LRU first
        self._held: set[int] = set()  # slots taken out by `hold`: neither free nor in the LRU
        self._lock = threading.Lock()
        self.evictions = 0
        self.retention = retention
        self.retained_cap_blocks = retained_cap_bytes // block_bytes
        logger.info(
            "DRAM tier: %d slots x %d B = %.1f MiB%s",
            self.num_slots,
            block_bytes,
            self.num_slots * block_bytes / 2**20,
            " (pinned)" if pinned else "",
        )

    @property
    def slab(self) -> torch.Tensor:
        """The [num_slots, block_bytes] host tensor the copy stream reads and writes."""
        return self._slab

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

    @property
    def num_held(self) -> int:
        return len(self._held)

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
            self._settle((slot,))
            return clone_block(self._slab[slot])

    def pop(self, block_hash: bytes) -> torch.Tensor | None:
        """Remove the block and return a copy (the slot is reused by the next put)."""
        with self._lock:
            slot = self._lru.pop(block_hash, None)
            if slot is None:
                return None
            self._settle((slot,))
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
            self._settle(slots)
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
                if not self._lru:
                    return False  # every slot is held by a copy
                _, victim_slot = self._lru.popitem(last=False)
                self._free.append(victim_slot)
                self.evictions += 1
            slot = self._free.pop()
            self._settle((slot,))
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
            self._settle(slots)
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
            if self.retention:
                block_hash = self.retention.spare_lru(self._lru, self.retained_cap_blocks,
                                                      self.medium.value)
                slot = self._lru.pop(block_hash)
            else:
                block_hash, slot = self._lru.popitem(last=False)
            self._settle((slot,))  # its data may still be on its way from the pool
            self._free.append(slot)
            self.evictions += 1
            return block_hash, self._slab[slot]

    def take(self, block_hash: bytes) -> torch.Tensor | None:
        """Remove this block and return a view of its slot, valid until the next `put` (as
        `pop_lru`'s): a quota's victim, moved down at once. None if absent (or held)."""
        with self._lock:
            slot = self._lru.pop(block_hash, None)
            if slot is None:
                return None
            self._settle((slot,))
            self._free.append(slot)
            self.evictions += 1
            return self._slab[slot]

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
        """Drop every block; return their hashes. Held slots stay held (their copy frees
        them); the rest are free, their last events kept for the CPU's next use."""
        with self._lock:
            dropped = list(self._lru)
            self._lru.clear()
            self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in self._held]
            return dropped

    # --- asynchronous copies (with a copy stream) ----------------------------------------
    def reserve(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Slots for new blocks (absent, with enough free slots: the caller made room) that a
        copy on the stream will write; they are in the LRU at once, readable by the CPU only
        after `guard`'s event. Ascending slots, so batches land in contiguous runs."""
        self._need_stream()
        with self._lock:
            if len(block_hashes) > len(self._free):
                raise ValueError(f"{len(block_hashes)} blocks but {len(self._free)} free slots")
            slots = [self._free.pop() for _ in block_hashes]
            slots.sort()
            for h, slot in zip(block_hashes, slots, strict=True):
                self._lru[h] = slot
            return slots

    def guard(self, slots: Sequence[int], event: CopyEvent) -> None:
        """`event` is the last copy touching these slots: the CPU waits for it before using one."""
        events = self._need_stream()
        with self._lock:
            for slot in slots:
                events[slot] = event

    def hold(self, block_hashes: Sequence[bytes]) -> list[int] | None:
        """Take blocks out for a copy to read: out of the LRU (no eviction, no second reader)
        but not free (no writer). None, and nothing held, unless every block is here."""
        self._need_stream()
        with self._lock:
            if not all(h in self._lru for h in block_hashes):
                return None
            slots = [self._lru.pop(h) for h in block_hashes]
            self._held.update(slots)
            return slots

    def release(self, slots: Sequence[int], event: CopyEvent | None) -> None:
        """Held slots whose copy was submitted (`event`) are free again; a CPU write into one
        waits for the event, a later copy on the stream runs after it anyway."""
        events = self._need_stream()
        with self._lock:
            self._unheld(slots)
            for slot in slots:
                if event is not None:
                    events[slot] = event
                self._free.append(slot)

    def unhold(self, block_hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        """Held blocks nobody copied go back into the LRU, most recently used."""
        self._need_stream()
        with self._lock:
            self._unheld(slots)
            for h, slot in zip(block_hashes, slots, strict=True):
                self._lru[h] = slot

    # --- internals (lock held) -----------------------------------------------------------
    def _settle(self, slots: Sequence[int]) -> None:
        """Wait for the copies still reading or writing these slots (CPU access next)."""
        events = self._events
        if events is None:
            return
        for slot in slots:
            event = events[slot]
            if event is not None:
                if not event.query():
                    event.synchronize()
                events[slot] = None

    def _need_stream(self) -> list[CopyEvent | None]:
        if self._events is None:
            raise RuntimeError("asynchronous slot copies need a DramTier built with a copy_stream")
        return self._events

    def _unheld(self, slots: Sequence[int]) -> None:
        for slot in slots:
            if slot not in self._held:
                raise ValueError(f"slot {slot} is not held")
            self._held.remove(slot)
