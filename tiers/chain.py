"""The exclusive tier chain below the pool: pool ▸ DRAM ▸ SSD.

A block lives in exactly one place. The pool demotes an evicted hashed block into DRAM (or
straight to SSD without DRAM); DRAM's LRU victims move to SSD; SSD's victims are dropped.
A lookup that continues past the pool asks `match_prefix`, and `promote` takes a block out of
its tier for the pool to load (the block leaves the chain: it is the pool's again). A peer's
pull is served by `media_below` / `read_run`, which copy blocks and leave them where they are.

Orphans: once a block has left every level, its descendants below the pool can never be
reached by a prefix lookup again, so the chain drops its whole subtree (`orphans_dropped`).
Promotion is not a drop: the block is back in the pool. Nor is a promotion that fails its
checksum: the caller recomputes that block.

The chain owns two parts with their own state: the tree of every block below the pool, which
also writes the KV events the index reads (`BlockTree`, tiers.chain_tree), and the counters
its figures are built from (`ChainCounters`, tiers.chain_stats). Every decision about where a
block goes is the chain's own, here.

Quotas (proto/tenant_ledger.py): with a ledger, the tree reports every block's tier to it,
and after each change that adds blocks below the pool an owner over its DRAM quota has its
oldest DRAM blocks moved down to the SSD, one over its SSD quota its oldest SSD blocks
dropped (`_enforce_quotas_locked`): that owner's, never another's.

Threads: the engine thread calls demote / match_prefix / promote; a loader thread may run
promote_many; a peer's pull reads from its own thread; the SSD tier writes (and evicts) in
its own thread. Chain state is under one lock, which promote_many releases while it reads the
SSD, so a demote never waits for a disk read. The SSD tier reports the blocks it lost on its
own through `take_dropped()`, drained under the chain lock at the start of each call, so no
tier ever calls back into the chain (no lock-order cycles).

With the pool on CUDA the data moves on a copy stream (tiers.copy_stream) straight between
pool blocks and the DRAM tier's slab slots, and the chain only decides and keeps the books:
`demote_into_dram` reserves slots that the caller's copy fills, `hold_dram_run` / `end_hold`
take a run of DRAM blocks out for a copy into the pool and settle what the pool took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from pagekv.proto.kv_events import KVEvent
from pagekv.proto.medium import Medium
from pagekv.proto.retention import RetentionTable
from pagekv.proto.tenant_ledger import TenantLedger
from pagekv.proto.tier_stats import ChainStats
from pagekv.tiers.base import BlockData, Tier, as_uint8_tensor
from pagekv.tiers.chain_stats import ChainCounters
from pagekv.tiers.chain_tree import BlockTree, Node
from pagekv.tiers.copy_stream import CopyEvent
from pagekv.tiers.dram import DramTier

# copy_in(indices into the batch, their slots, ascending) -> the event of the submitted copy
CopyIn = Callable[[list[int], list[int]], CopyEvent]
# What a pool batch yields: (block hash, parent hash, row of block_bytes), LRU first.
PoolBatches = Iterable[Sequence[tuple[bytes, bytes | None, torch.Tensor]]]


class TierChain:
    def __init__(self, dram: Tier | None, ssd: Tier | None, *, block_size: int | None = None,
                 ledger: TenantLedger | None = None, retention: RetentionTable | None = None
                 ) -> None:
        """`ledger`: owners and quotas; `retention`: the quota's victims it holds go last."""
        if dram is not None and ssd is not None and dram.block_bytes != ssd.block_bytes:
            raise ValueError(f"DRAM blocks are {dram.block_bytes} B but SSD blocks are {ssd.block_bytes} B")
        self.dram = dram if dram is not None and dram.capacity_bytes > 0 else None
        self.ssd = ssd
        self.block_size = block_size
        self._lock = threading.Lock()
        self._tree = BlockTree(block_size, ledger)  # every block below the pool, and the events
        self._ledger = ledger
        self._retention = retention
        self._promoting: set[bytes] = set()  # SSD blocks being read by promote_many
        self._counters = ChainCounters()
        if ssd is not None:
            # Warm restart: what the SSD still holds is below the pool again; tell the index.
            for rec in ssd.take_recovered():
                node = Node(rec.parent_hash, rec.token_ids, None, Medium.DISK)
                self._tree.add(rec.block_hash, node)
            with self._lock:
                self._enforce_quotas_locked()

    # --- the pool's side -----------------------------------------------------------------------
    def demote(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int],
               data: BlockData, lora_id: int | None = None) -> Medium | None:
        """The pool evicted this block: keep it one level down. Returns where it went (None: dropped).

        `data` is copied before return, so the pool may reuse its block right away.
        """
        with self._lock:
            self._sync_ssd_locked()
            medium = self._refresh_locked(block_hash)
            if medium is not None:
                return medium
            self._counters.add("demotions")
            node = Node(parent_hash, tuple(token_ids), lora_id, Medium.CPU)
            self._place_locked(block_hash, node, data)
            self._enforce_quotas_locked()  # (which may move this very block down)
            placed = self._tree.get(block_hash)
            return placed.medium if placed is not None else None

    def demote_many(self, block_hashes: Sequence[bytes], parent_hashes: Sequence[bytes | None],
                    rows: torch.Tensor) -> None:
        """`demote` for a batch evicted together ([n, block_bytes] rows): with DRAM, room is
        made first (LRU victims move down one by one), then the new blocks land in one copy."""
        dram = self.dram
        if dram is None or len(block_hashes) * dram.block_bytes > dram.capacity_bytes:
            for h, parent, row in zip(block_hashes, parent_hashes, rows, strict=True):
                self.demote(h, parent, (), row)
            return
        with self._lock:
            self._sync_ssd_locked()
            fresh = [i for i, h in enumerate(block_hashes) if self._refresh_locked(h) is None]
            if not fresh:
                return
            self._make_dram_room_locked(len(fresh))
            if dram.num_free_slots < len(fresh):  # slots held by copies: one at a time
                for i in fresh:
                    self._counters.add("demotions")
                    node = Node(parent_hashes[i], (), None, Medium.CPU)
                    self._place_locked(block_hashes[i], node, rows[i])
                self._enforce_quotas_locked()
                return
            t0 = time.perf_counter()
            src = rows if len(fresh) == len(block_hashes) else rows[fresh]
            dram.put_rows([block_hashes[i] for i in fresh], src)
            self._counters.count_move("pool_to_dram", src.numel(), t0)
            self._counters.add("demotions", len(fresh))
            for i in fresh:
                self._tree.add(block_hashes[i], Node(parent_hashes[i], (), None, Medium.CPU))
            self._enforce_quotas_locked()

    def match_prefix(self, block_hashes: Sequence[bytes], start: int = 0) -> list[Medium]:
        """Media (CPU / DISK) of the consecutive blocks from `start` held below the pool."""
        out: list[Medium] = []
        with self._lock:
            self._sync_ssd_locked()
            self._counters.add("lookups")
            for block_hash in block_hashes[start:]:
                medium = self._find_locked(block_hash, count=True)
                if medium is None:
                    break
                out.append(medium)
        return out

    def promote(self, block_hash: bytes) -> torch.Tensor | None:
        """Take a block out of its tier for the pool. None: not here, or unreadable (recompute)."""
        return self.promote_many([block_hash])[0]

    def promote_many(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Promote consecutive blocks of one prefix; the SSD ones are read in one batch.

        Returns data for the leading run of blocks that could be promoted and None from the
        first block that could not (absent, or unreadable: the caller recomputes from there).
        Blocks after that point stay below the pool. The chain lock is not held during the
        SSD read, so a loader thread can promote while the engine thread demotes.
        """
        n = len(block_hashes)
        out: list[torch.Tensor | None] = [None] * n
        with self._lock:
            self._sync_ssd_locked()
            run: list[Medium] = []  # media of the consecutive blocks present
            for block_hash in block_hashes:
                medium = self._find_locked(block_hash)
                if medium is None:
                    break
                run.append(medium)
            self._counters.add("promote_misses", n - len(run))
            if run and Medium.DISK not in run:
                # All in DRAM (the common reload): one gather, no lock release in between.
                assert self.dram is not None
                t0 = time.perf_counter()
                rows = self.dram.pop_many(block_hashes[: len(run)])
                self._counters.count_move("dram_to_pool", len(rows) * self.dram.block_bytes, t0)
                self._counters.add("promotions_dram", len(run))
                for i, row in enumerate(rows):
                    out[i] = row
                    self._tree.left(block_hashes[i], Medium.CPU)
                return out
            disk = [i for i, medium in enumerate(run) if medium == Medium.DISK]
            # Until this call has dealt with them, the SSD's reports about these blocks are
            # ours to handle (a failed read is not a drop: see the module docstring).
            self._promoting.update(block_hashes[i] for i in disk)
        read: dict[int, torch.Tensor | None] = {}
        ssd_seconds = 0.0
        if disk and self.ssd is not None:
            t0 = time.perf_counter()
            try:
                read = dict(zip(disk, self.ssd.pop_many([block_hashes[i] for i in disk]),
                                strict=True))
            except BaseException:
                with self._lock:  # the SSD's drop reports about them are ours again
                    self._promoting.difference_update(block_hashes[i] for i in disk)
                raise
            ssd_seconds = time.perf_counter() - t0
        with self._lock:
            self._promoting.difference_update(block_hashes[i] for i in disk)
            self._counters.add_seconds("ssd_to_pool_seconds", ssd_seconds)
            cut = False
            for i in range(len(run)):
                block_hash = block_hashes[i]
                source: Medium
                if i in read:
                    data, source = read[i], Medium.DISK
                else:
                    if cut:
                        continue  # untouched: stays in DRAM
                    data, source = self._pop_dram_locked(block_hash)
                if data is None:
                    cut = True
                    if source == Medium.DISK and block_hash in self._tree and not self._ssd_has(block_hash):
                        # Corrupt or unreadable: the SSD dropped it; the caller recomputes it.
                        self._counters.add("promote_failures")
                        self._tree.left(block_hash, Medium.DISK)
                    continue
                if cut:
                    self._put_back_ssd_locked(block_hash, data)  # read, but past the gap
                    continue
                out[i] = data
                dram = source == Medium.CPU
                self._counters.add("promotions_dram" if dram else "promotions_ssd")
                self._counters.add("dram_to_pool_bytes" if dram else "ssd_to_pool_bytes",
                                   data.numel())
                self._tree.left(block_hash, source)
        return out

    # --- the pool's side, copying through a stream (the pool on CUDA) --------------------------
    @property
    def async_dram(self) -> DramTier | None:
        """The DRAM tier if it copies through a stream, else None (no stream copies here)."""
        dram = self.dram
        if isinstance(dram, DramTier) and dram.copy_stream is not None:
            return dram
        return None

    def demote_into_dram(self, block_hashes: Sequence[bytes], parent_hashes: Sequence[bytes | None],
                         copy_in: CopyIn) -> bool:
        """`demote_many` where the caller copies into reserved DRAM slots: the chain picks the
        blocks that are new below the pool, makes room, reserves a slot for each and calls
        `copy_in(batch indices, slots)`, which submits the copies and returns their event;
        the slots are guarded by it (the CPU waits before touching them). False (and nothing
        done) when DRAM cannot take the whole batch: the caller demotes synchronously."""
        with self._lock:
            dram = self.async_dram
            if dram is None or len(block_hashes) > dram.num_slots - dram.num_held:
                return False
            self._sync_ssd_locked()
            fresh = [i for i, h in enumerate(block_hashes) if self._refresh_locked(h) is None]
            if not fresh:
                return True
            self._make_dram_room_locked(len(fresh))
            if dram.num_free_slots < len(fresh):
                return False  # (only with slots held meanwhile; nothing was reserved)
            t0 = time.perf_counter()
            slots = dram.reserve([block_hashes[i] for i in fresh])
            dram.guard(slots, copy_in(fresh, slots))
            self._counters.count_move("pool_to_dram", len(fresh) * dram.block_bytes, t0)  # the submission
            self._counters.add("demotions", len(fresh))
            for i in fresh:
                self._tree.add(block_hashes[i], Node(parent_hashes[i], (), None, Medium.CPU))
            self._enforce_quotas_locked()
            return True

    def hold_dram_run(self, block_hashes: Sequence[bytes]) -> list[int] | None:
        """Take consecutive DRAM blocks out of the chain (as a promotion does) for a copy into
        the pool, keeping their slots aside: the slots, or None (nothing taken) unless every
        one is in DRAM."""
        with self._lock:
            dram = self.async_dram
            if dram is None or not block_hashes:
                return None
            self._sync_ssd_locked()
            if not all(dram.contains(h) and h in self._tree for h in block_hashes):
                return None
            return dram.hold(block_hashes)

    def end_hold(self, block_hashes: Sequence[bytes], slots: Sequence[int], loaded: int,
                 event: CopyEvent | None) -> None:
        """The first `loaded` held blocks were copied into the pool by the copy `event`: they
        leave the chain and their slots are freed behind the copy. The rest go back to DRAM
        where they were, with no copy at all."""
        with self._lock:
            dram = self.async_dram
            assert dram is not None
            dram.release(slots[:loaded], event)
            for h in block_hashes[:loaded]:
                if h in self._tree:  # (its subtree may have been dropped meanwhile)
                    self._tree.left(h, Medium.CPU)
            self._counters.add("promotions_dram", loaded)
            self._counters.add("dram_to_pool_bytes", loaded * dram.block_bytes)
            back = [(h, s) for h, s in zip(block_hashes[loaded:], slots[loaded:], strict=True)]
            kept = [(h, s) for h, s in back if h in self._tree]
            dram.unhold([h for h, _ in kept], [s for _, s in kept])
            dropped = [s for h, s in back if h not in self._tree]
            if dropped:  # orphaned while held: nothing below the pool refers to them any more
                dram.release(dropped, None)

    def add_move_seconds(self, direction: str, seconds: float) -> None:
        """Time a stream copy took, measured once it completed (e.g. "dram_to_pool")."""
        with self._lock:
            self._counters.add_seconds(f"{direction}_seconds", seconds)

    # --- a peer's side: copies of blocks that stay where they are ------------------------------
    def media_below(self, block_hashes: Sequence[bytes]) -> list[Medium | None]:
        """Where each block is below the pool (None: not there); not counted as a lookup."""
        with self._lock:
            self._sync_ssd_locked()
            return [self._find_locked(h) for h in block_hashes]

    def read_run(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor]:
        """Copies of the leading run of `block_hashes` held in DRAM or on SSD; it ends at the
        first block that is in neither (evicted meanwhile) or cannot be read.

        A reload moves a block up (promote); serving a peer copies it, so it stays for this
        pod's own next hit. No chain lock: DRAM copies are taken under the tier's own lock,
        so an eviction cannot tear one, and SSD reads are checksum-verified like every one.
        """
        found: list[torch.Tensor | None] = [
            self.dram.get(h) if self.dram is not None else None for h in block_hashes]
        missing = [i for i, data in enumerate(found) if data is None]
        if missing and self.ssd is not None:
            for i, data in zip(missing, self.ssd.get_many([block_hashes[i] for i in missing]),
                               strict=True):
                found[i] = data
        out: list[torch.Tensor] = []
        for data in found:
            if data is None:
                break
            out.append(data)
        return out

    # --- the index's side ----------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """Drain the KV events (BlockStored / BlockRemoved with medium CPU or DISK)."""
        with self._lock:
            self._sync_ssd_locked()
            return self._tree.take_events()

    def full_state(self) -> dict[bytes, Medium]:
        """Every block below the pool -> its medium, for a full republish."""
        with self._lock:
            self._sync_ssd_locked()
            state: dict[bytes, Medium] = {}
            for tier in (self.ssd, self.dram):
                if tier is not None:
                    state.update(dict.fromkeys(tier.keys(), tier.medium))
            return state

    # --- an operator's side ----------------------------------------------------------------------
    def discard(self, block_hashes: Sequence[bytes]) -> dict[Medium, int]:
        """Delete these blocks from every tier below the pool, with their descendants here (no
        lookup reaches those any more), publishing their removal. How many went, per tier."""
        gone = {Medium.CPU: 0, Medium.DISK: 0}
        with self._lock:
            self._sync_ssd_locked()
            for block_hash in block_hashes:
                node = self._tree.get(block_hash)
                if node is None:
                    continue
                self._tier_of(node.medium).remove(block_hash)
                self._tree.left(block_hash, node.medium)
                gone[node.medium] += 1
                for child, medium in self._tree.drop_descendants(block_hash):
                    self._tier_of(medium).remove(child)
                    gone[medium] += 1
        return gone

    def parent_of(self, block_hash: bytes) -> tuple[bool, bytes | None]:
        """(whether the block is below the pool, the hash of the block before it)."""
        with self._lock:
            node = self._tree.get(block_hash)
            return (False, None) if node is None else (True, node.parent_hash)

    def _tier_of(self, medium: Medium) -> Tier:
        tier = self.dram if medium == Medium.CPU else self.ssd
        assert tier is not None  # (a block is only ever in a tier the chain has)
        return tier

    # --- figures (tiers.chain_stats) -----------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Every raw counter and size, flat, for diagnostics."""
        with self._lock:
            self._sync_ssd_locked()
            return self._counters.flat(len(self._tree), self.dram, self.ssd)

    def tier_stats(self) -> ChainStats:
        """The typed per-tier record the engine, Prometheus and the StatsResponse all read."""
        if self.block_size is None:
            raise ValueError("tier_stats() counts tokens: build the chain with its block_size")
        with self._lock:
            self._sync_ssd_locked()
            return self._counters.tier_stats(self.dram, self.ssd, self.block_size)

    # --- clearing, shutdown --------------------------------------------------------------------
    def clear(self) -> int:
        """Drop every block below the pool (files go in the background). Returns how many."""
        with self._lock:
            self._sync_ssd_locked()
            dropped = len(self._tree)
            tiers = [tier for tier in (self.dram, self.ssd) if tier is not None]
            for tier in tiers:
                tier.clear()
                tier.take_dropped()  # cleared, not lost: nothing more to publish
            self._tree.cleared(tuple(tier.medium for tier in tiers))
            return dropped

    def persist(self, pool_batches: PoolBatches) -> dict[Medium, int]:
        """Shutdown: write DRAM (LRU first) and then the pool's cached blocks to the SSD, so a
        restarted pod finds its hottest prefixes. `pool_batches` yield (hash, parent hash,
        row), least recently used first. Returns the blocks written per source tier.

        Only the SSD survives a restart, and the hottest prefixes are the ones still in the
        pool or in DRAM; without this a restarted pod's lookup misses on a prefix's first
        block and never reaches the rest of it on disk. DRAM's blocks move (the index hears
        CPU -> DISK); the pool's stay the pool's until it is gone, so they are not published.
        The SSD's backlog is waited for when full: at shutdown, nothing else is.
        """
        ssd = self.ssd
        written = {Medium.GPU: 0, Medium.CPU: 0}
        if ssd is None or ssd.disabled:
            return written
        with self._lock:
            self._sync_ssd_locked()
            dram = self.dram
            for block_hash in dram.keys() if dram is not None else ():
                assert dram is not None
                node = self._tree.get(block_hash)
                data = dram.get(block_hash) if node is not None else None
                if node is None or data is None or not _put_waiting(
                        ssd, block_hash, data, node.parent_hash):
                    continue
                dram.remove(block_hash)
                self._tree.moved(block_hash, node, Medium.DISK)
                written[Medium.CPU] += 1
            for batch in pool_batches:
                for block_hash, parent_hash, row in batch:
                    if block_hash in self._tree:
                        continue  # already below the pool: one copy is enough
                    if _put_waiting(ssd, block_hash, row, parent_hash):
                        written[Medium.GPU] += 1
            self._enforce_quotas_locked()
        ssd.flush()
        return written

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()

    # --- internals (lock held) -----------------------------------------------------------------
    def _enforce_quotas_locked(self) -> None:
        """Owners over their DRAM quota: their oldest DRAM blocks move down to the SSD (or are
        dropped without one); over their SSD quota: their oldest SSD blocks are dropped."""
        ledger = self._ledger
        if ledger is None:
            return
        retention = self._retention
        now = retention.now() if retention else 0.0
        retained = (lambda h: retention.holds(h, now)) if retention else None
        dram, ssd = self.dram, self.ssd
        if dram is not None:
            for owner in ledger.over(Medium.CPU):
                moved = 0
                for h in ledger.victims(owner, Medium.CPU, ledger.excess(owner, Medium.CPU),
                                        dram.contains, retained):
                    data = dram.take(h)
                    if data is not None:
                        self._move_dram_victim_locked(h, data)
                        moved += 1
                ledger.count_evicted(owner, Medium.CPU, moved)
        if ssd is not None:
            for owner in ledger.over(Medium.DISK):
                dropped = 0
                for h in ledger.victims(owner, Medium.DISK, ledger.excess(owner, Medium.DISK),
                                        ssd.contains, retained):
                    node = self._tree.get(h)
                    if ssd.remove(h) and node is not None and node.medium == Medium.DISK:
                        self._lost_locked(h, Medium.DISK)
                        dropped += 1
                ledger.count_evicted(owner, Medium.DISK, dropped)

    def _find_locked(self, block_hash: bytes, count: bool = False) -> Medium | None:
        """The medium a block is held in below the pool, DRAM first; `count`: as a lookup
        (per-tier queries and hits)."""
        for name, tier in (("dram", self.dram), ("ssd", self.ssd)):
            if tier is None:
                continue
            if count:
                self._counters.add(f"{name}_queries")
            if tier.contains(block_hash):
                if count:
                    self._counters.add(f"{name}_hits")
                return tier.medium
        return None

    def _refresh_locked(self, block_hash: bytes) -> Medium | None:
        """A block the pool evicts again (it recomputed it) is below the pool already, and one
        copy is enough: it only becomes DRAM's most recent. Its medium, None if not below."""
        node = self._tree.get(block_hash)
        if node is None:
            return None
        if node.medium == Medium.CPU and self.dram is not None:
            self.dram.touch(block_hash)
        return node.medium

    def _place_locked(self, block_hash: bytes, node: Node, data: BlockData) -> Medium | None:
        """Put a block that is in no tier yet into the highest tier that takes it."""
        if self.dram is not None:
            src = as_uint8_tensor(data, self.dram.block_bytes)
            self._make_dram_room_locked(1)
            t0 = time.perf_counter()
            if self.dram.put(block_hash, src):  # (refused only while copies hold every slot)
                self._counters.count_move("pool_to_dram", src.numel(), t0)
                node.medium = Medium.CPU
                self._tree.add(block_hash, node)
                return Medium.CPU
        if self.ssd is not None:
            t0 = time.perf_counter()
            if self.ssd.put(block_hash, data, node.parent_hash, node.token_ids):
                self._counters.count_move("pool_to_ssd", self.ssd.block_bytes, t0)
                node.medium = Medium.DISK
                self._tree.add(block_hash, node)
                return Medium.DISK
        self._lost_locked(block_hash, None)
        return None

    def _make_dram_room_locked(self, n: int) -> None:
        """Free `n` DRAM slots (if DRAM has that many) by moving LRU victims down one level."""
        assert self.dram is not None
        while self.dram.num_free_slots < n:
            victim = self.dram.pop_lru()
            if victim is None:
                break
            self._move_dram_victim_locked(*victim)

    def _move_dram_victim_locked(self, block_hash: bytes, data: torch.Tensor) -> None:
        """DRAM's LRU victim goes one level down (the SSD copies `data` before returning)."""
        node = self._tree.get(block_hash)
        if node is None:  # not ours (put into DRAM directly): nothing was published
            return
        if self.ssd is not None:
            t0 = time.perf_counter()
            if self.ssd.put(block_hash, data, node.parent_hash, node.token_ids):
                self._counters.count_move("dram_to_ssd", data.numel(), t0)
                self._tree.moved(block_hash, node, Medium.DISK)
                return
        self._lost_locked(block_hash, Medium.CPU)

    def _lost_locked(self, block_hash: bytes, medium: Medium | None) -> None:
        """A block left every level (nowhere to go, or lost by its tier): publish its removal
        from `medium` (None: it was never stored), count the drop, and drop its descendants
        below the pool, which no prefix lookup can reach now."""
        if medium is not None:
            self._tree.left(block_hash, medium)
        self._counters.add("drops")
        for child, child_medium in self._tree.drop_descendants(block_hash):
            tier = self.dram if child_medium == Medium.CPU else self.ssd
            if tier is not None:
                tier.remove(child)
            self._counters.add("orphans_dropped")

    def _pop_dram_locked(self, block_hash: bytes) -> tuple[torch.Tensor | None, Medium]:
        """Take a block found in DRAM by the lookup; it may have moved to the SSD since."""
        t0 = time.perf_counter()
        data = self.dram.pop(block_hash) if self.dram is not None else None
        self._counters.add_seconds("dram_to_pool_seconds", time.perf_counter() - t0)
        if data is None and self._ssd_has(block_hash):
            assert self.ssd is not None
            t0 = time.perf_counter()
            data = self.ssd.pop(block_hash)  # the DRAM victim is still in the SSD's write-behind
            self._counters.add_seconds("ssd_to_pool_seconds", time.perf_counter() - t0)
            return data, Medium.DISK
        return data, Medium.CPU

    def _ssd_has(self, block_hash: bytes) -> bool:
        return self.ssd is not None and self.ssd.contains(block_hash)

    def _put_back_ssd_locked(self, block_hash: bytes, data: torch.Tensor) -> None:
        """A block read from the SSD that the caller cannot use goes back (rewritten)."""
        node = self._tree.get(block_hash)
        if node is None:
            return
        if self.ssd is not None and self.ssd.put(block_hash, data, node.parent_hash, node.token_ids):
            return
        self._lost_locked(block_hash, Medium.DISK)

    def _sync_ssd_locked(self) -> None:
        """Apply the blocks the SSD lost on its own (evicted, corrupt, disabled)."""
        if self.ssd is None:
            return
        for block_hash in self.ssd.take_dropped():
            node = self._tree.get(block_hash)
            if node is None or node.medium != Medium.DISK or self.ssd.contains(block_hash):
                continue  # already promoted, or stored again since
            if block_hash in self._promoting:
                continue  # a promotion in flight reads it; it handles the outcome
            self._lost_locked(block_hash, Medium.DISK)


def _put_waiting(ssd: Tier, block_hash: bytes, data: BlockData, parent_hash: bytes | None) -> bool:
    """`ssd.put`, waiting for the writer once when its backlog is full (persist, at shutdown)."""
    if ssd.put(block_hash, data, parent_hash):
        return True
    ssd.flush()
    return ssd.put(block_hash, data, parent_hash)
