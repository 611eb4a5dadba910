"""Cross-pod KV pull between real pod processes over gRPC: pool, DRAM and SSD sources.

Pod A computes a prompt; pod B, asked the same prompt with A as its kv_source, pulls A's
blocks instead of recomputing them. The tokens must be A's cold ones, the usage must say
where the cached tokens came from, and the metrics on both sides must show the transfer.
"""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import LocalCluster, wait_healthy
from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.index import IndexSchema, lookup_prefix
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

PROMPT = [(i * 7) % 250 for i in range(300)]
FILLERS = [[(i * k) % 250 + 1 for i in range(280)] for k in (11, 13, 17, 19)]


def generate(address: str, prompt, source: pb.KvSource | None = None) -> pb.GenerateResponse:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True))
    if source is not None:
        request.kv_source.CopyFrom(source)
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.GenerationStub(ch).Generate(request, timeout=60)


def metrics(pod) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def wait_router_sees(router, pods: int) -> None:
    """Until the router counts `pods` live pods (a pod joins it at its next index refresh,
    which a loaded box may delay past the cluster's start)."""
    deadline = time.monotonic() + 30
    while metrics(router).get(("pagekv_router_live_pods", ()), 0) < pods:
        assert time.monotonic() < deadline, f"the router never saw {pods} live pods"
        time.sleep(0.1)


def wait_indexed(redis_url: str, pod_id: str, blocks: int) -> None:
    """Until the index shows `pod_id` holding PROMPT's first `blocks` blocks (its publisher
    flushes every 50 ms; a loaded box may take longer)."""
    client = redis.Redis.from_url(redis_url)
    hashes = hash_prompt(HashConfig("sha256", "vllm-none-hash"), 16, PROMPT)[:blocks]
    schema = IndexSchema("pagekv-tiny", 16, "sha256", "vllm-none-hash")
    deadline = time.monotonic() + 10
    try:
        while getattr(lookup_prefix(client, schema, hashes).get(pod_id), "depth", 0) < blocks:
            assert time.monotonic() < deadline, f"{pod_id}'s blocks never reached the index"
            time.sleep(0.05)
    finally:
        client.close()


def value(samples, name: str, **labels) -> float:
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == w for k, w in labels.items()))


SOURCE_ARGS = {
    "GPU": ["--num-gpu-blocks", "128"],
    "CPU": ["--num-gpu-blocks", "{small}", "--cpu-offload-bytes", "8MiB"],
    "DISK": ["--num-gpu-blocks", "{small}", "--disk-offload-bytes", "64MiB",
             "--disk-offload-dir", "{tmp}/ssd"],
}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("tier", ["GPU", "CPU", "DISK"])
def test_pull_from_each_tier_gives_cold_tokens(tmp_path, tier, block_size):
    small = str(352 // block_size)  # room for one request: the fillers evict the prompt
    source_args = [a.replace("{small}", small).replace("{tmp}", str(tmp_path))
                   for a in SOURCE_ARGS[tier]]
    common = ["--block-size", str(block_size), "--max-model-len", "320"]
    cluster = LocalCluster(nodes=0, run_dir=tmp_path, start_router=False)
    try:
        cluster.start()
        a = cluster.start_pod("node-a", [*common, *source_args])
        b = cluster.start_pod("node-b", [*common, "--num-gpu-blocks", "128"])
        cold = cluster.start_pod("node-c", [*common, "--num-gpu-blocks", "128",
                                            "--no-enable-prefix-caching"])
        for pod in (a, b, cold):
            wait_healthy(pod.address, 60, pod.proc)
        expected = generate(cold.address, PROMPT).completions[0].token_ids
        assert generate(a.address, PROMPT).completions[0].token_ids == expected
        if tier != "GPU":
            for filler in FILLERS:
                generate(a.address, filler)
        full = (len(PROMPT) - 1) // block_size
        got = generate(b.address, PROMPT, pb.KvSource(pod_id="node-a", address=a.address,
                                                      num_blocks=full))
        assert got.completions[0].token_ids == expected
        assert got.usage.cached_tokens_peer == full * block_size
        assert got.usage.cached_tokens == full * block_size
        served, pulled = metrics(a), metrics(b)
        assert value(served, "pagekv_kv_served_blocks_total", tier=tier) > 0
        assert value(served, "pagekv_kv_served_blocks_total") == full
        assert value(served, "pagekv_kv_transfers_active") == 0
        assert value(pulled, "pagekv_kv_pulled_blocks_total") == full
        assert value(pulled, "pagekv_kv_pull_fallbacks_total") == 0
        assert value(pulled, "pagekv_kv_pull_seconds_count") == 1
        assert value(pulled, "pagekv_prefix_cache_hits_tokens_total", tier="PEER") == \
            full * block_size
        assert value(pulled, "pagekv_kv_cache_free_blocks") == value(pulled,
                                                                     "pagekv_kv_cache_blocks")
    finally:
        cluster.stop()


def test_router_sends_a_busy_holders_prefix_to_an_idle_pod_by_pull(tmp_path):
    """The holder is busy (a queued request costs 10 s here): the router picks the idle
    pod with the pull option, names the holder in kv_source, and the idle pod pulls."""
    args = ["--num-gpu-blocks", "128", "--max-model-len", "1024"]
    cluster = LocalCluster(nodes=2, run_dir=tmp_path, node_args=args,
                           router_args=["--cost-queue-per-request", "10"]).start()
    try:
        wait_router_sees(cluster.router, 2)
        router = cluster.router.address
        first = generate(router, PROMPT)
        holder = first.routing.chosen_pod
        wait_indexed(cluster.redis_url, holder, 18)  # the pull option needs indexed blocks
        with grpc.insecure_channel(router) as ch:
            busy = pb_grpc.GenerationStub(ch).GenerateStream(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[*PROMPT, 1, 2]), sampling=pb.SamplingParams(
                    max_tokens=600, temperature=0.0, ignore_eos=True)), timeout=60)
            next(busy)  # in flight on the holder now
            got = generate(router, [*PROMPT, 3, 4])
            busy.cancel()
        info = got.routing
        assert info.chosen_pod != holder and info.reason == "peer_pull"
        assert info.pull_from == holder and info.pull_tokens == 18 * 16
        assert info.predicted_pull_saving_s > 0
        assert got.usage.cached_tokens_peer == 18 * 16
        holder_pod = next(p for p in cluster.pods if p.name == holder)
        direct = generate(holder_pod.address, [*PROMPT, 3, 4])  # as the holder computes it
        assert got.completions[0].token_ids == direct.completions[0].token_ids
    finally:
        cluster.stop()
