"""The fleet's Redis ACL users (deploy/redis_acl.py) on a real redis-server: pods write the
index's keys and run its scripts, routers only read, the default user is off; then a pod and
a router as processes, each logged in as its own user, serve and route by prefix."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.deploy.redis_acl import POD, ROUTER, AclUser, acl_setuser
from pagekv.deploy.redis_server import RedisProcess
from pagekv.kvnode.pod.client import Client
from pagekv.proto.index import connect
from pagekv.proto.index.scripts import LOOKUP, RENEW_LEASE

pytestmark = pytest.mark.integration

POD_USER = AclUser("pagekv-pod", "pod-pw-81fd0c", POD)
ROUTER_USER = AclUser("pagekv-router", "router-pw-3e5a77", ROUTER)
# A refused login is final: redis-py would retry it 3 times with backoff (about 4 s a call).
NO_RETRY = Retry(NoBackoff(), 0)


@pytest.fixture
def server(redis_binary: str, tmp_path: Path) -> Iterator[RedisProcess]:
    with RedisProcess(data_dir=tmp_path / "redis", binary=redis_binary,
                      acl_users=[POD_USER, ROUTER_USER]) as proc:
        yield proc


def test_default_user_is_refused(server: RedisProcess) -> None:
    anonymous = redis.Redis(host=server.host, port=server.port, socket_timeout=2,
                            retry=NO_RETRY)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.get("pagekv:x")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host=server.host, port=server.port, username="default",
                    password="anything", socket_timeout=2, retry=NO_RETRY).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):  # a user's wrong password
        redis.Redis(host=server.host, port=server.port, username=POD_USER.name,
                    password="wrong", socket_timeout=2, retry=NO_RETRY).ping()


def test_pods_write_their_keys_and_nothing_else(server: RedisProcess) -> None:
    pod = connect(server.url_for(POD_USER.name), 2.0)
    assert pod.set("pagekv:probe", "1") and pod.get("pagekv:probe") == b"1"
    assert RENEW_LEASE.run(pod, ["pagekv:lease", "pagekv:pod"], ["e1", "1000"]) == 0
    for refused in (lambda: pod.flushall(), lambda: pod.flushdb(),
                    lambda: pod.config_get("maxmemory"), lambda: pod.keys("*"),
                    lambda: pod.set("other:probe", "1"),  # outside the index's keys
                    lambda: pod.acl_list()):
        with pytest.raises(redis.exceptions.NoPermissionError):
            refused()


def test_routers_only_read(server: RedisProcess) -> None:
    connect(server.url_for(POD_USER.name), 2.0).hset("pagekv:pod", mapping={"epoch": "e1"})
    router = connect(server.url_for(ROUTER_USER.name), 2.0)
    assert router.hgetall("pagekv:pod") == {b"epoch": b"e1"}
    assert LOOKUP.sha == router.script_load(LOOKUP.source)  # it may load and run scripts...
    for refused in (lambda: router.set("pagekv:probe", "1"),
                    lambda: router.delete("pagekv:pod"), lambda: router.flushall(),
                    lambda: router.config_get("maxmemory")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            refused()
    with pytest.raises(redis.exceptions.ResponseError, match="can't run this command"):
        RENEW_LEASE.run(router, ["pagekv:lease", "pagekv:pod"], ["e1", "1000"])  # ...no writes
    assert router.hgetall("pagekv:pod") == {b"epoch": b"e1"}


def test_acl_setuser_line_names_the_rules() -> None:
    line = acl_setuser(ROUTER_USER)
    assert line.startswith("ACL SETUSER pagekv-router on >router-pw-3e5a77 resetkeys ")
    assert "~pagekv:*" in line and "-@dangerous" in line and "+@write" not in line
    with pytest.raises(ValueError, match="role"):
        AclUser("x", "y", "admin")


def test_pod_and_router_each_with_its_own_user(server: RedisProcess, tmp_path: Path) -> None:
    """The router routes a repeated prompt to the pod that published it: the pod wrote its
    claims as the pod user, the router read them as the router user."""
    router_flags = ["--redis-url", server.url_for(ROUTER_USER.name), "--no-shared-bursts",
                    "--reap-dead-after-s", "0"]
    cluster = LocalCluster(nodes=1, run_dir=tmp_path / "run",
                           redis_url=server.url_for(POD_USER.name),
                           node_args=["--num-gpu-blocks", "64", "--max-model-len", "256"],
                           router_args=router_flags)
    cluster.start(timeout=90)
    try:
        prompt = list(range(1, 120))
        with Client(cluster.router.address, 60) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.generate(prompt, max_tokens=2)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            deadline = time.monotonic() + 10
            while True:  # until the pod's claims are published and read back
                again = client.generate(prompt, max_tokens=2)
                if again.routing.predicted_cached_tokens > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert again.routing.predicted_cached_tokens > 0 and again.usage.cached_tokens > 0
        # The pod wrote all it had to; the router never took a refused write for an outage.
        assert "no permissions" not in cluster.pods[0].log_path.read_text(errors="replace")
        assert "unreachable" not in cluster.router.log_path.read_text(errors="replace")
    finally:
        cluster.stop()
