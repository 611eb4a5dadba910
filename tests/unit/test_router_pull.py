"""The router's pull option (a pod pulls a prefix it lacks from a peer): pure scoring, the
source choice, the reason, RoutingInfo's fields and the CLI flags. The decision over a real
index and the per-attempt kv_source: tests/integration/test_router_pull_hints.py."""

from __future__ import annotations

import argparse

import pytest

from pagekv.router.cli import add_arguments, config_from
from pagekv.router.config import DEFAULT_COSTS
from pagekv.router.routing import Decision
from pagekv.router.scoring import (
    REASON_PREFIX,
    REASON_PULL,
    REASONS,
    Candidate,
    CostModel,
    PullSource,
    pull_sources,
    rank,
    score_all,
    score_candidate,
)

BS = 16
PROMPT = 200  # 12 blocks can hit: (200 - 1) // 16
COSTS = CostModel(prefill_per_token=1e-3, cpu_per_token=1e-5, disk_per_token=1e-4,
                  queue_per_request=0.05, peer_per_token=1e-4)
EXACT = CostModel(1e-3, 1e-5, 1e-4, 0.05, peer_per_token=1e-4, tie_rel=0.0, tie_abs_s=0.0)


def holder(pod: str, blocks: int, **kw) -> Candidate:
    """A pod whose `blocks` leading blocks the index confirms in its pool."""
    return Candidate(pod, f"{pod}:1", ["GPU"] * blocks, held_blocks=blocks, **kw)


def by_pod(scores) -> dict:
    return {s.pod_id: s for s in scores}


# -- the option itself ------------------------------------------------------------------------

def test_a_pod_without_the_prefix_pulls_it_when_that_is_cheaper() -> None:
    s = by_pod(score_all([holder("h", 8), Candidate("c", "c:1")], PROMPT, BS, COSTS))
    c = s["c"]
    assert (c.pull_from, c.pull_address, c.pull_blocks, c.pull_tokens) == ("h", "h:1", 8, 128)
    assert c.cost_s == pytest.approx((PROMPT - 128) * 1e-3 + 128 * 1e-4)
    assert c.pull_saving_s == pytest.approx(128 * (1e-3 - 1e-4))
    assert c.cached_tokens == 0  # its own hit: the pulled tokens are not counted there
    assert s["h"].pull_from == "" and s["h"].cost_s == pytest.approx((PROMPT - 128) * 1e-3)


def test_a_pod_keeps_its_own_tiers_and_pulls_only_the_rest() -> None:
    own = Candidate("c", "c:1", ["CPU"] * 3, held_blocks=3)
    c = by_pod(score_all([holder("h", 8), own], PROMPT, BS, COSTS))["c"]
    assert (c.cached_cpu, c.pull_tokens, c.pull_blocks) == (48, 80, 8)
    assert c.cost_s == pytest.approx((PROMPT - 128) * 1e-3 + 48 * 1e-5 + 80 * 1e-4)
    assert c.pull_saving_s == pytest.approx(80 * (1e-3 - 1e-4))


def test_the_source_is_capped_at_the_lookup_limit() -> None:
    c = by_pod(score_all([holder("h", 13), Candidate("c", "c:1")], PROMPT, BS, COSTS))["c"]
    assert (c.pull_blocks, c.pull_tokens) == (12, 192)


def test_no_pull_when_the_peer_cost_is_not_below_prefill() -> None:
    for peer in (2e-3, 1e-3):  # slower than recomputing, or no faster
        c = Candidate("c", "c:1", published_costs={"peer": peer})
        s = by_pod(score_all([holder("h", 8), c], PROMPT, BS, COSTS))["c"]
        assert s.pull_from == "" and s.pull_tokens == 0 and s.pull_saving_s == 0.0
        assert s.cost_s == pytest.approx(PROMPT * 1e-3)
    # The configured figure applies until the pod publishes its own; garbage is ignored.
    slow = CostModel(1e-3, 1e-5, 1e-4, 0.05, peer_per_token=5e-3)
    plain = Candidate("c", "c:1", published_costs={"peer": float("nan")})
    assert by_pod(score_all([holder("h", 8), plain], PROMPT, BS, slow))["c"].pull_from == ""
    fast = Candidate("c", "c:1", published_costs={"peer": 1e-5})
    s = by_pod(score_all([holder("h", 8), fast], PROMPT, BS, slow))["c"]
    assert s.pull_from == "h" and s.pull_saving_s == pytest.approx(128 * (1e-3 - 1e-5))


def test_no_pull_for_a_pod_that_already_holds_as_much() -> None:
    # Its own prefix predicted by a burst (not yet in the index) counts: nothing to pull.
    burst = Candidate("c", "c:1", ["GPU"] * 8, burst_blocks=8)
    s = by_pod(score_all([holder("h", 8), burst], PROMPT, BS, COSTS))
    assert s["c"].pull_from == "" and s["h"].pull_from == ""
    # A deeper pod is the source for the shallower one, not the other way round.
    s = by_pod(score_all([holder("h", 8), holder("c", 10)], PROMPT, BS, COSTS))
    assert s["c"].pull_from == ""
    assert (s["h"].pull_from, s["h"].pull_blocks, s["h"].pull_tokens) == ("c", 10, 32)


def test_burst_predicted_blocks_are_never_a_source() -> None:
    predicted = Candidate("h", "h:1", ["GPU"] * 8, burst_blocks=8)  # held_blocks 0
    cands = [predicted, Candidate("c", "c:1")]
    assert pull_sources(cands, 12) == []
    assert by_pod(score_all(cands, PROMPT, BS, COSTS))["c"].pull_from == ""


