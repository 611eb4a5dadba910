"""Deciding when to pull, from measured costs (#28): the crossover of a pull against
recompute (fixed / (prefill - per_token)), taken only above it; the puller's measured cost
of the holder preferred over its single figure; the floor flag; near-tied sources chosen by
queue depth; garbage per-holder figures skipped and counted; the crossover as a metric.
Published and read over a real index: tests/integration/test_router_pull_costs.py."""

from __future__ import annotations

import argparse
import logging
import math

import pytest
from prometheus_client import CollectorRegistry

from pagekv.proto.index.bad_records import BAD_COST, BadRecords
from pagekv.proto.index.pod_record import parse_pod_record
from pagekv.proto.pull_cost import PullCost
from pagekv.router.cli import add_arguments, config_from
from pagekv.router.metrics import RouterMetrics
from pagekv.router.pull_crossovers import PullCrossovers
from pagekv.router.scoring import (
    Candidate,
    CostModel,
    pull_cost,
    pull_crossover,
    score_all,
)

BS = 16
PROMPT = 200  # 12 blocks can hit
PREFILL, PEER = 1e-3, 1e-4
COSTS = CostModel(prefill_per_token=PREFILL, cpu_per_token=1e-5, disk_per_token=1e-4,
                  queue_per_request=0.05, peer_per_token=PEER)
MEASURED = PullCost(0.1, PEER)  # a round trip and setup of 0.1 s: crossover 111.1 tokens


def holder(pod: str, blocks: int, **kw) -> Candidate:
    return Candidate(pod, f"{pod}:1", ["GPU"] * blocks, held_blocks=blocks, **kw)


def puller(**kw) -> Candidate:
    return Candidate("c", "c:1", **kw)


def chosen(cands: list[Candidate], costs: CostModel = COSTS, prompt: int = PROMPT):
    return {s.pod_id: s for s in score_all(cands, prompt, BS, costs)}["c"]


# -- the crossover ----------------------------------------------------------------------------

def test_the_crossover_is_the_fixed_part_over_the_saving_per_token() -> None:
    assert MEASURED.crossover_tokens(PREFILL) == pytest.approx(0.1 / (PREFILL - PEER))
    assert PullCost(0.0, PEER).crossover_tokens(PREFILL) == 0.0
    assert PullCost(0.0, PREFILL).crossover_tokens(PREFILL) == math.inf  # no cheaper
    assert PullCost(0.01, 2 * PREFILL).crossover_tokens(PREFILL) == math.inf
    c = puller(pull_costs={"h": MEASURED}, published_costs={"prefill": 2 * PREFILL})
    # At the puller's own prefill speed: twice as slow, so twice the saving per token.
    assert pull_crossover(c, "h", COSTS) == pytest.approx(0.1 / (2 * PREFILL - PEER))


def test_below_the_crossover_the_pod_recomputes_above_it_pulls() -> None:
    c = puller(pull_costs={"h": MEASURED})
    below = chosen([holder("h", 6), c])  # 96 tokens < 111.1
    assert below.pull_from == "" and below.cost_s == pytest.approx(PROMPT * PREFILL)
    above = chosen([holder("h", 8), c])  # 128 tokens > 111.1
    assert (above.pull_from, above.pull_tokens) == ("h", 128)
    assert above.cost_s == pytest.approx((PROMPT - 128) * PREFILL + MEASURED.seconds(128))
    assert above.pull_saving_s == pytest.approx(128 * (PREFILL - PEER) - 0.1)
    # At the same cost per token with no fixed part (the pod's single figure), 96 pulled.
    assert chosen([holder("h", 6), puller(published_costs={"peer": PEER})]).pull_from == "h"


@pytest.mark.parametrize("fixed", [0.0, 0.01, 0.05, 0.2])
@pytest.mark.parametrize("per_token", [1e-5, 5e-4, 9.9e-4, 1e-3, 3e-3])
def test_the_scorer_pulls_exactly_above_the_crossover_it_exports(fixed, per_token) -> None:
    c = puller(pull_costs={"h": PullCost(fixed, per_token)})
    edge = pull_crossover(c, "h", COSTS)
    for blocks in range(1, 13):
        s = chosen([holder("h", blocks), c])
        assert (s.pull_from == "h") == (blocks * BS > edge), (blocks, edge)


