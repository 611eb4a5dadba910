"""Integration fixtures: a real redis-server on a free loopback port, data in a tmp dir; the
router's in-process routers and fake pods."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from kvnode.pod.redis_server import RedisProcess, find_redis_server
from router.config import RouterConfig
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
