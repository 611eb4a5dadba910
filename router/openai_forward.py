"""Forwarding to a vLLM pod: its OpenAI server's /v1/completions behind the two methods of
a PageKV pod's Generation stub, so router/server.py routes, retries and streams back the
same way for both kinds of pod.

The request goes out as the token ids the router hashed (`prompt`: a list of ints), always
streamed, with usage at the end (`stream_options.include_usage`), the generated ids
(`return_token_ids`, vLLM >= 0.10.2; older servers ignore it and chunks carry text only) and,
with logprobs, tokens as ids (`return_tokens_as_token_ids`). SamplingParams fields map to
vLLM's names (min_p, skip_special_tokens too); an unset field is left out, so the vLLM
server's defaults apply, except max_tokens: null means up to the context length, as unset
does on a PageKV pod. No `model`: vLLM serves its own. No kv_source: a vLLM pod cannot pull.

prompt_logprobs: vLLM refuses them on a stream (its events have no place for them), so they
are asked for as `echo` with `logprobs` (vLLM then computes them, as many top tokens as
`logprobs`: the larger of the two asked for), whose first event of each choice puts the
prompt's tokens first in its logprobs; openai_stream.py takes them out of there, each cut to
the number of top tokens asked for. With return_token_ids the echo adds no prompt text
(vLLM's rule); a server that ignores return_token_ids would prepend it, so such a server's
echo is refused (INVALID_ARGUMENT) rather than read.

The events become a PageKV pod's GenerateChunks in router/openai_stream.py.

Failures are gRPC statuses, as a PageKV pod's would be: no connection, 502 or 503 ->
UNAVAILABLE (so the router tries the next pod), 400 -> INVALID_ARGUMENT with vLLM's
message, the deadline -> DEADLINE_EXCEEDED. `cancel()` closes the HTTP stream, which makes
the vLLM server abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import ssl
import struct
import types
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator
from typing import Any

import grpc

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.requests import NO_INT_ADAPTER_IDS
from pagekv.router.http_client import BrokenResponse, ConnectFailed, HttpOrigin, Response
from pagekv.router.openai_stream import (
    StreamReader,
    error_message,
    response_of,
    rpc_error,
    sse_events,
    status_code,
)

COMPLETIONS_PATH = "/v1/completions"
_U64 = 1 << 64


def _float32(value: float) -> float:
    """The shortest decimal that is the same float32: 0.7, not 0.699999988079071."""
    for digits in range(6, 10):
        short = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", short))[0] == value:
            return short
    return value


def completion_body(request: pb.GenerateRequest) -> dict[str, Any]:
    """The /v1/completions body of one Generate request (vLLM's parameter names)."""
    if request.HasField("lora_id"):  # (the router refuses it first: refuse_unsupported)
        raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, NO_INT_ADAPTER_IDS)
    sp = request.sampling
    prompt: Any = list(request.token_ids.ids) if request.HasField("token_ids") else request.text
    body: dict[str, Any] = {
        "prompt": prompt, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "max_tokens": sp.max_tokens if sp.HasField("max_tokens") else None}
    if request.lora_name:  # vLLM names an adapter as the model
        body["model"] = request.lora_name
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if sp.HasField(name):
            body[name] = _float32(getattr(sp, name))
    if sp.HasField("top_k") and sp.top_k > 0:
        body["top_k"] = sp.top_k
    if sp.HasField("seed"):  # vLLM takes a signed 64-bit seed: the same 64 bits
        body["seed"] = sp.seed - _U64 if sp.seed >= _U64 // 2 else sp.seed
    if sp.n > 1:
        body["n"] = sp.n
    if sp.stop:
        body["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        body["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        body["ignore_eos"] = True
    if sp.min_tokens:
        body["min_tokens"] = sp.min_tokens
    if sp.HasField("min_p"):
        body["min_p"] = _float32(sp.min_p)
    if sp.HasField("skip_special_tokens"):
        body["skip_special_tokens"] = sp.skip_special_tokens
    if sp.HasField("logprobs"):
        body["logprobs"] = sp.logprobs
        body["return_tokens_as_token_ids"] = True  # "token_id:<id>": ids, not texts
    if sp.HasField("prompt_logprobs"):  # through echo: see the module's docstring
        body["echo"] = True
        body["logprobs"] = max(sp.prompt_logprobs, body.get("logprobs", 0))
        body["return_tokens_as_token_ids"] = True
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    if request.request_id:
        body["request_id"] = request.request_id
    return body


class _StreamCall:
    """What GenerateStream returns: the chunks, and `cancel()`.

    `chunks(call)` starts the stream of chunks, which sets `call.response` to the HTTP
    response it reads and `call.done` when it ends."""

    def __init__(self, chunks: Callable[[_StreamCall], AsyncGenerator[pb.GenerateChunk, None]]
                 ) -> None:
        self.response: Response | None = None
        self.done = False
        self._closing: asyncio.Task[None] | None = None
        self._chunks = chunks(self)

    def __aiter__(self) -> AsyncIterator[pb.GenerateChunk]:
        return self._chunks

    def cancel(self) -> bool:
        """Close the HTTP stream now (a no-op once the call is done)."""
        if self.done:
            return False
        response, self.response = self.response, None
        if response is not None:
            response.abort()
        chunks = self._chunks
        assert isinstance(chunks, types.AsyncGeneratorType)  # (ag_running is not in the ABC)
        if not chunks.ag_running:  # suspended at a chunk: its clean-up runs now
            self._closing = asyncio.get_running_loop().create_task(chunks.aclose())
        return True


class _UnaryCall(_StreamCall):
    """What Generate returns: awaited, the whole response."""

    def __await__(self) -> Generator[Any, None, pb.GenerateResponse]:
        return self._collect().__await__()

    async def _collect(self) -> pb.GenerateResponse:
        return response_of([chunk async for chunk in self._chunks])


class VllmStub:
    """A vLLM pod's OpenAI server as a Generation stub (Generate, GenerateStream)."""

    def __init__(self, address: str, token: str | None = None,
                 connect_timeout_s: float = 3.0, ssl_context: ssl.SSLContext | None = None
                 ) -> None:
        self.address = address
        self.origin = HttpOrigin(address, connect_timeout_s=connect_timeout_s,
                                 ssl_context=ssl_context)
        self._auth = [("Authorization", f"Bearer {token}")] if token else []

    def Generate(self, request: pb.GenerateRequest, timeout: float | None = None,  # noqa: N802
                 **_: Any) -> _UnaryCall:
        return _UnaryCall(functools.partial(self._chunks, request, timeout))

    def GenerateStream(self, request: pb.GenerateRequest,  # noqa: N802 - the stub's names
                       timeout: float | None = None, **_: Any) -> _StreamCall:
        return _StreamCall(functools.partial(self._chunks, request, timeout))

    async def close(self) -> None:
        await self.origin.close()

    def _gone(self, why: str) -> grpc.aio.AioRpcError:
        return rpc_error(grpc.StatusCode.UNAVAILABLE, f"vLLM pod at {self.address}: {why}")

    async def _chunks(self, request: pb.GenerateRequest, timeout: float | None,
                      call: _StreamCall) -> AsyncGenerator[pb.GenerateChunk, None]:
        body = json.dumps(completion_body(request), separators=(",", ":")).encode()
        headers = [("Content-Type", "application/json"), ("Accept", "text/event-stream"),
                   ("User-Agent", "pagekv-router"), *self._auth]
        if request.request_id:
            headers.append(("X-Request-Id", request.request_id))
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        response = None
        try:
            response = call.response = await self.origin.request(
                "POST", COMPLETIONS_PATH, headers, body, deadline)
            if response.status != 200:
                message = error_message(await response.read(deadline))
                response.release()
                raise rpc_error(status_code(response.status), message or
                                f"HTTP {response.status} from vLLM pod at {self.address}")
            reader = StreamReader(request)
            async with contextlib.aclosing(response.chunks(deadline)) as pieces:
                async for event in sse_events(pieces):
                    for chunk in reader.take(event):
                        yield chunk
            yield reader.finish()
            await _end_body(response, deadline)
        except ConnectFailed as exc:
            raise self._gone(str(exc)) from None
        except BrokenResponse as exc:
            raise self._gone(f"the response broke off ({exc})") from None
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"deadline exceeded waiting for vLLM pod at {self.address}") from None
        finally:
            call.done = True
            if response is not None:
                response.abort()  # a no-op after release(): else the stream is cut here


async def _end_body(response: Response, deadline: float | None) -> None:
    """Read what follows `[DONE]` (the body's end, in the same packet or the next) so the
    connection can serve the next request; a server that keeps the body open loses it."""
    soon = asyncio.get_running_loop().time() + 1.0
    try:
        async for _ in response.chunks(soon if deadline is None else min(deadline, soon)):
            pass
    except (BrokenResponse, TimeoutError):
        response.abort()
        return
    response.release()
