"""The router against a real Redis and in-process fake pods: the fault paths, fast and exact
(an unavailable pod retried elsewhere, client errors passed through, an empty prompt, a
cancelled stream, no live pods, Redis down and back, a misconfigured pod, a dead pod reaped).
The router runs in-process on its own event loop thread, so its log lines can be read with
caplog. Fixtures: conftest.py; helpers: router_fixtures.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
import redis

from pagekv.proto.index import count_pod_claims
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.router.server import STOP_STEP_TIMEOUT_S
from tests.integration.index_fixtures import claim_id_of, claims_by_id
from tests.integration.router_fixtures import SCHEMA, tokens_req

pytestmark = pytest.mark.integration


def test_unavailable_pod_is_retried_on_the_next_best(redis_server, fake_pods, make_router
                                                     ) -> None:
    router = make_router(redis_server.url, unavailable_cooldown_s=0.0)
    router.wait_pods(3)
    for i, call in enumerate((router.stub.Generate,
                              lambda r: list(router.stub.GenerateStream(r))[-1])):
        prompt = list(range(1 + i, 100 + i))  # held by one pod only: it is the first choice
        for pod in fake_pods:
            pod.mode = "ok"
        home = router.stub.Generate(tokens_req(prompt)).served_by
        next(p for p in fake_pods if p.pod_id == home).mode = "unavailable"
        resp = call(tokens_req(prompt))
        assert resp.served_by != home
        assert resp.routing.reason == "retry_after_unavailable"
    # Summed over the pods: both prompts may have the same home (cold placement by hash).
    assert sum(router.metric("pagekv_router_retries_total", {"pod": p.pod_id})
               for p in fake_pods) == 2
    pod = next(p for p in fake_pods if p.mode == "unavailable")
    home = pod.pod_id
    # With a cooldown, the failed pod is tried last for a while instead of first every time.
    router.server.router.config.unavailable_cooldown_s = 5.0
    for pod_ in fake_pods:
        pod_.mode = "unavailable" if pod_ is pod else "ok"
    served = []
    for i in range(6):  # cold prompts: without the cooldown, rotation would pick it again
        served.append(router.stub.Generate(tokens_req([i + 1] * 40)).served_by)
    assert home not in served


@pytest.mark.parametrize("mode, code, needle", [
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "exceeds room"),
    ("exhausted", grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
])
def test_client_errors_pass_through(redis_server, fake_pods, make_router, mode, code, needle
                                    ) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    for pod in fake_pods:
        pod.mode = mode
    for call in (router.stub.Generate, lambda r: list(router.stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as err:
            call(tokens_req(list(range(1, 50))))
        assert err.value.code() == code and needle in err.value.details()
    assert sum(p.calls for p in fake_pods) == 2  # no retry for the client's own errors


def test_router_rejects_an_empty_prompt(redis_server, fake_pods, make_router) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    with pytest.raises(grpc.RpcError) as err:
        router.stub.Generate(pb.GenerateRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sum(p.calls for p in fake_pods) == 0


def test_cancelling_a_stream_cancels_the_pod_call(redis_server, fake_pods, make_router
                                                  ) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    for pod in fake_pods:
        pod.mode = "slow"
    call = router.stub.GenerateStream(tokens_req(list(range(1, 40))))
    next(call)
    call.cancel()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(p.cancelled.is_set() for p in fake_pods):
        time.sleep(0.05)
    assert any(p.cancelled.is_set() for p in fake_pods)
    assert router.metric("pagekv_router_inflight_requests") == 0


def test_no_live_pods_is_unavailable_with_a_reason(redis_server, make_router) -> None:
    router = make_router(redis_server.url)
    router.call(router.server.wait_ready(5))
    with pytest.raises(grpc.RpcError) as err:
        router.stub.Generate(tokens_req([1, 2, 3]))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no live pods" in err.value.details() and SCHEMA.namespace in err.value.details()


def test_redis_down_routes_by_load_then_recovers(redis_server, fake_pods, make_router,
                                                 caplog) -> None:
    router = make_router(redis_server.url)
    router.wait_pods(3)
    prompt = list(range(1, 100))
    router.stub.Generate(tokens_req(prompt))
    with caplog.at_level(logging.WARNING, logger="pagekv.router.pods"):
        redis_server.stop()
        served = set()
        for i in range(9):
            resp = router.stub.Generate(tokens_req(prompt + [i]))
            served.add(resp.served_by)
            if i == 0:
                time.sleep(0.3)  # the refresh loop notices too
        assert resp.routing.reason == "index_down_least_loaded"
        assert served == {"fake-a", "fake-b", "fake-c"}  # spread, not stuck
        assert router.metric("pagekv_router_fallback_routes_total", {"cause": "index_down"}) > 0
        assert router.metric("pagekv_router_index_up") == 0
        down = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down) == 1, [r.getMessage() for r in down]  # once per outage
        redis_server.start()  # same port, empty: the pods republish
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and router.metric("pagekv_router_index_up") < 1:
            time.sleep(0.1)
        assert router.metric("pagekv_router_index_up") == 1
    for pod in fake_pods:
        assert pod.publisher.flush(5)
    fresh = list(range(300, 400))
    first = router.stub.Generate(tokens_req(fresh))
    time.sleep(0.3)
    resp = router.stub.Generate(tokens_req(fresh))
    assert resp.routing.reason in ("prefix_hit", "burst_prediction")
    assert resp.served_by == first.served_by and resp.usage.cached_tokens == 96
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_mismatched_pod_config_is_refused_once(redis_server, fake_pods, make_router,
                                               caplog) -> None:
    # A pod whose registration claims another seed inside our namespace (a misconfigured
    # publisher): never routed to, one warning naming the difference.
    client = redis.Redis.from_url(redis_server.url)
    client.hset(SCHEMA.pod_key("fake-c"), "cfg.hash_seed", "other-seed")
    with caplog.at_level(logging.WARNING, logger="pagekv.router.pods"):
        router = make_router(redis_server.url)
        router.wait_pods(2)
        for i in range(6):
            resp = router.stub.Generate(tokens_req(list(range(i, i + 60))))
            assert resp.served_by != "fake-c"
        time.sleep(0.3)  # several refreshes
    warnings = [r.getMessage() for r in caplog.records if "fake-c" in r.getMessage()]
    assert len(warnings) == 1 and "hash_seed differs" in warnings[0]
    c = next(c for c in resp.routing.candidates if c.pod_id == "fake-c")
    assert not c.eligible and "hash_seed" in c.excluded_reason


def test_dead_pod_is_reaped_from_the_index(redis_server, fake_pods, make_router,
                                           caplog) -> None:
    client = redis.Redis.from_url(redis_server.url)
    router = make_router(redis_server.url, reap_dead_after_s=0.5)
    router.wait_pods(3)
    for i in range(6):  # spread some prefixes over the pods
        router.stub.Generate(tokens_req(list(range(i * 50, i * 50 + 48))))
    for pod in fake_pods:
        assert pod.publisher.flush(5)
    crashed = fake_pods[0]
    claim_id = claim_id_of(client, crashed.pod_id, SCHEMA)
    claims = count_pod_claims(client, SCHEMA, crashed.pod_id)
    assert claims > 0
    with caplog.at_level(logging.WARNING, logger="pagekv.router.pods"):
        crashed.publisher.stop(clear=False)  # a crash: its keys stay, its lease runs out
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and client.sismember(SCHEMA.pods_key,
                                                               crashed.pod_id):
            time.sleep(0.1)
    assert not client.exists(SCHEMA.pod_key(crashed.pod_id),
                             SCHEMA.pod_buckets_key(crashed.pod_id),
                             SCHEMA.pod_claim_ids_key(crashed.pod_id))
    assert claim_id and claim_id not in claims_by_id(client, SCHEMA)  # every claim of it stripped
    assert not client.hexists(SCHEMA.claim_ids_key, claim_id.hex())  # its id released
    assert count_pod_claims(client, SCHEMA, fake_pods[1].pod_id) > 0  # the others stay
    assert router.metric("pagekv_router_reaped_pods_total") == 1
    assert router.metric("pagekv_router_reaped_claims_total") == claims
    lines = [r.getMessage() for r in caplog.records if "no lease" in r.getMessage()]
    assert len(lines) == 1 and f"removed its {claims} block claims" in lines[0]


def test_stop_returns_when_a_server_will_not_drain(redis_server, make_router, caplog) -> None:
    """The HTTP server's drain never ends: stop() still returns, within its bound, says so."""
    router = make_router(redis_server.url)
    http = router.server.http
    assert http is not None
    drained = http.stop

    async def never_drains(grace: float) -> None:
        await drained(grace)  # the server itself stops; its drain is what never ends
        await asyncio.Event().wait()

    http.stop = never_drains  # type: ignore[method-assign]
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pagekv.router.server"):
        router.call(router.server.stop(0.2), timeout=0.2 + STOP_STEP_TIMEOUT_S + 20)
    assert time.monotonic() - t0 < 0.2 + STOP_STEP_TIMEOUT_S + 10
    assert "the servers' drain did not end" in caplog.text


