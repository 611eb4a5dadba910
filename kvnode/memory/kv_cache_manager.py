"""Per-request block tables on top of the block pool: lookup, allocation, free, fork.

The manager is the pod's `malloc`: a request's KV lives in `req_to_blocks[request_id]`, a list
of pool blocks in token order. Full blocks are registered in the prefix cache as soon as they
are allocated for a step that fills them (the forward pass writes every token's K/V before any
attention reads it, so a hit within the same step is safe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvnode.memory.block_pool import BlockPool, EvictHook, KVCacheBlock
from kvnode.memory.metrics import KVCacheMetrics
from kvnode.memory.request import Request
from proto.hashing import DEFAULT_HASH_SEED, HashConfig, RequestBlockHasher, lora_key
from proto.kv_events import KVEvent

logger = logging.getLogger(__name__)

VALID_BLOCK_SIZES = (8, 16, 32, 64, 128)


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
    ) -> None:
        if block_size not in VALID_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {VALID_BLOCK_SIZES}, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_config = HashConfig(hash_algo, hash_seed)
        self.metrics = metrics if metrics is not None else KVCacheMetrics()
        self.block_pool = BlockPool(
            num_blocks, enable_caching, block_size, on_evict, self.metrics, enable_kv_events
        )
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
        if h is None or h.block_size != self.block_size or h.config != self.hash_config:
            lora = lora_key(request.lora_id, request.lora_path)
            request.hasher = RequestBlockHasher(
                self.hash_config, self.block_size, request.cache_salt, lora, request.mm_inputs
            )
            request.block_hashes = []
            request.hasher.extend(request.all_token_ids, request.block_hashes)
        return request.block_hashes

    # -- lookup -------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks; stops at the first miss; changes nothing.

        Never covers the last token: its logits must be computed, so at most
        `(num_tokens - 1) // block_size` blocks can hit.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self._hashes(request)
        max_blocks = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        lookup = self.block_pool.cached_block_hash_to_block.get
        hits: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = lookup(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        hits_by_tier: dict[str, int] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        Returns the newly allocated blocks, or None when they do not fit — and then nothing
        was touched. On success, prefix hits are referenced, a shared partial last block is
        copied before it is written (copy-on-write), and full blocks are cached.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        rid = request.request_id
        bs = self.block_size
        pool = self.block_pool
        req_blocks = self.req_to_blocks.get(rid)
        admitting = req_blocks is None
        hits = new_computed_blocks or ()
        if hits and not admitting:
            raise ValueError(f"request {rid} already holds blocks; hits are only for admission")
        if len(hits) * bs != num_new_computed_tokens:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{len(hits)} computed blocks of {bs} tokens"
            )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        if total > request.num_tokens + 1:
            # One token past the known ones is allowed: a speculative slot for the next step.
            raise ValueError(
                f"request {rid}: {total} tokens requested but only {request.num_tokens} known"
            )
        num_held = 0 if admitting else len(req_blocks)
        num_required = -(-total // bs)
        num_new_blocks = max(0, num_required - num_held - len(hits))

        # The block about to receive token `num_computed` is shared and partly filled: the
        # writer gets a private copy (full blocks are never written, so never copied).
        cow_block = None
        if not admitting and num_computed % bs and num_computed // bs < num_held:
            last = req_blocks[num_computed // bs]
            if last.ref_cnt > 1:
                cow_block = last

        num_free = pool.free_block_queue.num_free_blocks
        num_revived = 0
        for b in hits:  # hits sitting in the free queue stop counting as free once touched
            if b.ref_cnt == 0:
                num_revived += 1
        # The reserve protects running requests; with none running it would only stall.
        reserve = self.watermark_blocks if admitting and self.req_to_blocks else 0
        if num_new_blocks + (cow_block is not None) + num_revived > num_free - reserve:
            return None

        if admitting:
            req_blocks = self.req_to_blocks[rid] = []
            self.num_cached_blocks[rid] = 0
            if not request.prefix_stats_recorded:
                request.prefix_stats_recorded = True
                self.metrics.record_admission(
                    request.num_tokens, hits_by_tier or {"GPU": num_new_computed_tokens}
                )
        if hits:
            pool.touch(hits)
            req_blocks.extend(hits)
            self.num_cached_blocks[rid] = len(hits)
        if cow_block is not None:
            fresh = pool.get_new_blocks(1)[0]
            idx = num_computed // bs
            req_blocks[idx] = fresh
            pool.free_blocks((cow_block,))
            self._block_copies.append((cow_block.block_id, fresh.block_id))
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        if new_blocks:
            req_blocks.extend(new_blocks)

        if self.enable_caching:
            hashes = self._hashes(request)
            num_full = min(total // bs, len(hashes))
            num_cached = self.num_cached_blocks[rid]
            if num_full > num_cached:
                pool.cache_full_blocks(
                    req_blocks, hashes, num_cached, num_full, request.all_token_ids
                )
                self.num_cached_blocks[rid] = num_full
        return new_blocks

    def load_cached_blocks(
        self,
        request: Request,
        start: int,
        loads: Sequence[tuple[bytes, object]],
        write_fn: Callable[[list[int], list], None],
    ) -> int:
        """Materialize blocks reloaded from a lower tier as pool cache entries.

        `loads` are (hash, data) for the request's blocks `start, start+1, ...`, which must
        continue its current pool hits. They become ordinary free cached blocks, so the next
        `get_computed_blocks` finds them as pool hits. Returns how many were loaded (fewer
        when the pool has no room); the caller owns the rest.
        """
        pool = self.block_pool
        pinned, _ = self.get_computed_blocks(request)
        if len(pinned) != start or not loads:
            return 0  # the pool-resident prefix changed meanwhile: the chain is broken
        pool.touch(pinned)  # making room must not evict the prefix these blocks extend
        try:
            # The reserve protects running requests, as at admission: with none running it
            # only turned reloadable blocks into recompute.
            reserve = self.watermark_blocks if self.req_to_blocks else 0
            n = min(len(loads), pool.get_num_free_blocks() - reserve)
            if n <= 0:
                return 0
            blocks = pool.get_new_blocks(n)
            write_fn([b.block_id for b in blocks], [data for _, data in loads[:n]])
            hashes = request.block_hashes
            pool.cache_full_blocks(pinned + blocks, hashes, start, start + n,
                                   request.all_token_ids)
            pinned = pinned + blocks
            return n
        finally:
            pool.free_blocks(reversed(pinned))  # tail first, as free(): the head stays longest

    def free(self, request: Request | str) -> None:
        """Release a request's blocks, tail first, so its prompt's head is evicted last."""
        rid = request if isinstance(request, str) else request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        if blocks is None:
            raise KeyError(f"request {rid!r} holds no blocks (unknown request or double free)")
        del self.num_cached_blocks[rid]
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

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()
