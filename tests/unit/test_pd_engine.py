"""Prefill/decode disaggregation in the engine: a prefill's held blocks, a decode pod's
phase-aware scheduling, and a handover between two engines giving a cold run's tokens.

The transport between the engines is a direct call into the prefill engine's exporter (as
tests/unit/test_peer_pull.py does); the pods' gRPC and TCP paths are the integration tests'.
"""

from __future__ import annotations

import time

import pytest

from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.handover_holds import (
    CLOSED,
    EVICTED,
    EXPIRED,
    SERVED,
    HandoverHolds,
)
from pagekv.kvnode.engine.peer_pull import FALLBACK_REASONS, PEER_UNAVAILABLE, KvSource, PullFailed
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager
from pagekv.kvnode.memory.request import Request
from pagekv.proto.medium import PEER_SHARE
from pagekv.router.disaggregation import PULL_FALLBACKS

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [(i * 37) % 250 + 1 for i in range(200)]


def engine(**kw) -> Engine:
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("max_model_len", 512)
    return Engine(model="pagekv-tiny", block_size=16, **kw)


def completions(eng: Engine, prompt, params, source=None) -> tuple[dict[int, list[int]], object]:
    """Every completion's tokens, by index, and the last delta."""
    eng.add_request("r", prompt, params, kv_source=source)
    tokens: dict[int, list[int]] = {}
    last = None
    deadline = time.monotonic() + 30
    while eng.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not finish"
        for out in eng.step():
            for c in out.outputs:
                tokens.setdefault(c.index, []).extend(c.token_ids)
            last = out
    return tokens, last


def run(eng: Engine, prompt, params=GREEDY, rid="r", source=None, hold_s=0.0):
    eng.add_request(rid, prompt, params, kv_source=source, hold_s=hold_s)
    tokens, last = [], None
    deadline = time.monotonic() + 30
    while eng.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not finish"
        for out in eng.step():
            tokens += out.outputs[0].token_ids
            last = out
    return tokens, last


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cached_blocks(mgr: KVCacheManager, n: int, rid: str):
    """`n` full blocks of a finished request: cached, referenced by nobody."""
    seed = sum(map(ord, rid))
    req = Request(rid, [(i * 3 + seed) % 250 for i in range(n * 16)])
    hit = mgr.lookup(req)
    assert hit.num_tokens == 0
    assert mgr.allocate_slots(req, req.num_tokens, hit) is not None
    blocks = list(mgr.get_blocks(rid))
    mgr.free(req)
    return blocks


def test_a_hold_pins_until_served_or_expired_and_never_past_half_the_pool():
    mgr = KVCacheManager(16, 16)
    clock = Clock()
    holds = HandoverHolds(mgr, clock)
    a, b = cached_blocks(mgr, 4, "a"), cached_blocks(mgr, 4, "b")
    holds.hold("a", a, 5.0)
    holds.hold("b", b, 1.0)
    assert all(blk.ref_cnt == 1 for blk in a + b)  # pinned: making room cannot evict them
    assert mgr.get_num_free_blocks() == 8
    clock.now = 1.5
    assert holds.expire() == 1 and "b" not in holds and "a" in holds
    assert all(blk.ref_cnt == 0 and blk.block_hash is not None for blk in b)  # still cached
    assert holds.release("a") and not holds.release("a")
    assert mgr.get_num_free_blocks() == 16
    # Half the pool at most: a third hold of 4 beside two makes the oldest give way.
    c, d, e = (cached_blocks(mgr, 4, x) for x in ("c", "d", "e"))
    holds.hold("c", c, 9)
    holds.hold("d", d, 9)
    holds.hold("e", e, 9)
    assert "c" not in holds and holds.stats().held_blocks == 8
    holds.close()
    holds.hold("huge", cached_blocks(mgr, 9, "huge"), 9)  # more than half: not held
    assert "huge" not in holds
    st = holds.stats()
    assert st.held_blocks == 0 and st.holds == 0
    assert st.ended == {SERVED: 1, EXPIRED: 1, EVICTED: 1, CLOSED: 2}
    assert mgr.get_num_free_blocks() == 16


