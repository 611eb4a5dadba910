"""The pod's side of the offload tiers: evict into them, reload prefixes out of them.

- Eviction: the block pool calls `on_evict(block)` when it pops a hashed block for reuse;
  its K/V (every layer) is copied out and demoted to DRAM before the pool overwrites it.
- Reload: at admission, a prefix that continues past the pool's hits is looked up in DRAM,
  then SSD. DRAM hits are promoted at once; a run that touches SSD is promoted by a loader
  thread while the request waits and the scheduler serves others. The loaded blocks become
  ordinary cached pool blocks, so the normal prefix-hit path then picks them up.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from kvnode.memory.block_pool import KVCacheBlock
from kvnode.memory.kv_cache_manager import KVCacheManager
from kvnode.memory.request import Request
from proto.kv_events import KVEvent
from tiers.chain import TierChain
from tiers.dram import DramTier
from tiers.ssd import SsdTier

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _PendingLoad:
    req: Request
    start: int
    hashes: list[bytes]
    media: list[str]
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


class TierConnector:
    def __init__(self, chain: TierChain, manager: KVCacheManager, runner) -> None:
        self.chain = chain
        self.manager = manager
        self.runner = runner
        self.block_size = manager.block_size
        self._loads: dict[str, _PendingLoad] = {}
        self._evict_buf: torch.Tensor | None = None
        self._loaded: dict[str, dict[str, int]] = {}  # request -> tokens reloaded, per tier
        self._inflight: dict[bytes, str] = {}  # block hash -> request whose SSD load has it
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tier-load")
        manager.block_pool.on_evict_many = self.on_evict

    # -- eviction -------------------------------------------------------------------------
    def on_evict(self, blocks: list[KVCacheBlock]) -> None:
        # One gather per layer into a buffer kept across calls; the tiers copy the rows.
        data = self.runner.read_blocks([b.block_id for b in blocks], self._evict_buf)
        if self._evict_buf is None or data.shape[0] > self._evict_buf.shape[0]:
            self._evict_buf = data
        self.chain.demote_many([b.block_hash for b in blocks], [b.parent_hash for b in blocks],
                               data)

    # -- reload ---------------------------------------------------------------------------
    def load_prefix(self, req: Request, hits: list, num_hit: int):
        """Scheduler hook: extend pool hits with blocks reloaded from DRAM/SSD.

        Returns (hits, num_hit_tokens, tokens_by_tier), or None while an SSD load runs.
        """
        bs = self.block_size
        rid = req.request_id
        pending = self._loads.get(rid)
        if pending is not None:
            if not pending.future.done():
                return None
            self._land(pending)
        else:
            max_blocks = (req.num_tokens - 1) // bs
            start = len(hits)
            if start < max_blocks and req.block_hashes[start] in self._inflight:
                return None  # another request is loading this prefix: hit it in the pool next
            media = (self.chain.match_prefix(req.block_hashes[:max_blocks], start)
                     if start < max_blocks else [])
            if not media:
                return hits, num_hit, self._by_tier(rid, num_hit)
            todo = list(req.block_hashes[start : start + len(media)])
            parent = req.block_hashes[start - 1] if start else None
            if "DISK" in media:
                # Pin the pool prefix these blocks continue, or it could be evicted meanwhile.
                self.manager.block_pool.touch(hits)
                future = self._loader.submit(self.chain.promote_many, todo)
                self._loads[rid] = _PendingLoad(req, start, todo, media, future, parent, hits)
                self._inflight.update(dict.fromkeys(todo, rid))
                return None
            self._store(req, start, todo, media, self.chain.promote_many(todo), parent)
        hits, num_hit = self.manager.get_computed_blocks(req)
        return hits, num_hit, self._by_tier(rid, num_hit)

    def finish_loads(self) -> None:
        """Land every finished SSD load in the pool now (as free cached blocks), whether or not
        its request is admitted this step, and release the prefix it pinned.

        A finished load used to be landed only when the scheduler reached its request; behind
        a waiting request that could not fit (FCFS stops there), the pinned prefix could be
        exactly the blocks that request needed: nothing ran again (deadlock).
        """
        for pending in [p for p in self._loads.values() if p.future.done()]:
            self._land(pending)

    def _land(self, pending: _PendingLoad) -> None:
        """A finished SSD load: its blocks into the pool, the pinned prefix released."""
        del self._loads[pending.req.request_id]
        try:
            datas = pending.future.result()
        except Exception:
            logger.exception("tier load failed; recomputing")
            datas = [None] * len(pending.hashes)
        self._store(pending.req, pending.start, pending.hashes, pending.media, datas,
                    pending.parent)
        self._end_load(pending)

    def _store(self, req: Request, start: int, todo: list[bytes], media: list[str],
               datas: list, parent: bytes | None) -> None:
        """Write promoted blocks into the pool as cached blocks continuing the request's
        pool prefix at block `start`; what does not fit goes back below the pool."""
        # The leading run that came back (a checksum failure ends it: recompute from there).
        run = 0
        while run < len(datas) and datas[run] is not None:
            run += 1
        loads = list(zip(todo[:run], datas[:run], strict=True))
        n = self.manager.load_cached_blocks(req, start, loads, self._write_blocks)
        if n < run:  # no room in the pool: keep the rest below instead of losing it
            self._demote_run(todo[n:run], datas[n:run], todo[n - 1] if n else parent)
        # Remember where the loaded tokens came from: if admission fails now, the next try
        # finds them as pool hits but must still report them as DRAM / SSD hits.
        counts = self._loaded.setdefault(req.request_id, {"CPU": 0, "DISK": 0})
        for m in media[:n]:
            counts[m] += self.block_size

    def _by_tier(self, rid: str, num_hit: int) -> dict[str, int]:
        loaded = self._loaded.get(rid, {"CPU": 0, "DISK": 0})
        cpu = min(loaded["CPU"], num_hit)
        disk = min(loaded["DISK"], num_hit - cpu)
        return {"GPU": num_hit - cpu - disk, "CPU": cpu, "DISK": disk}

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
        self.manager.block_pool.free_blocks(reversed(pending.pinned))
        for h in pending.hashes:
            self._inflight.pop(h, None)

    def forget(self, request_id: str) -> None:
        """A request left (finished, aborted): drop its bookkeeping; an in-flight load's
        blocks go back below the pool when it completes."""
        self._loaded.pop(request_id, None)
        pending = self._loads.pop(request_id, None)
        if pending is not None:
            self.manager.block_pool.free_blocks(reversed(pending.pinned))
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

    def stats(self) -> dict:
        """Nested form for the exporters: per-tier usage, per-direction moves."""
        s = self.chain.stats()
        tiers = {
            "CPU": {"used_bytes": s["dram_used_bytes"], "capacity_bytes": s["dram_capacity_bytes"],
                    "entries": s["dram_entries"], "hits_tokens": s["dram_hits"] * self.block_size,
                    "queries_tokens": s["dram_queries"] * self.block_size},
            "DISK": {"used_bytes": s["ssd_used_bytes"], "capacity_bytes": s["ssd_capacity_bytes"],
                     "entries": s["ssd_entries"], "hits_tokens": s["ssd_hits"] * self.block_size,
                     "queries_tokens": s["ssd_queries"] * self.block_size},
        }
        moves = {}
        for direction in ("pool_to_dram", "pool_to_ssd", "dram_to_ssd", "dram_to_pool",
                          "ssd_to_pool"):
            moves[direction] = {"bytes": s[f"{direction}_bytes"],
                                "seconds": s[f"{direction}_seconds"]}
        return {"tiers": tiers, "moves": moves, "orphans_dropped": s["orphans_dropped"],
                "checksum_failures": s["checksum_failures"], "raw": s}

    def reload_s_per_token(self, kv_bytes_per_token: int) -> dict[str, float]:
        """Measured seconds per token to bring a block back from each tier (for the router)."""
        s = self.chain.stats()
        out = {}
        for tier, key in (("CPU", "dram_to_pool"), ("DISK", "ssd_to_pool")):
            nbytes, secs = s[f"{key}_bytes"], s[f"{key}_seconds"]
            if nbytes > 0 and secs > 0:
                out[tier] = secs / nbytes * kv_bytes_per_token
        return out

    def close(self, persist: bool = False) -> None:
        self._loader.shutdown(wait=True)
        if persist and self.chain.ssd is not None:
            self.finish_loads()  # SSD reads already taken off the disk: into the pool, then back
            self.persist()
        self.chain.close()

    def persist(self, batch: int = 64) -> dict[str, int]:
        """Write the pool's cached blocks that no request holds, and DRAM, down to the SSD."""
        t0 = time.perf_counter()
        cached = [b for b in self.manager.block_pool.free_block_queue.get_all_free_blocks()
                  if b.block_hash is not None]  # least recently used first

        def batches():  # read a batch at a time: no second copy of the whole pool in memory
            for i in range(0, len(cached), batch):
                part = cached[i:i + batch]
                data = self.runner.read_blocks([b.block_id for b in part]).cpu()
                yield [(b.block_hash, b.parent_hash, data[j]) for j, b in enumerate(part)]

        written = self.chain.persist(batches())
        logger.info("tiers: wrote %d pool and %d DRAM blocks to the SSD tier at shutdown in "
                    "%.2fs", written["GPU"], written["CPU"], time.perf_counter() - t0)
        return written
