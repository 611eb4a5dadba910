"""Penalties, min_tokens and logprobs: the parameters' checks, the logits against a plain-Python
reference, whole greedy runs against a step-by-step reference on the model's own logits, and
logprobs against transformers on a random-weight checkpoint."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from pagekv.kvnode.engine import sampler
from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.logits_processors import SeqHistory, process_logits
from pagekv.kvnode.engine.sampler import sample
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem

EOS = 257  # pagekv-tiny's byte tokenizer
TIE = 1e-4  # paged decode vs a full prefill: logits this close may order either way


# -- the parameters ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"stop": [""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # > max_tokens (16)
    ({"min_tokens": 1.0}, "min_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"min_p": "0.1"}, "min_p"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
    ({"prompt_logprobs": False}, "prompt_logprobs"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)


def test_defaults_and_accepted_values():
    p = SamplingParams()
    assert (p.stop, p.min_tokens, p.presence_penalty, p.frequency_penalty,
            p.repetition_penalty, p.logprobs) == ([], 0, 0.0, 0.0, 1.0, None)
    assert not p.needs_history
    assert SamplingParams(stop="###").stop == ["###"]
    q = SamplingParams(max_tokens=4, min_tokens=4, presence_penalty=-2, frequency_penalty=2,
                       repetition_penalty=0.5, logprobs=20)
    assert q.has_penalties and q.needs_history
    assert SamplingParams(min_tokens=1).needs_history
    assert (p.min_p, p.prompt_logprobs, p.skip_special_tokens) == (0.0, None, True)  # vLLM's
    r = SamplingParams(min_p=1, prompt_logprobs=0, skip_special_tokens=False)
    assert (r.min_p, r.prompt_logprobs, r.skip_special_tokens) == (1, 0, False)
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20


# -- the logits, against plain Python -------------------------------------------------------------

def reference_row(row: list[float], p: SamplingParams, prompt: list[int],
                  output: list[int]) -> list[float]:
    """The penalties and min_tokens mask written out token by token, in doubles."""
    counts = Counter(output)
    seen = set(prompt) | set(output)
    out = []
    for t, x in enumerate(row):
        if p.repetition_penalty != 1.0 and t in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * counts[t] + p.presence_penalty * (1 if counts[t] else 0)
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
        if len(output) < p.min_tokens and t in stops:
            x = -math.inf
        out.append(x)
    return out


ROW_PARAMS = [
    SamplingParams(),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.75),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, presence_penalty=-1.0, frequency_penalty=2.0),
    SamplingParams(max_tokens=30, min_tokens=26, stop_token_ids=[3, 9]),
    # EOS ignored and a stop id past the vocabulary: nothing to mask
    SamplingParams(max_tokens=30, min_tokens=26, ignore_eos=True, stop_token_ids=[300]),
    SamplingParams(min_tokens=2, stop_token_ids=[4]),  # output long enough: no mask
    SamplingParams(),
]


def test_process_logits_matches_the_reference_row_by_row():
    rng = random.Random(5)
    vocab = 258
    logits = torch.randn(len(ROW_PARAMS), vocab, generator=torch.Generator().manual_seed(5)) * 3
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in ROW_PARAMS]
    outputs = [[rng.randrange(40) for _ in range(rng.randint(2, 25))] for _ in ROW_PARAMS]
    outputs[0] = []  # a row with nothing generated yet
    histories = [SeqHistory(o, torch.tensor(p)) for o, p in zip(outputs, prompts, strict=True)]
    before = logits.clone()
    got = process_logits(logits, ROW_PARAMS, histories, {EOS})
    assert torch.equal(logits, before)  # the caller's tensor is left alone
    for i, p in enumerate(ROW_PARAMS):
        want = reference_row(logits[i].tolist(), p, prompts[i], outputs[i])
        for t in range(vocab):
            if math.isinf(want[t]):
                assert got[i, t] == -math.inf, (i, t)
            else:
                assert got[i, t].item() == pytest.approx(want[t], rel=1e-5, abs=1e-5), (i, t)
    for i in (0, 6, 7, 8):  # no penalties, and nothing (left) to mask
        assert torch.equal(got[i], logits[i])  # bit for bit


def test_a_batch_without_penalties_is_returned_as_is():
    logits = torch.randn(3, 50)
    hist = [SeqHistory([1, 2, 3])] * 3
    params = [SamplingParams(min_tokens=2), SamplingParams(), SamplingParams(temperature=0)]
    assert process_logits(logits, params, hist, {EOS}) is logits


def test_plain_batches_never_reach_the_logits_processors(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a plain batch paid for penalties")

    monkeypatch.setattr(sampler, "process_logits", refuse)
    monkeypatch.setattr(Engine, "_history", staticmethod(refuse))
    llm = LLM("pagekv-tiny", num_gpu_blocks=64, max_model_len=128)
    out = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=5, temperature=0),
                                             SamplingParams(max_tokens=5, seed=1)])
    assert [len(o.outputs[0].token_ids) for o in out] == [5, 5]
    assert out[0].outputs[0].logprobs is None and out[0].outputs[0].stop_reason is None
    with pytest.raises(AssertionError, match="paid for penalties"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, presence_penalty=1.0))


def log_softmax_py(row: list[float]) -> list[float]:
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def test_logprobs_are_raw_whatever_the_sampling():
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(2)) * 2
    logits[0, 1] = logits[0].max() + 0.5  # the raw argmax, already generated: penalised away
    params = [SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0),
              SamplingParams(temperature=0.5, top_k=5, seed=3, logprobs=0),
              SamplingParams(temperature=0),  # did not ask
              SamplingParams(temperature=1.3, top_p=0.5, seed=4, logprobs=7, min_tokens=9,
                             presence_penalty=2.0)]
    hist = [SeqHistory([1, 2, 2], torch.tensor([5, 6])) for _ in params]
    gens = [sampler.make_generator(p.seed) for p in params]
    out = sample(logits, params, gens, hist, {EOS})
    assert out.logprobs is not None and out.logprobs[2] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        ref = log_softmax_py(logits[i].tolist())
        lp = out.logprobs[i]
        assert lp.token_id == out.tokens[i]
        assert lp.logprob == pytest.approx(ref[out.tokens[i]], abs=1e-5)
        assert len(lp.top) == p.logprobs
        best = sorted(range(60), key=lambda t: -ref[t])[: p.logprobs]
        assert [t for t, _ in lp.top] == best
        assert [v for _, v in lp.top] == pytest.approx([ref[t] for t in best], abs=1e-5)
    # Greedy under a repetition penalty: the argmax of the penalised row, not the raw one.
    penalised = reference_row(logits[0].tolist(), params[0], [5, 6], [1, 2, 2])
    assert out.tokens[0] == max(range(60), key=penalised.__getitem__) != 1
    assert sample(logits, params[2:3] * 4, [None] * 4).logprobs is None


# -- min_p ------------------------------------------------------------------------------------------

def drawn(row: list[float], draws: int, **kw) -> Counter:
    """How often each token is drawn from `row` in `draws` seeded samples."""
    params = [SamplingParams(seed=i, **kw) for i in range(draws)]
    logits = torch.tensor([row] * draws)
    return Counter(sample(logits, params, [sampler.make_generator(i) for i in range(draws)]
                          ).tokens)


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    # probs ~ [0.47, 0.29, 0.17, 0.064, 0.0043]: min_p 0.3 keeps the first three
    # (0.17 / 0.47 = 0.37 >= 0.3), drops 0.064 / 0.47 = 0.14.
    row = [2.0, 1.5, 1.0, 0.0, -2.7]
    counts = drawn(row, 3000, min_p=0.3)
    assert set(counts) == {0, 1, 2}
    # The kept tokens keep their relative odds (renormalised): 0.47 : 0.29 : 0.17.
    total = sum(counts.values())
    for tok, p in ((0, 0.505), (1, 0.306), (2, 0.186)):
        assert abs(counts[tok] / total - p) < 0.04, counts
    assert set(drawn(row, 3000)) == {0, 1, 2, 3, 4}  # without min_p, every one (not vacuous)


def test_min_p_applies_after_temperature_and_before_top_k():
    # Token 1 has exp(-2) = 0.135 of token 0's probability: below min_p 0.2 at temperature 1,
    # but exp(-1) = 0.37 of it at temperature 2 (vLLM filters the tempered distribution).
    row = [0.0, -2.0, -9.0]
    assert set(drawn(row, 400, temperature=1.0, min_p=0.2)) == {0}
    assert set(drawn(row, 400, temperature=2.0, min_p=0.2)) == {0, 1}
    # min_p first, then top_k over what is left; a greedy row ignores min_p.
    assert set(drawn(row, 400, temperature=2.0, min_p=0.2, top_k=1)) == {0}
    assert set(drawn([0.0, 0.1, -1.0], 50, temperature=0.0, min_p=0.99)) == {1}


# -- skip_special_tokens ---------------------------------------------------------------------------

def test_skip_special_tokens_false_keeps_them_in_the_text(tiny):
    llm, _ = tiny
    tok = llm.tokenizer
    rng = random.Random(1)
    prompts = [[256, *(rng.randrange(256) for _ in range(rng.randint(2, 12)))]
               for _ in range(200)]
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, plain)
    prompt, ids = next((p, o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)
                       if EOS in o.outputs[0].token_ids[:-1])  # EOS mid-output (ignored)
    kept = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                 skip_special_tokens=False))[0].outputs[0]
    assert kept.token_ids == ids
    assert "</s>" in kept.text and kept.text == tok.decode(ids, skip_special_tokens=False)
    skipped = llm.generate([prompt], plain)[0].outputs[0]
    assert "</s>" not in skipped.text and skipped.text == tok.decode(ids)


# -- whole greedy runs, replayed on the model's logits ---------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    """The engine under test, and a second runner of the same model as the reference: every
    reference step is a fresh prefill of prompt + output so far (no KV cache shared)."""
    llm = LLM("pagekv-tiny", num_gpu_blocks=128, max_model_len=256)
    ref = ModelRunner("pagekv-tiny", num_gpu_blocks=32, max_model_len=256, device="cpu")
    return llm, ref


def model_row(runner: ModelRunner, tokens: list[int]) -> list[float]:
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    return runner.execute([SeqBatchItem(tokens, 0, blocks)])[0].tolist()


def replay_greedy(runner: ModelRunner, prompt: list[int], p: SamplingParams, out) -> None:
    """Each token the engine chose is the argmax of the reference row (penalties and
    min_tokens applied by reference_row), it stopped where the reference stops, and not
    before."""
    toks = out.token_ids
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
    for k, tok in enumerate(toks):
        row = reference_row(model_row(runner, prompt + toks[:k]), p, prompt, toks[:k])
        assert row[tok] >= max(row) - TIE, f"step {k}: {tok} is not the argmax"
        if k + 1 < len(toks):
            assert not (tok in stops and k + 1 > p.min_tokens), f"should have stopped at {k}"
    if out.finish_reason == "stop":
        assert toks[-1] in stops and len(toks) > p.min_tokens
    else:
        assert out.finish_reason == "length" and len(toks) == p.max_tokens


PENALTIES = [
    dict(repetition_penalty=1.4),
    dict(repetition_penalty=0.8),
    dict(presence_penalty=1.2, frequency_penalty=0.6),
    dict(frequency_penalty=-1.5),
    dict(presence_penalty=-2.0, repetition_penalty=1.2),
]
PROMPTS = [[256, *b"the cat sat on the mat"], [256, *b"abcabcabc"], [256, 7, 7, 7, 7]]


def _name(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("kw", PENALTIES, ids=_name)
def test_greedy_with_penalties_follows_the_reference(tiny, kw):
    llm, ref = tiny
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **kw)
    base = llm.generate(PROMPTS, plain)
    outs = llm.generate(PROMPTS, [penalised] * len(PROMPTS))  # one batch, rows side by side
    for prompt, o in zip(PROMPTS, outs, strict=True):
        replay_greedy(ref, prompt, penalised, o.outputs[0])
    # Not vacuous: the penalties change what greedy picks.
    assert any(o.outputs[0].token_ids != b.outputs[0].token_ids
               for o, b in zip(outs, base, strict=True))


def test_penalised_and_plain_rows_share_a_batch(tiny):
    llm, _ = tiny
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    pen = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.5)
    alone_plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    alone_pen = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, pen)]
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + [pen] * 3)
    assert [o.outputs[0].token_ids for o in mixed] == alone_plain + alone_pen


def first_eos_prompt(llm: LLM) -> tuple[list[int], int]:
    """A prompt whose plain greedy run ends at EOS after at least 2 tokens (found among
    seeded random prompts: weights and prompts are fixed, so always the same one)."""
    rng = random.Random(0)
    prompts = [[256, *(rng.randrange(256) for _ in range(rng.randint(2, 12)))]
               for _ in range(400)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    for prompt, o in zip(prompts, outs, strict=True):
        c = o.outputs[0]
        if c.finish_reason == "stop" and len(c.token_ids) >= 2:
            assert c.token_ids[-1] == EOS and c.stop_reason is None
            return prompt, len(c.token_ids)
    raise AssertionError("no greedy run reached EOS")


@pytest.mark.workload
def test_min_tokens_masks_eos(tiny):
    llm, ref = tiny
    prompt, n = first_eos_prompt(llm)
    early = SamplingParams(max_tokens=20, temperature=0, min_tokens=n - 1)
    same = llm.generate([prompt], early)[0].outputs[0]
    assert same.token_ids[-1] == EOS and len(same.token_ids) == n  # the n-th token may be EOS
    held = SamplingParams(max_tokens=20, temperature=0, min_tokens=n)
    out = llm.generate([prompt], held)[0].outputs[0]
    assert EOS not in out.token_ids[:n] and len(out.token_ids) > n
    replay_greedy(ref, prompt, held, out)
    ignored = SamplingParams(max_tokens=20, temperature=0, min_tokens=n, ignore_eos=True)
    assert llm.generate([prompt], ignored)[0].outputs[0].finish_reason == "length"


def test_min_tokens_masks_stop_token_ids(tiny):
    llm, ref = tiny
    prompt = PROMPTS[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                 ignore_eos=True))[0].outputs[0].token_ids
    stop_at = free[2]
    first = free.index(stop_at)
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    out = llm.generate([prompt], plain)[0].outputs[0]
    assert out.token_ids == free[: first + 1] and out.stop_reason == stop_at
    held = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, min_tokens=first + 1,
                          stop_token_ids=[stop_at])
    out = llm.generate([prompt], held)[0].outputs[0]
    assert stop_at not in out.token_ids[: first + 1]
    replay_greedy(ref, prompt, held, out)
    if out.finish_reason == "stop":
        assert out.stop_reason == stop_at


# -- logprobs, against transformers ----------------------------------------------------------------

HF_ENGINE = dict(num_gpu_blocks=64, max_model_len=128, device="cpu", attention_backend="torch")


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.unit.test_model_hf import make_checkpoint

    path = tmp_path_factory.mktemp("llama-logprobs")
    hf = make_checkpoint(path, "llama", seed=3)
    eng = Engine(model=str(path), **HF_ENGINE)
    return hf, eng, path


def run(eng: Engine, prompt: list[int], p: SamplingParams):
    eng.add_request("r", prompt, p)
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    return outs


@pytest.mark.parametrize("p", [
    SamplingParams(max_tokens=8, temperature=0, logprobs=5),
    # Temperature, top-k and penalties change the draw, never the logprobs: raw ones.
    SamplingParams(max_tokens=8, temperature=0.8, top_k=10, seed=11, logprobs=3,
                   repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(max_tokens=5, temperature=1.0, seed=2, logprobs=0),
], ids=["greedy", "sampled-penalised", "sampled-only"])
def test_logprobs_equal_transformers_log_softmax(hf_llama, p):
    hf, eng, _ = hf_llama
    prompt = eng.tokenizer.encode("w5 w17 w3 w88 w41 w9", add_bos=False)
    deltas = run(eng, prompt, p)
    tokens = [t for d in deltas for c in d.outputs for t in c.token_ids]
    lps = [lp for d in deltas for c in d.outputs for lp in c.logprobs]
    assert len(lps) == len(tokens) == p.max_tokens
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    for j, (tok, lp) in enumerate(zip(tokens, lps, strict=True)):
        at = ref[len(prompt) - 1 + j]  # the distribution output token j was drawn from
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(at[tok].item(), abs=1e-4)
        want = at.topk(p.logprobs)
        assert [t for t, _ in lp.top] == want.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))
    if p.greedy:
        assert all(lp.top[0][0] == lp.token_id for lp in lps)


def test_logprobs_through_llm_with_n_samples(hf_llama):
    llm = LLM(str(hf_llama[2]), **HF_ENGINE)
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3, logprobs=2)
    out = llm.generate(["w1 w2 w3"], p)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
        assert all(len(lp.top) == 2 for lp in c.logprobs)
    assert llm.generate(["w1 w2"], SamplingParams(max_tokens=2))[0].outputs[0].logprobs is None
