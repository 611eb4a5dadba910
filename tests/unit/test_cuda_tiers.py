"""The tiers and memory planning on a real CUDA device (skipped without one).

- the DRAM tier's slab is one pinned allocation, written and read through the copy stream;
- batched copies through a small staging tensor land every block where read_block says;
- a DRAM reload whose copy overlaps another request's forward passes produces the tokens of
  a cold engine on the same device (the stream ordering: a missing event would let a forward
  read a block before its copy, or reuse one under it);
- the start-up memory plan: a profile forward measured the activation peak, and the pool is
  gpu_memory_utilization x total - weights - peak - non-torch - staging.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (the CPU tests use a fake stream)")

PREFIX = [(i * 37) % 250 + 1 for i in range(200)]  # 12 full blocks of 16
TARGET = PREFIX + [7, 9]
FILLERS = [[(i * k) % 250 + 1 for i in range(180)] for k in (11, 13, 17)]
LONG = [(i * 29) % 250 + 1 for i in range(40)]


def params(n: int):
    from pagekv.kvnode.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def cuda_engine(**kw):
    from pagekv.kvnode.engine.engine import Engine

    return Engine(model="pagekv-tiny", max_model_len=400, device="cuda", **kw)


def run_all(eng, reqs) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for rid, prompt, n in reqs:
        eng.add_request(rid, prompt, params(n))
    while eng.has_unfinished():
        for d in eng.step():
            got.setdefault(d.request_id, []).extend(d.outputs[0].token_ids)
    return got


def test_dram_slab_is_one_pinned_allocation_behind_a_cuda_stream():
    from pagekv.tiers.copy_stream import CudaCopyStream

    eng = cuda_engine(num_gpu_blocks=26, cpu_offload_bytes=4 << 20)
    dram = eng.tiers.chain.dram
    assert dram.slab.is_pinned() and dram.pinned
    assert isinstance(dram.copy_stream, CudaCopyStream)
    assert eng.tiers._transfer.stream is dram.copy_stream
    assert dram.slab.shape == (dram.num_slots, eng.runner.block_bytes)
    eng.close()


@pytest.mark.parametrize("staging_rows", [3, 1000])
def test_batched_copies_through_the_staging_tensor_match_read_block(staging_rows):
    from pagekv.kvnode.engine.block_transfer import BlockTransfer
    from pagekv.kvnode.model.attention.kv_cache import KVCache, KVCacheSpec
    from pagekv.tiers.copy_stream import CudaCopyStream

    spec = KVCacheSpec(4, 16, 2, 64, torch.bfloat16)
    kv = KVCache.allocate(spec, 64, "cuda")
    for c in (*kv.key_caches, *kv.value_caches):
        c.copy_(torch.randn(c.shape, device="cuda"))
    t = BlockTransfer(kv, CudaCopyStream("cuda"), staging_bytes=staging_rows * spec.block_bytes)
    host = torch.zeros((40, spec.block_bytes), dtype=torch.uint8, pin_memory=True)
    ids, rows = list(range(0, 40, 2)), [39 - i for i in range(20)]
    want = torch.stack([kv.read_block(b) for b in ids])
    copy = t.to_host(ids, host, rows)
    kv.write_blocks(ids, torch.zeros((20, spec.block_bytes), dtype=torch.uint8))  # compute
    copy.done.synchronize()
    assert torch.equal(host[rows], want)
    back = t.from_host(list(range(1, 40, 2)), host, rows)
    torch.cuda.current_stream().wait_event(back.done)
    assert torch.equal(torch.stack([kv.read_block(b) for b in range(1, 40, 2)]), want)
    assert t.seconds(back) > 0


def overlap_run(**kw) -> tuple[dict[str, list[int]], dict | None]:
    """Warm-up requests (TARGET's prefix ends up below the pool when the pool is small),
    then `long` starts and `target` arrives while it decodes."""
    eng = cuda_engine(**kw)
    run_all(eng, [(f"w{i}", p, 1) for i, p in enumerate((TARGET, *FILLERS))])
    got: dict[str, list[int]] = {}
    eng.add_request("long", LONG, params(40))
    for step in range(10**4):
        if step == 1:
            eng.add_request("target", TARGET, params(8))
        for d in eng.step():
            got.setdefault(d.request_id, []).extend(d.outputs[0].token_ids)
        if not eng.has_unfinished():
            break
    stats = eng.tiers.chain.stats() if eng.tiers is not None else None
    eng.close()
    return got, stats


def test_a_reload_overlapping_another_forward_gives_the_pool_hit_tokens():
    # The reference keeps TARGET's prefix in a big pool: its suffix runs with the same shapes
    # (a 192-token hit), so its tokens are bit for bit those of a correct reload. (A cold
    # run would compute the suffix inside a longer prefill: other bf16 roundings.)
    ref, _ = overlap_run(num_gpu_blocks=256)
    got, st = overlap_run(num_gpu_blocks=26, cpu_offload_bytes=4 << 20)
    assert got["target"] == ref["target"]
    assert len(got["long"]) == 40
    assert st["promotions_dram"] == 12 and st["dram_to_pool_seconds"] > 0


def test_sequential_reloads_and_evictions_through_the_stream_restore_exact_kv():
    # One request at a time; DRAM holds everything the small pool evicts, so every request
    # hits exactly as many tokens as in a pool that never evicts: same shapes, same tokens.
    prompts = [[(i * k + j) % 250 + 1 for i in range(120 + 7 * k)] for k in range(1, 7)
               for j in range(2)]
    reqs = [(f"r{i}", p, 6) for i, p in enumerate(prompts * 3)]
    ref_eng = cuda_engine(num_gpu_blocks=512)
    eng = cuda_engine(num_gpu_blocks=40, cpu_offload_bytes=8 << 20)
    for rid, prompt, n in reqs:
        want = run_all(ref_eng, [(rid, prompt, n)])
        assert run_all(eng, [(rid, prompt, n)]) == want, rid
    assert eng.tiers.chain.stats()["promotions_dram"] > 0
    eng.tiers.sync_copies()
    assert eng.kv_manager.get_num_free_blocks() == 40
    eng.close()


def test_memory_plan_profiles_the_activation_peak(caplog):
    from pagekv.kvnode.model.memory_planning import cuda_kv_budget
    from pagekv.kvnode.model.runner import ModelRunner

    def runner(step: int):
        gc.collect()
        torch.cuda.empty_cache()
        return ModelRunner("pagekv-small", device="cuda", gpu_memory_utilization=0.3,
                           max_model_len=4096, max_num_batched_tokens=step)

    caplog.set_level(logging.INFO)
    r = runner(4096)
    plan = r.memory_plan
    prof = plan.profile
    assert prof is not None and prof.activation_peak > 0 and prof.weights >= r.weights_bytes
    assert plan.kv_cache_bytes <= cuda_kv_budget(prof, 0.3) < plan.kv_cache_bytes + r.block_bytes
    total = torch.cuda.get_device_properties(0).total_memory
    assert prof.total == total
    assert torch.cuda.memory_allocated() <= 0.3 * total
    lines = [rec.getMessage() for rec in caplog.records]
    assert any(line.startswith("Model loading took") for line in lines)
    assert f"KV cache size: {plan.num_tokens} tokens" in lines
    assert any(line.startswith("Maximum concurrency for 4096 tokens") for line in lines)
    assert any(line.startswith("Memory profiling:") for line in lines)
    big_peak, big_blocks = prof.activation_peak, plan.num_blocks
    del r, plan, prof
    # A smaller step needs less activation memory: the pool grows accordingly.
    small = runner(256)
    assert small.memory_plan.profile.activation_peak < big_peak
    assert small.memory_plan.num_blocks >= big_blocks
