"""The pod's side of the offload tiers: evict into them, reload prefixes out of them.

- Eviction: a `TierEvictor` is the KV cache manager's eviction hook, given to it when it is
  built; the pool calls it with the hashed blocks it pops for reuse, and their K/V (every
  layer) is copied out and demoted to DRAM before the pool overwrites it.
- Reload: at admission, a prefix that continues past the pool's hit is looked up in DRAM,
  then SSD. DRAM hits are promoted at once; a run that touches SSD is promoted by a loader
  thread while the request waits and the scheduler serves others. The loaded blocks become
  ordinary cached pool blocks, and the admission's `PrefixHit` is extended over them.
- The pool on CUDA: both directions are batched copies on a copy stream straight between the
  pool and the DRAM tier's pinned slab (kvnode.engine.block_transfer); an SSD read lands in
  pinned rows first. A reload's request waits until its copy completes (tier_copies) while
  the scheduler runs the others: the copy overlaps their forward passes. On CPU every copy is
  synchronous, as it always was.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from pagekv.kvnode.engine.block_transfer import Copy, transfer_for
from pagekv.kvnode.engine.tier_copies import PoolCopies, pack_rows
from pagekv.kvnode.memory.block_pool import KVCacheBlock
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager, PrefixHit
from pagekv.kvnode.memory.request import Request
from pagekv.proto.kv_events import KVEvent
from pagekv.proto.medium import OFFLOAD_MEDIUMS, Medium
from pagekv.proto.retention import RetentionTable
from pagekv.proto.tenant_ledger import TenantLedger
from pagekv.proto.tier_stats import ChainStats
from pagekv.tiers.chain import TierChain
from pagekv.tiers.codec import elem_size_of
from pagekv.tiers.dram import DramTier
from pagekv.tiers.peer_entries import KvLayout

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _PendingLoad:
    req: Request
    start: int
    hashes: list[bytes]
    media: list[Medium]
    future: Future
    parent: bytes | None  # the pool block these continue (their chain's parent)
    pinned: list[KVCacheBlock]  # that pool prefix, referenced until the load is consumed


def _as_rows(datas: list[torch.Tensor]) -> torch.Tensor:
    """Blocks as one [n, block_bytes] tensor: a view when they already are consecutive rows
    of one tensor (a DRAM reload), else one stacking copy (numpy: a plain memcpy per block,
    no intra-op thread pool, see tiers.base.copy_block)."""
    first = datas[0]
    row = first.numel()
    nbytes = row * first.element_size()
    storage = first.untyped_storage().data_ptr()
    if all(
        d.dim() == 1 and d.is_contiguous() and d.dtype == first.dtype and d.numel() == row
        and d.untyped_storage().data_ptr() == storage
        and d.data_ptr() == first.data_ptr() + i * nbytes for i, d in enumerate(datas)
    ):  # (one storage, so the view of the n rows from `first` on stays inside it)
        return first.as_strided((len(datas), row), (row, 1))
    import numpy as np  # (only here: a DRAM-only CUDA bench host may have no numpy)

    return torch.from_numpy(np.stack([d.numpy() for d in datas]))


def kv_layout(runner) -> KvLayout:
    """What a block's bytes mean (model, shape, dtype): the SSD tier files blocks under it
    and two pods exchange blocks only when theirs are equal."""
    spec = runner.kv_spec
    dtype = str(spec.dtype).removeprefix("torch.")
    layout = {"num_layers": spec.num_layers, "block_size": spec.block_size,
              "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size, "dtype": dtype,
              "model": runner.model_config.name or runner.model_config.architecture}
    return KvLayout.of(layout, elem_size_of(dtype), runner.block_bytes)


def build_tier_chain(runner, cpu_offload_bytes: int, disk_offload_bytes: int,
                     disk_offload_dir: str | None, block_size: int,
                     retention: RetentionTable | None = None,
                     retained_dram_bytes: int = 0, retained_ssd_bytes: int = 0,
                     ledger: TenantLedger | None = None) -> TierChain | None:
    """`retention`: the tiers pass over the blocks it holds, up to their retained bytes;
    `ledger`: the tenants' quotas the chain enforces."""
    if cpu_offload_bytes <= 0 and disk_offload_bytes <= 0:
        return None
    dram = None
    if cpu_offload_bytes > 0:
        transfer = transfer_for(runner)  # CUDA: copies through its stream and staging tensor
        dram = DramTier(cpu_offload_bytes, runner.block_bytes,
                        pin_memory=runner.device.type == "cuda",
                        copy_stream=transfer.stream if transfer is not None else None,
                        retention=retention, retained_cap_bytes=retained_dram_bytes)
    ssd = None
    if disk_offload_bytes > 0:
        from pagekv.tiers.ssd import SsdTier  # (lz4, xxhash, aiofiles: only with an SSD tier)

        if not disk_offload_dir:
            raise ValueError("--disk-offload-bytes needs --disk-offload-dir")
        try:
            os.makedirs(disk_offload_dir, exist_ok=True)
        except OSError as e:  # the SSD tier then disables itself; the pod keeps serving
            logger.error("SSD tier directory %s unusable: %s", disk_offload_dir, e)
        layout = kv_layout(runner)
        ssd = SsdTier(disk_offload_dir, disk_offload_bytes, runner.block_bytes, layout.json,
                      dtype=layout.dtype, retention=retention,
                      retained_cap_bytes=retained_ssd_bytes)
    chain = TierChain(dram, ssd, block_size=block_size, ledger=ledger, retention=retention)
    logger.info(
        "offload tiers: DRAM %.1f MiB (%d blocks), SSD %.1f MiB in %s",
        cpu_offload_bytes / 2**20, cpu_offload_bytes // runner.block_bytes,
        disk_offload_bytes / 2**20, disk_offload_dir or "-",
    )
    return chain


