"""Scenario tests of the KV cache manager."""

import pytest

from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
from pagekv.kvnode.memory.request import Request
from tests.kv_invariants import check_manager

BS = 16


def admit(mgr, req):
    hit = mgr.lookup(req)
    n = hit.num_tokens
    new = mgr.allocate_slots(req, req.num_tokens - n, hit)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return n


def decode(mgr, req, token):
    req.append_output_token_ids(token)
    assert mgr.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1


def test_hit_after_free():
    mgr = KVCacheManager(16, BS, watermark=0)
    a = Request("a", list(range(40)))
    assert admit(mgr, a) == 0
    mgr.free(a)
    b = Request("b", list(range(40)))
    hits, n = mgr.get_computed_blocks(b)
    assert n == 32 and len(hits) == 2
    assert admit(mgr, b) == 32
    assert mgr.metrics.prefix_hits_tokens == 32
    assert mgr.metrics.prefix_queries_tokens == 80


def test_hit_never_covers_last_token():
    mgr = KVCacheManager(16, BS, watermark=0)
    a = Request("a", list(range(32)))
    admit(mgr, a)
    mgr.free(a)
    b = Request("b", list(range(32)))
    _, n = mgr.get_computed_blocks(b)
    assert n == 16  # 32 tokens cached, but the last one must be computed
    c = Request("c", list(range(33)))
    _, n = mgr.get_computed_blocks(c)
    assert n == 32


