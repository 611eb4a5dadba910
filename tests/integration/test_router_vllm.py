"""The router in front of vLLM pods, end to end with real processes: two PageKV pods stand in
for vLLM (their OpenAI server on --http-port, their KV events in vLLM's format on
--kv-events-zmq), each behind a real `pagekv ingest-vllm` that registers it `kind=vllm` in
one Redis. The same pods also publish with their own IndexPublisher into a second Redis, as
PageKV pods (`kind=pagekv`, reached over gRPC), so one workload can be routed over both.

Checked: through the router (gRPC and its OpenAI API) a vLLM-kind pod answers what it
answers when called directly, in a PageKV pod's stream shape, with usage and routing; its
refusal is the client's INVALID_ARGUMENT; a client's cancel stops the pod's work; routing
decisions over the ingested index equal those over the pods' own; a killed pod is retried
on the other. The stub alone against a scripted server: test_router_vllm_http.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import Child, pagekv_cmd, spawn, stop_child, wait_healthy
from pagekv.deploy.redis_server import RedisProcess, free_port
from pagekv.proto.index import count_pod_claims, lookup_prefix
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.router.scoring import CostModel
from tests.integration.router_fixtures import tokens_req
from tests.integration.vllm_fixtures import SCHEMA, chain, wait_for

pytestmark = pytest.mark.integration

PODS = ("pod-a", "pod-b")
POD_ARGS = ["--num-gpu-blocks", "256", "--max-model-len", "2048", "--num-threads", "1",
            "--lease-ttl-s", "1.5"]
# The index alone decides: ties are exact (no absolute tolerance), identical pods are equally
# fast whatever they measured (a wide speed band), no pull option (a vLLM pod has none), no
# burst predictions (the test waits for the index instead).
SAME_COSTS = CostModel(prefill_per_token=1e-3, cpu_per_token=6e-6, disk_per_token=3e-5,
                       queue_per_request=1e-4, tie_abs_s=0.0, speed_band=1000.0)


@dataclass
class Fleet:
    own: RedisProcess       # the pods' own publishers: kind=pagekv
    ingested: RedisProcess  # the ingesters': kind=vllm
    pods: dict[str, Child] = field(default_factory=dict)
    grpc: dict[str, str] = field(default_factory=dict)
    http: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, int] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)

    def stub(self, pod_id: str) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(grpc.insecure_channel(self.grpc[pod_id]))

    def kv(self, pod_id: str) -> pb_grpc.KVNodeStub:
        return pb_grpc.KVNodeStub(grpc.insecure_channel(self.grpc[pod_id]))


@pytest.fixture(scope="module")
def fleet(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    run = tmp_path_factory.mktemp("vllm-fleet")
    f = Fleet(RedisProcess(data_dir=run / "own", binary=redis_binary).start(),
              RedisProcess(data_dir=run / "ingested", binary=redis_binary).start())
    try:
        zmq: dict[str, tuple[int, int]] = {}
        for pod_id in PODS:
            port, http, mport, pub, replay = (free_port() for _ in range(5))
            f.grpc[pod_id], f.http[pod_id], f.metrics[pod_id] = (
                f"127.0.0.1:{port}", f"127.0.0.1:{http}", mport)
            zmq[pod_id] = (pub, replay)
            f.pods[pod_id] = spawn(pod_id, pagekv_cmd(
                "node", "--model", SCHEMA.model, "--host", "127.0.0.1", "--port", str(port),
                "--http-port", str(http), "--metrics-port", str(mport), "--pod-id", pod_id,
                "--redis-url", f.own.url, "--kv-events-zmq", f"tcp://127.0.0.1:{pub}",
                "--kv-events-replay-zmq", f"tcp://127.0.0.1:{replay}", *POD_ARGS), run,
                env={"OMP_NUM_THREADS": "1"})
            f.children.append(f.pods[pod_id])
        for pod_id in PODS:
            wait_healthy(f.grpc[pod_id], 120, f.pods[pod_id].proc)
        for pod_id in PODS:
            pub, replay = zmq[pod_id]
            # No /health probe: a killed pod stays in the index, so the router tries it.
            f.children.append(spawn(f"ingest-{pod_id}", pagekv_cmd(
                "ingest-vllm", "--zmq-endpoint", f"tcp://127.0.0.1:{pub}",
                "--replay-endpoint", f"tcp://127.0.0.1:{replay}", "--pod-id", pod_id,
                "--openai-address", f.http[pod_id], "--model", SCHEMA.model,
                "--block-size", str(SCHEMA.block_size), "--redis-url", f.ingested.url,
                "--lease-ttl-s", "1.5", "--health-interval-s", "0"), run))
        client = redis.Redis.from_url(f.ingested.url)
        wait_for(lambda: all(client.exists(SCHEMA.lease_key(p)) for p in PODS), 30,
                 "the ingesters' registrations")
        yield f
    finally:
        for child in f.children:
            stop_child(child)
        f.own.close()
        f.ingested.close()


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def wait_indexed(url: str, pod_id: str, prompt: list[int]) -> None:
    """Until the index shows every full block of `prompt` on `pod_id`."""
    client = redis.Redis.from_url(url)
    hashes = chain(prompt)

    def held() -> bool:
        match = lookup_prefix(client, SCHEMA, hashes).get(pod_id)
        return match is not None and match.depth >= len(hashes)

    wait_for(held, 15, f"{pod_id}'s blocks in {url}")
    client.close()


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {}, exc.read()


def sse_data(raw: bytes) -> list[dict[str, Any]]:
    lines = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def shape(chunks: list[pb.GenerateChunk]) -> list[tuple]:
    return [(c.index, list(c.token_ids), c.text, c.finish_reason) for c in chunks]


def pod_metric(port: int, name: str, reason: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name == name and s.labels.get("finish_reason") == reason:
                return s.value
    return 0.0


def test_generate_through_the_router_is_the_vllm_pods_own_answer(fleet, make_router) -> None:
    router = make_router(fleet.ingested.url)
    router.wait_pods(2)
    prompt = prompt_of(1, 53)
    req = tokens_req(prompt, max_tokens=8)
    cold = router.stub.Generate(req, timeout=30)
    pod_id = cold.served_by
    assert pod_id in PODS and cold.routing.chosen_pod == pod_id
    assert cold.routing.chosen_address == fleet.http[pod_id]  # registered by the ingester
    assert (cold.usage.prompt_tokens, cold.usage.completion_tokens) == (53, 8)
    direct = fleet.stub(pod_id).Generate(req, timeout=30)
    assert cold.completions == direct.completions
    assert direct.completions[0].finish_reason == pb.FINISH_REASON_LENGTH

    # Streamed: the pod's own chunks, one for one; usage and routing on the last one only.
    # The blocks came back through the ingester: a predicted hit, which the pod confirms.
    wait_indexed(fleet.ingested.url, pod_id, prompt)
    call = router.stub.GenerateStream(req, timeout=30)
    chunks = list(call)
    assert dict(call.initial_metadata())["pagekv-served-by"] == pod_id
    assert shape(chunks) == shape(list(fleet.stub(pod_id).GenerateStream(req, timeout=30)))
    assert [c.HasField("usage") for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    assert last.served_by == pod_id and last.routing.reason == "prefix_hit"
    assert last.usage.cached_tokens == last.routing.predicted_cached_tokens == 48
    assert last.usage.cached_tokens_gpu == 48

    # A stop token id and logprobs travel as vLLM names them, and come back as ids.
    tokens = list(direct.completions[0].token_ids)
    i = next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k])
    stop = tokens_req(prompt, max_tokens=8)
    stop.sampling.stop_token_ids.append(tokens[i])
    (c,) = router.stub.Generate(stop, timeout=30).completions
    assert (c.finish_reason, c.stop_token_id, list(c.token_ids)) == (
        pb.FINISH_REASON_STOP, tokens[i], tokens[:i + 1])
    lp = tokens_req(prompt, max_tokens=4)
    lp.sampling.logprobs = 2
    via, mine = (s.Generate(lp, timeout=30).completions[0].logprobs
                 for s in (router.stub, fleet.stub(pod_id)))
    assert [(t.sampled.token_id, t.sampled.logprob) for t in via] == [
        (t.sampled.token_id, t.sampled.logprob) for t in mine]
    assert [{x.token_id for x in t.top} for t in via] == [{x.token_id for x in t.top}
                                                          for t in mine]


def test_prompt_logprobs_and_vllms_new_fields_reach_a_vllm_pod(fleet, make_router) -> None:
    """#26's fields through the router to a vLLM-kind pod (prompt_logprobs by way of vLLM's
    echo on a stream) come back as the pod's own gRPC answer gives them."""
    router = make_router(fleet.ingested.url)
    router.wait_pods(2)
    req = tokens_req(prompt_of(5, 37), max_tokens=3)
    req.sampling.prompt_logprobs = 2
    req.sampling.logprobs = 1
    via = router.stub.Generate(req, timeout=30)
    mine = fleet.stub(via.served_by).Generate(req, timeout=30)
    assert len(via.completions[0].prompt_logprobs) == 36

    def same(got: Any, want: Any) -> None:
        assert [(t.sampled.token_id, [x.token_id for x in t.top]) for t in got] == [
            (t.sampled.token_id, [x.token_id for x in t.top]) for t in want]
        assert [t.sampled.logprob for t in got] == pytest.approx(
            [t.sampled.logprob for t in want], abs=1e-5)

    same(via.completions[0].prompt_logprobs, mine.completions[0].prompt_logprobs)
    same(via.completions[0].logprobs, mine.completions[0].logprobs)
    assert list(via.completions[0].token_ids) == list(mine.completions[0].token_ids)
    chunks = list(router.stub.GenerateStream(req, timeout=30))
    same(chunks[0].prompt_logprobs, mine.completions[0].prompt_logprobs)
    assert not any(c.prompt_logprobs for c in chunks[1:])
    # min_p and skip_special_tokens under vLLM's names: the pod's own sampling.
    drawn = tokens_req(prompt_of(6, 20), max_tokens=12)
    drawn.sampling.temperature, drawn.sampling.seed, drawn.sampling.min_p = 1.5, 4, 0.25
    drawn.sampling.skip_special_tokens = False
    got = router.stub.Generate(drawn, timeout=30)
    assert got.completions[0] == fleet.stub(got.served_by).Generate(drawn, timeout=30
                                                                    ).completions[0]