def test_kv_pull_off_scores_exactly_as_without_the_option() -> None:
    cands = [holder("h", 8), Candidate("c", "c:1"), Candidate("d", "d:1", ["CPU"] * 2)]
    off = score_all(cands, PROMPT, BS, COSTS, pull=False)
    assert off == [score_candidate(c, PROMPT, BS, COSTS) for c in cands]
    on = score_all(cands, PROMPT, BS, COSTS, pull=True)
    assert [s.pull_from for s in on] == ["", "h", "h"]
    assert all(s_on.cost_s < s_off.cost_s for s_on, s_off in zip(on[1:], off[1:], strict=True))


# -- the source -------------------------------------------------------------------------------

def source_of(cands: list[Candidate], pod: str = "c") -> str:
    return by_pod(score_all([*cands, Candidate(pod, f"{pod}:1")], PROMPT, BS, COSTS))[pod] \
        .pull_from


def test_source_ties_go_to_the_shorter_queue_then_the_pod_id() -> None:
    assert source_of([holder("a", 8, waiting=3), holder("b", 8, running=1)]) == "b"
    assert source_of([holder("b", 8), holder("a", 8)]) == "a"
    # A block deeper saves more than the tie tolerance: depth wins over the longer queue.
    assert source_of([holder("a", 8), holder("d", 9, waiting=5)]) == "d"
    # Capped depths are equal depths: the queue decides between them.
    assert source_of([holder("a", 14, waiting=2), holder("b", 13)]) == "b"


def test_ineligible_and_cooling_pods_are_no_source() -> None:
    cands = [holder("x", 10, eligible=False), holder("y", 9, lendable=False), holder("a", 4),
             Candidate("c", "c:1")]
    assert pull_sources(cands, 12) == [PullSource("a", "a:1", 4)]
    assert pull_sources(cands[:2], 12) == []
    assert by_pod(score_all(cands, PROMPT, BS, COSTS))["c"].pull_from == "a"


# -- the reason and what the client is told --------------------------------------------------

def test_reason_is_peer_pull_when_the_pull_set_the_chosen_pod_apart() -> None:
    assert REASON_PULL == "peer_pull" and REASON_PULL in REASONS
    # The holder is busy: an idle pod that pulls beats it, with no prefix of its own.
    cands = [holder("h", 8, waiting=10), Candidate("c", "c:1")]
    order, reason = rank(score_all(cands, PROMPT, BS, EXACT), EXACT)
    assert order[0].pod_id == "c" and reason == REASON_PULL
    # Without the option the holder's prefix still is not worth its queue: a plain cost win.
    order, reason = rank(score_all(cands, PROMPT, BS, EXACT, pull=False), EXACT)
    assert order[0].pod_id == "c" and reason != REASON_PULL
    # A pod with a prefix of its own above the others' is a prefix hit, pull or not.
    cands.append(Candidate("d", "d:1", ["GPU"] * 3, held_blocks=3))
    order, reason = rank(score_all(cands, PROMPT, BS, EXACT), EXACT)
    assert order[0].pod_id == "d" and order[0].pull_from == "h" and reason == REASON_PREFIX


def test_routing_info_reports_the_pull_option() -> None:
    scores = score_all([holder("h", 8, waiting=10), Candidate("c", "c:1")], PROMPT, BS, EXACT)
    order, reason = rank(scores, EXACT)
    decision = Decision(order, reason, scores, 12, 0.1)
    info = decision.routing_info(order[0])
    assert (info.pull_from, info.pull_tokens) == ("h", 128)
    assert info.predicted_pull_saving_s == pytest.approx(128 * (1e-3 - 1e-4))
    assert info.predicted_cached_tokens == 0
    cand = {c.pod_id: c for c in info.candidates}
    assert (cand["c"].pull_from, cand["c"].pull_tokens) == ("h", 128)
    assert cand["c"].pull_saving_s == pytest.approx(128 * (1e-3 - 1e-4))
    assert cand["h"].pull_from == "" and cand["h"].pull_tokens == 0
    # A retry that drops the hint says so; the candidates still show the option.
    dropped = decision.routing_info(order[0], pulled=False)
    assert dropped.pull_from == "" and dropped.pull_tokens == 0
    assert {c.pod_id: c.pull_from for c in dropped.candidates}["c"] == "h"


# -- configuration ---------------------------------------------------------------------------

def test_cost_model_rejects_a_bad_peer_figure() -> None:
    for bad in (-1e-5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="peer_per_token"):
            CostModel(1e-3, 1e-5, 1e-4, 0.05, peer_per_token=bad)


def test_peer_default_lies_between_the_reload_and_prefill_figures() -> None:
    d = DEFAULT_COSTS
    assert d.cpu_per_token < d.peer_per_token < d.prefill_per_token


def test_cli_flags_set_the_peer_cost_and_the_switch() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = config_from(parser.parse_args([]))
    assert default.kv_pull is True
    assert default.costs.peer_per_token == DEFAULT_COSTS.peer_per_token
    cfg = config_from(parser.parse_args(["--cost-peer-per-token", "2e-5", "--no-kv-pull"]))
    assert cfg.kv_pull is False and cfg.costs.peer_per_token == 2e-5
    assert config_from(parser.parse_args(["--kv-pull"])).kv_pull is True