def test_stop_returns_when_a_step_swallows_its_cancellation(redis_server, make_router,
                                                            caplog) -> None:
    """A clean-up step that ignores being cancelled (as a Redis read mid-command can) is left
    behind after its bound: stop() returns and the next steps still run."""
    router = make_router(redis_server.url)
    registry = router.server.router.registry
    closed = registry.close
    swallowed = 0

    async def stubborn_close() -> None:
        nonlocal swallowed
        while swallowed < 3:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
        await closed()

    registry.close = stubborn_close  # type: ignore[method-assign]
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pagekv.router.server"):
        router.call(router.server.stop(0.2), timeout=0.2 + 4 * STOP_STEP_TIMEOUT_S + 20)
    assert time.monotonic() - t0 < 0.2 + 4 * STOP_STEP_TIMEOUT_S + 10
    assert "closing the pod registry did not end" in caplog.text
    assert swallowed >= 1  # it was cancelled, and went on ignoring it



def test_a_second_router_on_the_same_port_is_refused(redis_server, make_router, loop) -> None:
    """gRPC binds with SO_REUSEPORT unless told not to: a second router then shared the
    first's port (and its clients) without an error."""
    from pagekv.router.config import RouterConfig
    from pagekv.router.server import RouterServer

    first = make_router(redis_server.url)
    second = RouterServer(RouterConfig(redis_url=redis_server.url), host="127.0.0.1",
                          port=first.port)
    with pytest.raises(RuntimeError, match=f"could not bind 127.0.0.1:{first.port}"):
        asyncio.run_coroutine_threadsafe(second.start(), loop).result(30)
    asyncio.run_coroutine_threadsafe(second.stop(0), loop).result(30)
    # `pagekv router` says so in one line, exit 2.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pagekv", "router", "--host", "127.0.0.1",
                           "--port", str(first.port), "--redis-url", redis_server.url],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"router cannot start: could not bind 127.0.0.1:{first.port}" in done.stderr
