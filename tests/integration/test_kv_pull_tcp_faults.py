"""Cross-pod KV pull on the tcp data transport (issue #28) under faults and hostile inputs,
with real pod processes.

Pod A computes each prompt cold and holds it (its tcp data port fixed, so a test can dial
it). A hostile holder is tests/integration/fake_tcp_peer.py: it relays A's blocks and
answers the puller with a ticket to its own data port, where it corrupts, reorders, pads,
truncates, stalls or lies. The puller (B, or D with a short deadline) must answer exactly
A's cold greedy tokens whatever happens, keep the blocks that arrived intact before the
fault, count the fallback by its reason, leak no pool block, and never wait past its
deadline. A hostile puller (this test itself) dials A's data port with no hello, bad
hellos, unknown and spent tokens, a flood of idle connections, and a reader that stops
mid-run: A sends it no byte of KV and releases the pins of every run it opened."""

from __future__ import annotations

import functools
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import Child, LocalCluster, wait_healthy
from pagekv.deploy.redis_server import free_port
from pagekv.kvnode.pod import kv_data_tcp
from pagekv.kvnode.pod.kv_data_tcp import HELLO_TIMEOUT_S, MAX_PENDING_HELLOS
from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.tiers.ssd_format import ENTRY_FIXED_LEN, entry_header_len, parse_entry_header

pytestmark = pytest.mark.integration

POD_ARGS = ["--num-gpu-blocks", "160", "--max-model-len", "1024", "--num-threads", "1"]
BLOCK = 16
N_TOKENS = 300
FULL = (N_TOKENS - 1) // BLOCK  # blocks a peer can give (never the prompt's last token)
B_DEADLINE_S = 20.0  # B: long, so a fault that is not told apart from a stall shows
D_DEADLINE_S = 4.0
QUICK_S = 6.0        # a fault B must notice at once: well under its deadline
FAKE = Path(__file__).with_name("fake_tcp_peer.py")
HELLO = struct.Struct("<4sH")


def prompt(n: int, length: int = N_TOKENS) -> list[int]:
    """A prompt of its own per case: no pod holds any block of it beforehand."""
    return [(i * 13 + n * 37) % 250 for i in range(length)]


@dataclass(frozen=True)
class Bed:
    a: Child        # the holder, its tcp data port known
    b: Child        # a puller, 20 s deadline
    d: Child        # a puller, 4 s deadline
    data_port: int  # a's


@pytest.fixture(scope="module")
def pods(tmp_path_factory) -> Iterator[Bed]:
    cluster = LocalCluster(nodes=0, start_router=False, node_args=POD_ARGS,
                           run_dir=tmp_path_factory.mktemp("kv-pull-tcp-faults"))
    cluster.start()
    data_port = free_port()
    try:
        bed = Bed(cluster.start_pod("node-a", ["--kv-data-port", str(data_port)]),
                  cluster.start_pod("node-b", ["--kv-pull-deadline-s", str(B_DEADLINE_S)]),
                  cluster.start_pod("node-d", ["--kv-pull-deadline-s", str(D_DEADLINE_S)]),
                  data_port)
        for child in (bed.a, bed.b, bed.d):
            wait_healthy(child.target(), 120, child.proc)
        yield bed
    finally:
        cluster.stop()


# -- the pods' answers and metrics -----------------------------------------------------------
def generate_future(target: Child, tokens: list[int], source: str | None = None,
                    timeout: float = 40.0):
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=tokens),
        sampling=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    if source is not None:
        req.kv_source.CopyFrom(pb.KvSource(pod_id="peer", address=source,
                                           num_blocks=(len(tokens) - 1) // BLOCK))
    channel = grpc.insecure_channel(target.target())
    future = pb_grpc.GenerationStub(channel).Generate.future(req, timeout=timeout)
    future.add_done_callback(lambda _: channel.close())
    return future


def generate(target: Child, tokens: list[int], source: str | None = None
             ) -> pb.GenerateResponse:
    return generate_future(target, tokens, source).result()


def cold(pods, tokens: list[int]) -> list[int]:
    """A's greedy answer computed cold (A then holds the prompt)."""
    ref = generate(pods.a, tokens)
    assert ref.usage.cached_tokens == 0
    return list(ref.completions[0].token_ids)


def samples(target: Child) -> list[tuple[str, dict[str, str], float]]:
    url = f"http://127.0.0.1:{target.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def value(m, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in m if n == name and all(lab.get(k) == w
                                                        for k, w in labels.items()))


