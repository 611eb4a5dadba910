"""PageKV's own data transport for cross-pod pulls: framed TCP, zero-copy at both ends.

The control is `KVNode.PullBlocks` (kvnode/pod/kv_transfer.py): its first message is a
ticket naming this transport, the holder's data port and a session token. The puller then
connects to that port on the host it dialed for gRPC, and the bytes flow here:

    puller → holder   "PKVT" | version u16 | token (32 bytes)
    holder → puller   chunk | chunk | ... | "PKVE" | blocks u32
    chunk             "PKVC" | n u32 | n raw entries      (or, LZ4: one entry, "PKVB"...)

Each entry is the SSD tier's self-describing entry (tiers/ssd_format.py: hashes, layout id,
both checksums, then the payload), exactly what the gRPC path carries. The holder sends a
host pool's block from where it lies: the header, then the block's per-layer planes in one
`sendmsg` (a gather write, no copy in Python), a chunk of blocks at a time. Both ends know
each raw entry's header length (from the hashes asked), so the puller posts one
`recvmsg_into` for a whole chunk: each header into a buffer, each payload straight into the
pool block reserved for it (a scatter read); then it checks every header (kvnode/engine/
peer_pull.BlockSink) and verifies every payload's checksum where it landed, before it counts.
A chunk whose bytes are not those entries fails those checks: nothing of it counts.
Nothing on the hot path allocates per message: the kernel copies from the socket into the
pool and out of the pool into the socket.

With TLS (the pod's --tls-* files), the data connection is TLS with the same files as its
gRPC port: the server's certificate checked against the CA, a client certificate when the
pod requires one. An unknown or reused token, a hello that does not come within
HELLO_TIMEOUT_S, or bytes that are not a hello: the connection is closed, nothing sent.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence

from pagekv.kvnode.engine.peer_pull import (
    DEADLINE,
    PEER_MISSING,
    PEER_UNAVAILABLE,
    BlockSink,
    PullAsk,
    PullFailed,
    PullHandle,
)
from pagekv.kvnode.pod.kv_data_session import TOKEN_BYTES, ExportSession
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.tiers.codec import CODEC_RAW
from pagekv.tiers.ssd_format import ENTRY_FIXED_LEN, FormatError, entry_header_len

logger = logging.getLogger(__name__)

NAME = "tcp"
HELLO = struct.Struct("<4sH")
HELLO_MAGIC = b"PKVT"
VERSION = 1
END = struct.Struct("<4sI")
END_MAGIC = b"PKVE"
CHUNK = struct.Struct("<4sI")
CHUNK_MAGIC = b"PKVC"
ENTRY_MAGIC = b"PKVB"
RECEIVE_WINDOW_MAX = 16 << 20  # the most _size_receive_window asks for
IOV_MAX = 1024            # pieces one sendmsg may take (Linux's UIO_MAXIOV)
HELLO_TIMEOUT_S = 5.0
MAX_PENDING_HELLOS = 32   # connections not yet past their hello; a newer one evicts the oldest


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into_pieces(sock, [memoryview(buf)])
    return bytes(buf)


def _recv_into_pieces(sock: socket.socket, pieces: Sequence[memoryview]) -> None:
    """Fill every piece, in order, from the socket (ConnectionError on a short stream)."""
    views = [p for p in pieces if p.nbytes]
    if isinstance(sock, ssl.SSLSocket):  # no recvmsg_into over TLS: one piece at a time
        for view in views:
            while view.nbytes:
                n = sock.recv_into(view)
                if n == 0:
                    raise ConnectionError("the peer closed the data connection")
                view = view[n:]
        return
    while views:
        n = sock.recvmsg_into(views[:IOV_MAX])[0]
        if n == 0:
            raise ConnectionError("the peer closed the data connection")
        _advance(views, n)


def _send_pieces(sock: socket.socket, pieces: Sequence[bytes | memoryview]) -> None:
    """Every piece, in order (a gather write; partial writes resumed)."""
    views = [memoryview(p).cast("B") for p in pieces if memoryview(p).nbytes]
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return
    while views:
        _advance(views, sock.sendmsg(views[:IOV_MAX]))


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first `n` bytes of `views` (what one scatter/gather call moved)."""
    while n:
        first = views[0]
        if n >= first.nbytes:
            n -= first.nbytes
            views.pop(0)
        else:
            views[0] = first[n:]
            n = 0


