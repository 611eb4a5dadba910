"""Invariant checks of the KV memory manager and the offload tiers, shared by the tests.

- every block's ref_cnt equals the number of request tables (plus tier-load pins) holding it;
- the free queue's links are consistent both ways and hold exactly the ref_cnt == 0 blocks,
  so no block is both free and referenced;
- the hash map only points at blocks carrying that hash;
- a lookup never hits past num_tokens - 1, and every hit is the request's own prefix;
- the tiers' books (slots, entries, bytes, the chain's tree) agree with each other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pagekv.kvnode.memory.block_pool import BlockPool, KVCacheBlock
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
from pagekv.kvnode.memory.request import Request


def check_pool(pool: BlockPool, holders: Iterable[Iterable[KVCacheBlock]]) -> None:
    """`holders`: every list of blocks that holds one reference per entry (request tables,
    the prefixes pinned by in-flight tier loads)."""
    refs: Counter[int] = Counter()
    for blocks in holders:
        for b in blocks:
            refs[b.block_id] += 1
    for b in pool.blocks:
        assert b.ref_cnt == refs[b.block_id], (b, refs[b.block_id])

    q = pool.free_block_queue
    free = q.get_all_free_blocks()
    assert len(free) == q.num_free_blocks
    assert len({b.block_id for b in free}) == len(free)
    prev = q._head
    for b in free:
        assert b.prev_free_block is prev and prev.next_free_block is b
        prev = b
    assert prev.next_free_block is q._tail and q._tail.prev_free_block is prev
    assert {b.block_id for b in free} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for b in pool.blocks:
        if b.ref_cnt > 0:  # referenced, so not linked into the free queue
            assert b.prev_free_block is None and b.next_free_block is None, b

    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    assert len(hashed) == len(pool.cached_block_hash_to_block)


def check_manager(mgr: KVCacheManager, pins: Iterable[Iterable[KVCacheBlock]] = ()) -> None:
    assert set(mgr.num_cached_blocks) == set(mgr.req_to_blocks)
    check_pool(mgr.block_pool, [*mgr.req_to_blocks.values(), *pins])


def check_lookup(mgr: KVCacheManager, req: Request) -> None:
    """A lookup stops before the last token and only returns the request's own blocks."""
    hit = mgr.lookup(req)
    hits, n = hit.blocks, hit.num_tokens
    assert n == len(hits) * mgr.block_size
    assert n <= req.num_tokens - 1, (req, n)
    assert len(hits) <= hit.max_blocks
    for i, b in enumerate(hits):
        assert b.block_hash == req.block_hashes[i]


def check_all_free(mgr: KVCacheManager) -> None:
    """Nothing runs: every pool block is free and unreferenced."""
    assert mgr.req_to_blocks == {} and mgr.num_cached_blocks == {}
    assert mgr.get_num_free_blocks() == mgr.num_blocks
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.blocks)
    check_manager(mgr)


def check_tier_chain(chain) -> None:
    """The chain's tree and the tiers' books agree (call with no load in flight)."""
    dram, ssd = chain.dram, chain.ssd
    dram_keys = set(dram.keys()) if dram is not None else set()
    ssd_keys = set(ssd.keys()) if ssd is not None else set()
    with chain._lock:
        chain._sync_ssd_locked()
        nodes = dict(chain._tree.nodes)
        children = {p: set(c) for p, c in chain._tree.children.items()}
    assert not dram_keys & ssd_keys, "a block in two tiers at once"
    assert set(nodes) == dram_keys | ssd_keys
    for h, node in nodes.items():
        assert node.medium == ("CPU" if h in dram_keys else "DISK"), (h.hex()[:12], node.medium)
        if node.parent_hash is not None:
            assert h in children.get(node.parent_hash, ()), "node missing from its parent's set"
    for parent, kids in children.items():
        assert kids, "empty child set left behind"
        for k in kids:
            assert k in nodes and nodes[k].parent_hash == parent
    if dram is not None:
        slots = list(dram._lru.values())
        assert len(set(slots)) == len(slots)
        assert not set(slots) & set(dram._free)
        assert len(slots) + len(dram._free) == dram.num_slots
        assert dram.used_bytes == dram.num_entries * dram.block_bytes <= dram.capacity_bytes
    if ssd is not None:
        with ssd._lock:
            live = Counter(loc.seg.seq for loc in ssd._index.entries.values())
            segs = dict(ssd._index.segments)
            assert ssd.num_entries == len(ssd._index.entries) + len(ssd._ring.entries)
            assert ssd._ring.nbytes == sum(p.nbytes for p in ssd._ring.entries.values())
            assert ssd.used_bytes == sum(s.size for s in segs.values())
            assert ssd.used_bytes <= ssd.capacity_bytes
            assert set(live) <= set(segs), "an index entry in a deleted segment"
            for seq, seg in segs.items():
                assert seg.live == live[seq], (seq, seg.live, live[seq])
