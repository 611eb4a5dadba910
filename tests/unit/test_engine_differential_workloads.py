"""Differential, property-based end-to-end test of the engine's cache paths.

A random workload (shared prefixes of random lengths, including exact block multiples and
prefixes shorter than one block; random suffixes; repeated prompts; conversation turns whose
prompt holds the previous answer; max_tokens 1..20; n in 1..3, greedy or seeded; stop tokens;
cache salts; aborts after k steps; arrivals spread over steps; prefix-cache resets between
requests, and refused ones while busy; client ids shaped like the engine's sample ids) runs
through

- a reference engine: prefix caching off, a pool big enough for everything;
- engines with prefix caching on and a small pool (eviction, preemption): without tiers,
  with a DRAM tier, with an SSD tier (behind a 2-slot DRAM, or alone), and with a few DRAM
  slots over a tiny SSD (drops, SSD evictions); chunked prefill on or off, with budgets down
  to 3 tokens; block size 8 or 16; watermark; batches of one sequence or more.

Every request must produce the reference's tokens (an aborted one: a prefix of them). Every
admission keeps its hits below the last token; after every step the manager's invariants
hold (tests/kv_invariants.py); at the end every pool block is free, the tiers' books agree and
the per-tier hit metrics equal the sum of the requests' counts. Each workload ends with a
probe that cannot pass vacuously: a prompt P, a flush prompt that needs the whole pool (so
every cached block is evicted), P again — which must be served entirely from the tiers, from
SSD where the DRAM is too small to hold it — and another flush. The SSD engine is then
restarted on its directory and serves P again from disk.

PAGEKV_DIFF_EXAMPLES=500 runs a longer hunt. The harness (events, driving an engine, the
checks) is in engine_diff_harness.py; test_engine_differential_reset.py is the deterministic
companion.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagekv.kvnode.engine.sampling_params import SamplingParams
from tests.unit.engine_diff_harness import (
    KV_BYTES_PER_TOKEN,
    Drain,
    Req,
    Reset,
    Workload,
    assert_metrics_match,
    assert_same_tokens,
    check_end,
    drive,
    make_engine,
)

pytestmark = pytest.mark.workload

STOP_CANDIDATES = (19, 27, 109, 113, 193, 228)  # tokens the tiny model often produces
REF_BLOCKS = 512
EXAMPLES = int(os.environ.get("PAGEKV_DIFF_EXAMPLES", "20"))


def blocks_needed(n_tokens: int, bs: int) -> int:
    return -(-n_tokens // bs)


@st.composite
def workloads(draw) -> Workload:
    bs = draw(st.sampled_from((8, 16)))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))

    def toks(n: int, lo: int = 1, hi: int = 200) -> list[int]:
        return [rng.randint(lo, hi) for _ in range(n)]

    prefixes = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("short", "exact", "ragged")))
        if kind == "short":
            n = draw(st.integers(1, bs - 1))
        elif kind == "exact":
            n = bs * draw(st.integers(1, 4))
        else:
            n = bs * draw(st.integers(1, 3)) + draw(st.integers(1, bs - 1))
        prefixes.append(toks(n))

    events: list = []
    need = 0
    prompts: list[list[int]] = []
    for i in range(draw(st.integers(2, 14))):
        if i and draw(st.integers(0, 9)) == 0:
            events.append(Reset(draw(st.booleans()), draw(st.booleans())))
        turns = [e for e in events if isinstance(e, Req) and e.abort_after is None
                 and "#" not in e.rid and e.follows is None]  # finishes everywhere
        follows, suffix, extra = None, [], 0
        salt = draw(st.sampled_from((None, None, None, "s")))
        if turns and draw(st.integers(0, 4)) == 0:  # the next turn of a conversation
            prev = draw(st.sampled_from(turns))
            follows, salt, prompt = prev.rid, prev.salt, list(prev.prompt)
            suffix = toks(draw(st.integers(1, bs)))
            extra = prev.params.max_tokens + len(suffix)
        elif prompts and draw(st.integers(0, 4)) == 0:  # the same prompt again: all cached
            prompt = list(draw(st.sampled_from(prompts)))
        else:
            which = draw(st.integers(-1, len(prefixes) - 1))
            prefix = prefixes[which] if which >= 0 else []
            prompt = prefix + toks(draw(st.integers(0 if prefix else 1, 2 * bs)))
        prompts.append(prompt)
        greedy = draw(st.booleans())
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 20)),
            temperature=0.0 if greedy else 0.8,
            top_k=0 if greedy else draw(st.sampled_from((0, 20))),
            top_p=1.0 if greedy else draw(st.sampled_from((1.0, 0.9))),
            seed=None if greedy else draw(st.integers(0, 10_000)),
            n=draw(st.sampled_from((1, 1, 2, 3))),
            stop_token_ids=draw(st.lists(st.sampled_from(STOP_CANDIDATES), max_size=2)),
            ignore_eos=draw(st.booleans()),
        )
        abort = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 6)))
        # Sometimes an id shaped like the engine's name for a sample of an earlier request.
        rid = f"r{i}"
        if i and draw(st.integers(0, 5)) == 0:
            rid = f"r{draw(st.integers(0, i - 1))}#{draw(st.integers(1, 2))}"
            if any(isinstance(e, Req) and e.rid == rid for e in events):
                rid = f"r{i}"
        events.append(Req(rid, prompt, params, draw(st.integers(0, 4)), abort, salt, follows,
                          suffix))
        need = max(need, blocks_needed(len(prompt) + extra + params.max_tokens, bs))

    # The probe: long enough for three full blocks, so a 2-slot DRAM cannot hold all of it.
    probe = prefixes[0] + toks(max(1, 3 * bs + 1 - len(prefixes[0])) + draw(st.integers(0, bs)))
    probe_params = SamplingParams(max_tokens=6, temperature=0.8, seed=draw(st.integers(0, 99)),
                                  n=2, ignore_eos=True)
    need = max(need, blocks_needed(len(probe) + probe_params.max_tokens, bs))
    num_blocks = need + draw(st.integers(0, 8))
    max_len = num_blocks * bs

    def flush(rid: str) -> Req:  # needs every pool block: evicts everything cached
        return Req(rid, toks(max_len - 1, 201, 255),
                   SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))

    events += [Drain(), Req("probe1", probe, probe_params), Drain(), flush("flush1"), Drain(),
               Req("probe2", probe, probe_params), Drain(), flush("flush2"), Drain()]
    chunked = draw(st.booleans())
    if chunked:
        budget = draw(st.sampled_from((3, bs // 2 + 1, bs, 2 * bs + 3, 4 * bs, 2048)))
    else:
        budget = draw(st.sampled_from((max_len, 2048)))
    return Workload(bs, num_blocks, chunked, budget, draw(st.sampled_from((1, 2, 3, 64))),
                    draw(st.sampled_from((0.0, 0.01, 0.2))),
                    draw(st.sampled_from((0, 2))), draw(st.integers(0, 3)),
                    draw(st.sampled_from((48 << 10, 96 << 10))), events, probe)

# -- the property ----------------------------------------------------------------------------
@settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(w=workloads())
def test_cached_and_offloaded_paths_match_a_cold_run(w: Workload) -> None:
    bs = w.block_size
    full = (len(w.probe) - 1) // bs * bs  # every probe block but the one with the last token

    ref_eng = make_engine(w, num_gpu_blocks=REF_BLOCKS, enable_prefix_caching=False)
    ref = drive(ref_eng, w.events, aborts=False)
    check_end(ref_eng)
    assert ref["probe2"].cached == 0

    block_bytes = KV_BYTES_PER_TOKEN * bs
    tmp = tempfile.mkdtemp(prefix="pagekv-diff-")
    ssd_kw = dict(cpu_offload_bytes=w.ssd_dram_blocks * block_bytes,
                  disk_offload_bytes=16 << 20, disk_offload_dir=os.path.join(tmp, "ssd"))
    configs = {
        "pool": {},
        "dram": {"cpu_offload_bytes": w.num_blocks * block_bytes},
        "ssd": ssd_kw,
        "tight": dict(cpu_offload_bytes=w.tight_dram_blocks * block_bytes,
                      disk_offload_bytes=w.tight_ssd_bytes,
                      disk_offload_dir=os.path.join(tmp, "tight")),
    }
    try:
        for name, kw in configs.items():
            eng = make_engine(w, **kw)
            try:
                got = drive(eng, w.events)
                assert_same_tokens(ref, got, name)
                check_end(eng)
                assert_metrics_match(eng, got)
                p2 = got["probe2"].by_tier
                if name == "pool":  # the flush evicted every block of the probe
                    assert got["probe2"].cached == 0
                elif name == "dram":
                    assert p2 == {"GPU": 0, "CPU": full, "DISK": 0}, p2
                elif name == "tight":  # what the tiers dropped is recomputed
                    assert p2["GPU"] == 0 and got["probe2"].cached <= full, p2
                else:
                    assert p2["GPU"] == 0 and p2["CPU"] + p2["DISK"] == full, p2
                    assert p2["DISK"] >= full - w.ssd_dram_blocks * bs > 0, p2
                    on_disk = {h for h, m in eng.full_state().items() if m == "DISK"}
            finally:
                eng.close()

        # Warm restart over the same SSD directory: what was on disk is served from it.
        eng = make_engine(w, **ssd_kw)
        try:
            hashes = eng.kv_manager._hashes(_request(w.probe))[: full // bs]
            lead = 0
            while lead < len(hashes) and hashes[lead] in on_disk:
                lead += 1
            got = drive(eng, [Req("probe1", w.probe, _probe_params(w))])
            assert_same_tokens({"probe1": ref["probe1"]}, got, "restart")
            assert got["probe1"].by_tier["DISK"] >= lead * bs, (got["probe1"].by_tier, lead)
            # A clean close wrote what the pool and DRAM held down to the SSD as well
            # (disk_offload_persist), so the whole probe comes back from disk.
            assert got["probe1"].by_tier["DISK"] == full, got["probe1"].by_tier
            check_end(eng)
        finally:
            eng.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _request(prompt: list[int]):
    from pagekv.kvnode.memory.request import Request

    return Request("probe", prompt)


def _probe_params(w: Workload) -> SamplingParams:
    return next(e.params for e in w.events if isinstance(e, Req) and e.rid == "probe1")