def test_the_measured_cost_of_the_holder_is_preferred_over_the_pods_single_figure() -> None:
    # The puller's single figure says pulls are cheap, but from h it measured them slower
    # than recomputing: it pulls from g, which it has no figure of (the single one holds).
    c = puller(published_costs={"peer": PEER}, pull_costs={"h": PullCost(0.0, 2 * PREFILL)})
    assert pull_crossover(c, "h", COSTS) == math.inf
    assert pull_cost(c, "g", COSTS) == PullCost(0.0, PEER)
    s = chosen([holder("h", 10), holder("g", 8), c])
    assert s.pull_from == "g"
    assert chosen([holder("h", 10), c]).pull_from == ""
    # Neither figure: the configured one.
    assert pull_cost(puller(), "h", COSTS) == PullCost(0.0, PEER)


def test_the_floor_flag_keeps_shorter_pulls_out() -> None:
    floor = CostModel(PREFILL, 1e-5, 1e-4, 0.05, peer_per_token=PEER, pull_min_token_delta=129)
    assert chosen([holder("h", 8), puller()], floor).pull_from == ""  # 128 < 129
    assert chosen([holder("h", 9), puller()], floor).pull_from == "h"  # 144
    at = CostModel(PREFILL, 1e-5, 1e-4, 0.05, peer_per_token=PEER, pull_min_token_delta=128)
    assert chosen([holder("h", 8), puller()], at).pull_from == "h"  # 128: enough
    # The floor never lowers the crossover: below it the measured cost still says no.
    c = puller(pull_costs={"h": MEASURED})
    low = CostModel(PREFILL, 1e-5, 1e-4, 0.05, peer_per_token=PEER, pull_min_token_delta=16)
    assert chosen([holder("h", 6), c], low).pull_from == ""
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="pull_min_token_delta"):
            CostModel(PREFILL, 1e-5, 1e-4, 0.05, pull_min_token_delta=bad)  # type: ignore[arg-type]


def test_cli_sets_the_floor() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from(parser.parse_args([])).costs.pull_min_token_delta == 0
    cfg = config_from(parser.parse_args(["--pull-min-token-delta", "256"]))
    assert cfg.costs.pull_min_token_delta == 256


# -- among near-tied sources ------------------------------------------------------------------

LONG = 2000  # 124 blocks can hit: a block more or less of prefix is within the tolerance


def test_near_tied_prefixes_go_to_the_shorter_queue() -> None:
    # a holds a block more than b (16 tokens, 14 ms of a 0.56 s estimate: within 5%).
    cands = [holder("a", 100, waiting=4), holder("b", 99), puller()]
    s = chosen(cands, prompt=LONG)
    assert (s.pull_from, s.pull_blocks, s.pull_tokens) == ("b", 99, 99 * BS)
    # Its queue empties, the other's fills: the next pull goes there.
    cands = [holder("a", 100), holder("b", 99, running=3), puller()]
    assert chosen(cands, prompt=LONG).pull_from == "a"
    # Equal queues: the cheaper pull (the deeper prefix), then the pod id.
    assert chosen([holder("b", 100), holder("a", 99), puller()], prompt=LONG).pull_from == "b"
    assert chosen([holder("b", 100), holder("a", 100), puller()], prompt=LONG).pull_from == "a"


def test_near_tied_measured_costs_go_to_the_shorter_queue_a_slower_link_does_not() -> None:
    slower = PullCost(0.0, 1.1 * PEER)  # 10% more per token: 16 ms of 0.56 s, tied
    slow = PullCost(0.0, 3 * PEER)      # 0.32 s more: not tied, its queue does not matter
    c = puller(pull_costs={"a": PullCost(0.0, PEER), "b": slower})
    assert chosen([holder("a", 100, waiting=2), holder("b", 100), c], prompt=LONG).pull_from == "b"
    c = puller(pull_costs={"a": PullCost(0.0, PEER), "b": slow})
    assert chosen([holder("a", 100, waiting=2), holder("b", 100), c], prompt=LONG).pull_from == "a"


def test_a_source_below_the_crossover_is_no_option_even_with_the_shorter_queue() -> None:
    c = puller(pull_costs={"b": PullCost(1.0, PEER)})  # b: a second per pull, never worth it
    s = chosen([holder("a", 12, waiting=9), holder("b", 12), c])
    assert s.pull_from == "a"


# -- garbage per-holder figures ---------------------------------------------------------------

def record(fields: dict[str, str]) -> list:
    flat = ["epoch", "e1", "address", "127.0.0.1:5000", "updated", "1", "cost.prefill", "1e-3",
            "cost.peer.good", "1e-4", "cost.peer_fixed.good", "0.02"]
    for name, value in fields.items():
        flat += [name, value]
    return ["puller", "e1", 3000, flat]


