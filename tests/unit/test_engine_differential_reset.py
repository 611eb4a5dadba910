"""The engine's prefix-cache reset, deterministic companion of the differential test
(test_engine_differential_workloads.py): between requests it forgets the pool's blocks,
keeps or clears the tiers as asked, and is refused while a request runs; every run gives the
tokens of a run with prefix caching off. Harness: engine_diff_harness.py.
"""

from __future__ import annotations

import random

from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.sampling_params import SamplingParams
from tests.unit.engine_diff_harness import (
    KV_BYTES_PER_TOKEN,
    Req,
    Result,
    Workload,
    check_end,
    drive,
    make_engine,
)


# -- deterministic companions ----------------------------------------------------------------
def _run_one(eng: Engine, rid: str, prompt: list[int], params: SamplingParams) -> Result:
    return drive(eng, [Req(rid, prompt, params)])[rid]


def test_reset_prefix_cache_between_requests():
    bs, n_blocks = 8, 8
    rng = random.Random(3)
    prompt = [rng.randint(1, 200) for _ in range(3 * bs + 5)]
    flush = [rng.randint(201, 255) for _ in range(n_blocks * bs - 1)]
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=11, n=2, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    w = Workload(bs, n_blocks, True, 2048, 64, 0.01, 0, 0, 0, [], prompt)
    ref = _run_one(make_engine(w, enable_prefix_caching=False), "p", prompt, params)
    eng = make_engine(w, cpu_offload_bytes=n_blocks * KV_BYTES_PER_TOKEN * bs)
    full = 3 * bs

    def run(rid: str) -> Result:
        r = _run_one(eng, rid, prompt, params)
        assert r.tokens == ref.tokens and r.finish == ref.finish
        return r

    assert run("cold").cached == 0
    assert run("pool").by_tier == {"GPU": full, "CPU": 0, "DISK": 0}
    ok, cleared = eng.reset_prefix_cache()
    assert ok and cleared >= 3  # the prompt's blocks (and full blocks of output)
    assert run("after-pool-reset").cached == 0  # the pool forgot; nothing had been demoted
    _run_one(eng, "flush", flush, one)  # the prompt's blocks go down to DRAM
    assert eng.reset_prefix_cache()[0]
    assert run("tiers-kept").by_tier == {"GPU": 0, "CPU": full, "DISK": 0}
    _run_one(eng, "flush2", flush, one)
    ok, cleared = eng.reset_prefix_cache(include_tiers=True)
    assert ok and cleared > 0 and not eng.full_state()
    assert run("all-cleared").cached == 0

    eng.add_request("busy", prompt, params)
    eng.step()
    state = eng.full_state()
    assert eng.reset_prefix_cache(include_tiers=True) == (False, 0)  # refused while running
    assert eng.full_state() == state
    while eng.has_unfinished():
        eng.step()
    check_end(eng)
    eng.close()