def test_a_lent_hold_outlives_its_deadline_and_its_release_until_given_back():
    mgr = KVCacheManager(16, 16)
    clock = Clock()
    holds = HandoverHolds(mgr, clock)
    a = cached_blocks(mgr, 4, "a")
    holds.hold("a", a, 1.0)
    hashes = [b.block_hash for b in a]
    assert holds.lend("a", hashes[1:3]) == a[1:3]  # a run of the hold, in place
    assert holds.lend("a", hashes[::-1]) is None and holds.lend("b", hashes) is None
    clock.now = 5.0
    assert holds.expire() == 0 and "a" in holds  # being read: not past its deadline yet
    holds.hold("c", cached_blocks(mgr, 5, "c"), 9)  # room for it only by evicting "a": no
    assert "a" in holds and "c" not in holds
    assert holds.release("a") and "a" in holds  # served, still read: ends once given back
    holds.give_back("a")
    assert holds.expire() == 1 and "a" not in holds
    assert holds.stats().ended[SERVED] == 1 and mgr.get_num_free_blocks() == 16


def test_a_finished_prefill_holds_its_full_prompt_blocks_an_aborted_one_none():
    eng = engine()
    run(eng, PROMPT, SamplingParams(max_tokens=1, temperature=0.0), rid="pd-1", hold_s=30.0)
    assert eng.stats().handover.held_blocks == len(PROMPT) // 16
    assert eng.kv_manager.get_num_free_blocks() == 64 - len(PROMPT) // 16
    assert eng.release_handover("pd-1") and eng.stats().handover.held_blocks == 0
    eng.add_request("pd-2", PROMPT[:100], GREEDY, hold_s=30.0)
    eng.step()
    eng.abort("pd-2")
    assert eng.stats().handover.held_blocks == 0
    assert eng.kv_manager.get_num_free_blocks() == 64


def test_an_unpulled_hold_expires_on_the_idle_tick():
    eng = engine()
    run(eng, PROMPT, SamplingParams(max_tokens=1, temperature=0.0), rid="pd", hold_s=0.2)
    assert eng.stats().handover.held_blocks > 0
    deadline = time.monotonic() + 5
    while eng.stats().handover.held_blocks:
        assert time.monotonic() < deadline, "the hold never expired"
        eng.idle_tick()
        time.sleep(0.02)
    assert eng.stats().handover.ended[EXPIRED] == 1


def exporter_fetch(src: Engine, released: list[str]):
    """The prefill engine's blocks as the transfer service serves them: from the hold the
    handover names, then the hold ends (KvTransferService._run, _served)."""
    def fetch(source, ask, handle, sink):
        run_ = src.lend_handover(ask.handover_id, ask.hashes, ask.parent)
        assert run_ is not None, "the hold was not there to serve from"
        try:
            for entry in src.exporter.read_entries(run_, 0, len(run_.hashes)):
                sink.take_entry(entry)
        finally:
            src.return_handover(ask.handover_id)
        released.append(ask.handover_id)
        src.release_handover(ask.handover_id)
    return fetch


