"""The OpenAI API's /v1/completions and /v1/models, driven by the official `openai` client
(sync, async, streaming) against a pod and against the router of a real cluster of
processes: the same tokens as gRPC and the offline LLM, n and seeds, several prompts, stop
strings across token boundaries, logprobs, usage and cached tokens, the pagekv extension."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from tests.integration.contract_fixtures import MAX_MODEL_LEN, byte_text, sampling
from tests.integration.openai_fixtures import (
    MODEL,
    HttpTarget,
    complete,
    raw_post,
    token_ids_of,
    with_extras,
)

pytestmark = pytest.mark.integration

PROMPT = "PageKV keeps the KV cache in fixed-size blocks. "
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=MODEL, num_gpu_blocks=64, max_model_len=1024)


def test_models_lists_the_served_model(http_target: HttpTarget) -> None:
    models = http_target.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "pagekv"


def test_greedy_tokens_equal_grpc_and_offline(http_target: HttpTarget, offline: LLM) -> None:
    out = complete(http_target.client(),
        model=MODEL, prompt=PROMPT, max_tokens=12, logprobs=0, **GREEDY,
        extra_body={"return_tokens_as_token_ids": True})
    choice = out.choices[0]
    http_ids = token_ids_of(choice.logprobs)
    grpc_resp = http_target.grpc.gen.Generate(pb.GenerateRequest(
        text=PROMPT, sampling=sampling(12, ignore_eos=True)), timeout=60)
    assert http_ids == list(grpc_resp.completions[0].token_ids)
    assert choice.text == grpc_resp.completions[0].text == byte_text(http_ids)
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0,
                                                    ignore_eos=True))[0]
    assert http_ids == ref.outputs[0].token_ids
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(PROMPT) + 1  # the byte tokenizer's BOS


def test_stream_joins_to_the_whole_response(http_target: HttpTarget) -> None:
    client = http_target.client()
    whole = complete(client, model=MODEL, prompt=PROMPT, max_tokens=20, **GREEDY)
    chunks = list(complete(
        client, model=MODEL, prompt=PROMPT, max_tokens=20, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    *choice_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 20
    assert all(c.usage is None and len(c.choices) == 1 for c in choice_chunks)
    assert "".join(c.choices[0].text for c in choice_chunks) == whole.choices[0].text
    finishing = [c for c in choice_chunks if c.choices[0].finish_reason]
    assert finishing == [choice_chunks[-1]] and finishing[0].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1
    # The extension rides on the usage chunk: served_by and the tiers' split.
    ext = last.model_extra["pagekv"]
    assert ext["served_by"].startswith("node-")
    assert sum(ext["cached_tokens_by_tier"].values()) == last.usage.prompt_tokens_details.cached_tokens


def test_async_client_concurrent_requests(http_target: HttpTarget) -> None:
    prompts = [f"{PROMPT} Request number {i}." for i in range(4)]
    sync = http_target.client()
    expected = [complete(sync, model=MODEL, prompt=p, max_tokens=8, **GREEDY)
                .choices[0].text for p in prompts]

    async def run() -> list[str]:
        client = http_target.async_client()
        try:
            outs = await asyncio.gather(*(complete(client,
                model=MODEL, prompt=p, max_tokens=8, **GREEDY) for p in prompts))
            streamed = []
            async for chunk in await complete(client,
                    model=MODEL, prompt=prompts[0], max_tokens=8, stream=True, **GREEDY):
                streamed.append(chunk.choices[0].text)
            assert "".join(streamed) == expected[0]
            return [o.choices[0].text for o in outs]
        finally:
            await client.close()

    assert asyncio.run(run()) == expected


def test_n_and_seed_reproducible(http_target: HttpTarget) -> None:
    client = http_target.client()
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "n": 3, "temperature": 1.0,
          "seed": 1234, "ignore_eos": True}
    a, b = complete(client, **kw), complete(client, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each sample draws its own noise
    other = complete(client, **{**kw, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    assert a.usage.completion_tokens == 30


def test_several_prompts_number_their_choices(http_target: HttpTarget) -> None:
    client = http_target.client()
    prompts = [PROMPT + "one", [256, *b"token ids"]]
    alone = [complete(client, model=MODEL, prompt=p, max_tokens=6, **GREEDY)
             for p in prompts]
    both = complete(client, model=MODEL, prompt=prompts, max_tokens=6, n=2, **GREEDY)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0].choices[0].text] * 2 + \
        [alone[1].choices[0].text] * 2
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    streamed: dict[int, str] = {}
    for chunk in complete(client, model=MODEL, prompt=prompts, max_tokens=6, n=2,
                                           stream=True, **GREEDY):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == [c.text for c in both.choices]


def test_stop_string_across_token_boundaries(http_target: HttpTarget) -> None:
    client = http_target.client()
    # Each byte is a token here: a stop string of 3 characters always spans 3 tokens.
    free = complete(client, model=MODEL, prompt=PROMPT, max_tokens=40, **GREEDY)
    text = free.choices[0].text
    start = next(i for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    cut = text[:text.index(stop)]
    out = complete(client, model=MODEL, prompt=PROMPT, max_tokens=40, stop=[stop],
                                    **GREEDY)
    choice = out.choices[0]
    assert choice.text == cut and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    # Streamed: no event ever shows text that is cut later.
    pieces = [c.choices[0].text for c in complete(client,
        model=MODEL, prompt=PROMPT, max_tokens=40, stop=stop, stream=True, **GREEDY)]
    assert "".join(pieces) == cut
    assert not any(stop in p for p in pieces)


def test_logprobs_match_grpc(http_target: HttpTarget) -> None:
    out = complete(http_target.client(),
        model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY,
        extra_body={"return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    resp = http_target.grpc.gen.Generate(pb.GenerateRequest(
        text=PROMPT, sampling=sampling(6, ignore_eos=True, logprobs=3)), timeout=60)
    want = resp.completions[0].logprobs
    assert token_ids_of(lp) == [t.sampled.token_id for t in want]
    assert lp.token_logprobs == pytest.approx([t.sampled.logprob for t in want], abs=1e-6)
    for top, w in zip(lp.top_logprobs, want, strict=True):
        assert top == pytest.approx({f"token_id:{x.token_id}": x.logprob for x in w.top},
                                    abs=1e-6)
        assert len(top) == 3
        # Greedy: the sampled token is the most likely one.
        assert max(top.values()) == pytest.approx(w.sampled.logprob, abs=1e-6)
    assert lp.text_offset == list(range(len(lp.tokens))) or lp.text_offset[0] == 0


def test_penalties_and_min_tokens_reach_the_engine(http_target: HttpTarget) -> None:
    client = http_target.client()
    extra = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
    out = complete(client, model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                    extra_body={"repetition_penalty": 1.3, "min_tokens": 4},
                                    **extra)
    resp = http_target.grpc.gen.Generate(pb.GenerateRequest(text=PROMPT, sampling=sampling(
        16, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3,
        min_tokens=4)), timeout=60)
    assert out.choices[0].text == resp.completions[0].text
    plain = complete(client, model=MODEL, prompt=PROMPT, max_tokens=16, **GREEDY)
    assert plain.choices[0].text != out.choices[0].text


def test_repeated_prompt_reports_cached_tokens(http_target: HttpTarget) -> None:
    client = http_target.client()
    prompt = f"[{http_target.name}] " + "A shared system prompt for every request. " * 6
    kw = with_extras({"model": MODEL, "prompt": prompt, "max_tokens": 2, **GREEDY})
    first = client.completions.with_raw_response.create(**kw)
    again = client.completions.with_raw_response.create(**kw)
    a, b = first.parse(), again.parse()
    n_prompt = a.usage.prompt_tokens
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached == 16 * ((n_prompt - 1) // 16)  # every full block but a last-token one
    ext = b.model_extra["pagekv"]
    assert sum(ext["cached_tokens_by_tier"].values()) == cached
    assert again.headers["x-pagekv-served-by"] == ext["served_by"] == \
        first.headers["x-pagekv-served-by"]
    if http_target.name == "router":
        routing = ext["routing"]
        assert routing["chosen_pod"] == ext["served_by"]
        assert routing["predicted_cached_tokens"] == cached
        assert again.headers["x-pagekv-routing-reason"] == routing["reason"]
        assert {c["pod_id"] for c in routing["candidates"]} == {"node-a", "node-b"}
    else:
        assert ext["routing"] is None


def test_request_id_and_ignored_fields_in_headers(http_target: HttpTarget) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1, "request_id": "abc-1",
                       "some_future_field": 1}).encode()
    status, headers, raw = raw_post(http_target, "/completions", body)
    assert status == 200, raw
    assert headers["x-request-id"] == "abc-1"
    assert json.loads(raw)["id"] == "cmpl-abc-1"
    assert headers["x-pagekv-ignored-fields"] == "some_future_field"


def test_return_token_ids_and_a_null_max_tokens_read_as_vllm_reads_them(
        http_target: HttpTarget) -> None:
    """What a router forwarding to a vLLM pod sends (router/openai_forward.py)."""
    client = http_target.client()
    ids = list(http_target.grpc.gen.Generate(pb.GenerateRequest(
        text=PROMPT, sampling=sampling(12, ignore_eos=True)), timeout=60).completions[0].token_ids)
    whole = complete(client, model=MODEL, prompt=PROMPT, max_tokens=12, return_token_ids=True,
                     **GREEDY)
    assert whole.choices[0].model_extra["token_ids"] == ids
    chunks = list(complete(client, model=MODEL, prompt=PROMPT, max_tokens=12, stream=True,
                           return_token_ids=True, **GREEDY))
    # Every new id in order, those whose text is still held back included.
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ids
    plain = complete(client, model=MODEL, prompt=PROMPT, max_tokens=2, **GREEDY)
    assert "token_ids" not in plain.choices[0].model_extra
    # max_tokens null: up to the context length (left out: OpenAI's 16).
    prompt = [7] * (MAX_MODEL_LEN - 20)
    for body, n in (({"max_tokens": None}, 20), ({}, 16)):
        status, _, raw = raw_post(http_target, "/completions", json.dumps(
            {"model": MODEL, "prompt": prompt, **GREEDY, **body}).encode())
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == n


# -- vLLM's echo, prompt_logprobs, min_p, skip_special_tokens (#26) ---------------------------

def prompt_logprobs_offline(offline: LLM, ids: list[int], k: int) -> list:
    """The offline engine's prompt logprobs for `ids` (entry 0 None)."""
    out = offline.generate([ids],
                           SamplingParams(max_tokens=1, prompt_logprobs=k))[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    return out.prompt_logprobs


def test_echo_with_logprobs_puts_the_prompt_first(http_target: HttpTarget, offline: LLM
                                                  ) -> None:
    """OpenAI's legacy shape, as vLLM serves it (what lm-evaluation-harness reads): the
    prompt's text before the choice's, its tokens first in logprobs with a null first
    logprob, then the generated ones."""
    client = http_target.client()
    ids = [256, *PROMPT.encode()]  # the byte tokenizer's BOS + bytes
    plain = complete(client, model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=2, **GREEDY,
                     return_tokens_as_token_ids=True)
    out = complete(client, model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=2, echo=True,
                   **GREEDY, return_tokens_as_token_ids=True)
    choice, gen = out.choices[0], plain.choices[0]
    assert choice.text == PROMPT + gen.text
    lp = choice.logprobs
    assert token_ids_of(lp) == ids + token_ids_of(gen.logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = prompt_logprobs_offline(offline, ids, 2)
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([w.logprob for w in want[1:]],
                                                          abs=1e-4)
    for top, w in zip(lp.top_logprobs[1:len(ids)], want[1:], strict=True):
        # The prompt's token first, then the 2 best (the token once if among them).
        assert list(top)[0] == f"token_id:{w.token_id}"
        assert top == pytest.approx({f"token_id:{w.token_id}": w.logprob,
                                     **{f"token_id:{t}": v for t, v in w.top}}, abs=1e-4)
    assert lp.token_logprobs[len(ids):] == pytest.approx(gen.logprobs.token_logprobs,
                                                         abs=1e-5)
    assert lp.text_offset == [len("token_id:") * i + sum(
        len(str(t)) for t in token_ids_of(lp)[:i]) for i in range(len(lp.tokens))]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 3


def test_echo_alone_streamed_and_of_token_ids(http_target: HttpTarget) -> None:
    client = http_target.client()
    # max_tokens 0: the prompt alone (vLLM computes one token and leaves it out).
    only = complete(client, model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
                    **GREEDY)
    assert only.choices[0].text == PROMPT
    assert len(only.choices[0].logprobs.tokens) == len(PROMPT) + 1
    whole = complete(client, model=MODEL, prompt=PROMPT, max_tokens=6, echo=True, logprobs=1,
                     n=2, **GREEDY)
    events = list(complete(client, model=MODEL, prompt=PROMPT, max_tokens=6, echo=True,
                           logprobs=1, n=2, stream=True, **GREEDY))
    for i in (0, 1):
        mine = [e.choices[0] for e in events if e.choices and e.choices[0].index == i]
        assert mine[0].text.startswith(PROMPT)  # the prompt comes in the first event
        assert mine[0].logprobs.token_logprobs[0] is None
        assert "".join(c.text for c in mine) == whole.choices[i].text
        assert [t for c in mine for t in c.logprobs.tokens] == whole.choices[i].logprobs.tokens
        assert [v for c in mine for v in c.logprobs.token_logprobs] == pytest.approx(
            whole.choices[i].logprobs.token_logprobs, abs=1e-5)
    # A token-id prompt echoes as its text, special tokens included (vLLM's decode).
    ids = [256, *b"token ids"]
    echoed = complete(client, model=MODEL, prompt=ids, max_tokens=2, echo=True, **GREEDY)
    alone = complete(client, model=MODEL, prompt=ids, max_tokens=2, **GREEDY)
    assert echoed.choices[0].text == "<s>token ids" + alone.choices[0].text
    # return_token_ids: the prompt comes back as prompt_token_ids, not as text (vLLM).
    both = complete(client, model=MODEL, prompt=PROMPT, max_tokens=2, echo=True,
                    return_token_ids=True, **GREEDY)
    assert both.choices[0].model_extra["prompt_token_ids"] == [256, *PROMPT.encode()]
    assert both.choices[0].text == complete(client, model=MODEL, prompt=PROMPT, max_tokens=2,
                                            **GREEDY).choices[0].text


def test_prompt_logprobs_are_vllms_and_the_engines(http_target: HttpTarget, offline: LLM
                                                   ) -> None:
    ids = [256, *PROMPT.encode()]
    status, _, raw = raw_post(http_target, "/completions", json.dumps(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 2, "prompt_logprobs": 3,
         **GREEDY}).encode())
    assert status == 200, raw
    want = prompt_logprobs_offline(offline, ids, 3)
    for choice in json.loads(raw)["choices"]:
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        for g, w in zip(got[1:], want[1:], strict=True):
            assert g[str(w.token_id)]["logprob"] == pytest.approx(w.logprob, abs=1e-4)
            assert g[str(w.token_id)]["decoded_token"] == chr(w.token_id)
            tops = [(int(t), e["rank"], e["logprob"]) for t, e in g.items() if e["rank"]]
            assert [(t, r) for t, r, _ in tops] == [(t, r) for r, (t, _) in
                                                    enumerate(w.top, 1)]
            assert [v for _, _, v in tops] == pytest.approx([v for _, v in w.top], abs=1e-4)
            in_top = [r for r, (t, _) in enumerate(w.top, 1) if t == w.token_id]
            assert g[str(w.token_id)]["rank"] == (in_top[0] if in_top else None)
    # Not on a stream (vLLM's rule), and not asked: absent.
    plain = complete(http_target.client(), model=MODEL, prompt=PROMPT, max_tokens=2, **GREEDY)
    assert "prompt_logprobs" not in plain.choices[0].model_extra


def test_min_p_and_skip_special_tokens_reach_the_engine(http_target: HttpTarget,
                                                        offline: LLM) -> None:
    client = http_target.client()
    # A seed whose draw holds a special token early (the byte tokenizer's BOS or EOS).
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 2.0,
          "seed": 30, "ignore_eos": True, "return_token_ids": True}
    loose = complete(client, **kw).choices[0]
    ids = loose.model_extra["token_ids"]
    assert {256, 257} & set(ids), "no special token drawn: the test would prove nothing"
    kept = complete(client, **kw, extra_body={"skip_special_tokens": False}).choices[0]
    assert kept.model_extra["token_ids"] == ids  # the same tokens, other text
    want = offline.generate([PROMPT], SamplingParams(max_tokens=24, temperature=2.0, seed=30,
                                                     ignore_eos=True,
                                                     skip_special_tokens=False))[0].outputs[0]
    assert want.token_ids == ids and kept.text == want.text != loose.text
    assert ("<s>" in kept.text or "</s>" in kept.text) and "</s>" not in loose.text
    strict = complete(client, **kw, extra_body={"min_p": 0.5}).choices[0]
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=24, temperature=2.0, seed=30,
                                                    ignore_eos=True, min_p=0.5))[0].outputs[0]
    assert strict.model_extra["token_ids"] == ref.token_ids != ids
