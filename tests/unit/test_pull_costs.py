"""The puller pod's cost model per holder (kvnode/engine/pull_costs.py): the fit of seconds =
fixed + tokens x per_token from measured pulls, what it leaves out, its bounds, and what the
engine publishes from it (read back by the index parser, as a router reads it)."""

from __future__ import annotations

import math
import statistics
import threading

import pytest

from pagekv.kvnode.engine.peer_pull import DEADLINE, PEER_MISSING, KvSource, PullResult
from pagekv.kvnode.engine.pull_costs import MAX_FIXED_S, PeerPullCosts, fit_line
from pagekv.proto.index.bad_records import BAD_COST, BadRecords
from pagekv.proto.index.pod_record import parse_pod_record
from tests.unit.test_peer_pull import PROMPT, direct_fetch, engine, run

FIXED, PER_TOKEN = 0.02, 5e-5  # a pull's round trip and landing setup; its cost per token
LENGTHS = (128, 512, 1024, 2048, 4096)


def pulled(model: PeerPullCosts, holder: str, tokens: int, seconds: float,
           failure: str | None = None) -> None:
    model.observe(PullResult(failure=failure, seconds=seconds, source_pod=holder,
                             tokens=tokens))


def line(model: PeerPullCosts, holder: str, fixed: float, per_token: float,
         rounds: int = 2) -> None:
    for _ in range(rounds):
        for n in LENGTHS:
            pulled(model, holder, n, fixed + n * per_token)


# -- the fit ----------------------------------------------------------------------------------

def test_the_fit_recovers_the_fixed_part_and_the_cost_per_token() -> None:
    model = PeerPullCosts()
    line(model, "h", FIXED, PER_TOKEN)
    cost = model.cost("h")
    assert cost is not None
    assert cost.fixed_s == pytest.approx(FIXED) and cost.per_token_s == pytest.approx(PER_TOKEN)
    # A figure per token alone (the old one) prices a short pull at a fraction of its cost.
    assert cost.seconds(128) == pytest.approx(FIXED + 128 * PER_TOKEN)


def test_an_outlier_does_not_move_the_fit() -> None:
    model = PeerPullCosts()
    line(model, "h", FIXED, PER_TOKEN)
    pulled(model, "h", 512, 3.0)      # stuck behind a collection: 100x its time
    pulled(model, "h", 4096, 0.001)   # a clock glitch: impossibly fast
    cost = model.cost("h")
    assert cost is not None
    assert cost.fixed_s == pytest.approx(FIXED, rel=0.1)
    assert cost.per_token_s == pytest.approx(PER_TOKEN, rel=0.1)


def test_a_failed_or_partial_pull_never_makes_a_peer_look_fast() -> None:
    model = PeerPullCosts()
    line(model, "h", FIXED, PER_TOKEN)
    before = model.cost("h")
    for _ in range(40):  # more than the window: all of it, had they counted
        pulled(model, "h", 16, 1e-4, failure=PEER_MISSING)   # failed fast after one block
        pulled(model, "h", 0, 0.5, failure=DEADLINE)
    assert model.cost("h") == before
    # A holder only ever failed with is not measured at all (the router's fallback applies).
    pulled(model, "x", 2048, 1e-4, failure=PEER_MISSING)
    assert model.cost("x") is None and "x" not in model.costs()


def test_pulls_of_one_length_fit_the_line_through_zero_at_their_median() -> None:
    model = PeerPullCosts()
    for seconds in (0.10, 0.12, 0.11, 0.5):
        pulled(model, "h", 2048, seconds)
    cost = model.cost("h")
    assert cost is not None
    assert cost.fixed_s == 0.0 and cost.per_token_s == pytest.approx(0.115 / 2048)
    # Too few pulls for a line: the same.
    fixed, per_token = fit_line([(100, 0.01), (1000, 0.05)])
    assert fixed == 0.0 and per_token == pytest.approx((1e-4 + 5e-5) / 2)


def test_noise_that_bends_the_line_below_zero_falls_back_to_the_line_through_zero() -> None:
    # Longer pulls measured faster (a slope < 0): no line with both parts >= 0.
    fixed, per_token = fit_line([(100, 0.05), (1000, 0.04), (2000, 0.03)])
    assert fixed == 0.0 and per_token == pytest.approx(0.04 / 1000)


def test_holders_are_fitted_apart() -> None:
    model = PeerPullCosts()
    line(model, "near", FIXED, PER_TOKEN)
    line(model, "far", 0.1, 4 * PER_TOKEN)
    costs = model.costs()
    assert costs["near"].per_token_s == pytest.approx(PER_TOKEN)
    assert costs["far"].fixed_s == pytest.approx(0.1)
    assert costs["far"].per_token_s == pytest.approx(4 * PER_TOKEN)


