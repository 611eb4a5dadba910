"""What the P/D integration tests share: a mixed reference pod outside the fleet (its tokens
are the cold run's), calls through the router, and the pods' metrics."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import Child, pagekv_cmd, spawn, wait_healthy
from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.index import IndexSchema, lookup_prefix
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_reference(run_dir: Path, args: list[str]) -> Child:
    """A mixed pod on no index (the router never sees it): the tokens to match."""
    port, http = free_port(), free_port()
    child = spawn("reference", pagekv_cmd(
        "node", "--model", "pagekv-tiny", "--port", str(port), "--http-port", str(http),
        "--pod-id", "reference", "--num-threads", "1", *args), run_dir)
    child.address, child.http_port = f"127.0.0.1:{port}", http
    wait_healthy(child.address, 120, child.proc)
    return child


def request(tokens: list[int], max_tokens: int = 12, **sampling) -> pb.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=tokens),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))


def generate(address: str, req: pb.GenerateRequest, timeout: float = 60
             ) -> pb.GenerateResponse:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.GenerationStub(ch).Generate(req, timeout=timeout)


def stream(address: str, req: pb.GenerateRequest, timeout: float = 60
           ) -> tuple[dict[int, list[int]], pb.GenerateChunk]:
    """Each completion's streamed tokens, and the last chunk (usage, routing)."""
    tokens: dict[int, list[int]] = {}
    last = None
    with grpc.insecure_channel(address) as ch:
        for chunk in pb_grpc.GenerationStub(ch).GenerateStream(req, timeout=timeout):
            tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
            last = chunk
    assert last is not None
    return tokens, last


def completions(response: pb.GenerateResponse) -> dict[int, list[int]]:
    return {c.index: list(c.token_ids) for c in response.completions}


def stats(pod: Child) -> pb.StatsResponse:
    with grpc.insecure_channel(pod.target()) as ch:
        return pb_grpc.KVNodeStub(ch).Stats(pb.StatsRequest(), timeout=10)


def metrics(child: Child) -> list[tuple[str, dict[str, str], float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{child.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def value(samples, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples
               if n == name and all(lab.get(k) == w for k, w in labels.items()))


def wait_for(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"not within {timeout:g}s: {what}"
        time.sleep(0.05)


def idle_and_unpinned(pod: Child) -> bool:
    """No request, no hold, no pull or transfer: every pool block free (cached or not)."""
    st = stats(pod)
    return (st.num_free_blocks == st.num_blocks and st.handover_held_blocks == 0
            and st.num_running == 0 and st.num_waiting == 0)


def wait_router_sees(router: Child, pods: int) -> None:
    wait_for(lambda: value(metrics(router), "pagekv_router_live_pods") >= pods,
             f"the router sees {pods} live pods", 60)


def wait_indexed(redis_url: str, block_size: int, tokens: list[int], pod_id: str,
                 blocks: int) -> None:
    """Until the index shows `pod_id` holding the first `blocks` blocks of `tokens` (in any
    tier): what the router will score it by."""
    client = redis.Redis.from_url(redis_url)
    hashes = hash_prompt(HashConfig("sha256", "vllm-none-hash"), block_size, tokens)[:blocks]
    schema = IndexSchema("pagekv-tiny", block_size, "sha256", "vllm-none-hash")
    try:
        wait_for(lambda: getattr(lookup_prefix(client, schema, hashes).get(pod_id), "depth", 0)
                 >= blocks, f"{pod_id}'s {blocks} blocks in the index")
    finally:
        client.close()
