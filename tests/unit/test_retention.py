"""Retention: the table (pins, sessions), how the pool and both tiers spare what it holds, and
one-shot requests — on the pool alone, on the tiers alone, and through the engine."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.memory.block_pool import BlockPool
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
from pagekv.kvnode.memory.request import Request
from pagekv.proto.medium import Medium
from pagekv.proto.retention import FILE_NAME, NO_CACHE_CONTROL, CacheControl, RetentionTable
from pagekv.tiers.dram import DramTier
from pagekv.tiers.ssd_index import Segment, SsdIndex
from tests.unit.engine_runs import run_request


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


# --- the table ----------------------------------------------------------------------------
def test_marks_run_out_and_hits_renew_them() -> None:
    clock = Clock()
    table = RetentionTable(100, clock)
    assert table.retain([h(1), h(2)], 10.0) == 2
    assert table.holds(h(1)) and not table.holds(h(3))
    clock.t += 8
    table.renew([h(1)])  # a hit: ten more seconds from now
    clock.t += 5
    assert table.holds(h(1)) and not table.holds(h(2))
    assert table.sweep() == 1 and len(table) == 1
    clock.t += 6
    assert not table.holds(h(1))
    assert table.retain([h(1)], 0) == 0  # no time: no mark


def test_a_longer_time_stays_and_the_table_is_capped() -> None:
    clock = Clock()
    table = RetentionTable(2, clock)
    table.retain([h(1)], 100.0)
    table.retain([h(1)], 5.0)
    clock.t += 50
    assert table.holds(h(1))
    assert table.retain([h(2), h(3)], 10.0) == 1
    assert table.refused == 1
    clock.t += 11  # h(2) ran out: its place is free again
    assert table.retain([h(3)], 10.0) == 1
    assert table.release([h(1), h(9)]) == 1 and not table.holds(h(1))


def test_saved_marks_come_back_and_spent_or_damaged_ones_do_not(tmp_path: Path) -> None:
    clock = Clock()
    table = RetentionTable(10, clock)
    table.retain([h(1)], 100.0)
    table.retain([h(2)], 5.0)
    assert table.save(tmp_path) == 2 and not table.dirty
    clock.t += 10
    again = RetentionTable(10, clock)
    assert again.load(tmp_path) == 1
    assert again.holds(h(1)) and not again.holds(h(2))
    (tmp_path / FILE_NAME).write_bytes(b"PKVRET1\n\x20short")
    assert RetentionTable(10, clock).load(tmp_path) == 0
    assert RetentionTable(10, clock).load(tmp_path / "absent") == 0


@pytest.mark.parametrize("kwargs", [{"pin_ttl_s": -1}, {"pin_ttl_s": 86_401},
                                    {"pin_tokens": -1}, {"one_shot": True, "pin_ttl_s": 5},
                                    {"one_shot": True, "session_id": "s"},
                                    {"session_id": "x" * 257}])
def test_contradictory_or_unbounded_asks_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CacheControl(**kwargs)


def test_a_pin_covers_whole_blocks_of_the_prompt() -> None:
    assert CacheControl(60.0).pin_blocks(100, 16, 6) == 6
    assert CacheControl(60.0, 40).pin_blocks(100, 16, 6) == 2
    assert CacheControl(60.0, 500).pin_blocks(100, 16, 6) == 6


# --- the pool -------------------------------------------------------------------------------
def cached_pool(table: RetentionTable, cap: int, n: int = 8) -> BlockPool:
    pool = BlockPool(n, block_size=4, retention=table, retained_cap_blocks=cap,
                     enable_kv_events=False)
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(blocks, [h(i) for i in range(n)], 0, n)
    pool.free_blocks(blocks)  # LRU: h(0) is the next victim
    return pool


def test_the_pool_passes_over_retained_blocks_up_to_its_cap() -> None:
    table = RetentionTable(100)
    table.retain([h(0), h(1), h(2)], 60.0)
    pool = cached_pool(table, cap=2)
    got = pool.get_new_blocks(4)
    # h(0), h(1) spared (cap 2); h(2) is past the cap and goes, as do h(3..5)
    assert pool.get_cached_block(h(0)) and pool.get_cached_block(h(1))
    assert pool.get_cached_block(h(2)) is None
    assert len(got) == 4
    assert table.spared["GPU"] == 2 and table.yielded["GPU"] == 1


def test_retained_blocks_yield_when_nothing_else_is_free(caplog) -> None:
    table = RetentionTable(100)
    table.retain([h(i) for i in range(8)], 60.0)
    pool = cached_pool(table, cap=8)
    with caplog.at_level(logging.WARNING):
        got = pool.get_new_blocks(3)  # never refused because of pins
    assert len(got) == 3 and pool.get_num_free_blocks() == 5
    assert table.yielded["GPU"] == 3
    assert "retained" in caplog.text


def test_a_one_shot_requests_blocks_go_first_and_never_below() -> None:
    evicted: list[bytes] = []
    mgr = KVCacheManager(12, 8, on_evict_many=lambda bs: evicted.extend(b.block_hash for b in bs))
    shared = Request("a", list(range(17)))
    mgr.allocate_slots(shared, 17, mgr.lookup(shared))
    mgr.free(shared)
    once = Request("b", list(range(16)) + list(range(100, 117)),
                   cache_control=CacheControl(one_shot=True))
    hit = mgr.lookup(once)
    assert len(hit.blocks) == 2  # it shares the first two blocks of "a"
    mgr.allocate_slots(once, once.num_tokens - 16, hit)
    mgr.free(once)
    own = set(once.block_hashes[2:])
    assert len(own) == 2
    for rid, first, n in (("c", 200, 13), ("d", 300, 21)):  # 5 blocks: 7 were never used
        filler = Request(rid, list(range(first, first + n)))
        mgr.allocate_slots(filler, n, mgr.lookup(filler))
    assert not own & set(mgr.cached_hashes()), "the one-shot's own blocks went first"
    assert not own & set(evicted), "and were not handed to the tiers"
    assert set(shared.block_hashes[:2]) <= set(mgr.cached_hashes())  # the shared ones stay


def test_a_hit_on_a_one_shot_block_makes_it_ordinary() -> None:
    evicted: list[bytes] = []
    mgr = KVCacheManager(6, 8, on_evict_many=lambda bs: evicted.extend(b.block_hash for b in bs))
    once = Request("a", list(range(17)), cache_control=CacheControl(one_shot=True))
    mgr.allocate_slots(once, 17, mgr.lookup(once))
    mgr.free(once)
    again = Request("b", list(range(17)))
    mgr.allocate_slots(again, 1, mgr.lookup(again))
    mgr.free(again)
    flood = Request("c", list(range(100, 148)))
    mgr.allocate_slots(flood, 48, mgr.lookup(flood))
    assert set(once.block_hashes[:2]) <= set(evicted)


def test_a_sessions_blocks_are_kept_after_its_turn() -> None:
    table = RetentionTable(100)
    mgr = KVCacheManager(8, 8, retention=table, retained_cap_blocks=8, session_idle_s=30.0)
    turn = Request("t1", list(range(20)), cache_control=CacheControl(session_id="s1"))
    mgr.allocate_slots(turn, 20, mgr.lookup(turn))
    turn.append_output_token_ids([50, 51, 52, 53])
    mgr.allocate_slots(turn, 4)
    mgr.free(turn)
    assert len(turn.block_hashes) == 3  # output blocks too
    assert all(table.holds(x) for x in turn.block_hashes)
    preempted = Request("t2", list(range(40, 57)), cache_control=CacheControl(session_id="s2"))
    mgr.allocate_slots(preempted, 17, mgr.lookup(preempted))
    mgr.free(preempted, preempted=True)  # computed again later: not a finished turn
    assert not any(table.holds(x) for x in preempted.block_hashes)


# --- the tiers ------------------------------------------------------------------------------
def test_dram_passes_over_retained_victims_up_to_its_cap() -> None:
    table = RetentionTable(100)
    tier = DramTier(4 * 64, 64, retention=table, retained_cap_bytes=2 * 64)
    for i in range(4):
        tier.put(h(i), torch.full((64,), i, dtype=torch.uint8))
    table.retain([h(0), h(1), h(2)], 60.0)
    assert tier.pop_lru()[0] == h(2)  # h(0), h(1) spared; h(2) past the cap
    assert tier.pop_lru()[0] == h(3)
    assert {tier.pop_lru()[0], tier.pop_lru()[0]} == {h(0), h(1)}  # nothing else: they yield
    assert table.yielded["CPU"] == 3


def test_the_ssd_index_passes_over_retained_entries() -> None:
    table = RetentionTable(100)
    index = SsdIndex(6 * 100, {"evictions": 0}, lambda: None, table, retained_cap_blocks=4)
    segments = [Segment(seq, f"seg{seq}") for seq in range(3)]  # two entries each
    for i in range(6):
        seg = segments[i // 2]
        if i % 2 == 0:
            index.add_segment(seg)
        index.add(h(i), seg, (i % 2) * 100, 100)
        index.grow(seg, 100)
    table.retain([h(0)], 60.0)
    evicted, doomed = index.evict(100)
    # h(0) keeps the oldest segment: the next one is emptied instead (a spared entry's
    # segment stays on disk until it leaves).
    assert evicted == [h(1), h(2), h(3)] and h(0) in index
    assert doomed == [segments[1]]
    assert table.spared["DISK"] >= 1 and not table.yielded


# --- through the engine (the tiny model) ----------------------------------------------------
P = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PREFIX = [(i * 37) % 250 + 1 for i in range(160)]  # 10 full blocks of 16


def fillers(k: int) -> list[list[int]]:
    return [[(i * m + 3) % 250 + 1 for i in range(150)] for m in range(11, 11 + 2 * k, 2)]


def serve(engine: Engine, prompt: list[int], control: CacheControl = NO_CACHE_CONTROL):
    """The request's last delta, and every token it produced."""
    return run_request(engine, prompt, P, cache_control=control)


