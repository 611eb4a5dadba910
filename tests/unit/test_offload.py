"""Offload tiers wired into the engine: evicted blocks come back from DRAM and SSD."""

import random
from pathlib import Path

import pytest
import torch

from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.memory.request import Request
from pagekv.proto.kv_events import BlockRemoved, BlockStored

P = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PREFIX = [(i * 37) % 250 + 1 for i in range(200)]  # 12 full blocks of 16
TARGET = PREFIX + [7, 9]
FILLERS = [[(i * k) % 250 + 1 for i in range(180)] for k in (11, 13, 17)]


@pytest.fixture(scope="module")
def cold_tokens():
    llm = LLM("pagekv-tiny", num_gpu_blocks=256, max_model_len=512, enable_prefix_caching=False)
    return llm.generate([TARGET], P)[0].outputs[0].token_ids


def run(llm, prompts):
    return [llm.generate([p], P)[0] for p in prompts]


def small_llm(**kw):
    return LLM("pagekv-tiny", num_gpu_blocks=26, max_model_len=400, **kw)


def test_pool_hit_same_tokens(cold_tokens):
    llm = small_llm()
    out = run(llm, [TARGET, TARGET])[-1]
    assert out.cached_tokens_by_tier["GPU"] == 192
    assert out.outputs[0].token_ids == cold_tokens


@pytest.mark.parametrize("tier", ["CPU", "DISK"])
def test_evicted_prefix_reloads_from_tier_with_same_tokens(tmp_path, cold_tokens, tier):
    kw = ({"cpu_offload_bytes": 4 << 20} if tier == "CPU"
          else {"disk_offload_bytes": 16 << 20, "disk_offload_dir": str(tmp_path)})
    llm = small_llm(**kw)
    outs = run(llm, [TARGET, *FILLERS, TARGET])
    last = outs[-1]
    assert last.outputs[0].token_ids == cold_tokens
    assert last.cached_tokens_by_tier[tier] > 0
    assert last.num_cached_tokens == sum(last.cached_tokens_by_tier.values())
    assert llm.engine.metrics.prefix_hits_tokens_by_tier[tier] > 0
    llm.engine.close()


def test_eviction_events_carry_the_tier(tmp_path):
    llm = small_llm(cpu_offload_bytes=4 << 20)
    events = []
    llm.engine.event_sinks.append(events.extend)
    run(llm, [TARGET, *FILLERS])
    cpu_stored = {h for e in events if isinstance(e, BlockStored) and e.medium == "CPU"
                  for h in e.block_hashes}
    gpu_removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"
                   for h in e.block_hashes}
    assert cpu_stored and cpu_stored <= gpu_removed
    assert set(llm.engine.tiers.full_state()) == cpu_stored - {
        h for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"
        for h in e.block_hashes}


def test_overflow_lands_on_ssd_and_survives_restart(tmp_path, cold_tokens):
    kw = {"cpu_offload_bytes": 3 * 8192, "disk_offload_bytes": 16 << 20,
          "disk_offload_dir": str(tmp_path), "disk_offload_persist": False}
    llm = small_llm(**kw)
    run(llm, [TARGET, *FILLERS])
    state = llm.engine.tiers.full_state()
    on_disk = {h for h, m in state.items() if m == "DISK"}
    assert on_disk, state
    target_hashes = set(llm.engine.kv_manager._hashes(Request("x", TARGET)))
    assert target_hashes & on_disk
    llm.engine.close()  # flush the SSD writer, as a pod does on SIGTERM

    restarted = small_llm(**kw)
    assert {h for h, m in restarted.engine.tiers.full_state().items() if m == "DISK"} == on_disk
    out = restarted.generate([TARGET], P)[0]
    assert out.cached_tokens_by_tier["DISK"] > 0
    assert out.outputs[0].token_ids == cold_tokens
    restarted.engine.close()


@pytest.mark.parametrize("workload", ["pool_only", "pool_and_dram"])
def test_clean_shutdown_persists_pool_and_dram_for_a_restart(tmp_path, cold_tokens, workload):
    kw = {"cpu_offload_bytes": 3 * 8192, "disk_offload_bytes": 16 << 20,
          "disk_offload_dir": str(tmp_path)}
    llm = small_llm(**kw)
    # Either every TARGET block is still in the pool, or they are spread over pool/DRAM/SSD.
    run(llm, [TARGET] if workload == "pool_only" else [TARGET, *FILLERS])
    llm.engine.close()
    restarted = small_llm(**kw)
    out = restarted.generate([TARGET], P)[0]
    assert out.cached_tokens_by_tier == {"GPU": 0, "CPU": 0, "DISK": 192}  # 12 full blocks
    assert out.outputs[0].token_ids == cold_tokens
    restarted.engine.close()


