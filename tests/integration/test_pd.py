"""Prefill/decode disaggregation through real processes (issue #29): a prefill pod, a decode
pod and the router on one index, at block sizes 16 and 32; a mixed pod outside the fleet
gives the tokens every split request must match.

The prefill pod keeps a DRAM tier and the decode pod an SSD tier under small pools, so a
prompt that comes back after two others finds its prefix there: the decode pod reloads it
from SSD and pulls only the rest from the prefill pod, which reloaded the same prefix from
DRAM before computing the rest. The router splits at 160 uncached tokens (set, so the cases
sit either side of it; the measured budget is test_pd_faults.py's).
"""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator

import pytest

from pagekv.deploy.local_cluster import Child, LocalCluster, stop_child, wait_healthy
from tests.integration.pd_fixtures import (
    completions,
    generate,
    idle_and_unpinned,
    metrics,
    request,
    start_reference,
    stats,
    stream,
    value,
    wait_for,
    wait_indexed,
    wait_router_sees,
)

pytestmark = pytest.mark.integration

THRESHOLD = 160  # above pagekv-tiny's measured budget (~20-80 tokens), which would win
COMMON = ["--max-model-len", "512", "--num-threads", "1"]


def tokens(name: str, n: int) -> list[int]:
    rng = random.Random(name)
    return [rng.randrange(1, 251) for _ in range(n)]


