"""The router's split decision (router/disaggregation.py): which requests are prefilled on a
prefill pod, at which threshold, and that roles travel through the registration."""

from __future__ import annotations

import pytest

from pagekv.proto.index.bad_records import BAD_REGISTRATION, BadRecords
from pagekv.proto.index.pod_record import PodInfo, parse_pod_record
from pagekv.proto.index.schema import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL
from pagekv.proto.index.writes import role_fields
from pagekv.router.config import RouterConfig
from pagekv.router.disaggregation import fallback_label, plan_split, serving_pods, split_threshold
from pagekv.router.pods import PodEntry
from pagekv.router.scoring import Score


def pod(pod_id: str, role: str, budget: int = 0, backlog: int = 0,
        prefill_s: float | None = None) -> PodEntry:
    load = {"prefill_budget": budget, "prefill_backlog": backlog}
    costs = {"prefill": prefill_s} if prefill_s is not None else {}
    info = PodInfo(pod_id, f"127.0.0.1:{1000 + len(pod_id)}", "e", {}, load, costs, 0.0, 3000,
                   role=role)
    return PodEntry(info, stub=None)  # type: ignore[arg-type]  # (never called here)


def score(pod_id: str, cached: int = 0, pull_tokens: int = 0) -> Score:
    return Score(pod_id, "x:1", cached_gpu=cached, cost_s=0.1,
                 pull_from="other" if pull_tokens else "", pull_tokens=pull_tokens)


PODS = {p.pod_id: p for p in (pod("pre", ROLE_PREFILL), pod("dec", ROLE_DECODE, budget=96),
                              pod("mix", ROLE_MIXED))}


@pytest.mark.parametrize("threshold", [100, 200])
def test_a_prompt_is_split_from_the_threshold_on(threshold):
    cfg = RouterConfig(pd_threshold_tokens=threshold)  # above the decode pod's 96
    below, at = (plan_split([score("dec")], [score("pre")], PODS, n, cfg)
                 for n in (threshold - 1, threshold))
    assert below == (None, threshold, "local")
    plan, considered, decision = at
    assert decision == "split"
    assert considered == threshold and plan is not None
    assert [s.pod_id for s in plan.prefill_order] == ["pre"] and plan.uncached == threshold


def test_the_threshold_is_the_floor_or_the_decode_pods_measured_budget_if_larger():
    assert split_threshold(PODS["dec"], RouterConfig()) == 1024  # the default floor
    cfg = RouterConfig(pd_threshold_tokens=0)  # the budget alone
    assert split_threshold(PODS["dec"], cfg) == 96  # published load.prefill_budget
    assert split_threshold(PODS["mix"], cfg) == cfg.block_size  # unmeasured: one block
    assert split_threshold(PODS["dec"], RouterConfig(pd_threshold_tokens=10)) == 96
    assert split_threshold(PODS["dec"], RouterConfig(pd_threshold_tokens=200)) == 200
    assert plan_split([score("dec")], [score("pre")], PODS, 95, cfg)[0] is None  # (idle)
    assert plan_split([score("dec")], [score("pre")], PODS, 96, cfg)[0] is not None


def test_what_the_decode_pod_holds_or_pulls_is_not_uncached():
    cfg = RouterConfig(pd_threshold_tokens=64)  # (its budget, 96, applies)
    # 300 tokens, 256 of them cached on the decode pod: 44 left, under the threshold.
    assert plan_split([score("dec", cached=256)], [score("pre")], PODS, 300, cfg)[0] is None
    assert plan_split([score("dec", pull_tokens=256)], [score("pre")], PODS, 300, cfg)[0] is None
    plan = plan_split([score("dec", cached=100)], [score("pre")], PODS, 300, cfg)[0]
    assert plan is not None and plan.uncached == 200


def test_no_split_without_prefill_pods_when_off_or_onto_a_prefill_pod():
    cfg = RouterConfig(pd_threshold_tokens=128)
    assert plan_split([score("dec")], [], PODS, 500, cfg) == (None, 0, "")
    assert plan_split([score("dec")], [score("pre")], PODS, 500,
                      RouterConfig(pd_split=False)) == (None, 0, "")
    assert plan_split([score("pre")], [score("pre")], PODS, 500, cfg) == (None, 0, "")


def test_a_prefill_pod_whose_queue_outlasts_the_local_prefill_is_passed_over():
    # Both prefill at 1 ms a token; the decode pod would spend 300 ms on a 300-token prompt.
    pods = {p.pod_id: p for p in (
        pod("dec", ROLE_DECODE, budget=64, prefill_s=1e-3),
        pod("busy", ROLE_PREFILL, backlog=4000, prefill_s=1e-3),   # 4 s of queue
        pod("ready", ROLE_PREFILL, backlog=200, prefill_s=1e-3))}  # 0.2 s
    cfg = RouterConfig(pd_threshold_tokens=0)
    plan, _, decision = plan_split([score("dec")], [score("busy"), score("ready")], pods,
                                   300, cfg)
    assert decision == "split" and plan is not None
    assert [s.pod_id for s in plan.prefill_order] == ["ready"]
    plan, threshold, decision = plan_split([score("dec")], [score("busy")], pods, 300, cfg)
    assert plan is None and decision == "prefill_busy" and threshold == 64
    # A document long enough to outlast the queue still goes to the busy prefill pod.
    assert plan_split([score("dec")], [score("busy")], pods, 5000, cfg)[2] == "split"


def test_prefill_pods_serve_whole_requests_only_when_nothing_else_is_live():
    assert [p.pod_id for p in serving_pods(list(PODS.values()))] == ["dec", "mix"]
    only = [PODS["pre"]]
    assert serving_pods(only) == only


def test_a_pod_reported_fallback_is_a_bounded_label():
    assert fallback_label("deadline") == "deadline"
    assert fallback_label("x" * 300) == "other"


def record(fields: dict[str, str]) -> list:
    flat = []
    for k, v in {"address": "127.0.0.1:5", "epoch": "e1", **fields}.items():
        flat += [k.encode(), v.encode()]
    return [b"p1", b"e1", 3000, flat]


def test_the_role_travels_in_the_registration_and_a_forged_one_is_refused():
    bad = BadRecords()
    info = parse_pod_record(record(role_fields(ROLE_PREFILL)), bad)
    assert info is not None and info.role == ROLE_PREFILL
    legacy = parse_pod_record(record({}), bad)
    assert legacy is not None and legacy.role == ROLE_MIXED  # a pod from before roles
    assert parse_pod_record(record({"role": "boss"}), bad) is None
    assert bad.counts[BAD_REGISTRATION] == 1
    with pytest.raises(ValueError):
        role_fields("boss")


def test_a_forged_tiny_budget_is_read_as_one_block_at_least():
    cfg = RouterConfig(block_size=16, pd_threshold_tokens=0)
    assert split_threshold(pod("dec", ROLE_DECODE, budget=1), cfg) == 16
