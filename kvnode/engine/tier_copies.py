"""Pool blocks a stream copy is still writing (the pool on CUDA), pinned until it completes.

A reload from DRAM (or the landing of an SSD read) submits its copy into freshly cached pool
blocks and returns at once (kvnode.engine.block_transfer). Until the copy's `done` event has
completed, those blocks are pinned (no eviction, no reuse: nothing may write them) and marked
busy by hash: an admission whose prefix hit includes one waits, so its forward pass never
reads a block still in flight, while the scheduler runs other requests meanwhile — the copy
overlaps their forward passes. Once complete, compute is ordered after the copy's event,
the pins are released, and the copy's measured time is counted with the chain's moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagekv.kvnode.engine.block_transfer import BlockTransfer, Copy
from pagekv.kvnode.memory.block_pool import KVCacheBlock
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
from pagekv.tiers.base import copy_block
from pagekv.tiers.chain import TierChain


@dataclass(slots=True)
class _InFlight:
    copy: Copy
    pinned: list[KVCacheBlock]  # the blocks the copy writes, referenced until it is done
    hashes: list[bytes]
    move: str  # the chain's move it belongs to: "dram_to_pool" / "ssd_to_pool"
    source: torch.Tensor | None  # host rows the copy reads, kept alive until it is done


class PoolCopies:
    def __init__(self, transfer: BlockTransfer, manager: KVCacheManager, chain: TierChain
                 ) -> None:
        self.transfer = transfer
        self.manager = manager
        self.chain = chain
        self._inflight: list[_InFlight] = []  # oldest first
        self._busy: dict[bytes, _InFlight] = {}

    def __len__(self) -> int:
        return len(self._inflight)

    def track(self, copy: Copy, block_ids: Sequence[int], hashes: Sequence[bytes], move: str,
              source: torch.Tensor | None = None) -> None:
        """A copy into these (just cached) pool blocks was submitted: pin them until done."""
        pool = self.manager.block_pool
        rec = _InFlight(copy, [pool.blocks[i] for i in block_ids], list(hashes), move, source)
        self.manager.pin(rec.pinned)
        self._inflight.append(rec)
        self._busy.update(dict.fromkeys(rec.hashes, rec))

    def busy(self, blocks: Sequence[KVCacheBlock]) -> bool:
        """True while a copy still writes one of these pool blocks (completed ones released)."""
        if not self._inflight:
            return False
        self.release_done()
        return any(b.block_hash in self._busy for b in blocks)

    def release_done(self) -> None:
        """Release every copy whose event has completed (events complete in order)."""
        while self._inflight and self._inflight[0].copy.done.query():
            self._finish(self._inflight.pop(0))

    def wait_one(self) -> None:
        """Block until the oldest copy completes (a few ms: the GIL is released meanwhile)."""
        if self._inflight:
            self._inflight[0].copy.done.synchronize()
        self.release_done()

    def sync_all(self) -> None:
        for rec in self._inflight:
            rec.copy.done.synchronize()
        self.release_done()

    def pinned_sets(self) -> list[list[KVCacheBlock]]:
        return [rec.pinned for rec in self._inflight]

    def _finish(self, rec: _InFlight) -> None:
        self.transfer.stream.order_compute(rec.copy.done)
        for h in rec.hashes:
            if self._busy.get(h) is rec:
                del self._busy[h]
        self.manager.unpin(rec.pinned)
        self.chain.add_move_seconds(rec.move, self.transfer.seconds(rec.copy))


def pack_rows(datas: list[torch.Tensor | None], block_bytes: int, pin: bool
              ) -> list[torch.Tensor | None]:
    """The leading run of blocks an SSD read returned, copied into the rows of one host
    tensor (pinned: the copy to the pool is then one async DMA), the rest as they are.
    Runs on the loader thread, so the engine thread only submits the copy."""
    run = 0
    while run < len(datas) and datas[run] is not None:
        run += 1
    if run == 0:
        return datas
    rows = torch.empty((run, block_bytes), dtype=torch.uint8, pin_memory=pin)
    for i in range(run):
        copy_block(rows[i], datas[i])  # type: ignore[arg-type]
    return [rows[i] for i in range(run)] + datas[run:]
