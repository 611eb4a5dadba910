"""Per-request block tables on top of the block pool: lookup, allocation, free, fork.

The manager is the pod's `malloc`: a request's KV lives in `req_to_blocks[request_id]`, a list
of pool blocks in token order. Full blocks are registered in the prefix cache as soon as they
are allocated for a step that fills them (the forward pass writes every token's K/V before any
attention reads it, so a hit within the same step is safe).

It is also the pool's only face: the scheduler and the tier connector see a `PrefixHit` (one
lookup per admission, extended in place by whatever the tiers reload), pin and unpin blocks,
and list what is cached through methods here; nothing outside `kvnode.memory` touches the pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, KeysView, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, cast

from pagekv.kvnode.memory.block_pool import BlockPool, EvictHook, EvictManyHook, KVCacheBlock
from pagekv.kvnode.memory.metrics import KVCacheMetrics
from pagekv.kvnode.memory.request import Request
from pagekv.proto.hashing import (
    DEFAULT_HASH_SEED,
    HashConfig,
    RequestBlockHasher,
    lora_key,
    max_hit_blocks,
)
from pagekv.proto.kv_events import KVEvent
from pagekv.proto.medium import Medium
from pagekv.proto.retention import RetentionTable
from pagekv.proto.tenant_ledger import NO_OWNER, TenantLedger

logger = logging.getLogger(__name__)

VALID_BLOCK_SIZES = (8, 16, 32, 64, 128)
_ref_cnt = attrgetter("ref_cnt")


@dataclass(slots=True, eq=False)
class PrefixHit:
    """A request's cached prefix: made by one `lookup` at admission, extended in place by the
    tier connector's reloads, and handed as is to `allocate_slots`, so one admission walks
    the pool's hash map once."""

    blocks: list[KVCacheBlock]  # pool blocks of the prefix, in order
    block_size: int
    max_blocks: int  # the most blocks that may ever hit (see proto.hashing.max_hit_blocks)
    tokens_by_tier: dict[Medium, int] | None = None  # set by the tiers; None: all the pool's
    # The request asked to read no cached prefix (vLLM's skip_reading_prefix_cache): not a
    # prefix-cache query, so the hit-rate figures leave it out.
    skipped_reading: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    def by_tier(self) -> dict[Medium, int]:
        """Where the hit tokens came from (a reload counts for the tier it came from)."""
        if self.tokens_by_tier is not None:
            return self.tokens_by_tier
        return {Medium.GPU: self.num_tokens}


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: str = DEFAULT_HASH_SEED,
        watermark: float = 0.01,
        on_evict: EvictHook | None = None,
        metrics: KVCacheMetrics | None = None,
        enable_kv_events: bool = True,
        on_evict_many: EvictManyHook | None = None,
        retention: RetentionTable | None = None,
        retained_cap_blocks: int = 0,
        session_idle_s: float = 0.0,
        ledger: TenantLedger | None = None,
    ) -> None:
        """`on_evict_many` gets every batch of hashed blocks about to be reused, before they
        are overwritten (the tiers copy them out); it is fixed here, once, at construction.
        `retention`: the pod's table of pinned and session blocks (proto/retention.py); a
        request's pin is marked at admission, a session's blocks for `session_idle_s` when
        each turn ends, and every hit renews them. `ledger`: the blocks' owners and quotas
        (proto/tenant_ledger.py)."""
        if block_size not in VALID_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {VALID_BLOCK_SIZES}, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_config = HashConfig(hash_algo, hash_seed)
        self.metrics = metrics if metrics is not None else KVCacheMetrics()
        self.block_pool = BlockPool(
            num_blocks, enable_caching, block_size, on_evict, self.metrics, enable_kv_events,
            on_evict_many, retention, retained_cap_blocks, ledger,
        )
        self.retention = retention
        self.session_idle_s = session_idle_s
        # Admissions keep this many blocks in reserve for running requests' decode growth,
        # so a new arrival cannot push the running batch straight into preemption.
        self.watermark_blocks = int(watermark * num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self._block_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    # -- hashing ------------------------------------------------------------------------
    def _hashes(self, request: Request) -> list[bytes]:
        """The request's block hashes, attaching this pool's hasher on first sight (or when the
        request was hashed for another block size or hash configuration)."""
        h = request.hasher
        # Identity first: comparing two HashConfigs field by field costs more than the rest.
        if h is None or h.block_size != self.block_size or (
            h.config is not self.hash_config and h.config != self.hash_config
        ):
            lora = lora_key(request.lora_id, request.lora_path)
            request.hasher = RequestBlockHasher(
                self.hash_config, self.block_size, request.cache_salt, lora, request.mm_inputs,
                request.shared_blocks,
            )
            request.block_hashes = []
            request.hasher.extend(request.all_token_ids, request.block_hashes)
        return request.block_hashes

    # -- lookup -------------------------------------------------------------------------
    def lookup(self, request: Request, skip_reading: bool = False) -> PrefixHit:
        """Longest cached prefix of full blocks; stops at the first miss; changes nothing.

        Never covers the last token: its logits must be computed (`max_hit_blocks`).
        `skip_reading`: no prefix at all (a request that needs every position's logits); its
        blocks are still cached as they fill.
        """
        if skip_reading:
            return PrefixHit([], self.block_size, 0, skipped_reading=True)
        if not self.enable_caching:
            return PrefixHit([], self.block_size, 0)
        hashes = self._hashes(request)
        hit = PrefixHit([], self.block_size,
                        min(len(hashes), max_hit_blocks(request.num_tokens, self.block_size)))
        self._continue_lookup(hit, hashes)
        return hit

    def get_computed_blocks(self, request: Request, skip_reading: bool = False
                            ) -> tuple[list[KVCacheBlock], int]:
        """vLLM's name for `lookup`, as (blocks, tokens)."""
        hit = self.lookup(request, skip_reading)
        return hit.blocks, hit.num_tokens

    def _continue_lookup(self, hit: PrefixHit, hashes: Sequence[bytes]) -> None:
        """Walk on from the hit's last block: what a fresh lookup would add, given that the
        blocks already in the hit are still cached (referenced, or nothing evicted since)."""
        blocks = hit.blocks
        # Every candidate is looked up in one C-level pass (dict reads, no side effects), then
        # cut at the first miss: cheaper than stopping early in a Python loop.
        found: list[KVCacheBlock | None] = list(map(
            self.block_pool.cached_block_hash_to_block.get, hashes[len(blocks):hit.max_blocks]
        ))
        if None in found:
            del found[found.index(None):]
        blocks.extend(cast("list[KVCacheBlock]", found))  # no None left

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`, after the tokens of `hit`
        (its admission's lookup) when it has one.

        Returns the newly allocated blocks, or None when they do not fit — and then nothing
        was touched. On success, prefix hits are referenced, a shared partial last block is
        copied before it is written (copy-on-write), and full blocks are cached.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is None:
            return self._admit(request, num_new_tokens, hit)
        if hit is not None and hit.blocks:
            raise ValueError(f"request {request.request_id} already holds blocks; "
                             "hits are only for admission")

        # A running request: a decode step or a later prefill chunk. This runs once per
        # decoded token of every request, so it is written out here rather than in helpers.
        bs = self.block_size
        num_computed = request.num_computed_tokens
        total = num_computed + num_new_tokens
        if total > len(request.all_token_ids) + 1:
            self._too_many(request, total)
        num_new_blocks = -(-total // bs) - len(req_blocks)
        # The block about to receive token `num_computed` is shared and partly filled: the
        # writer gets a private copy (full blocks are never written, so never copied).
        idx = num_computed // bs
        cow_block = None
        if num_computed % bs and idx < len(req_blocks) and req_blocks[idx].ref_cnt > 1:
            cow_block = req_blocks[idx]
        if num_new_blocks <= 0 and cow_block is None:
            new_blocks = []  # the common decode step: the token fits the last block
        else:
            pool = self.block_pool
            num_new_blocks = max(0, num_new_blocks)
            if num_new_blocks + (cow_block is not None) > pool.free_block_queue.num_free_blocks:
                return None
            if cow_block is not None:
                fresh = pool.get_new_blocks(1)[0]
                req_blocks[idx] = fresh
                pool.free_blocks((cow_block,))
                self._block_copies.append((cow_block.block_id, fresh.block_id))
            new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
            req_blocks.extend(new_blocks)
        # Only a step that fills a block has anything to cache.
        if self.enable_caching and total // bs > self.num_cached_blocks[request.request_id]:
            self._cache_full_blocks(request, req_blocks, total)
        return new_blocks

    def _admit(
        self, request: Request, num_new_tokens: int, hit: PrefixHit | None
    ) -> list[KVCacheBlock] | None:
        """`allocate_slots` for a request holding no blocks yet: its hits, then new blocks."""
        bs = self.block_size
        pool = self.block_pool
        hits = hit.blocks if hit is not None else []
        total = request.num_computed_tokens + len(hits) * bs + num_new_tokens
        if total > len(request.all_token_ids) + 1:
            self._too_many(request, total)
        num_new_blocks = max(0, -(-total // bs) - len(hits))
        # Hits sitting in the free queue stop counting as free once touched.
        num_revived = list(map(_ref_cnt, hits)).count(0)
        # The reserve protects running requests; with none running it would only stall.
        reserve = self.watermark_blocks if self.req_to_blocks else 0
        if num_new_blocks + num_revived > pool.free_block_queue.num_free_blocks - reserve:
            return None

        rid = request.request_id
        if not request.prefix_stats_recorded:
            request.prefix_stats_recorded = True
            if hit is None or not hit.skipped_reading:
                self.metrics.record_admission(
                    request.num_tokens, hit.by_tier() if hit is not None else {Medium.GPU: 0}
                )
        if hits:
            pool.touch(hits)
        request.num_hit_blocks = len(hits)
        if self.retention is not None:
            self._retain_at_admission(request, len(hits))
        req_blocks = self.req_to_blocks[rid] = list(hits)
        self.num_cached_blocks[rid] = len(hits)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, total)
        return new_blocks

    def _retain_at_admission(self, request: Request, num_hits: int) -> None:
        """A hit renews what it hit; a pin is marked now, before its blocks are computed, so
        that none of them is evicted while the rest of its prompt is."""
        retention = self.retention
        assert retention is not None
        if num_hits and retention:
            retention.renew(request.block_hashes[:num_hits])
        control = request.cache_control
        if control.pins:
            hashes = self._hashes(request)  # (none yet when it skipped reading the cache)
            n = control.pin_blocks(request.num_prompt_tokens, self.block_size, len(hashes))
            retention.retain(hashes[:n], control.pin_ttl_s)

    @staticmethod
    def _too_many(request: Request, total: int) -> None:
        # One token past the known ones is allowed: a speculative slot for the next step.
        raise ValueError(f"request {request.request_id}: {total} tokens requested but "
                         f"only {request.num_tokens} known")

    def _cache_full_blocks(
        self, request: Request, req_blocks: list[KVCacheBlock], total: int
    ) -> None:
        """Register the request's full blocks (of its first `total` tokens) not cached yet."""
        rid = request.request_id
        hashes = self._hashes(request)
        num_full = min(total // self.block_size, len(hashes))
        num_cached = self.num_cached_blocks[rid]
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                req_blocks, hashes, num_cached, num_full, request.all_token_ids,
                owner=request.tenant or NO_OWNER, shared_blocks=request.shared_blocks,
            )
            self.num_cached_blocks[rid] = num_full

    def load_cached_blocks(
        self,
        request: Request,
        start: int,
        loads: Sequence[tuple[bytes, object]],
        write_fn: Callable[[list[int], list[Any]], None],  # block ids, their tiers' data
        hit: PrefixHit | None = None,
    ) -> int:
        """Materialize blocks reloaded from a lower tier as pool cache entries.

        `loads` are (hash, data) for the request's blocks `start, start+1, ...`, which must
        continue its current pool hits: `hit` when the caller just looked them up (it is then
        extended in place, as a fresh lookup would find it), else they are looked up here.
        They become ordinary free cached blocks, so a later lookup finds them as pool hits.
        Returns how many were loaded (fewer when the pool has no room); the caller owns the
        rest.
        """
        if hit is None:
            hit = self.lookup(request)
        if len(hit.blocks) != start or not loads:
            return 0  # the pool-resident prefix changed meanwhile: the chain is broken
        pinned = list(hit.blocks)
        self.pin(pinned)  # making room must not evict the prefix these blocks extend
        try:
            blocks = self.take_free_blocks(len(loads))
        finally:
            self.unpin(pinned)
        if not blocks:
            return 0
        write_fn([b.block_id for b in blocks], [data for _, data in loads[: len(blocks)]])
        return self.land_blocks(request, start, blocks, hit)

    def take_free_blocks(self, n: int) -> list[KVCacheBlock]:
        """Up to `n` blocks for the caller to write (the pool's free ones, evicting as an
        allocation does), one reference each: `land_blocks` or `release` gives them back.
        The reserve protects running requests, as at admission: with none running it only
        turned reloadable blocks into recompute."""
        reserve = self.watermark_blocks if self.req_to_blocks else 0
        n = min(n, self.block_pool.get_num_free_blocks() - reserve)
        return self.block_pool.get_new_blocks(n) if n > 0 else []

    def land_blocks(self, request: Request, start: int, blocks: Sequence[KVCacheBlock],
                    hit: PrefixHit | None = None) -> int:
        """Blocks from `take_free_blocks`, written with the request's blocks `start, ...`,
        become ordinary free cached blocks continuing its pool prefix (`hit`, extended in
        place, as a fresh lookup would find it; looked up here when None). Returns how many
        landed: none when the pool prefix no longer ends at `start`. The caller's references
        are dropped either way."""
        if hit is None:
            hit = self.lookup(request)
        landed = len(blocks) if len(hit.blocks) == start else 0
        if landed:
            hashes = request.block_hashes
            self.block_pool.cache_full_blocks(list(hit.blocks) + list(blocks), hashes, start,
                                              start + landed, request.all_token_ids,
                                              owner=request.tenant or NO_OWNER,
                                              shared_blocks=request.shared_blocks)
            self._continue_lookup(hit, hashes)
        self.unpin(blocks)  # tail first: the run's head stays cached longest
        return landed

    def release(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Give back blocks of `take_free_blocks` (written or not): an unhashed one holds
        nothing reusable and is handed out first."""
        self.block_pool.free_blocks(blocks)

    def pin(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Hold a reference on blocks no request table holds (a prefix a tier load extends),
        so that making room cannot evict them."""
        self.block_pool.touch(blocks)

    def unpin(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Release `pin`: tail first, as `free`, so the prefix's head stays cached longest."""
        self.block_pool.free_blocks(reversed(blocks))

    def free(self, request: Request | str, preempted: bool = False) -> None:
        """Release a request's blocks, tail first, so its prompt's head is evicted last.
        `preempted`: it will be computed again, so its cache control does not apply yet."""
        rid = request if isinstance(request, str) else request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        if blocks is None:
            raise KeyError(f"request {rid!r} holds no blocks (unknown request or double free)")
        del self.num_cached_blocks[rid]
        req = request if isinstance(request, Request) and not preempted else None
        control = req.cache_control if req is not None else None
        if req is not None and control is not None and control.one_shot:
            # Its own blocks (past its hit) that no one else holds: first to go, never demoted.
            for block in blocks[req.num_hit_blocks:]:
                if block.ref_cnt == 1 and block.block_hash is not None:
                    block.one_shot = True
            self.block_pool.free_blocks(reversed(blocks[req.num_hit_blocks:]),
                                        evict_first=True)
            self.block_pool.free_blocks(reversed(blocks[: req.num_hit_blocks]))
            return
        if req is not None and req.cache_control.session_id and self.retention is not None \
                and self.session_idle_s > 0:
            # The next turn's prompt starts with all of this one: keep it through the pause.
            self.retention.retain(req.block_hashes[: len(blocks)], self.session_idle_s)
        self.block_pool.free_blocks(reversed(blocks))

    def fork(self, parent: Request, child: Request) -> None:
        """Parallel sampling: the child shares every block of the parent (copy-on-write)."""
        blocks = self.req_to_blocks.get(parent.request_id)
        if blocks is None:
            raise KeyError(f"parent request {parent.request_id!r} holds no blocks")
        if child.request_id in self.req_to_blocks:
            raise ValueError(f"child request {child.request_id!r} already holds blocks")
        for b in blocks:
            b.ref_cnt += 1
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks[parent.request_id]
        child.num_computed_tokens = parent.num_computed_tokens
        child.prefix_stats_recorded = True  # the parent's admission already counted the prompt
        if child.hasher is None and parent.hasher is not None:
            # Same tokens so far, so the same chain: copy it instead of rehashing the prompt.
            child.hasher = parent.hasher
            child.block_hashes = list(parent.block_hashes)

    def forget_cached(self, block_hashes: Sequence[bytes]) -> int:
        """Drop these blocks from the prefix cache (an operator's delete); how many were in it."""
        return len(self.block_pool.forget(block_hashes))

    def parent_of(self, block_hash: bytes) -> tuple[bool, bytes | None]:
        """(whether the pool caches the block, the hash of the block before it)."""
        block = self.block_pool.get_cached_block(block_hash)
        return (False, None) if block is None else (True, block.parent_hash)

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()  # only succeeds with no request holding blocks
        if not ok:
            logger.warning("reset_prefix_cache refused: %d blocks are in use",
                           self.num_blocks - self.block_pool.get_num_free_blocks())
        return ok

    # -- queries --------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            raise KeyError(f"request {request_id!r} holds no blocks")
        return blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.get_blocks(request_id)]

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._block_copies = self._block_copies, []
        return copies

    def take_events(self) -> list[KVEvent]:
        return self.block_pool.take_events()

    def cached_hashes(self) -> KeysView[bytes]:
        """The hash of every block the prefix cache holds (a live view: read it at once)."""
        return self.block_pool.cached_block_hash_to_block.keys()

    def idle_cached_blocks(self) -> list[KVCacheBlock]:
        """Cached blocks that no request holds, least recently used (next victim) first."""
        return [b for b in self.block_pool.free_block_queue.get_all_free_blocks()
                if b.block_hash is not None]

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()
