"""End to end with real processes: a PageKV pod publishing its KV events in vLLM's format
(`pagekv node --kv-events-zmq`, int hashes: the ingester recomputes every full hash) and
`pagekv ingest-vllm` writing them into Redis. The pod also publishes to Redis itself under
its own id, so the ingested claims can be compared with what its own publisher wrote: the
same block hashes, in the same tiers (a small pool and a DRAM tier make it demote).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import urllib.request

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import pagekv_cmd, spawn, stop_child, wait_healthy
from pagekv.deploy.redis_server import free_port
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from tests.integration.vllm_fixtures import SCHEMA, pod_claims, wait_for

pytestmark = pytest.mark.integration

POD_ARGS = ["--num-gpu-blocks", "24", "--cpu-offload-bytes", "8MiB", "--max-model-len", "256",
            "--num-threads", "2", "--lease-ttl-s", "1.5"]


def metrics(port: int) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, s.labels.get("reason") or s.labels.get("result") or "")] = s.value
    return out


def generate(stub: pb_grpc.GenerationStub, first: int, n: int) -> None:
    for i in range(first, first + n):  # distinct prompts of 3 full blocks (a 258-token vocab)
        prompt = [(i * 37 + j) % 250 + 1 for j in range(16 * 3 + 5)]
        stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.
                                         SamplingParams(max_tokens=4, temperature=0.0)),
                      timeout=60)


def test_pod_events_through_the_ingester_equal_the_pods_own_claims(redis_server, tmp_path
                                                                   ) -> None:
    grpc_port, zmq_port, replay_port, http_port, mport, pod_mport = (
        free_port() for _ in range(6))
    pod = spawn("pod", pagekv_cmd(
        "node", "--model", SCHEMA.model, "--host", "127.0.0.1", "--port", str(grpc_port),
        "--http-port", str(http_port), "--metrics-port", str(pod_mport), "--pod-id", "pod-self",
        "--redis-url", redis_server.url,
        "--kv-events-zmq", f"tcp://127.0.0.1:{zmq_port}",
        "--kv-events-replay-zmq", f"tcp://127.0.0.1:{replay_port}", *POD_ARGS), tmp_path)
    ingester = None
    rclient = redis.Redis.from_url(redis_server.url)
    try:
        wait_healthy(f"127.0.0.1:{grpc_port}", proc=pod.proc)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            generate(stub, 1, 3)  # before the ingester: it learns them from the replay
            ingester = spawn("ingest", pagekv_cmd(
                "ingest-vllm", "--zmq-endpoint", f"tcp://127.0.0.1:{zmq_port}",
                "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}", "--pod-id", "pod-zmq",
                "--openai-address", f"127.0.0.1:{http_port}", "--model", SCHEMA.model,
                "--block-size", str(SCHEMA.block_size), "--redis-url", redis_server.url,
                "--metrics-port", str(mport), "--lease-ttl-s", "1.5"), tmp_path)
            wait_for(lambda: rclient.exists(SCHEMA.lease_key("pod-zmq")), 30, "the ingester")
            generate(stub, 10, 8)  # more than the pool holds: blocks demote to DRAM
        own = wait_for(lambda: pod_claims(rclient, SCHEMA, "pod-self"), what="own claims")

        def same() -> bool:
            # Settled first: the ingester has applied the pod's last batch and both
            # publishers have written all they were handed (before that, both may still show
            # the state from before the last prompts, and look alike).
            pod_m, ing_m = metrics(pod_mport), metrics(mport)
            if (ing_m[("pagekv_ingest_last_seq", "")]
                    != pod_m[("pagekv_kv_events_zmq_seq", "")] - 1):
                return False
            if any(m[("pagekv_index_visible_seq", "")] != m[("pagekv_index_seq", "")]
                   for m in (pod_m, ing_m)):
                return False
            ingested = pod_claims(rclient, SCHEMA, "pod-zmq")
            return (ingested == pod_claims(rclient, SCHEMA, "pod-self")
                    and ing_m[("pagekv_ingest_indexed_blocks", "")] == len(ingested))

        wait_for(same, 20, "the ingested claims to equal the pod's own")
        own = pod_claims(rclient, SCHEMA, "pod-self")
        assert "C" in "".join(own.values()) and "G" in "".join(own.values())
        m = metrics(mport)
        assert m[("pagekv_ingest_batches_total", "")] >= 11  # a prefill per prompt, at least
        assert m[("pagekv_ingest_garbage_frames_total", "")] == 0
        refused = {k[1]: v for k, v in m.items() if k[0] == "pagekv_ingest_refused_events_total"}
        assert refused and not any(refused.values()), refused
        assert m[("pagekv_ingest_indexed_blocks", "")] == len(own)
        pod_m = metrics(pod_mport)
        assert pod_m[("pagekv_kv_events_zmq_published_total", "")] >= 11
        assert pod_m[("pagekv_kv_events_zmq_dropped_total", "")] == 0
        assert pod_m[("pagekv_kv_events_zmq_replays_served_total", "")] >= 1  # the join
        promtool = shutil.which("promtool")
        assert promtool, "promtool not found: apt-get install -y prometheus"
        for port in (mport, pod_mport):
            page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            r = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True,
                               timeout=30)
            assert r.returncode == 0, r.stdout + r.stderr
        # A clean stop removes what it wrote, and only that.
        ingester.proc.send_signal(signal.SIGTERM)
        assert ingester.proc.wait(15) == 0
        assert pod_claims(rclient, SCHEMA, "pod-zmq") == {}
        assert not rclient.sismember(SCHEMA.pods_key, "pod-zmq")
        assert pod_claims(rclient, SCHEMA, "pod-self") == own
    finally:
        if ingester is not None:
            stop_child(ingester)
        stop_child(pod)