def engine_with(tmp_path: Path | None = None, **kw) -> Engine:
    tiers = ({"cpu_offload_bytes": 4 * 8192, "disk_offload_bytes": 8 << 20,
              "disk_offload_dir": str(tmp_path)} if tmp_path is not None else {})
    return Engine(model="pagekv-tiny", num_gpu_blocks=26, max_model_len=400, **tiers, **kw)


def test_a_pinned_prefix_outlives_a_flood_of_pool_dram_and_ssd(tmp_path: Path) -> None:
    cold = serve(engine_with(), PREFIX + [5])[1]
    engine = engine_with(tmp_path)
    serve(engine, PREFIX + [9], CacheControl(pin_ttl_s=600.0))
    for prompt in fillers(12):  # ~110 blocks through a 24-block pool, 4 DRAM slots, an SSD
        serve(engine, prompt)
    out, tokens = serve(engine, PREFIX + [5])
    assert out.num_cached_tokens == 160
    assert tokens == cold and len(cold) == 4
    stats = engine.stats().retention
    assert stats is not None and stats.marks == 10 and stats.resident[Medium.GPU] == 10
    engine.close()


def test_without_a_pin_the_same_flood_evicts_the_prefix(tmp_path: Path) -> None:
    engine = engine_with()
    serve(engine, PREFIX + [9])
    for prompt in fillers(12):
        serve(engine, prompt)
    assert serve(engine, PREFIX + [5])[0].num_cached_tokens == 0


