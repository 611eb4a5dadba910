"""The data path of a pull alone: PageKV's tcp transport against a plain socket, same bytes.

A holder process serves a run of SmolLM2-135M's KV blocks (30 layers, 3 KV heads of 64, fp32:
46,080 B/token, 94.4 MB for 2,048 tokens) from a pool laid out as the pod's (per-layer K and V
tensors); this process receives them as a pod does: each block's header checked, its planes
received straight into a pool block (`BlockSink` over `recvmsg_into`), its checksum verified.
The baseline is a plain Python socket moving the same number of bytes from a preallocated
buffer (`sendall`) into a preallocated buffer (`recv_into`), nothing else, in its own
process too (bench/plain_socket.py). Rounds alternate; medians and the ratio are printed.
No engine, no gRPC control: what the wire and the two ends' Python cost (bench.kv_pull has
the whole pull, control and landing included).

    python -m bench.kv_wire [--quick] [--tokens 2048] [--block-size 16] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import torch

from bench.machine import machine_info
from bench.stats import pct
from pagekv.kvnode.engine.kv_export import ExportRun
from pagekv.kvnode.engine.peer_pull import BlockSink, PullAsk, PullHandle
from pagekv.kvnode.model.attention.kv_cache import KVCache, KVCacheSpec
from pagekv.kvnode.pod.kv_data_session import ExportSession
from pagekv.kvnode.pod.kv_data_tcp import TcpDataClient, TcpDataServer
from pagekv.proto.medium import Medium
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.tiers.peer_entries import KvLayout

LAYERS, HEADS, HEAD = 30, 3, 64  # SmolLM2-135M's KV


def pool(blocks: int, block_size: int) -> tuple[KVCache, KvLayout]:
    spec = KVCacheSpec(LAYERS, block_size, HEADS, HEAD, torch.float32)
    cache = KVCache.allocate(spec, blocks, "cpu")
    for k in (*cache.key_caches, *cache.value_caches):
        k.normal_()
    layout = KvLayout.of({"model": "bench", "dtype": "float32", "block": block_size},
                         4, spec.block_bytes)
    return cache, layout


class PoolExporter:
    """The exporter's part a session uses, over a bare pool (every block "pinned")."""

    def __init__(self, cache: KVCache, layout: KvLayout) -> None:
        self.cache = cache
        self.layout = layout

    def payloads(self, run: ExportRun, lo: int, hi: int) -> list[list[memoryview]]:
        return [self.cache.block_planes(i) or [] for i in range(lo, hi)]

    def pool_blocks(self, run: ExportRun, lo: int, hi: int) -> list[None]:
        return [None] * (hi - lo)  # no pool blocks to keep checksums on: each pull sums all


def hashes(n: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * 8 for i in range(1, n + 1)]


def ended(session: ExportSession) -> None:
    """The control call's part: hold the session until the transport has sent it all."""
    while not session.wait_progress(session.ready, 60)[1]:
        pass
    session.end()


def holder(tokens: int, block_size: int) -> None:
    """The holder process: serves every session asked on stdin ("go"), prints tickets."""
    blocks = tokens // block_size
    cache, layout = pool(blocks, block_size)
    exporter = PoolExporter(cache, layout)
    server = TcpDataServer("127.0.0.1")
    chain = hashes(blocks)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        run = ExportRun(chain, [Medium.GPU] * blocks)
        session = ExportSession(exporter, run, budget=1 << 40,  # type: ignore[arg-type]
                                deadline=time.monotonic() + 60, compress=False,
                                chunk_bytes=4 << 20, close_run=lambda: None)
        ticket = server.offer(session)
        print(json.dumps({"port": ticket.port, "token": ticket.token.hex(),
                          "n": ticket.num_blocks}), flush=True)
        threading.Thread(target=ended, args=(session,), daemon=True).start()
    server.close()


def pull_once(proc: subprocess.Popen, client: TcpDataClient, sink_pool: KVCache,
              layout: KvLayout, blocks: int) -> float:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    t = json.loads(proc.stdout.readline())
    ticket = pb.TransferTicket(transport="tcp", port=t["port"], token=bytes.fromhex(t["token"]),
                               num_blocks=t["n"])
    ask = PullAsk("bench", hashes(blocks), None, time.monotonic() + 60)
    sink = BlockSink(layout, ask, [sink_pool.block_planes(i) or [] for i in range(blocks)])
    t0 = time.perf_counter()
    client.receive("127.0.0.1", ticket, ask, sink, PullHandle(), iter(()))
    seconds = time.perf_counter() - t0
    assert sink.count == blocks, (sink.count, blocks)
    return seconds


def plain_socket_once(nbytes: int, port: int) -> float:
    out = subprocess.run([sys.executable, "-m", "bench.plain_socket", "fetch", "127.0.0.1",
                          str(port), str(nbytes)], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)["seconds"][0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=None, help="default 5 quick, 15 full")
    ap.add_argument("--holder", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.holder:
        holder(args.tokens, args.block_size)
        return 0
    rounds = args.rounds or (5 if args.quick else 15)
    blocks = args.tokens // args.block_size
    sink_pool, layout = pool(blocks, args.block_size)
    nbytes = blocks * layout.block_bytes
    proc = subprocess.Popen([sys.executable, "-m", "bench.kv_wire", "--holder", "--tokens",
                             str(args.tokens), "--block-size", str(args.block_size)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    sock_port = 47000 + (int(time.time()) % 1000)
    sock_server = subprocess.Popen([sys.executable, "-m", "bench.plain_socket", "serve",
                                    "127.0.0.1", str(sock_port), str(nbytes)],
                                   stdout=subprocess.PIPE, text=True)
    assert sock_server.stdout is not None
    sock_server.stdout.readline()  # listening
    client = TcpDataClient()
    times: dict[str, list[float]] = {"plain socket": [], "PageKV tcp transport": []}
    try:
        pull_once(proc, client, sink_pool, layout, blocks)  # warm-up: pages, imports
        plain_socket_once(nbytes, sock_port)
        for r in range(rounds):
            order = list(times) if r % 2 == 0 else list(reversed(times))
            for name in order:
                times[name].append(plain_socket_once(nbytes, sock_port) if name == "plain socket"
                                   else pull_once(proc, client, sink_pool, layout, blocks))
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(10)
        sock_server.kill()
    print(f"# the data path alone: {nbytes / 1e6:.1f} MB ({args.tokens} tokens of SmolLM2-135M "
          f"fp32 KV, {blocks} blocks of {args.block_size}) over loopback, {rounds} alternating "
          f"rounds — {machine_info()}")
    print()
    print("| path | GB/s p50 | ms p50 | ms p90 | vs plain socket (p50 GB/s) |")
    print("|---|---|---|---|---|")
    base = nbytes / pct(times["plain socket"], 0.5) / 1e9
    for name, secs in times.items():
        gbs = nbytes / pct(secs, 0.5) / 1e9
        print(f"| {name} | {gbs:.2f} | {pct(secs, 0.5) * 1e3:.1f} | {pct(secs, 0.9) * 1e3:.1f} | "
              f"{gbs / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
