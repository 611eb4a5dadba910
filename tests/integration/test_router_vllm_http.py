"""The router's vLLM stub (router/openai_forward.py) against a scripted OpenAI server on
loopback, real HTTP: the request body in vLLM's names, vLLM's stream (text only, as before
return_token_ids; then ids and logprobs) as a PageKV pod's chunks, every failure as the gRPC
status a pod would give, kept-alive connections, and a cancel that closes the stream. The
same stub against real pods through a real router: test_router_vllm.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from pagekv.deploy.redis_server import free_port
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.router.openai_forward import VllmStub, completion_body

pytestmark = pytest.mark.integration

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


class ScriptedOpenAI:
    """Each request gets the next reply of `replies` (raw HTTP written by the test); the
    bodies and the connections are counted."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.bodies: list[dict[str, Any]] = []
        self.heads: list[str] = []
        self.connections = 0
        self.client_gone = asyncio.Event()

    async def __aenter__(self) -> ScriptedOpenAI:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                length = next(int(line.split(":", 1)[1]) for line in head.split("\r\n")
                              if line.lower().startswith("content-length:"))
                self.heads.append(head)
                self.bodies.append(json.loads(await reader.readexactly(length)))
                if not await self.replies.pop(0)(reader, writer):
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse(*events: dict[str, Any], done: bool = True, marker: bool = True) -> Reply:
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for event in events:
            writer.write(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
        if done:
            writer.write((_chunk(b"data: [DONE]\n\n") if marker else b"") + b"0\r\n\r\n")
        await writer.drain()
        return done  # not done: the body is cut off here
    return reply


def status(code: int, body: dict[str, Any] | str) -> Reply:
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d"
                     b"\r\n\r\n%s" % (code, len(data), data))
        await writer.drain()
        return True
    return reply


def hang(server: ScriptedOpenAI, *events: dict[str, Any]) -> Reply:
    """Some events, then nothing until the client closes the connection."""
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await sse(*events, done=False)(reader, writer)
        await reader.read()
        server.client_gone.set()
        return False
    return reply


def event(*choices: dict[str, Any], usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's stream event (CompletionStreamResponse)."""
    return {"id": "cmpl-vllm-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": list(choices), "usage": usage}


def choice(index: int, text: str, finish: str | None = None, stop: Any = None,
           **extra: Any) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish,
            "stop_reason": stop, **extra}


USAGE = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
         "prompt_tokens_details": {"cached_tokens": 32}}


def request(**sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="rq-1", token_ids=pb.TokenIds(ids=list(range(40))),
                              sampling=pb.SamplingParams(**sampling))


async def stream(stub: VllmStub, req: pb.GenerateRequest, timeout: float | None = 10.0
                 ) -> list[pb.GenerateChunk]:
    return [c async for c in stub.GenerateStream(req, timeout=timeout)]


