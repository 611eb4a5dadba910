"""P/D faults with real processes (issue #29): two prefill pods, two decode pods, the router.

Each fault ends in the cold run's tokens (a mixed pod outside the fleet computes them) and
is counted by its reason: a handover past its deadline (the prefill pod stopped) falls back
to recompute and the prefill pod's hold expires; a decode pod lost fails over to the other
one, which still pulls from the prefill pod; a prefill pod lost before the handover makes
the router try the other; a prefill pod lost after its prefill leaves the decode pod to
recompute; with no prefill pod left the decode pod computes the prompt itself. Nothing
stays pinned on the pods left. The tests run in order: each kills what the next no longer
needs. A router with the measured threshold checks it is the decode pod's published one.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator

import pytest
import redis

from pagekv.deploy.local_cluster import Child, LocalCluster, stop_child, wait_healthy
from pagekv.proto.index import IndexSchema
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from tests.integration.pd_fixtures import (
    completions,
    generate,
    idle_and_unpinned,
    metrics,
    request,
    start_reference,
    stats,
    value,
    wait_for,
    wait_indexed,
    wait_router_sees,
)

pytestmark = pytest.mark.integration

BS = 16
COMMON = ["--max-model-len", "512", "--num-threads", "1", "--num-gpu-blocks", "96"]
PULL_DEADLINE_S = 1.5
HOLD_MS = 2500
FULL = (300 - 1) // BS * BS  # what a 300-token prompt's handover carries


def tokens(name: str, n: int) -> list[int]:
    rng = random.Random(name)
    return [rng.randrange(1, 251) for _ in range(n)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[dict[str, Child | str]]:
    tmp = tmp_path_factory.mktemp("pd-faults")
    c = LocalCluster(nodes=0, run_dir=tmp, start_router=False)
    c.start()
    ref = None
    try:
        # Prefill pods' leases outlive the kills below by far: the router still lists a
        # killed one when the next request comes (what a crash looks like until it expires).
        out: dict[str, Child | str] = {
            name: c.start_pod(name, [*COMMON, "--role", "prefill", "--lease-ttl-s", "15"])
            for name in ("pre-1", "pre-2")}
        out |= {name: c.start_pod(name, [*COMMON, "--role", "decode",
                                         "--kv-pull-deadline-s", str(PULL_DEADLINE_S)])
                for name in ("dec-1", "dec-2")}
        ref = start_reference(tmp, COMMON)
        for pod in list(out.values()):
            assert isinstance(pod, Child)
            wait_healthy(pod.target(), 120, pod.proc)
        router = c.start_router_process("router", ["--pd-threshold-tokens", "64",
                                                   "--pd-hold-ms", str(HOLD_MS)])
        measured = c.start_router_process("router-measured", ["--pd-threshold-tokens", "0"])
        for r in (router, measured):
            wait_healthy(r.target(), 60, r.proc)
            wait_router_sees(r, 4)
        assert c.redis_url is not None
        out |= {"router": router, "measured": measured, "ref": ref, "redis": c.redis_url}
        yield out
    finally:
        if ref is not None:
            stop_child(ref)
        c.stop()


def pod(fleet, name: str) -> Child:
    child = fleet[name]
    assert isinstance(child, Child)
    return child


def reference(fleet, prompt: list[int]) -> dict[int, list[int]]:
    return completions(generate(pod(fleet, "ref").target(), request(prompt)))


def published_budget(fleet, pod_id: str) -> int:
    client = redis.Redis.from_url(str(fleet["redis"]))
    try:
        key = IndexSchema("pagekv-tiny", BS, "sha256", "vllm-none-hash").pod_key(pod_id)
        return int(float(client.hget(key, "load.prefill_budget") or 0))
    finally:
        client.close()


def prefill_held(pre: Child, prompt: list[int], handover_id: str) -> pb.GenerateRequest:
    """Prefill `prompt` on `pre` as the router's prefill half does (held under
    `handover_id`) and return the decode half that names the hold."""
    prefill = request(prompt, 1)
    prefill.request_id = handover_id
    prefill.handover.hold_ms = HOLD_MS
    generate(pre.target(), prefill)
    decode = request(prompt)
    decode.kv_source.CopyFrom(pb.KvSource(pod_id=pre.name, address=pre.target(),
                                          num_blocks=len(prompt) // BS,
                                          handover_id=handover_id))
    return decode


def test_the_threshold_is_the_decode_pods_measured_budget(fleet):
    for name in ("dec-1", "dec-2"):  # a prefill-heavy step and decode-only steps, timed
        generate(pod(fleet, name).target(), request(tokens(f"warm-{name}", 300), 24))
    for name in ("dec-1", "dec-2"):
        wait_for(lambda name=name: published_budget(fleet, name) > 0,
                 f"{name} publishes its prefill budget", 20)
    probe = request(tokens("probe", 40), 1)  # too short to time: the budgets stay put
    measured = pod(fleet, "measured").target()

    def reads_the_budget() -> bool:
        got = generate(measured, probe)
        assert got.routing.chosen_pod in ("dec-1", "dec-2")  # never a prefill pod here
        return got.routing.pd_threshold_tokens == max(
            BS, published_budget(fleet, got.routing.chosen_pod))
    # The router reads the published budgets at its registry's refresh.
    wait_for(reads_the_budget, "the router splits at the decode pod's published budget", 10)
    got = generate(measured, probe)
    assert BS <= got.routing.pd_threshold_tokens <= 2048


def test_a_handover_past_its_deadline_falls_back_and_the_hold_expires(fleet):
    pre, dec = pod(fleet, "pre-2"), pod(fleet, "dec-2")
    prompt = tokens("deadline", 300)
    decode = prefill_held(pre, prompt, "pd-deadline")
    assert stats(pre).handover_held_blocks == 300 // BS
    os.kill(pre.proc.pid, signal.SIGSTOP)
    try:
        got = generate(dec.target(), decode)
    finally:
        os.kill(pre.proc.pid, signal.SIGCONT)
    assert completions(got) == reference(fleet, prompt)
    assert got.usage.kv_pull_fallback == "deadline" and got.usage.cached_tokens_peer == 0
    assert got.usage.kv_pull_ms >= PULL_DEADLINE_S * 1e3 * 0.9
    wait_for(lambda: stats(pre).handover_held_blocks == 0, "the unpulled hold expired", 20)
    assert value(metrics(pre), "pagekv_handover_holds_total", outcome="expired") >= 1
    assert value(metrics(dec), "pagekv_handover_fallbacks_total", reason="deadline") == 1


def test_a_lost_decode_pod_fails_over_and_the_other_one_pulls(fleet):
    dec1, router = pod(fleet, "dec-1"), pod(fleet, "router")
    head = tokens("decode-lost", 200)
    generate(dec1.target(), request(head))  # dec-1 holds the head: the router's first choice
    wait_indexed(str(fleet["redis"]), BS, head, "dec-1", 199 // BS)
    os.killpg(dec1.proc.pid, signal.SIGKILL)
    dec1.proc.wait(10)
    prompt = head + tokens("decode-lost-tail", 100)
    got = generate(router.target(), request(prompt))
    assert completions(got) == reference(fleet, prompt)
    assert got.routing.chosen_pod == "dec-2" and got.routing.prefill_pod.startswith("pre-")
    assert got.routing.reason == "retry_after_unavailable"
    assert got.usage.cached_tokens_peer == FULL and got.routing.pd_fallback == ""
    assert value(metrics(router), "pagekv_router_retries_total", pod="dec-1") >= 1


def test_a_lost_prefill_pod_makes_the_router_try_the_other(fleet):
    pre1, router = pod(fleet, "pre-1"), pod(fleet, "router")
    head = tokens("prefill-lost", 200)
    generate(pre1.target(), request(head))  # pre-1 holds the head: the first prefill pod
    wait_indexed(str(fleet["redis"]), BS, head, "pre-1", 199 // BS)
    os.killpg(pre1.proc.pid, signal.SIGKILL)
    pre1.proc.wait(10)
    prompt = head + tokens("prefill-lost-tail", 100)
    got = generate(router.target(), request(prompt))
    assert completions(got) == reference(fleet, prompt)
    assert got.routing.prefill_pod == "pre-2" and got.routing.chosen_pod == "dec-2"
    assert got.usage.cached_tokens_peer == FULL and got.routing.pd_fallback == ""
    assert value(metrics(router), "pagekv_router_retries_total", pod="pre-1") >= 1


def test_a_prefill_pod_lost_after_its_prefill_leaves_the_decode_pod_to_recompute(fleet):
    pre2, dec2 = pod(fleet, "pre-2"), pod(fleet, "dec-2")
    prompt = tokens("lost-after", 300)
    decode = prefill_held(pre2, prompt, "pd-lost")
    os.killpg(pre2.proc.pid, signal.SIGKILL)
    pre2.proc.wait(10)
    got = generate(dec2.target(), decode)
    assert completions(got) == reference(fleet, prompt)
    assert got.usage.kv_pull_fallback == "peer_unavailable"
    assert value(metrics(dec2), "pagekv_handover_fallbacks_total",
                 reason="peer_unavailable") == 1


def test_with_no_prefill_pod_left_the_decode_pod_computes_the_prompt(fleet):
    router = pod(fleet, "router")
    prompt = tokens("no-prefill", 300)
    got = generate(router.target(), request(prompt))  # pre-2's lease still lists it
    assert completions(got) == reference(fleet, prompt)
    assert got.routing.chosen_pod == "dec-2" and got.routing.prefill_pod == ""
    assert got.routing.pd_fallback == "prefill_unavailable"
    assert got.usage.cached_tokens == 0
    assert value(metrics(router), "pagekv_router_pd_fallbacks_total",
                 reason="prefill_unavailable") == 1


def test_nothing_stays_pinned_on_the_pods_left(fleet):
    dec2 = pod(fleet, "dec-2")
    wait_for(lambda: idle_and_unpinned(dec2), "dec-2 idle with every block free")
    assert value(metrics(dec2), "pagekv_kv_transfers_active") == 0
