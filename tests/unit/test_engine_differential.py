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

PAGEKV_DIFF_EXAMPLES=500 runs a longer hunt.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvnode.engine.engine import DuplicateRequestId, Engine
from kvnode.engine.sampling_params import SamplingParams
from tests.kv_invariants import check_all_free, check_lookup, check_manager, check_tier_chain

MODEL = "pagekv-tiny"
KV_BYTES_PER_TOKEN = 512  # pagekv-tiny in fp32: 2 layers x (K, V) x 2 KV heads x 16 dims x 4 B
STOP_CANDIDATES = (19, 27, 109, 113, 193, 228)  # tokens the tiny model often produces
REF_BLOCKS = 512
MAX_STEPS = 5000
EXAMPLES = int(os.environ.get("PAGEKV_DIFF_EXAMPLES", "20"))


@dataclass
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    wait_steps: int = 0  # engine steps between the previous arrival and this one
    abort_after: int | None = None  # steps after arrival (0: before its first step)
    salt: str | None = None  # cache_salt: must never share blocks with another salt
    # A next turn: the prompt is `prompt` + the output of request `follows` (its first
    # sample, once it finished) + `suffix`, as a chat client sends it.
    follows: str | None = None
    suffix: list[int] = field(default_factory=list)


@dataclass
class Reset:
    include_tiers: bool
    idle: bool = True  # wait until the engine is idle first; else it must refuse while busy


@dataclass
class Drain:
    pass


@dataclass
class Workload:
    block_size: int
    num_blocks: int  # the small pool of the engines under test
    chunked: bool
    budget: int
    max_num_seqs: int
    watermark: float
    ssd_dram_blocks: int  # DRAM slots in front of the SSD (0: SSD alone)
    tight_dram_blocks: int  # the "tight" engine: a few DRAM slots over a tiny SSD,
    tight_ssd_bytes: int  # so both drop blocks (orphans, SSD evictions, segment deletion)
    events: list
    probe: list[int]

    def __repr__(self) -> str:
        lines = [f"Workload(bs={self.block_size}, blocks={self.num_blocks}, "
                 f"chunked={self.chunked}, budget={self.budget}, seqs={self.max_num_seqs}, "
                 f"watermark={self.watermark}, "
                 f"ssd_dram_blocks={self.ssd_dram_blocks}, tight={self.tight_dram_blocks}"
                 f"/{self.tight_ssd_bytes >> 10}KiB, probe_len={len(self.probe)})"]
        for e in self.events:
            if isinstance(e, Req):
                p = e.params
                lines.append(
                    f"  {e.rid}: len={len(e.prompt)} head={e.prompt[:4]} wait={e.wait_steps} "
                    f"abort={e.abort_after} salt={e.salt} follows={e.follows} max_tokens={p.max_tokens} n={p.n} "
                    f"T={p.temperature} seed={p.seed} stop={p.stop_token_ids} "
                    f"ignore_eos={p.ignore_eos}")
            else:
                lines.append(f"  {e!r}")
        return "\n".join(lines)


@dataclass
class Result:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    cached: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    aborted: bool = False
    rejected: bool = False  # refused: a live sample of another request had this id


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


# -- driving an engine ---------------------------------------------------------------------
def guard_admissions(eng: Engine) -> None:
    """Check every admission the scheduler makes: hits stop before the last token, are the
    request's own blocks, and their split by tier adds up."""
    mgr = eng.kv_manager
    real = mgr.allocate_slots

    def allocate_slots(request, num_new_tokens, hit=None):
        if hit is not None:
            assert hit.num_tokens <= request.num_tokens - 1, request
            for i, b in enumerate(hit.blocks):
                assert b.block_hash == request.block_hashes[i]
            assert sum(hit.by_tier().values()) == hit.num_tokens, hit.by_tier()
        return real(request, num_new_tokens, hit)

    mgr.allocate_slots = allocate_slots


def check_step(eng: Engine) -> None:
    mgr = eng.kv_manager
    pins = [p.pinned for p in eng.tiers._loads.values()] if eng.tiers is not None else []
    check_manager(mgr, pins)
    bs = mgr.block_size
    for seq in eng.scheduler.waiting:
        check_lookup(mgr, seq.req)
    for seq in eng.scheduler.running:
        req = seq.req
        assert len(mgr.req_to_blocks[req.request_id]) * bs >= req.num_computed_tokens
    for group in eng.groups.values():
        assert group.num_cached_tokens <= len(group.prompt_token_ids) - 1
        assert sum(group.cached_tokens_by_tier.values()) == group.num_cached_tokens


def quiesce(eng: Engine) -> None:
    """Let the tier loader finish (and run the put-back callbacks of aborted loads)."""
    if eng.tiers is not None:
        eng.tiers._loader.submit(lambda: None).result(timeout=30)


