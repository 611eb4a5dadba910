"""The DRAM tier's slab with a copy stream: slots reserved for, held by and guarded by copies.

The stream is tests/unit/fake_copy_stream.py: a copy runs only when its event is waited for
(or queried enough), so a CPU access that does not wait reads what the slot held before.
"""

from __future__ import annotations

import pytest
import torch

from pagekv.tiers.chain import TierChain
from pagekv.tiers.copy_stream import contiguous_runs
from pagekv.tiers.dram import DramTier
from tests.unit.fake_copy_stream import FakeCopyStream

BB = 64  # block bytes


def h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def pattern(i: int) -> torch.Tensor:
    return torch.full((BB,), i % 251, dtype=torch.uint8)


def tier(slots: int, lag: int = 10**6) -> tuple[DramTier, FakeCopyStream]:
    stream = FakeCopyStream(lag=lag)
    return DramTier(slots * BB, BB, copy_stream=stream), stream


def copy_into(dram: DramTier, stream: FakeCopyStream, slots: list[int], values: list[int]):
    """A stream copy writing pattern(v) into each slot; returns its event."""
    for slot, v in zip(slots, values, strict=True):
        stream.submit(lambda slot=slot, v=v: dram.slab[slot].copy_(pattern(v)))
    return stream.record()


def test_contiguous_runs():
    assert contiguous_runs([]) == []
    assert contiguous_runs([4]) == [(0, 4, 1)]
    assert contiguous_runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (3, 5, 2), (5, 9, 1)]


def test_the_slab_is_one_allocation_carved_into_slots():
    dram, _ = tier(8)
    assert tuple(dram.slab.shape) == (8, BB)
    base = dram.slab.data_ptr()
    assert [dram.slab[i].data_ptr() - base for i in range(8)] == [i * BB for i in range(8)]


def test_reserved_slots_are_consecutive_and_readable_only_after_their_copy():
    dram, stream = tier(8)
    slots = dram.reserve([h(i) for i in range(5)])
    assert slots == [0, 1, 2, 3, 4]  # one run: one host copy for the batch
    dram.guard(slots, copy_into(dram, stream, slots, [10, 11, 12, 13, 14]))
    assert stream.pending == 5  # nothing ran yet
    assert all(dram.contains(h(i)) for i in range(5))
    got = dram.get(h(2))  # a CPU read: waits for the copy
    assert torch.equal(got, pattern(12))
    assert stream.pending == 0 and stream.syncs == 1
    assert torch.equal(dram.pop(h(4)), pattern(14))  # settled already: no second wait
    assert stream.syncs == 1


def test_cpu_reads_of_every_kind_wait_for_the_copy():
    for read in ("get", "pop", "pop_many", "pop_lru"):
        dram, stream = tier(4)
        slots = dram.reserve([h(1), h(2)])
        dram.guard(slots, copy_into(dram, stream, slots, [7, 8]))
        if read == "pop_many":
            one, two = dram.pop_many([h(1), h(2)])
            assert torch.equal(one, pattern(7)) and torch.equal(two, pattern(8))
        elif read == "pop_lru":
            victim, view = dram.pop_lru()
            assert victim == h(1) and torch.equal(view, pattern(7))
        else:
            assert torch.equal(getattr(dram, read)(h(2)), pattern(8))
        assert stream.pending == 0, read


def test_a_released_slot_is_rewritten_by_the_cpu_only_after_the_copy_reading_it():
    dram, stream = tier(1)
    dram.put(h(1), pattern(1))
    [slot] = dram.hold([h(1)])
    out = torch.zeros(BB, dtype=torch.uint8)
    stream.submit(lambda: out.copy_(dram.slab[slot]))  # a copy reading the held slot
    dram.release([slot], stream.record())
    assert dram.num_free_slots == 1 and not dram.contains(h(1))
    dram.put(h(2), pattern(2))  # the CPU reuses the slot: the reader must have run first
    assert torch.equal(out, pattern(1))
    assert torch.equal(dram.get(h(2)), pattern(2))


