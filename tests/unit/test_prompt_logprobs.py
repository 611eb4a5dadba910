"""Prompt logprobs (SamplingParams.prompt_logprobs): equal to transformers' log_softmax over the
same prompt on a random-weight checkpoint, across prefill chunks, beside other requests in
one batch, with the prefix cached in the pool, a tier or a peer (never read: every position
is computed), on the first delta only; the generated tokens are those of the plain request."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.prompt_logprobs import rows_to_score
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.memory.request import Request
from pagekv.proto.medium import PEER_SHARE, Medium
from tests.unit.test_peer_pull import SOURCE, direct_fetch

K = 4  # top tokens asked per prompt position
BUDGET = 16  # max_num_batched_tokens: a 61-token prompt prefills in 4 chunks
HF_ENGINE = dict(num_gpu_blocks=64, max_model_len=128, device="cpu", attention_backend="torch",
                 max_num_batched_tokens=BUDGET)
PLAIN = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SCORED = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=K)


def test_rows_to_score_covers_each_prompt_token_once():
    """Chunks of any size, and a chunk recomputed after a preemption, score every prompt token
    1 .. P-1 exactly once, each from the row of the position before it."""
    rng = random.Random(3)
    for _ in range(300):
        num_prompt = rng.randint(1, 60)
        scored = [0]  # token 0 has no entry
        pos = 0
        while pos < num_prompt:
            n = rng.randint(1, num_prompt - pos)
            rows = rows_to_score(pos, n, num_prompt, len(scored))
            if rows is not None:
                off, count = rows
                assert 0 <= off and off + count <= n
                # row (pos + off) predicts token pos + off + 1: the next one not scored yet
                assert pos + off + 1 == len(scored)
                scored += range(len(scored), len(scored) + count)
            pos += n
            if pos < num_prompt and rng.random() < 0.15:
                pos = 0  # preempted: recomputed from the start
        assert scored == list(range(num_prompt))
    assert rows_to_score(70, 1, 61, 61) is None  # a decode step scores nothing


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.unit.test_model_hf import make_checkpoint

    path = tmp_path_factory.mktemp("llama-prompt-logprobs")
    return make_checkpoint(path, "llama", seed=4), path


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 96) for _ in range(n)]


def reference(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def assert_matches(entries, prompt: list[int], ref: torch.Tensor, k: int = K) -> None:
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        e, at = entries[j], ref[j - 1]  # position j-1 predicts token j
        assert e.token_id == prompt[j]
        assert e.logprob == pytest.approx(at[prompt[j]].item(), abs=1e-4), j
        want = at.topk(k)
        assert [t for t, _ in e.top] == want.indices.tolist(), j
        assert [v for _, v in e.top] == pytest.approx(want.values.tolist(), abs=1e-4)


def drain(eng: Engine, steps: int | None = None, deltas: dict | None = None
          ) -> dict[str, list]:
    """Each request's deltas, stepping until the engine is idle (or `steps` steps)."""
    deltas = {} if deltas is None else deltas
    deadline = time.monotonic() + 60
    while eng.has_unfinished() and (steps is None or steps > 0):
        assert time.monotonic() < deadline, "the engine did not finish"
        for d in eng.step():
            deltas.setdefault(d.request_id, []).append(d)
        steps = None if steps is None else steps - 1
    return deltas


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.outputs[0].token_ids]


def test_chunked_prompt_logprobs_equal_transformers_and_come_once(hf_llama):
    hf, path = hf_llama
    eng = Engine(model=str(path), **HF_ENGINE)
    prompt = prompt_of(61, 1)  # > BUDGET: chunked prefill
    eng.add_request("plain", prompt, PLAIN)
    plain = tokens_of(drain(eng)["plain"])
    eng.reset_prefix_cache()  # this test is about chunks; the cached prefix is the next one's
    eng.add_request("r", prompt, SCORED)
    deltas = drain(eng)["r"]
    assert len(deltas) == PLAIN.max_tokens  # one per token: the prefill took several steps
    assert_matches(deltas[0].prompt_logprobs, prompt, reference(hf, prompt))
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert tokens_of(deltas) == plain  # generation unchanged
    assert deltas[0].outputs[0].logprobs is None  # only prompt logprobs were asked