def test_memory_is_bounded_by_the_window_and_the_holders() -> None:
    model = PeerPullCosts(window=5, max_peers=2)
    line(model, "h", 1.0, 1e-3, rounds=1)  # five slow pulls
    line(model, "h", FIXED, PER_TOKEN, rounds=1)  # then five fast ones: the window's all
    cost = model.cost("h")
    assert cost is not None and cost.fixed_s == pytest.approx(FIXED)
    line(model, "a", FIXED, PER_TOKEN, rounds=1)
    pulled(model, "h", 100, 0.03)     # h pulled from again: "a" is now the oldest
    line(model, "b", FIXED, PER_TOKEN, rounds=1)
    assert set(model.costs()) == {"h", "b"}


def test_the_fit_is_clamped_to_what_the_router_accepts() -> None:
    model = PeerPullCosts()
    line(model, "h", 60.0, PER_TOKEN)
    cost = model.cost("h")
    assert cost is not None and cost.fixed_s == MAX_FIXED_S


def test_pulls_noted_while_the_costs_are_read() -> None:
    model = PeerPullCosts(window=8)
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            model.cost_map()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(2000):
            pulled(model, f"h{i % 70}", 100 + i % 900, 0.01 + i % 7 * 1e-3)
    finally:
        stop.set()
        reader.join()
    assert len(model.costs()) == 64


# -- what is published ------------------------------------------------------------------------

def test_the_cost_map_keeps_a_single_peer_figure_their_median() -> None:
    model = PeerPullCosts()
    assert model.cost_map() == {}
    for holder, s_per_token in (("a", 1e-5), ("b", 2e-5), ("c", 9e-5)):
        pulled(model, holder, 1000, 1000 * s_per_token)
    published = model.cost_map()
    assert published["peer"] == pytest.approx(2e-5)
    assert published["peer.a"] == pytest.approx(1e-5) and published["peer_fixed.a"] == 0.0
    assert set(published) == {"peer", *(f"peer{p}.{h}" for p in ("", "_fixed")
                                        for h in "abc")}


def record(costs: dict[str, float]) -> list:
    """A live-pods record of a pod publishing `costs` (as the index publisher writes them)."""
    flat: list[str] = ["epoch", "e1", "address", "127.0.0.1:5000", "updated", "1"]
    for name, value in costs.items():
        flat += [f"cost.{name}", repr(float(value))]
    return ["puller", "e1", 3000, flat]


def test_what_the_engine_publishes_is_what_the_router_reads() -> None:
    model = PeerPullCosts()
    line(model, "pod-b", FIXED, PER_TOKEN)
    line(model, "pod.with.dots", 0.1, 1e-4)
    bad = BadRecords()
    info = parse_pod_record(record({"prefill": 6e-4, **model.cost_map()}), bad)
    assert info is not None and sum(bad.counts.values()) == 0
    assert info.pull_costs == model.costs()
    assert info.pull_costs["pod.with.dots"].fixed_s == pytest.approx(0.1)
    assert set(info.tier_costs) == {"prefill", "peer"}  # per holder: pull_costs only
    assert bad.counts[BAD_COST] == 0


def test_the_engine_registers_the_model_and_publishes_it() -> None:
    eng = engine()
    puller = eng.enable_peer_pull(lambda *a: None)
    assert eng.pull_costs is not None and eng.pull_costs.observe in puller.observers
    for observe in puller.observers:
        for n in LENGTHS:
            observe(PullResult(seconds=FIXED + n * PER_TOKEN, source_pod="h", tokens=n))
    costs = eng.tier_costs()
    assert costs["peer.h"] == pytest.approx(PER_TOKEN)
    assert costs["peer_fixed.h"] == pytest.approx(FIXED)
    # The single figure, for old routers: all-in per token (the fixed part spread over it).
    assert costs["peer"] == pytest.approx(statistics.median(FIXED / n + PER_TOKEN
                                                            for n in LENGTHS))


def test_a_real_pull_is_measured_for_its_holder() -> None:
    src, dst = engine(), engine()
    run(src, PROMPT)
    dst.enable_peer_pull(direct_fetch(src))
    run(dst, PROMPT, KvSource("pod-src", "127.0.0.1:1", 64))
    assert dst.puller is not None and dst.puller.stats.blocks > 0
    costs = dst.tier_costs()
    assert 0 < costs["peer.pod-src"] < math.inf and costs["peer_fixed.pod-src"] == 0.0
    assert costs["peer"] == pytest.approx(costs["peer.pod-src"])
