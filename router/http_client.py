"""A small asyncio HTTP/1.1 client, for the router's calls to vLLM pods' OpenAI servers.

The protocol is h11's (the sans-IO parser uvicorn itself depends on, so the router's light
install already has it); this module only moves bytes. One `HttpOrigin` per pod keeps its
idle keep-alive connections, so a busy router does not open (and leave in TIME_WAIT) a
connection per request. A response body is read as it arrives: a stream of server-sent
events goes on for as long as the generation does.

Every wait is bounded by the caller's deadline (a loop time, or None for none) and the
connection by `connect_timeout_s`; no timer spans the caller's own work between two reads.

An `https://` origin verifies the server's certificate and name: against the system's CAs,
or the CA file of the TLS context the caller builds once with `client_ssl_context`
(proto/credentials.py; the router's --vllm-tls-* files), which may also hold the client's own
certificate, for a server that asks for one (mutual TLS). A TLS failure is a ConnectFailed like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncGenerator

import h11

from pagekv.proto.credentials import client_ssl_context

_READ_BYTES = 65536


class ConnectFailed(Exception):
    """No response at all: refused, unreachable, timed out connecting, or the connection
    closed before a status line (a pod that is gone or restarting)."""


class BrokenResponse(Exception):
    """The response started and then broke: cut off, or not HTTP the parser accepts."""


def split_address(address: str) -> tuple[str, int, bool]:
    """`host:port`, `http://host:port` or `https://host:port` (IPv6 in brackets) ->
    (host, port, tls)."""
    tls = address.startswith("https://")
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port), tls


class _Connection:
    __slots__ = ("h11", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)

    async def send(self, *events: h11.Event) -> None:
        for event in events:
            data = self.h11.send(event)
            if data:
                self.writer.write(data)
        await self.writer.drain()

    async def next_event(self, deadline: float | None) -> h11.Event | type[h11.PAUSED]:
        while True:
            event = self.h11.next_event()
            if isinstance(event, h11.Event):
                return event
            if event is h11.PAUSED:  # the callers take it as "not what was expected"
                return h11.PAUSED
            async with asyncio.timeout_at(deadline):
                data = await self.reader.read(_READ_BYTES)
            self.h11.receive_data(data)  # b"": the peer closed

    def reusable(self) -> bool:
        return (self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE
                and not self.reader.at_eof())

    def abort(self) -> None:
        self.writer.transport.abort()


class Response:
    """A status, its headers (lower-case names) and a body still to read. `release()` when
    done: the connection goes back to its origin when the body was read to the end."""

    def __init__(self, origin: HttpOrigin, conn: _Connection, status: int,
                 headers: dict[str, str]) -> None:
        self._origin = origin
        self._conn: _Connection | None = conn
        self.status = status
        self.headers = headers
        self._complete = False

    async def chunks(self, deadline: float | None) -> AsyncGenerator[bytes, None]:
        conn = self._conn
        assert conn is not None, "the response was released"
        while not self._complete:
            try:
                event = await conn.next_event(deadline)
            except TimeoutError:  # an OSError too, but the caller's deadline: not broken
                raise
            except (OSError, h11.RemoteProtocolError) as exc:
                raise BrokenResponse(f"{type(exc).__name__}: {exc}") from None
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._complete = True
                return
            else:  # ConnectionClosed (nothing else comes within a body)
                raise BrokenResponse(f"the connection closed mid-response ({event!r})")

    async def read(self, deadline: float | None, limit: int = 1 << 20) -> bytes:
        """The whole body, at most `limit` bytes of it (an error page, not a stream)."""
        parts: list[bytes] = []
        size = 0
        async for piece in self.chunks(deadline):
            if size < limit:
                parts.append(piece[:limit - size])
            size += len(piece)
        return b"".join(parts)

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._origin.give_back(conn, self._complete)

    def abort(self) -> None:
        """Close the connection now: the client went away, the server sees the stream end."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()


class HttpOrigin:
    """One server's connections. `ssl_context` (client_ssl_context's) is used for an
    https:// address; plain http:// ignores it."""

    def __init__(self, address: str, *, connect_timeout_s: float = 3.0,
                 max_idle: int = 16, ssl_context: ssl.SSLContext | None = None) -> None:
        self.host, self.port, tls = split_address(address)
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._ssl = (ssl_context or client_ssl_context(None)) if tls else None
        self._idle: list[_Connection] = []
        self._closed = False

    async def _connect(self, deadline: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        until = loop.time() + self.connect_timeout_s
        if deadline is not None:
            until = min(until, deadline)
        try:
            async with asyncio.timeout_at(until):
                reader, writer = await asyncio.open_connection(self.host, self.port,
                                                               ssl=self._ssl)
        except TimeoutError:
            if deadline is not None and until >= deadline:
                raise  # the caller's deadline, not a connection problem
            raise ConnectFailed(f"no connection within {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc.strerror or exc}") from None
        return _Connection(reader, writer)

    async def request(self, method: str, target: str, headers: list[tuple[str, str]],
                      body: bytes, deadline: float | None) -> Response:
        """Send one request and read its status line and headers. A kept-alive connection
        that turns out to be closed (the server's idle timeout) is replaced once by a new
        one: nothing was answered on it, so nothing was served."""
        while True:
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else await self._connect(deadline)
            try:
                return await self._exchange(conn, method, target, headers, body, deadline)
            except ConnectFailed:
                conn.abort()
                if not reused:
                    raise
            except BaseException:
                conn.abort()
                raise

    async def _exchange(self, conn: _Connection, method: str, target: str,
                        headers: list[tuple[str, str]], body: bytes,
                        deadline: float | None) -> Response:
        head = [("Host", f"{self.host}:{self.port}"), ("Content-Length", str(len(body))),
                *headers]
        try:
            async with asyncio.timeout_at(deadline):
                await conn.send(h11.Request(method=method, target=target, headers=head),
                                h11.Data(data=body), h11.EndOfMessage())
            while True:
                event = await conn.next_event(deadline)
                if isinstance(event, h11.Response):
                    break
                if not isinstance(event, h11.InformationalResponse):  # ConnectionClosed
                    raise ConnectFailed(self._closed_early())
                # 100 Continue and the like: the real one follows
        except TimeoutError:
            raise
        except h11.RemoteProtocolError as exc:
            # h11's words for an end of stream while it waits for the status line
            raise ConnectFailed(self._closed_early() if conn.reader.at_eof()
                                else f"RemoteProtocolError: {exc}") from None
        except (OSError, h11.LocalProtocolError) as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from None
        names = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        return Response(self, conn, event.status_code, names)

    def _closed_early(self) -> str:
        if self._ssl is None:
            return "the connection closed before a response"
        # TLS 1.3 completes the client's handshake before the server checks the client's
        # certificate; its refusal then reads here as an end of stream, with no reason.
        return ("the server closed the TLS connection before a response, as a server that "
                "requires a client certificate does when it gets none or one its CA did not "
                "sign")

    def give_back(self, conn: _Connection, complete: bool) -> None:
        """A response is done with its connection: kept for the next request if the body
        was read to the end (`complete`) and both sides can go on, else closed."""
        if complete and not self._closed and len(self._idle) < self.max_idle \
                and conn.reusable():
            conn.h11.start_next_cycle()
            self._idle.append(conn)
        else:
            conn.abort()

    async def close(self) -> None:
        """Close the idle connections; responses still being read close theirs when done."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.writer.close()
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()
