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
