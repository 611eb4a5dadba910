"""Per-tenant quotas and the shared region: the tenants file's fields, the shared-prefix match,
the salt on the block after the region, the ledger, the pool and the tier chain enforcing a
quota on the owner's own blocks, and the whole through the engine (the tiny model)."""

from __future__ import annotations

import logging

import pytest
import torch

from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.memory.block_pool import BlockPool, KVCacheBlock
from pagekv.proto.hashing import DEFAULT_HASH_SEED, HashConfig, hash_prompt
from pagekv.proto.medium import Medium
from pagekv.proto.shared_prefix import SharedPrefixes
from pagekv.proto.tenant_ledger import NO_OWNER, SHARED_OWNER, TenantLedger
from pagekv.proto.tenant_salt import tenant_salt
from pagekv.proto.tenants import SharedRegion, TenantMap, TierQuota, hash_token
from pagekv.tiers.chain import TierChain
from pagekv.tiers.dram import DramTier
from tests.unit.engine_runs import run_request

BB = 8192  # the tiny model's block: 2 layers x K,V x 2 heads x 16 dims x 16 tokens x 4 B


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def tenants_map(**extra) -> TenantMap:
    data = {"tenants": {"acme": {"tokens": [hash_token("a")], "quota": {"pool": 4 * BB}},
                        "globex": {"tokens": [hash_token("b")]}}, **extra}
    return TenantMap.from_mapping(data)


# --- the tenants file ------------------------------------------------------------------------
def test_quotas_and_the_shared_region_are_read_from_the_tenants_file() -> None:
    m = tenants_map(shared={"prefixes": [{"text": "be brief"}, {"token_ids": [1, 2, 3]}],
                            "quota": {"dram": "1MiB", "ssd": 2_000_000}})
    assert m.quotas == {"acme": TierQuota(pool=4 * BB)}
    assert m.shared == SharedRegion(("be brief",), ((1, 2, 3),),
                                    TierQuota(dram=1 << 20, ssd=2_000_000))
    assert m.name_set == {"acme", "globex"} and m.names == ["acme", "globex"]
    assert m.digest != tenants_map().digest  # the join check compares quotas too


