"""A vLLM pod's streamed /v1/completions as a PageKV pod's GenerateChunks, and its errors as
gRPC statuses (router/openai_forward.py sends the request).

The chunks have a PageKV pod's shape: text and token ids per event, finish reason and stop
reason on a completion's last chunk, the usage on the very last chunk. vLLM sends the usage
as an event of its own after the last completion's; that completion's chunk is held until
then and the two become one. Asked for prompt_logprobs (sent as echo: openai_forward.py),
the prompt's positions are taken out of each choice's first event and go out once, on the
first chunk. `prompt_tokens_details.cached_tokens` (sent by vLLM with
--enable-prompt-tokens-details) counts as pool hits: vLLM reports no tiers (a PageKV pod's
own OpenAI server does, in its `pagekv` object, and those are taken).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb

MAX_EVENT_BYTES = 16 << 20  # one SSE event: far above any real one

FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ABORT}

# HTTP status -> gRPC status; anything else >= 500 is INTERNAL, anything else < 500
# INVALID_ARGUMENT.
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED, 409: grpc.StatusCode.ALREADY_EXISTS,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED, 502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# An error event's `type` where its `code` is not an HTTP status (PageKV's own server).
ERROR_TYPES = {
    "invalid_request_error": grpc.StatusCode.INVALID_ARGUMENT,
    "rate_limit_error": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "service_unavailable_error": grpc.StatusCode.UNAVAILABLE,
    "timeout_error": grpc.StatusCode.DEADLINE_EXCEEDED,
    "cancelled_error": grpc.StatusCode.CANCELLED,
    "authentication_error": grpc.StatusCode.UNAUTHENTICATED,
    "permission_error": grpc.StatusCode.PERMISSION_DENIED,
}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """What a gRPC pod's call would raise: router/server.py handles both alike."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def status_code(status: int) -> grpc.StatusCode:
    default = grpc.StatusCode.INTERNAL if status >= 500 else grpc.StatusCode.INVALID_ARGUMENT
    return STATUS_CODES.get(status, default)


