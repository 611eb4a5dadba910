"""Engine behaviour: batching-independent outputs, preemption, parallel sampling, abort, soak."""

import random

import pytest

from pagekv.kvnode.engine.engine import DuplicateRequestId, Engine, RequestRejected
from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(k, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(rng.randint(3, 90))] for _ in range(k)]


@pytest.fixture(scope="module")
def alone_outputs():
    llm = LLM("pagekv-tiny", num_gpu_blocks=256, max_model_len=256)
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts(32)]


@pytest.mark.parametrize("chunked", [True, False])
def test_outputs_independent_of_batching(alone_outputs, chunked):
    llm = LLM(
        "pagekv-tiny", num_gpu_blocks=256, max_model_len=256, enable_chunked_prefill=chunked,
        max_num_batched_tokens=64 if chunked else 256, enable_prefix_caching=False,
    )
    outs = llm.generate(prompts(32), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone_outputs


def test_outputs_identical_under_preemption(alone_outputs):
    llm = LLM("pagekv-tiny", num_gpu_blocks=24, block_size=16, max_model_len=256, watermark=0.0)
    outs = llm.generate(prompts(32), GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone_outputs
    assert llm.engine.kv_manager.get_num_free_blocks() == 24


def test_parallel_sampling_shares_prompt_blocks_and_copies_partial_block():
    eng = Engine(model="pagekv-tiny", num_gpu_blocks=64, max_model_len=256)
    prompt = list(range(1, 41))  # 2 full blocks of 16 + a partial block of 8
    eng.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0.0, n=4,
                                                ignore_eos=True))
    eng.step()  # prefill once, fork 3 children, each samples its first token
    mgr = eng.kv_manager
    tables = [mgr.get_blocks(f"r#{i}") for i in (1, 2, 3)] + [mgr.get_blocks("r")]
    assert all(t[0] is tables[0][0] and t[1] is tables[0][1] for t in tables)
    assert tables[0][0].ref_cnt == 4 and tables[0][1].ref_cnt == 4
    copies = []
    orig_copy = eng.runner.copy_blocks
    eng.runner.copy_blocks = lambda pairs: (copies.extend(pairs), orig_copy(pairs))
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    # The shared partial block is copied once per writer except the last one to write.
    assert len(copies) == 3 and len({src for src, _ in copies}) == 1
    tokens = {}
    for d in outs:
        for c in d.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
    assert len(tokens) == 4 and len({tuple(v) for v in tokens.values()}) == 1
    assert mgr.get_num_free_blocks() == 64


def test_seeded_sampling_is_reproducible():
    llm = LLM("pagekv-tiny", num_gpu_blocks=128, max_model_len=256)
    p = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7, n=3)
    a = llm.generate([[5, 6, 7, 8]], p)[0]
    # Same seed in a busier batch: same samples.
    b = llm.generate([[9, 9, 9], [5, 6, 7, 8], [1, 2]], [GREEDY, p, GREEDY])[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # children draw differently


def test_abort_mid_stream_frees_every_block():
    eng = Engine(model="pagekv-tiny", num_gpu_blocks=64, max_model_len=256)
    free0 = eng.kv_manager.get_num_free_blocks()
    eng.add_request("a", list(range(1, 50)), SamplingParams(max_tokens=100, ignore_eos=True, n=2))
    for _ in range(4):
        eng.step()
    assert eng.kv_manager.get_num_free_blocks() < free0
    final = eng.abort("a")
    assert final.finished and all(c.finish_reason == "abort" for c in final.outputs)
    assert eng.kv_manager.get_num_free_blocks() == free0
    assert not eng.has_unfinished()


def test_bad_requests_rejected_and_engine_keeps_serving():
    eng = Engine(model="pagekv-tiny", num_gpu_blocks=16, max_model_len=200, max_n=4)
    bad = [
        ([], SamplingParams(), "empty"),
        ([1] * 200, SamplingParams(), "max_model_len"),
        ([1, 99999], SamplingParams(), "vocabulary"),
        ([1, 2], SamplingParams(max_tokens=500), "remaining context"),
        ([1, 2], SamplingParams(n=5), "max_n"),
    ]
    for tokens, params, needle in bad:
        with pytest.raises(RequestRejected, match=needle):
            eng.add_request(None, tokens, params)
    for field, value in [("n", 0), ("temperature", -1.0), ("max_tokens", 0), ("top_p", 0.0)]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    eng.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 3


def test_stop_token_and_eos():
    llm = LLM("pagekv-tiny", num_gpu_blocks=64, max_model_len=256)
    free_run = llm.generate([[3, 4, 5]], GREEDY)[0].outputs[0].token_ids
    stop_at = free_run[4]
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=12, temperature=0,
                                                    stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run[: free_run.index(stop_at) + 1]
    # The stop token ends the ids but not the text (vLLM's rule; the pod says the same).
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1])