def test_shutdown_without_persist_loses_what_the_pool_held(tmp_path):
    kw = {"disk_offload_bytes": 16 << 20, "disk_offload_dir": str(tmp_path),
          "disk_offload_persist": False}
    llm = small_llm(**kw)
    run(llm, [TARGET])
    llm.engine.close()
    restarted = small_llm(**kw)
    assert restarted.generate([TARGET], P)[0].num_cached_tokens == 0
    restarted.engine.close()


def test_corrupted_ssd_entry_is_a_miss_not_wrong_output(tmp_path, cold_tokens):
    kw = {"disk_offload_bytes": 16 << 20, "disk_offload_dir": str(tmp_path)}
    llm = small_llm(**kw)
    run(llm, [TARGET, *FILLERS])
    llm.engine.close()
    segments = [p for p in Path(tmp_path).rglob("*") if p.is_file() and p.stat().st_size > 4096]
    assert segments
    for seg in segments:  # flip bytes well inside the payloads
        data = bytearray(seg.read_bytes())
        for off in range(1024, len(data), 997):
            data[off] ^= 0xFF
        seg.write_bytes(bytes(data))
    restarted = small_llm(**kw)
    out = restarted.generate([TARGET], P)[0]
    assert out.outputs[0].token_ids == cold_tokens
    stats = restarted.engine.stats().chain
    raw = restarted.engine.tiers.chain.stats()
    assert stats.checksum_failures + raw.get("ssd_torn_entries", 0) > 0
    restarted.engine.close()


def test_abort_while_ssd_load_in_flight(tmp_path):
    llm = small_llm(disk_offload_bytes=16 << 20, disk_offload_dir=str(tmp_path))
    run(llm, [TARGET, *FILLERS])
    eng = llm.engine
    eng.add_request("t", TARGET, P)
    eng.step()  # the SSD load starts; the request waits
    eng.abort("t")
    assert not eng.has_unfinished()
    assert eng.kv_manager.get_num_free_blocks() == 26
    eng.close()


def test_an_admission_looks_the_pool_up_once(cold_tokens):
    """The scheduler's lookup is the admission's only one: a DRAM reload extends it in place
    (it used to be repeated by the manager and again by the tier connector)."""
    llm = small_llm(cpu_offload_bytes=4 << 20)
    run(llm, [TARGET, *FILLERS])  # TARGET's prefix now sits in DRAM
    mgr = llm.engine.kv_manager
    lookups = []
    real = mgr.lookup
    mgr.lookup = lambda req, **kw: (lookups.append(req.request_id), real(req, **kw))[1]
    out = run(llm, [TARGET])[0]
    assert out.outputs[0].token_ids == cold_tokens
    assert out.cached_tokens_by_tier["CPU"] > 0
    assert len(lookups) == 1
    llm.engine.close()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp16", "fp8"])
def test_batched_block_io_matches_single_block_io(kv_dtype):
    llm = LLM("pagekv-tiny", num_gpu_blocks=16, max_model_len=128, kv_cache_dtype=kv_dtype)
    llm.generate([list(range(1, 100))], P)
    runner = llm.engine.runner
    ids = [3, 0, 5]
    batch = runner.read_blocks(ids)
    assert torch.equal(batch, torch.stack([runner.read_block(i) for i in ids]))
    runner.write_blocks([10, 11, 12], batch)
    assert torch.equal(runner.read_blocks([10, 11, 12]), batch)