@pytest.mark.parametrize("bad, words", [
    ({"tenants": {"a": {"tokens": [hash_token("a")], "quota": {"gpu": 1}}}}, "quota must map"),
    ({"tenants": {"a": {"tokens": [hash_token("a")], "quota": {"pool": "lots"}}}},
     "not a size"),
    ({"tenants": {"a": {"tokens": [hash_token("a")], "quota": {"pool": -5}}}}, "not a size"),
    ({"tenants": {"a": {"tokens": [hash_token("a")]}}, "shared": {"quota": {}}},
     "'shared:' must hold"),
    ({"tenants": {"a": {"tokens": [hash_token("a")]}}, "shared": {"prefixes": [{"x": 1}]}},
     "shared prefix"),
    ({"tenants": {"a": {"tokens": [hash_token("a")]}}, "shared": {"prefixes": [
        {"token_ids": [1, -2]}]}}, "shared prefix"),
    ({"tenants": {"a": {"tokens": [hash_token("a")]}}, "extra": 1}, "expected a mapping"),
])
def test_a_bad_quota_or_shared_region_is_refused_in_words(bad: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        TenantMap.from_mapping(bad)


# --- the shared region's hashing -------------------------------------------------------------
def test_a_prompt_shares_its_leading_whole_blocks_within_a_prefix() -> None:
    system = list(range(1, 41))  # 2.5 blocks of 16: 2 shareable
    shared = SharedPrefixes([system, [900] * 64], 16)
    assert shared.blocks(system + [7] * 30) == 2
    assert shared.blocks(system[:20] + [7] * 30) == 1  # only its first block lies within
    assert shared.blocks([5] + system) == 0
    assert shared.blocks([900] * 100) == 4  # the longest match of all prefixes
    assert shared.blocks(system[:10]) == 0  # no full block


def test_the_salt_moves_to_the_block_after_the_shared_region() -> None:
    cfg = HashConfig("sha256", DEFAULT_HASH_SEED)
    ids = list(range(1, 81))  # 5 blocks
    a, b = tenant_salt("acme", None), tenant_salt("globex", None)
    plain = hash_prompt(cfg, 16, ids)
    at_a, at_b = hash_prompt(cfg, 16, ids, a, salt_block=2), hash_prompt(cfg, 16, ids, b,
                                                                          salt_block=2)
    assert at_a[:2] == at_b[:2] == plain[:2]  # shared: the same for every tenant
    assert at_a[2] != at_b[2] and not set(at_a[2:]) & set(at_b[2:])  # then each its own
    assert hash_prompt(cfg, 16, ids, a, salt_block=0) == hash_prompt(cfg, 16, ids, a)


# --- the ledger ------------------------------------------------------------------------------
def test_the_ledger_follows_owners_through_the_tiers_and_flags_who_is_over() -> None:
    ledger = TenantLedger({"acme": {Medium.GPU: 2, Medium.CPU: 1}})
    ledger.placed([h(1), h(2), h(3)], Medium.GPU, "acme")
    ledger.placed([h(9)], Medium.GPU, "globex")
    assert ledger.over(Medium.GPU) == ["acme"] and ledger.excess("acme", Medium.GPU) == 1
    ledger.touched([h(1)], Medium.GPU)  # a hit: h(2) is now the oldest
    assert ledger.victims("acme", Medium.GPU, 1, lambda _: True) == [h(2)]
    ledger.placed([h(2)], Medium.CPU)  # demoted: the owner is the one recorded
    ledger.gone([h(2)], Medium.GPU)
    assert ledger.over(Medium.GPU) == [] and ledger.owner_of(h(2)) == "acme"
    ledger.gone([h(2)], Medium.CPU)
    assert ledger.owner_of(h(2)) is None  # in no tier: forgotten
    ledger.placed([h(5)], Medium.DISK)  # found on the SSD at start-up: no known owner
    ledger.placed([h(5)], Medium.GPU, "acme")  # cached again by acme's request
    assert ledger.usage() == {("acme", Medium.GPU): 3, ("globex", Medium.GPU): 1,
                              ("acme", Medium.DISK): 1}
    ledger.cleared(Medium.GPU)
    assert ledger.usage() == {("acme", Medium.DISK): 1}


def test_victims_skip_what_the_tier_cannot_evict_and_take_retained_ones_last() -> None:
    ledger = TenantLedger({"acme": {Medium.GPU: 0}})
    ledger.placed([h(i) for i in range(6)], Medium.GPU, "acme")
    got = ledger.victims("acme", Medium.GPU, 3, usable=lambda x: x != h(1),
                         retained=lambda x: x == h(0))
    assert got == [h(2), h(3), h(4)]
    assert ledger.victims("acme", Medium.GPU, 6, lambda _: True,
                          lambda x: x == h(0))[-1] == h(0)


# --- the pool --------------------------------------------------------------------------------
def pool_with(ledger: TenantLedger, n: int = 32) -> tuple[BlockPool, list[bytes]]:
    evicted: list[bytes] = []
    pool = BlockPool(n, block_size=16, ledger=ledger,
                     on_evict_many=lambda blocks: evicted.extend(b.block_hash for b in blocks))
    return pool, evicted


def cache(pool: BlockPool, owner: str, base: int, n: int, shared: int = 0
          ) -> list[KVCacheBlock]:
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(blocks, [h(base + i) for i in range(n)], 0, n, owner=owner,
                           shared_blocks=shared)
    return blocks


def test_a_tenant_over_its_pool_quota_evicts_its_own_idle_blocks() -> None:
    ledger = TenantLedger({"acme": {Medium.GPU: 4}})
    pool, evicted = pool_with(ledger)
    globex = cache(pool, "globex", 100, 6)
    pool.free_blocks(reversed(globex))
    acme = cache(pool, "acme", 200, 10)  # all running: none can go yet
    assert not evicted and ledger.usage()[("acme", Medium.GPU)] == 10
    pool.free_blocks(reversed(acme))  # released (leaves first): trimmed back to the quota
    assert ledger.usage() == {("acme", Medium.GPU): 4, ("globex", Medium.GPU): 6}
    # The chain's end went, handed to the tiers as any eviction; its first blocks stay.
    assert evicted == [h(200 + i) for i in reversed(range(4, 10))]
    assert all(pool.get_cached_block(h(200 + i)) for i in range(4))
    assert all(pool.get_cached_block(h(100 + i)) for i in range(6))  # never another's
    assert ledger.evicted == {("acme", Medium.GPU): 6}
    # The evicted blocks are uncached and at the queue's head: the next allocation takes
    # them, not globex's cached ones.
    cache(pool, "acme", 300, 20)
    assert all(pool.get_cached_block(h(100 + i)) for i in range(6))


def test_the_shared_region_is_counted_apart() -> None:
    ledger = TenantLedger({"acme": {Medium.GPU: 2}, SHARED_OWNER: {Medium.GPU: 8}})
    pool, evicted = pool_with(ledger)
    pool.free_blocks(reversed(cache(pool, "acme", 0, 5, shared=3)))
    assert ledger.usage() == {(SHARED_OWNER, Medium.GPU): 3, ("acme", Medium.GPU): 2}
    assert not evicted
    pool.free_blocks(reversed(cache(pool, NO_OWNER, 50, 2)))  # no tenant: no quota
    assert ledger.usage()[(NO_OWNER, Medium.GPU)] == 2


# --- the tier chain --------------------------------------------------------------------------
def test_a_tenant_over_its_dram_quota_moves_its_own_blocks_down(make_tier) -> None:
    from tests.unit.ssd_fixtures import BB as SSD_BB

    ledger = TenantLedger({"acme": {Medium.CPU: 2, Medium.DISK: 3}})
    dram = DramTier(16 * SSD_BB, SSD_BB)
    ssd = make_tier()
    chain = TierChain(dram, ssd, block_size=16, ledger=ledger)
    row = torch.zeros(SSD_BB, dtype=torch.uint8)
    for i in range(4):  # globex: within no quota
        ledger.placed([h(100 + i)], Medium.GPU, "globex")
        chain.demote(h(100 + i), None, (), row)
        ledger.gone([h(100 + i)], Medium.GPU)
    for i in reversed(range(8)):  # a chain, evicted leaf first as the pool frees it
        ledger.placed([h(i)], Medium.GPU, "acme")
        chain.demote(h(i), h(i - 1) if i else None, (), row + i)
        ledger.gone([h(i)], Medium.GPU)
    ssd.flush()
    usage = ledger.usage()
    assert usage[("acme", Medium.CPU)] == 2 and usage[("acme", Medium.DISK)] == 3
    assert usage[("globex", Medium.CPU)] == 4  # DRAM had room: globex's stay
    assert [dram.contains(h(i)) for i in range(8)] == [True] * 2 + [False] * 6
    assert ledger.evicted[("acme", Medium.CPU)] == 6
    assert ledger.evicted[("acme", Medium.DISK)] == 3
    # The oldest (the chain's leaves) went first: what is left is still one prefix.
    assert chain.match_prefix([h(i) for i in range(8)]) == [Medium.CPU] * 2 + [Medium.DISK] * 3


# --- through the engine (the tiny model) -----------------------------------------------------
P = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SYSTEM = [(i * 13) % 200 + 1 for i in range(64)]  # 4 blocks


def serve(engine: Engine, prompt: list[int], tenant: str, salt: str | None):
    return run_request(engine, prompt, P, cache_salt=salt, tenant=tenant)


def test_through_the_engine_quotas_hold_and_the_shared_region_is_hit_by_all(caplog) -> None:
    tenants = tenants_map(shared={"prefixes": [{"token_ids": SYSTEM}]})
    salt_a, salt_b = tenant_salt("acme", None), tenant_salt("globex", None)
    cold_engine = Engine(model="pagekv-tiny", num_gpu_blocks=64, max_model_len=400)
    globex_prompt = [(i * 29) % 200 + 1 for i in range(96)]
    cold = serve(cold_engine, globex_prompt + [3], "", None)[1]
    # Without the quota the flood evicts globex's prefix from this 24-block pool.
    plain = Engine(model="pagekv-tiny", num_gpu_blocks=24, max_model_len=256,
                   tenants=TenantMap.from_mapping({"tenants": {"acme": {"tokens": [
                       hash_token("a")]}, "globex": {"tokens": [hash_token("b")]}}}))
    serve(plain, globex_prompt + [9], "globex", salt_b)
    for k in range(6):
        serve(plain, [(i * (17 + 2 * k)) % 200 + 1 for i in range(96)], "acme", salt_a)
    assert serve(plain, globex_prompt + [3], "globex", salt_b)[0].num_cached_tokens == 0
    engine = Engine(model="pagekv-tiny", num_gpu_blocks=24, max_model_len=256,
                    tenants=tenants)
    serve(engine, globex_prompt + [9], "globex", salt_b)
    with caplog.at_level(logging.INFO, logger="pagekv.proto.tenant_ledger"):
        for k in range(6):  # acme floods: ~36 blocks through a 4-block quota
            serve(engine, [(i * (17 + 2 * k)) % 200 + 1 for i in range(96)], "acme", salt_a)
    assert "acme is over its GPU quota" in caplog.text
    stats = engine.stats().tenancy
    assert stats is not None
    assert stats.held_blocks[("acme", Medium.GPU)] <= 4
    assert stats.quota_blocks[("acme", Medium.GPU)] == 4
    assert stats.evicted[("acme", Medium.GPU)] > 0 and ("globex", Medium.GPU) not in stats.evicted
    out, tokens = serve(engine, globex_prompt + [3], "globex", salt_b)
    assert out.num_cached_tokens == 96 and tokens == cold  # never another's
    # The shared region: acme computes it, globex hits it; what follows stays each its own.
    serve(engine, SYSTEM + [5] * 40, "acme", salt_a)
    hit = serve(engine, SYSTEM + [5] * 40, "globex", salt_b)[0]
    assert hit.num_cached_tokens == 64
    assert engine.stats().tenancy.held_blocks[(SHARED_OWNER, Medium.GPU)] == 4
