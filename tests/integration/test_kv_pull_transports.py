"""Cross-pod KV pull on each data transport (issue #28), real pod processes: PageKV's framed
TCP, Mooncake's transfer engine (skipped, with the reason, where it cannot load), and the
blocks in the PullBlocks stream itself (grpc) × a holder's pool, DRAM and SSD tiers × block
sizes 16 and 32.

Per block size one cluster: a holder per tier (serving every transport) and a puller per
transport (offering only that one). Each case is a prompt of its own: the holder computes it
cold (its tokens are the reference), evicts it to its tier when that is DRAM or SSD, and
the puller, asked the prompt with the holder as its kv_source, must answer the same tokens
with the whole prefix from the peer, counted under its transport, from that tier, and leave
no block pinned on either pod.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench import pull_cut
from bench.netns_partitions import generate as bed_generate
from bench.netns_partitions import request
from pagekv.deploy.local_cluster import Child, LocalCluster, wait_healthy
from pagekv.deploy.netns_bed import NetnsBed
from pagekv.deploy.netns_mesh import unavailable_reason as netns_unavailable
from pagekv.kvnode.pod.kv_transports import mooncake_unavailable
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

# Its Mooncake fault tests run on a network-namespace bed: one bed at a time (xdist_groups.py).
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("netns")]

MOONCAKE_WHY_NOT = mooncake_unavailable()
TIERS = ("GPU", "CPU", "DISK")
TRANSPORTS = ("tcp", "mooncake", "grpc")
SERVED = ("mooncake,tcp" if MOONCAKE_WHY_NOT is None else "tcp")
PROMPT_LEN = 300
COMMON = ["--max-model-len", "320", "--num-threads", "1"]
TIER_ARGS = {  # as tests/integration/test_kv_pull.py: room for one request, then the tier
    "GPU": ["--num-gpu-blocks", "128"],
    "CPU": ["--num-gpu-blocks", "{small}", "--cpu-offload-bytes", "8MiB"],
    "DISK": ["--num-gpu-blocks", "{small}", "--disk-offload-bytes", "64MiB",
             "--disk-offload-dir", "{tmp}/ssd-{tier}"],
}


def prompt(n: int) -> list[int]:
    """A prompt no pod has seen: one per case."""
    rng = random.Random(f"prompt-{n}")
    return [rng.randrange(1, 251) for _ in range(PROMPT_LEN)]


def filler(n: int) -> list[int]:
    rng = random.Random(f"filler-{n}")
    return [rng.randrange(1, 251) for _ in range(PROMPT_LEN - 20)]


@pytest.fixture(scope="module", params=[16, 32], ids=lambda bs: f"block{bs}")
def cluster(request, tmp_path_factory) -> Iterator[dict[str, Child | int]]:
    bs = request.param
    tmp = tmp_path_factory.mktemp(f"transports-{bs}")
    small = str(352 // bs)
    c = LocalCluster(nodes=0, run_dir=tmp, start_router=False)
    c.start()
    try:
        pods: dict[str, Child | int] = {"block_size": bs}
        for tier in TIERS:
            args = [a.replace("{small}", small).replace("{tmp}", str(tmp))
                    .replace("{tier}", tier) for a in TIER_ARGS[tier]]
            pods[tier] = c.start_pod(f"holder-{tier.lower()}",
                                     ["--block-size", str(bs), *COMMON, *args,
                                      "--kv-transports", SERVED])
        for t in TRANSPORTS:
            if t == "mooncake" and MOONCAKE_WHY_NOT is not None:
                continue
            # A long deadline: a holder that kept a slab until the pull's deadline would
            # run out of them in test_mooncake_slabs_are_reused.
            pods[t] = c.start_pod(f"puller-{t}", ["--block-size", str(bs), *COMMON,
                                                  "--num-gpu-blocks", "128",
                                                  "--kv-pull-deadline-s", "20",
                                                  "--kv-transports", t])
        for pod in pods.values():
            if isinstance(pod, Child):
                wait_healthy(pod.target(), 120, pod.proc)
        yield pods
    finally:
        c.stop()


def generate(pod: Child, tokens: list[int], source: pb.KvSource | None = None
             ) -> pb.GenerateResponse:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=tokens), sampling=pb.SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True))
    if source is not None:
        req.kv_source.CopyFrom(source)
    with grpc.insecure_channel(pod.target()) as ch:
        return pb_grpc.GenerationStub(ch).Generate(req, timeout=60)


def metrics(pod: Child) -> list[tuple[str, dict[str, str], float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def value(samples, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples
               if n == name and all(lab.get(k) == w for k, w in labels.items()))


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"not within {timeout:g}s: {what}"
        time.sleep(0.05)


def nothing_pinned(pod: Child) -> bool:
    m = metrics(pod)
    return (value(m, "pagekv_kv_cache_free_blocks") == value(m, "pagekv_kv_cache_blocks")
            and value(m, "pagekv_kv_transfers_active") == 0)


CASES = [(tier, t) for t in TRANSPORTS for tier in TIERS]


@pytest.mark.parametrize(("tier", "transport"), CASES,
                         ids=[f"{t}-{tier}" for tier, t in CASES])
def test_pull_on_each_transport_from_each_tier(cluster, tier, transport):
    if transport == "mooncake" and MOONCAKE_WHY_NOT is not None:
        pytest.skip(f"mooncake: {MOONCAKE_WHY_NOT}")
    bs = cluster["block_size"]
    holder, puller = cluster[tier], cluster[transport]
    assert isinstance(bs, int) and isinstance(holder, Child) and isinstance(puller, Child)
    n = CASES.index((tier, transport)) + 100 * bs
    tokens = prompt(n)
    ref = generate(holder, tokens)
    assert ref.usage.cached_tokens == 0
    want = list(ref.completions[0].token_ids)
    if tier != "GPU":
        for k in range(2):  # each alone fills the holder's pool: the prompt goes to its tier
            generate(holder, filler(n + k))
    full = (PROMPT_LEN - 1) // bs
    served0, pulled0 = metrics(holder), metrics(puller)
    got = generate(puller, tokens, pb.KvSource(pod_id=holder.name, address=holder.target(),
                                               num_blocks=full))
    assert list(got.completions[0].token_ids) == want
    assert got.usage.cached_tokens_peer == got.usage.cached_tokens == full * bs, \
        puller.log_tail(10)
    served, pulled = metrics(holder), metrics(puller)

    def grew(before, after, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew(served0, served, "pagekv_kv_served_blocks_total", tier=tier) == full
    assert grew(pulled0, pulled, "pagekv_kv_pulled_blocks_total") == full
    assert grew(pulled0, pulled, "pagekv_kv_pull_fallbacks_total") == 0
    assert grew(pulled0, pulled, "pagekv_prefix_cache_hits_tokens_total", tier="PEER") == \
        full * bs
    assert grew(pulled0, pulled, "pagekv_kv_pulls_by_transport_total", transport=transport,
                outcome="ok") == 1, puller.log_tail(10)
    for pod in (puller, holder):
        wait_for(lambda pod=pod: nothing_pinned(pod),
                 f"{pod.name}: every block free, no transfer active")


def test_mooncake_slabs_are_reused(cluster):
    """More pulls from one holder than it has slabs, each within the others' deadlines: each
    slab is lent again as soon as its puller is done, and every pull is whole."""
    if MOONCAKE_WHY_NOT is not None:
        pytest.skip(f"mooncake: {MOONCAKE_WHY_NOT}")
    from pagekv.kvnode.pod.kv_data_mooncake import SLABS

    bs = cluster["block_size"]
    holder, puller = cluster["GPU"], cluster["mooncake"]
    assert isinstance(bs, int) and isinstance(holder, Child) and isinstance(puller, Child)
    full = (PROMPT_LEN - 1) // bs
    for k in range(SLABS + 2):
        tokens = prompt(1000 + 100 * bs + k)
        want = list(generate(holder, tokens).completions[0].token_ids)
        got = generate(puller, tokens, pb.KvSource(pod_id=holder.name,
                                                   address=holder.target(), num_blocks=full))
        assert list(got.completions[0].token_ids) == want
        assert got.usage.cached_tokens_peer == full * bs, (k, puller.log_tail(5))
    wait_for(lambda: nothing_pinned(holder) and nothing_pinned(puller), "nothing pinned")


def test_mooncake_slab_is_readable_only_while_lent():
    """Mooncake serves any registered memory to whoever reaches its ports: a run's entries
    are in the holder's slab while its puller reads them, and wiped once the control call
    is over. In one process, the transport's two ends and a third engine that reads the
    slab raw (as anyone on the network could)."""
    if MOONCAKE_WHY_NOT is not None:
        pytest.skip(f"mooncake: {MOONCAKE_WHY_NOT}")
    import numpy as np

    from bench.kv_wire import PoolExporter, hashes, pool
    from pagekv.kvnode.engine.kv_export import ExportRun
    from pagekv.kvnode.engine.peer_pull import BlockSink, PullAsk, PullHandle
    from pagekv.kvnode.pod import kv_data_mooncake as mc
    from pagekv.kvnode.pod.kv_data_session import ExportSession
    from pagekv.proto.medium import Medium

    blocks = 24
    src, layout = pool(blocks, 16)
    dst, _ = pool(blocks, 16)
    server, client = mc.MooncakeDataServer("127.0.0.1"), mc.MooncakeDataClient()
    closed = threading.Event()
    session = ExportSession(PoolExporter(src, layout),  # type: ignore[arg-type]
                            ExportRun(hashes(blocks), [Medium.GPU] * blocks), budget=1 << 30,
                            deadline=time.monotonic() + 30, compress=False,
                            chunk_bytes=8 * layout.block_bytes, close_run=closed.set)
    ticket = server.offer(session)
    assert ticket.transport == "mooncake" and len(ticket.entry_lengths) == blocks

    def control() -> Iterator[pb.PullBlocksChunk]:
        seen = 0
        while seen < blocks:
            seen, _ = session.wait_progress(seen, 5)
            yield pb.PullBlocksChunk(ready_blocks=seen)

    ask = PullAsk("t", hashes(blocks), None, time.monotonic() + 30)
    sink = BlockSink(layout, ask, [dst.block_planes(i) or [] for i in range(blocks)])
    client.receive("127.0.0.1", ticket, ask, sink, PullHandle(), control())
    assert sink.count == blocks
    assert all(bytes(a) == bytes(b) for i in range(blocks)
               for a, b in zip(src.block_planes(i) or [], dst.block_planes(i) or [],
                               strict=True))
    spy = mc._new_engine("127.0.0.1")
    seen = np.zeros(4096, np.uint8)
    assert spy.register_memory(seen.ctypes.data, seen.nbytes) == 0

    def slab_head() -> bytes:
        assert spy.transfer_sync_read(ticket.session, seen.ctypes.data, ticket.buffer,
                                      seen.nbytes) == 0
        return seen.tobytes()

    assert slab_head()[:4] == b"PKVB"  # lent: the first entry, there to be read
    session.end()  # the control call over (a pod's puller cancels it once done)
    assert closed.wait(5), "the run was never closed"
    wait_for(lambda: not any(slab_head()), "the released slab wiped", timeout=5)
    server.close()


# -- Mooncake under faults, hosts of their own (deploy/netns_bed.py) ---------------------------
# pagekv-small over a link shaped to 100 Mbit/s: a 3,000-token prefix is 18 MB, about 1.5 s
# on the wire, so a fault a fraction into the pull lands while the puller's reads move.
FAULT_MODEL = "pagekv-small"
FAULT_PROMPT = 3000
FAULT_RATE = "100mbit"
FAULT_DEADLINE_S = 4.0
FAULT_ARGS = ["--num-gpu-blocks", "512", "--max-model-len", str(FAULT_PROMPT + 64),
              "--kv-pull-deadline-s", str(FAULT_DEADLINE_S), "--kv-transports", "mooncake"]


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    if MOONCAKE_WHY_NOT is not None:
        pytest.skip(f"mooncake: {MOONCAKE_WHY_NOT}")
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"no network-namespace test bed: {why}")
    with NetnsBed(2, tmp_path_factory.mktemp("mooncake-faults"), model=FAULT_MODEL,
                  pod_args=FAULT_ARGS).start() as b:
        yield b


def test_mooncake_holder_killed_mid_pull_falls_back(bed):
    """The holder SIGKILLed while its blocks move: the puller recomputes what did not arrive
    (the cold tokens), counts one fallback, and has every pool block free again."""
    bed.mesh.set_rate("node-a", "node-b", FAULT_RATE)
    rng = random.Random(2829)
    tokens = [rng.randrange(1, 256) for _ in range(FAULT_PROMPT)]
    want = list(bed_generate(bed.address("node-a"), request(tokens, 4), 300)
                .completions[0].token_ids)
    # How long an uncut pull of this size takes here (a prompt of its own).
    probe = [rng.randrange(1, 256) for _ in range(FAULT_PROMPT)]
    bed_generate(bed.address("node-a"), request(probe, 4), 300)
    uncut = pull_cut.pull_call(bed, "node-a", "node-b", probe, 4, 60.0, pull_cut.PullCall())
    assert uncut.code == "OK" and uncut.peer_tokens == (FAULT_PROMPT - 1) // 16 * 16, uncut
    during = pull_cut.PullCall()
    worker = threading.Thread(target=pull_cut.pull_call, daemon=True, args=(
        bed, "node-a", "node-b", tokens, 4, 60.0, during))
    worker.start()
    time.sleep(uncut.seconds * 0.6)  # past the first reads (4 MiB each), before the last
    os.killpg(bed.pod("node-a").proc.pid, signal.SIGKILL)
    worker.join(FAULT_DEADLINE_S + 60.0)
    assert during.code == "OK" and during.tokens == want, during
    assert 0 < during.peer_tokens < uncut.peer_tokens, during  # it landed mid-pull
    assert sum(during.fallbacks.values()) == 1, during
    assert set(during.fallbacks) <= {"peer_unavailable", "deadline"}, during
    assert during.seconds < FAULT_DEADLINE_S + 30.0, during
    free_s, in_use = None, {}
    end = time.monotonic() + 10
    while time.monotonic() < end:
        with grpc.insecure_channel(bed.address("node-b")) as ch:
            st = pb_grpc.KVNodeStub(ch).Stats(pb.StatsRequest(), timeout=5)
        in_use = {"node-b": st.num_blocks - st.num_free_blocks}
        if not in_use["node-b"]:
            free_s = 0.0
            break
        time.sleep(0.1)
    assert free_s is not None, in_use
