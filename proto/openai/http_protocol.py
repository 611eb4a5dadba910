"""uvicorn's httptools protocol with the header limits uvicorn lacks.

httptools gathers each header whole before uvicorn sees it, and uvicorn sets no bound: a
64 MB header was read and held. Here every byte is counted before the parser gets it, while
a request's headers are incomplete: past the limit the rest is never parsed, the client gets
431 and the connection is closed, so what one connection makes the server hold is bounded by
the limit (plus one socket read). A header timer cuts a client that trickles its headers
(slowloris) and a connection that never sends any. The fast path is uvicorn's own: one
comparison per read, the same parser.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pagekv.proto.openai.errors import ApiError
from pagekv.proto.openai.limits import HttpLimits

logger = logging.getLogger(__name__)


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request that broke a limit."""


class LimitedHttpProtocol(HttpToolsProtocol):
    limits: ClassVar[HttpLimits] = HttpLimits()
    # (status): count a refusal in the front end's metrics (route "other")
    refusal_counters: ClassVar[tuple[Callable[[int], None], ...]] = ()

    @classmethod
    def bounded_by(cls, limits: HttpLimits,
                   count_refusal: Callable[[int], None] | None = None
                   ) -> type[LimitedHttpProtocol]:
        """The protocol class uvicorn builds per connection, with these limits."""
        counters = () if count_refusal is None else (count_refusal,)
        return type(cls.__name__, (cls,), {"limits": limits, "refusal_counters": counters})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.awaiting_headers = True  # between requests too: the next bytes are headers
        self.header_bytes = 0
        self.header_timer: asyncio.TimerHandle | None = None
        self.refusal: tuple[int, str, str] | None = None

    # -- connection ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()  # a connection that sends nothing is cut too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        rest: bytes | memoryview = data
        piece: bytes | memoryview
        while rest:
            if self.awaiting_headers:
                room = self.limits.max_header_bytes - self.header_bytes
                if len(rest) > room:  # only the allowed part reaches the parser
                    view = memoryview(rest)
                    piece, rest = view[:room], view[room:]
                else:
                    piece, rest = rest, b""
                self.header_bytes += len(piece)
            else:
                piece, rest = rest, b""
            if piece and not self._feed(piece):
                return
            if self.awaiting_headers and rest:  # the headers go on past the limit
                self._refuse(431, f"the request's headers are larger than the limit of "
                             f"{self.limits.max_header_bytes} bytes", "headers_too_large")
                return
            if self.transport.is_closing():
                return
        # Headers begun but not complete: timed from here (a whole request in one read, the
        # usual case, arms no timer).
        if self.awaiting_headers and self.header_bytes:
            self._arm_header_timer()

    def _feed(self, piece: bytes | memoryview) -> bool:
        """The parser fed (uvicorn's own handling); False once the connection is done."""
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return False
        except httptools.HttpParserError:
            if self.refusal is not None:
                self._refuse(*self.refusal)
            else:  # not HTTP: one debug line, not a warning per hostile client
                logger.debug("invalid HTTP request from %s", self.client)
                self.send_400_response("Invalid HTTP request received.")
            return False
        return True

    # -- parser callbacks ----------------------------------------------------------------
    def on_headers_complete(self) -> None:
        # Counted once whole (their bytes are bounded already): no cost per header.
        if len(self.headers) > self.limits.max_headers:
            self.refusal = (431, f"the request has more than {self.limits.max_headers} "
                            f"header fields", "too_many_headers")
            raise _Refused()  # before uvicorn starts the request
        self.awaiting_headers = False
        self._disarm_header_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.awaiting_headers = True
        self.header_bytes = 0
        super().on_message_complete()

    # -- the header timer ----------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                     self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timeout(self) -> None:
        self.header_timer = None
        if self.transport.is_closing() or not self.awaiting_headers:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_header_timer()  # a pipelined request's bytes, while a response runs
            return
        if self.header_bytes == 0:  # nothing asked: closed, as an idle keep-alive is
            self.transport.close()
            return
        self._refuse(408, f"the request's headers did not arrive within "
                     f"{self.limits.header_timeout_s:g} s", "header_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        logger.debug("HTTP %d for %s: %s", status, self.client, message)
        for count in self.refusal_counters:
            count(status)
        body = json.dumps(ApiError(status, message, code=code).body()).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\n",
                 b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        self.transport.close()
