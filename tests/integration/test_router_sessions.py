"""Session affinity through the router (real gRPC, real Redis, fake pods): a session's turns
go back to its pod even when their prompts share nothing the index could route by, move
once that pod publishes a saturated queue, and stay where they moved."""

from __future__ import annotations

import random
import time

import pytest

from tests.integration.router_fixtures import tokens_req

pytestmark = pytest.mark.integration


def turn(router, session: str, seed: int):
    rng = random.Random(seed)
    req = tokens_req([rng.randrange(256) for _ in range(40)])  # nothing shared between turns
    req.session_id = session
    return router.stub.Generate(req, timeout=30)


def wait_published(router, pod_id: str, waiting: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = router.server.router.registry.pods.get(pod_id)
        if entry is not None and entry.info.waiting == waiting:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{pod_id} never published waiting={waiting}")


def test_a_sessions_turns_follow_its_pod_until_it_saturates(redis_server, fake_pods,
                                                           make_router) -> None:
    router = make_router(redis_server.url, session_max_waiting=3)
    router.wait_pods(3)
    home = turn(router, "chat-1", 0).served_by
    for seed in range(1, 6):
        assert turn(router, "chat-1", seed).served_by == home
    others = {turn(router, f"other-{i}", 100 + i).served_by for i in range(8)}
    assert len(others) > 1  # without a session the same prompts spread over the pods
    pod = next(p for p in fake_pods if p.pod_id == home)
    pod.waiting = 3
    wait_published(router, home, 3)
    moved = turn(router, "chat-1", 50).served_by
    assert moved != home
    pod.waiting = 0
    wait_published(router, home, 0)
    assert turn(router, "chat-1", 51).served_by == moved  # the session went with it
    assert router.metric("pagekv_router_session_routes_total", {"outcome": "kept"}) == 6
    assert router.metric("pagekv_router_session_routes_total", {"outcome": "moved"}) == 1
    assert router.metric("pagekv_router_session_routes_total", {"outcome": "new"}) == 9