def test_a_pin_runs_out() -> None:
    engine = engine_with()
    serve(engine, PREFIX + [9], CacheControl(pin_ttl_s=1.0))
    time.sleep(1.1)  # the TTL has run: the blocks are evicted like any other
    for prompt in fillers(12):
        serve(engine, prompt)
    assert serve(engine, PREFIX + [5])[0].num_cached_tokens == 0


def test_pins_too_large_for_the_running_requests_yield() -> None:
    engine = engine_with(retained_pool_bytes=26 * 8192)  # the whole pool may be retained
    serve(engine, PREFIX + [9], CacheControl(pin_ttl_s=600.0))
    serve(engine, fillers(1)[0][:140] + PREFIX[:120], CacheControl(pin_ttl_s=600.0))
    # A request needing most of the pool: the pins yield, it is served.
    big = [(i * 7) % 250 + 1 for i in range(330)]
    assert len(serve(engine, big)[1]) == 4
    assert engine.stats().retention.yielded.get("GPU", 0) > 0


def test_one_shot_requests_write_nothing_below_the_pool(tmp_path: Path) -> None:
    engine = engine_with(tmp_path)
    before = engine.stats().chain
    for prompt in fillers(12):  # ~4x the pool: each reuses the last one's blocks first
        serve(engine, prompt, CacheControl(one_shot=True))
    after = engine.stats().chain
    assert sum(t.entries for t in after.tiers.values()) == sum(
        t.entries for t in before.tiers.values()) == 0
    for prompt in fillers(12):  # the same flood, plain: it spills to DRAM and SSD
        serve(engine, [7, *prompt])
    assert sum(t.entries for t in engine.stats().chain.tiers.values()) > 0
    engine.close()


def test_pins_survive_a_restart_with_the_ssd_tier(tmp_path: Path) -> None:
    engine = engine_with(tmp_path)
    serve(engine, PREFIX + [9], CacheControl(pin_ttl_s=600.0))
    engine.close()  # persists the pool to the SSD and saves the marks beside it
    assert (tmp_path / FILE_NAME).exists()
    again = engine_with(tmp_path)
    assert len(again.retention.table) == 10
    for prompt in fillers(12):
        serve(again, prompt)
    out = serve(again, PREFIX + [5])[0]
    assert out.num_cached_tokens == 160
    assert out.cached_tokens_by_tier["DISK"] + out.cached_tokens_by_tier["GPU"] == 160
    again.close()


def test_marks_on_lru_mappings_move_spared_entries_to_the_newest_end() -> None:
    table = RetentionTable(10)
    table.retain([h(0)], 60.0)
    lru: OrderedDict[bytes, int] = OrderedDict((h(i), i) for i in range(3))
    assert table.spare_lru(lru, 5, "CPU") == h(1)
    assert list(lru) == [h(1), h(2), h(0)]