class TierEvictor:
    """The pool's eviction hook: copy the K/V of blocks about to be reused down the chain."""

    def __init__(self, chain: TierChain, runner) -> None:
        self.chain = chain
        self.runner = runner
        self._buf: torch.Tensor | None = None
        dram = chain.async_dram
        self.transfer = transfer_for(runner) if dram is not None else None

    def __call__(self, blocks: list[KVCacheBlock]) -> None:
        hashes = [b.block_hash for b in blocks if b.block_hash is not None]
        if len(hashes) != len(blocks):
            raise ValueError("the pool evicts only blocks that carry a hash")
        parents = [b.parent_hash for b in blocks]
        ids = [b.block_id for b in blocks]
        transfer = self.transfer
        dram = self.chain.async_dram  # (not None when there is a transfer: see __init__)
        if transfer is not None and dram is not None:  # a copy on the stream into DRAM slots
            slab = dram.slab

            def copy_in(indices: list[int], slots: list[int]):
                return transfer.to_host([ids[i] for i in indices], slab, slots).done

            if self.chain.demote_into_dram(hashes, parents, copy_in):
                return
        # One gather per layer into a buffer kept across calls; the tiers copy the rows.
        self.chain.demote_many(hashes, parents, self.runner.read_blocks(ids, self._rows(len(ids))))

    def _rows(self, n: int) -> torch.Tensor:
        if self._buf is None or self._buf.shape[0] < n:
            self._buf = torch.empty((n, self.runner.block_bytes), dtype=torch.uint8,
                                    pin_memory=self.runner.device.type == "cuda")
        return self._buf