def test_held_blocks_are_neither_evictable_nor_free_and_unhold_restores_them():
    dram, _ = tier(3)
    for i in range(3):
        dram.put(h(i), pattern(i))
    assert dram.hold([h(0), h(9)]) is None  # all or nothing
    assert dram.num_entries == 3
    slots = dram.hold([h(0), h(1)])
    assert dram.num_held == 2 and dram.num_entries == 1 and dram.num_free_slots == 0
    assert dram.pop_lru()[0] == h(2)  # the only evictable one
    assert dram.pop_lru() is None
    dram.put(h(5), pattern(5))  # takes the one free slot
    assert dram.put(h(6), pattern(6))  # replaces the LRU one, never a held one
    assert dram.num_entries == 1 and not dram.contains(h(5))
    dram.unhold([h(0)], slots[:1])
    dram.release(slots[1:], None)
    assert dram.num_held == 0 and dram.contains(h(0))
    assert torch.equal(dram.get(h(0)), pattern(0))
    with pytest.raises(ValueError, match="not held"):
        dram.release(slots[1:], None)


def test_put_refuses_when_every_slot_is_held():
    dram, _ = tier(2)
    dram.put(h(0), pattern(0))
    dram.put(h(1), pattern(1))
    dram.hold([h(0), h(1)])
    assert dram.put(h(2), pattern(2)) is False


def test_clear_keeps_held_slots_out_of_the_free_list():
    dram, _ = tier(4)
    for i in range(4):
        dram.put(h(i), pattern(i))
    slots = dram.hold([h(1)])
    assert set(dram.clear()) == {h(0), h(2), h(3)}
    assert dram.num_free_slots == 3 and slots[0] not in dram._free
    dram.release(slots, None)
    assert sorted(dram._free) == [0, 1, 2, 3]


def test_released_slots_are_reused_in_runs():
    dram, stream = tier(8)
    a = dram.reserve([h(i) for i in range(4)])
    dram.guard(a, copy_into(dram, stream, a, [1, 2, 3, 4]))
    b = dram.reserve([h(i) for i in range(4, 8)])
    dram.guard(b, copy_into(dram, stream, b, [5, 6, 7, 8]))
    held = dram.hold([h(i) for i in range(4)])
    dram.release(held, stream.record())
    again = dram.reserve([h(i) for i in range(10, 14)])
    assert again == a  # the freed run comes back as one run
    assert len(contiguous_runs(again)) == 1


def test_without_a_stream_the_async_calls_refuse():
    dram = DramTier(4 * BB, BB)
    with pytest.raises(RuntimeError, match="copy_stream"):
        dram.reserve([h(0)])


def test_chain_demote_into_dram_reserves_fresh_blocks_and_refreshes_known_ones():
    dram, stream = tier(4)
    chain = TierChain(dram, None, block_size=16)
    chain.demote(h(0), None, (), pattern(0))
    calls = []

    def copy_in(indices, slots):
        calls.append((indices, slots))
        return copy_into(dram, stream, slots, [100 + i for i in indices])

    assert chain.demote_into_dram([h(0), h(1), h(2)], [None, h(0), h(1)], copy_in)
    assert calls == [([1, 2], [1, 2])]  # h(0) was below already: only refreshed
    assert chain.full_state() == dict.fromkeys([h(0), h(1), h(2)], "CPU")
    assert torch.equal(chain.promote(h(2)), pattern(102))  # waits for the copy
    # More than DRAM holds: refused, nothing done (the caller demotes synchronously).
    assert not chain.demote_into_dram([h(i) for i in range(10, 15)], [None] * 5, copy_in)
    assert len(calls) == 1


def test_chain_hold_and_end_hold_move_only_what_the_pool_took():
    dram, stream = tier(4)
    chain = TierChain(dram, None, block_size=16)
    for i in range(3):
        chain.demote(h(i), h(i - 1) if i else None, (), pattern(i))
    chain.take_events()
    assert chain.hold_dram_run([h(0), h(7)]) is None
    slots = chain.hold_dram_run([h(0), h(1), h(2)])
    assert slots is not None and dram.num_held == 3
    chain.end_hold([h(0), h(1), h(2)], slots, 2, stream.record())
    assert chain.full_state() == {h(2): "CPU"}  # the third came back, with no copy
    assert torch.equal(dram.get(h(2)), pattern(2))
    removed = [e for e in chain.take_events() if type(e).__name__ == "BlockRemoved"]
    assert sorted(x for e in removed for x in e.block_hashes) == [h(0), h(1)]
    st = chain.stats()
    assert st["promotions_dram"] == 2 and st["dram_to_pool_bytes"] == 2 * BB
    assert dram.num_held == 0 and dram.num_free_slots == 3
