"""The router's TTFT predictor (router/ttft_model.py), its rolling error (ttft_errors.py) and
the per-pod clock that feeds them (ttft_tracker.py)."""

from __future__ import annotations

import math

import pytest

from pagekv.proto.index.pod_record import PodInfo
from pagekv.proto.pull_cost import PullCost
from pagekv.router.metrics import RouterMetrics
from pagekv.router.scoring import CostModel, Score, queue_cost
from pagekv.router.ttft_errors import RollingErrors
from pagekv.router.ttft_model import (
    DEFAULT_STEP_TOKENS,
    absolute_percentage_error,
    backlog_seconds,
    own_seconds,
    pod_figures,
    predict,
)
from pagekv.router.ttft_tracker import (
    ATTENTION_MIN_PAIRS,
    ATTENTION_MIN_SAMPLES,
    CONTEXT_MIN_SAMPLES,
    TtftTracker,
)

COSTS = CostModel(prefill_per_token=6e-4, cpu_per_token=6e-6, disk_per_token=3e-5,
                  queue_per_request=0.025, peer_per_token=6e-5)
PREFILL, BUDGET = 2e-3, 50  # published: so the pod's step is 50 x 2 ms = 0.1 s


def info(pod: str = "a", prefill: float | None = PREFILL, budget: int = BUDGET,
         backlog: float = 0.0, updated_at: float = 0.0, **costs: float) -> PodInfo:
    tier_costs = dict(costs)
    if prefill is not None:
        tier_costs["prefill"] = prefill
    return PodInfo(pod, "127.0.0.1:1", "e", {}, {"prefill_budget": budget,
                                                "prefill_backlog": backlog},
                   tier_costs, updated_at, 3000)


def score(pod: str = "a", gpu: int = 0, cpu: int = 0, disk: int = 0, cost_s: float = 0.5,
          **kw) -> Score:
    return Score(pod, "127.0.0.1:1", cached_gpu=gpu, cached_cpu=cpu, cached_disk=disk,
                 cost_s=cost_s, **kw)


# -- the model -----------------------------------------------------------------------------

def test_own_work_is_steps_prefill_reloads_and_pull() -> None:
    s = score(gpu=160, cpu=64, disk=32, pull_from="b", pull_tokens=128)
    pull = PullCost(0.01, 1e-5)
    pod = pod_figures({"prefill": PREFILL, "CPU": 1e-5, "DISK": 4e-5}, {"prefill_budget": 50},
                      {"b": pull}, s, COSTS)
    assert pod.step_s == pytest.approx(0.1) and pod.measured
    seconds, steps = own_seconds(s, 1000, pod)
    uncached = 1000 - 160 - 64 - 32 - 128
    assert steps == 1
    assert seconds == pytest.approx(0.1 + uncached * PREFILL + 64 * 1e-5 + 32 * 4e-5
                                    + 0.01 + 128 * 1e-5)


def test_long_prompts_take_a_step_per_budget_and_the_last_token_is_always_computed() -> None:
    pod = pod_figures({"prefill": PREFILL}, {"prefill_budget": 50}, {}, score(), COSTS)
    _, steps = own_seconds(score(), 2 * DEFAULT_STEP_TOKENS + 1, pod)
    assert steps == 3
    full_hit = score(gpu=1008)  # everything cached the lookup allows: one token left
    assert own_seconds(full_hit, 1008, pod)[0] == pytest.approx(0.1 + PREFILL)


def test_unmeasured_pods_are_priced_at_the_configured_costs() -> None:
    s = score(pull_from="b", pull_tokens=64)
    pod = pod_figures({}, {}, {}, s, COSTS)
    assert not pod.measured
    assert pod.prefill_s_per_token == COSTS.prefill_per_token
    assert pod.step_s == pytest.approx(queue_cost(COSTS, COSTS.prefill_per_token))
    assert pod.pull == PullCost(0.0, COSTS.peer_per_token)  # no fit: the single figure
    # A prefill published without a budget (no decode step timed yet): not the pod's own.
    assert not pod_figures({"prefill": PREFILL}, {}, {}, s, COSTS).measured


def test_prediction_adds_the_work_ahead_and_backlog_is_priced_in_steps() -> None:
    pod = pod_figures({"prefill": PREFILL}, {"prefill_budget": 50, "prefill_backlog": 300},
                      {}, score(), COSTS)
    p = predict(score(), 101, pod, ahead_s=0.7)
    assert p.ahead_s == 0.7 and p.own_s == pytest.approx(0.1 + 101 * PREFILL)
    assert p.seconds == pytest.approx(p.ahead_s + p.own_s)
    assert predict(score(), 101, pod, ahead_s=-1.0).ahead_s == 0.0
    assert backlog_seconds(pod) == pytest.approx(0.1 + 300 * PREFILL)


