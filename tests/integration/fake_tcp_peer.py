"""A KV holder that misbehaves on the tcp data transport, for
tests/integration/test_kv_pull_tcp_faults.py.

It serves KVNode.PullBlocks by relaying the request to a real pod (--upstream) on the gRPC
path (transports stripped: the entries come in the stream), then answers the puller as a
tcp holder does: a ticket naming its own data port and a fresh token, and on the data
connection (once the puller's hello shows that token) the entries and the end frame
(kvnode/pod/kv_data_tcp.py's wire format), altered as the current mode says. The mode is
set on stdin, one line per change ("<mode> <arg>"), acknowledged with "MODE <mode> <arg>":

  relay           every entry intact, then the end frame (the fake itself is faithful)
  corrupt K       a payload byte of entry K (0-based) flipped
  skip K          entry K+1 sent where entry K belongs
  extra           every entry, then entry 0 once more, then the end frame
  garbage K       K entries, then bytes that are no frame
  huge-payload K  entry K's header (checksummed) announcing a payload 512 MiB longer
  huge-header K   entry K's fixed part announcing 65535 tokens and a 255-byte hash
  stall K         K entries, then "SENT K" on stdout and silence (the connection held)
  close K         K entries, then the connection closed, no end frame
  count N         every entry, then an end frame that says N more than were sent
  short K         K entries, then an honest end frame of K
  transport NAME  a ticket naming transport NAME (no data connection expected)
  port P          a ticket pointing at port P (no data connection expected)
  jammed          a ticket pointing at a port whose accept queue is full: the puller's
                  connect hangs (its SYNs dropped, as across a partition)

and in chunk frames ("PKVC" | n u32 | n raw entries), as a holder sends raw entries:

  chunk-relay     every entry in one chunk, then the end frame
  chunk-corrupt K one chunk, a payload byte of entry K flipped
  chunk-skip K    one chunk without entry K
  chunk-over      a chunk announcing one entry more than asked
  chunk-zero      a chunk announcing no entry
  chunk-cut K     a chunk of K entries, then one announcing the rest, cut inside its first

Each served data connection ends with "DONE <mode>" on stdout, and a hello with a token this
fake did not give out with "BAD HELLO". Prints "READY <port>" once it listens on
127.0.0.1:<port>.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import socket
import struct
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.tiers.ssd_format import pack_entry_header_of, parse_entry_header

MAX_MESSAGE = 64 << 20
HELLO = struct.Struct("<4sH")
END = struct.Struct("<4sI")
CHUNK = struct.Struct("<4sI")
FIXED = struct.Struct("<4sHBBBBHQQQQ")  # an entry's fixed part (tiers/ssd_format.py)
TOKEN_BYTES = 32
HUGE = 512 << 20


def say(line: str) -> None:
    print(line, flush=True)


@dataclass
class Pull:
    """A ticket given out: the entries to send on its data connection, and its mode."""

    entries: list[bytes]
    mode: str
    arg: str
    done: threading.Event = field(default_factory=threading.Event)


def reheader(entry: bytes, **changes: int) -> bytes:
    """The entry's header with fields changed, its checksum made right again (a hostile
    holder can do that): the header alone, no payload."""
    hdr = parse_entry_header(entry)
    fields = dict(block_hash=hdr.block_hash, parent_hash=hdr.parent_hash,
                  token_ids=hdr.token_ids, layout_id=hdr.layout_id, dtype_code=hdr.dtype_code,
                  codec=hdr.codec, raw_len=hdr.raw_len, payload_len=hdr.payload_len,
                  payload_xxh=hdr.payload_xxh)
    fields.update(changes)
    return pack_entry_header_of(**fields)  # type: ignore[arg-type]


class DataPort:
    """The fake's data port: a thread per connection, which plays its pull's mode."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.pulls: dict[bytes, Pull] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()
        # A listener that never accepts, its queue of one taken: further SYNs are dropped.
        self.jammed = socket.create_server(("127.0.0.1", 0), backlog=0)
        self.jammed_port = self.jammed.getsockname()[1]
        self.jam = socket.create_connection(("127.0.0.1", self.jammed_port), timeout=5)

    def _accept(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pull = None
        with conn, contextlib.suppress(OSError):
            conn.settimeout(10)
            hello = _recv_exact(conn, HELLO.size + TOKEN_BYTES)
            with self.lock:
                pull = self.pulls.pop(hello[HELLO.size:], None)
            if hello[:4] != b"PKVT" or pull is None:
                say("BAD HELLO")
                return
            conn.settimeout(None)
            with contextlib.suppress(OSError):  # the puller let go while this still sent
                self._play(conn, pull)
            say(f"DONE {pull.mode}")
        if pull is not None:
            pull.done.set()

    def _play(self, conn: socket.socket, pull: Pull) -> None:
        entries, mode = pull.entries, pull.mode
        k = int(pull.arg) if pull.arg.isdigit() else 0
        if mode.startswith("chunk-"):
            return _play_chunked(conn, entries, mode, k)
        if mode == "corrupt":
            damaged = bytearray(entries[k])
            damaged[-1] ^= 0xFF  # the payload ends the entry
            entries = [*entries[:k], bytes(damaged), *entries[k + 1:]]
        elif mode == "skip":
            entries = [*entries[:k], *entries[k + 1:]]
        elif mode == "extra":
            entries = [*entries, entries[0]]
        elif mode in ("garbage", "huge-payload", "huge-header", "stall", "close", "short"):
            entries = entries[:k]
        for entry in entries:
            conn.sendall(entry)
        if mode == "garbage":
            conn.sendall(b"JUNK" + bytes(range(60)))
            _drain(conn)
        elif mode == "huge-payload":
            raw_len = parse_entry_header(pull.entries[k]).raw_len
            conn.sendall(reheader(pull.entries[k], payload_len=raw_len + HUGE))
            _drain(conn)  # never the payload: a puller that waits for it waits in vain
        elif mode == "huge-header":
            fixed = list(FIXED.unpack_from(pull.entries[k]))
            fixed[4], fixed[6] = 255, 65535  # hash_len, n_tokens
            conn.sendall(FIXED.pack(*fixed))
            _drain(conn)
        elif mode == "stall":
            say(f"SENT {k}")
            _drain(conn)  # silence, until the puller lets go (or this process is killed)
        elif mode == "close":
            return
        else:
            extra = int(pull.arg) if mode == "count" else 0
            sent = len(entries) - (1 if mode == "extra" else 0)
            conn.sendall(END.pack(b"PKVE", sent + extra))
            _drain(conn)


def _play_chunked(conn: socket.socket, entries: list[bytes], mode: str, k: int) -> None:
    def chunk(some: list[bytes], n: int | None = None) -> bytes:
        return CHUNK.pack(b"PKVC", len(some) if n is None else n) + b"".join(some)

    if mode == "chunk-corrupt":
        damaged = bytearray(entries[k])
        damaged[-1] ^= 0xFF
        entries = [*entries[:k], bytes(damaged), *entries[k + 1:]]
    elif mode == "chunk-skip":
        entries = [*entries[:k], *entries[k + 1:]]
    if mode == "chunk-over":
        conn.sendall(chunk(entries, len(entries) + 1))
    elif mode == "chunk-zero":
        conn.sendall(chunk([]))
    elif mode == "chunk-cut":
        conn.sendall(chunk(entries[:k]))
        conn.sendall(chunk([entries[k][: len(entries[k]) // 2]], len(entries) - k))
        return  # closed mid-entry
    else:
        conn.sendall(chunk(entries) + END.pack(b"PKVE", len(entries)))
    _drain(conn)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            raise ConnectionError("closed")
        buf += got
    return buf


def _drain(conn: socket.socket) -> None:
    """Hold the connection until the puller closes it (a reset, with bytes it never read)."""
    conn.settimeout(None)
    with contextlib.suppress(ConnectionResetError):
        while conn.recv(1 << 16):
            pass


class FakeTcpPeer(pb_grpc.KVNodeServicer):
    def __init__(self, upstream: str, data: DataPort) -> None:
        channel = grpc.insecure_channel(upstream, [
            ("grpc.max_receive_message_length", MAX_MESSAGE)])
        self.stub = pb_grpc.KVNodeStub(channel)
        self.data = data
        self.mode, self.arg = "relay", "0"

    def PullBlocks(self, request, context):
        offered = list(request.transports)
        del request.transports[:]  # the upstream's entries in its stream, to replay
        entries = [e for chunk in self.stub.PullBlocks(request, timeout=30)
                   for e in chunk.entries]
        mode, arg = self.mode, self.arg
        token = secrets.token_bytes(TOKEN_BYTES)
        pull = Pull(entries, mode, arg)
        ticket = pb.TransferTicket(transport="tcp", token=token, num_blocks=len(entries),
                                   port=self.data.port)
        if mode == "transport":
            ticket.transport = arg
        elif mode == "port":
            ticket.port = int(arg)
        elif mode == "jammed":
            ticket.port = self.data.jammed_port
        else:
            with self.data.lock:
                self.data.pulls[token] = pull
        say(f"TICKET {mode} offered={','.join(offered)}")
        yield pb.PullBlocksChunk(ticket=ticket)
        # The control stays open while the data moves, as a real holder's does.
        end = time.monotonic() + 30
        while context.is_active() and not pull.done.is_set() and time.monotonic() < end:
            pull.done.wait(0.05)
        if pull.done.is_set():
            yield pb.PullBlocksChunk(ready_blocks=len(entries))


def read_modes(peer: FakeTcpPeer) -> None:
    for line in sys.stdin:
        parts = line.split()
        if len(parts) == 2:
            peer.mode, peer.arg = parts
            say(f"MODE {peer.mode} {peer.arg}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", required=True)
    args = p.parse_args()
    data = DataPort()
    peer = FakeTcpPeer(args.upstream, data)
    server = grpc.server(futures.ThreadPoolExecutor(8), options=[
        ("grpc.max_send_message_length", MAX_MESSAGE)])
    pb_grpc.add_KVNodeServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    threading.Thread(target=read_modes, args=(peer,), daemon=True).start()
    say(f"READY {port}")
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
