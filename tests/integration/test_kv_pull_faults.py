"""Cross-pod KV pull under faults, with real pods: a peer killed mid-transfer, a corrupt
entry, a peer too slow for the deadline, a peer of another hash seed, a dead address.

Pod A computes each prompt cold and serves its blocks; the faulty peer is
tests/integration/fake_kv_peer.py, a process that relays A's PullBlocks and misbehaves on
purpose. The puller (B, or D with a short deadline) must answer exactly A's greedy tokens
whatever happens, keep the blocks that arrived intact before the fault, count the fallback
by its reason, and leak no block on either side.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import Child, LocalCluster, wait_healthy
from pagekv.deploy.redis_server import free_port
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

POD_ARGS = ["--num-gpu-blocks", "128", "--max-model-len", "1024", "--num-threads", "1"]
BLOCK = 16
FULL = 299 // BLOCK  # blocks of a 300-token prompt a peer can give (never the last token)
FAKE_PEER = Path(__file__).with_name("fake_kv_peer.py")


def prompt(n: int) -> list[int]:
    """A 300-token prompt of its own per test: no pod holds any block of it beforehand."""
    return [(i * 7 + n * 31) % 250 for i in range(300)]


@pytest.fixture(scope="module")
def pods(tmp_path_factory) -> Iterator[dict[str, Child]]:
    """a: the source; b: a puller (long deadline); d: a puller with a 0.5 s deadline;
    c: another hash seed (a fresh pod for references, and a peer b must refuse)."""
    cluster = LocalCluster(nodes=0, start_router=False, node_args=POD_ARGS,
                           run_dir=tmp_path_factory.mktemp("kv-pull-faults"))
    cluster.start()
    try:
        out = {
            "a": cluster.start_pod("node-a"),
            "b": cluster.start_pod("node-b", ["--kv-pull-deadline-s", "20"]),
            "d": cluster.start_pod("node-d", ["--kv-pull-deadline-s", "0.5"]),
            "c": cluster.start_pod("node-c", ["--hash-seed", "another-seed"]),
        }
        for child in out.values():
            wait_healthy(child.address, 120, child.proc)
        yield out
    finally:
        cluster.stop()


def generate(pod: Child, tokens: list[int], source: str | None = None,
             timeout: float = 30.0) -> pb.GenerateResponse:
    return generate_future(pod, tokens, source, timeout).result()


def generate_future(pod: Child, tokens: list[int], source: str | None = None,
                    timeout: float = 30.0):
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=tokens),
        sampling=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    if source is not None:
        req.kv_source.CopyFrom(pb.KvSource(pod_id="peer", address=source, num_blocks=FULL))
    channel = grpc.insecure_channel(pod.address)
    future = pb_grpc.GenerationStub(channel).Generate.future(req, timeout=timeout)
    future.add_done_callback(lambda _: channel.close())
    return future


def metrics(pod: Child) -> dict[tuple[str, str], float]:
    """(sample name, its reason or tier label) -> value, from the pod's /metrics."""
    url = f"http://127.0.0.1:{pod.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, s.labels.get("reason", s.labels.get("tier", "")))
            out[key] = out.get(key, 0.0) + s.value
    return out


