"""The contract's request limits (proto.requests) and the server pieces both servers share for
bad input (proto.serving): undecodable bodies, throttled warnings, aborted calls freed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import weakref

import grpc
import pytest

from pagekv.deploy.redis_server import free_port
from pagekv.proto import serving
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.requests import (
    MAX_CACHE_SALT_BYTES,
    MAX_LOGPROBS,
    MAX_REQUEST_ID_BYTES,
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    BadRequest,
    PromptLimits,
    check_request,
    parse_prompt,
    prompt_is_large,
)

LIMITS = PromptLimits(max_bytes=100, max_tokens=50)


def byte_encode(text: str) -> list[int]:
    return [256, *text.encode("utf-8")]


def refusal(req: pb.GenerateRequest) -> str:
    with pytest.raises(BadRequest) as err:
        check_request(req, LIMITS)
    return str(err.value)


@pytest.mark.parametrize("field,limit", [("request_id", MAX_REQUEST_ID_BYTES),
                                         ("cache_salt", MAX_CACHE_SALT_BYTES)])
def test_string_fields_are_bounded_in_utf8_bytes(field: str, limit: int) -> None:
    check_request(pb.GenerateRequest(text="hi", **{field: "x" * limit}), LIMITS)
    assert refusal(pb.GenerateRequest(text="hi", **{field: "x" * (limit + 1)})) == (
        f"{field} has {limit + 1} bytes; the limit is {limit}")
    # Two bytes each: half as many characters are already too many.
    wide = "é" * (limit // 2 + 1)
    assert refusal(pb.GenerateRequest(text="hi", **{field: wide})).startswith(
        f"{field} has {2 * len(wide)} bytes")


def test_stop_token_ids_are_bounded() -> None:
    ok = pb.SamplingParams(stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    check_request(pb.GenerateRequest(text="hi", sampling=ok), LIMITS)
    over = pb.SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
    assert "sampling.stop_token_ids has" in refusal(pb.GenerateRequest(text="hi", sampling=over))


def test_stop_strings_and_logprobs_are_bounded() -> None:
    def req(**kw) -> pb.GenerateRequest:
        return pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**kw))

    check_request(req(stop=["x" * MAX_STOP_STRING_BYTES] * MAX_STOP_STRINGS,
                      logprobs=MAX_LOGPROBS), LIMITS)
    assert refusal(req(stop=["x"] * (MAX_STOP_STRINGS + 1))) == (
        f"sampling.stop has {MAX_STOP_STRINGS + 1} strings; the limit is {MAX_STOP_STRINGS}")
    assert refusal(req(stop=["ok", "é" * (MAX_STOP_STRING_BYTES // 2 + 1)])) == (
        f"sampling.stop[1] has {MAX_STOP_STRING_BYTES + 2} bytes; the limit is "
        f"{MAX_STOP_STRING_BYTES}")
    assert refusal(req(stop=["ok", ""])).startswith("sampling.stop[1] is empty")
    assert refusal(req(logprobs=MAX_LOGPROBS + 1)) == (
        f"sampling.logprobs is {MAX_LOGPROBS + 1}; the limit is {MAX_LOGPROBS}")
    check_request(req(prompt_logprobs=MAX_LOGPROBS, min_p=1.0), LIMITS)
    check_request(req(prompt_logprobs=0, min_p=0.0), LIMITS)
    assert refusal(req(prompt_logprobs=MAX_LOGPROBS + 1)) == (
        f"sampling.prompt_logprobs is {MAX_LOGPROBS + 1}; the limit is {MAX_LOGPROBS}")
    for bad in (-0.5, 1.5, float("nan"), float("inf")):
        assert refusal(req(min_p=bad)).startswith("sampling.min_p must be in [0, 1], got")


def test_prompt_bounds_before_and_after_tokenizing() -> None:
    check_request(pb.GenerateRequest(text="a" * 100), LIMITS)
    assert refusal(pb.GenerateRequest(text="a" * 101)) == (
        "prompt text has 101 bytes; the limit is 100 (--max-prompt-bytes)")
    check_request(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 50)), LIMITS)
    assert refusal(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 51))) == (
        "prompt token_ids has 51 ids; the limit is 50 (--max-prompt-tokens)")
    # Within the bytes, past the tokens (BOS + 50 bytes): refused once tokenized.
    req = pb.GenerateRequest(text="a" * 50)
    check_request(req, LIMITS)
    with pytest.raises(BadRequest, match=r"prompt text has 51 tokens; the limit is 50"):
        parse_prompt(req, byte_encode, LIMITS)
    assert list(parse_prompt(pb.GenerateRequest(text="a" * 49), byte_encode,
                             LIMITS).token_ids) == byte_encode("a" * 49)


def test_lora_id_is_still_refused_first() -> None:
    assert "lora_id" in refusal(pb.GenerateRequest(text="a" * 500, lora_id=1))


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        PromptLimits(max_bytes=0)


def test_the_largest_valid_request_fits_the_message_limit() -> None:
    limits = PromptLimits()
    common = dict(request_id="r" * MAX_REQUEST_ID_BYTES, cache_salt="s" * MAX_CACHE_SALT_BYTES,
                  sampling=pb.SamplingParams(
                      max_tokens=2**32 - 1, temperature=1.0, top_p=1.0, top_k=-(2**31),
                      seed=2**64 - 1, n=2**32 - 1, ignore_eos=True,
                      stop_token_ids=[2**32 - 1] * MAX_STOP_TOKEN_IDS,
                      stop=["\U0010ffff" * (MAX_STOP_STRING_BYTES // 4)] * MAX_STOP_STRINGS,
                      min_tokens=2**32 - 1, presence_penalty=-2.0, frequency_penalty=-2.0,
                      repetition_penalty=1e-30, logprobs=MAX_LOGPROBS))
    text = pb.GenerateRequest(text="a" * limits.max_bytes, **common)
    ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**32 - 1] * limits.max_tokens),
                             **common)
    for req in (text, ids):
        check_request(req, limits)
        assert req.ByteSize() <= limits.max_message_bytes


def test_large_prompts_go_to_a_thread() -> None:
    assert not prompt_is_large(pb.GenerateRequest(text="a" * 100))
    assert prompt_is_large(pb.GenerateRequest(text="a" * 100_000))
    assert prompt_is_large(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 100_000)))
    assert not prompt_is_large(pb.GenerateRequest())


def test_throttled_warning(monkeypatch: pytest.MonkeyPatch,
                           caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    monkeypatch.setattr(serving.time, "monotonic", lambda: now[0])
    warn = serving.ThrottledWarning(logging.getLogger("test.throttle"), 10.0)
    with caplog.at_level(logging.WARNING, "test.throttle"):
        for _ in range(5):
            warn.warn("bad %s", "x")
        now[0] += 10.0
        warn.warn("bad %s", "y")
    assert [r.getMessage() for r in caplog.records] == [
        "bad x", "bad y (and 4 more since the last warning)"]


# -- a real aio server with add_servicer --------------------------------------------------------

class Big:
    """Stands for a request's tokens: what must not outlive a refused call."""