def fallbacks(target: Child) -> dict[str, float]:
    return {lab["reason"]: v for n, lab, v in samples(target)
            if n == "pagekv_kv_pull_fallbacks_total"}


def by_transport(target: Child) -> dict[tuple[str, str], float]:
    return {(lab["transport"], lab["outcome"]): v for n, lab, v in samples(target)
            if n == "pagekv_kv_pulls_by_transport_total"}


def grew(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"not within {timeout:g}s: {what}"
        time.sleep(0.05)


def idle(target: Child) -> bool:
    m = samples(target)
    return (value(m, "pagekv_kv_cache_free_blocks") == value(m, "pagekv_kv_cache_blocks")
            and value(m, "pagekv_kv_transfers_active") == 0)


def no_leaks(*targets: Child, timeout: float = 10.0) -> None:
    for target in targets:
        def settled(target: Child = target) -> bool:
            return idle(target)

        wait_for(settled, f"{target.name}: every block free, no transfer active", timeout)


def peak_rss(target: Child) -> int:
    """The pod process's peak resident memory (VmHWM), bytes."""
    for line in Path(f"/proc/{target.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


# -- the hostile holder ----------------------------------------------------------------------
class FakeTcpPeer:
    def __init__(self, upstream: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(FAKE), "--upstream", upstream], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.PIPE, text=True,
            start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.address = f"127.0.0.1:{self.expect('READY ', 30).split()[1]}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def mode(self, mode: str, arg: str = "0") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{mode} {arg}\n")
        self.proc.stdin.flush()
        self.expect(f"MODE {mode} {arg}")

    def expect(self, prefix: str, timeout: float = 20.0) -> str:
        end = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the fake peer never printed {prefix!r}; it printed "
                                     f"{self.seen[-10:]}") from None
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@contextmanager
def fake_peer(upstream: Child) -> Iterator[FakeTcpPeer]:
    peer = FakeTcpPeer(upstream.target())
    try:
        yield peer
    finally:
        peer.kill()


@pytest.fixture(scope="module")
def fake(pods) -> Iterator[FakeTcpPeer]:
    with fake_peer(pods.a) as peer:
        yield peer


# (mode, its argument, blocks the puller keeps, the fallback reason; None: a whole pull)
HOSTILE_HOLDERS = [
    ("relay", "0", FULL, None),
    ("corrupt", "7", 7, "checksum"),
    ("skip", "5", 5, "hash_mismatch"),
    ("extra", "0", FULL, "hash_mismatch"),
    ("garbage", "4", 4, "peer_unavailable"),
    ("huge-payload", "3", 3, "peer_unavailable"),
    ("huge-header", "3", 3, "peer_unavailable"),
    ("close", "6", 6, "peer_unavailable"),
    ("count", "3", FULL, "peer_missing"),
    ("short", "6", 6, "peer_missing"),
    ("transport", "mooncake", 0, "config_mismatch"),  # B offers tcp alone
    ("port", "closed", 0, "peer_unavailable"),
    ("port", str(2**32 - 1), 0, "peer_unavailable"),  # no such port (getaddrinfo says)
]
# The same in chunk frames, the way a holder sends raw entries (where the transport has them).
CHUNKED = [
    ("chunk-relay", "0", FULL, None),
    ("chunk-corrupt", "7", 7, "checksum"),
    ("chunk-skip", "5", 5, "hash_mismatch"),
    ("chunk-over", "0", 0, "peer_unavailable"),
    ("chunk-zero", "0", 0, "peer_unavailable"),
    ("chunk-cut", "6", 6, "peer_unavailable"),
]
HAS_CHUNKS = pytest.mark.skipif(not hasattr(kv_data_tcp, "CHUNK_MAGIC"),
                                reason="this tcp transport has no chunk frames")
