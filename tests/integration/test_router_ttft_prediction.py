"""The TTFT prediction end to end: a real pod (the tiny random-weight checkpoint) publishes
the costs it fitted from what it served (on its /metrics too), the router predicts each
call's TTFT from them, measures the first token, and its MAPE gauge appears and moves."""

from __future__ import annotations

import random
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.router.server import PREDICTED_TTFT_METADATA_KEY
from tests.integration.router_fixtures import pod_cluster, tokens_req

pytestmark = pytest.mark.integration

POD_ARGS = ["--num-gpu-blocks", "160", "--max-model-len", "2048", "--lease-ttl-s", "1.5",
            "--max-num-batched-tokens", "2048"]


@pytest.fixture(scope="module")
def cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    run_dir = tmp_path_factory.mktemp("ttft-run")
    with pod_cluster(redis_binary, run_dir, POD_ARGS, {"node-a": []}) as cluster:
        yield cluster


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [256] + [rng.randrange(256) for _ in range(n - 1)]


def stream(router: Any, ids: list[int]) -> tuple[int, dict[str, str]]:
    """A streamed call through the router: (tokens received, its trailing metadata)."""
    call = router.stub.GenerateStream(tokens_req(ids, max_tokens=3), timeout=60)
    tokens = sum(len(chunk.token_ids) for chunk in call)
    return tokens, dict(call.trailing_metadata())


def fitted(pod: Any) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics",
                                  timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "pagekv_pod_fitted_cost_seconds":
            out.update({s.labels["kind"]: s.value for s in family.samples})
    return out


def test_the_mape_gauge_appears_and_moves(cluster: Any, make_router: Any) -> None:
    router = make_router(cluster.redis_url)
    router.wait_pods(1)
    labels = {"pod": "node-a", "predictor": "model"}
    gauge = "pagekv_router_ttft_prediction_mape"
    assert router.server.metrics.registry.get_sample_value(gauge, labels) is None

    tokens, trailer = stream(router, prompt(1, 300))  # a prefill-heavy step: measured
    assert tokens == 3
    assert int(trailer[PREDICTED_TTFT_METADATA_KEY]) > 0
    first = router.server.metrics.registry.get_sample_value(gauge, labels)
    assert first is not None and first >= 0
    assert router.metric("pagekv_router_ttft_seconds_count", {"pod": "node-a"}) == 1
    assert router.server.metrics.registry.get_sample_value(
        gauge, {"pod": "node-a", "predictor": "cost_s"}) is not None

    # The pod exports what it fitted: its prefill cost, and its decode step.
    deadline = time.monotonic() + 10
    while set(fitted(cluster.pods[0])) < {"prefill_per_token", "decode_step"}:
        assert time.monotonic() < deadline, fitted(cluster.pods[0])
        time.sleep(0.2)
    assert fitted(cluster.pods[0])["prefill_per_token"] > 0

    values = {first}
    for i, n in enumerate((40, 700, 120, 1500)):  # other lengths: other errors
        stream(router, prompt(10 + i, n))
        values.add(router.server.metrics.registry.get_sample_value(gauge, labels))
    assert len(values) > 1  # it moved
    assert router.metric("pagekv_router_ttft_seconds_count", {"pod": "node-a"}) == 5

    # A unary call is measured too (its response less its decode steps).
    router.stub.Generate(tokens_req(prompt(99, 200), max_tokens=3), timeout=60)
    assert router.metric("pagekv_router_ttft_seconds_count", {"pod": "node-a"}) == 6
