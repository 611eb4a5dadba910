"""OpenAI's HTTP API over a pod or a router, as an ASGI app (Starlette).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /version; vLLM's POST /tokenize, POST /detokenize and GET /tokenizer_info
(tokenization.py); GET /metrics, the Prometheus page the metrics port serves (the same
registry), where vLLM serves it; GET /openapi.json, the routes described (openapi.py). Every
error is OpenAI's JSON error object with the status its clients expect (errors.py); a stack
trace never leaves the process. /openapi.json, /health and /version are open; the rest need
the API token when one is set — /metrics too: unlike the metrics port, which an operator binds
to a private interface, the API port faces the clients, and its page names pods, the model,
load and hit rates (Prometheus sends the token with `authorization: credentials`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from importlib import metadata
from typing import Any, TypeVar
from urllib.parse import quote

from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagekv.proto.openai.backend import AdapterAdmin, Backend, Tokenizer
from pagekv.proto.openai.calls import Calls, ClientGone, EventStream, until_disconnect
from pagekv.proto.openai.errors import ApiError, invalid
from pagekv.proto.openai.limits import REQUEST_TIMEOUT_HEADER
from pagekv.proto.openai.openapi import openapi_document
from pagekv.proto.openai.params import Parsed, parse_chat, parse_completion, read_str
from pagekv.proto.openai.prompt_echo import prompt_echoes
from pagekv.proto.openai.render import Renderer, TokenTexts
from pagekv.proto.openai.tokenization import (
    TokenizeAsk,
    parse_detokenize,
    parse_tokenize,
    render_chat,
    tokenize_reply,
    tokenizer_info,
)
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.requests import NoSuchAdapter

logger = logging.getLogger(__name__)

T = TypeVar("T")

LARGE_TEXT = 64 << 10  # characters: render and tokenize off the event loop past this
CLIENT_CLOSED = 499  # nginx's status for a client that hung up (never seen by that client)


def _version() -> str:
    try:
        return metadata.version("pagekv")
    except metadata.PackageNotFoundError:
        return "0+checkout"


class OpenAIFrontend:
    """The routes, over one backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.token_texts: TokenTexts | None = None
        self._ignored_logged: set[str] = set()
        self.openapi: dict[str, Any] = {}  # the app's routes described (build_app sets it)

    # -- plumbing ---------------------------------------------------------------------------
    def _json(self, route: str, status: int, body: Any,
              headers: dict[str, str] | None = None) -> JSONResponse:
        self._count(route, status)
        return JSONResponse(body, status, headers={**self.backend.headers, **(headers or {})})

    def _count(self, route: str, status: int) -> None:
        if self.backend.on_response is not None:
            self.backend.on_response(route, status)

    def _error(self, route: str, exc: ApiError) -> JSONResponse:
        if exc.status >= 500 and exc.status != 504:  # a deadline is the client's business
            logger.warning("%s -> %d: %s", route, exc.status, exc.message)
        # A stalled body will not finish: the connection cannot carry another request. (A
        # 413's rest is still read, and dropped, so that a client sending it all first, as
        # http.client does, gets to read its answer.)
        closing = {"connection": "close"} if exc.status == 408 else None
        return self._json(route, exc.status, exc.body(), closing)

    def _check_auth(self, request: Request) -> None:
        token, others = self.backend.api_token, self.backend.accepts_token
        if token is None and others is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given = given.strip()
        ok = scheme.lower() == "bearer" and bool(given) and (
            (token is not None and hmac.compare_digest(given.encode(), token.encode()))
            or (others is not None and others(given)))
        if not ok:
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> dict[str, Any]:
        cap = self.backend.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > cap):
            raise ApiError(413, f"the request body is larger than the limit of {cap} bytes",
                           code="body_too_large")
        parts, size = [], 0
        pause = self.backend.limits.body_timeout_s
        try:
            async with asyncio.timeout(pause) as stall:
                async for piece in request.stream():
                    stall.reschedule(asyncio.get_running_loop().time() + pause)
                    size += len(piece)
                    if size > cap:
                        raise ApiError(413, f"the request body is larger than the limit of "
                                       f"{cap} bytes", code="body_too_large")
                    parts.append(piece)
        except TimeoutError:
            raise ApiError(408, f"the request body stalled (no bytes for {pause:g} s)",
                           code="body_timeout") from None
        except ClientDisconnect:
            raise ClientGone() from None
        try:
            body = json.loads(b"".join(parts))
        except RecursionError:
            raise invalid("the request body nests too deeply") from None
        except ValueError as exc:  # bad JSON, or bytes that are not UTF-8/16/32
            raise invalid(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        _check_unicode(body)
        return body

    def _check_model(self, parsed: Parsed) -> str:
        return self._check_model_name(parsed.model)

    def _check_model_name(self, model: str | None) -> str:
        """The model the request names (a served name, or a LoRA adapter's name, as vLLM
        takes it); 404 naming what is served."""
        names = self.backend.model_names
        if model is not None and model not in names and model not in self.backend.adapters():
            adapters = sorted(self.backend.adapters())[:20]
            raise ApiError(404, f"The model `{model}` does not exist (this server serves "
                           f"{', '.join(names)}"
                           + (f"; LoRA adapters: {', '.join(adapters)}" if adapters else "")
                           + ")", param="model", code="model_not_found")
        if not self.backend.ready():
            raise ApiError(503, f"the {self.backend.kind} is starting", code="starting")
        return model or names[0]

    def _adapter_of(self, model: str) -> str:
        """The LoRA adapter a checked model name selects ("": the base model)."""
        return "" if model in self.backend.model_names else model

    def _texts(self, tokenizer: Tokenizer) -> TokenTexts:
        if self.token_texts is None:
            self.token_texts = TokenTexts(tokenizer.decode)
        return self.token_texts

    def _log_ignored(self, fields: list[str]) -> None:
        new = [f for f in fields if f not in self._ignored_logged]
        if new and len(self._ignored_logged) < 256:
            self._ignored_logged.update(new)
            logger.info("ignoring request fields PageKV does not know: %s", ", ".join(new))

    # -- routes -----------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.backend.ready():
            return self._json("/health", 200, {"status": "ok"})
        return self._json("/health", 503, {"status": "starting"})

    async def version(self, request: Request) -> Response:
        return self._json("/version", 200, {"version": _version(), "server": "pagekv",
                                            "kind": self.backend.kind})

    async def models(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except ApiError as exc:
            return self._error("/v1/models", exc)
        b = self.backend
        created = int(time.time())
        cards = []
        max_len = b.max_model_len() if b.ready() else None
        for name in b.model_names:
            card: dict[str, Any] = {"id": name, "object": "model", "created": created,
                                    "owned_by": "pagekv", "root": b.root, "parent": None}
            if max_len is not None:
                card["max_model_len"] = max_len
            cards.append(card)
        for name, path in sorted(b.adapters().items()):  # vLLM's: root the path, parent the base
            card = {"id": name, "object": "model", "created": created, "owned_by": "pagekv",
                    "root": path, "parent": b.model_names[0]}
            if max_len is not None:
                card["max_model_len"] = max_len
            cards.append(card)
        return self._json("/v1/models", 200, {"object": "list", "data": cards})

    # -- LoRA adapters at run time (a pod's; vLLM's routes and bodies) -----------------------
    def _check_admin(self, request: Request) -> None:
        token = self.backend.admin_token
        if token is None:
            self._check_auth(request)  # no admin token: as open as the API itself
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 token.encode()):
            raise ApiError(401, "this route needs the admin token (Authorization: Bearer "
                           "<--admin-token>)", code="invalid_api_key")

    async def load_lora_adapter(self, request: Request) -> Response:
        route = "/v1/load_lora_adapter"
        try:
            admin = self._adapter_routes()
            self._check_admin(request)
            body = await self._body(request)
            name, path = read_str(body, "lora_name"), read_str(body, "lora_path")
            if not name or not path:
                raise invalid("lora_name and lora_path are required")
            try:
                await admin.load(name, path)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="lora_path", code="bad_adapter") from None
            return self._json(route, 200, {"status": "ok", "lora_name": name,
                                           "message": f"LoRA adapter {name!r} added"})
        except ApiError as exc:
            return self._error(route, exc)

    async def unload_lora_adapter(self, request: Request) -> Response:
        route = "/v1/unload_lora_adapter"
        try:
            admin = self._adapter_routes()
            self._check_admin(request)
            name = read_str(await self._body(request), "lora_name")
            if not name:
                raise invalid("lora_name is required")
            try:
                await admin.unload(name)
            except NoSuchAdapter as exc:
                raise ApiError(404, str(exc), param="lora_name",
                               code="model_not_found") from None
            return self._json(route, 200, {"status": "ok", "lora_name": name,
                                           "message": f"LoRA adapter {name!r} removed"})
        except ApiError as exc:
            return self._error(route, exc)

    def _adapter_routes(self) -> AdapterAdmin:
        assert self.backend.adapter_admin is not None  # (the routes exist only with one)
        return self.backend.adapter_admin

    async def metrics(self, request: Request) -> Response:
        """The registry the metrics port serves, in the format the scraper asks for."""
        try:
            self._check_auth(request)
        except ApiError as exc:
            return self._error("/metrics", exc)
        registry = self.backend.metrics
        if registry is None:
            return self._json("/metrics", 404, ApiError(
                404, "this server keeps no metrics", code="not_found").body())
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        page = await asyncio.to_thread(encoder, registry)  # the collectors read the engine
        self._count("/metrics", 200)
        return Response(page, 200, headers=self.backend.headers, media_type=content_type)

    async def openapi_json(self, request: Request) -> Response:
        return self._json("/openapi.json", 200, self.openapi)

    async def tokenize(self, request: Request) -> Response:
        route = "/tokenize"
        try:
            self._check_auth(request)
            ask = parse_tokenize(await self._body(request), self.backend.prompt_limits)
            self._check_model_name(ask.model)
            tokenizer = self.backend.tokenizer()
            reply = await self._off_loop_if(ask.size() > LARGE_TEXT, self._tokenized, tokenizer,
                                            ask)
            return self._json(route, 200, reply)
        except ApiError as exc:
            return self._error(route, exc)

    def _tokenized(self, tokenizer: Tokenizer, ask: TokenizeAsk) -> dict[str, Any]:
        return tokenize_reply(tokenizer, ask, self.backend.max_model_len(),
                              self._texts(tokenizer))

    async def detokenize(self, request: Request) -> Response:
        route = "/detokenize"
        try:
            self._check_auth(request)
            body = await self._body(request)
            self._check_model_name(read_str(body, "model"))
            tokenizer = self.backend.tokenizer()
            ids = parse_detokenize(body, tokenizer.vocab_size)
            text = await self._off_loop_if(len(ids) > LARGE_TEXT // 4, tokenizer.decode, ids,
                                           False)
            return self._json(route, 200, {"prompt": text})
        except ApiError as exc:
            return self._error(route, exc)

    async def tokenizer_info(self, request: Request) -> Response:
        route = "/tokenizer_info"
        try:
            self._check_auth(request)
            self._check_model_name(None)
            return self._json(route, 200, tokenizer_info(self.backend.tokenizer(),
                                                         self.backend.max_model_len()))
        except ApiError as exc:
            return self._error(route, exc)

    @staticmethod
    async def _off_loop_if(large: bool, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args), on a worker thread when the input is large (milliseconds of work)."""
        if large:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def completions(self, request: Request) -> Response | EventStream:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response | EventStream:
        return await self._generate(request, chat=True)

    # -- errors no route answered (the app's exception handlers) ---------------------------
    async def http_error(self, request: Request, exc: Exception) -> Response:
        """No such route (404, 405) or another of Starlette's HTTP errors."""
        assert isinstance(exc, HTTPException)  # the handler of HTTPException only
        status = exc.status_code
        message = (f"no route {request.method} {request.url.path}" if status in (404, 405)
                   else str(exc.detail))
        return self._json(request.url.path if status != 404 else "other", status,
                          ApiError(status, message, code="not_found" if status == 404
                                   else None).body())

    async def client_gone(self, request: Request, exc: Exception) -> Response:
        """A client that hung up before its response (mid-body, mid-wait): nginx's 499 in
        the metrics, one debug line — not a server error."""
        path = request.url.path
        route = path if path in self.openapi.get("paths", {}) else "other"
        logger.debug("%s %s: the client hung up", request.method, path)
        self._count(route, CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)

    async def internal_error(self, request: Request, exc: Exception) -> Response:
        """An exception that escaped a route: logged with its trace, a bare 500 for the client."""
        logger.exception("HTTP %s %s failed", request.method, request.url.path)
        return self._json("other", 500, ApiError(500, "internal error",
                                                 code="internal_error").body())

    # -- generation -------------------------------------------------------------------------
    async def _generate(self, request: Request, *, chat: bool) -> Response | EventStream:
        route = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            return await self._run(request, route, chat)
        except ApiError as exc:
            return self._error(route, exc)
        except ClientGone:
            self._count(route, CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)

    async def _run(self, request: Request, route: str, chat: bool) -> Response | EventStream:
        timeout_s = self.backend.limits.deadline_s(request.headers.get(REQUEST_TIMEOUT_HEADER))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._check_auth(request)
        body = await self._body(request)
        if chat:
            parsed, messages, template_kwargs = parse_chat(body)
        else:
            parsed, prompts = parse_completion(body)
        model = self._check_model(parsed)
        lora = self._adapter_of(model)
        tokenizer = self.backend.tokenizer()
        chat_echo = ""
        if chat:
            prompts = [await self._chat_prompt(tokenizer, messages, template_kwargs)]
            if parsed.pin_message is not None:  # the breakpoint: the prompt through it
                through = {**template_kwargs, "add_generation_prompt": False}
                head = await self._chat_prompt(tokenizer, messages[: parsed.pin_message + 1],
                                               through)
                parsed.pin_tokens = max(1, len(head))
            if parsed.echo:
                chat_echo = _chat_echo(messages, template_kwargs)
        self._log_ignored(parsed.ignored)
        rid = parsed.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
        requests = [self._request(rid if len(prompts) == 1 else f"{rid}-{k}", p, parsed, lora)
                    for k, p in enumerate(prompts)]
        echoes = None if chat else await prompt_echoes(requests, parsed, tokenizer,
                                                       self.backend.prompt_limits)
        renderer = Renderer(
            chat=chat, response_id=f"{'chatcmpl' if chat else 'cmpl'}-{rid}", model=model,
            n=parsed.n, num_prompts=len(prompts),
            token_texts=TokenTexts.as_id if parsed.tokens_as_ids else self._texts(tokenizer),
            logprobs=parsed.logprobs, streaming=parsed.stream,
            include_usage=parsed.include_usage, token_ids=parsed.token_ids,
            echo=parsed.echo, echoes=echoes, echo_only=parsed.echo_only,
            num_logprobs=parsed.num_logprobs,
            prompt_logprobs=parsed.prompt_logprobs is not None, chat_echo=chat_echo)
        calls = Calls(self.backend, requests, deadline, request.headers.get("authorization"))
        headers = {"x-request-id": header_value(rid)}
        if parsed.ignored:
            headers["x-pagekv-ignored-fields"] = header_value(",".join(parsed.ignored)[:1024])
        if parsed.stream:
            return await self._stream(request, route, calls, renderer, headers, timeout_s)
        await until_disconnect(request.receive, self._collect(calls, renderer),
                               calls.contexts[0].deadline, timeout_s)
        out = renderer.response()
        headers.update(_decision_headers(out["pagekv"]))
        return self._json(route, 200, out, headers)

    async def _chat_prompt(self, tokenizer: Tokenizer, messages: list[dict[str, Any]],
                           kwargs: dict[str, Any]) -> list[int]:
        """The conversation rendered with the model's template and tokenized as the pods
        would (tokenization.render_chat)."""
        large = sum(len(m["content"]) for m in messages) > LARGE_TEXT
        return await self._off_loop_if(large, render_chat, tokenizer, messages, kwargs)

    @staticmethod
    def _request(rid: str, prompt: str | list[int], parsed: Parsed, lora: str
                 ) -> pb.GenerateRequest:
        req = pb.GenerateRequest(request_id=rid, cache_salt=parsed.cache_salt,
                                 one_shot=parsed.one_shot, session_id=parsed.session_id,
                                 lora_name=lora)
        if parsed.pin_ttl_s:
            req.cache_control.ttl_s = parsed.pin_ttl_s
            req.cache_control.tokens = parsed.pin_tokens
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        req.sampling.CopyFrom(parsed.sampling)
        return req

    @staticmethod
    async def _collect(calls: Calls, renderer: Renderer) -> None:
        async for k, chunk in calls.events():
            renderer.add(k, chunk)

    async def _stream(self, request: Request, route: str, calls: Calls, renderer: Renderer,
                      headers: dict[str, str], timeout_s: float | None) -> EventStream:
        async def events() -> AsyncGenerator[dict[str, Any] | None, None]:
            async for k, chunk in calls.events():
                yield renderer.add(k, chunk)

        stream = events()

        async def first_event() -> list[dict[str, Any]]:
            # Status and headers wait for the first event: an error before it (a bad value
            # only the pod can check, a full queue, no pod) is still a proper HTTP status.
            async for event in stream:
                if event is not None:
                    return [event]
            return []

        try:
            deadline = calls.contexts[0].deadline
            first = await until_disconnect(request.receive, first_event(), deadline, timeout_s)
        except BaseException:
            await stream.aclose()
            raise
        headers.update({f"x-{k}": header_value(v) for k, v in calls.metadata().items()})

        def tail() -> list[dict[str, Any]]:
            return [renderer.usage_event()] if renderer.include_usage else []

        def closed(status: int) -> None:
            self._count(route, status)

        return EventStream(stream, first, tail, {**self.backend.headers, **headers}, closed,
                           deadline, timeout_s)