DATA_MODES = {"relay", "corrupt", "skip", "extra", "garbage", "huge-payload", "huge-header",
              "close", "count", "short", *(mode for mode, *_ in CHUNKED)}
CASE_IDS = [f"{mode}-{arg}" for mode, arg, _, _ in HOSTILE_HOLDERS + CHUNKED]


@pytest.mark.parametrize(("mode", "arg", "kept", "reason"), [
    *HOSTILE_HOLDERS, *(pytest.param(*case, marks=HAS_CHUNKS) for case in CHUNKED)],
    ids=CASE_IDS)
def test_hostile_holder_on_tcp(pods, fake, mode, arg, kept, reason):
    a, b = pods.a, pods.b
    tokens = prompt(100 + CASE_IDS.index(f"{mode}-{arg}"))
    want = cold(pods, tokens)
    fake.mode(mode, str(free_port()) if arg == "closed" else arg)  # closed: nothing listens
    before, transports, rss = fallbacks(b), by_transport(b), peak_rss(b)
    t0 = time.monotonic()
    resp = generate(b, tokens, fake.address)
    elapsed = time.monotonic() - t0
    assert fake.expect("TICKET ") == f"TICKET {mode} offered=tcp"
    if mode in DATA_MODES:
        assert fake.expect("DONE ") == f"DONE {mode}"  # B dialed the ticket, then let go
    assert list(resp.completions[0].token_ids) == want
    assert resp.usage.cached_tokens_peer == kept * BLOCK
    assert grew(before, fallbacks(b)) == ({reason: 1} if reason else {}), b.log_tail(10)
    outcome = "ok" if reason is None else "fallback"
    assert grew(transports, by_transport(b)) == {
        ("tcp" if mode != "transport" else "none", outcome): 1}
    assert elapsed < QUICK_S, f"{elapsed:.1f}s: B waited for something that never comes"
    # A payload announced 512 MiB long is refused from its header, never allocated.
    assert peak_rss(b) - rss < 128 << 20
    no_leaks(b, a)


def test_stalled_holder_ends_at_the_deadline(pods, fake):
    a, d = pods.a, pods.d
    tokens, sent = prompt(50), 4
    want = cold(pods, tokens)
    fake.mode("stall", str(sent))
    before = fallbacks(d)
    t0 = time.monotonic()
    resp = generate(d, tokens, fake.address)
    elapsed = time.monotonic() - t0
    assert fake.expect("SENT ") == f"SENT {sent}"
    assert list(resp.completions[0].token_ids) == want
    assert resp.usage.cached_tokens_peer == sent * BLOCK
    assert grew(before, fallbacks(d)) == {"deadline": 1}, d.log_tail(10)
    assert D_DEADLINE_S <= elapsed < D_DEADLINE_S + 4.0  # the deadline, then a recompute
    assert fake.expect("DONE ") == "DONE stall"  # D closed the stalled connection
    no_leaks(d, a)


def test_holder_killed_mid_transfer(pods):
    a, b = pods.a, pods.b
    tokens, sent = prompt(51), 5
    want = cold(pods, tokens)
    before = fallbacks(b)
    with fake_peer(a) as victim:
        victim.mode("stall", str(sent))
        future = generate_future(b, tokens, victim.address)
        assert victim.expect("SENT ") == f"SENT {sent}"
        assert not future.done()  # B waits on the stalled holder
        t0 = time.monotonic()
        victim.kill()
        resp = future.result()
        assert time.monotonic() - t0 < QUICK_S  # noticed the dead connection, not the deadline
    assert list(resp.completions[0].token_ids) == want
    assert resp.usage.cached_tokens_peer == sent * BLOCK
    assert grew(before, fallbacks(b)) == {"peer_unavailable": 1}, b.log_tail(10)
    no_leaks(b, a)


