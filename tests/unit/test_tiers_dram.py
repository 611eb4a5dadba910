"""The DRAM tier: a fixed slab of slots, LRU order, slots reused, copies that outlive the source."""

from __future__ import annotations

import pytest
import torch

from pagekv.tiers.dram import DramTier

BB = 256


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block(i: int) -> torch.Tensor:
    return torch.full((BB,), i % 256, dtype=torch.uint8)


def test_slab_is_made_once_with_whole_slots() -> None:
    tier = DramTier(capacity_bytes=BB * 4 + 100, block_bytes=BB)
    assert tier.num_slots == 4
    assert tier.capacity_bytes == BB * 4
    assert tier._slab.shape == (4, BB)
    ptr = tier._slab.data_ptr()
    for i in range(20):
        tier.put(h(i), block(i))
    assert tier._slab.data_ptr() == ptr  # never reallocated


def test_put_copies_so_the_pool_block_can_be_reused() -> None:
    tier = DramTier(BB * 2, BB)
    src = block(7)
    tier.put(h(1), src)
    src.fill_(0)
    got = tier.get(h(1))
    assert got is not None and torch.equal(got, block(7))


def test_lru_order_and_eviction_when_full() -> None:
    tier = DramTier(BB * 3, BB)
    for i in range(3):
        tier.put(h(i), block(i))
    assert tier.keys() == [h(0), h(1), h(2)]
    tier.get(h(0))  # 0 becomes most recent
    assert tier.keys() == [h(1), h(2), h(0)]
    tier.put(h(3), block(3))  # full: the LRU block (1) goes
    assert not tier.contains(h(1))
    assert tier.keys() == [h(2), h(0), h(3)]
    assert tier.evictions == 1


def test_pop_lru_returns_the_victim_and_frees_its_slot() -> None:
    tier = DramTier(BB * 2, BB)
    tier.put(h(0), block(10))
    tier.put(h(1), block(11))
    assert tier.is_full()
    victim = tier.pop_lru()
    assert victim is not None
    vh, data = victim
    assert vh == h(0) and torch.equal(data, block(10))
    assert tier.num_free_slots == 1
    tier.put(h(2), block(12))  # reuses the victim's slot
    assert tier.slot_of(h(2)) is not None
    assert tier.num_entries == 2 and tier.used_bytes == 2 * BB


def test_pop_is_exclusive_and_returns_an_owned_copy() -> None:
    tier = DramTier(BB * 1, BB)
    tier.put(h(0), block(5))
    data = tier.pop(h(0))
    assert data is not None and torch.equal(data, block(5))
    assert not tier.contains(h(0)) and tier.num_entries == 0
    tier.put(h(1), block(6))  # same slot overwritten: the popped copy must not change
    assert torch.equal(data, block(5))
    assert tier.pop(h(0)) is None


def test_slots_are_reused_after_remove_and_evict() -> None:
    tier = DramTier(BB * 2, BB)
    tier.put(h(0), block(0))
    tier.put(h(1), block(1))
    slots = {tier.slot_of(h(0)), tier.slot_of(h(1))}
    assert tier.remove(h(0))
    assert not tier.remove(h(0))
    assert tier.evict() == h(1)
    assert tier.evict() is None
    tier.put(h(2), block(2))
    tier.put(h(3), block(3))
    assert {tier.slot_of(h(2)), tier.slot_of(h(3))} == slots


def test_same_hash_put_twice_keeps_one_copy() -> None:
    tier = DramTier(BB * 2, BB)
    tier.put(h(0), block(0))
    tier.put(h(1), block(1))
    tier.put(h(0), block(0))
    assert tier.num_entries == 2
    assert tier.keys() == [h(1), h(0)]


def test_wrong_size_is_rejected() -> None:
    tier = DramTier(BB * 2, BB)
    with pytest.raises(ValueError, match="blocks of 256 bytes"):
        tier.put(h(0), torch.zeros(BB + 1, dtype=torch.uint8))


def test_bytes_and_typed_tensors_are_accepted() -> None:
    tier = DramTier(BB * 2, BB)
    tier.put(h(0), bytes(range(256)))
    got = tier.get(h(0))
    assert got is not None and bytes(got.numpy()) == bytes(range(256))
    halves = torch.randn(BB // 2).half()
    tier.put(h(1), halves)
    got = tier.get(h(1))
    assert got is not None and torch.equal(got.view(torch.float16), halves)


def test_zero_capacity_refuses_puts() -> None:
    tier = DramTier(BB - 1, BB)
    assert tier.num_slots == 0
    assert not tier.put(h(0), block(0))


def test_pop_many_gathers_the_present_blocks_and_misses_the_rest() -> None:
    tier = DramTier(BB * 4, BB)
    for i in range(3):
        tier.put(h(i), block(i))
    got = tier.pop_many([h(2), h(9), h(0)])
    assert got[1] is None
    assert got[0] is not None and torch.equal(got[0], block(2))
    assert got[2] is not None and torch.equal(got[2], block(0))
    assert tier.keys() == [h(1)] and tier.num_free_slots == 3


def test_put_rows_scatters_into_free_slots_and_refuses_without_room() -> None:
    tier = DramTier(BB * 3, BB)
    rows = torch.stack([block(i) for i in range(3)])
    assert tier.put_rows([h(i) for i in range(3)], rows) == 3
    assert tier.num_free_slots == 0 and tier.keys() == [h(0), h(1), h(2)]
    got = tier.get(h(1))
    assert got is not None and torch.equal(got, block(1))
    with pytest.raises(ValueError, match="free slots"):
        tier.put_rows([h(5)], rows[:1])


def test_dram_loses_nothing_on_its_own_and_keeps_nothing_across_restarts() -> None:
    tier = DramTier(BB * 2, BB)
    tier.put(h(0), block(0))
    assert tier.take_dropped() == [] and tier.take_recovered() == []
    assert tier.flush() and not tier.disabled
    assert tier.stats() == {"entries": 1, "used_bytes": BB, "capacity_bytes": BB * 2}
    tier.close()


def test_get_many_copies_each_block_and_leaves_it() -> None:
    """Tier.get_many (a peer's pull through TierChain.read_run) on a tier that does not batch
    its reads: one `get` per block, a miss is None, nothing leaves the tier."""
    tier = DramTier(BB * 4, BB)
    tier.put(h(1), block(1))
    tier.put(h(2), block(2))
    got = tier.get_many([h(2), h(9), h(1)])
    assert got[1] is None
    assert got[0] is not None and torch.equal(got[0], block(2))
    assert got[2] is not None and torch.equal(got[2], block(1))
    assert tier.num_entries == 2
