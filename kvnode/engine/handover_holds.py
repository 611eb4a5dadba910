"""Prefill/decode disaggregation, the prefill pod's side: the prompt blocks of a finished
prefill held in the pool for the decode pod's pull.

A request the router split carries `Handover.hold_ms`. When it finishes, its prompt's full
(hashed) blocks are pinned here under its id instead of going straight to the prefix cache,
so that making room for other prompts cannot evict them before the decode pod has pulled
them. A hold ends when a pull naming it (`KvSource.handover_id`) has been served in full,
when its deadline passes, or when the pod closes; the blocks then stay cached (evictable
like any other), so the next request with that prefix can still hit them here. Engine-thread
only, as the pool is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagekv.kvnode.memory.block_pool import KVCacheBlock
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager

logger = logging.getLogger(__name__)

# How a hold ended (the `outcome` label of pagekv_handover_holds_total).
SERVED = "served"    # a pull naming it was served in full
EXPIRED = "expired"  # its deadline passed first
EVICTED = "evicted"  # newer holds needed the room (holds may pin half the pool at most)
CLOSED = "closed"    # the pod stopped
HOLD_OUTCOMES = (SERVED, EXPIRED, EVICTED, CLOSED)
# A longer hold is refused down to this: a forged hold_ms must not pin a pool for good.
MAX_HOLD_S = 120.0


@dataclass(slots=True)
class _Hold:
    blocks: list[KVCacheBlock]
    deadline: float


@dataclass(frozen=True, slots=True)
class HoldStats:
    """Right now and so far: the blocks held, the holds, and how the finished ones ended."""

    held_blocks: int
    holds: int
    ended: dict[str, int]


class HandoverHolds:
    def __init__(self, manager: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.manager = manager
        self.clock = clock
        # Holds are a client's to ask for: they never pin more than half the pool, so the
        # pod's own requests always find room (the oldest hold gives way first).
        self.max_blocks = manager.num_blocks // 2
        self._holds: dict[str, _Hold] = {}
        self._held_blocks = 0
        self._ended = dict.fromkeys(HOLD_OUTCOMES, 0)

    def hold(self, handover_id: str, blocks: list[KVCacheBlock], hold_s: float) -> None:
        """Pin `blocks` (a finished prefill's prompt blocks) for `hold_s` seconds at most.
        An id held already is released first (a client reusing its request id)."""
        if not blocks or hold_s <= 0:
            return
        if handover_id in self._holds:
            self._end(handover_id, EXPIRED)
        if len(blocks) > self.max_blocks:
            return
        while self._held_blocks + len(blocks) > self.max_blocks:
            oldest = next(iter(self._holds))
            logger.warning("handover %s: released before its deadline to hold %s (holds "
                           "pin at most %d blocks)", oldest, handover_id, self.max_blocks)
            self._end(oldest, EVICTED)
        self.manager.pin(blocks)
        self._holds[handover_id] = _Hold(list(blocks), self.clock() + min(hold_s, MAX_HOLD_S))
        self._held_blocks += len(blocks)
        logger.debug("handover %s: %d blocks held for %.1f s", handover_id, len(blocks),
                     min(hold_s, MAX_HOLD_S))

    def release(self, handover_id: str) -> bool:
        """A pull naming the hold was served in full: the blocks go to the prefix cache.
        False when no such hold is here (expired already, or never made)."""
        if handover_id not in self._holds:
            return False
        self._end(handover_id, SERVED)
        return True

    def expire(self) -> int:
        """End the holds past their deadline (the decode pod never pulled, or failed to);
        returns how many ended."""
        if not self._holds:
            return 0
        now = self.clock()
        late = [hid for hid, h in self._holds.items() if h.deadline <= now]
        for hid in late:
            self._end(hid, EXPIRED)
            logger.info("handover %s: not pulled before its deadline; its blocks go to the "
                        "prefix cache", hid)
        return len(late)

    def close(self) -> None:
        for hid in list(self._holds):
            self._end(hid, CLOSED)

    def _end(self, handover_id: str, outcome: str) -> None:
        held = self._holds.pop(handover_id)
        self.manager.unpin(held.blocks)
        self._held_blocks -= len(held.blocks)
        self._ended[outcome] += 1

    def __contains__(self, handover_id: str) -> bool:
        return handover_id in self._holds

    def pinned_sets(self) -> list[list[KVCacheBlock]]:
        """The blocks each hold pins (the pool invariants' checks count them)."""
        return [h.blocks for h in self._holds.values()]

    def stats(self) -> HoldStats:
        return HoldStats(self._held_blocks, len(self._holds), dict(self._ended))
