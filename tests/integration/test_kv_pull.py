"""Cross-pod KV pull between real pod processes, through the router: a busy holder's prefix
goes to an idle pod with a kv_source and is pulled there. (Each transport from each tier,
pool / DRAM / SSD, at both block sizes: tests/integration/test_kv_pull_transports.py.)
"""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.index import IndexSchema, lookup_prefix
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

PROMPT = [(i * 7) % 250 for i in range(300)]


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