def test_cached_prefix_is_not_read_and_the_result_is_the_same(hf_llama):
    hf, path = hf_llama
    eng = Engine(model=str(path), **HF_ENGINE)
    prompt = prompt_of(50, 2)
    eng.add_request("warm", prompt, PLAIN)
    warm = drain(eng)["warm"]
    eng.add_request("hit", prompt, PLAIN)  # control: the prefix is cached in the pool
    assert drain(eng)["hit"][-1].num_cached_tokens == 48
    queries = eng.metrics.prefix_requests
    eng.add_request("r", prompt, SCORED)
    deltas = drain(eng)["r"]
    assert deltas[-1].num_cached_tokens == 0
    assert_matches(deltas[0].prompt_logprobs, prompt, reference(hf, prompt))
    assert tokens_of(deltas) == tokens_of(warm)
    # Not a prefix-cache query (vLLM leaves such requests out of the hit rate).
    assert eng.metrics.prefix_requests == queries
    # Its blocks were cached as it prefilled: a later plain request still hits them.
    eng.add_request("after", prompt, PLAIN)
    assert drain(eng)["after"][-1].num_cached_tokens == 48


def test_beside_other_requests_in_one_batch(hf_llama):
    """Prompt-logprob requests mixed with plain ones (decodes and prefill chunks in the same
    steps): every plain request's tokens are those it gets alone, every scored one's prompt
    logprobs are transformers'."""
    hf, path = hf_llama
    prompts = [prompt_of(n, 10 + n) for n in (5, 40, 23, 61, 9, 33)]
    alone = []
    for i, p in enumerate(prompts):
        eng = Engine(model=str(path), **HF_ENGINE)
        eng.add_request(str(i), p, PLAIN)
        alone.append(tokens_of(drain(eng)[str(i)]))
    eng = Engine(model=str(path), **HF_ENGINE)
    deltas: dict[str, list] = {}
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SCORED if i % 2 else PLAIN)
        if i == 2:
            drain(eng, 3, deltas)  # later arrivals join a batch already decoding
    drain(eng, deltas=deltas)
    for i, p in enumerate(prompts):
        assert tokens_of(deltas[str(i)]) == alone[i], i
        if i % 2:
            assert_matches(deltas[str(i)][0].prompt_logprobs, p, reference(hf, p))
        else:
            assert all(d.prompt_logprobs is None for d in deltas[str(i)])