async def failure(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details()


def test_the_body_carries_every_sampling_field_under_vllms_name() -> None:
    req = pb.GenerateRequest(
        request_id="r9", token_ids=pb.TokenIds(ids=[5, 6, 7]), cache_salt="s",
        sampling=pb.SamplingParams(
            max_tokens=12, temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1, n=3,
            stop=["\n\n"], stop_token_ids=[2], ignore_eos=True, min_tokens=4,
            presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.1,
            logprobs=2),
        kv_source=pb.KvSource(pod_id="p", address="a:1", num_blocks=1))
    assert completion_body(req) == {
        "prompt": [5, 6, 7], "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True, "max_tokens": 12, "temperature": 0.7, "top_p": 0.9,
        "top_k": 40, "seed": -1, "n": 3, "stop": ["\n\n"], "stop_token_ids": [2],
        "ignore_eos": True, "min_tokens": 4, "presence_penalty": 0.5,
        "frequency_penalty": -0.25, "repetition_penalty": 1.1, "logprobs": 2,
        "return_tokens_as_token_ids": True, "cache_salt": "s", "request_id": "r9"}
    # Unset: the vLLM server's defaults, but max_tokens null (up to the context, as on a pod).
    bare = completion_body(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])))
    assert bare == {"prompt": [1], "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": True, "max_tokens": None}
    # vLLM's names for #26's fields; prompt_logprobs through echo (a stream cannot carry
    # vLLM's own prompt_logprobs field), with as many top tokens as the larger ask.
    sp = pb.SamplingParams(min_p=0.05, skip_special_tokens=False, prompt_logprobs=3,
                           logprobs=1)
    body = completion_body(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=sp))
    assert {k: body[k] for k in ("min_p", "skip_special_tokens", "echo", "logprobs",
                                 "return_tokens_as_token_ids")} == {
        "min_p": 0.05, "skip_special_tokens": False, "echo": True, "logprobs": 3,
        "return_tokens_as_token_ids": True}
    assert "prompt_logprobs" not in body
    only = completion_body(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=(
        pb.SamplingParams(prompt_logprobs=0))))
    assert (only["echo"], only["logprobs"]) == (True, 0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        completion_body(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), lora_id=3))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_id" in info.value.details()


def test_a_text_only_vllm_stream_reads_as_a_pods_chunks() -> None:
    async def go() -> None:
        async with ScriptedOpenAI() as server:
            events = [event(choice(0, "He")), event(choice(1, "Wo")),
                      event(choice(0, "llo", "stop", 7)), event(choice(1, "rld", "length")),
                      event(usage=USAGE)]
            server.replies = [sse(*events), sse(*events)]
            stub = VllmStub(server.address, token="tok")
            chunks = await stream(stub, request(max_tokens=3, n=2))
            assert [(c.index, c.text) for c in chunks] == [(0, "He"), (1, "Wo"), (0, "llo"),
                                                           (1, "rld")]
            assert [c.finish_reason for c in chunks] == [0, 0, pb.FINISH_REASON_STOP,
                                                         pb.FINISH_REASON_LENGTH]
            assert chunks[2].stop_token_id == 7 and not chunks[3].WhichOneof("stop_reason")
            # The usage rides on the very last chunk only, as on a PageKV pod.
            assert [c.HasField("usage") for c in chunks] == [False] * 3 + [True]
            assert chunks[-1].usage == pb.Usage(prompt_tokens=40, completion_tokens=3,
                                                cached_tokens=32, cached_tokens_gpu=32)
            assert {c.request_id for c in chunks} == {"rq-1"}
            assert not any(c.token_ids for c in chunks)  # an older vLLM: no ids
            response = await stub.Generate(request(max_tokens=3, n=2), timeout=10)
            assert [(c.index, c.text, c.finish_reason) for c in response.completions] == [
                (0, "Hello", pb.FINISH_REASON_STOP), (1, "World", pb.FINISH_REASON_LENGTH)]
            assert response.completions[0].stop_token_id == 7
            assert response.usage.cached_tokens == 32 and response.request_id == "rq-1"
            assert server.bodies[0] == completion_body(request(max_tokens=3, n=2))
            head = server.heads[0].lower()
            assert head.startswith("post /v1/completions http/1.1")
            assert "authorization: bearer tok" in head and "x-request-id: rq-1" in head
            assert server.connections == 1  # kept alive for the second call
            await stub.close()

    asyncio.run(go())