def fallbacks(pod: Child) -> dict[str, float]:
    return {reason: v for (name, reason), v in metrics(pod).items()
            if name == "pagekv_kv_pull_fallbacks_total"}


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll until `check()` holds (releases finish on other threads of other processes)."""
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(0.05)


def no_leaks(*puller_and_sources: Child) -> None:
    for pod in puller_and_sources:
        def idle(pod=pod) -> bool:
            m = metrics(pod)
            return (m[("pagekv_kv_cache_free_blocks", "")] == m[("pagekv_kv_cache_blocks", "")]
                    and m[("pagekv_kv_transfers_active", "")] == 0)
        wait_for(idle, f"{pod.name}: every block free and no transfer active")


class FakePeer:
    def __init__(self, upstream: str, mode: str, arg: float = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(FAKE_PEER), "--upstream", upstream, "--mode", mode,
             "--arg", str(arg)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        port = self.expect("READY ", 30).split()[1]
        self.address = f"127.0.0.1:{port}"

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, prefix: str, timeout: float = 20.0) -> str:
        end = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"fake peer never printed {prefix!r}; it printed "
                                     f"{self.seen}") from None
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def drained(self) -> bool:
        """Every byte this peer wrote has left the kernel's queues for the puller process
        (`ss`: Send-Q and Recv-Q 0 on both ends of its connections): a SIGKILL now sends an
        RST, which on Linux discards what the puller's kernel still held unread, so "what
        arrived" only means arrived once it is drained."""
        port = self.address.rsplit(":", 1)[1]
        out = subprocess.run(["ss", "-tnH", f"( sport = :{port} or dport = :{port} )"],
                             capture_output=True, text=True, timeout=10).stdout
        rows = [line.split() for line in out.splitlines() if line.strip()]
        return bool(rows) and all(r[1] == "0" and r[2] == "0" for r in rows if len(r) > 2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@contextmanager
def fake_peer(upstream: Child, mode: str, arg: float = 0) -> Iterator[FakePeer]:
    peer = FakePeer(upstream.address, mode, arg)
    try:
        yield peer
    finally:
        peer.kill()


def cold(pods: dict[str, Child], tokens: list[int]) -> list[int]:
    """A's greedy answer, computed cold (A then holds the prompt), checked against a pod
    that never saw it."""
    ref = generate(pods["a"], tokens)
    assert ref.usage.cached_tokens == 0
    fresh = generate(pods["c"], tokens)
    assert fresh.usage.cached_tokens == 0
    want = list(ref.completions[0].token_ids)
    assert list(fresh.completions[0].token_ids) == want and len(want) == 8
    return want


def check_pull(resp: pb.GenerateResponse, want: list[int], peer_blocks: int,
               puller: Child, before: dict[str, float], reason: str | None) -> None:
    assert list(resp.completions[0].token_ids) == want
    assert resp.usage.cached_tokens_peer == peer_blocks * BLOCK
    after = fallbacks(puller)
    grew = {r: after[r] - before.get(r, 0.0) for r in after if after[r] != before.get(r, 0.0)}
    assert grew == ({reason: 1} if reason else {}), puller.log_tail(10)


def test_faithful_relay_pulls_every_block(pods):
    tokens = prompt(1)
    want = cold(pods, tokens)
    before = fallbacks(pods["b"])
    with fake_peer(pods["a"], "relay") as peer:
        resp = generate(pods["b"], tokens, peer.address)
        assert peer.expect("DONE ") == f"DONE {FULL}"
    check_pull(resp, want, FULL, pods["b"], before, None)
    no_leaks(pods["b"], pods["a"])


def test_peer_killed_mid_transfer_keeps_what_arrived(pods):
    tokens, sent = prompt(2), 5
    want = cold(pods, tokens)
    before = fallbacks(pods["b"])
    with fake_peer(pods["a"], "stall-after", sent) as peer:
        future = generate_future(pods["b"], tokens, peer.address)
        assert peer.expect("SENT ") == f"SENT {sent}"
        assert not future.done()  # B is waiting on the stalled peer
        wait_for(peer.drained, "the entries sent to reach the puller")
        peer.kill()
        resp = future.result()
    check_pull(resp, want, sent, pods["b"], before, "peer_unavailable")
    no_leaks(pods["b"], pods["a"])


def test_corrupt_entry_keeps_the_run_before_it(pods):
    tokens, bad = prompt(3), 7
    want = cold(pods, tokens)
    before = fallbacks(pods["b"])
    with fake_peer(pods["a"], "corrupt", bad) as peer:
        resp = generate(pods["b"], tokens, peer.address)
    check_pull(resp, want, bad, pods["b"], before, "checksum")
    no_leaks(pods["b"], pods["a"])


def test_slow_peer_misses_the_deadline(pods):
    tokens, delay = prompt(4), 4.0
    want = cold(pods, tokens)
    before = fallbacks(pods["d"])
    with fake_peer(pods["a"], "delay", delay) as peer:
        t0 = time.monotonic()
        resp = generate(pods["d"], tokens, peer.address)
        elapsed = time.monotonic() - t0
    assert elapsed < delay - 1.0  # d gave up at its 0.5 s deadline, not when the peer woke
    check_pull(resp, want, 0, pods["d"], before, "deadline")
    no_leaks(pods["d"], pods["a"])


def test_peer_of_another_hash_seed_is_refused(pods):
    tokens = prompt(5)
    want = cold(pods, tokens)  # c holds the prompt now, under its own seed
    before = fallbacks(pods["b"])
    refused = metrics(pods["c"]).get(("pagekv_kv_transfers_refused_total", "config_mismatch"), 0)
    resp = generate(pods["b"], tokens, pods["c"].address)
    check_pull(resp, want, 0, pods["b"], before, "config_mismatch")
    assert metrics(pods["c"])[("pagekv_kv_transfers_refused_total", "config_mismatch")] == \
        refused + 1
    no_leaks(pods["b"], pods["c"])


def test_dead_address_falls_back_quickly(pods):
    tokens = prompt(6)
    want = cold(pods, tokens)
    before = fallbacks(pods["b"])
    t0 = time.monotonic()
    resp = generate(pods["b"], tokens, f"127.0.0.1:{free_port()}", timeout=15)
    assert time.monotonic() - t0 < 10
    check_pull(resp, want, 0, pods["b"], before, "peer_unavailable")
    no_leaks(pods["b"])