def test_get_computed_blocks_changes_nothing():
    mgr = KVCacheManager(8, BS, watermark=0)
    a = Request("a", list(range(48)))
    admit(mgr, a)
    mgr.free(a)
    before = [(b.ref_cnt, b.block_hash) for b in mgr.block_pool.blocks]
    free_before = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    mgr.get_computed_blocks(Request("b", list(range(48))))
    assert before == [(b.ref_cnt, b.block_hash) for b in mgr.block_pool.blocks]
    assert free_before == [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def test_exact_free_and_eviction_order():
    mgr = KVCacheManager(6, BS, watermark=0)
    a = Request("a", list(range(48)))  # 3 full blocks; blocks 0,1,2
    admit(mgr, a)
    a_ids = mgr.get_block_ids("a")
    mgr.free(a)
    order = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    # Untouched blocks first, then a's blocks tail-first, so a's head is evicted last.
    assert order == [3, 4, 5] + list(reversed(a_ids))
    b = Request("b", [1000 + i for i in range(80)])  # needs 5 blocks: evicts a's last two
    admit(mgr, b)
    a2 = Request("a2", list(range(48)))
    _, n = mgr.get_computed_blocks(a2)
    assert n == 16  # only a's first block survived


def test_failed_allocation_leaves_state_unchanged():
    mgr = KVCacheManager(4, BS, watermark=0)
    a = Request("a", list(range(32)))
    admit(mgr, a)
    mgr.free(a)
    snapshot = [(b.block_id, b.ref_cnt, b.block_hash) for b in mgr.block_pool.blocks]
    big = Request("big", list(range(16)) + list(range(5000, 5000 + 64)))  # 1 hit + 4 new
    hit = mgr.lookup(big)
    n = hit.num_tokens
    assert n == 16
    assert mgr.allocate_slots(big, big.num_tokens - n, hit) is None
    assert snapshot == [(b.block_id, b.ref_cnt, b.block_hash) for b in mgr.block_pool.blocks]
    assert "big" not in mgr.req_to_blocks
    assert mgr.get_num_free_blocks() == 4
    assert mgr.metrics.prefix_requests == 1  # the failed admission is not counted


def test_reset_refused_while_in_use():
    mgr = KVCacheManager(4, BS, watermark=0)
    a = Request("a", list(range(20)))
    admit(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    _, n = mgr.get_computed_blocks(Request("b", list(range(20))))
    assert n == 0


def test_cache_salt_isolation():
    mgr = KVCacheManager(8, BS, watermark=0)
    admit(mgr, Request("a", list(range(40)), cache_salt="tenant-a"))
    mgr.free("a")
    assert mgr.get_computed_blocks(Request("b", list(range(40)), cache_salt="tenant-b"))[1] == 0
    assert mgr.get_computed_blocks(Request("c", list(range(40))))[1] == 0
    assert mgr.get_computed_blocks(Request("d", list(range(40)), cache_salt="tenant-a"))[1] == 32


def test_lora_isolation():
    mgr = KVCacheManager(8, BS, watermark=0)
    admit(mgr, Request("a", list(range(40)), lora_id="sql"))
    mgr.free("a")
    assert mgr.get_computed_blocks(Request("b", list(range(40)), lora_id="chat"))[1] == 0
    assert mgr.get_computed_blocks(Request("c", list(range(40))))[1] == 0
    assert mgr.get_computed_blocks(Request("d", list(range(40)), lora_id="sql"))[1] == 32


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_one_token_change_in_block_k_leaves_k_hits(k):
    mgr = KVCacheManager(32, BS, watermark=0)
    base = list(range(6 * BS + 1))
    admit(mgr, Request("a", base))
    mgr.free("a")
    changed = list(base)
    changed[k * BS + 7] = 99999
    assert mgr.get_computed_blocks(Request("b", changed))[1] == k * BS


def test_decode_caches_block_when_full():
    mgr = KVCacheManager(8, BS, watermark=0)
    a = Request("a", list(range(14)))
    admit(mgr, a)
    events = mgr.take_events()
    assert events == []  # no full block yet
    decode(mgr, a, 500)
    decode(mgr, a, 501)  # token 16 allocated: block 0 (tokens 0..15) is now full and cached
    stored = mgr.take_events()
    assert len(stored) == 1 and stored[0].token_ids == list(range(14)) + [500, 501]
    assert stored[0].block_hashes == a.block_hashes[:1]


def test_fork_then_write_copies_partial_block():
    mgr = KVCacheManager(16, BS, watermark=0)
    parent = Request("p", list(range(20)))  # block 0 full, block 1 partial (4 tokens)
    admit(mgr, parent)
    child = Request("c", list(range(20)))
    mgr.fork(parent, child)
    blocks = mgr.get_blocks("p")
    assert [b.ref_cnt for b in blocks] == [2, 2]
    decode(mgr, child, 7)  # child writes into the shared partial block: copy first
    copies = mgr.take_block_copies()
    assert copies == [(blocks[1].block_id, mgr.get_block_ids("c")[1])]
    assert mgr.get_block_ids("c")[0] == blocks[0].block_id  # the full block stays shared
    assert blocks[0].ref_cnt == 2 and blocks[1].ref_cnt == 1
    decode(mgr, parent, 8)  # parent now owns its partial block alone: no copy
    assert mgr.take_block_copies() == []
    mgr.free(parent)
    mgr.free(child)
    assert mgr.get_num_free_blocks() == 16


def test_fork_on_block_boundary_copies_nothing():
    mgr = KVCacheManager(16, BS, watermark=0)
    parent = Request("p", list(range(32)))
    admit(mgr, parent)
    child = Request("c", list(range(32)))
    mgr.fork(parent, child)
    decode(mgr, child, 1)
    decode(mgr, parent, 2)
    assert mgr.take_block_copies() == []


def test_bad_use_raises_clear_errors():
    mgr = KVCacheManager(4, BS)
    with pytest.raises(KeyError, match="double free"):
        mgr.free("nope")
    a = Request("a", [1, 2, 3])
    admit(mgr, a)
    mgr.free(a)
    with pytest.raises(KeyError, match="double free"):
        mgr.free(a)
    with pytest.raises(ValueError, match="non-negative ints"):
        Request("x", [1, -2])
    with pytest.raises(ValueError, match="non-negative ints"):
        Request("x", [1, 2.5])
    with pytest.raises(ValueError, match="non-negative ints"):
        Request("x", [True])
    with pytest.raises(ValueError, match="at least one token"):
        Request("x", [])
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 24)
    with pytest.raises(KeyError):
        mgr.get_block_ids("unknown")
    with pytest.raises(ValueError, match="positive"):
        mgr.allocate_slots(Request("y", [1]), 0)


def test_watermark_applies_to_admission_only():
    mgr = KVCacheManager(10, BS, watermark=0.2)  # 2 blocks reserved
    a = Request("a", list(range(8 * BS)))
    hit = mgr.lookup(a)
    assert hit.num_tokens == 0
    assert mgr.allocate_slots(a, a.num_tokens, hit) is not None  # 8 of 10, 2 left
    a.num_computed_tokens = a.num_tokens
    b = Request("b", [7])
    assert mgr.allocate_slots(b, 1) is None  # would dip into the reserve
    decode(mgr, a, 1)  # a running request may use the reserve
    assert mgr.get_num_free_blocks() == 1


def test_disabled_caching_never_hits():
    mgr = KVCacheManager(8, BS, enable_caching=False, watermark=0)
    admit(mgr, Request("a", list(range(40))))
    mgr.free("a")
    assert mgr.get_computed_blocks(Request("b", list(range(40)))) == ([], 0)
    assert mgr.take_events() == []


def test_eviction_hook_is_given_at_construction():
    batches = []
    mgr = KVCacheManager(4, BS, watermark=0,
                         on_evict_many=lambda blocks: batches.append([b.block_hash for b in blocks]))
    a = Request("a", list(range(40)))  # 2 full blocks cached, 1 partial
    admit(mgr, a)
    mgr.free(a)
    admit(mgr, Request("b", [1000 + i for i in range(64)]))  # all 4 blocks: a's 2 evicted
    assert len(batches) == 1 and set(batches[0]) == set(a.block_hashes[:2])


def test_pin_holds_a_free_prefix_and_unpin_frees_it_tail_first():
    mgr = KVCacheManager(4, BS, watermark=0)
    a = Request("a", list(range(33)))  # blocks 0, 1 full and cached; block 2 partial
    admit(mgr, a)
    mgr.free(a)
    assert [b.block_hash for b in mgr.idle_cached_blocks()] == [a.block_hashes[1],
                                                                 a.block_hashes[0]]
    hit = mgr.lookup(Request("a2", list(range(33))))
    assert hit.num_tokens == 32 and hit.by_tier() == {"GPU": 32}
    mgr.pin(hit.blocks)
    assert mgr.get_num_free_blocks() == 2 and mgr.idle_cached_blocks() == []
    assert mgr.allocate_slots(Request("big", [500 + i for i in range(48)]), 48) is None
    mgr.unpin(hit.blocks)
    assert mgr.get_num_free_blocks() == 4
    assert set(mgr.cached_hashes()) == set(a.block_hashes[:2])
    # Tail first, as free(): the prefix's head is the last to be evicted.
    assert [b.block_hash for b in mgr.idle_cached_blocks()] == [a.block_hashes[1],
                                                                 a.block_hashes[0]]


def test_loaded_blocks_extend_the_hit_as_a_fresh_lookup_would():
    """Block 1 of a prefix was evicted but blocks 0 and 2 stayed: reloading block 1 into the
    admission's hit continues it through block 2, with no second lookup."""
    mgr = KVCacheManager(8, BS, watermark=0)
    tokens = list(range(49))  # 3 full blocks can hit
    a = Request("a", tokens)
    admit(mgr, a)
    blocks = mgr.get_blocks("a")[:3]
    mgr.free(a)
    mgr.pin(blocks)  # reorder the free queue so that block 1 is the next cached victim
    mgr.unpin([blocks[1]])
    mgr.unpin([blocks[0], blocks[2]])
    x = Request("x", [900 + i for i in range(81)])  # 6 blocks: the 5 uncached ones and block 1
    admit(mgr, x)
    mgr.free(x)  # x's partial block goes to the queue's head: the load below evicts nothing
    assert set(mgr.cached_hashes()) >= {a.block_hashes[0], a.block_hashes[2]}
    assert a.block_hashes[1] not in mgr.cached_hashes()

    req = Request("a2", tokens)
    hit = mgr.lookup(req)
    assert hit.blocks == [blocks[0]] and hit.max_blocks == 3
    written = []
    n = mgr.load_cached_blocks(req, 1, [(req.block_hashes[1], "row")],
                               lambda ids, datas: written.append((ids, datas)), hit)
    assert n == 1 and written[0][1] == ["row"]
    assert hit.num_tokens == 48 and hit.blocks[2] is blocks[2]
    assert hit.blocks == mgr.lookup(Request("a3", tokens)).blocks
    assert mgr.get_num_free_blocks() == 8  # the load pinned the prefix only while it ran


def test_lookup_stops_at_the_first_miss_though_later_blocks_are_cached():
    mgr = KVCacheManager(8, BS, watermark=0)
    a = Request("a", list(range(3 * BS + 1)))  # blocks 0..2 full, block 3 partial
    admit(mgr, a)
    mgr.free(a)  # free queue: [block 3 (unhashed), 4 never used, blocks 2, 1, 0 (hashed)]
    hit = mgr.lookup(Request("a2", list(range(3 * BS + 1))))
    assert hit.num_tokens == 3 * BS
    pinned = hit.blocks[2:]
    mgr.pin(pinned)  # block 2 stays cached while the pool makes room
    filler = Request("f", list(range(1000, 1000 + 6 * BS)))
    assert mgr.allocate_slots(filler, filler.num_tokens) is not None  # 5 free + block 1 evicted
    again = Request("a3", list(range(3 * BS + 1)))
    hit = mgr.lookup(again)
    assert again.block_hashes[2] in mgr.cached_hashes()  # block 2 is cached...
    assert again.block_hashes[1] not in mgr.cached_hashes()
    assert hit.num_tokens == BS  # ...but a hit is a prefix: it ends at block 1's miss
    mgr.unpin(pinned)
    check_manager(mgr)


def test_running_request_caches_each_block_as_it_fills_and_only_then():
    mgr = KVCacheManager(8, BS, watermark=0)
    a = Request("a", list(range(BS - 2)))
    admit(mgr, a)
    for t in range(3 * BS):
        decode(mgr, a, 100 + t)
        full = a.num_computed_tokens // BS
        assert len(a.block_hashes) == a.num_tokens // BS
        assert mgr.num_cached_blocks["a"] == full
        assert [b.block_hash for b in mgr.get_blocks("a")[:full]] == a.block_hashes[:full]
    stored = [e for e in mgr.take_events() if e.block_hashes]
    assert [e.block_hashes for e in stored] == [[h] for h in a.block_hashes[:3]]


def test_a_later_prefill_chunk_caches_the_blocks_it_fills():
    mgr = KVCacheManager(8, BS, watermark=0)
    a = Request("a", list(range(3 * BS + 5)))
    hit = mgr.lookup(a)
    assert mgr.allocate_slots(a, BS + 3, hit) == mgr.get_blocks("a")  # first chunk: 2 blocks
    a.num_computed_tokens = BS + 3
    assert mgr.num_cached_blocks["a"] == 1
    assert len(mgr.allocate_slots(a, 2 * BS)) == 2  # up to token 51: blocks 2 and 3
    assert mgr.num_cached_blocks["a"] == 3
    assert mgr.cached_hashes() >= set(a.block_hashes[:3])


def test_output_tokens_are_checked_and_hashed_as_blocks_fill():
    mgr = KVCacheManager(8, BS, watermark=0)
    a = Request("a", list(range(BS - 1)))
    admit(mgr, a)
    for bad in (True, -1, [1, -1], [2.0], [False]):
        with pytest.raises(ValueError, match="non-negative ints"):
            a.append_output_token_ids(bad)
    assert a.num_tokens == BS - 1 and a.output_token_ids == []
    a.append_output_token_ids(5)  # completes block 0
    assert len(a.block_hashes) == 1
    a.append_output_token_ids(list(range(2 * BS)))  # a list that fills two more
    assert len(a.block_hashes) == 3
    assert a.output_token_ids == [5, *range(2 * BS)]
    fresh = Request("b", a.all_token_ids)
    mgr.lookup(fresh)  # the same tokens hashed from scratch
    assert fresh.block_hashes == a.block_hashes
