"""Shared by the engine's differential tests (tests/unit/test_engine_differential_*.py): the
events of a workload (Req, Reset, Drain) and the Workload itself, driving an engine through
them while checking every admission and step (tests/kv_invariants.py), and the checks at the
end (every pool block free, the tiers' books, the same tokens as the reference, per-tier hit
metrics equal to the requests' counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagekv.kvnode.engine.engine import DuplicateRequestId, Engine
from pagekv.kvnode.engine.sampling_params import SamplingParams
from tests.kv_invariants import check_all_free, check_lookup, check_manager, check_tier_chain

MODEL = "pagekv-tiny"
KV_BYTES_PER_TOKEN = 512  # pagekv-tiny in fp32: 2 layers x (K, V) x 2 KV heads x 16 dims x 4 B
MAX_STEPS = 5000


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
    pins = eng.tiers.pinned_sets() if eng.tiers is not None else []
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
    """Let the tier loader finish (and run the put-back callbacks of aborted loads), and the
    copies into the pool (a copy stream's)."""
    if eng.tiers is not None:
        eng.tiers._loader.submit(lambda: None).result(timeout=30)
        eng.tiers.sync_copies()


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