def test_finished_sample_is_reported_once():
    engine = LLM("pagekv-tiny", num_gpu_blocks=64, max_model_len=256).engine
    staggered = 0
    for seed in range(12):
        # Half the vocabulary stops: the two samples usually finish at different steps.
        params = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=seed,
                                stop_token_ids=list(range(0, 256, 2)))
        engine.add_request(f"r{seed}", [3, 4, 5], params)
        finished_at: dict[int, int] = {}
        step = 0
        while engine.has_unfinished():
            step += 1
            for delta in engine.step():
                for c in delta.outputs:
                    assert c.index not in finished_at, "a finished completion came back"
                    if c.finish_reason is not None:
                        finished_at[c.index] = step
        assert sorted(finished_at) == [0, 1]
        staggered += finished_at[0] != finished_at[1]
    assert staggered, "no seed finished the two samples at different steps"


@pytest.mark.workload
def test_soak_random_requests_small_pool():
    rng = random.Random(1)
    eng = Engine(model="pagekv-tiny", num_gpu_blocks=48, block_size=8, max_model_len=256,
                 max_num_batched_tokens=96, max_num_seqs=16)
    expected = {}
    pending = []
    for i in range(500):
        n_prompt = rng.randint(1, 60)
        p = SamplingParams(max_tokens=rng.randint(1, 16), temperature=rng.choice([0.0, 1.0]),
                           ignore_eos=True, n=rng.choice([1, 1, 1, 2]), seed=i)
        pending.append((f"s{i}", [rng.randrange(1, 250) for _ in range(n_prompt)], p))
        expected[f"s{i}"] = p
    got: dict[str, dict[int, list[int]]] = {}
    finished = set()
    steps = 0
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 6)):
            if pending:
                rid, toks, p = pending.pop(0)
                eng.add_request(rid, toks, p)
        for d in eng.step():
            assert d.request_id not in finished, "output after finish"
            for c in d.outputs:
                got.setdefault(d.request_id, {}).setdefault(c.index, []).extend(c.token_ids)
            if d.finished:
                finished.add(d.request_id)
        steps += 1
        assert steps < 20000
    assert finished == set(expected)
    for rid, p in expected.items():
        assert sorted(got[rid]) == list(range(p.n))
        assert all(len(toks) == p.max_tokens for toks in got[rid].values())
    mgr = eng.kv_manager
    assert mgr.get_num_free_blocks() == 48
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.blocks)
    assert mgr.req_to_blocks == {}
    assert eng.scheduler.num_preemptions > 0


def test_prefill_cost_is_measured_on_prefill_heavy_steps():
    eng = Engine(model="pagekv-tiny", num_gpu_blocks=128, max_model_len=512,
                 max_num_batched_tokens=256)
    assert eng.prefill_s_per_token is None  # nothing measured before real traffic
    eng.add_request("p", [(k * 7) % 250 + 1 for k in range(300)], SamplingParams(max_tokens=1))
    while eng.has_unfinished():
        eng.step()
    assert len(eng._prefill_samples) == 1  # the 256-token step; the 44-token one is skipped
    assert eng.prefill_s_per_token > 0
    assert eng.kv_manager.get_num_free_blocks() == 128  # the warm-up pass left no trace