def cancel_mid_pull(pods, puller: str, fake: FakeTcpPeer, n: int, mode: str) -> float:
    """The puller's request, its pull waiting on the fake, cancelled by its client; when."""
    target = getattr(pods, puller)
    tokens = prompt(n)
    cold(pods, tokens)
    fake.mode(mode, "3")
    future = generate_future(target, tokens, fake.address)
    fake.expect("SENT " if mode == "stall" else "TICKET ")
    time.sleep(0.2)  # (jammed: the puller is in its connect by now)
    assert not idle(target)  # the pull's blocks are reserved
    future.cancel()
    return time.monotonic()


def kick(target: Child) -> bool:
    """A request through the puller (its engine loop steps), then whether it is idle."""
    generate(target, prompt(99, 40))
    return idle(target)


def test_puller_cancelled_mid_transfer_stops_its_worker(pods, fake):
    """The client gives up on B's request while B's pull waits on a stalled holder: B's
    worker stops at once (its data connection closed), long before B's 20 s deadline, and
    the blocks it reserved are back in the pool by B's next request."""
    a, b = pods.a, pods.b
    t0 = cancel_mid_pull(pods, "b", fake, 52, "stall")
    assert fake.expect("DONE ", timeout=QUICK_S) == "DONE stall"  # B closed the connection
    assert time.monotonic() - t0 < QUICK_S
    wait_for(lambda: kick(b), "B idle after its next request", QUICK_S)
    no_leaks(b, a)


def test_cancelled_pull_gives_its_blocks_back_while_idle(pods, fake):
    """D's request cancelled while its worker hangs in connect (a holder across a
    partition): the worker gives up at D's 4 s deadline, and then, with no other request
    on D, its reserved blocks must go back to the pool."""
    d = pods.d
    cancel_mid_pull(pods, "d", fake, 54, "jammed")
    try:
        no_leaks(d, timeout=D_DEADLINE_S + QUICK_S)
    finally:  # whatever happened, the later tests find D idle
        wait_for(lambda: kick(d), "D idle after its next request", D_DEADLINE_S + QUICK_S)


def test_cancel_interrupts_a_hanging_connect(pods, fake):
    d = pods.d
    t0 = cancel_mid_pull(pods, "d", fake, 56, "jammed")
    try:
        wait_for(lambda: kick(d), "D's cancelled pull let go", 2.0)
        assert time.monotonic() - t0 < D_DEADLINE_S - 1.0
    finally:
        wait_for(lambda: kick(d), "D idle after its next request", D_DEADLINE_S + QUICK_S)


# -- the hostile puller, on the real holder's data port ------------------------------------
@functools.cache
def layout_json() -> str:
    """The KV layout the pods have (pagekv-tiny), as a puller sends it."""
    from pagekv.kvnode.engine.engine import Engine

    return Engine(model="pagekv-tiny", num_gpu_blocks=32, max_model_len=320).kv_layout.json


class Ticket:
    """A PullBlocks call on the holder that offered tcp: its ticket, the call kept open."""

    def __init__(self, holder: Child, tokens: list[int], timeout: float = 20.0) -> None:
        self.channel = grpc.insecure_channel(holder.target())
        kv = pb_grpc.KVNodeStub(self.channel)
        config = kv.Stats(pb.StatsRequest(), timeout=10).hash_config
        n = (len(tokens) - 1) // BLOCK
        self.hashes = hash_prompt(HashConfig(), BLOCK, tokens)[:n]
        self.call = kv.PullBlocks(pb.PullBlocksRequest(
            block_hashes=self.hashes, hash_config=config, kv_layout=layout_json(),
            chain_token_ids=tokens[: n * BLOCK], transports=["tcp"]), timeout=timeout)
        first = next(self.call)
        assert first.HasField("ticket") and first.ticket.transport == "tcp"
        assert first.ticket.num_blocks == n
        self.ticket = first.ticket

    def rest(self) -> list[pb.PullBlocksChunk]:
        return list(self.call)

    def cancel(self) -> None:
        self.call.cancel()
        self.channel.close()


