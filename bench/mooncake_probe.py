"""Mooncake's transfer engine over TCP against a plain Python socket: the same bytes, the same
run, alternating rounds (the figure issue #28 quotes: 94.4 MB = SmolLM2's 2,048-token prefix).

    python -m bench.mooncake_probe [--bytes N] [--rounds K] [--host 127.0.0.1]

Two holder processes, started here: `bench.plain_socket serve` (a preallocated buffer sent
with `sendall`) and this module's `serve` (a TransferEngine, TCP protocol, P2P handshake, no
metadata server, with one preallocated, registered buffer). The puller (this process) has a
preallocated buffer of each kind, touched before timing; each round it fetches the N bytes
once on the socket and once with `transfer_sync_read`, in alternating order. Printed: each
path's median and best GB/s, and the ratio of the medians.

With `--transports`, the data path of a whole pull instead (as bench.kv_wire, no engine,
no gRPC): a holder process serves a pool of SmolLM2-135M's KV blocks (94.4 MB for 2,048
tokens) on PageKV's tcp transport and on Mooncake's (kvnode/pod/kv_data_mooncake.py: packed
into a registered slab, `ready_blocks` relayed on its stdout as the control stream would);
this process receives each pull into a pool through a BlockSink (every header and checksum
checked), timed from the ask to the last block landed; the plain socket in the same rounds.

With `--pods`, whole pulls between real pod processes on the real model (SmolLM2-135M, one
torch thread each): holder A serves `--kv-transports mooncake,tcp`, pullers B (tcp) and C
(mooncake) each pull a fresh 2,048-token prefix A computed, and a plain socket moves as many
bytes, the three in rotating order; a pull's GB/s is its puller's pagekv_kv_pulled_bytes_total
over its pagekv_kv_pull_seconds (admission to landed), every pull checked whole
(cached_tokens_peer, no fallback) and its greedy tokens A's.

    python -m bench.mooncake_probe serve HOST NBYTES            # the Mooncake holder (internal)
    python -m bench.mooncake_probe holder TOKENS BLOCK_SIZE     # the transports' (internal)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from bench.plain_socket import ASK, recv_exact, tuned

DEFAULT_BYTES = 94_400_000


def _engine(host: str):
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO lines are per connection
    from mooncake.engine import TransferEngine  # type: ignore[import-untyped,import-not-found,unused-ignore]

    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    return engine


def serve(host: str, nbytes: int) -> None:
    engine = _engine(host)
    buf = np.full(nbytes, 0x5A, np.uint8)  # touched once, reused by every read
    if engine.register_memory(buf.ctypes.data, nbytes) != 0:
        raise RuntimeError("register_memory failed")
    print(f"{host}:{engine.get_rpc_port()} {buf.ctypes.data}", flush=True)
    sys.stdin.read()  # until the puller closes our stdin


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run(host: str, nbytes: int, rounds: int) -> dict[str, list[float]]:
    port = _free_port(host)
    plain = subprocess.Popen([sys.executable, "-m", "bench.plain_socket", "serve", host,
                              str(port), str(nbytes)], stdout=subprocess.PIPE, text=True)
    moon = subprocess.Popen([sys.executable, "-m", "bench.mooncake_probe", "serve", host,
                             str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert plain.stdout is not None and moon.stdout is not None
        plain.stdout.readline()
        session, address = moon.stdout.readline().split()
        engine = _engine(host)
        dst = np.zeros(nbytes, np.uint8)
        if engine.register_memory(dst.ctypes.data, nbytes) != 0:
            raise RuntimeError("register_memory failed")
        view = memoryview(bytearray(nbytes))
        view[:] = b"\x00" * nbytes
        sock = tuned(socket.create_connection((host, port), timeout=60))
        # A first read of each: the handshakes and connections, not timed.
        engine.transfer_sync_read(session, dst.ctypes.data, int(address), 4096)
        sock.sendall(ASK.pack(4096))
        recv_exact(sock, view[:4096])
        secs: dict[str, list[float]] = {"plain socket": [], "mooncake tcp": []}
        with sock:
            for r in range(rounds):
                order = ("plain socket", "mooncake tcp")
                for name in order if r % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    if name == "plain socket":
                        sock.sendall(ASK.pack(nbytes))
                        recv_exact(sock, view)
                    elif engine.transfer_sync_read(session, dst.ctypes.data, int(address),
                                                   nbytes) != 0:
                        raise RuntimeError("transfer_sync_read failed")
                    secs[name].append(time.perf_counter() - t0)
        if dst[-1] != 0x5A or view[-1] != 0x5A:
            raise RuntimeError("the bytes read are not the holder's")
        return secs
    finally:
        if moon.stdin is not None:
            moon.stdin.close()
        for p in (plain, moon):
            p.kill()
            p.wait()


def holder(tokens: int, block_size: int) -> None:
    """Serves a session per stdin line ("tcp" or "mooncake"): its ticket as a JSON line, then
    "ready N" lines as the transport makes blocks ready, then "end"."""
    from bench.kv_wire import PoolExporter, hashes, pool
    from pagekv.kvnode.engine.kv_export import ExportRun
    from pagekv.kvnode.pod.kv_data_mooncake import MooncakeDataServer
    from pagekv.kvnode.pod.kv_data_session import ExportSession
    from pagekv.kvnode.pod.kv_data_tcp import TcpDataServer
    from pagekv.proto.medium import Medium

    blocks = tokens // block_size
    cache, layout = pool(blocks, block_size)
    exporter = PoolExporter(cache, layout)
    servers: dict[str, TcpDataServer | MooncakeDataServer] = {
        "tcp": TcpDataServer("127.0.0.1"), "mooncake": MooncakeDataServer("127.0.0.1")}
    chain = hashes(blocks)
    for line in sys.stdin:
        server = servers.get(line.strip())
        if server is None:
            break
        session = ExportSession(exporter, ExportRun(chain, [Medium.GPU] * blocks),  # type: ignore[arg-type]
                                budget=1 << 40, deadline=time.monotonic() + 60,
                                compress=False, chunk_bytes=4 << 20, close_run=lambda: None)
        ticket = server.offer(session)
        print(json.dumps({"transport": ticket.transport, "token": ticket.token.hex(),
                          "num_blocks": ticket.num_blocks, "port": ticket.port,
                          "session": ticket.session, "buffer": ticket.buffer,
                          "entry_lengths": list(ticket.entry_lengths)}), flush=True)
        seen, finished = 0, False
        # The control call's part (kv_transfer._progress): until tcp has sent its end mark,
        # until Mooncake's slots are all ready; then over when the puller says it is done
        # (a pod's puller cancels the call).
        while not finished and (ticket.transport == "tcp" or seen < ticket.num_blocks):
            seen, finished = session.wait_progress(seen, 60)
            print(f"ready {seen}", flush=True)
        print("end", flush=True)
        sys.stdin.readline()  # "done"
        session.end()
    for server in servers.values():
        server.close()


def transports(tokens: int, block_size: int, rounds: int) -> int:
    from bench.kv_wire import hashes, pool
    from pagekv.kvnode.engine.peer_pull import BlockSink, PullAsk, PullHandle
    from pagekv.kvnode.pod.kv_data_mooncake import MooncakeDataClient
    from pagekv.kvnode.pod.kv_data_tcp import TcpDataClient
    from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb

    blocks = tokens // block_size
    sink_pool, layout = pool(blocks, block_size)
    nbytes = blocks * layout.block_bytes
    proc = subprocess.Popen([sys.executable, "-m", "bench.mooncake_probe", "holder",
                             str(tokens), str(block_size)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    port = _free_port("127.0.0.1")
    plain = subprocess.Popen([sys.executable, "-m", "bench.plain_socket", "serve", "127.0.0.1",
                              str(port), str(nbytes)], stdout=subprocess.PIPE, text=True)
    assert plain.stdout is not None
    plain.stdout.readline()
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None
    clients: dict[str, TcpDataClient | MooncakeDataClient] = {
        "tcp": TcpDataClient(), "mooncake": MooncakeDataClient()}

    def control():
        for line in stdout:
            if line.startswith("end"):
                return
            yield pb.PullBlocksChunk(ready_blocks=int(line.split()[1]))

    def pull(name: str) -> float:
        t0 = time.perf_counter()
        stdin.write(name + "\n")
        stdin.flush()
        t = json.loads(stdout.readline())
        ticket = pb.TransferTicket(
            transport=t["transport"], token=bytes.fromhex(t["token"]),
            num_blocks=t["num_blocks"], port=t["port"], session=t["session"],
            buffer=t["buffer"], entry_lengths=t["entry_lengths"])
        ask = PullAsk("bench", hashes(blocks), None, time.monotonic() + 60)
        sink = BlockSink(layout, ask, [sink_pool.block_planes(i) or [] for i in range(blocks)])
        ctl = control()
        clients[name].receive("127.0.0.1", ticket, ask, sink, PullHandle(), ctl)
        seconds = time.perf_counter() - t0
        for _ in ctl:  # up to the holder's "end" (the tcp transport reads no control)
            pass
        stdin.write("done\n")
        stdin.flush()
        assert sink.count == blocks, (name, sink.count, blocks)
        return seconds

    view = memoryview(bytearray(nbytes))
    view[:] = b"\x00" * nbytes

    def plain_once(sock: socket.socket) -> float:
        t0 = time.perf_counter()
        sock.sendall(ASK.pack(nbytes))
        recv_exact(sock, view)
        return time.perf_counter() - t0

    secs: dict[str, list[float]] = {"plain socket": [], "PageKV tcp transport": [],
                                    "Mooncake transport (tcp)": []}
    try:
        with tuned(socket.create_connection(("127.0.0.1", port), timeout=60)) as sock:
            pull("tcp"), pull("mooncake"), plain_once(sock)  # warm-up: pages, connections
            for r in range(rounds):
                names = list(secs) if r % 2 == 0 else list(reversed(secs))
                for name in names:
                    secs[name].append(plain_once(sock) if name == "plain socket" else
                                      pull("tcp" if "tcp transport" in name else "mooncake"))
    finally:
        stdin.close()
        proc.wait(10)
        plain.kill()
        plain.wait()
    print(f"the data path of a pull: {nbytes / 1e6:.1f} MB ({tokens} tokens of SmolLM2-135M "
          f"fp32 KV, {blocks} blocks of {block_size}) on loopback, {rounds} alternating rounds")
    print("| path | median GB/s | best GB/s | vs plain socket (medians) |")
    print("|---|---|---|---|")
    base = nbytes / statistics.median(secs["plain socket"])
    for name, values in secs.items():
        med = nbytes / statistics.median(values)
        print(f"| {name} | {med / 1e9:.2f} | {nbytes / min(values) / 1e9:.2f} | "
              f"{med / base:.2f}x |")
    return 0


def pods(prefix: int, rounds: int) -> int:
    import random
    import tempfile
    from pathlib import Path

    import grpc

    from bench.kv_pull import BLOCK, MODEL, random_tokens, reset
    from bench.pod_metrics import scrape_url
    from pagekv.deploy.local_cluster import LocalCluster, wait_healthy
    from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
    from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

    def generate(address: str, tokens: list[int], source: pb.KvSource | None = None):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=tokens), sampling=pb.SamplingParams(
            max_tokens=2, temperature=0.0, ignore_eos=True))
        if source is not None:
            req.kv_source.CopyFrom(source)
        with grpc.insecure_channel(address) as ch:
            return pb_grpc.GenerationStub(ch).Generate(req, timeout=300)

    node = ["--num-threads", "1", "--num-gpu-blocks", str(2 * prefix // BLOCK + 64),
            "--max-model-len", str(prefix + 64), "--kv-pull-deadline-s", "30"]
    cluster = LocalCluster(nodes=0, model=MODEL, node_args=node, start_router=False,
                           run_dir=Path(tempfile.mkdtemp(prefix="pagekv-mooncake-")))
    cluster.start()
    rng = random.Random(28)
    got: dict[str, list[float]] = {"tcp": [], "mooncake": [], "plain socket": []}
    sizes: list[float] = []
    plain: subprocess.Popen | None = None
    sock: socket.socket | None = None
    try:
        a = cluster.start_pod("node-a", ["--kv-transports", "mooncake,tcp"])
        pullers = {t: cluster.start_pod(f"node-{t}", ["--kv-transports", t])
                   for t in ("tcp", "mooncake")}
        for child in (a, *pullers.values()):
            wait_healthy(child.target(), 300, child.proc)
        full = (prefix - 1) // BLOCK

        def pull(name: str, tokens: list[int], want: list[int]) -> float:
            b = pullers[name]
            reset(b.target())
            url = f"http://127.0.0.1:{b.metrics_port}/metrics"
            before = scrape_url(url)
            resp = generate(b.target(), tokens, pb.KvSource(
                pod_id="node-a", address=a.target(), num_blocks=full))
            after = scrape_url(url)
            assert list(resp.completions[0].token_ids) == want, name
            assert resp.usage.cached_tokens_peer == full * BLOCK, (name, resp.usage)
            grew = {k: after[k] - before.get(k, 0.0) for k in after}
            assert not any(v for k, v in grew.items() if "fallbacks" in k), (name, grew)
            sizes.append(grew["pagekv_kv_pulled_bytes_total"])
            return grew["pagekv_kv_pull_seconds_sum"]

        for r in range(rounds + 1):  # the first round warms up (connections, pages)
            tokens = random_tokens(rng, prefix)
            want = list(generate(a.target(), tokens).completions[0].token_ids)
            if r == 0:
                for name in pullers:
                    pull(name, tokens, want)
                nbytes = int(sizes[0])
                port = _free_port("127.0.0.1")
                plain = subprocess.Popen([sys.executable, "-m", "bench.plain_socket", "serve",
                                          "127.0.0.1", str(port), str(nbytes)],
                                         stdout=subprocess.PIPE, text=True)
                assert plain.stdout is not None
                plain.stdout.readline()
                sock = tuned(socket.create_connection(("127.0.0.1", port), timeout=60))
                view = memoryview(bytearray(nbytes))
                view[:] = b"\x00" * nbytes
                continue
            names = list(got)[r % 3:] + list(got)[: r % 3]  # each path first in turn
            for name in names:
                if name == "plain socket":
                    assert sock is not None
                    t0 = time.perf_counter()
                    sock.sendall(ASK.pack(nbytes))
                    recv_exact(sock, view)
                    got[name].append(time.perf_counter() - t0)
                else:
                    got[name].append(pull(name, tokens, want))
    finally:
        if sock is not None:
            sock.close()
        if plain is not None:
            plain.kill()
            plain.wait()
        cluster.stop()
    print(f"whole pulls of a {prefix}-token prefix ({nbytes / 1e6:.1f} MB, {MODEL}) between "
          f"pods on loopback, admission to landed; {rounds} rounds, the paths' order rotating")
    print("| path | median GB/s | best GB/s | median ms | vs plain socket (medians) |")
    print("|---|---|---|---|---|")
    base = nbytes / statistics.median(got["plain socket"])
    rows = {"plain socket": got["plain socket"], "pull, PageKV tcp transport": got["tcp"],
            "pull, Mooncake transport (tcp)": got["mooncake"]}
    for name, values in rows.items():
        med = nbytes / statistics.median(values)
        print(f"| {name} | {med / 1e9:.2f} | {nbytes / min(values) / 1e9:.2f} | "
              f"{statistics.median(values) * 1e3:.0f} | {med / base:.2f}x |")
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["serve"]:
        serve(argv[1], int(argv[2]))
        return 0
    if argv[:1] == ["holder"]:
        holder(int(argv[1]), int(argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=DEFAULT_BYTES)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--transports", action="store_true", help="the transports' data path")
    ap.add_argument("--tokens", type=int, default=2048, help="--transports: the run's tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pods", action="store_true", help="whole pulls between real pods")
    ap.add_argument("--prefix", type=int, default=2048, help="--pods: the prefix's tokens")
    args = ap.parse_args(argv)
    if args.pods:
        return pods(args.prefix, args.rounds)
    if args.transports:
        return transports(args.tokens, args.block_size, args.rounds)
    secs = run(args.host, args.bytes, args.rounds)
    gbps = {name: [args.bytes / s / 1e9 for s in values] for name, values in secs.items()}
    print(f"{args.bytes / 1e6:.1f} MB on {args.host}, {args.rounds} alternating rounds")
    print("| path | median GB/s | best GB/s |")
    print("|---|---|---|")
    for name, values in gbps.items():
        print(f"| {name} | {statistics.median(values):.2f} | {max(values):.2f} |")
    ratio = statistics.median(gbps["mooncake tcp"]) / statistics.median(gbps["plain socket"])
    print(f"mooncake / plain socket (medians): {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
