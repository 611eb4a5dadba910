"""Shared by the router's integration tests (tests/integration/test_router_*.py): the test
index schema and costs, an in-process router on an event loop thread (RouterHandle), request
helpers, and FakePod, a real gRPC server and IndexPublisher with no model. The pytest
fixtures that build these (loop, make_router, fake_pods) are in conftest.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagekv.kvnode.index.publisher import IndexPublisher
from pagekv.proto.hashing import HashConfig, hash_prompt
from pagekv.proto.index import IndexSchema
from pagekv.proto.kv_events import BlockStored
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.router.config import RouterConfig
from pagekv.router.scoring import CostModel
from pagekv.router.server import RouterServer

BS = 16
SEED = "vllm-none-hash"
SCHEMA = IndexSchema("pagekv-tiny", BS, "sha256", SEED)
# Queue nearly free: the tests check prefix decisions, not load balancing.
TEST_COSTS = CostModel(prefill_per_token=1e-3, cpu_per_token=6e-6, disk_per_token=3e-5,
                       queue_per_request=1e-4)


# -- an in-process router on a shared event loop thread ---------------------------------------

class RouterHandle:
    def __init__(self, lp: asyncio.AbstractEventLoop, config: RouterConfig) -> None:
        self.loop = lp
        self.server = RouterServer(config, host="127.0.0.1", port=0, http_port=0)
        self.port = self.call(self.server.start())
        self.http_url = f"http://127.0.0.1:{self.server.http_port}/v1"
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_pods(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.server.router.registry.eligible()) >= n:
                return
            time.sleep(0.05)
        raise TimeoutError(f"router sees {len(self.server.router.registry.eligible())} pods")

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.server.metrics.registry.get_sample_value(name, labels or {})
        return value or 0.0

    def close(self) -> None:
        self.channel.close()
        self.call(self.server.stop(0.2))


def tokens_req(ids: list[int], salt: str = "", max_tokens: int = 2) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), cache_salt=salt,
                              sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                         temperature=0.0, ignore_eos=True))


# -- real pods as processes ---------------------------------------------------------------------

@contextmanager
def pod_cluster(redis_binary: str, run_dir: Path, pod_args: list[str],
                pods: dict[str, list[str]]) -> Iterator[Any]:
    """A Redis and real pods (name -> its own extra flags) as processes, one torch thread
    each, healthy when this yields; all stopped after, or if any fails to start."""
    from pagekv.deploy.local_cluster import LocalCluster, wait_healthy
    from pagekv.deploy.redis_server import RedisProcess

    rp = RedisProcess(data_dir=run_dir / "redis", binary=redis_binary).start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # pods share two cores: no oversubscription
        cluster = LocalCluster(nodes=0, run_dir=run_dir, redis_url=rp.url,
                               node_args=pod_args, start_router=False)
        try:
            for name, extra in pods.items():
                cluster.start_pod(name, extra)
            for child in cluster.children:
                wait_healthy(child.address, 120, child.proc)
        except BaseException:
            cluster.stop()
            rp.close()
            raise
    try:
        yield cluster
    finally:
        cluster.stop()
        rp.close()


@contextmanager
def stopped(pod: Any) -> Iterator[None]:
    """The pod's process group stopped (as a hung host would be), resumed whatever happens."""
    os.killpg(pod.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(pod.proc.pid, signal.SIGCONT)


# -- fake pods: a real gRPC server and a real IndexPublisher, no model ------------------------

class FakePod(pb_grpc.GenerationServicer):
    """Caches every full block it is sent (in a dict) and publishes it like a pod does,
    `publish_delay_s` later (a slow publisher: the index lags what the pod holds)."""

    def __init__(self, pod_id: str, redis_url: str, schema: IndexSchema = SCHEMA,
                 publish_delay_s: float = 0.0) -> None:
        self.pod_id = pod_id
        self.schema = schema
        self.publish_delay_s = publish_delay_s
        self._timers: list[threading.Timer] = []
        self.mode = "ok"  # ok | unavailable | invalid | exhausted | slow
        self.calls = 0
        self.waiting = 0  # the load it publishes (a test makes it look saturated)
        self.kv_sources: list[pb.KvSource | None] = []  # each call's hint, failed calls too
        self.cancelled = threading.Event()
        self.state: dict[bytes, str] = {}
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(8))
        pb_grpc.add_GenerationServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()
        self.publisher = IndexPublisher(
            redis_url, schema, pod_id, self.address, schema.hash_config(),
            load_fn=lambda: {"waiting": self.waiting, "running": 0, "free_blocks": 100,
                             "num_blocks": 100},
            full_state_fn=self._snapshot, tier_costs_fn=lambda: {"prefill": 1e-3},
            lease_ttl_s=1.0)
        assert self.publisher.start()

    def _snapshot(self) -> dict[bytes, str]:
        with self._lock:
            return dict(self.state)

    def _serve(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.Usage:
        self.calls += 1
        self.kv_sources.append(request.kv_source if request.HasField("kv_source") else None)
        if self.mode == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.pod_id} is draining")
        if self.mode == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens=100000 exceeds room")
        if self.mode == "exhausted":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (8 requests)")
        ids = list(request.token_ids.ids)
        lora = (str(request.lora_id), "") if request.HasField("lora_id") else None
        cfg = HashConfig(self.schema.hash_algo, self.schema.hash_seed)
        hashes = hash_prompt(cfg, BS, ids, request.cache_salt or None, lora)
        with self._lock:
            hit = 0
            for h in hashes[:(len(ids) - 1) // BS]:
                if h not in self.state:
                    break
                hit += 1
            first = next((i for i, h in enumerate(hashes) if h not in self.state), None)
            new = [h for h in hashes if h not in self.state]
            self.state.update(dict.fromkeys(new, "GPU"))
        if new:  # with its parent link, as a pod's pool reports a run
            parent = hashes[first - 1] if first else None
            events = [BlockStored(new, parent, [], BS)]
            if self.publish_delay_s > 0:
                timer = threading.Timer(self.publish_delay_s, self.publisher.submit, [events])
                timer.daemon = True
                self._timers.append(timer)
                timer.start()
            else:
                self.publisher.submit(events)
        return pb.Usage(prompt_tokens=len(ids), completion_tokens=2, cached_tokens=hit * BS,
                        cached_tokens_gpu=hit * BS)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                 ) -> pb.GenerateResponse:
        usage = self._serve(request, context)
        return pb.GenerateResponse(request_id=request.request_id or "r", usage=usage,
                                   completions=[pb.Completion(index=0, token_ids=[1, 2])],
                                   served_by=self.pod_id)

    def GenerateStream(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                       ) -> Iterator[pb.GenerateChunk]:
        usage = self._serve(request, context)
        if self.mode == "slow":
            try:
                for _ in range(200):  # at most 10 s
                    if not context.is_active():
                        self.cancelled.set()
                        return
                    yield pb.GenerateChunk(index=0, token_ids=[7])
                    time.sleep(0.05)
            except GeneratorExit:  # grpc closed the stream at a yield: the call was cancelled
                self.cancelled.set()
                raise
        yield pb.GenerateChunk(index=0, token_ids=[1])
        yield pb.GenerateChunk(index=0, token_ids=[2], usage=usage, served_by=self.pod_id,
                               finish_reason=pb.FINISH_REASON_LENGTH)

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self.publisher.stop(clear=True)
        self.server.stop(0)

