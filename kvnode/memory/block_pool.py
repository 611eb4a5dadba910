"""The paged KV pool's bookkeeping: blocks, the free queue, and the prefix-cache map.

Pure Python, no torch: the tensors live in the model runner; this module only decides which
block id holds what. Names follow vLLM V1 (`KVCacheBlock`, `FreeKVCacheBlockQueue`,
`BlockPool`) because that is the vocabulary the field reads.

A block has two independent properties: `ref_cnt` (how many request tables point at it) and
`block_hash` (whether its content is a reusable prefix-cache entry). A free block that still
carries a hash is both free *and* a valid cache entry; it is evicted lazily, only when it is
popped from the free queue for reuse — and that is the moment `on_evict` hands it to the tiers.

Retention (proto/retention.py): a free block whose hash the retention table holds (a pin, an
idle session) is passed over when blocks are popped for reuse — it moves to the queue's tail —
up to the pool's cap of retained blocks; when nothing else is free it yields, counted and
logged: a pin never refuses a request. A one-shot request's private blocks go to the head
and are never handed to the tiers.

Quotas (proto/tenant_ledger.py): with a ledger, every cached hash is placed under its owner;
an owner over its pool quota has its oldest idle blocks evicted at once (to the tiers, as any
eviction) — its own, never another's — each time it caches or frees blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pagekv.kvnode.memory.metrics import KVCacheMetrics
from pagekv.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagekv.proto.medium import Medium
from pagekv.proto.retention import RetentionTable
from pagekv.proto.tenant_ledger import NO_OWNER, SHARED_OWNER, TenantLedger


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    parent_hash: bytes | None = None  # the previous block of its chain (for the tiers)
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # Lifecycle timestamps (monotonic seconds) for the block-lifetime histograms.
    alloc_time: float = 0.0
    free_time: float = 0.0
    # xxh3 of the block's bytes once a peer pull has computed it (kvnode/pod/
    # kv_data_session.py): a cached block's content is fixed until it is handed out again,
    # which clears it, so a hot prefix served to many pods is checksummed once.
    payload_xxh: int | None = None
    # Cached by a one-shot request and shared with no one since: evicted first, and never
    # written below the pool. A later hit makes it an ordinary block.
    one_shot: bool = False

    def __repr__(self) -> str:  # the default would recurse through the free-list links
        h = self.block_hash.hex()[:12] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list threaded through the blocks themselves.

    The head is the next victim. Every operation is O(1) per block: `remove` is how a prefix
    hit pulls a free cached block out of the middle of the queue, which a `deque` would make
    O(n) in the pool size. A queued block's links are never None (the head and tail are
    sentinels); the asserts below say so to the type checker, one per block touched.
    """

    __slots__ = ("num_free_blocks", "_head", "_tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVCacheBlock(-2)
        self.num_free_blocks = 0
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        out = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None:
            raise ValueError(f"{block} is not in the free queue")
        self._unlink(block)

    def remove_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """`remove` each block (the free blocks of a prefix hit), in one call."""
        for block in blocks:
            prev, nxt = block.prev_free_block, block.next_free_block
            if prev is None or nxt is None:
                raise ValueError(f"{block} is not in the free queue")
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
            block.prev_free_block = block.next_free_block = None
            self.num_free_blocks -= 1

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        n = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            n += 1
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += n

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the head, in the given order (the first becomes the next victim)."""
        if not blocks:
            return
        first = self._head.next_free_block
        assert first is not None
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            assert block is not None
            out.append(block)
            block = block.next_free_block
        return out


# Called with each hashed block about to be reused, before its data is overwritten; the
# batch form gets them all at once (the tiers copy a batch in one gather per layer).
EvictHook = Callable[[KVCacheBlock], None]
EvictManyHook = Callable[[list[KVCacheBlock]], None]


class BlockPool:
    """All blocks, made once at start-up, plus the hash → block map of the prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        block_size: int = 16,
        on_evict: EvictHook | None = None,
        metrics: KVCacheMetrics | None = None,
        enable_kv_events: bool = True,
        on_evict_many: EvictManyHook | None = None,
        retention: RetentionTable | None = None,
        retained_cap_blocks: int = 0,
        ledger: TenantLedger | None = None,
    ) -> None:
        """`retention`: the table of retained hashes; at most `retained_cap_blocks` free
        retained blocks are passed over by one allocation. `ledger`: whose blocks these are,
        and the quotas."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.block_size = block_size
        self.on_evict = on_evict
        self.on_evict_many = on_evict_many
        self.metrics = metrics
        self.enable_kv_events = enable_kv_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self._events: list[KVEvent] = []
        self.retention = retention
        self.retained_cap_blocks = retained_cap_blocks
        self.ledger = ledger

    # -- prefix cache -------------------------------------------------------------------
    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] | None = None,
        lora_id: int | None = None,
        owner: str = NO_OWNER,
        shared_blocks: int = 0,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under their chained hashes.

        A hash already mapped to another block (two requests computed the same prefix at the
        same time) leaves the newcomer unhashed: it is freed to the queue's head later.
        `owner`: the request's tenant, whose quota the blocks count against; the first
        `shared_blocks` are the shared region's (proto/shared_prefix.py).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        cached = self.cached_block_hash_to_block
        stored: list[bytes] = []
        first = num_cached_blocks  # index of stored[0]
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a prefix hit: already cached
            h = block_hashes[i]
            if h in cached:
                continue
            block.block_hash = h
            block.parent_hash = block_hashes[i - 1] if i > 0 else None
            cached[h] = block
            if not stored:
                first = i
            stored.append(h)
        if stored and self.enable_kv_events:
            bs = self.block_size
            # The parent of the first block stored (the index places a run by its parent:
            # None would make a block after a skipped one the root of a chain).
            parent = block_hashes[first - 1] if first > 0 else None
            # From the block after that parent, as vLLM's events: the tokens and the parent
            # recompute the run's hashes (the vLLM ingester checks them that way).
            toks = list(token_ids[first * bs : num_full_blocks * bs]) if token_ids is not None else []
            self._events.append(BlockStored(stored, parent, toks, bs, lora_id, Medium.GPU))
        ledger = self.ledger
        if stored and ledger is not None:
            region = set(block_hashes[:shared_blocks])
            ledger.placed([h for h in stored if h in region], Medium.GPU, SHARED_OWNER)
            ledger.placed([h for h in stored if h not in region], Medium.GPU, owner)
            self._trim_over_quota(ledger)

    # -- allocation ---------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks for writing; a popped block still carrying a hash is evicted now."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} free blocks, only "
                f"{self.free_block_queue.num_free_blocks} are free"
            )
        if self.retention:
            blocks = self._pop_sparing_retained(num_blocks, self.retention)
        else:
            blocks = self.free_block_queue.popleft_n(num_blocks)
        now = time.monotonic() if self.metrics is not None else 0.0
        self._evict(blocks, now)
        for block in blocks:
            block.ref_cnt = 1
            block.alloc_time = now
        return blocks

    def _evict(self, blocks: list[KVCacheBlock], now: float) -> None:
        """The hashed ones among blocks about to be reused leave the prefix cache: handed to
        the tiers first (a one-shot request's private blocks are not worth the copy)."""
        metrics = self.metrics
        if self.on_evict is not None or self.on_evict_many is not None:
            # The hooks copy the data out (to the tiers) before the blocks are overwritten.
            evicted = [b for b in blocks if b.block_hash is not None and not b.one_shot]
            if evicted and self.on_evict_many is not None:
                self.on_evict_many(evicted)
            if self.on_evict is not None:
                for b in evicted:
                    self.on_evict(b)
        removed: list[bytes] | None = None
        for block in blocks:
            if block.block_hash is not None:
                if metrics is not None:
                    metrics.observe_eviction(now - block.alloc_time, now - block.free_time)
                del self.cached_block_hash_to_block[block.block_hash]
                if removed is None:
                    removed = []
                removed.append(block.block_hash)
                block.block_hash = None
            block.payload_xxh = None
            block.one_shot = False
        if removed:
            if self.enable_kv_events:
                self._events.append(BlockRemoved(removed, Medium.GPU))
            if self.ledger is not None:
                self.ledger.gone(removed, Medium.GPU)

    def _trim_over_quota(self, ledger: TenantLedger) -> None:
        """Evict, now, the oldest idle blocks of each owner over its pool quota (unretained
        ones first) until it is within it or has no idle block left (running requests'
        blocks are not evictable)."""
        over = ledger.over(Medium.GPU)
        if not over:
            return
        cached = self.cached_block_hash_to_block
        retention = self.retention
        now = retention.now() if retention else 0.0

        def idle(h: bytes) -> bool:
            block = cached.get(h)
            return block is not None and block.ref_cnt == 0

        def retained(h: bytes) -> bool:
            return retention is not None and retention.holds(h, now)

        for owner in over:
            excess = ledger.excess(owner, Medium.GPU)
            if not excess:
                continue
            victims = [cached[h] for h in ledger.victims(
                owner, Medium.GPU, excess, idle, retained if retention else None)]
            if not victims:
                continue
            self.free_block_queue.remove_n(victims)
            self._evict(victims, time.monotonic() if self.metrics is not None else 0.0)
            self.free_block_queue.prepend_n(victims)  # uncached now: reused first
            ledger.count_evicted(owner, Medium.GPU, len(victims))

    def _pop_sparing_retained(self, n: int, retention: RetentionTable) -> list[KVCacheBlock]:
        """`n` blocks off the free queue's head, passing over retained ones (to the tail) up
        to the cap; retained ones are taken when nothing else is left."""
        queue = self.free_block_queue
        now = retention.now()
        out: list[KVCacheBlock] = []
        spared: list[KVCacheBlock] = []
        cap = self.retained_cap_blocks
        yielded = 0
        while len(out) < n:
            if not queue.num_free_blocks:
                taken = spared[: n - len(out)]
                del spared[: len(taken)]
                out += taken
                yielded += len(taken)
                break
            block = queue.popleft()
            h = block.block_hash
            if h is not None and retention.holds(h, now):
                if len(spared) < cap:
                    spared.append(block)
                    continue
                yielded += 1
            out.append(block)
        if spared:
            queue.append_n(spared)
        retention.note(Medium.GPU.value, len(spared), yielded)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix hits; a free one leaves the free queue (not evicted)."""
        revived = []
        ledger = self.ledger
        if ledger is not None:
            blocks = list(blocks)
            ledger.touched([b.block_hash for b in blocks if b.block_hash is not None],
                           Medium.GPU)
        for block in blocks:
            if block.ref_cnt == 0:
                revived.append(block)
                block.one_shot = False  # someone else's hit: no longer the one-shot's own
            block.ref_cnt += 1
        if revived:
            self.free_block_queue.remove_n(revived)
            metrics = self.metrics
            if metrics is not None:
                now = time.monotonic()
                for block in revived:
                    metrics.observe_reuse(now - block.free_time)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock],
                    evict_first: bool = False) -> None:
        """Drop one reference each; blocks reaching zero go back to the free queue.

        Hashed blocks join the tail (LRU: evicted last, in the order given); unhashed blocks
        hold nothing reusable and go to the head, to be reused first. `evict_first`: the
        hashed ones go to the head too, after the unhashed (a one-shot request's).
        """
        now = time.monotonic() if self.metrics is not None else 0.0
        hashed: list[KVCacheBlock] = []
        unhashed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            ref_cnt = block.ref_cnt
            if ref_cnt > 1:  # still shared (a prefix other requests hold)
                block.ref_cnt = ref_cnt - 1
            elif ref_cnt == 1:
                block.ref_cnt = 0
                block.free_time = now
                if block.block_hash is None:
                    unhashed.append(block)
                else:
                    hashed.append(block)
            else:
                raise ValueError(f"{block} freed more often than it was referenced")
        if hashed and evict_first:
            self.free_block_queue.prepend_n(hashed)
        elif hashed:
            self.free_block_queue.append_n(hashed)
        if unhashed:
            self.free_block_queue.prepend_n(unhashed)
        if hashed and self.ledger is not None:
            # Released in the order given (a request's leaves first): its owner's oldest are
            # then the chain's ends, and a quota's eviction never cuts a prefix short.
            self.ledger.touched([b.block_hash for b in hashed if b.block_hash is not None],
                                Medium.GPU)
            self._trim_over_quota(self.ledger)

    def forget(self, block_hashes: Iterable[bytes]) -> list[KVCacheBlock]:
        """Take these hashes out of the prefix cache (an operator's delete): a free block goes
        to the free queue's head, to be reused first; one a request holds stays its, uncached.
        Returns the blocks that held them."""
        cached = self.cached_block_hash_to_block
        gone: list[KVCacheBlock] = []
        removed: list[bytes] = []
        for h in block_hashes:
            block = cached.pop(h, None)
            if block is None:
                continue
            removed.append(h)
            block.block_hash = None
            block.one_shot = False
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self.free_block_queue.prepend_n([block])
            gone.append(block)
        if removed and self.enable_kv_events:
            self._events.append(BlockRemoved(removed, Medium.GPU))
        if removed and self.ledger is not None:
            self.ledger.gone(removed, Medium.GPU)
        return gone

    def reset_prefix_cache(self) -> bool:
        """Forget every cache entry. Refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared(Medium.GPU))
        if self.ledger is not None:
            self.ledger.cleared(Medium.GPU)
        return True

    # -- accounting -----------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
