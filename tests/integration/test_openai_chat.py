"""/v1/chat/completions with the real chat model (SmolLM2-135M-Instruct), through the official
`openai` client against the pod and the router: the model's own template, answers that end
at the end of turn, the same greedy tokens as gRPC and the offline LLM.chat, streamed deltas,
stop strings across BPE tokens, chat logprobs."""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.kvnode.pod.client import chat_token_ids
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from tests.integration.openai_fixtures import CHAT_MODEL

pytestmark = pytest.mark.integration

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


@pytest.fixture(params=["pod", "router"])
def via(request: pytest.FixtureRequest, chat_cluster: LocalCluster) -> tuple[str, str]:
    child = chat_cluster.pods[0] if request.param == "pod" else chat_cluster.router
    return f"http://127.0.0.1:{child.http_port}/v1", child.address


def client_of(via: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=via[0], api_key="unused", max_retries=0)


def test_chat_answer_ends_at_end_of_turn(via: tuple[str, str]) -> None:
    out = client_of(via).chat.completions.create(model=CHAT_MODEL, messages=MESSAGES,
                                                 max_tokens=40, temperature=0)
    choice = out.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] is None
    assert "<|im_end|>" not in choice.message.content
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.usage.prompt_tokens == len(chat_token_ids(CHAT_MODEL, QUESTION, SYSTEM))


def test_chat_greedy_tokens_equal_grpc(via: tuple[str, str]) -> None:
    out = client_of(via).chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True})
    http_ids = [int(t.token.removeprefix("token_id:")) for t in out.choices[0].logprobs.content]
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(via[1]))
    resp = stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=chat_token_ids(CHAT_MODEL, QUESTION, SYSTEM)),
        sampling=pb.SamplingParams(max_tokens=24, temperature=0.0)), timeout=120)
    assert http_ids == list(resp.completions[0].token_ids)
    assert out.choices[0].message.content == resp.completions[0].text


def test_chat_stream_deltas(via: tuple[str, str]) -> None:
    client = client_of(via)
    whole = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES,
                                           max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in deltas[1:])
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == \
        whole.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_stop_string_across_tokens(via: tuple[str, str]) -> None:
    client = client_of(via)
    answer = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES,
                                            max_tokens=40, temperature=0
                                            ).choices[0].message.content
    assert "Paris" in answer
    stop = "France is"  # several BPE tokens in SmolLM2's vocabulary
    assert stop in answer, answer
    out = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=40,
                                         temperature=0, stop=[stop, "never-seen"])
    choice = out.choices[0]
    assert choice.message.content == answer[:answer.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=40, temperature=0, stop=stop,
        stream=True))
    assert streamed == choice.message.content


def test_chat_logprobs_shape(via: tuple[str, str]) -> None:
    out = client_of(via).chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    text = ""
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        text += entry.token
    assert text == out.choices[0].message.content


def test_text_parts_and_async_client(via: tuple[str, str]) -> None:
    parts = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
             {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    plain = client_of(via).chat.completions.create(model=CHAT_MODEL, messages=MESSAGES,
                                                   max_tokens=12, temperature=0)

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=via[0], api_key="unused", max_retries=0)
        try:
            outs = await asyncio.gather(*(client.chat.completions.create(
                model=CHAT_MODEL, messages=m, max_tokens=12, temperature=0)
                for m in (parts, MESSAGES)))
            return [o.choices[0].message.content for o in outs]
        finally:
            await client.close()

    assert asyncio.run(run()) == [plain.choices[0].message.content] * 2


def test_chat_prompt_logprobs_are_the_conversations(via: tuple[str, str]) -> None:
    """vLLM's chat prompt_logprobs sit on the response: those of the rendered conversation,
    as /v1/completions gives them for the same ids (from /tokenize)."""
    import json
    import urllib.request

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(via[0].removesuffix("/v1") + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    chat = post("/v1/chat/completions", {"model": CHAT_MODEL, "messages": MESSAGES,
                                         "max_tokens": 2, "temperature": 0,
                                         "prompt_logprobs": 1})
    ids = post("/tokenize", {"messages": MESSAGES})["tokens"]
    plain = post("/v1/completions", {"model": CHAT_MODEL, "prompt": ids, "max_tokens": 2,
                                     "temperature": 0, "prompt_logprobs": 1})
    got, want = chat["prompt_logprobs"], plain["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids) == chat["usage"]["prompt_tokens"]
    assert [sorted(g) for g in got[1:]] == [sorted(w) for w in want[1:]]
    for g, w, t in zip(got[1:], want[1:], ids[1:], strict=True):
        assert g[str(t)]["logprob"] == pytest.approx(w[str(t)]["logprob"], abs=1e-5)
    assert "prompt_logprobs" not in chat["choices"][0]