@pytest.mark.parametrize("params", [
    GREEDY,
    SamplingParams(max_tokens=8, temperature=0.9, seed=7, n=3, ignore_eos=True),
], ids=["greedy", "n3-seeded"])
def test_a_handover_gives_the_cold_tokens_and_reports_its_wait(params):
    ref_tokens = completions(engine(enable_prefix_caching=False), PROMPT, params)[0]
    prefill, decode = engine(), engine(role="decode")
    released: list[str] = []
    decode.enable_peer_pull(exporter_fetch(prefill, released))
    run(prefill, PROMPT, SamplingParams(max_tokens=1, temperature=0.0), rid="pd-x", hold_s=30)
    source = KvSource("prefill", "127.0.0.1:1", len(PROMPT) // 16, handover_id="pd-x")
    tokens, last = completions(decode, PROMPT, params, source)
    assert tokens == ref_tokens and len(tokens) == params.n
    assert last.cached_tokens_by_tier[PEER_SHARE] == (len(PROMPT) - 1) // 16 * 16
    assert last.kv_pull_s > 0 and last.kv_pull_fallback == ""
    prefill.idle_tick()  # the hold ends on the prefill engine's thread
    assert released == ["pd-x"] and prefill.stats().handover.held_blocks == 0


def test_a_failed_handover_recomputes_and_says_why():
    cold = engine(enable_prefix_caching=False)
    ref = run(cold, PROMPT)[0]
    decode = engine(role="decode")

    def gone(source, ask, handle, sink):
        raise PullFailed(PEER_UNAVAILABLE, "the prefill pod is gone")
    decode.enable_peer_pull(gone)
    source = KvSource("prefill", "127.0.0.1:1", len(PROMPT) // 16, handover_id="pd-y")
    tokens, last = run(decode, PROMPT, source=source)
    assert tokens == ref
    assert last.kv_pull_fallback == PEER_UNAVAILABLE and last.num_cached_tokens == 0
    assert decode.kv_manager.get_num_free_blocks() == decode.kv_manager.num_blocks


def test_a_decode_pod_caps_each_steps_prefill_at_its_budget():
    eng = engine(role="decode", num_gpu_blocks=128)
    eng.scheduler.prefill_budget = 32  # as Engine.step sets it from its measured budget
    short = [5] * 20
    eng.add_request("chat", short, SamplingParams(max_tokens=40, temperature=0.0,
                                                  ignore_eos=True))
    eng.scheduler.prefill_budget = 32
    out = eng.scheduler.schedule()
    assert [n for _, n in out.scheduled] == [20]  # a short prompt under the cap: whole
    seq = out.scheduled[0][0]
    seq.req.num_computed_tokens += 20
    seq.req.append_output_token_ids(1)
    eng.add_request("doc", PROMPT, GREEDY)
    for _ in range(3):
        out = eng.scheduler.schedule()
        sizes = {s.req.request_id: n for s, n in out.scheduled}
        assert sizes["chat"] == 1 and sizes["doc"] <= 32  # the decode runs, the prefill waits
        for s, n in out.scheduled:
            s.req.num_computed_tokens += n
            if s.req.num_computed_tokens == s.req.num_tokens:
                s.req.append_output_token_ids(1)


def test_a_decode_pod_admits_only_what_fits_with_its_output():
    # 16 blocks of 16: a running request reserving 10 blocks for its output leaves too
    # little for a second one that needs 9 (a mixed pod would admit it and preempt later).
    eng = engine(role="decode", num_gpu_blocks=16, watermark=0.0, max_model_len=256)
    long_out = SamplingParams(max_tokens=140, temperature=0.0, ignore_eos=True)
    eng.add_request("a", [3] * 20, long_out)
    eng.add_request("b", [4] * 20, long_out)
    out = eng.scheduler.schedule()
    assert [s.req.request_id for s, _ in out.scheduled] == ["a"]
    mixed = engine(num_gpu_blocks=16, watermark=0.0, max_model_len=256)
    mixed.add_request("a", [3] * 20, long_out)
    mixed.add_request("b", [4] * 20, long_out)
    assert len(mixed.scheduler.schedule().scheduled) == 2


def test_the_prefill_budget_is_measured_and_published():
    eng = engine(role="decode", num_gpu_blocks=128)
    assert eng.load().prefill_budget == 0  # nothing timed yet
    run(eng, PROMPT * 2, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    budget = eng.load().prefill_budget
    assert 16 <= budget <= eng.args.max_num_batched_tokens
    assert eng.load().as_fields()["prefill_budget"] == budget


def test_the_router_knows_every_pull_fallback_reason():
    assert set(PULL_FALLBACKS) == set(FALLBACK_REASONS)


def test_the_prefill_backlog_is_published_and_clears_when_idle():
    eng = engine(max_num_batched_tokens=64)
    eng.add_request("doc", PROMPT, GREEDY)
    eng.step()  # the first 64-token chunk is scheduled: all 200 were still to compute
    assert eng.load().prefill_backlog == len(PROMPT)
    eng.step()
    assert eng.load().prefill_backlog == len(PROMPT) - 64
    while eng.has_unfinished():
        eng.step()
    eng.idle_tick()
    assert eng.load().prefill_backlog == 0 and eng.load().as_fields()["prefill_backlog"] == 0


def test_a_waiting_prompt_is_admitted_beside_a_long_prefill_under_the_cap():
    eng = engine(role="decode", num_gpu_blocks=128)
    eng.scheduler.prefill_budget = 32
    eng.add_request("doc", PROMPT, GREEDY)
    out = eng.scheduler.schedule()
    assert [n for _, n in out.scheduled] == [32]  # alone: the whole cap
    out.scheduled[0][0].req.num_computed_tokens += 32
    eng.add_request("chat", [7] * 12, GREEDY)
    sizes = {s.req.request_id: n for s, n in eng.scheduler.schedule().scheduled}
    assert sizes == {"doc": 16, "chat": 12}  # the running prefill left half to the chat
