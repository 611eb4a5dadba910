"""The engine's tiers with a copy stream (the CUDA path), run on CPU.

`make_copy_stream` is pointed at tests/unit/fake_copy_stream.py: its copies run only when an
event after them is waited for or has been queried `lag` times, so a forward pass that read
a reloaded block before its copy, or a pool block reused under a copy, would produce other
tokens than the reference: an engine without prefix caching (cold, nothing offloaded). The engines run
on CPU even where CUDA exists (tests/unit/test_cuda_tiers.py has the real stream).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings

import pagekv.kvnode.engine.block_transfer as block_transfer
from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams
from tests.kv_invariants import check_manager, check_tier_chain
from tests.unit.engine_diff_harness import (
    KV_BYTES_PER_TOKEN,
    assert_metrics_match,
    assert_same_tokens,
    check_end,
    drive,
    make_engine,
)
from tests.unit.fake_copy_stream import FakeCopyStream
from tests.unit.test_engine_differential_workloads import REF_BLOCKS, workloads

P = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PREFIX = [(i * 37) % 250 + 1 for i in range(200)]  # 12 full blocks of 16
TARGET = PREFIX + [7, 9]
FILLERS = [[(i * k) % 250 + 1 for i in range(180)] for k in (11, 13, 17)]
LONG = [(i * 29) % 250 + 1 for i in range(40)]
LONG_P = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


class Streams(list):
    lag = 3  # queries before a copy completes on its own


@pytest.fixture
def streams(monkeypatch) -> Streams:
    """Every engine built in the test copies through a FakeCopyStream (made in order)."""
    made = Streams()

    def make(runner):
        made.append(FakeCopyStream(lag=made.lag))
        return made[-1]

    monkeypatch.setattr(block_transfer, "make_copy_stream", make)
    return made


@pytest.fixture(scope="module")
def cold():
    llm = LLM("pagekv-tiny", num_gpu_blocks=256, max_model_len=512, enable_prefix_caching=False,
              device="cpu")
    return {"target": llm.generate([TARGET], P)[0].outputs[0].token_ids,
            "long": llm.generate([LONG], LONG_P)[0].outputs[0].token_ids}


def small_llm(**kw) -> LLM:
    return LLM("pagekv-tiny", num_gpu_blocks=26, max_model_len=400, device="cpu", **kw)


def test_dram_reload_through_the_stream_gives_the_cold_tokens(streams, cold):
    llm = small_llm(cpu_offload_bytes=4 << 20)
    eng = llm.engine
    dram = eng.tiers.chain.dram
    assert dram.copy_stream is streams[0] and eng.tiers._transfer.stream is streams[0]
    outs = [llm.generate([p], P)[0] for p in (TARGET, *FILLERS, TARGET)]
    last = outs[-1]
    assert last.outputs[0].token_ids == cold["target"]
    assert last.cached_tokens_by_tier == {"GPU": 0, "CPU": 192, "DISK": 0}
    st = eng.tiers.chain.stats()
    assert st["promotions_dram"] == 12 and dram.num_held == 0
    assert streams[0].compute_waits > 0  # evictions ordered the pool's reuse after gathers
    check_tier_chain(eng.tiers.chain)
    eng.close()


def test_a_reload_waits_for_its_copy_while_another_request_runs(streams, cold):
    eng = Engine(model="pagekv-tiny", num_gpu_blocks=26, max_model_len=400,
                 cpu_offload_bytes=4 << 20, device="cpu")
    stream = streams[0]
    got: dict[str, list[int]] = {}

    def step():
        for d in eng.step():
            got.setdefault(d.request_id, []).extend(d.outputs[0].token_ids)
        check_manager(eng.kv_manager, eng.tiers.pinned_sets())

    for i, p in enumerate((TARGET, *FILLERS)):  # TARGET's prefix ends up in DRAM
        eng.add_request(f"warm{i}", p, SamplingParams(max_tokens=1, temperature=0.0))
        while eng.has_unfinished():
            step()
    eng.add_request("long", LONG, LONG_P)
    step()  # long's prefill
    eng.add_request("target", TARGET, P)
    step()  # target's reload is submitted; target waits, long decodes
    copies = eng.tiers._copies
    assert len(copies) == 1 and "target" not in got
    under_copy = copies.pinned_sets()[0]
    assert len(under_copy) == 12 and all(b.ref_cnt == 1 for b in under_copy)
    free = {b.block_id for b in eng.kv_manager.block_pool.free_block_queue.get_all_free_blocks()}
    assert not free & {b.block_id for b in under_copy}  # pinned: never handed out
    waited = 0
    while "target" not in got:
        before = len(got.get("long", []))
        step()
        if "target" not in got:
            waited += 1
            assert len(got["long"]) == before + 1  # the other request ran meanwhile
        assert waited < 10
    assert waited >= 1 and stream.syncs == 0  # nobody blocked on the copy: it overlapped
    while eng.has_unfinished():
        step()
    assert got["target"] == cold["target"] and got["long"] == cold["long"]
    assert len(copies) == 0 and all(b.ref_cnt == 0 for b in under_copy)
    eng.close()


def test_a_lone_reload_waits_on_the_copy_instead_of_spinning(streams, cold):
    streams.lag = 10**6  # only a wait completes it
    llm = small_llm(cpu_offload_bytes=4 << 20)
    outs = [llm.generate([p], P)[0] for p in (TARGET, *FILLERS, TARGET)]
    assert outs[-1].outputs[0].token_ids == cold["target"]
    assert outs[-1].cached_tokens_by_tier["CPU"] == 192
    assert streams[0].syncs >= 1
    llm.engine.close()


def test_aborting_a_request_whose_copy_runs_keeps_its_blocks_pinned_until_done(streams):
    eng = Engine(model="pagekv-tiny", num_gpu_blocks=26, max_model_len=400,
                 cpu_offload_bytes=4 << 20, device="cpu")
    for i, p in enumerate((TARGET, *FILLERS)):
        eng.add_request(f"warm{i}", p, SamplingParams(max_tokens=1, temperature=0.0))
        while eng.has_unfinished():
            eng.step()
    eng.add_request("long", LONG, LONG_P)
    eng.add_request("target", TARGET, P)
    eng.step()
    assert len(eng.tiers._copies) == 1
    pinned = eng.tiers._copies.pinned_sets()[0]
    eng.abort("target")
    assert all(b.ref_cnt == 1 for b in pinned)  # the copy still writes them
    while eng.has_unfinished():
        eng.step()
    eng.tiers.sync_copies()
    assert all(b.ref_cnt == 0 for b in pinned)
    assert eng.kv_manager.get_num_free_blocks() == 26
    eng.close()


def test_ssd_reload_lands_through_the_stream(streams, cold, tmp_path):
    llm = small_llm(disk_offload_bytes=16 << 20, disk_offload_dir=str(tmp_path))
    outs = [llm.generate([p], P)[0] for p in (TARGET, *FILLERS, TARGET)]
    assert outs[-1].outputs[0].token_ids == cold["target"]
    assert outs[-1].cached_tokens_by_tier["DISK"] > 0
    assert streams[0].ran > 0  # the landing was a stream copy
    llm.engine.close()


# -- the differential workloads of test_engine_differential_workloads, with the stream ------------
@settings(max_examples=int(os.environ.get("PAGEKV_DIFF_EXAMPLES", "6")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@pytest.mark.workload
@given(w=workloads())
def test_offloaded_workloads_through_the_stream_match_a_cold_run(streams, w):
    ref_eng = make_engine(w, num_gpu_blocks=REF_BLOCKS, enable_prefix_caching=False,
                          device="cpu")
    ref = drive(ref_eng, w.events, aborts=False)
    block_bytes = KV_BYTES_PER_TOKEN * w.block_size
    full = (len(w.probe) - 1) // w.block_size * w.block_size
    tmp = tempfile.mkdtemp(prefix="pagekv-stream-")
    configs = {
        "dram": {"cpu_offload_bytes": w.num_blocks * block_bytes},
        "ssd": dict(cpu_offload_bytes=w.ssd_dram_blocks * block_bytes,
                    disk_offload_bytes=16 << 20, disk_offload_dir=os.path.join(tmp, "ssd")),
    }
    try:
        for name, kw in configs.items():
            eng = make_engine(w, device="cpu", **kw)
            try:
                got = drive(eng, w.events)
                assert_same_tokens(ref, got, name)
                check_end(eng)
                assert_metrics_match(eng, got)
                if name == "dram":
                    assert got["probe2"].by_tier == {"GPU": 0, "CPU": full, "DISK": 0}
            finally:
                eng.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
