"""Server-side pieces the pod and the router share: gRPC health with `List`, the metrics page,
and service registration that refuses an undecodable request and frees an aborted one.

The only module of the contract that touches server machinery, and only servers import it
(the layer test allows it here and nowhere else in `proto`): the router may not import pod
code, so what both servers need has to live below both.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry, make_wsgi_app

from pagekv.proto.requests import undecodable

logger = logging.getLogger(__name__)

METRICS_PATH = "/metrics"


# grpc_health has no stubs that know `List` (types-grpcio-health-checking predates it): Any.
class HealthServicer(health.aio.HealthServicer):  # type: ignore[misc]  # subclasses Any
    """grpc.health.v1 with `List` answered (grpcio's servicer leaves it UNIMPLEMENTED)."""

    async def List(self, request: health_pb2.HealthListRequest,
                   context: grpc.aio.ServicerContext[Any, Any]
                   ) -> health_pb2.HealthListResponse:
        statuses = {name: health_pb2.HealthCheckResponse(status=status)
                    for name, status in dict(self._server_status).items()}
        return health_pb2.HealthListResponse(statuses=statuses)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the process open


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # one line per scrape is noise
        pass


def _metrics_only(app: WSGIApplication) -> WSGIApplication:
    """The exposition on /metrics; every other path is a 404 that says where to look. HEAD
    is GET without the body (prometheus_client answers it 405 with a body, which strict
    clients such as aiohttp refuse: a benchmark tool's probe of the page then fails)."""
    def wrapped(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        head = environ.get("REQUEST_METHOD") == "HEAD"
        if environ.get("PATH_INFO", "") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [] if head else [b"not found: metrics are served on /metrics\n"]
        if not head:
            return app(environ, start_response)
        body = app({**environ, "REQUEST_METHOD": "GET"}, start_response)
        if hasattr(body, "close"):
            body.close()
        return []
    return wrapped


def _bearer_only(app: WSGIApplication, token: str) -> WSGIApplication:
    """`app` for requests with 'Authorization: Bearer <token>' (what Prometheus sends with
    authorization.credentials_file), 401 for any other, which says only what is needed."""
    want = token.encode()

    def wrapped(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        scheme, _, given = str(environ.get("HTTP_AUTHORIZATION", "")).partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), want):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", 'Bearer realm="metrics"')])
        return [b"metrics need 'Authorization: Bearer <token>' (--metrics-token)\n"]
    return wrapped


def serve_metrics(registry: CollectorRegistry, host: str, port: int,
                  token: str | None = None) -> WSGIServer:
    """Serve `registry` on http://host:port/metrics from a daemon thread; returns the server
    (its `server_port` is the bound port, for port 0). Call `shutdown()` to stop it.
    `token`: every request must carry it as a bearer token (else 401)."""
    app = _metrics_only(make_wsgi_app(registry))
    server = make_server(host, port, _bearer_only(app, token) if token else app,
                         server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="pagekv-metrics", daemon=True).start()
    return server


# -- requests protobuf cannot decode ------------------------------------------------------------
# grpc aio calls a handler's deserializer outside the handler: a DecodeError there (invalid
# UTF-8 in a string field, a message cut short) becomes UNKNOWN "Unexpected <class ...>" and an
# ERROR traceback per call. add_servicer's deserializer returns an Undecodable instead, which
# the handler refuses with INVALID_ARGUMENT and a warning at most every UNDECODABLE_LOG_S.
def method_paths(service: ServiceDescriptor) -> tuple[str, ...]:
    """Every method of a service as gRPC names it on the wire (`/pagekv.v1.CacheAdmin/Locate`):
    what a TokenGuard's admin or peer methods list."""
    return tuple(f"/{service.full_name}/{m.name}" for m in service.methods)


UNDECODABLE_LOG_S = 10.0


class Undecodable:
    """Stands in for a request protobuf could not decode; `details` says why."""

    __slots__ = ("details",)

    def __init__(self, details: str) -> None:
        self.details = details


class ThrottledWarning:
    """One warning per `interval_s` at most; the next one says how many were held back."""

    def __init__(self, log: logging.Logger, interval_s: float) -> None:
        self.log = log
        self.interval_s = interval_s
        self._last = -float("inf")
        self._held = 0

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._held += 1
            return
        if self._held:
            msg, args = msg + " (and %d more since the last warning)", (*args, self._held)
        self._last, self._held = now, 0
        self.log.warning(msg, *args)


def _drop_frames(exc: BaseException) -> None:
    """Clear the tracebacks of an aborted call's AbortError and of the errors it was raised
    while handling. grpc keeps the AbortError in the call's state, which the servicer's
    frames in its traceback refer back to (as `context`): a cycle holding the request, its
    tokens and hashes until the garbage collector came by, in memory the allocator then kept
    (a router grew ~20 MB per refused 1 MiB prompt). Servicers log what they need first."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += (e.__cause__, e.__context__)


def _tolerant(message_cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    name = message_cls.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return message_cls.FromString(data)
        except DecodeError as exc:
            return Undecodable(undecodable(name, exc))
    return deserialize


def add_servicer(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object,
                 on_refused: Callable[[], None] | None = None) -> None:
    """What the generated add_<Service>Servicer_to_server does (for unary requests), with
    a deserializer that never raises: an undecodable request is INVALID_ARGUMENT with its
    reason, and `on_refused` is called for each (a metric). An aborted call's memory is freed
    when it ends (_drop_frames)."""
    warning = ThrottledWarning(logger, UNDECODABLE_LOG_S)

    async def refuse(request: Undecodable, context: grpc.aio.ServicerContext[Any, Any],
                     method: str) -> None:
        warning.warn("refused undecodable %s call from %s: %s", method, context.peer(),
                     request.details)
        if on_refused is not None:
            on_refused()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)

    def unary(method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, Undecodable):
                await refuse(request, context, method)
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError as exc:
                del request
                _drop_frames(exc)
                raise
        return handle

    def streaming(method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]
                         ) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await refuse(request, context, method)
            try:
                # aclosing: a cancelled call closes the servicer's stream now, not when collected.
                async with contextlib.aclosing(behavior(request, context)) as items:
                    async for item in items:
                        yield item
            except grpc.aio.AbortError as exc:
                del request
                _drop_frames(exc)
                raise
        return handle

    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for m in service.methods:
        if m.client_streaming:
            raise ValueError(f"{m.full_name}: client streaming is not supported here")
        deserialize = _tolerant(message_factory.GetMessageClass(m.input_type))
        serialize = message_factory.GetMessageClass(m.output_type).SerializeToString
        behavior = getattr(servicer, m.name)
        if m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                streaming(m.full_name, behavior), request_deserializer=deserialize,
                response_serializer=serialize)
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                unary(m.full_name, behavior), request_deserializer=deserialize,
                response_serializer=serialize)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