def test_prefix_caching_on_off_and_second_run_same_tokens():
    shared = [(k * 5) % 250 + 1 for k in range(70)]
    batch = [shared + [i, i + 1, i + 2] for i in range(1, 6)]
    off = LLM("pagekv-tiny", num_gpu_blocks=128, max_model_len=256,
              enable_prefix_caching=False).generate(batch, GREEDY)
    llm = LLM("pagekv-tiny", num_gpu_blocks=128, max_model_len=256)
    first = llm.generate(batch, GREEDY)
    second = llm.generate(batch, GREEDY)  # every prompt hits the first run's blocks
    tokens = [[o.outputs[0].token_ids for o in run] for run in (off, first, second)]
    assert tokens[0] == tokens[1] == tokens[2]
    assert all(o.num_cached_tokens == 64 for o in second)
    assert all(o.num_cached_tokens == 0 for o in off)


def test_large_prompt_admitted_when_only_the_watermark_would_block_it():
    # 150 + 5 tokens need 10 of 10 blocks; the 2-block watermark must not hold it forever.
    eng = Engine(model="pagekv-tiny", num_gpu_blocks=10, max_model_len=160, watermark=0.2)
    eng.add_request("big", [(k % 250) + 1 for k in range(150)],
                    SamplingParams(max_tokens=5, ignore_eos=True))
    steps = 0
    while eng.has_unfinished() and steps < 50:
        eng.step()
        steps += 1
    assert not eng.has_unfinished()


def _run_to_end(eng, outs=None):
    outs = {} if outs is None else outs
    while eng.has_unfinished():
        for d in eng.step():
            for c in d.outputs:
                outs.setdefault((d.request_id, c.index), []).extend(c.token_ids)
    return outs


def test_client_id_shaped_like_a_sample_never_shares_its_blocks():
    # The engine names the second sample of request "a" "a#1" (its block table's key). A client
    # request with that id used to crash fork() (ValueError out of step()) when it came first,
    # and to write into the sample's block table when it came second.
    two = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)
    one = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    a, b = [1, 2, 3], [5, 6, 7, 8]
    alone = LLM("pagekv-tiny", num_gpu_blocks=32, max_model_len=256).generate([a, b], [two, one])
    want = {("a", 0): alone[0].outputs[0].token_ids, ("a", 1): alone[0].outputs[1].token_ids,
            ("a#1", 0): alone[1].outputs[0].token_ids}

    eng = Engine(model="pagekv-tiny", num_gpu_blocks=32, max_model_len=256)
    eng.add_request("a#1", b, one)
    outs = {}
    for d in eng.step():
        outs.setdefault((d.request_id, 0), []).extend(d.outputs[0].token_ids)
    eng.add_request("a", a, two)  # its second sample cannot be named "a#1" now
    assert _run_to_end(eng, outs) == want
    assert eng.kv_manager.get_num_free_blocks() == 32

    eng = Engine(model="pagekv-tiny", num_gpu_blocks=32, max_model_len=256)
    eng.add_request("a", a, two)
    outs = {}
    for d in eng.step():
        for c in d.outputs:
            outs.setdefault(("a", c.index), []).extend(c.token_ids)
    with pytest.raises(DuplicateRequestId):
        eng.add_request("a#1", b, one)  # taken by a live sample
    assert _run_to_end(eng, outs) == {k: v for k, v in want.items() if k[0] == "a"}
    assert eng.kv_manager.get_num_free_blocks() == 32


def test_abort_leaves_a_reused_id_of_a_finished_sample_alone():
    # Sample 1 of "a" stops at its first token; a client then reuses the id "a#1". Aborting
    # "a" used to release every sample by id again, freeing the new request's blocks.
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=2, ignore_eos=True)
    first = LLM("pagekv-tiny", num_gpu_blocks=32, max_model_len=256).generate([[1, 2, 3]], seeded)
    t0, t1 = (c.token_ids[0] for c in first[0].outputs)
    assert t0 != t1
    stop = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=2, ignore_eos=True,
                          stop_token_ids=[t1])
    eng = Engine(model="pagekv-tiny", num_gpu_blocks=32, max_model_len=256)
    eng.add_request("a", [1, 2, 3], stop)
    eng.step()  # prefill, fork; sample 1 draws t1 and stops
    eng.add_request("a#1", [5, 6, 7, 8], GREEDY)
    eng.step()
    eng.abort("a")
    assert eng.kv_manager.get_blocks("a#1")  # untouched
    outs = _run_to_end(eng)
    assert len(outs[("a#1", 0)]) == GREEDY.max_tokens - 1  # one token came in the step above
    assert eng.kv_manager.get_num_free_blocks() == 32
