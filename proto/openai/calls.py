"""Running one HTTP request's engine requests and watching its client.

- `Calls`: the backend's GenerateStream for each prompt, merged into one stream of
  (prompt index, chunk); a backend abort becomes the HTTP error it maps to.
- `until_disconnect`: awaits work unless the client hangs up first, in which case the work
  is cancelled — which closes the backend stream, which aborts the engine request and frees
  its KV blocks (the same path a cancelled gRPC call takes).
- `EventStream`: server-sent events, one per backend chunk, `data: [DONE]` last, with the
  same disconnect watch for the whole stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

from pagekv.proto.openai.backend import Backend, CallAborted, CallContext
from pagekv.proto.openai.errors import ApiError, from_grpc
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Done:
    """A prompt's stream has ended (what `_merged`'s pumps put last)."""


_DONE = _Done()


class ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


class Calls:
    """One engine request per prompt, through the backend's own GenerateStream handler."""

    def __init__(self, backend: Backend, requests: list[pb.GenerateRequest],
                 deadline: float | None = None, authorization: str | None = None) -> None:
        self.backend = backend
        self.requests = requests
        # The handlers see the deadline and the credential as a gRPC call's (the router's
        # pod calls carry the deadline; a tenants file's tenant is read from the credential).
        self.contexts = [CallContext(deadline, authorization) for _ in requests]

    def metadata(self) -> dict[str, str]:
        """What the handlers sent as initial metadata (the router: the pod it chose), one
        comma-separated value per key across the prompts."""
        merged: dict[str, list[str]] = {}
        for ctx in self.contexts:
            for key, value in ctx.initial_metadata:
                merged.setdefault(key, []).append(value)
        return {k: ",".join(v) for k, v in merged.items()}

    async def events(self) -> AsyncIterator[tuple[int, pb.GenerateChunk]]:
        try:
            if len(self.requests) == 1:
                stream = self.backend.generate_stream(self.requests[0], self.contexts[0])
                async with contextlib.aclosing(stream) as chunks:
                    async for chunk in chunks:
                        yield 0, chunk
                return
            async for item in self._merged():
                yield item
        except CallAborted as exc:
            raise from_grpc(exc.code, exc.details) from None

    async def _merged(self) -> AsyncIterator[tuple[int, pb.GenerateChunk]]:
        queue: asyncio.Queue[tuple[int, pb.GenerateChunk] | Exception | _Done] = asyncio.Queue()

        async def pump(k: int) -> None:
            try:
                stream = self.backend.generate_stream(self.requests[k], self.contexts[k])
                async with contextlib.aclosing(stream) as chunks:
                    async for chunk in chunks:
                        queue.put_nowait((k, chunk))
            except Exception as exc:  # handed to the consumer, which cancels the others
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(_DONE)

        tasks = [asyncio.ensure_future(pump(k)) for k in range(len(self.requests))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if isinstance(item, _Done):
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (the ASGI server reports http.disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def seconds_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def past_deadline(timeout_s: float | None) -> ApiError:
    return ApiError(504, f"the request ran past its deadline ({timeout_s:g} s)",
                    type="timeout_error", code="deadline_exceeded")


async def until_disconnect(receive: Receive, work: Awaitable[T],
                           deadline: float | None = None,
                           timeout_s: float | None = None) -> T:
    """`work`'s result; cancelled if the client hangs up (ClientGone) or `deadline`
    (time.monotonic()) passes first (504: the request's `timeout_s` ran out)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, timeout=seconds_left(deadline),
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client went, the time ran out, or this was cancelled
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        expired = not watch.done()
        watch.cancel()
    if task.cancelled():
        if expired:
            raise past_deadline(timeout_s)
        raise ClientGone()
    return task.result()


class EventStream:
    """An ASGI response streaming `events` as server-sent events: `first` (already taken,
    so the status and headers could wait for it), then the rest, then `tail()` and
    `data: [DONE]`. An error after the first byte is sent as an error event (the status is
    gone by then), then [DONE], as vLLM does."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[dict[str, Any] | None, None],
                 first: list[dict[str, Any]],
                 tail: Callable[[], list[dict[str, Any]]], headers: dict[str, str],
                 on_close: Callable[[int], None] | None = None,
                 deadline: float | None = None, timeout_s: float | None = None) -> None:
        self.events = events
        self.first = first
        self.tail = tail
        self.headers = headers
        self.on_close = on_close  # (status): 200 done, 499 the client went, 504 out of time
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                   (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        producer = asyncio.ensure_future(self._produce(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        completed = expired = False
        try:
            await asyncio.wait({producer, watch}, timeout=seconds_left(self.deadline),
                               return_when=asyncio.FIRST_COMPLETED)
            completed = producer.done() and not producer.cancelled()
            expired = not completed and not watch.done()
        finally:
            if not producer.done():  # the client hung up or the time ran out: stop the
                producer.cancel()    # engine's work now
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await producer
            watch.cancel()
            with contextlib.suppress(Exception):
                await self.events.aclose()
            if self.on_close is not None:
                self.on_close(200 if completed else 504 if expired else 499)
        if completed:
            producer.result()
        elif expired:  # the status is gone: an error event, then [DONE], as for any error
            body = past_deadline(self.timeout_s).body()
            await send({"type": "http.response.body", "body": sse(body), "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                        "more_body": False})

    async def _produce(self, send: Send) -> None:
        for event in self.first:
            await send({"type": "http.response.body", "body": sse(event), "more_body": True})
        try:
            async for item in self.events:
                if item is not None:
                    await send({"type": "http.response.body", "body": sse(item),
                                "more_body": True})
            for event in self.tail():
                await send({"type": "http.response.body", "body": sse(event), "more_body": True})
        except ApiError as exc:
            await send({"type": "http.response.body", "body": sse(exc.body()),
                        "more_body": True})
        except Exception:
            logger.exception("stream failed")
            body = ApiError(500, "internal error", code="internal_error").body()
            await send({"type": "http.response.body", "body": sse(body), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})