def drive(eng: Engine, events: list, aborts: bool = True) -> dict[str, Result]:
    results: dict[str, Result] = {}
    countdown: dict[str, int | None] = {}
    finished: set[str] = set()

    def collect(d) -> None:
        r = results.setdefault(d.request_id, Result())
        for c in d.outputs:
            r.tokens.setdefault(c.index, []).extend(c.token_ids)
            r.finish[c.index] = c.finish_reason
        r.cached = d.num_cached_tokens
        r.by_tier = dict(d.cached_tokens_by_tier)
        if d.finished:
            finished.add(d.request_id)
            countdown.pop(d.request_id, None)

    def abort_due() -> None:
        for rid, left in list(countdown.items()):
            if left is not None and left <= 0:
                del countdown[rid]
                d = eng.abort(rid)
                if d is not None:
                    collect(d)
                    results[rid].aborted = True
                check_step(eng)

    def step() -> None:
        for d in eng.step():
            assert d.request_id not in finished, f"output after finish: {d.request_id}"
            collect(d)
        check_step(eng)
        for rid, left in countdown.items():
            if left is not None:
                countdown[rid] = left - 1
        abort_due()

    def drain() -> None:
        steps = 0
        while eng.has_unfinished():
            step()
            steps += 1
            assert steps < MAX_STEPS, "no progress"
        quiesce(eng)
        check_all_free(eng.kv_manager)

    for ev in events:
        if isinstance(ev, Req):
            prompt = ev.prompt
            if ev.follows is not None:
                drain()  # the previous turn's answer is part of this prompt
                prompt = ev.prompt + results[ev.follows].tokens.get(0, []) + ev.suffix
            for _ in range(ev.wait_steps):
                step()
            try:
                eng.add_request(ev.rid, prompt, ev.params, cache_salt=ev.salt)
            except DuplicateRequestId:
                assert ev.rid in eng._child_ids  # a live sample of another request has this id
                results[ev.rid] = Result(rejected=True)
                continue
            countdown[ev.rid] = ev.abort_after if aborts else None
            check_step(eng)
            abort_due()
        elif isinstance(ev, Reset):
            if ev.idle:
                drain()
            mgr = eng.kv_manager
            idle = mgr.get_num_free_blocks() == mgr.num_blocks
            before = eng.full_state()
            ok, _ = eng.reset_prefix_cache(include_tiers=ev.include_tiers)
            assert ok == idle  # refused while any block is in use, and then nothing changed
            if ok:
                assert not mgr.cached_hashes()
                if ev.include_tiers and ev.idle and eng.tiers is not None:
                    assert not eng.tiers.full_state()  # (drain() let aborted loads finish)
            else:
                assert eng.full_state() == before
            check_step(eng)
        else:
            drain()
    drain()
    return results


def make_engine(w: Workload, **kw) -> Engine:
    args = dict(model=MODEL, block_size=w.block_size, max_model_len=w.num_blocks * w.block_size,
                num_gpu_blocks=w.num_blocks, enable_chunked_prefill=w.chunked,
                max_num_batched_tokens=w.budget, max_num_seqs=w.max_num_seqs,
                watermark=w.watermark)
    args.update(kw)
    eng = Engine(**args)
    assert eng.runner.block_bytes == KV_BYTES_PER_TOKEN * w.block_size
    guard_admissions(eng)
    return eng


def check_end(eng: Engine) -> None:
    quiesce(eng)
    check_all_free(eng.kv_manager)
    if eng.tiers is not None:
        assert eng.tiers._loads == {} and eng.tiers._inflight == {}
        assert eng.tiers._loaded == {}
        if eng.tiers.chain.ssd is not None:
            assert eng.tiers.chain.ssd.flush(timeout=30)
        check_tier_chain(eng.tiers.chain)


def assert_same_tokens(ref: dict[str, Result], got: dict[str, Result], name: str) -> None:
    assert set(got) <= set(ref), (name, set(got) - set(ref))
    for rid, want in ref.items():
        r = got.get(rid)
        if r is None or r.rejected or want.rejected:  # aborted before any output, or refused
            continue
        if r.aborted:
            for idx, toks in r.tokens.items():
                assert toks == want.tokens[idx][: len(toks)], (name, rid, idx, toks, want.tokens)
        else:
            assert r.tokens == want.tokens, (name, rid, r.tokens, want.tokens)
            assert r.finish == want.finish, (name, rid, r.finish, want.finish)


def assert_metrics_match(eng: Engine, results: dict[str, Result]) -> None:
    """The pod's per-tier hit counters equal the sum of what the requests reported."""
    total = {"GPU": 0, "CPU": 0, "DISK": 0}
    for r in results.values():
        for tier, n in r.by_tier.items():
            total[tier] += n
        assert r.cached == sum(r.by_tier.values())
    assert eng.metrics.prefix_hits_tokens_by_tier == total


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
    from kvnode.memory.request import Request

    return Request("probe", prompt)


def _probe_params(w: Workload) -> SamplingParams:
    return next(e.params for e in w.events if isinstance(e, Req) and e.rid == "probe1")


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