def test_unwritable_ssd_dir_disables_the_tier_and_keeps_serving(tmp_path, cold_tokens, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    llm = small_llm(disk_offload_bytes=16 << 20, disk_offload_dir=str(blocker / "ssd"))
    outs = run(llm, [TARGET, *FILLERS, TARGET])
    assert outs[-1].outputs[0].token_ids == cold_tokens
    assert llm.engine.tiers.chain.ssd.disabled
    assert any(r.levelname == "ERROR" for r in caplog.records)
    llm.engine.close()


def test_request_hashed_for_another_block_size_is_rehashed():
    from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager

    req = Request("r", list(range(1, 70)))
    KVCacheManager(16, block_size=16).get_computed_blocks(req)
    assert len(req.block_hashes) == 4
    KVCacheManager(16, block_size=32).get_computed_blocks(req)
    assert len(req.block_hashes) == 2


def test_demote_many_equals_one_by_one(tmp_path):
    from pagekv.tiers.chain import TierChain
    from pagekv.tiers.dram import DramTier
    from pagekv.tiers.ssd import SsdTier

    layout = {"num_layers": 1, "block_size": 16, "num_kv_heads": 1, "head_size": 64,
              "dtype": "uint8"}

    def chain(d):
        return TierChain(DramTier(4 * 1024, 1024),
                         SsdTier(tmp_path / d, 1 << 20, 1024, layout), block_size=16)

    rows = torch.randint(0, 255, (7, 1024), dtype=torch.uint8)
    hashes = [bytes([i]) * 32 for i in range(7)]
    parents = [None] + hashes[:-1]
    one, many = chain("one"), chain("many")
    for h, p, r in zip(hashes[:3], parents[:3], rows[:3], strict=True):
        one.demote(h, p, (), r)
    many.demote_many(hashes[:3], parents[:3], rows[:3])
    for h, p, r in zip(hashes, parents, rows, strict=True):  # 3 repeats + 4 new: 3 spill
        one.demote(h, p, (), r)
    many.demote_many(hashes, parents, rows)
    assert one.full_state() == many.full_state()
    assert {h: m for h, m in many.full_state().items()} == {
        **dict.fromkeys(hashes[:3], "DISK"), **dict.fromkeys(hashes[3:], "CPU")}
    for h, r in zip(hashes, rows, strict=True):
        assert torch.equal(many.promote(h), r)
    one.close()
    many.close()


def test_two_requests_for_one_ssd_prefix_share_a_single_load(tmp_path, cold_tokens):
    llm = small_llm(disk_offload_bytes=16 << 20, disk_offload_dir=str(tmp_path))
    run(llm, [TARGET, *FILLERS])  # TARGET's prefix now sits on SSD
    loads = []
    chain = llm.engine.tiers.chain
    real = chain.promote_many
    chain.promote_many = lambda hashes: (loads.append(len(hashes)), real(hashes))[1]
    outs = llm.generate([TARGET, TARGET], P)
    assert len(loads) == 1  # the second request waited for the first one's load
    assert [o.outputs[0].token_ids for o in outs] == [cold_tokens, cold_tokens]
    assert outs[0].cached_tokens_by_tier["DISK"] > 0
    assert outs[1].num_cached_tokens >= outs[0].num_cached_tokens  # no recompute
    eng = llm.engine
    assert eng.kv_manager.get_num_free_blocks() == 26  # pins released
    assert eng.tiers._inflight == {}
    eng.close()


def test_finished_ssd_load_releases_its_pins_behind_a_request_that_cannot_fit(tmp_path):
    # r holds 4 of 6 blocks; b's SSD load pins the other 2 (b's pool prefix). r then needs a
    # 5th block and is preempted to the head of the queue, where it no longer fits while the
    # pins are held. b's load used to be landed (and its pins released) only when the
    # scheduler reached b, which FCFS never did behind r: no step ran anything again.
    rng = random.Random(5)
    x = [rng.randint(1, 200) for _ in range(25)]  # 3 full blocks of 8 + 1 token
    r = [rng.randint(1, 200) for _ in range(25)]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=8, num_gpu_blocks=6, max_model_len=48, max_num_batched_tokens=48)
    cold = LLM("pagekv-tiny", enable_prefix_caching=False, **kw).generate([r, x], greedy)
    eng = LLM("pagekv-tiny", disk_offload_bytes=16 << 20, disk_offload_dir=str(tmp_path),
              **kw).engine
    got: dict[str, list[int]] = {"x": [], "r": [], "b": []}

    def step():
        for d in eng.step():
            got[d.request_id].extend(d.outputs[0].token_ids)

    eng.add_request("x", x, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        step()
    eng.add_request("r", r, greedy)  # evicts x's third block to SSD
    for _ in range(7):  # r's prefill and decodes until its 4 blocks are full
        step()
    eng.add_request("b", x, greedy)
    step()  # b's SSD load starts, pinning x's first two blocks: no block is free
    assert "b" in eng.tiers._loads and eng.kv_manager.get_num_free_blocks() == 0
    steps = 0
    while eng.has_unfinished():
        step()
        steps += 1
        assert steps < 200, "no progress"
    assert eng.kv_manager.get_num_free_blocks() == 6
    assert [got["r"], got["b"]] == [o.outputs[0].token_ids for o in cold]
    eng.close()


def test_reload_with_nothing_running_is_not_cut_by_the_watermark():
    # 9 of the prompt's blocks sit in DRAM; the pool has 10 and a 2-block watermark. With no
    # request running, the reserve used to cut the reload to 8 blocks (the 9th recomputed).
    bs, n = 8, 10
    rng = random.Random(1)
    prompt = [rng.randint(1, 200) for _ in range(9 * bs + 1)]
    flush = [rng.randint(201, 255) for _ in range(n * bs - 1)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm = LLM("pagekv-tiny", block_size=bs, num_gpu_blocks=n, max_model_len=n * bs,
              watermark=0.2, cpu_offload_bytes=n * llm_block_bytes(bs))
    cold = llm.generate([prompt], one)[0]
    llm.generate([flush], one)  # every pool block evicted to DRAM
    warm = llm.generate([prompt], one)[0]
    assert warm.cached_tokens_by_tier == {"GPU": 0, "CPU": 9 * bs, "DISK": 0}
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def llm_block_bytes(bs: int) -> int:
    return 512 * bs  # pagekv-tiny in fp32: 2 layers x (K, V) x 2 KV heads x 16 dims x 4 B
