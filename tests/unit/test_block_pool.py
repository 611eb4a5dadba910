"""Unit tests of the free queue and the block pool."""

import pytest

from pagekv.kvnode.memory.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagekv.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def ids(blocks):
    return [b.block_id for b in blocks]


def make_queue(n):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def test_queue_popleft_remove_append_order():
    blocks, q = make_queue(5)
    assert q.num_free_blocks == 5
    assert q.popleft().block_id == 0
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4]
    q.append(blocks[2])
    q.append(blocks[0])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 2, 0]
    assert q.num_free_blocks == 5


def test_queue_popleft_n_prepend_n_append_n():
    blocks, q = make_queue(6)
    got = q.popleft_n(3)
    assert ids(got) == [0, 1, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in got)
    q.prepend_n([blocks[2], blocks[1]])
    assert ids(q.get_all_free_blocks()) == [2, 1, 3, 4, 5]
    q.append_n([blocks[0]])
    assert ids(q.get_all_free_blocks()) == [2, 1, 3, 4, 5, 0]
    assert q.num_free_blocks == 6
    with pytest.raises(ValueError):
        q.popleft_n(7)


def test_queue_empty_and_remove_errors():
    blocks, q = make_queue(1)
    q.popleft()
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[0])  # not in the queue
    assert q.popleft_n(0) == []


def test_pool_new_blocks_and_lazy_eviction_hook():
    evicted = []
    batches = []
    pool = BlockPool(4, block_size=16, on_evict=lambda b: evicted.append((b.block_id, b.block_hash)),
                     on_evict_many=lambda bs: batches.append([b.block_id for b in bs]))
    blocks = pool.get_new_blocks(2)
    assert [b.ref_cnt for b in blocks] == [1, 1]
    pool.cache_full_blocks(blocks, [b"h0", b"h1"], 0, 2, list(range(32)))
    assert pool.get_cached_block(b"h0") is blocks[0]
    pool.free_blocks(reversed(blocks))
    # Freed but still cached: a valid cache entry at ref_cnt 0.
    assert blocks[0].ref_cnt == 0 and blocks[0].block_hash == b"h0"
    assert pool.get_num_free_blocks() == 4
    # Unhashed blocks 2,3 are reused first; then h1 (freed first), then h0.
    order = ids(pool.free_block_queue.get_all_free_blocks())
    assert order == [2, 3, 1, 0]
    pool.get_new_blocks(3)
    assert evicted == [(1, b"h1")] and batches == [[1]]
    assert pool.get_cached_block(b"h1") is None
    assert pool.get_cached_block(b"h0") is blocks[0]
    events = pool.take_events()
    assert isinstance(events[0], BlockStored) and events[0].block_hashes == [b"h0", b"h1"]
    assert events[0].parent_block_hash is None and events[0].token_ids == list(range(32))
    assert events[-1] == BlockRemoved([b"h1"], "GPU")
    assert pool.take_events() == []


def test_stored_event_names_the_parent_of_its_first_block_even_after_a_skip():
    pool = BlockPool(4, block_size=16, enable_kv_events=True)
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [b"h0"], 0, 1)  # another request cached block 0 meanwhile
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(b, [b"h0", b"h1"], 0, 2)
    events = pool.take_events()
    assert [(e.block_hashes, e.parent_block_hash) for e in events] == [
        ([b"h0"], None), ([b"h1"], b"h0")]


def test_stored_event_tokens_start_after_its_parent():
    pool = BlockPool(4, block_size=2, enable_kv_events=True)
    pool.cache_full_blocks(pool.get_new_blocks(1), [b"h0"], 0, 1, token_ids=[1, 2])
    pool.take_events()
    blocks = pool.get_new_blocks(3)  # block 0 cached meanwhile: the run starts at block 1
    pool.cache_full_blocks(blocks, [b"h0", b"h1", b"h2"], 0, 3, token_ids=[1, 2, 3, 4, 5, 6])
    (event,) = pool.take_events()
    assert (event.block_hashes, event.parent_block_hash, event.token_ids) == (
        [b"h1", b"h2"], b"h0", [3, 4, 5, 6])


def test_pool_unhashed_freed_to_front():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a[:1], [b"x"], 0, 1)
    pool.free_blocks(a)
    # a[1] is unhashed: front. a[0] hashed: tail.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 3, 0]


def test_touch_revives_free_cached_block():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [b"h"], 0, 1)
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 3
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.touch([b])
    assert b.ref_cnt == 2 and pool.get_num_free_blocks() == 2


def test_duplicate_hash_not_registered_twice():
    pool = BlockPool(4)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [b"same"], 0, 1)
    pool.cache_full_blocks(b, [b"same"], 0, 1)
    assert pool.get_cached_block(b"same") is a[0]
    assert b[0].block_hash is None


def test_free_more_than_referenced_raises():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.free_blocks([b])


def test_get_new_blocks_too_many():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2"):
        pool.get_new_blocks(3)


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"h"], 0, 1)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"h") is blocks[0]
    pool.free_blocks(blocks)
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"h") is None and blocks[0].block_hash is None
    assert pool.take_events() == [AllBlocksCleared("GPU")]


def test_usage():
    pool = BlockPool(4)
    assert pool.usage == 0.0
    pool.get_new_blocks(1)
    assert pool.usage == 0.25


def test_bad_num_blocks():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_touch_revives_each_free_block_once_and_keeps_the_queue_linked():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"a", b"b", b"c"], 0, 3)
    pool.free_blocks(blocks)
    pool.touch([blocks[0], blocks[2], blocks[2]])  # block 2 twice: unlinked once, two refs
    assert [b.ref_cnt for b in blocks] == [1, 0, 2]
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 1]
    assert pool.get_num_free_blocks() == 3
    pool.free_blocks([blocks[2], blocks[2], blocks[0]])
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 1, 2, 0]


def test_queue_remove_n_refuses_a_block_not_in_it():
    blocks, q = make_queue(3)
    q.remove_n([blocks[1], blocks[0]])
    assert ids(q.get_all_free_blocks()) == [2] and q.num_free_blocks == 1
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove_n([blocks[2], blocks[0]])
    assert q.num_free_blocks == 0  # block 2 was unlinked before block 0 was refused
