"""vLLM event ingestion: what `pagekv ingest-vllm` costs, against the published figure to
stay below (event ingestion at 0.16% of a router CPU), and against a bare ZeroMQ subscriber
fed the same stream in the same run.

A publisher in vLLM's format (XPUB on loopback, payloads encoded before the clock starts:
int hashes, tagged-map events, as vLLM sends by default) feeds a real `pagekv ingest-vllm`
process writing into a real redis-server, its /health probe answered by a small HTTP server
here (as a vLLM pod's would be). The workload is a vLLM pod's: each batch stores a run of
blocks (a new prompt, or the continuation of one: the ingester recomputes every full hash
from tokens and parent) and, once the pool is full, removes as many of the oldest.

* idle — the process with no events (its lease, its timers, its health probe);
* throughput — every batch at once: ingester CPU per event and per block, i.e. events/s on
  one core;
* paced, at each rate of --rates (batches/s; default 100 batches/s is one store and one
  removal of 8 blocks: 1,600 block changes/s, a pod prefilling ~12,800 tokens/s at block
  size 16): the ingester's share of one core; beside it, the baselines: subscriber processes
  that only receive the same stream (SUB, drained every tick like the ingester, nothing done
  with it), one in Python (pyzmq) and one compiled (bench/native/zmq_floor.c, built here with
  gcc against pyzmq's own libzmq): the transport's own cost, which no ingester in that
  language (or in any, for the compiled one) can go under. Also Redis's own
  CPU for the writes (not the router's: Redis runs apart) and the index lag, a batch's send
  to its first block visible in Redis (polled), p50/p99.

CPU is read from /proc/<pid>/task/*/schedstat: nanoseconds on CPU of every thread (the
ZeroMQ I/O thread included), not 10 ms clock ticks.

    python -m bench.vllm_ingest [--quick] [--rates 25,50,100] [--seconds 10] [--plot PNG]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402
import zmq  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from bench.stats import pct  # noqa: E402
from pagekv.deploy.local_cluster import pagekv_cmd, spawn, stop_child  # noqa: E402
from pagekv.deploy.redis_server import RedisProcess, free_port  # noqa: E402
from pagekv.proto.hashing import DEFAULT_HASH_SEED, HashConfig, RequestBlockHasher  # noqa: E402
from pagekv.proto.index import IndexSchema  # noqa: E402
from pagekv.proto.index.schema import claim_field  # noqa: E402
from pagekv.proto.vllm_events import (  # noqa: E402
    WireBlockRemoved,
    WireBlockStored,
    encode_batch,
    seq_to_bytes,
    short_hash,
)

PUBLISHED_SHARE = 0.0016  # event ingestion at 0.16% of a router CPU
BS = 16
SCHEMA = IndexSchema("pagekv-tiny", BS, "sha256", DEFAULT_HASH_SEED)
TOPIC = b"kv-events"
POD = "vllm-bench"


class Workload:
    """A vLLM pod's batches: runs stored on new or continued chains, the oldest removed
    once `pool` blocks are held. Each batch remembers the block key of its first stored
    block (to see it land in Redis)."""

    def __init__(self, blocks_per_event: int, pool: int, seed: int = 0) -> None:
        self.k = blocks_per_event
        self.pool = pool
        self.rng = random.Random(seed)
        self.hasher = RequestBlockHasher(HashConfig(SCHEMA.hash_algo, SCHEMA.hash_seed), BS)
        self.chains: list[tuple[list[int], list[bytes]]] = []
        self.held: deque[bytes] = deque()
        self.events = self.blocks = 0

    def batch(self) -> tuple[list, tuple[str, bytes]]:
        k, rng = self.k, self.rng
        if not self.chains or rng.random() < 0.5 or len(self.chains[-1][1]) >= 64:
            self.chains.append(([], []))
            if len(self.chains) > 32:
                self.chains.pop(0)
            tokens, hashes = self.chains[-1]
        else:
            tokens, hashes = self.chains[rng.randrange(len(self.chains))]
        start = len(hashes)
        tokens += [rng.randrange(1, 32000) for _ in range(k * BS)]
        self.hasher.extend(tokens, hashes)
        new = hashes[start:]
        parent = short_hash(hashes[start - 1]) if start else None
        events: list = [WireBlockStored([short_hash(h) for h in new], parent,
                                        tokens[start * BS:], BS, None, "GPU", None)]
        self.held.extend(new)
        if len(self.held) > self.pool:
            gone = [self.held.popleft() for _ in range(k)]
            events.append(WireBlockRemoved([short_hash(h) for h in gone], "GPU"))
        self.events += len(events)
        self.blocks += sum(len(e.block_hashes) for e in events)
        return events, (SCHEMA.chain_claims_key(hashes), claim_field(new[0]))


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid` so far, in seconds (ns precision)."""
    total = 0
    for path in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def last_seq(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    for line in text.decode().splitlines():
        if line.startswith("pagekv_ingest_last_seq"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def metrics_up(metrics_port: int) -> bool:
    try:
        last_seq(metrics_port)
    except OSError:
        return False
    return True


def metric_sum(metrics_port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith(name))


class LagWatcher(threading.Thread):
    """Polls Redis (every 2 ms) for each sent batch's first block: send -> visible, in s."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.pending: deque[tuple[str, float]] = deque()
        self.lags: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() or self.pending:
            batch = list(self.pending)[:256]
            if not batch:
                time.sleep(0.002)
                continue
            pipe = self.client.pipeline(transaction=False)
            for key, _ in batch:
                pipe.hexists(key, POD)
            seen = pipe.execute()
            now = time.time()
            for (key, sent), there in zip(batch, seen, strict=True):
                if there:
                    self.lags.append(now - sent)
                    self.pending.remove((key, sent))
            time.sleep(0.002)


def _metrics_page() -> bytes:
    """A /metrics page the size of a vLLM pod's (~60 KB, mostly histogram buckets), with the
    gauges the ingester reads: its load scrape is part of what the ingester costs."""
    lines = [f'vllm:time_to_first_token_seconds_bucket{{le="{b}",model_name="m"}} {i}.0'
             for i, b in enumerate(range(1200))]
    lines += ['vllm:num_requests_running{model_name="m",engine="0"} 12.0',
              'vllm:num_requests_waiting{model_name="m",engine="0"} 3.0',
              'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.4',
              'vllm:cache_config_info{engine="0",num_gpu_blocks="20000"} 1.0']
    return ("\n".join(lines) + "\n").encode()


class _Health(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server does
    page = _metrics_page()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = self.page if self.path == "/metrics" else b""
        self.send_response(200 if self.path in ("/health", "/metrics") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def floor_subscriber(endpoint: str, tick_s: float) -> int:
    """The baseline process: receive every batch, drained once per tick, and drop it."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.setsockopt(zmq.RCVHWM, 100_000)
    sub.connect(endpoint)
    while True:
        if not sub.poll(250):
            continue
        time.sleep(tick_s)
        while True:
            try:
                sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break


def build_native_floor(out_dir: Path) -> Path | None:
    """bench/native/zmq_floor.c built against the libzmq pyzmq bundles; None (said) if it
    cannot be: no gcc, or a pyzmq without a bundled libzmq."""
    libs = sorted(Path(zmq.__file__).resolve().parent.parent.glob("pyzmq.libs/libzmq*.so*"))
    source = Path(__file__).resolve().parent / "native" / "zmq_floor.c"
    if not libs:
        print("# (no bundled libzmq found: the compiled baseline is left out)")
        return None
    exe = out_dir / "zmq_floor"
    try:
        subprocess.run(["gcc", "-O2", "-o", str(exe), str(source), str(libs[0]),
                        f"-Wl,-rpath,{libs[0].parent}"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"# (the compiled baseline could not be built: {exc}; left out)")
        return None
    return exe


def subscribed(pub, what: str) -> None:
    assert pub.poll(30_000), f"{what} did not subscribe"
    pub.recv()


def paced(pub, batches: list, first_seq: int, rate: float, seconds: float, pids: dict,
          redis_url: str) -> dict:
    """Send int(rate * seconds) batches at `rate`; CPU share of each process in `pids`,
    index lag percentiles."""
    n = int(rate * seconds)
    watcher = LagWatcher(redis_url)
    watcher.start()
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t0 = time.perf_counter()
    events = blocks = 0
    for i in range(n):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        evs, key = batches[i]
        events += len(evs)
        blocks += sum(len(e.block_hashes) for e in evs)
        now = time.time()
        pub.send_multipart((TOPIC, seq_to_bytes(first_seq + i), encode_batch(now, evs)))
        watcher.pending.append((key, now))
    # One more period, so that the last batch's work falls inside the window too.
    time.sleep(max(0.0, t0 + n / rate + 0.1 - time.perf_counter()))
    wall = time.perf_counter() - t0
    share = {name: (cpu_seconds(pid) - cpu0[name]) / wall for name, pid in pids.items()}
    watcher.stop.set()
    watcher.join(30)
    lags = watcher.lags
    return {"rate": rate, "batches": n, "events": events, "blocks": blocks, "wall": wall,
            "share": share, "lag_p50": pct(lags, 0.5) if lags else float("nan"),
            "lag_p99": pct(lags, 0.99) if lags else float("nan"),
            "lag_max": max(lags) if lags else float("nan"), "seen": len(lags)}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["blocks"] / r["wall"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(rates, [100 * r["share"]["ingester"] for r in rows], "o-",
            label="pagekv ingest-vllm")
    ax.plot(rates, [100 * r["share"]["floor"] for r in rows], "s--",
            label="bare ZeroMQ subscriber, Python (receive only)")
    if "floor_c" in rows[0]["share"]:
        ax.plot(rates, [100 * r["share"]["floor_c"] for r in rows], "^:",
                label="bare ZeroMQ subscriber, C (receive only)")
    ax.axhline(100 * PUBLISHED_SHARE, color="red", lw=1, label="published figure, 0.16%")
    ax.set_xlabel("block changes/s (vLLM batches of 8-block events)")
    ax.set_ylabel("% of one core")
    ax.set_title("vLLM KV-event ingestion: CPU against event rate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run of each phase")
    ap.add_argument("--batches", type=int, default=20_000, help="the throughput phase")
    ap.add_argument("--rates", default="10,25,50,100", help="batches/s of the paced phases")
    ap.add_argument("--seconds", type=float, default=20.0, help="each paced phase")
    ap.add_argument("--blocks-per-event", type=int, default=8)
    ap.add_argument("--pool", type=int, default=20_000, help="blocks the pod holds")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="the idle phase")
    ap.add_argument("--tick-s", type=float, default=0.05,
                    help="the ingester's --flush-interval-s (and the baseline's tick)")
    ap.add_argument("--plot", default=None, help="PNG of CPU share against rate")
    ap.add_argument("--floor-subscriber", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.floor_subscriber:
        return floor_subscriber(args.floor_subscriber, args.tick_s)
    if args.quick:
        args.batches, args.seconds, args.idle_seconds = 3000, 3.0, 2.0
        args.rates = "100"
    rates = [float(r) for r in args.rates.split(",")]
    run_dir = Path(tempfile.mkdtemp(prefix="pagekv-bench-ingest-"))
    work = Workload(args.blocks_per_event, args.pool)
    t_gen = time.perf_counter()
    batches = [work.batch() for _ in range(args.batches)]
    paced_sets = [[work.batch() for _ in range(int(r * args.seconds))] for r in rates]
    payloads = [encode_batch(0.0, events) for events, _ in batches]
    gen_s = time.perf_counter() - t_gen
    fast_events = sum(len(events) for events, _ in batches)
    fast_blocks = sum(sum(len(e.block_hashes) for e in events) for events, _ in batches)

    health = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=health.serve_forever, daemon=True).start()
    rds = RedisProcess(data_dir=run_dir / "redis").start()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the throughput phase sends all at once
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # see the second subscriber's subscription too
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    mport = free_port()
    child = spawn("ingest", pagekv_cmd(
        "ingest-vllm", "--zmq-endpoint", endpoint, "--topic", TOPIC.decode(), "--pod-id", POD,
        "--openai-address", f"127.0.0.1:{health.server_port}", "--model", SCHEMA.model,
        "--block-size", str(BS), "--redis-url", rds.url, "--metrics-port", str(mport),
        "--flush-interval-s", str(args.tick_s), "--log-level", "WARNING"), run_dir)
    floors: list[subprocess.Popen] = []
    rows: list[dict] = []
    try:
        assert pub.poll(60_000), "the ingester did not subscribe"
        pub.recv()
        deadline = time.monotonic() + 60
        while not metrics_up(mport):  # its metrics server answers: it has started
            assert time.monotonic() < deadline, "the ingester's metrics never answered"
            time.sleep(0.1)
        time.sleep(2.0)  # and has settled (its first sync, the lazy imports)
        pid = child.proc.pid
        # -- idle: what the process costs with no events (lease renewals, timers) ----------
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        time.sleep(args.idle_seconds)
        idle_share = (cpu_seconds(pid) - cpu0) / (time.perf_counter() - t0)
        # -- throughput: everything at once ------------------------------------------------
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        for seq, payload in enumerate(payloads):
            pub.send_multipart((TOPIC, seq_to_bytes(seq), payload), copy=False)
        last_key = batches[-1][1]
        client = redis.Redis.from_url(rds.url)
        while last_seq(mport) < args.batches - 1 or not client.hexists(*last_key):
            if child.proc.poll() is not None:
                raise RuntimeError(child.log_tail())
            time.sleep(0.01)
        fast_wall, fast_cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
        # -- the baseline subscribers join for the paced phases --------------------------
        floors.append(subprocess.Popen(
            [sys.executable, "-m", "bench.vllm_ingest", "--floor-subscriber", endpoint,
             "--tick-s", str(args.tick_s)], cwd=Path(__file__).resolve().parent.parent))
        subscribed(pub, "the Python baseline subscriber")
        pids = {"ingester": pid, "floor": floors[0].pid, "redis": rds.pid}
        native = build_native_floor(run_dir)
        if native is not None:
            floors.append(subprocess.Popen([str(native), endpoint, TOPIC.decode(),
                                            str(round(args.tick_s * 1000))]))
            subscribed(pub, "the compiled baseline subscriber")
            pids["floor_c"] = floors[1].pid
        time.sleep(1.0)
        seq = args.batches
        for rate, paced_batches in zip(rates, paced_sets, strict=True):
            rows.append(paced(pub, paced_batches, seq, rate, args.seconds, pids, rds.url))
            seq += len(paced_batches)
            time.sleep(0.5)
        refused = metric_sum(mport, "pagekv_ingest_refused_events_total")
        gaps = metric_sum(mport, "pagekv_ingest_gaps_total")
        pod_up = metric_sum(mport, "pagekv_ingest_pod_up")
    finally:
        for floor in floors:
            floor.kill()
            floor.wait()
        stop_child(child)
        pub.close(0)
        rds.close()
        health.shutdown()

    print(f"# vLLM event ingestion, pagekv ingest-vllm ({machine_info()})")
    print(f"# {args.blocks_per_event} blocks per event, pool {args.pool} blocks, int hashes "
          f"recomputed (sha256); tick {args.tick_s * 1e3:g} ms; workload generated in "
          f"{gen_s:.1f}s; refused {refused:.0f}, gaps {gaps:.0f}, pod up {pod_up:.0f}")
    print(f"idle: the ingester takes {idle_share:.3%} of one core (/health and a "
          f"{len(_Health.page) // 1000} KB /metrics read every 2 s, lease renewed every 2 s)")
    print(f"throughput: {args.batches} batches, {fast_events} events, {fast_blocks} blocks in "
          f"{fast_wall:.2f}s, {fast_cpu:.2f} CPU s: {fast_events / fast_cpu:,.0f} events/s and "
          f"{fast_blocks / fast_cpu:,.0f} block changes/s per core")
    print()
    print("| batches/s | events/s | block changes/s | ingester, % of a core | bare subscriber, "
          "Python (baseline) | ingester / baseline | bare subscriber, C | Redis, % of a core | "
          "index lag p50 / p99 / max ms | vs 0.16% |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ing, base = r["share"]["ingester"], r["share"]["floor"]
        native_share = r["share"].get("floor_c")
        native_cell = "-" if native_share is None else f"{native_share:.3%}"
        print(f"| {r['rate']:g} | {r['events'] / r['wall']:,.0f} | "
              f"{r['blocks'] / r['wall']:,.0f} | {ing:.3%} | {base:.3%} | "
              f"{ing / max(base, 1e-9):.2f}x | {native_cell} | {r['share']['redis']:.3%} | "
              f"{r['lag_p50'] * 1e3:.1f} / {r['lag_p99'] * 1e3:.1f} / {r['lag_max'] * 1e3:.1f} | "
              f"{'below' if ing <= PUBLISHED_SHARE else f'x{ing / PUBLISHED_SHARE:.1f}'} |")
    if args.plot and len(rows) > 1:
        plot(rows, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