def test_token_ids_logprobs_and_a_stop_string_come_back() -> None:
    lp = {"tokens": ["token_id:11", "token_id:12"], "token_logprobs": [-0.5, -1.5],
          "top_logprobs": [{"token_id:11": -0.5, "token_id:3": -0.25},
                           {"token_id:12": -1.5}], "text_offset": [0, 1]}
    async def go() -> None:
        async with ScriptedOpenAI() as server:
            server.replies = [sse(
                event(choice(0, "", prompt_token_ids=list(range(40)))),
                event(choice(0, "ab", "stop", "\n", token_ids=[11, 12], logprobs=lp)),
                event(usage={"prompt_tokens": 40, "completion_tokens": 2}))]
            stub = VllmStub(server.address)
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(40))),
                                     sampling=pb.SamplingParams(logprobs=1))
            (chunk,) = await stream(stub, req)
            assert list(chunk.token_ids) == [11, 12] and chunk.stop_string == "\n"
            assert chunk.request_id == "cmpl-vllm-1"  # none given: vLLM's id
            assert [(t.sampled.token_id, t.sampled.logprob) for t in chunk.logprobs] == [
                (11, -0.5), (12, -1.5)]
            # vLLM's top_logprobs hold the chosen token too: the 1 best is what a pod sends.
            assert [x.token_id for x in chunk.logprobs[0].top] == [3]
            assert chunk.usage.cached_tokens == 0  # vLLM without prompt tokens details
            await stub.close()

    asyncio.run(go())


def echo_logprobs(prompt: list[int], gen: list[int], k: int) -> dict[str, Any]:
    """vLLM's echo logprobs: the prompt's positions (the first null), then the generated
    ones; each top holds the chosen token and the k best (ids 900.. here)."""
    ids = prompt + gen
    tops: list[Any] = [None] + [
        {f"token_id:{t}": -1.0 - i, **{f"token_id:{900 + j}": -0.1 * (j + 1)
                                        for j in range(k)}} for i, t in enumerate(ids[1:])]
    return {"tokens": [f"token_id:{t}" for t in ids],
            "token_logprobs": [None] + [-1.0 - i for i in range(len(ids) - 1)],
            "top_logprobs": tops, "text_offset": list(range(len(ids)))}


def test_prompt_logprobs_come_back_from_vllms_echo() -> None:
    prompt = [5, 6, 7, 8]
    async def go() -> None:
        async with ScriptedOpenAI() as server:
            stub = VllmStub(server.address)
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=(
                pb.SamplingParams(prompt_logprobs=2, logprobs=1, n=2)))
            first = [choice(i, "", token_ids=[20 + i], prompt_token_ids=prompt,
                            logprobs=echo_logprobs(prompt, [20 + i], 2)) for i in (0, 1)]
            later = [choice(i, "x", "length", token_ids=[30 + i],
                            logprobs={"tokens": [f"token_id:{30 + i}"],
                                      "token_logprobs": [-0.5], "text_offset": [0],
                                      "top_logprobs": [{f"token_id:{30 + i}": -0.5,
                                                        "token_id:900": -0.1,
                                                        "token_id:901": -0.2}]})
                     for i in (0, 1)]
            server.replies = [sse(*(event(c) for c in [*first, *later]),
                                  event(usage={"prompt_tokens": 4, "completion_tokens": 4}))]
            chunks = await stream(stub, req)
            # Once, on the stream's first chunk: entry j is prompt token j + 1.
            got = chunks[0].prompt_logprobs
            assert [(e.sampled.token_id, e.sampled.logprob) for e in got] == [
                (6, -1.0), (7, -2.0), (8, -3.0)]
            assert [[x.token_id for x in e.top] for e in got] == [[900, 901]] * 3
            assert all(not c.prompt_logprobs for c in chunks[1:])
            # Each choice's own logprobs: its tokens only, the 1 best asked for.
            for c in chunks:
                assert [e.sampled.token_id for e in c.logprobs] == list(c.token_ids)
                assert all([x.token_id for x in e.top] == [900] for e in c.logprobs)
            assert [list(c.token_ids) for c in chunks] == [[20], [21], [30], [31]]
            # Unary: on completion 0.
            server.replies = [sse(*(event(c) for c in [*first, *later]))]
            response = await stub.Generate(req, timeout=10)
            assert len(response.completions[0].prompt_logprobs) == 3
            assert not response.completions[1].prompt_logprobs
            # prompt_logprobs alone: no generated logprobs come back.
            server.replies = [sse(event(first[0]), event(later[0]))]
            chunks = await stream(stub, pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(prompt_logprobs=1)))
            assert len(chunks[0].prompt_logprobs) == 3 and not any(c.logprobs for c in chunks)
            assert [[x.token_id for x in e.top] for e in chunks[0].prompt_logprobs] == [[900]] * 3
            # A server that ignores return_token_ids would echo the prompt's text: refused.
            old = {k: v for k, v in first[0].items() if k not in ("token_ids",
                                                                   "prompt_token_ids")}
            server.replies = [sse(event(old))]
            code, details = await failure(stream(stub, req))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in details
            await stub.close()

    asyncio.run(go())