@pytest.mark.parametrize("fields", [
    {"cost.peer.h": "nan", "cost.peer_fixed.h": "0.01"},
    {"cost.peer.h": "inf", "cost.peer_fixed.h": "0.01"},
    {"cost.peer.h": "-1e-4", "cost.peer_fixed.h": "0.01"},
    {"cost.peer.h": "1e308", "cost.peer_fixed.h": "0.01"},
    {"cost.peer.h": "0", "cost.peer_fixed.h": "0.01"},   # a free pull would always win
    {"cost.peer.h": "fast", "cost.peer_fixed.h": "0.01"},
    {"cost.peer.h": "1e-4", "cost.peer_fixed.h": "nan"},
    {"cost.peer.h": "1e-4", "cost.peer_fixed.h": "-0.5"},  # would make short pulls win
    {"cost.peer.h": "1e-4", "cost.peer_fixed.h": "1e9"},
    {"cost.peer.h": "1e-4"},                              # half of it: not the whole price
    {"cost.peer_fixed.h": "0.01"},
    {"cost.peer.": "1e-4", "cost.peer_fixed.": "0.01"},   # no holder named
])
def test_a_garbage_holder_figure_is_skipped_and_counted(fields) -> None:
    bad = BadRecords()
    info = parse_pod_record(record(fields), bad)
    assert info is not None  # the pod itself is routed to
    assert bad.counts[BAD_COST] == 1 and sum(bad.counts.values()) == 1
    assert info.pull_costs == {"good": PullCost(0.02, 1e-4)}
    assert info.tier_costs == {"prefill": 1e-3}
    # The holder skipped: its pull priced at the pod's single figure (here: the configured).
    c = puller(published_costs=info.tier_costs, pull_costs=info.pull_costs)
    assert pull_cost(c, "h", COSTS) == PullCost(0.0, PEER)


def test_sane_holder_figures_are_read() -> None:
    bad = BadRecords()
    info = parse_pod_record(record({"cost.peer.h": "2e-4", "cost.peer_fixed.h": "0"}), bad)
    assert info is not None and sum(bad.counts.values()) == 0
    assert info.pull_costs == {"good": PullCost(0.02, 1e-4), "h": PullCost(0.0, 2e-4)}


# -- the metric -------------------------------------------------------------------------------

def crossover(metrics: RouterMetrics, pod: str, peer: str) -> float | None:
    return metrics.registry.get_sample_value("pagekv_router_pull_crossover_tokens",
                                             {"pod": pod, "peer": peer})


def test_the_crossover_of_each_pair_is_exported(caplog) -> None:
    metrics = RouterMetrics(CollectorRegistry())
    export = PullCrossovers(metrics.pull_crossover, interval_s=1.0)
    c = puller(pull_costs={"h": MEASURED, "slow": PullCost(0.0, 2 * PREFILL)})
    vllm = Candidate("v", "v:1", can_pull=False, lendable=False)
    cands = [holder("h", 8), holder("slow", 8), c, vllm]
    with caplog.at_level(logging.DEBUG, logger="pagekv.router.pull_crossovers"):
        export.update(cands, COSTS, now=10.0)
    assert crossover(metrics, "c", "h") == pytest.approx(0.1 / (PREFILL - PEER))
    assert crossover(metrics, "c", "slow") == math.inf
    # h measured nothing: any peer at the configured figure, one series, not one per peer.
    assert crossover(metrics, "h", "*") == 0.0 and crossover(metrics, "h", "c") is None
    assert crossover(metrics, "c", "*") == 0.0  # c's unmeasured peers
    assert crossover(metrics, "c", "v") is None and crossover(metrics, "v", "*") is None
    assert any("pull crossover c <- h: 111 tokens (measured" in r.getMessage()
               for r in caplog.records)
    assert any("pull crossover c <- slow: never" in r.getMessage() for r in caplog.records)
    # At most once per interval; a pod gone leaves the metric.
    c.pull_costs = {"h": PullCost(0.2, PEER)}
    export.update(cands[:1] + cands[2:], COSTS, now=10.5)
    assert crossover(metrics, "c", "h") == pytest.approx(0.1 / (PREFILL - PEER))
    export.update(cands[:1] + cands[2:], COSTS, now=11.0)
    assert crossover(metrics, "c", "h") == pytest.approx(0.2 / (PREFILL - PEER))
    assert crossover(metrics, "c", "slow") is None