def _shutdown(sock: socket.socket) -> None:
    """Wake a thread blocked on the socket (close alone does not, on Linux)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _tune(sock: socket.socket) -> None:
    # Buffer sizes stay the kernel's autotuning: a fixed SO_RCVBUF would cap the window at
    # net.core.rmem_max and turn the tuning off.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _size_receive_window(sock: socket.socket) -> None:
    """Before connecting, the receive buffer at once as large as the kernel allows
    (net.core.rmem_max, 4 MiB here): a fresh connection's autotuning starts at 128 KiB and
    grows only as the reader keeps up, which a one-pull connection never outlives (94 MB on
    loopback: 1.27-1.38 GB/s autotuned, 1.55-1.57 with 4 MiB, alternating rounds). A window of
    4 MiB covers a datacenter link's bandwidth-delay product (100 Gbit/s x 300 us)."""
    size = _rmem_max()
    if size:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, min(size, RECEIVE_WINDOW_MAX))


@functools.cache
def _rmem_max() -> int:
    try:
        with open("/proc/sys/net/core/rmem_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0  # not Linux, or hidden: the kernel's autotuning


class TcpDataServer:
    """The holder's end: a listening port, the sessions offered on it, a thread per
    connection that sends its session's frames."""

    name = NAME

    def __init__(self, host: str, port: int = 0, ssl_context: ssl.SSLContext | None = None
                 ) -> None:
        self._listener = socket.create_server((host, port), backlog=64)
        self.port = self._listener.getsockname()[1]
        self._ssl = ssl_context
        self._sessions: dict[bytes, ExportSession] = {}
        self._lock = threading.Lock()
        self._pending: deque[socket.socket] = deque()  # accepted, no hello yet
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kv-data-accept",
                                        daemon=True)
        self._thread.start()

    def offer(self, session: ExportSession) -> pb.TransferTicket:
        """Make the session reachable by its token until it is taken or ends."""
        with self._lock:
            self._sessions[session.token] = session
        session.on_abort(lambda: self._withdraw(session))
        return pb.TransferTicket(transport=NAME, token=session.token,
                                 num_blocks=session.num_blocks, port=self.port)

    def _withdraw(self, session: ExportSession) -> None:
        with self._lock:
            if self._sessions.get(session.token) is session:
                del self._sessions[session.token]

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # out of descriptors: do not spin
                continue
            with self._lock:
                if len(self._pending) >= MAX_PENDING_HELLOS:
                    # The oldest silent one makes room: a real puller says hello within a
                    # round trip, so a flood of idle connections cannot keep it out.
                    _shutdown(self._pending.popleft())
                self._pending.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kv-data-send",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        session = None
        try:
            with conn:
                hello = self._hello(conn)
                session = self._claim(hello[1]) if hello is not None else None
                if session is not None:
                    self._send(hello[0], session)  # type: ignore[index]  # set with session
        except (OSError, ValueError) as exc:
            logger.debug("data connection ended: %s", exc)
            if session is not None:
                session.finish()  # nothing more will go: the control call need not wait
        finally:
            if session is not None:
                session.detach()

    def _hello(self, conn: socket.socket) -> tuple[socket.socket, bytes] | None:
        """The connection past TLS and a whole valid hello, and the token it names; None if
        refused. The connection counts as silent until then (MAX_PENDING_HELLOS)."""
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            sock: socket.socket = conn
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(conn, server_side=True)
            magic, version = HELLO.unpack(_recv_exact(sock, HELLO.size))
            if magic != HELLO_MAGIC or version != VERSION:
                return None
            return sock, _recv_exact(sock, TOKEN_BYTES)
        except (OSError, ConnectionError, ssl.SSLError):
            return None
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._pending.remove(conn)

    def _claim(self, token: bytes) -> ExportSession | None:
        with self._lock:
            session = self._sessions.pop(token, None)  # single use
        if session is None or not session.attach():
            return None
        return session

    def _send(self, sock: socket.socket, session: ExportSession) -> None:
        session.on_abort(lambda: _shutdown(sock))
        _tune(sock)
        step = session.per_chunk
        for lo in range(0, session.num_blocks, step):
            remaining = session.remaining_s()
            if remaining <= 0:
                return  # the puller's deadline has passed: it is not reading any more
            sock.settimeout(remaining)
            hi = min(lo + step, session.num_blocks)
            frames = session.frames(lo, hi)
            if session.compress:  # LZ4 entries: lengths the puller cannot know, one by one
                _send_pieces(sock, [piece for frame in frames for piece in frame])
            elif frames:
                _send_pieces(sock, [CHUNK.pack(CHUNK_MAGIC, len(frames)),
                                    *(piece for frame in frames for piece in frame)])
            session.sent(frames)
            if len(frames) < hi - lo:
                break  # the byte limit, or a tier block gone
        sock.sendall(END.pack(END_MAGIC, session.sent_blocks))
        session.finish()

    def close(self) -> None:
        self._closed = True
        _shutdown(self._listener)
        self._listener.close()
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.end()