def test_every_failure_is_the_status_a_pod_would_give() -> None:
    async def go() -> None:
        async with ScriptedOpenAI() as server:
            stub = VllmStub(server.address)
            cases = [
                (status(400, {"error": {"message": "max_tokens is too large", "type":
                                        "BadRequestError", "param": "max_tokens", "code": 400}}),
                 grpc.StatusCode.INVALID_ARGUMENT, "max_tokens is too large"),
                (status(400, {"object": "error", "message": "older vLLM's shape",
                              "type": "BadRequestError", "code": 400}),
                 grpc.StatusCode.INVALID_ARGUMENT, "older vLLM's shape"),
                (status(503, "Service Unavailable"), grpc.StatusCode.UNAVAILABLE,
                 "Service Unavailable"),
                (status(429, {"error": {"message": "queue full"}}),
                 grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
                (status(500, {"error": {"message": "engine dead"}}), grpc.StatusCode.INTERNAL,
                 "engine dead"),
                (sse(event(choice(0, "x")), {"error": {"message": "bad token", "code": 400}}),
                 grpc.StatusCode.INVALID_ARGUMENT, "bad token"),
                (sse(event(choice(0, "x")), done=False), grpc.StatusCode.UNAVAILABLE,
                 "broke off"),
            ]
            for reply, code, words in cases:
                server.replies = [reply]
                got = await failure(stream(stub, request()))
                assert got[0] == code and words in got[1], (code, got)
            server.replies = [hang(server)]
            code, details = await failure(stream(stub, request(), timeout=0.3))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and server.address in details
            await stub.close()
        gone = VllmStub(f"127.0.0.1:{free_port()}")  # nobody listens there
        code, details = await failure(stream(gone, request()))
        assert code == grpc.StatusCode.UNAVAILABLE and "ConnectionRefused" in details

    asyncio.run(go())


def test_a_stale_kept_alive_connection_is_replaced_and_a_cancel_closes_the_stream() -> None:
    async def go() -> None:
        async with ScriptedOpenAI() as server:
            stub = VllmStub(server.address)
            done = sse(event(choice(0, "a", "length")), event(usage=USAGE))

            async def then_close(reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter) -> bool:
                await done(reader, writer)
                return False  # the server's idle timeout: it closes the kept connection

            unmarked = sse(event(choice(0, "a", "length")), event(usage=USAGE), marker=False)
            server.replies = [then_close, unmarked, done]
            assert len(await stream(stub, request())) == 1
            await asyncio.sleep(0.05)
            # On a new connection; a body that ends without [DONE] ends the stream too.
            (last,) = await stream(stub, request())
            assert last.usage.cached_tokens == 32
            assert len(await stream(stub, request())) == 1
            assert server.connections == 2  # the last two on one kept-alive connection
            server.replies = [hang(server, event(choice(0, "first")))]
            call = stub.GenerateStream(request(), timeout=10)
            first = await call.__aiter__().__anext__()
            assert first.text == "first"
            assert call.cancel()
            await asyncio.wait_for(server.client_gone.wait(), 5)  # the server saw it close
            await stub.close()

    asyncio.run(go())
