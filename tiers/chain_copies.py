"""The chain's side of asynchronous pool <-> DRAM copies (the pool on CUDA: tiers.copy_stream).

The synchronous `demote_many` / `promote_many` hand the chain the data itself. Here the chain
only decides and keeps the books, under its lock, while the caller's copy runs on the copy
stream straight between pool blocks and the DRAM tier's slab slots:

- demotion: the chain picks the blocks that are new below the pool, makes room, reserves a
  slot for each and calls `copy_in(batch indices, slots)`, which submits the copies and
  returns their event; the slots are guarded by it (the CPU waits before touching them).
- promotion: `hold_dram_run` takes a run of DRAM blocks out of the chain (as a promotion
  does) but keeps their slots aside; the caller copies them into the pool and then
  `end_hold` frees the slots of the blocks it loaded (after the copy's event) and puts the
  others back where they were, with no copy at all.

Every function runs with the chain's lock held (TierChain's wrappers take it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pagekv.proto.medium import Medium
from pagekv.tiers.chain_tree import Node
from pagekv.tiers.copy_stream import CopyEvent
from pagekv.tiers.dram import DramTier

if TYPE_CHECKING:
    from pagekv.tiers.chain import TierChain

# copy_in(indices into the batch, their slots, ascending) -> the event of the submitted copy
CopyIn = Callable[[list[int], list[int]], CopyEvent]


def async_dram(chain: TierChain) -> DramTier | None:
    """The chain's DRAM tier if it copies through a stream, else None."""
    dram = chain.dram
    if isinstance(dram, DramTier) and dram.copy_stream is not None:
        return dram
    return None


def demote_into_dram_locked(chain: TierChain, block_hashes: Sequence[bytes],
                            parent_hashes: Sequence[bytes | None], copy_in: CopyIn) -> bool:
    """Demote a batch evicted together by copying it into reserved DRAM slots. False (and
    nothing done) when DRAM cannot take the whole batch: the caller demotes synchronously."""
    dram = async_dram(chain)
    if dram is None or len(block_hashes) > dram.num_slots - dram.num_held:
        return False
    chain._sync_ssd_locked()
    fresh = [i for i, h in enumerate(block_hashes) if chain._refresh_locked(h) is None]
    if not fresh:
        return True
    chain._make_dram_room_locked(len(fresh))
    if dram.num_free_slots < len(fresh):
        return False  # (only with slots held meanwhile; nothing was reserved)
    t0 = time.perf_counter()
    slots = dram.reserve([block_hashes[i] for i in fresh])
    dram.guard(slots, copy_in(fresh, slots))
    chain._count_move("pool_to_dram", len(fresh) * dram.block_bytes, t0)  # the submission
    chain._c["demotions"] += len(fresh)
    for i in fresh:
        chain._tree.add(block_hashes[i], Node(parent_hashes[i], (), None, Medium.CPU))
    return True


def hold_dram_run_locked(chain: TierChain, block_hashes: Sequence[bytes]) -> list[int] | None:
    """Take consecutive DRAM blocks out of the chain for a copy into the pool: their slots,
    or None (nothing taken) unless every one is in DRAM."""
    dram = async_dram(chain)
    if dram is None or not block_hashes:
        return None
    chain._sync_ssd_locked()
    if not all(dram.contains(h) and h in chain._tree for h in block_hashes):
        return None
    return dram.hold(block_hashes)


def end_hold_locked(chain: TierChain, block_hashes: Sequence[bytes], slots: Sequence[int],
                    loaded: int, event: CopyEvent | None) -> None:
    """The first `loaded` held blocks were copied into the pool by the copy `event`: they
    leave the chain and their slots are freed behind the copy. The rest go back to DRAM."""
    dram = async_dram(chain)
    assert dram is not None
    dram.release(slots[:loaded], event)
    for h in block_hashes[:loaded]:
        if h in chain._tree:  # (its subtree may have been dropped meanwhile)
            chain._tree.left(h, Medium.CPU)
    chain._c["promotions_dram"] += loaded
    chain._c["dram_to_pool_bytes"] += loaded * dram.block_bytes
    back = [(h, s) for h, s in zip(block_hashes[loaded:], slots[loaded:], strict=True)]
    kept = [(h, s) for h, s in back if h in chain._tree]
    dram.unhold([h for h, _ in kept], [s for _, s in kept])
    dropped = [s for h, s in back if h not in chain._tree]
    if dropped:  # orphaned while held: nothing below the pool refers to them any more
        dram.release(dropped, None)