def dial(port: int, slow: bool = False) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if slow:  # before connecting: a small window and small segments, so that the holder's
        # send buffer (autotuned from its segment size) holds a few blocks, not the run
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


def hello(token: bytes, magic: bytes = b"PKVT", version: int = 1) -> bytes:
    return HELLO.pack(magic, version) + token


def everything(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """All the holder sends until it closes the connection (fails if it does not)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(1 << 16):
            out += chunk
    except ConnectionResetError:  # closed with our hello unread: a reset, as good as an end
        pass
    return out


def entries_in(stream: bytes, hashes: list[bytes]) -> int:
    """The entries of `stream` (alone or in chunk frames), each the next block of the chain,
    then the end frame: its count (the hostile puller's positive control: it reads what a
    real one would)."""
    pos, parent, i, in_chunk = 0, None, 0, 0
    while True:
        magic = stream[pos : pos + 4]
        if magic == b"PKVC" and not in_chunk:
            (in_chunk,) = struct.unpack_from("<I", stream, pos + 4)
            pos += 8
            continue
        if magic != b"PKVB":
            break
        header_len = entry_header_len(stream[pos : pos + ENTRY_FIXED_LEN])
        hdr = parse_entry_header(stream[pos : pos + header_len])
        assert hdr.block_hash == hashes[i] and hdr.parent_hash == parent
        pos += hdr.entry_len
        parent, i, in_chunk = hashes[i], i + 1, max(in_chunk - 1, 0)
    magic, count = struct.unpack_from("<4sI", stream, pos)
    assert magic == b"PKVE" and count == i and pos + 8 == len(stream) and not in_chunk
    return count


def test_data_port_sends_nothing_to_a_bad_hello(pods):
    a, b = pods.a, pods.b
    port = pods.data_port
    tokens = prompt(60)
    cold(pods, tokens)
    silent = dial(port)  # says nothing at all: closed after HELLO_TIMEOUT_S
    t_silent = time.monotonic()
    live = Ticket(a, tokens)
    token = live.ticket.token
    refusals = [hello(token, magic=b"XXXX"), hello(token, version=2), hello(os.urandom(32)),
                hello(token)[:20], b"GET / HTTP/1.1\r\n\r\n" + bytes(64)]
    for bad in refusals:
        with closing(dial(port)) as sock:
            sock.sendall(bad)
            if bad == hello(token)[:20]:
                sock.shutdown(socket.SHUT_WR)  # a hello cut short
            assert everything(sock) == b"", bad
    # The pull's own token, after all that, still gets its run, once.
    with closing(dial(port)) as sock:
        sock.sendall(hello(token))
        assert entries_in(everything(sock), live.hashes) == len(live.hashes)
    assert [c.ready_blocks for c in live.rest()][-1] == len(live.hashes)
    live.cancel()
    with closing(dial(port)) as sock:  # spent
        sock.sendall(hello(token))
        assert everything(sock) == b""
    # A pull whose control has ended (cancelled before the puller dialed): its token is dead.
    gone = Ticket(a, tokens)
    gone.cancel()
    no_leaks(a)
    with closing(dial(port)) as sock:
        sock.sendall(hello(gone.ticket.token))
        assert everything(sock) == b""
    # Meanwhile the silent connection did not hold up a real pod's pull.
    assert silent.fileno() != -1
    tokens2 = prompt(61)
    want = cold(pods, tokens2)
    resp = generate(b, tokens2, a.target())
    assert list(resp.completions[0].token_ids) == want
    assert resp.usage.cached_tokens_peer == FULL * BLOCK
    with closing(silent):
        assert everything(silent, HELLO_TIMEOUT_S + 5) == b""
        assert time.monotonic() - t_silent > HELLO_TIMEOUT_S - 1  # A closed it, not this test
    no_leaks(a, b)


def test_idle_connection_flood_does_not_stop_a_pull(pods):
    a, b = pods.a, pods.b
    port = pods.data_port
    tokens = prompt(62)
    want = cold(pods, tokens)
    before = by_transport(b)
    flood = [dial(port) for _ in range(MAX_PENDING_HELLOS + 4)]
    try:
        resp = generate(b, tokens, a.target())
        assert list(resp.completions[0].token_ids) == want
        assert grew(before, by_transport(b)) == {("tcp", "ok"): 1}, b.log_tail(5)
        assert resp.usage.cached_tokens_peer == FULL * BLOCK
    finally:
        for sock in flood:
            sock.close()
    no_leaks(a, b)


def test_pull_after_an_idle_flood_is_whole(pods):
    """Once the idle connections are gone, the data port serves pulls again."""
    a, b = pods.a, pods.b
    port = pods.data_port
    flood = [dial(port) for _ in range(MAX_PENDING_HELLOS + 4)]
    for sock in flood:
        sock.close()
    tokens = prompt(63)
    want = cold(pods, tokens)
    before = by_transport(b)
    time.sleep(0.5)  # the holder sees the closes on its own threads
    resp = generate(b, tokens, a.target())
    assert list(resp.completions[0].token_ids) == want
    assert grew(before, by_transport(b)) == {("tcp", "ok"): 1}, b.log_tail(5)
    no_leaks(a, b)


def stalled_reader(a: Child, port: int, tokens: list[int], timeout: float = 20.0
                   ) -> tuple[Ticket, socket.socket]:
    """A puller that takes its ticket, says hello, reads a few bytes and then stops
    reading, with a receive window too small for the run: A's sender blocks mid-run."""
    t = Ticket(a, tokens, timeout)
    sock = dial(port, slow=True)
    sock.sendall(hello(t.ticket.token))
    assert sock.recv(64)[:4] in (b"PKVB", b"PKVC")  # an entry, or a chunk of them
    time.sleep(1.0)
    m = samples(a)
    # Still sending (a finished sender would have ended the call), its blocks pinned.
    assert value(m, "pagekv_kv_transfers_active") == 1
    assert value(m, "pagekv_kv_cache_free_blocks") < value(m, "pagekv_kv_cache_blocks")
    return t, sock


def test_holder_lets_go_when_the_puller_cancels_mid_send(pods):
    a = pods.a
    port = pods.data_port
    tokens = prompt(64, 1000)
    cold(pods, tokens)
    t, sock = stalled_reader(a, port, tokens)
    with closing(sock):
        with closing(dial(port)) as again:  # the token, while its run is being sent
            again.sendall(hello(t.ticket.token))
            assert everything(again) == b""
        t0 = time.monotonic()
        t.cancel()  # the control ends; the data connection is still open, unread
        no_leaks(a, timeout=5)
        assert time.monotonic() - t0 < 5
        got = everything(sock, 10)  # A shut its side down: the rest of the run never comes
        run_bytes = len(t.hashes) * 8192
        assert len(got) < run_bytes


def test_holder_lets_go_when_the_data_connection_drops_mid_send(pods):
    """The puller's data connection reset mid-run, its control call left open: A's sender
    stops, and the pins go with the call, at its deadline at the latest."""
    a = pods.a
    port = pods.data_port
    tokens = prompt(65, 1000)
    cold(pods, tokens)
    call_s = 3.0
    t, sock = stalled_reader(a, port, tokens, timeout=call_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset
    try:
        no_leaks(a, timeout=call_s + 3)
    finally:
        t.cancel()
