"""The HTTP listener: uvicorn in the process's own event loop, beside the gRPC server.

uvicorn (with httptools' parser) is the ASGI server the field's OpenAI servers run on
(vLLM's among them); http_protocol.py adds the header limits it lacks. It runs here inside
the pod's or router's running loop, so an HTTP request reaches the gRPC handler it calls
without a thread hop; its own signal handling is off (the process's SIGTERM drain decides
when it stops).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Generator

import uvicorn

from pagekv.proto.credentials import TlsFiles
from pagekv.proto.openai.app import build_app
from pagekv.proto.openai.backend import Backend
from pagekv.proto.openai.http_protocol import LimitedHttpProtocol

logger = logging.getLogger(__name__)


class _Embedded(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:  # the host owns SIGTERM/SIGINT
        yield


class HttpServer:
    def __init__(self, backend: Backend, host: str, port: int,
                 tls: TlsFiles | None = None) -> None:
        self.backend = backend
        self.host = host
        self.port = port
        self.tls = tls
        self._server: _Embedded | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None and self.tls.cert else "http"

    async def start(self) -> int:
        """Bind (port 0: any free one) and serve; returns the bound port."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"cannot bind the HTTP port {self.host}:{self.port} "
                               f"({exc.strerror}): choose another --http-port") from None
        self.port = sock.getsockname()[1]
        tls = self.tls if self.tls is not None and self.tls.cert else None
        mutual = tls is not None and bool(tls.ca)  # mutual TLS, as on the gRPC port
        b = self.backend
        count = b.on_response
        # httptools' parser, inside a protocol that bounds the headers (http_protocol.py).
        protocol = LimitedHttpProtocol.bounded_by(
            b.limits, None if count is None else lambda status: count("other", status))
        config = uvicorn.Config(build_app(b), http=protocol, ws="none", lifespan="off",
                                log_level="warning", access_log=False, timeout_keep_alive=30,
                                timeout_graceful_shutdown=5,
                                ssl_certfile=tls.cert if tls is not None else None,
                                ssl_keyfile=tls.key if tls is not None else None,
                                ssl_ca_certs=tls.ca if tls is not None and mutual else None,
                                ssl_cert_reqs=ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE)
        self._server = _Embedded(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # a failed start raises here
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.005)
        logger.info("OpenAI API (%s) on %s://%s:%d/v1; %s", b.kind, self.scheme,
                    self.host, self.port, b.limits.describe())
        return self.port

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Stop accepting, let in-flight responses finish for up to `drain_timeout_s`."""
        if self._server is None or self._task is None:
            return
        # uvicorn annotates it int, but only passes it to asyncio.wait_for: a float works.
        grace = max(0.0, drain_timeout_s)
        self._server.config.timeout_graceful_shutdown = grace  # type: ignore[assignment]
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, drain_timeout_s + 5)
        self._server = None
