"""A pod as a real process: gRPC Generate/GenerateStream, errors, metrics, the Redis index."""

from __future__ import annotations

import contextlib
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.deploy.redis_server import RedisProcess
from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.index import (
    IndexSchema,
    PodMatch,
    count_pod_claims,
    list_live_pods,
    lookup_prefix,
)
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

POD_ARGS = ["--num-gpu-blocks", "64", "--max-model-len", "512", "--lease-ttl-s", "1.5",
            "--max-queue", "8"]
SCHEMA = IndexSchema("pagekv-tiny", 16, "sha256", "vllm-none-hash")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pod-run")
    with LocalCluster(nodes=1, run_dir=run_dir, node_args=POD_ARGS, start_router=False) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.pods[0].address) as ch:
        yield pb_grpc.GenerationStub(ch), pb_grpc.KVNodeStub(ch)


@pytest.fixture(scope="module")
def rclient(cluster):
    return redis.Redis.from_url(cluster.redis_url)


def greedy(max_tokens=8):
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_generate_and_stream_equal_offline(stub):
    gen, _ = stub
    llm = LLM("pagekv-tiny", num_gpu_blocks=64, max_model_len=512)
    prompts = [list(range(1, 30)), [7, 8, 9]]
    want = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, w in zip(prompts, want, strict=True):
        resp = gen.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                               sampling=greedy()))
        assert list(resp.completions[0].token_ids) == w.outputs[0].token_ids
        assert resp.served_by == "node-a"
        assert resp.usage.prompt_tokens == len(prompt) and resp.usage.completion_tokens == 8
        assert resp.completions[0].finish_reason == pb.FINISH_REASON_LENGTH
        chunks = list(gen.GenerateStream(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                            sampling=greedy())))
        streamed = [t for c in chunks for t in c.token_ids]
        assert streamed == w.outputs[0].token_ids
        assert chunks[-1].served_by == "node-a" and chunks[-1].usage.completion_tokens == 8
    text = llm.generate(["hello pod"], SamplingParams(max_tokens=5, temperature=0,
                                                      ignore_eos=True))[0].outputs[0]
    resp = gen.Generate(pb.GenerateRequest(text="hello pod", sampling=greedy(5)))
    assert list(resp.completions[0].token_ids) == text.token_ids
    assert resp.completions[0].text == text.text


def test_index_holds_exactly_the_prompt_blocks_at_gpu(stub, rclient):
    gen, kv = stub
    assert kv.ResetPrefixCache(pb.ResetPrefixCacheRequest()).success
    deadline = time.time() + 5  # the clear reaches Redis asynchronously, like every event
    while time.time() < deadline and count_pod_claims(rclient, SCHEMA, "node-a"):
        time.sleep(0.05)
    assert count_pod_claims(rclient, SCHEMA, "node-a") == 0
    prompt = [100 + i for i in range(40)]  # 2 full blocks; 40 + 3 computed tokens stay < 48
    resp = gen.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                           sampling=greedy(4)))
    assert resp.usage.cached_tokens == 0
    hashes = hash_prompt(HashConfig("sha256", "vllm-none-hash"), 16, prompt)
    assert len(hashes) == 2
    deadline = time.time() + 5
    while time.time() < deadline and lookup_prefix(rclient, SCHEMA, hashes)["node-a"].depth < 2:
        time.sleep(0.05)
    match = lookup_prefix(rclient, SCHEMA, hashes)["node-a"]
    assert match == PodMatch(2, ["GPU", "GPU"])
    assert count_pod_claims(rclient, SCHEMA, "node-a") == 2
    again = gen.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                            sampling=greedy(4)))
    assert again.usage.cached_tokens == 32 and again.usage.cached_tokens_gpu == 32
    assert list(again.completions[0].token_ids) == list(resp.completions[0].token_ids)