def _chat_echo(messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    """vLLM's chat echo: the last message's content, when it has the answer's role (the
    assistant's; any role without a generation prompt, where the answer continues it)."""
    last = messages[-1]
    if last["role"] == "assistant" or not kwargs.get("add_generation_prompt", True):
        return str(last["content"])
    return ""


def _check_unicode(body: Any) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which no UTF-8 wire can carry:
    refuse them here, naming where, instead of failing deep inside."""
    stack = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise invalid(f"{where or 'the body'} holds a lone UTF-16 surrogate (not "
                              f"valid Unicode)", where.split("[", 1)[0].split(".", 1)[0]
                              or None) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k if not where else f"{where}.{k}", k))
                stack.append((k if not where else f"{where}.{k}", v))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))


def header_value(text: str) -> str:
    """A client's string (a request id, a field name) made safe for a response header:
    printable ASCII kept, the rest percent-encoded — never a CR/LF that would start a header
    of the client's choosing, never a character latin-1 cannot carry."""
    return quote(text, safe="!#$&'()*+,/:;=?@[]~^|{}`<>\"")


def _decision_headers(extension: dict[str, Any]) -> dict[str, str]:
    out = {}
    if extension.get("served_by"):
        out["x-pagekv-served-by"] = header_value(extension["served_by"])
    routing = extension.get("routing")
    if routing:
        out["x-pagekv-routing-reason"] = header_value(routing["reason"])
        out["x-pagekv-predicted-cached-tokens"] = str(routing["predicted_cached_tokens"])
    return out


def build_app(backend: Backend) -> Starlette:
    front = OpenAIFrontend(backend)
    routes = [
        Route("/v1/completions", front.completions, methods=["POST"]),
        Route("/v1/chat/completions", front.chat_completions, methods=["POST"]),
        Route("/v1/models", front.models, methods=["GET"]),
        Route("/tokenize", front.tokenize, methods=["POST"]),
        Route("/detokenize", front.detokenize, methods=["POST"]),
        Route("/tokenizer_info", front.tokenizer_info, methods=["GET"]),
        Route("/health", front.health, methods=["GET"]),
        Route("/version", front.version, methods=["GET"]),
        Route("/metrics", front.metrics, methods=["GET"]),
        Route("/openapi.json", front.openapi_json, methods=["GET"]),
    ]
    if backend.adapter_admin is not None:  # a pod's run-time LoRA adapters
        routes += [Route("/v1/load_lora_adapter", front.load_lora_adapter, methods=["POST"]),
                   Route("/v1/unload_lora_adapter", front.unload_lora_adapter,
                         methods=["POST"])]
    # Every route must be described: a route added without its description fails here.
    front.openapi = openapi_document(routes, backend.kind, _version())
    return Starlette(routes=routes, exception_handlers={HTTPException: front.http_error,
                                                        ClientDisconnect: front.client_gone,
                                                        ClientGone: front.client_gone,
                                                        Exception: front.internal_error})
