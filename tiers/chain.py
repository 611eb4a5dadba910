"""The exclusive tier chain below the pool: pool ▸ DRAM ▸ SSD.

A block lives in exactly one place. The pool demotes an evicted hashed block into DRAM (or
straight to SSD without DRAM); DRAM's LRU victims move to SSD; SSD's victims are dropped.
A lookup that continues past the pool asks `match_prefix`, and `promote` takes a block out of
its tier for the pool to load (the block leaves the chain: it is the pool's again).

Orphans: a prefix lookup stops at the first miss, so once a block has left every level, its
descendants below the pool can never be reached again. The chain keeps parent -> children
links of the blocks it holds and drops a dropped block's whole subtree (`orphans_dropped`).
Promotion is not a drop: the block is back in the pool and its descendants stay reachable.
The same holds for a promotion that fails its checksum: the caller recomputes that block into
the pool, so its descendants stay too.

Threads: the engine thread calls demote / match_prefix / promote; a loader thread may run
promote_many; the SSD tier writes (and evicts) in its own thread. Chain state is under one
lock, which promote_many releases while it reads the SSD, so a demote never waits for a disk
read. The SSD tier reports the blocks it lost on its own through `take_dropped()`, drained
under the chain lock at the start of each call, so no tier ever calls back into the chain
(no lock-order cycles).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from proto.medium import Medium
from proto.tier_stats import MOVES, ChainStats, TierMove, TierStats, move_name
from tiers.base import BlockData, TierMedium, as_uint8_tensor
from tiers.dram import DramTier
from tiers.ssd import SsdTier

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Node:
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    lora_id: int | None
    medium: TierMedium


_COUNTERS = (
    "demotions",
    "drops",  # blocks that left the bottom of the chain (nowhere to go, SSD eviction or loss)
    "orphans_dropped",
    "lookups",
    "dram_queries",
    "dram_hits",
    "ssd_queries",
    "ssd_hits",
    "promotions_dram",
    "promotions_ssd",
    "promote_misses",
    "promote_failures",  # found but unreadable (checksum failure, I/O error)
    "pool_to_dram_bytes",
    "pool_to_dram_seconds",
    "pool_to_ssd_bytes",
    "pool_to_ssd_seconds",
    "dram_to_ssd_bytes",
    "dram_to_ssd_seconds",
    "dram_to_pool_bytes",
    "dram_to_pool_seconds",
    "ssd_to_pool_bytes",
    "ssd_to_pool_seconds",
)


class TierChain:
    def __init__(
        self,
        dram: DramTier | None,
        ssd: SsdTier | None,
        *,
        block_size: int | None = None,
    ) -> None:
        if dram is not None and ssd is not None and dram.block_bytes != ssd.block_bytes:
            raise ValueError(f"DRAM blocks are {dram.block_bytes} B but SSD blocks are {ssd.block_bytes} B")
        self.dram = dram if dram is not None and dram.num_slots > 0 else None
        self.ssd = ssd
        self.block_size = block_size
        self._lock = threading.Lock()
        self._nodes: dict[bytes, _Node] = {}  # every block below the pool
        self._children: dict[bytes, set[bytes]] = {}  # parent -> children below the pool
        self._events: list[KVEvent] = []
        self._promoting: set[bytes] = set()  # SSD blocks being read by promote_many
        self._c: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        if ssd is not None:
            # Warm restart: what the SSD still holds is below the pool again; tell the index.
            for rec in ssd.take_recovered():
                self._add_node(rec.block_hash, _Node(rec.parent_hash, rec.token_ids, None, "DISK"))

    # --- the pool's side -----------------------------------------------------------------------
    def demote(
        self,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        data: BlockData,
        lora_id: int | None = None,
    ) -> TierMedium | None:
        """The pool evicted this block: keep it one level down. Returns where it went (None: dropped).

        `data` is copied before return, so the pool may reuse its block right away.
        """
        with self._lock:
            self._sync_ssd_locked()
            node = self._nodes.get(block_hash)
            if node is not None:
                # Already below the pool (the pool recomputed it): one copy is enough.
                if node.medium == "CPU" and self.dram is not None:
                    self.dram.touch(block_hash)
                return node.medium
            self._c["demotions"] += 1
            node = _Node(parent_hash, tuple(token_ids), lora_id, "CPU")
            return self._place_locked(block_hash, node, data)

    def demote_many(
        self,
        block_hashes: Sequence[bytes],
        parent_hashes: Sequence[bytes | None],
        rows: torch.Tensor,
    ) -> None:
        """`demote` for a batch evicted together ([n, block_bytes] rows): with DRAM, room is
        made first (LRU victims move down one by one), then the new blocks land in one copy."""
        dram = self.dram
        if dram is None or len(block_hashes) > dram.num_slots:
            for h, parent, row in zip(block_hashes, parent_hashes, rows, strict=True):
                self.demote(h, parent, (), row)
            return
        with self._lock:
            self._sync_ssd_locked()
            fresh: list[int] = []
            for i, h in enumerate(block_hashes):
                node = self._nodes.get(h)
                if node is not None:  # already below the pool: one copy is enough
                    if node.medium == "CPU":
                        dram.touch(h)
                    continue
                fresh.append(i)
            if not fresh:
                return
            while dram.num_free_slots < len(fresh):
                victim = dram.pop_lru()
                if victim is None:
                    break
                self._move_dram_victim_locked(*victim)
            t0 = time.perf_counter()
            src = rows if len(fresh) == len(block_hashes) else rows[fresh]
            dram.put_rows([block_hashes[i] for i in fresh], src)
            self._c["pool_to_dram_seconds"] += time.perf_counter() - t0
            self._c["pool_to_dram_bytes"] += src.numel()
            self._c["demotions"] += len(fresh)
            for i in fresh:
                self._add_node(block_hashes[i], _Node(parent_hashes[i], (), None, "CPU"))

    def match_prefix(self, block_hashes: Sequence[bytes], start: int = 0) -> list[str]:
        """Media ("CPU"/"DISK") of the consecutive blocks from `start` held below the pool."""
        out: list[str] = []
        with self._lock:
            self._sync_ssd_locked()
            self._c["lookups"] += 1
            for block_hash in block_hashes[start:]:
                if self.dram is not None:
                    self._c["dram_queries"] += 1
                    if self.dram.contains(block_hash):
                        self._c["dram_hits"] += 1
                        out.append("CPU")
                        continue
                if self.ssd is not None:
                    self._c["ssd_queries"] += 1
                    if self.ssd.contains(block_hash):
                        self._c["ssd_hits"] += 1
                        out.append("DISK")
                        continue
                break
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
            run: list[TierMedium] = []  # media of the consecutive blocks present
            for block_hash in block_hashes:
                if self.dram is not None and self.dram.contains(block_hash):
                    run.append("CPU")
                elif self.ssd is not None and self.ssd.contains(block_hash):
                    run.append("DISK")
                else:
                    break
            self._c["promote_misses"] += n - len(run)
            if run and "DISK" not in run:
                # All in DRAM (the common reload): one gather, no lock release in between.
                assert self.dram is not None
                t0 = time.perf_counter()
                rows = self.dram.pop_many(block_hashes[: len(run)])
                self._c["dram_to_pool_seconds"] += time.perf_counter() - t0
                self._c["dram_to_pool_bytes"] += rows.numel()
                self._c["promotions_dram"] += len(run)
                for i in range(len(run)):
                    out[i] = rows[i]
                    self._left_tier_locked(block_hashes[i], "CPU")
                return out
            disk = [i for i, medium in enumerate(run) if medium == "DISK"]
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
            self._c["ssd_to_pool_seconds"] += ssd_seconds
            cut = False
            for i in range(len(run)):
                block_hash = block_hashes[i]
                medium: TierMedium
                if i in read:
                    data, medium = read[i], "DISK"
                else:
                    if cut:
                        continue  # untouched: stays in DRAM
                    data, medium = self._pop_dram_locked(block_hash)
                if data is None:
                    cut = True
                    if medium == "DISK" and block_hash in self._nodes and not self._ssd_has(block_hash):
                        # Corrupt or unreadable: the SSD dropped it; the caller recomputes it.
                        self._c["promote_failures"] += 1
                        self._left_tier_locked(block_hash, "DISK")
                    continue
                if cut:
                    self._put_back_ssd_locked(block_hash, data)  # read, but past the gap
                    continue
                out[i] = data
                self._c["promotions_dram" if medium == "CPU" else "promotions_ssd"] += 1
                self._c["dram_to_pool_bytes" if medium == "CPU" else "ssd_to_pool_bytes"] += data.numel()
                self._left_tier_locked(block_hash, medium)
        return out

    def clear(self) -> int:
        """Drop every block below the pool (files go in the background). Returns how many."""
        with self._lock:
            self._sync_ssd_locked()
            dropped = len(self._nodes)
            if self.dram is not None:
                self.dram.clear()
                self._events.append(AllBlocksCleared("CPU"))
            if self.ssd is not None:
                self.ssd.clear()
                self.ssd.take_dropped()
                self._events.append(AllBlocksCleared("DISK"))
            self._nodes.clear()
            self._children.clear()
            return dropped

    # --- the index's side ----------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """Drain the KV events (BlockStored / BlockRemoved with medium "CPU" or "DISK")."""
        with self._lock:
            self._sync_ssd_locked()
            events, self._events = self._events, []
            return events

    def full_state(self) -> dict[bytes, str]:
        """Every block below the pool -> its medium, for a full republish."""
        with self._lock:
            self._sync_ssd_locked()
            state: dict[bytes, str] = {}
            if self.ssd is not None:
                state.update(dict.fromkeys(self.ssd.keys(), "DISK"))
            if self.dram is not None:
                state.update(dict.fromkeys(self.dram.keys(), "CPU"))
            return state

    def stats(self) -> dict[str, float]:
        with self._lock:
            self._sync_ssd_locked()
            out = dict(self._c)
            out["blocks_below_pool"] = len(self._nodes)
            for prefix, tier in (("dram", self.dram), ("ssd", self.ssd)):
                out[f"{prefix}_used_bytes"] = tier.used_bytes if tier is not None else 0
                out[f"{prefix}_capacity_bytes"] = tier.capacity_bytes if tier is not None else 0
                out[f"{prefix}_entries"] = tier.num_entries if tier is not None else 0
            if self.ssd is not None:
                ssd = self.ssd.stats()
                for key in ("checksum_failures", "torn_entries", "read_errors", "evictions",
                            "put_drops", "pending_bytes", "bytes_written", "write_seconds",
                            "bytes_read", "read_seconds", "disabled"):  # fmt: skip
                    out[f"ssd_{key}"] = ssd[key]
            out["checksum_failures"] = out.get("ssd_checksum_failures", 0)
            return out

    def tier_stats(self) -> ChainStats:
        """The typed per-tier record the engine, Prometheus and the StatsResponse all read
        (`stats()` is every raw counter, flat, for diagnostics)."""
        if self.block_size is None:
            raise ValueError("tier_stats() counts tokens: build the chain with its block_size")
        bs = self.block_size
        with self._lock:
            self._sync_ssd_locked()
            c = self._c
            tiers = {}
            for medium, prefix, tier in ((Medium.CPU, "dram", self.dram),
                                         (Medium.DISK, "ssd", self.ssd)):
                tiers[medium] = TierStats(
                    medium,
                    tier.used_bytes if tier is not None else 0,
                    tier.capacity_bytes if tier is not None else 0,
                    tier.num_entries if tier is not None else 0,
                    c[f"{prefix}_hits"] * bs,
                    c[f"{prefix}_queries"] * bs,
                )
            moves = tuple(TierMove(src, dst, c[f"{move_name(src, dst)}_bytes"],
                                   c[f"{move_name(src, dst)}_seconds"]) for src, dst in MOVES)
            failures = self.ssd.stats()["checksum_failures"] if self.ssd is not None else 0
            return ChainStats(tiers, moves, c["orphans_dropped"], failures)

    def persist(self, pool_batches: Iterable[Sequence[tuple[bytes, bytes | None, torch.Tensor]]]
                ) -> dict[str, int]:
        """Shutdown: write DRAM (LRU first) and then the pool's cached blocks to the SSD.

        Only the SSD survives a restart, and the hottest prefixes are the ones still in the pool
        or DRAM; without this a restarted pod's lookup misses on a prefix's first block and never
        reaches the rest of it on disk. `pool_batches` yield (hash, parent hash, row), least
        recently used first. Returns the blocks written per source tier."""
        written = {"GPU": 0, "CPU": 0}
        ssd = self.ssd
        if ssd is None or ssd.disabled:
            return written
        with self._lock:
            self._sync_ssd_locked()
            dram = self.dram
            for block_hash in dram.keys() if dram is not None else ():
                node = self._nodes.get(block_hash)
                data = dram.get(block_hash) if node is not None else None
                if data is None or not self._put_waiting_locked(block_hash, data, node.parent_hash):
                    continue
                dram.remove(block_hash)
                self._events.append(BlockRemoved([block_hash], medium="CPU"))
                node.medium = "DISK"
                self._events.append(self._stored_event(block_hash, node))
                written["CPU"] += 1
            for batch in pool_batches:
                for block_hash, parent_hash, row in batch:
                    if block_hash in self._nodes:
                        continue  # already below the pool: one copy is enough
                    if self._put_waiting_locked(block_hash, row, parent_hash):
                        written["GPU"] += 1
        ssd.flush()
        return written

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()

    # --- internals (lock held) -----------------------------------------------------------------
    def _place_locked(self, block_hash: bytes, node: _Node, data: BlockData) -> TierMedium | None:
        """Put a block that is in no tier yet into the highest tier that takes it."""
        if self.dram is not None:
            src = as_uint8_tensor(data, self.dram.block_bytes)
            if self.dram.is_full():
                victim = self.dram.pop_lru()
                if victim is not None:
                    self._move_dram_victim_locked(*victim)
            t0 = time.perf_counter()
            self.dram.put(block_hash, src)
            self._c["pool_to_dram_seconds"] += time.perf_counter() - t0
            self._c["pool_to_dram_bytes"] += src.numel()
            node.medium = "CPU"
            self._add_node(block_hash, node)
            return "CPU"
        if self.ssd is not None:
            t0 = time.perf_counter()
            ok = self.ssd.put(block_hash, data, node.parent_hash, node.token_ids)
            if ok:
                self._c["pool_to_ssd_seconds"] += time.perf_counter() - t0
                self._c["pool_to_ssd_bytes"] += self.ssd.block_bytes
                node.medium = "DISK"
                self._add_node(block_hash, node)
                return "DISK"
        self._c["drops"] += 1
        self._drop_descendants_locked(block_hash)
        return None

    def _move_dram_victim_locked(self, block_hash: bytes, data: torch.Tensor) -> None:
        """DRAM's LRU victim goes one level down (the SSD copies `data` before returning)."""
        node = self._nodes.get(block_hash)
        if node is None:  # not ours (put into DRAM directly): nothing was published
            return
        self._events.append(BlockRemoved([block_hash], medium="CPU"))
        if self.ssd is not None:
            t0 = time.perf_counter()
            if self.ssd.put(block_hash, data, node.parent_hash, node.token_ids):
                self._c["dram_to_ssd_seconds"] += time.perf_counter() - t0
                self._c["dram_to_ssd_bytes"] += data.numel()
                node.medium = "DISK"
                self._events.append(self._stored_event(block_hash, node))
                return
        self._c["drops"] += 1
        self._forget_node(block_hash)
        self._drop_descendants_locked(block_hash)

    def _add_node(self, block_hash: bytes, node: _Node) -> None:
        self._nodes[block_hash] = node
        if node.parent_hash is not None:
            self._children.setdefault(node.parent_hash, set()).add(block_hash)
        self._events.append(self._stored_event(block_hash, node))

    def _stored_event(self, block_hash: bytes, node: _Node) -> BlockStored:
        return BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=node.parent_hash,
            token_ids=list(node.token_ids),
            block_size=self.block_size if self.block_size is not None else len(node.token_ids),
            lora_id=node.lora_id,
            medium=node.medium,
        )

    def _forget_node(self, block_hash: bytes) -> _Node | None:
        """Unlink a block from the tree (its own children keep their link to it)."""
        node = self._nodes.pop(block_hash, None)
        if node is not None and node.parent_hash is not None:
            siblings = self._children.get(node.parent_hash)
            if siblings is not None:
                siblings.discard(block_hash)
                if not siblings:
                    del self._children[node.parent_hash]
        return node

    def _left_tier_locked(self, block_hash: bytes, medium: TierMedium) -> None:
        """A block left its tier for the pool (or was lost on promotion): publish and unlink it."""
        self._events.append(BlockRemoved([block_hash], medium=medium))
        self._forget_node(block_hash)

    def _pop_dram_locked(self, block_hash: bytes) -> tuple[torch.Tensor | None, TierMedium]:
        """Take a block found in DRAM by the lookup; it may have moved to the SSD since."""
        t0 = time.perf_counter()
        data = self.dram.pop(block_hash) if self.dram is not None else None
        self._c["dram_to_pool_seconds"] += time.perf_counter() - t0
        if data is None and self._ssd_has(block_hash):
            assert self.ssd is not None
            t0 = time.perf_counter()
            data = self.ssd.pop(block_hash)  # the DRAM victim is still in the SSD's write-behind
            self._c["ssd_to_pool_seconds"] += time.perf_counter() - t0
            return data, "DISK"
        return data, "CPU"

    def _put_waiting_locked(self, block_hash: bytes, data: BlockData, parent_hash: bytes | None) -> bool:
        """`ssd.put`, waiting for the writer once when its backlog is full (shutdown only)."""
        assert self.ssd is not None
        if self.ssd.put(block_hash, data, parent_hash):
            return True
        self.ssd.flush()
        return self.ssd.put(block_hash, data, parent_hash)

    def _ssd_has(self, block_hash: bytes) -> bool:
        return self.ssd is not None and self.ssd.contains(block_hash)

    def _put_back_ssd_locked(self, block_hash: bytes, data: torch.Tensor) -> None:
        """A block read from the SSD that the caller cannot use goes back (rewritten)."""
        node = self._nodes.get(block_hash)
        if node is None:
            return
        if self.ssd is not None and self.ssd.put(block_hash, data, node.parent_hash, node.token_ids):
            return
        self._events.append(BlockRemoved([block_hash], medium="DISK"))
        self._forget_node(block_hash)
        self._c["drops"] += 1
        self._drop_descendants_locked(block_hash)

    def _drop_descendants_locked(self, block_hash: bytes) -> None:
        """`block_hash` left every level: its descendants below the pool are unreachable."""
        stack = list(self._children.pop(block_hash, ()))
        removed: dict[TierMedium, list[bytes]] = {"CPU": [], "DISK": []}
        while stack:
            child = stack.pop()
            node = self._forget_node(child)
            if node is None:
                continue
            tier = self.dram if node.medium == "CPU" else self.ssd
            if tier is not None:
                tier.remove(child)
            removed[node.medium].append(child)
            self._c["orphans_dropped"] += 1
            stack.extend(self._children.pop(child, ()))
        for medium, hashes in removed.items():
            if hashes:
                self._events.append(BlockRemoved(hashes, medium=medium))

    def _sync_ssd_locked(self) -> None:
        """Apply the blocks the SSD lost on its own (evicted, corrupt, disabled)."""
        if self.ssd is None:
            return
        for block_hash in self.ssd.take_dropped():
            node = self._nodes.get(block_hash)
            if node is None or node.medium != "DISK" or self.ssd.contains(block_hash):
                continue  # already promoted, or stored again since
            if block_hash in self._promoting:
                continue  # a promotion in flight reads it; it handles the outcome
            self._events.append(BlockRemoved([block_hash], medium="DISK"))
            self._forget_node(block_hash)
            self._c["drops"] += 1
            self._drop_descendants_locked(block_hash)