@pytest.mark.parametrize("request_kwargs, needle", [
    ({"text": ""}, "empty"),
    ({"token_ids": pb.TokenIds(ids=[])}, "empty"),
    ({"token_ids": pb.TokenIds(ids=[1, 99999])}, "vocabulary"),
    ({"text": "hi", "sampling": pb.SamplingParams(max_tokens=100000)}, "max_tokens"),
    ({"text": "hi", "sampling": pb.SamplingParams(n=0, max_tokens=2, temperature=-1.0)},
     "temperature"),
    ({"text": "hi", "sampling": pb.SamplingParams(n=1000, max_tokens=2)}, "max_n"),
    ({}, "prompt is required"),
])
def test_bad_inputs_invalid_argument(stub, request_kwargs, needle):
    gen, _ = stub
    for call in (gen.Generate, lambda r: list(gen.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as err:
            call(pb.GenerateRequest(**request_kwargs))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details()
    ok = gen.Generate(pb.GenerateRequest(text="still serving", sampling=greedy(2)))
    assert len(ok.completions[0].token_ids) == 2


def test_n_zero_means_one(stub):
    gen, _ = stub
    resp = gen.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(
        n=0, max_tokens=2, temperature=0.0)))
    assert len(resp.completions) == 1


def test_cancelled_stream_frees_blocks(stub):
    gen, kv = stub
    free0 = kv.Stats(pb.StatsRequest()).num_free_blocks
    call = gen.GenerateStream(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=list(range(1, 100))), sampling=greedy(400)))
    next(iter(call))
    call.cancel()
    deadline = time.time() + 5
    while time.time() < deadline:
        st = kv.Stats(pb.StatsRequest())
        if st.num_running == 0 and st.num_free_blocks == free0:
            break
        time.sleep(0.05)
    assert st.num_running == 0 and st.num_free_blocks == free0


def test_full_queue_resource_exhausted(stub):
    gen, _ = stub
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=greedy(120))
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(gen.Generate, req, timeout=120) for _ in range(16)]
        codes = []
        for f in futures:
            try:
                f.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert grpc.StatusCode.OK in codes


def test_metrics_parse_and_carry_tier_hits(cluster, stub):
    gen, _ = stub
    prompt = list(range(1, 40))
    for _ in range(2):
        gen.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=greedy(2)))
    url = f"http://127.0.0.1:{cluster.pods[0].metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    hits = {s.labels["tier"]: s.value for s in families["pagekv_prefix_cache_hits_tokens"].samples
            if s.name.endswith("_total")}
    assert hits["GPU"] >= 32 and "CPU" in hits and "DISK" in hits
    for name in ("pagekv_time_to_first_token_seconds", "pagekv_inter_token_latency_seconds",
                 "pagekv_kv_cache_usage_ratio", "pagekv_kv_block_lifetime_seconds",
                 "pagekv_num_requests_waiting", "pagekv_requests"):
        assert name in families, name


def test_redis_restart_then_index_whole_again(tmp_path):
    """Redis goes away mid-run: requests keep succeeding; after it returns, the pod
    republishes its full state."""
    rp = RedisProcess(data_dir=tmp_path / "r").start()
    cluster = LocalCluster(nodes=1, run_dir=tmp_path, redis_url=rp.url, node_args=POD_ARGS,
                           start_router=False).start()
    try:
        with grpc.insecure_channel(cluster.pods[0].address) as ch:
            gen = pb_grpc.GenerationStub(ch)
            p1, p2 = [200 + i for i in range(33)], [150 + i for i in range(33)]
            gen.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=p1), sampling=greedy(2)))
            rp.stop()
            resp = gen.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=p2),
                                                   sampling=greedy(2)))
            assert len(resp.completions[0].token_ids) == 2
            rp.start()  # same port, empty: everything must be republished
            client = redis.Redis.from_url(rp.url)
            cfg = HashConfig("sha256", "vllm-none-hash")
            deadline = time.time() + 15
            depths = {}
            while time.time() < deadline:
                try:
                    depths = {tuple(p): lookup_prefix(client, SCHEMA, hash_prompt(cfg, 16, p))
                              .get("node-a") for p in (p1, p2)}
                    if all(m is not None and m.depth == 2 for m in depths.values()):
                        break
                except redis.RedisError:
                    pass
                time.sleep(0.2)
            assert all(m is not None and m.depth == 2 for m in depths.values()), depths
    finally:
        cluster.stop()
        rp.close()


