"""Prefill/decode disaggregation, the prefill pod's side: the prompt blocks of a finished
prefill held in the pool for the decode pod's pull.

A request the router split carries `Handover.hold_ms`. When it finishes, its prompt's full
(hashed) blocks are pinned here under its id instead of going straight to the prefix cache,
so that making room for other prompts cannot evict them before the decode pod has pulled
them. The pull naming the hold (`KvSource.handover_id`) is served from it directly
(`lend`): the blocks are pinned already, so no call waits for the engine thread, which on a
busy prefill pod is in the middle of another prompt's step. A hold ends when a pull naming
it has been served in full, when its deadline passes (never while lent), or when the pod
closes; the blocks then stay cached (evictable like any other), so the next request with
that prefix can still hit them here.

Threads: hold, expire, release and close run on the engine thread (they pin and unpin
pool blocks); lend and give_back on a transfer's thread. The lock guards the books only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
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
    lent: int = 0        # transfers reading its blocks right now: it cannot end meanwhile
    served: bool = False  # a pull was served in full: end it at the engine's next tick


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
        self._lock = threading.Lock()

    # -- the engine thread ------------------------------------------------------------------
    def hold(self, handover_id: str, blocks: list[KVCacheBlock], hold_s: float) -> None:
        """Pin `blocks` (a finished prefill's prompt blocks) for `hold_s` seconds at most.
        An id held already is released first (a client reusing its request id), unless a
        transfer is reading it (then the new hold is not made)."""
        if not blocks or hold_s <= 0 or len(blocks) > self.max_blocks:
            return
        with self._lock:
            old = self._holds.get(handover_id)
            if old is not None and old.lent:
                return
            if old is not None:
                self._end(handover_id, EXPIRED)
            while self._held_blocks + len(blocks) > self.max_blocks:
                oldest = next((hid for hid, h in self._holds.items() if not h.lent), None)
                if oldest is None:
                    return  # every hold is being read: this one is not made
                logger.warning("handover %s: released before its deadline to hold %s (holds "
                               "pin at most %d blocks)", oldest, handover_id, self.max_blocks)
                self._end(oldest, EVICTED)
            self.manager.pin(blocks)
            self._holds[handover_id] = _Hold(list(blocks),
                                             self.clock() + min(hold_s, MAX_HOLD_S))
            self._held_blocks += len(blocks)
        logger.debug("handover %s: %d blocks held for %.1f s", handover_id, len(blocks),
                     min(hold_s, MAX_HOLD_S))

    def release(self, handover_id: str) -> bool:
        """The hold's blocks go to the prefix cache now (its pull was served in full; a
        transfer still reading it defers that to `expire`). False: no such hold."""
        with self._lock:
            held = self._holds.get(handover_id)
            if held is None:
                return False
            if held.lent:
                held.served = True
            else:
                self._end(handover_id, SERVED)
            return True

    def expire(self) -> int:
        """End the holds whose pull was served, and those past their deadline (the decode
        pod never pulled, or failed to) that no transfer is reading; returns how many."""
        if not self._holds:  # (a racy read: the next tick sees what this one missed)
            return 0
        now = self.clock()
        with self._lock:
            done = [(hid, SERVED if h.served else EXPIRED) for hid, h in self._holds.items()
                    if not h.lent and (h.served or h.deadline <= now)]
            for hid, outcome in done:
                self._end(hid, outcome)
        for hid, outcome in done:
            if outcome == EXPIRED:
                logger.info("handover %s: not pulled before its deadline; its blocks go to "
                            "the prefix cache", hid)
        return len(done)

    def close(self) -> None:
        """The pod stops (its transfers are over): every hold ends."""
        with self._lock:
            for hid in list(self._holds):
                self._end(hid, CLOSED)

    def _end(self, handover_id: str, outcome: str) -> None:
        """(Under the lock, on the engine thread.)"""
        held = self._holds.pop(handover_id)
        self.manager.unpin(held.blocks)
        self._held_blocks -= len(held.blocks)
        self._ended[outcome] += 1

    # -- a transfer's thread -----------------------------------------------------------------
    def lend(self, handover_id: str, block_hashes: Sequence[bytes]
             ) -> list[KVCacheBlock] | None:
        """The held blocks whose hashes are `block_hashes` (a consecutive run of the hold),
        for a transfer to read in place; the hold cannot end until `give_back`. None when
        the hold is gone or does not hold them all (serve the pull the ordinary way)."""
        if not block_hashes:
            return None
        with self._lock:
            held = self._holds.get(handover_id)
            if held is None or held.served:
                return None
            hashes = [b.block_hash for b in held.blocks]
            try:
                start = hashes.index(block_hashes[0])
            except ValueError:
                return None
            run = held.blocks[start : start + len(block_hashes)]
            if [b.block_hash for b in run] != list(block_hashes):
                return None
            held.lent += 1
            return run

    def give_back(self, handover_id: str) -> None:
        """A transfer `lend` served is over (its blocks are read)."""
        with self._lock:
            held = self._holds.get(handover_id)
            if held is not None and held.lent:
                held.lent -= 1

    # -- any thread ----------------------------------------------------------------------------
    def __contains__(self, handover_id: str) -> bool:
        return handover_id in self._holds

    def stats(self) -> HoldStats:
        return HoldStats(self._held_blocks, len(self._holds), dict(self._ended))