class TcpDataClient:
    """The puller's end: one connection per pull, received into the pull's BlockSink."""

    name = NAME

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context

    def receive(self, host: str, ticket: pb.TransferTicket, ask: PullAsk, sink: BlockSink,
                handle: PullHandle, control: Iterator[pb.PullBlocksChunk]) -> None:
        """The blocks come on the data connection in order: `control` is not needed."""
        timeout = ask.deadline - time.monotonic()
        if timeout <= 0:
            raise PullFailed(DEADLINE, "no time left before the pull's deadline")
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, ticket.port, type=socket.SOCK_STREAM)[0]
            raw = socket.socket(family, kind, proto)
        except (OSError, UnicodeError, OverflowError) as exc:
            raise PullFailed(PEER_UNAVAILABLE, f"data port {host}:{ticket.port}: {exc}") from None
        with raw:
            # Before connecting: a cancel must also stop a connect to an unreachable holder.
            handle.on_cancel(lambda: _shutdown(raw))
            try:
                _size_receive_window(raw)
                raw.settimeout(timeout)
                raw.connect(address)
            except OSError as exc:
                if handle.cancelled:
                    return
                raise PullFailed(PEER_UNAVAILABLE,
                                 f"data port {host}:{ticket.port}: {exc}") from None
            _tune(raw)
            try:
                sock = (self._ssl.wrap_socket(raw, server_hostname=host)
                        if self._ssl is not None else raw)
                sock.sendall(HELLO.pack(HELLO_MAGIC, VERSION) + ticket.token)
                self._receive_blocks(sock, ask, sink)
            except TimeoutError:
                if handle.cancelled:
                    return
                raise PullFailed(DEADLINE, f"{sink.count} of {len(ask.hashes)} blocks before "
                                           f"the deadline") from None
            except (OSError, ConnectionError, ssl.SSLError) as exc:
                if handle.cancelled:
                    return
                raise PullFailed(PEER_UNAVAILABLE, f"data connection to {host}:{ticket.port} "
                                                   f"after {sink.count} blocks: {exc}") from None

    def _receive_blocks(self, sock: socket.socket, ask: PullAsk, sink: BlockSink) -> None:
        fixed = bytearray(ENTRY_FIXED_LEN)
        fixed_view = memoryview(fixed)
        while True:
            sock.settimeout(max(ask.deadline - time.monotonic(), 1e-3))
            _recv_into_pieces(sock, [fixed_view[:4]])
            if fixed_view[:4] == END_MAGIC:
                (count,) = struct.unpack("<I", _recv_exact(sock, 4))
                if count != sink.count:
                    raise PullFailed(PEER_MISSING, f"the peer says it sent {count} blocks, "
                                                   f"{sink.count} arrived")
                return
            if fixed_view[:4] == CHUNK_MAGIC:
                (n,) = struct.unpack("<I", _recv_exact(sock, 4))
                self._receive_chunk(sock, n, sink)
                continue
            if fixed_view[:4] != ENTRY_MAGIC:
                raise ConnectionError("the data stream is out of step (not an entry)")
            _recv_into_pieces(sock, [fixed_view[4:]])
            try:
                header_len = entry_header_len(fixed_view)
            except FormatError as exc:
                raise ConnectionError(f"a malformed entry header: {exc}") from None
            header = bytes(fixed) + _recv_exact(sock, header_len - ENTRY_FIXED_LEN)
            hdr = sink.expect(header)
            if hdr.codec == CODEC_RAW and hdr.payload_len == hdr.raw_len:
                _recv_into_pieces(sock, sink.pieces())
                sink.commit(hdr)
            else:  # LZ4 (a slow link): whole, then decoded into place; never over a block
                if hdr.payload_len > hdr.raw_len + 4096:
                    raise ConnectionError(f"a payload of {hdr.payload_len} bytes for a "
                                          f"{hdr.raw_len}-byte block")
                sink.take_entry(header + _recv_exact(sock, hdr.payload_len))

    @staticmethod
    def _receive_chunk(sock: socket.socket, n: int, sink: BlockSink) -> None:
        """`n` raw entries in one scatter read: headers into buffers, payloads in place."""
        if not 0 < n <= sink.capacity - sink.count:
            raise ConnectionError(f"a chunk of {n} blocks where {sink.capacity - sink.count} "
                                  f"are still asked for")
        headers = [bytearray(sink.header_len(k)) for k in range(n)]
        views: list[memoryview] = []
        for k, header in enumerate(headers):
            views.append(memoryview(header))
            views.extend(sink.pieces(k))
        _recv_into_pieces(sock, views)
        for header in headers:
            sink.commit(sink.expect(header))
