"""Integration fixtures: a real redis-server on a free loopback port, data in a tmp dir."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvnode.pod.redis_server import RedisProcess, find_redis_server


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