def test_killed_pod_lease_expires(tmp_path):
    rp = RedisProcess(data_dir=tmp_path / "r").start()
    cluster = LocalCluster(nodes=1, run_dir=tmp_path, redis_url=rp.url, node_args=POD_ARGS,
                           start_router=False).start()
    try:
        client = redis.Redis.from_url(rp.url)
        prompt = [60 + i for i in range(33)]
        with grpc.insecure_channel(cluster.pods[0].address) as ch:
            pb_grpc.GenerationStub(ch).Generate(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=greedy(2)))
        hashes = hash_prompt(HashConfig("sha256", "vllm-none-hash"), 16, prompt)
        deadline = time.time() + 5
        while time.time() < deadline and getattr(
                lookup_prefix(client, SCHEMA, hashes).get("node-a"), "depth", 0) < 2:
            time.sleep(0.05)
        assert lookup_prefix(client, SCHEMA, hashes)["node-a"].depth == 2
        cluster.pods[0].proc.kill()  # no chance to clean up: only the lease can expire
        cluster.pods[0].proc.wait(5)
        deadline = time.time() + 10
        while time.time() < deadline and "node-a" in lookup_prefix(client, SCHEMA, hashes):
            time.sleep(0.1)
        assert "node-a" not in lookup_prefix(client, SCHEMA, hashes)
        assert all(p.pod_id != "node-a" for p in list_live_pods(client, SCHEMA))
    finally:
        cluster.stop()
        rp.close()


def test_sigterm_drains_in_flight_requests(tmp_path):
    cluster = LocalCluster(nodes=1, run_dir=tmp_path, node_args=POD_ARGS,
                           start_router=False).start()
    try:
        pod = cluster.pods[0]
        with grpc.insecure_channel(pod.address) as ch:
            stream = pb_grpc.GenerationStub(ch).GenerateStream(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=greedy(200)))
            chunks = [next(stream)]
            pod.proc.send_signal(signal.SIGTERM)  # mid-stream
            chunks.extend(stream)
        assert sum(len(c.token_ids) for c in chunks) == 200
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert pod.proc.wait(30) == 0
        assert "draining in-flight requests" in pod.log_tail(50)
    finally:
        cluster.stop()


def test_sigterm_while_still_starting_drains_accepted_requests(tmp_path):
    """The engine takes requests before the index's first sync ends (health is still
    NOT_SERVING): a SIGTERM in that window must drain them, not cut them off."""
    import socket
    import threading
    silent = socket.socket()  # a "Redis" that accepts connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    conns: list[socket.socket] = []

    def accept_all():
        with contextlib.suppress(OSError):
            while True:
                conns.append(silent.accept()[0])
    threading.Thread(target=accept_all, daemon=True).start()
    cluster = LocalCluster(nodes=1, run_dir=tmp_path, start_router=False,
                           redis_url=f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
    try:
        # A long answer: leaving the unreachable index takes a second before gRPC stops.
        pod = cluster.start_pod("node-a", [*POD_ARGS, "--max-model-len", "1024",
                                           "--num-gpu-blocks", "80", "--drain-timeout-s", "120"])
        deadline = time.time() + 60
        with grpc.insecure_channel(pod.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            while True:
                stream = stub.GenerateStream(pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=greedy(800)),
                    wait_for_ready=True, timeout=60)
                try:
                    chunks = [next(stream)]
                    break
                except grpc.RpcError as e:  # "pod is starting": the engine is not built yet
                    assert e.code() == grpc.StatusCode.UNAVAILABLE and time.time() < deadline
                    time.sleep(0.05)
            pod.proc.send_signal(signal.SIGTERM)
            silent.close()  # the index goes away: leaving it does not hold the stop up
            for conn in conns:
                conn.close()
            chunks.extend(stream)
        assert sum(len(c.token_ids) for c in chunks) == 800
        assert pod.proc.wait(30) == 0
        assert "finishing start, then draining" in pod.log_tail(50)
    finally:
        cluster.stop()
        silent.close()
