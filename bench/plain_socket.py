"""The plain-socket baseline of a pull: a Python TCP socket moving N bytes from a preallocated
buffer (`sendall`) into a preallocated buffer (`recv_into`), nothing else on the path.

Two ends, each a process of its own (so each can run inside a network namespace with
`ip netns exec`):

    python -m bench.plain_socket serve HOST PORT NBYTES      # the holder's side: sends
    python -m bench.plain_socket fetch HOST PORT NBYTES [--times K]   # the puller's side

`serve` accepts connections until killed; on each, every 8-byte ask (a big-endian byte
count) is answered by that many bytes. `fetch` connects, then K times asks for NBYTES and
receives them, timing each from the ask to the last byte (one round trip plus the bytes, as
a pull is timed from its ask to its last block) and prints one JSON line: the seconds of
each transfer and the connect time.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time

ASK = struct.Struct(">Q")


def tuned(sock: socket.socket) -> socket.socket:
    # The asks are tiny; buffer sizes stay the kernel's autotuning (a fixed SO_RCVBUF would
    # cap it at net.core.rmem_max, far below what a fast link needs).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n


def serve(host: str, port: int, nbytes: int) -> None:
    payload = memoryview(bytearray(b"\x5a" * nbytes))  # touched once, reused by every ask
    with socket.create_server((host, port), reuse_port=False) as server:
        print("listening", flush=True)
        while True:
            conn, _ = server.accept()
            with tuned(conn):
                ask = bytearray(ASK.size)
                try:
                    while True:
                        recv_exact(conn, memoryview(ask))
                        (n,) = ASK.unpack(ask)
                        conn.sendall(payload[:min(n, nbytes)])
                except (ConnectionError, OSError):
                    pass  # the fetcher is done


def fetch(host: str, port: int, nbytes: int, times: int) -> dict:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    view[:] = b"\x00" * nbytes  # touched before timing, as a pull's staging buffer would be
    t0 = time.perf_counter()
    sock = tuned(socket.create_connection((host, port), timeout=60))
    connect_s = time.perf_counter() - t0
    secs = []
    with sock:
        for _ in range(times):
            t0 = time.perf_counter()
            sock.sendall(ASK.pack(nbytes))
            recv_exact(sock, view)
            secs.append(time.perf_counter() - t0)
    return {"bytes": nbytes, "connect_s": connect_s, "seconds": secs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=("serve", "fetch"))
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("nbytes", type=int)
    ap.add_argument("--times", type=int, default=1, help="fetch: transfers on one connection")
    args = ap.parse_args(argv)
    if args.role == "serve":
        serve(args.host, args.port, args.nbytes)
    else:
        print(json.dumps(fetch(args.host, args.port, args.nbytes, args.times)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