def test_through_llm_with_n_samples_and_zero_top(hf_llama):
    hf, path = hf_llama
    llm = LLM(str(path), **HF_ENGINE)
    prompt = prompt_of(30, 5)
    out = llm.generate([prompt], SamplingParams(max_tokens=4, n=3, seed=1, prompt_logprobs=0))[0]
    assert len(out.outputs) == 3
    assert_matches(out.prompt_logprobs, prompt, reference(hf, prompt), k=0)
    assert all(e.top == [] for e in out.prompt_logprobs[1:])
    one = llm.generate([[7]], SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
    assert one.prompt_logprobs == [None]  # a one-token prompt: nothing to score


def tiny_engine(**kw) -> Engine:
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("max_model_len", 400)
    return Engine(model="pagekv-tiny", max_num_batched_tokens=64, **kw)


def scored_run(eng: Engine, prompt: list[int], rid: str = "r", **kw):
    eng.add_request(rid, prompt, SCORED, **kw)
    deltas = drain(eng)[rid]
    return deltas[0].prompt_logprobs, tokens_of(deltas), deltas[-1]


PROMPT = [(i * 37) % 250 + 1 for i in range(200)]
FILLERS = [[(i * k) % 250 + 1 for i in range(180)] for k in (11, 13, 17)]


@pytest.fixture(scope="module")
def cold():
    return scored_run(tiny_engine(enable_prefix_caching=False), PROMPT)


def test_a_prefix_in_the_dram_tier_is_not_loaded(cold):
    # A small pool: the fillers push the prompt's blocks down to the DRAM tier.
    eng = tiny_engine(num_gpu_blocks=26, cpu_offload_bytes=8 << 20)
    eng.add_request("warm", PROMPT, PLAIN)
    drain(eng)
    for i, f in enumerate(FILLERS):
        eng.add_request(f"f{i}", f, PLAIN)
        drain(eng)
    probe = Request("probe", PROMPT)  # control: the pool lost the prefix, the tier holds it
    assert eng.kv_manager.lookup(probe).num_tokens == 0
    state = eng.full_state()
    assert all(state.get(h) == Medium.CPU for h in probe.block_hashes)
    entries, tokens, last = scored_run(eng, PROMPT)
    assert (entries, tokens) == cold[:2]
    assert last.num_cached_tokens == 0 and not any(last.cached_tokens_by_tier.values())


def test_a_peer_holding_the_prefix_is_not_pulled_from(cold):
    src = tiny_engine()
    src.add_request("warm", PROMPT, PLAIN)
    drain(src)
    control = tiny_engine()  # the peer does serve a plain request
    control.enable_peer_pull(direct_fetch(src))
    control.add_request("control", PROMPT, PLAIN, kv_source=SOURCE)
    assert drain(control)["control"][-1].cached_tokens_by_tier[PEER_SHARE] > 0
    dst = tiny_engine()
    puller = dst.enable_peer_pull(direct_fetch(src))
    entries, tokens, last = scored_run(dst, PROMPT, kv_source=SOURCE)
    assert (entries, tokens) == cold[:2]
    assert last.cached_tokens_by_tier.get(PEER_SHARE, 0) == 0 and puller.stats.pulls == 0


def test_preempted_mid_prefill_still_scores_every_token_once(cold):
    """A pool too small for both: the decoding request preempts the scoring one while it is
    still prefilling; its recompute skips what it already scored."""
    eng = tiny_engine(num_gpu_blocks=18, max_model_len=256, max_num_seqs=2, watermark=0.0)
    long_decode = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    eng.add_request("d", FILLERS[0][:100], long_decode)
    deltas = drain(eng, 3)
    eng.add_request("r", PROMPT, SCORED)
    drain(eng, deltas=deltas)
    assert eng.scheduler.num_preemptions > 0
    assert tokens_of(deltas["r"]) == cold[1]
    # Other chunk boundaries than the cold run's: equal up to float rounding.
    got, want = deltas["r"][0].prompt_logprobs, cold[0]
    assert len(got) == len(want) == len(PROMPT) and got[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)


def test_only_the_asking_rows_go_through_the_lm_head(monkeypatch):
    eng = tiny_engine()
    real = eng.runner.execute_with_token_logits
    calls: list[tuple[int, int]] = []  # (tokens in the step, rows scored)

    def counted(batch, token_rows):
        calls.append((sum(len(it.token_ids) for it in batch), sum(c for *_, c in token_rows)))
        return real(batch, token_rows)

    monkeypatch.setattr(eng.runner, "execute_with_token_logits", counted)
    eng.add_request("a", PROMPT[:50], PLAIN)
    eng.add_request("b", FILLERS[1][:40], PLAIN)
    drain(eng)
    assert calls == []  # plain steps take execute, as before
    eng.add_request("plain", FILLERS[0][:50], PLAIN)
    eng.add_request("r", FILLERS[2][:30], SCORED)
    drain(eng)
    # Two prefill steps (64 + 16 tokens), with r's 29 scored rows and not plain's 50.
    assert sum(rows for _, rows in calls) == 29
    assert all(rows < tokens for tokens, rows in calls)


def test_runner_token_logits_are_execute_s_and_all_positions_rows():
    from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem

    runner = ModelRunner("pagekv-tiny", num_gpu_blocks=32, max_model_len=256, device="cpu")
    batch = [SeqBatchItem(PROMPT[:20], 0, [0, 1]), SeqBatchItem(PROMPT[:7], 0, [2]),
             SeqBatchItem(FILLERS[0][:33], 0, [3, 4, 5])]
    last = runner.execute(batch)
    every = runner.execute(batch, all_positions=True)
    got_last, rows = runner.execute_with_token_logits(batch, [(2, 5, 28), (0, 0, 3)])
    assert torch.allclose(got_last, last, atol=1e-5)
    want = torch.cat([every[27 + 5 : 27 + 33], every[0:3]])
    assert torch.allclose(rows, want, atol=1e-5)
    with pytest.raises(ValueError, match="not new tokens"):
        runner.execute_with_token_logits(batch, [(1, 5, 3)])


def test_scoring_steps_are_not_prefill_cost_samples():
    """The prefill cost published to the router is a plain prefill's: a step that also
    scored prompt logprobs is left out."""
    eng = Engine(model="pagekv-tiny", num_gpu_blocks=128, max_model_len=512,
                 max_num_batched_tokens=256)
    eng.add_request("r", PROMPT + PROMPT[:100], SCORED)
    drain(eng)
    assert eng.prefill_s_per_token is None
    eng.add_request("plain", FILLERS[0] + FILLERS[1][:120], PLAIN)
    drain(eng)
    assert eng.prefill_s_per_token is not None