def error_message(body: bytes) -> str:
    """The message of an OpenAI error body (`{"error": {"message"}}`, or older vLLM's flat
    `{"object": "error", "message"}`), else the body's text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:1000]
    return _event_error_message(data) or json.dumps(data)[:1000]


def _event_error_message(data: Any) -> str:
    if not isinstance(data, dict):
        return ""
    err = data.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if isinstance(err, str):
        return err
    return str(data.get("message") or "") if data.get("object") == "error" else ""


def _event_error_code(event: dict[str, Any]) -> grpc.StatusCode:
    err = event.get("error")
    err = err if isinstance(err, dict) else event
    code = err.get("code")
    if isinstance(code, int) and not isinstance(code, bool):  # vLLM: the HTTP status
        return status_code(code)
    return ERROR_TYPES.get(str(err.get("type")), grpc.StatusCode.INTERNAL)


async def sse_events(pieces: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    """The JSON of each server-sent event's data, until `[DONE]` or the body's end."""
    buf = b""
    data: list[bytes] = []
    async for piece in pieces:
        buf += piece
        if len(buf) > MAX_EVENT_BYTES:
            raise rpc_error(grpc.StatusCode.INTERNAL, "an event from the vLLM pod exceeds "
                            f"{MAX_EVENT_BYTES} bytes")
        *lines, buf = buf.split(b"\n")
        for line in lines:
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                data.append(line[5:].removeprefix(b" "))
            elif not line and data:  # a blank line ends the event
                text, data = b"\n".join(data), []
                if text.strip() == b"[DONE]":
                    return
                try:
                    yield json.loads(text)
                except ValueError:
                    raise rpc_error(grpc.StatusCode.INTERNAL, "the vLLM pod sent an event "
                                    f"that is not JSON: {text[:200]!r}") from None


def _token_id(token: Any) -> int | None:
    if isinstance(token, str) and token.startswith("token_id:"):
        tail = token[len("token_id:"):]
        return int(tail) if tail.isdigit() else None
    return None


def _logprobs(lp: dict[str, Any], ids: list[int], k: int | None, start: int = 0,
              stop: int | None = None) -> list[pb.TokenLogprobs]:
    """Positions start..stop of completions' logprobs object (tokens as "token_id:<id>") as
    TokenLogprobs with the k best tokens (vLLM's top_logprobs hold the chosen token too);
    where a token is not in that form, the id at its place in `ids` is taken. A position
    with no logprob (an echoed prompt's first token) is skipped."""
    out = []
    tokens = (lp.get("tokens") or [])[start:stop]
    values = (lp.get("token_logprobs") or [])[start:stop]
    tops = (lp.get("top_logprobs") or [])[start:stop]
    for i, (token, value) in enumerate(zip(tokens, values, strict=False)):
        tid = _token_id(token)
        if tid is None and i < len(ids):
            tid = ids[i]
        if tid is None or value is None:
            continue
        entry = pb.TokenLogprobs(sampled=pb.Logprob(token_id=tid, logprob=value))
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        best = sorted(top.items(), key=lambda kv: -kv[1])  # best first
        for tok, v in best[:k]:
            if (t := _token_id(tok)) is not None:
                entry.top.add(token_id=t, logprob=v)
        out.append(entry)
    return out


class StreamReader:
    """vLLM's completion events -> GenerateChunks. A completion's last chunk is held until
    the next event: when that is the usage, the two are one chunk, as on a PageKV pod."""

    def __init__(self, request: pb.GenerateRequest) -> None:
        self.request = request
        self.rid = request.request_id
        self.held: pb.GenerateChunk | None = None
        self.usage: pb.Usage | None = None
        self.tokens = 0
        sp = request.sampling
        self.logprobs_k = sp.logprobs if sp.HasField("logprobs") else None
        # prompt_logprobs came as echo (openai_forward.py): each choice's first event holds
        # the prompt's positions first, which go out once, on the stream's first chunk.
        self.prompt_k = sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None
        self.echoed: set[int] = set()  # the choices whose first event was read
        self.prompt_logprobs: list[pb.TokenLogprobs] | None = None  # not yet sent

    def take(self, event: Any) -> list[pb.GenerateChunk]:
        message = _event_error_message(event)
        if message:  # an error after the stream began: the status line said 200
            raise rpc_error(_event_error_code(event), message)
        try:
            return self._take(event)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise rpc_error(grpc.StatusCode.INTERNAL, f"the vLLM pod sent an event this "
                            f"router cannot read ({type(exc).__name__}: {exc})") from None

    def _take(self, event: dict[str, Any]) -> list[pb.GenerateChunk]:
        if not self.rid:
            self.rid = str(event.get("id") or "")
        out = []
        for choice in event.get("choices") or ():
            chunk = self._chunk(choice)
            if chunk is None:
                continue
            if self.held is not None:
                out.append(self.held)
                self.held = None
            if chunk.finish_reason:
                self.held = chunk
            else:
                out.append(chunk)
        if event.get("usage"):
            self.usage = _usage(event["usage"], event.get("pagekv"))
        return out

    def _chunk(self, choice: dict[str, Any]) -> pb.GenerateChunk | None:
        text = choice.get("text") or ""
        ids = [int(t) for t in choice.get("token_ids") or ()]
        finished = choice.get("finish_reason")
        finish = FINISH_REASONS.get(finished, pb.FINISH_REASON_STOP) if finished \
            else pb.FINISH_REASON_UNSPECIFIED
        lp = choice.get("logprobs")
        index = int(choice.get("index") or 0)
        start = self._echo(choice, index, lp)
        if not (text or ids or finish or lp):
            return None  # e.g. the first event's prompt_token_ids alone
        self.tokens += len(ids)
        chunk = pb.GenerateChunk(request_id=self.rid, index=index, token_ids=ids, text=text,
                                 finish_reason=finish)
        if self.prompt_logprobs is not None:
            chunk.prompt_logprobs.extend(self.prompt_logprobs)
            self.prompt_logprobs = []  # sent: an empty list from here on
        reason = choice.get("stop_reason")
        if finish == pb.FINISH_REASON_STOP and reason is not None:
            if isinstance(reason, int) and not isinstance(reason, bool):
                chunk.stop_token_id = reason
            else:
                chunk.stop_string = str(reason)
        if isinstance(lp, dict) and self.logprobs_k is not None:
            chunk.logprobs.extend(_logprobs(lp, ids, self.logprobs_k, start))
        return chunk

    def _echo(self, choice: dict[str, Any], index: int, lp: Any) -> int:
        """Where a choice's own logprobs start: past the echoed prompt in its first event
        (whose positions are read into prompt_logprobs, once), else 0."""
        if self.prompt_k is None or index in self.echoed:
            return 0
        self.echoed.add(index)
        if "token_ids" not in choice:
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs needs a vLLM "
                            "pod that returns token ids (return_token_ids, vLLM >= 0.10.2)")
        prompt = [int(t) for t in choice.get("prompt_token_ids")
                  or self.request.token_ids.ids]
        if not isinstance(lp, dict) or not prompt:
            raise rpc_error(grpc.StatusCode.INTERNAL, "the vLLM pod's echo carries no "
                            "logprobs for the prompt")
        if self.prompt_logprobs is None:
            self.prompt_logprobs = _logprobs(lp, prompt, self.prompt_k, 0, len(prompt))
        return len(prompt)

    def finish(self) -> pb.GenerateChunk:
        """The stream's last chunk: the held one (or an empty one) with the usage."""
        last = self.held or pb.GenerateChunk(request_id=self.rid)
        self.held = None
        if self.usage is None:  # a server that sent none: what is known
            self.usage = pb.Usage(prompt_tokens=len(self.request.token_ids.ids),
                                  completion_tokens=self.tokens)
        last.usage.CopyFrom(self.usage)
        return last


def _usage(u: dict[str, Any], extension: Any) -> pb.Usage:
    details = u.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    usage = pb.Usage(prompt_tokens=int(u.get("prompt_tokens") or 0),
                     completion_tokens=int(u.get("completion_tokens") or 0),
                     cached_tokens=cached, cached_tokens_gpu=cached)
    tiers = extension.get("cached_tokens_by_tier") if isinstance(extension, dict) else None
    if isinstance(tiers, dict):  # a PageKV pod's OpenAI server says where its hits were
        usage.cached_tokens_gpu = int(tiers.get("gpu") or 0)
        usage.cached_tokens_cpu = int(tiers.get("cpu") or 0)
        usage.cached_tokens_disk = int(tiers.get("disk") or 0)
        usage.cached_tokens_peer = int(tiers.get("peer") or 0)
    return usage


def response_of(chunks: list[pb.GenerateChunk]) -> pb.GenerateResponse:
    """A stream's chunks as the unary call's response."""
    out = pb.GenerateResponse(request_id=chunks[-1].request_id if chunks else "")
    by_index: dict[int, pb.Completion] = {}
    for chunk in chunks:
        c = by_index.get(chunk.index)
        if c is None:
            c = by_index[chunk.index] = pb.Completion(index=chunk.index)
        if chunk.prompt_logprobs:  # the contract's place in a response: completion 0
            first = by_index.setdefault(0, pb.Completion(index=0))
            first.prompt_logprobs.extend(chunk.prompt_logprobs)
        c.token_ids.extend(chunk.token_ids)
        c.text += chunk.text
        c.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason:
            c.finish_reason = chunk.finish_reason
            which = chunk.WhichOneof("stop_reason")
            if which:
                setattr(c, which, getattr(chunk, which))
        if chunk.HasField("usage"):
            out.usage.CopyFrom(chunk.usage)
    out.completions.extend(by_index[i] for i in sorted(by_index))
    return out