def test_absolute_percentage_error() -> None:
    assert absolute_percentage_error(1.2, 1.0) == pytest.approx(0.2)
    assert absolute_percentage_error(0.5, 1.0) == pytest.approx(0.5)
    assert absolute_percentage_error(1.0, 0.0) is None
    assert absolute_percentage_error(math.inf, 1.0) is None


# -- the rolling error ---------------------------------------------------------------------

def test_rolling_mape_is_over_the_last_window() -> None:
    errors = RollingErrors(window=3)
    for predicted in (2.0, 1.0, 1.0, 1.1):  # errors 1.0, 0, 0, 0.1: the first rolls out
        errors.observe("a", "model", predicted, 1.0)
    assert errors.mape("a", "model") == pytest.approx(0.1 / 3)
    assert errors.count("a", "model") == 3
    assert errors.mape("a", "cost_s") is None and errors.mape("b", "model") is None
    assert errors.observe("a", "model", 1.0, 0.0) == (None, [])  # nothing measured
    assert errors.count("a", "model") == 3


def test_rolling_errors_forget_the_least_recent_pod() -> None:
    errors = RollingErrors(window=2, max_pods=2)
    errors.observe("a", "model", 1.0, 1.0)
    errors.observe("b", "model", 1.0, 1.0)
    errors.observe("a", "model", 1.0, 1.0)  # a is the more recent now
    assert errors.observe("c", "model", 1.0, 1.0)[1] == ["b"]
    assert errors.mape("b", "model") is None and errors.mape("a", "model") == 0.0
    with pytest.raises(ValueError):
        RollingErrors(window=0)


# -- the tracker ----------------------------------------------------------------------------

def tracker() -> tuple[TtftTracker, RouterMetrics]:
    metrics = RouterMetrics()
    return TtftTracker(metrics, COSTS, window=10), metrics


def gauge(metrics: RouterMetrics, pod: str, predictor: str) -> float | None:
    return metrics.registry.get_sample_value(
        "pagekv_router_ttft_prediction_mape", {"pod": pod, "predictor": predictor})


OWN_100 = 0.1 + 100 * PREFILL  # a 100-token cold prompt on an idle pod: 0.3 s


def test_an_idle_pod_call_is_predicted_and_its_error_reported() -> None:
    t, m = tracker()
    ticket = t.start(score(cost_s=0.5), info(), 100, now=10.0)
    assert ticket.predicted_s == pytest.approx(OWN_100) and ticket.ahead_s == 0
    assert gauge(m, "a", "model") is None  # nothing measured yet
    t.first_token(ticket, now=10.0 + 0.4)
    assert gauge(m, "a", "model") == pytest.approx(abs(OWN_100 - 0.4) / 0.4)
    assert gauge(m, "a", "cost_s") == pytest.approx(0.25)  # the naive predictor: 0.5 vs 0.4
    ratio = m.registry.get_sample_value("pagekv_router_ttft_predicted_over_measured_sum",
                                        {"pod": "a", "predictor": "model"})
    assert ratio == pytest.approx(OWN_100 / 0.4)
    assert m.registry.get_sample_value("pagekv_router_ttft_seconds_count", {"pod": "a"}) == 1
    t.first_token(ticket, now=11.0)  # measured once only
    assert m.registry.get_sample_value("pagekv_router_ttft_seconds_count", {"pod": "a"}) == 1


def test_calls_queue_behind_ours_on_the_same_pod_only() -> None:
    t, _ = tracker()
    first = t.start(score(), info(), 100, now=0.0)
    second = t.start(score(), info(), 100, now=0.0)
    other = t.start(score("b"), info("b"), 100, now=0.0)
    assert second.ahead_s == pytest.approx(OWN_100)
    assert second.predicted_s == pytest.approx(2 * OWN_100)
    assert other.ahead_s == 0.0
    assert first.ahead_s == 0.0


def test_an_early_or_late_first_token_moves_the_calls_behind_it() -> None:
    t, _ = tracker()
    first = t.start(score(), info(), 100, now=0.0)
    second = t.start(score(), info(), 100, now=0.0)
    t.first_token(first, now=OWN_100 + 0.5)  # half a second late
    assert second.expected_at == pytest.approx(2 * OWN_100 + 0.5)
    third = t.start(score(), info(), 100, now=OWN_100 + 0.5)
    assert third.ahead_s == pytest.approx(OWN_100)  # what is left of the second
    # The predictions already made are judged as made: the second's stays at 2 x own.
    assert second.predicted_s == pytest.approx(2 * OWN_100)