def test_the_routers_openai_api_reaches_a_vllm_pod(fleet, make_router) -> None:
    router = make_router(fleet.ingested.url)
    router.wait_pods(2)
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    code, headers, raw = post(router.http_url + "/completions", body)
    assert code == 200, raw
    via = json.loads(raw)
    pod_id = via["pagekv"]["served_by"]
    assert pod_id in PODS and headers["x-pagekv-served-by"] == pod_id
    code, _, raw = post(f"http://{fleet.http[pod_id]}/v1/completions", body)
    direct = json.loads(raw)
    assert via["choices"][0]["text"] == direct["choices"][0]["text"]
    assert via["choices"][0]["finish_reason"] == "length"
    assert via["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert via["usage"]["completion_tokens"] == 8
    code, headers, raw = post(router.http_url + "/completions", {
        **body, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_data(raw)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == \
        direct["choices"][0]["text"]
    assert events[-1]["usage"]["completion_tokens"] == 8
    assert events[-1]["pagekv"]["routing"]["chosen_pod"] == headers["x-pagekv-served-by"]


def test_a_request_the_vllm_pod_refuses_is_the_clients_invalid_argument(fleet, make_router
                                                                        ) -> None:
    router = make_router(fleet.ingested.url)
    router.wait_pods(2)
    bad = tokens_req(prompt_of(2, 20), max_tokens=100000)
    with pytest.raises(grpc.RpcError) as via:
        router.stub.Generate(bad, timeout=30)
    with pytest.raises(grpc.RpcError) as direct:
        fleet.stub("pod-a").Generate(bad, timeout=30)
    assert via.value.code() == direct.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert via.value.details() == direct.value.details()  # the pod's words, passed through
    assert "max_tokens" in via.value.details()
    code, _, raw = post(router.http_url + "/completions",
                        {"prompt": [1, 2, 3], "max_tokens": 100000})
    assert code == 400 and json.loads(raw)["error"]["param"] == "max_tokens"


def test_a_cancelled_stream_stops_the_vllm_pods_work(fleet, make_router) -> None:
    router = make_router(fleet.ingested.url)
    router.wait_pods(2)
    call = router.stub.GenerateStream(tokens_req(prompt_of(3, 20), max_tokens=1900),
                                      timeout=60)
    next(call)
    pod_id = dict(call.initial_metadata())["pagekv-served-by"]
    finished = pod_metric(fleet.metrics[pod_id], "pagekv_requests_total", "length")
    assert fleet.kv(pod_id).Stats(pb.StatsRequest(), timeout=5).num_running == 1
    call.cancel()
    wait_for(lambda: fleet.kv(pod_id).Stats(pb.StatsRequest(), timeout=5).num_running == 0,
             5, "the pod to drop the request")
    # Aborted, not run to its 1,900 tokens (an abort is not counted as finished).
    assert pod_metric(fleet.metrics[pod_id], "pagekv_requests_total", "length") == finished


def test_routing_over_ingested_events_decides_as_over_the_pods_own(fleet, make_router
                                                                   ) -> None:
    rng = random.Random(7)
    prefixes = [prompt_of(10 + g, 64) for g in range(3)]

    def sibling(g: int, keep: int = 64) -> list[int]:  # 73 tokens: 4 blocks can hit
        return prefixes[g][:keep] + [rng.randrange(1, 250) for _ in range(73 - keep)]

    workload = [sibling(0), sibling(1), sibling(0), sibling(2), sibling(1), sibling(0, 32),
                sibling(2), sibling(1, 48), sibling(0)]
    runs = {}
    for name, url in (("own", fleet.own.url), ("ingested", fleet.ingested.url)):
        for pod_id in PODS:  # both runs start from empty pods and an empty index
            assert fleet.kv(pod_id).ResetPrefixCache(
                pb.ResetPrefixCacheRequest(include_tiers=True), timeout=30).success
        for index_url in (fleet.own.url, fleet.ingested.url):
            client = redis.Redis.from_url(index_url)
            wait_for(lambda c=client: not any(count_pod_claims(c, SCHEMA, p) for p in PODS),
                     15, "an empty index")
        router = make_router(url, costs=SAME_COSTS, kv_pull=False, burst_ttl_s=0.0)
        router.wait_pods(2)
        decisions = []
        for prompt in workload:  # 2 tokens more do not fill a block: only prompt blocks
            r = router.stub.Generate(tokens_req(prompt), timeout=30)
            info = r.routing
            assert r.served_by == info.chosen_pod
            assert r.usage.cached_tokens == info.predicted_cached_tokens  # the pod agrees
            decisions.append((info.chosen_pod, info.reason, info.predicted_cached_tokens))
            wait_indexed(url, r.served_by, prompt)
        runs[name] = decisions
    assert runs["ingested"] == runs["own"]
    reasons = {d[1] for d in runs["own"]}
    assert {"cold_spread", "prefix_hit"} <= reasons, runs["own"]
    assert {0, 32, 48, 64} <= {d[2] for d in runs["own"]}, runs["own"]


def test_a_killed_vllm_pod_is_retried_on_the_other(fleet, make_router) -> None:
    first, second = prompt_of(4, 53), prompt_of(5, 53)
    for prompt in (first, second):  # pod-b holds their prefixes: its hits
        fleet.stub("pod-b").Generate(tokens_req(prompt), timeout=30)
        wait_indexed(fleet.ingested.url, "pod-b", prompt)
    # No cooldown: the second call also tries the dead pod first (the streaming retry).
    router = make_router(fleet.ingested.url, unavailable_cooldown_s=0.0)
    router.wait_pods(2)
    victim = fleet.pods["pod-b"].proc
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(10)
    r = router.stub.Generate(tokens_req(first), timeout=30)
    assert r.served_by == "pod-a" and r.routing.reason == "retry_after_unavailable"
    chunks = list(router.stub.GenerateStream(tokens_req(second), timeout=30))
    assert chunks[-1].served_by == "pod-a"
    assert chunks[-1].routing.reason == "retry_after_unavailable"
    assert router.metric("pagekv_router_retries_total", {"pod": "pod-b"}) == 2
