"""The fleet's Redis ACL users (deploy/redis_acl.py) on a real redis-server: pods write the
index's keys and run its scripts, routers only read, the default user is off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pagekv.deploy.redis_acl import POD, ROUTER, AclUser, acl_setuser
from pagekv.deploy.redis_server import RedisProcess
from pagekv.proto.index import connect
from pagekv.proto.index.scripts import LOOKUP, RENEW_LEASE

pytestmark = pytest.mark.integration

POD_USER = AclUser("pagekv-pod", "pod-pw-81fd0c", POD)
ROUTER_USER = AclUser("pagekv-router", "router-pw-3e5a77", ROUTER)


@pytest.fixture
def server(redis_binary: str, tmp_path: Path) -> Iterator[RedisProcess]:
    with RedisProcess(data_dir=tmp_path / "redis", binary=redis_binary,
                      acl_users=[POD_USER, ROUTER_USER]) as proc:
        yield proc


def test_default_user_is_refused(server: RedisProcess) -> None:
    anonymous = redis.Redis(host=server.host, port=server.port, socket_timeout=2)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.get("pagekv:x")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host=server.host, port=server.port, username="default",
                    password="anything", socket_timeout=2).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):  # a user's wrong password
        redis.Redis(host=server.host, port=server.port, username=POD_USER.name,
                    password="wrong", socket_timeout=2).ping()


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