class Servicer:
    def __init__(self) -> None:
        self.seen: list[str] = []
        self.big: weakref.ref[Big] | None = None

    async def Generate(self, request, context):
        self.seen.append(request.text)
        if request.text == "refuse":
            tokens = Big()
            self.big = weakref.ref(tokens)
            try:
                raise BadRequest("no")
            except BadRequest as exc:  # how the pod and the router refuse a request
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.GenerateResponse(request_id=request.request_id)

    async def GenerateStream(self, request, context):
        self.seen.append(request.text)
        for i in range(3):
            yield pb.GenerateChunk(request_id=request.request_id, index=i)


BAD_BODIES = {
    "invalid UTF-8 in text": b"\x12\x02\xff\xfe",
    "invalid UTF-8 in request_id": b"\x0a\x01\x80\x12\x01a",
    "invalid UTF-8 in cache_salt": b"\x12\x01a\x2a\x02\xc3\x28",
    "truncated": pb.GenerateRequest(text="hello world", request_id="r").SerializeToString()[:-4],
}


@contextlib.asynccontextmanager
async def serving_channel(servicer: Servicer, on_refused=None):
    server = grpc.aio.server()
    serving.add_servicer(server, pb.DESCRIPTOR.services_by_name["Generation"], servicer,
                         on_refused)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield (ch.unary_unary("/pagekv.v1.Generation/Generate"),
                   ch.unary_stream("/pagekv.v1.Generation/GenerateStream"))
    finally:
        await server.stop(None)


async def _drain(call) -> list:
    return [item async for item in call]


OK = pb.GenerateRequest(text="fine", request_id="r1").SerializeToString()


def test_add_servicer_refuses_undecodable_bodies(caplog: pytest.LogCaptureFixture) -> None:
    servicer, refused = Servicer(), []

    async def run() -> None:
        async with serving_channel(servicer, lambda: refused.append(1)) as (unary, stream):
            for name, body in BAD_BODIES.items():
                for call in (lambda b: unary(b, timeout=5),
                             lambda b: _drain(stream(b, timeout=5))):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(body)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                    assert err.value.details().startswith(
                        "cannot decode the request as pagekv.v1.GenerateRequest: "), name
            # Good bodies still go through, both kinds of call.
            assert pb.GenerateResponse.FromString(await unary(OK)).request_id == "r1"
            chunks = [pb.GenerateChunk.FromString(c) for c in await _drain(stream(OK))]
            assert [c.index for c in chunks] == [0, 1, 2]

    with caplog.at_level(logging.WARNING, "pagekv.proto.serving"):
        asyncio.run(run())
    assert servicer.seen == ["fine", "fine"]  # the bad ones never reached the servicer
    assert len(refused) == 2 * len(BAD_BODIES)
    warnings = [r.getMessage() for r in caplog.records if r.name == "pagekv.proto.serving"]
    assert len(warnings) == 1, warnings  # eight refusals, one line (the rest held back)
    assert "refused undecodable pagekv.v1.Generation.Generate" in warnings[0]


def test_an_aborted_call_frees_what_its_handler_held() -> None:
    """When it ends, not at the next garbage collection: grpc keeps an aborted call's error,
    whose traceback holds the handler's frames (it holds only the last call's state, until
    the next call)."""
    servicer = Servicer()

    async def run() -> None:
        async with serving_channel(servicer) as (unary, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await unary(pb.GenerateRequest(text="refuse").SerializeToString())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await unary(OK)
            assert servicer.big is not None and servicer.big() is None

    gc.disable()
    try:
        asyncio.run(run())
    finally:
        gc.enable()
