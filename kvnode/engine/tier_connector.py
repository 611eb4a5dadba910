"""The pod's side of the offload tiers: evict into them, reload prefixes out of them.

- Eviction: a `TierEvictor` is the KV cache manager's eviction hook, given to it when it is
  built; the pool calls it with the hashed blocks it pops for reuse, and their K/V (every
  layer) is copied out and demoted to DRAM before the pool overwrites it.
- Reload: at admission, a prefix that continues past the pool's hit is looked up in DRAM,
  then SSD. DRAM hits are promoted at once; a run that touches SSD is promoted by a loader
  thread while the request waits and the scheduler serves others. The loaded blocks become
  ordinary cached pool blocks, and the admission's `PrefixHit` is extended over them.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from pagekv.kvnode.memory.block_pool import KVCacheBlock
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager, PrefixHit
from pagekv.kvnode.memory.request import Request
from pagekv.proto.kv_events import KVEvent
from pagekv.proto.medium import OFFLOAD_MEDIUMS, Medium
from pagekv.proto.tier_stats import ChainStats
from pagekv.tiers.chain import TierChain
from pagekv.tiers.dram import DramTier
from pagekv.tiers.ssd import SsdTier

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
    base = first._base if first._base is not None else None
    if (
        base is not None and base.dim() == 2 and base.is_contiguous()
        and base.shape[0] >= len(datas) and first.data_ptr() == base.data_ptr()
        and all(d._base is base for d in datas)
    ):
        row = base.shape[1]
        if all(d.data_ptr() == base.data_ptr() + i * row for i, d in enumerate(datas)):
            return base[: len(datas)]
    return torch.from_numpy(np.stack([d.numpy() for d in datas]))


def build_tier_chain(runner, cpu_offload_bytes: int, disk_offload_bytes: int,
                     disk_offload_dir: str | None, block_size: int) -> TierChain | None:
    if cpu_offload_bytes <= 0 and disk_offload_bytes <= 0:
        return None
    dram = None
    if cpu_offload_bytes > 0:
        dram = DramTier(cpu_offload_bytes, runner.block_bytes,
                        pin_memory=runner.device.type == "cuda")
    ssd = None
    if disk_offload_bytes > 0:
        if not disk_offload_dir:
            raise ValueError("--disk-offload-bytes needs --disk-offload-dir")
        try:
            os.makedirs(disk_offload_dir, exist_ok=True)
        except OSError as e:  # the SSD tier then disables itself; the pod keeps serving
            logger.error("SSD tier directory %s unusable: %s", disk_offload_dir, e)
        spec = runner.kv_spec
        layout = {"num_layers": spec.num_layers, "block_size": spec.block_size,
                  "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
                  "dtype": str(spec.dtype).removeprefix("torch."), "model": runner.model_config.name or runner.model_config.architecture}
        ssd = SsdTier(disk_offload_dir, disk_offload_bytes, runner.block_bytes, layout)
    chain = TierChain(dram, ssd, block_size=block_size)
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

    def __call__(self, blocks: list[KVCacheBlock]) -> None:
        # One gather per layer into a buffer kept across calls; the tiers copy the rows.
        data = self.runner.read_blocks([b.block_id for b in blocks], self._buf)
        if self._buf is None or data.shape[0] > self._buf.shape[0]:
            self._buf = data
        self.chain.demote_many([b.block_hash for b in blocks], [b.parent_hash for b in blocks],
                               data)


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

    # -- reload ---------------------------------------------------------------------------
    def load_prefix(self, req: Request, hit: PrefixHit) -> bool:
        """Scheduler hook: extend the admission's pool hit, in place, with blocks reloaded
        from DRAM/SSD, and say which tier its tokens came from. False while an SSD load runs.
        """
        rid = req.request_id
        pending = self._loads.get(rid)
        if pending is not None:
            if not pending.future.done():
                return False
            self._land(pending, hit)
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
                    future = self._loader.submit(self.chain.promote_many, todo)
                    self._loads[rid] = _PendingLoad(req, start, todo, media, future, parent,
                                                    pinned)
                    self._inflight.update(dict.fromkeys(todo, rid))
                    return False
                self._store(req, start, todo, media, self.chain.promote_many(todo), parent, hit)
        hit.tokens_by_tier = self._by_tier(rid, hit.num_tokens)
        return True

    def finish_loads(self) -> None:
        """Land every finished SSD load in the pool now (as free cached blocks), whether or not
        its request is admitted this step, and release the prefix it pinned.

        A finished load used to be landed only when the scheduler reached its request; behind
        a waiting request that could not fit (FCFS stops there), the pinned prefix could be
        exactly the blocks that request needed: nothing ran again (deadlock).
        """
        for pending in [p for p in self._loads.values() if p.future.done()]:
            self._land(pending)

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

    def _store(self, req: Request, start: int, todo: list[bytes], media: list[Medium],
               datas: list, parent: bytes | None, hit: PrefixHit | None) -> None:
        """Write promoted blocks into the pool as cached blocks continuing the request's
        pool prefix at block `start`; what does not fit goes back below the pool."""
        # The leading run that came back (a checksum failure ends it: recompute from there).
        run = 0
        while run < len(datas) and datas[run] is not None:
            run += 1
        loads = list(zip(todo[:run], datas[:run], strict=True))
        n = self.manager.load_cached_blocks(req, start, loads, self._write_blocks, hit)
        if n < run:  # no room in the pool: keep the rest below instead of losing it
            self._demote_run(todo[n:run], datas[n:run], todo[n - 1] if n else parent)
        # Remember where the loaded tokens came from: if admission fails now, the next try
        # finds them as pool hits but must still report them as DRAM / SSD hits.
        counts = self._loaded.setdefault(req.request_id, dict.fromkeys(OFFLOAD_MEDIUMS, 0))
        for m in media[:n]:
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

    def _write_blocks(self, block_ids: list[int], datas: list) -> None:
        self.runner.write_blocks(block_ids, _as_rows(datas))

    def has_pending_loads(self) -> bool:
        return bool(self._loads)

    def wait_for_loads(self, timeout: float) -> None:
        """Block (GIL released) until a tier load finishes, instead of spinning the step loop."""
        if self._loads:
            wait([p.future for p in self._loads.values()], timeout, FIRST_COMPLETED)

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
            pending.future.add_done_callback(lambda f, p=pending: self._put_back(p, f))

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

    def full_state(self) -> dict[bytes, str]:
        return self.chain.full_state()

    def clear(self) -> int:
        return self.chain.clear()

    def tier_stats(self) -> ChainStats:
        return self.chain.tier_stats()

    def reload_s_per_token(self, kv_bytes_per_token: int) -> dict[Medium, float]:
        """Measured seconds per token to bring a block back from each tier (for the router)."""
        return self.tier_stats().reload_s_per_token(kv_bytes_per_token)

    def close(self, persist: bool = False) -> None:
        self._loader.shutdown(wait=True)
        if persist and self.chain.ssd is not None:
            self.finish_loads()  # SSD reads already taken off the disk: into the pool, then back
            self.persist()
        self.chain.close()

    def persist(self, batch: int = 64) -> dict[str, int]:
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