class TierConnector:
    def __init__(self, chain: TierChain, manager: KVCacheManager, runner) -> None:
        self.chain = chain
        self.manager = manager
        self.runner = runner
        self.block_size = manager.block_size
        self._loads: dict[str, _PendingLoad] = {}
        self._loaded: dict[str, dict[Medium, int]] = {}  # request -> tokens reloaded, per tier
        self._inflight: dict[bytes, str] = {}  # block hash -> request whose SSD load has it
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tier-load")
        self._transfer = transfer_for(runner)  # None: synchronous copies (the pool on CPU)
        self._copies = (PoolCopies(self._transfer, manager, chain)
                        if self._transfer is not None else None)

    # -- reload ---------------------------------------------------------------------------
    def load_prefix(self, req: Request, hit: PrefixHit) -> bool:
        """Scheduler hook: extend the admission's pool hit, in place, with blocks reloaded
        from DRAM/SSD, and say which tier its tokens came from. False while an SSD load
        runs, or a copy still writes part of the hit into the pool (CUDA).
        """
        rid = req.request_id
        if self._copying(hit):
            return False
        pending = self._loads.get(rid)
        if pending is not None:
            if not pending.future.done():
                return False
            self._land(pending, hit)
            if self._copying(hit):
                return False
        else:
            max_blocks = hit.max_blocks
            start = len(hit.blocks)
            if start < max_blocks and req.block_hashes[start] in self._inflight:
                return False  # another request is loading this prefix: hit it in the pool next
            media = (self.chain.match_prefix(req.block_hashes[:max_blocks], start)
                     if start < max_blocks else [])
            if media:
                todo = list(req.block_hashes[start : start + len(media)])
                parent = req.block_hashes[start - 1] if start else None
                if Medium.DISK in media:
                    # Pin the pool prefix these blocks continue, or it could be evicted meanwhile.
                    pinned = list(hit.blocks)
                    self.manager.pin(pinned)
                    future = self._loader.submit(self._read_below, todo)
                    self._loads[rid] = _PendingLoad(req, start, todo, media, future, parent,
                                                    pinned)
                    self._inflight.update(dict.fromkeys(todo, rid))
                    return False
                if not self._load_dram_async(req, start, todo, media, hit):
                    self._store(req, start, todo, media, self.chain.promote_many(todo), parent,
                                hit)
                if self._copying(hit):
                    return False  # the others run while the copy does; this one next step
        hit.tokens_by_tier = self._by_tier(rid, hit.num_tokens)
        return True

    def finish_loads(self) -> None:
        """Land every finished SSD load in the pool now (as free cached blocks), whether or not
        its request is admitted this step, and release the prefix it pinned; release the
        blocks of completed copies.

        A finished load used to be landed only when the scheduler reached its request; behind
        a waiting request that could not fit (FCFS stops there), the pinned prefix could be
        exactly the blocks that request needed: nothing ran again (deadlock).
        """
        if self._copies is not None:
            self._copies.release_done()
        for pending in [p for p in self._loads.values() if p.future.done()]:
            self._land(pending)

    def _copying(self, hit: PrefixHit) -> bool:
        return self._copies is not None and self._copies.busy(hit.blocks)

    def _read_below(self, todo: list[bytes]) -> list:
        """The loader thread's job: promote the blocks (an SSD read); with a copy stream, in
        pinned rows, so landing them is one async copy."""
        datas = self.chain.promote_many(todo)
        if self._transfer is None:
            return datas
        return pack_rows(datas, self.runner.block_bytes, self._transfer.stream.pin_memory)

    def _land(self, pending: _PendingLoad, hit: PrefixHit | None = None) -> None:
        """A finished SSD load: its blocks into the pool (extending `hit`, its request's
        lookup of this admission, if any), the pinned prefix released."""
        del self._loads[pending.req.request_id]
        try:
            datas = pending.future.result()
        except Exception:
            logger.exception("tier load failed; recomputing")
            datas = [None] * len(pending.hashes)
        self._store(pending.req, pending.start, pending.hashes, pending.media, datas,
                    pending.parent, hit)
        self._end_load(pending)

    def _load_dram_async(self, req: Request, start: int, todo: list[bytes],
                         media: list[Medium], hit: PrefixHit) -> bool:
        """A DRAM run copied on the stream from its slab slots straight into the pool (the
        blocks leave DRAM only for what the pool took). False: not possible, do it the
        synchronous way."""
        dram = self.chain.async_dram
        transfer = self._transfer  # (not None when there are copies: see __init__)
        if (self._copies is None or transfer is None or dram is None
                or dram.copy_stream is not transfer.stream):
            return False
        slots = self.chain.hold_dram_run(todo)
        if slots is None:
            return False
        copies: list[Copy] = []
        targets: list[int] = []

        def write(block_ids: list[int], positions: list) -> None:
            copies.append(transfer.from_host(block_ids, dram.slab, [slots[i] for i in positions]))
            targets.extend(block_ids)

        loaded = 0
        try:
            loaded = self.manager.load_cached_blocks(req, start, [(h, i) for i, h in
                                                                  enumerate(todo)], write, hit)
        finally:
            self.chain.end_hold(todo, slots, loaded, copies[0].done if copies else None)
        if copies:
            self._copies.track(copies[0], targets, todo[:loaded], "dram_to_pool")
        self._count_loaded(req.request_id, media[:loaded])
        return True

    def _store(self, req: Request, start: int, todo: list[bytes], media: list[Medium],
               datas: list, parent: bytes | None, hit: PrefixHit | None) -> None:
        """Write promoted blocks into the pool as cached blocks continuing the request's
        pool prefix at block `start`; what does not fit goes back below the pool."""
        # The leading run that came back (a checksum failure ends it: recompute from there).
        run = 0
        while run < len(datas) and datas[run] is not None:
            run += 1
        loads = list(zip(todo[:run], datas[:run], strict=True))
        uploads: list[tuple[Copy, list[int], torch.Tensor]] = []

        def write(block_ids: list[int], blocks: list) -> None:
            rows = _as_rows(blocks)
            if self._transfer is None:
                self.runner.write_blocks(block_ids, rows)
            else:
                uploads.append((self._transfer.upload(block_ids, rows), block_ids, rows))

        n = self.manager.load_cached_blocks(req, start, loads, write, hit)
        if uploads:
            copy, block_ids, rows = uploads[0]
            move = "dram_to_pool" if Medium.DISK not in media[:n] else "ssd_to_pool"
            self._copies.track(copy, block_ids, todo[:n], move, rows)  # type: ignore[union-attr]
        if n < run:  # no room in the pool: keep the rest below instead of losing it
            self._demote_run(todo[n:run], datas[n:run], todo[n - 1] if n else parent)
        self._count_loaded(req.request_id, media[:n])

    def _count_loaded(self, rid: str, media: list[Medium]) -> None:
        """Remember where the loaded tokens came from: if admission fails now, the next try
        finds them as pool hits but must still report them as DRAM / SSD hits."""
        counts = self._loaded.setdefault(rid, dict.fromkeys(OFFLOAD_MEDIUMS, 0))
        for m in media:
            counts[m] += self.block_size

    def _by_tier(self, rid: str, num_hit: int) -> dict[Medium, int]:
        loaded = self._loaded.get(rid)
        cpu = min(loaded[Medium.CPU], num_hit) if loaded else 0
        disk = min(loaded[Medium.DISK], num_hit - cpu) if loaded else 0
        return {Medium.GPU: num_hit - cpu - disk, Medium.CPU: cpu, Medium.DISK: disk}

    def _demote_run(self, hashes: list[bytes], datas: list, parent: bytes | None) -> None:
        """Put consecutive blocks of one chain back below the pool, each under its parent."""
        for h, data in zip(hashes, datas, strict=True):
            if data is not None:
                self.chain.demote(h, parent, (), data)
            parent = h

    def has_pending_loads(self) -> bool:
        return bool(self._loads) or bool(self._copies)

    def wait_for_loads(self, timeout: float) -> None:
        """Block (GIL released) until a tier load or copy finishes, instead of spinning the
        step loop."""
        if self._copies:
            self._copies.wait_one()  # a copy takes milliseconds
        elif self._loads:
            wait([p.future for p in self._loads.values()], timeout, FIRST_COMPLETED)

    def sync_copies(self) -> None:
        """Wait for every copy into the pool and release its blocks."""
        if self._copies is not None:
            self._copies.sync_all()

    def pinned_sets(self) -> list[list[KVCacheBlock]]:
        """Every list of pool blocks the tiers hold a reference on (SSD loads' prefixes,
        blocks under copy)."""
        pins = [p.pinned for p in self._loads.values()]
        return pins + (self._copies.pinned_sets() if self._copies is not None else [])

    def _end_load(self, pending: _PendingLoad) -> None:
        """Unpin the prefix an SSD load continued; its blocks are no longer in flight."""
        self.manager.unpin(pending.pinned)
        for h in pending.hashes:
            self._inflight.pop(h, None)

    def forget(self, request_id: str) -> None:
        """A request left (finished, aborted): drop its bookkeeping; an in-flight load's
        blocks go back below the pool when it completes."""
        self._loaded.pop(request_id, None)
        pending = self._loads.pop(request_id, None)
        if pending is not None:
            self.manager.unpin(pending.pinned)
            pending.pinned = []
            pending.future.add_done_callback(functools.partial(self._put_back, pending))

    def _put_back(self, pending: _PendingLoad, future: Future) -> None:
        try:
            datas = future.result()
        except Exception:
            datas = [None] * len(pending.hashes)
        self._demote_run(pending.hashes, datas, pending.parent)
        for h in pending.hashes:  # below the pool again: others may load them now
            self._inflight.pop(h, None)

    # -- state ----------------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        return self.chain.take_events()

    def full_state(self) -> dict[bytes, Medium]:
        return self.chain.full_state()

    def clear(self) -> int:
        return self.chain.clear()

    def media_below(self, block_hashes: Sequence[bytes]) -> list[Medium | None]:
        """Where each block is below the pool (None: not there)."""
        return self.chain.media_below(block_hashes)

    def parent_of(self, block_hash: bytes) -> tuple[bool, bytes | None]:
        return self.chain.parent_of(block_hash)

    def discard(self, block_hashes: Sequence[bytes]) -> dict[Medium, int]:
        """An operator's delete of these blocks below the pool; how many went per tier."""
        return self.chain.discard(block_hashes)

    def tier_stats(self) -> ChainStats:
        return self.chain.tier_stats()

    def reload_s_per_token(self, kv_bytes_per_token: int) -> dict[Medium, float]:
        """Measured seconds per token to bring a block back from each tier (for the router)."""
        return self.tier_stats().reload_s_per_token(kv_bytes_per_token)

    def close(self, persist: bool = False) -> None:
        self._loader.shutdown(wait=True)
        self.sync_copies()
        if persist and self.chain.ssd is not None:
            self.finish_loads()  # SSD reads already taken off the disk: into the pool, then back
            self.persist()
        self.chain.close()

    def persist(self, batch: int = 64) -> dict[Medium, int]:
        """Write the pool's cached blocks that no request holds, and DRAM, down to the SSD."""
        t0 = time.perf_counter()
        cached = self.manager.idle_cached_blocks()  # least recently used first

        def batches():  # read a batch at a time: no second copy of the whole pool in memory
            for i in range(0, len(cached), batch):
                part = cached[i:i + batch]
                data = self.runner.read_blocks([b.block_id for b in part]).cpu()
                yield [(b.block_hash, b.parent_hash, data[j]) for j, b in enumerate(part)]

        written = self.chain.persist(batches())
        logger.info("tiers: wrote %d pool and %d DRAM blocks to the SSD tier at shutdown in "
                    "%.2fs", written[Medium.GPU], written[Medium.CPU], time.perf_counter() - t0)
        return written