def test_a_pending_call_past_its_time_pushes_the_queue() -> None:
    t, _ = tracker()
    t.start(score(), info(), 100, now=0.0)
    late = t.start(score(), info(), 100, now=OWN_100 + 1.0)  # the first is 1 s overdue
    # The first is taken as finishing now at the earliest: nothing is left ahead of it
    # but itself, so the new call waits for none of the first's predicted work.
    assert late.ahead_s == pytest.approx(0.0)
    behind = t.start(score(), info(), 100, now=OWN_100 + 1.0)
    assert behind.ahead_s == pytest.approx(OWN_100)


def test_a_failed_call_leaves_the_clock() -> None:
    t, _ = tracker()
    first = t.start(score(), info(), 100, now=0.0)
    second = t.start(score(), info(), 100, now=0.0)
    t.close(first)
    assert second.expected_at == pytest.approx(OWN_100)
    third = t.start(score(), info(), 100, now=0.0)
    assert third.ahead_s == pytest.approx(OWN_100)
    t.close(None)
    t.close(first)  # twice: a no-op


def test_a_unary_calls_decode_steps_are_taken_off() -> None:
    t, m = tracker()
    ticket = t.start(score(), info(), 100, now=0.0)
    t.unary_done(ticket, steps=11, now=OWN_100 + 10 * 0.1)  # 10 more steps of 0.1 s
    assert gauge(m, "a", "model") == pytest.approx(0.0, abs=1e-9)


def test_the_published_backlog_counts_only_when_newer_than_our_last_first_token() -> None:
    t, _ = tracker()
    ticket = t.start(score(), info(backlog=200, updated_at=5.0), 100, now=0.0)
    assert ticket.ahead_s == pytest.approx(0.1 + 200 * PREFILL)  # others' work
    t.first_token(ticket, now=1.0)
    # Our first token there came after that reading (the clock is unix time): it is stale.
    again = t.start(score(), info(backlog=200, updated_at=5.0), 100, now=2.0)
    assert again.ahead_s == pytest.approx(0.0)



def test_the_attention_over_a_cached_prefix_is_fitted_per_pod() -> None:
    t, _ = tracker()
    pairs = 100 * 512
    per_pair = 1e-6  # the pod's hits take this long per (new token, cached token) more
    busy = t.start(score(gpu=512), info(), 612, inflight=1, now=0.0)  # a decode beside it
    t.first_token(busy, now=10.0)  # slow for its company: no attention sample
    now = 20.0
    for _ in range(ATTENTION_MIN_SAMPLES):
        ticket = t.start(score(gpu=512), info(), 612, now=now)
        assert ticket.predicted_s == pytest.approx(OWN_100)  # nothing fitted yet
        t.first_token(ticket, now=now + OWN_100 + pairs * per_pair)
        now += 10.0
    hit = t.start(score(gpu=512), info(), 612, now=now)
    assert hit.predicted_s == pytest.approx(OWN_100 + pairs * per_pair)
    # In units of the published prefill cost: a pod twice as slow, twice the attention.
    t.close(hit)
    slow = t.start(score(gpu=512), info(prefill=2 * PREFILL), 612, now=now)
    assert slow.predicted_s == pytest.approx(2 * (OWN_100 + pairs * per_pair))  # step too
    # Cold prompts have no prefix to attend to; the other pod has fitted nothing.
    assert t.start(score(), info(), 100, now=now + 100).predicted_s == pytest.approx(OWN_100)
    assert t.start(score("b", gpu=512), info("b"), 612, now=now).predicted_s == \
        pytest.approx(OWN_100)
    # A short prefix is no sample (too few pairs to tell from the noise).
    assert pairs >= ATTENTION_MIN_PAIRS > 1 * 16


def test_calls_sent_while_another_pod_computes_are_priced_at_a_fitted_slowdown() -> None:
    """Pods on one host slow each other: a pod's calls sent while another pod has a prefill
    of ours pending get the slowdown measured on such calls; the others do not."""
    t, _ = tracker()
    now = 0.0
    for _ in range(CONTEXT_MIN_SAMPLES):
        other = t.start(score("b"), info("b"), 5000, now=now)  # b busy meanwhile
        ticket = t.start(score(), info(), 100, now=now)
        assert ticket.predicted_s == pytest.approx(OWN_100)  # nothing fitted yet
        t.first_token(ticket, now=now + 1.5 * OWN_100)
        t.close(other)
        now += 10.0
    alone = t.start(score(), info(), 100, now=now)
    assert alone.predicted_s == pytest.approx(OWN_100)
    t.close(alone)
    t.start(score("b"), info("b"), 5000, now=now)
    beside = t.start(score(), info(), 100, now=now)
    assert beside.predicted_s == pytest.approx(1.5 * OWN_100)
    behind = t.start(score(), info(), 100, now=now)  # the clock carries it
    assert behind.ahead_s == pytest.approx(1.5 * OWN_100)