@pytest.fixture(scope="module", params=[16, 32], ids=lambda bs: f"block{bs}")
def fleet(request, tmp_path_factory) -> Iterator[dict]:
    bs = request.param
    tmp = tmp_path_factory.mktemp(f"pd-{bs}")
    pool = str(1024 // bs)  # ~three 300-token prompts: a fourth evicts the oldest to the tier
    c = LocalCluster(nodes=0, run_dir=tmp, start_router=False)
    c.start()
    ref = None
    try:
        base = ["--block-size", str(bs), *COMMON, "--num-gpu-blocks", pool]
        pre = c.start_pod("pre", [*base, "--role", "prefill", "--cpu-offload-bytes", "8MiB"])
        dec = c.start_pod("dec", [*base, "--role", "decode", "--disk-offload-bytes", "64MiB",
                                  "--disk-offload-dir", str(tmp / "dec-ssd")])
        ref = start_reference(tmp, ["--block-size", str(bs), *COMMON, "--num-gpu-blocks", "256"])
        for pod in (pre, dec):
            wait_healthy(pod.target(), 120, pod.proc)
        router = c.start_router_process("router", ["--block-size", str(bs),
                                                   "--pd-threshold-tokens", str(THRESHOLD)])
        wait_healthy(router.target(), 60, router.proc)
        wait_router_sees(router, 2)
        yield {"bs": bs, "pre": pre, "dec": dec, "ref": ref, "router": router,
               "redis": c.redis_url}
    finally:
        if ref is not None:
            stop_child(ref)
        c.stop()


def assert_split(routing, bs: int, prompt_len: int, local_blocks: int = 0) -> None:
    assert routing.chosen_pod == "dec" and routing.prefill_pod == "pre"
    assert routing.pd_fallback == "" and routing.pd_threshold_tokens == THRESHOLD
    assert routing.prefill_ms > 0
    assert routing.handover_tokens == ((prompt_len - 1) // bs - local_blocks) * bs
    assert routing.handover_ms > 0


def test_a_split_request_gives_the_mixed_pods_tokens_unary_and_streamed(fleet):
    bs, router, ref = fleet["bs"], fleet["router"].target(), fleet["ref"].target()
    prompt = tokens("cold", 300)
    got = generate(router, request(prompt))
    assert completions(got) == completions(generate(ref, request(prompt)))
    assert_split(got.routing, bs, 300)
    assert got.usage.cached_tokens_peer == got.routing.handover_tokens
    streamed_prompt = tokens("streamed", 290)
    streamed, last = stream(router, request(streamed_prompt, 20))
    assert streamed == completions(generate(ref, request(streamed_prompt, 20)))
    assert_split(last.routing, bs, 290)
    wait_for(lambda: stats(fleet["pre"]).handover_held_blocks == 0,
             "the prefill pod let its holds go once pulled")


def test_prefixes_in_the_pools_and_tiers_give_the_same_tokens(fleet):
    bs, router, ref = fleet["bs"], fleet["router"].target(), fleet["ref"].target()
    pre, dec = fleet["pre"], fleet["dec"]
    head = tokens("head", 200)
    generate(router, request(head))  # split: both pods now hold the head
    wait_indexed(fleet["redis"], bs, head, "dec", 199 // bs)
    # Pool: the head is still in the decode pod's pool; only the rest is handed over.
    again = head + tokens("tail-a", 180)
    got = generate(router, request(again))
    assert completions(got) == completions(generate(ref, request(again)))
    assert_split(got.routing, bs, 380, local_blocks=200 // bs)
    assert got.usage.cached_tokens_gpu == 200 // bs * bs
    # Tiers: three more prompts push the head out of both pools (prefill: DRAM, decode: SSD).
    cpu_hits = value(metrics(pre), "pagekv_prefix_cache_hits_tokens_total", tier="CPU")
    for name in ("filler-1", "filler-2", "filler-3"):
        generate(router, request(tokens(name, 300)))
    wait_for(lambda: stats(dec).tiers[-1].entries > 0, "the decode pod spilled to SSD")
    later = head + tokens("tail-b", 180)
    got = generate(router, request(later))
    assert completions(got) == completions(generate(ref, request(later)))
    assert got.routing.prefill_pod == "pre" and got.routing.chosen_pod == "dec"
    assert got.usage.cached_tokens_disk > 0 and got.usage.cached_tokens_peer > 0
    assert got.usage.cached_tokens == (380 - 1) // bs * bs
    assert value(metrics(pre), "pagekv_prefix_cache_hits_tokens_total", tier="CPU") > cpu_hits


def test_the_router_splits_from_the_threshold_and_keeps_decode_hits_local(fleet):
    bs, router, ref = fleet["bs"], fleet["router"].target(), fleet["ref"].target()
    short = generate(router, request(tokens("short", THRESHOLD - 1)))
    assert short.routing.prefill_pod == "" and short.routing.chosen_pod == "dec"
    assert short.routing.pd_threshold_tokens == THRESHOLD
    at = generate(router, request(tokens("at", THRESHOLD)))
    assert at.routing.prefill_pod == "pre" and at.routing.chosen_pod == "dec"
    # A prefix the decode pod holds: the few new tokens stay there.
    turn = tokens("turn", 200)
    generate(router, request(turn))
    wait_indexed(fleet["redis"], bs, turn, "dec", 199 // bs)
    follow = turn + tokens("follow", 30)
    got = generate(router, request(follow))
    assert got.routing.prefill_pod == "" and got.routing.chosen_pod == "dec"
    assert completions(got) == completions(generate(ref, request(follow)))
    assert got.usage.cached_tokens_gpu == 200 // bs * bs


def test_n_samples_and_stop_strings_match(fleet):
    router, ref = fleet["router"].target(), fleet["ref"].target()
    prompt = tokens("sampled", 280)
    sampled = request(prompt, 16, temperature=0.8, seed=11, n=3)
    got = generate(router, sampled)
    assert got.routing.prefill_pod == "pre" and len(got.completions) == 3
    assert completions(got) == completions(generate(ref, sampled))
    prompt = tokens("stopped", 280)  # not the one above: the decode pod holds that one now
    plain = generate(ref, request(prompt, 24))
    text = plain.completions[0].text
    stop = text[6:9] if len(text) > 9 else text[-2:]
    stopped = request(prompt, 24, stop=[stop])
    got = generate(router, stopped)
    want = generate(ref, stopped)
    assert got.routing.prefill_pod == "pre"
    assert [(c.text, c.finish_reason, list(c.token_ids)) for c in got.completions] == \
        [(c.text, c.finish_reason, list(c.token_ids)) for c in want.completions]


def completion_over_http(pod: Child, prompt: list[int]) -> dict:
    body = json.dumps({"model": "pagekv-tiny", "prompt": prompt, "max_tokens": 10,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{pod.http_port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_the_openai_api_sees_one_call(fleet):
    router, ref = fleet["router"], fleet["ref"]
    prompt = tokens("http", 260)
    split_before = value(metrics(router), "pagekv_router_pd_requests_total", decision="split")
    got = completion_over_http(router, prompt)
    assert got["choices"][0]["text"] == completion_over_http(ref, prompt)["choices"][0]["text"]
    assert value(metrics(router), "pagekv_router_pd_requests_total",
                 decision="split") == split_before + 1


def test_no_block_stays_pinned_and_the_metrics_show_the_roles(fleet):
    pre, dec, router = fleet["pre"], fleet["dec"], fleet["router"]
    for pod in (pre, dec):
        wait_for(lambda pod=pod: idle_and_unpinned(pod), f"{pod.name} idle, nothing pinned")
    assert stats(pre).role == "prefill" and stats(dec).role == "decode"
    pm, dm, rm = metrics(pre), metrics(dec), metrics(router)
    assert value(pm, "pagekv_pod_role", role="prefill") == 1
    # Every hold ended by its pull, none by its deadline or for room.
    assert value(pm, "pagekv_handover_holds_total", outcome="served") >= 5
    assert value(pm, "pagekv_handover_holds_total", outcome="expired") == 0
    assert value(pm, "pagekv_handover_holds_total", outcome="evicted") == 0
    assert value(pm, "pagekv_handover_served_from_hold_total") >= 5  # no engine round trip
    assert value(dm, "pagekv_handover_seconds_count") >= 5
    assert value(dm, "pagekv_handover_bytes_total") > 0
    assert value(dm, "pagekv_handover_fallbacks_total") == 0
    assert value(rm, "pagekv_router_pd_requests_total", decision="local") >= 2
    assert value(rm, "pagekv_router_pd_prefill_seconds_count") >= 5
    assert value(rm, "pagekv_router_pd_fallbacks_total") == 0
    assert value(rm, "pagekv_router_pd_threshold_tokens", pod="dec") == THRESHOLD
