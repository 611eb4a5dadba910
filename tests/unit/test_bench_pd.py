"""bench.pd's pure parts: the seeded workload (the same schedule for every configuration),
the token gaps, their classes (what the chat's pod did for a long prompt meanwhile) and the
summary the tables print."""

from __future__ import annotations

import math

import pytest

from bench.pd import (
    CHAT,
    HANDOVER,
    LONG,
    OTHER,
    PREFILLING,
    Result,
    WorkloadSpec,
    arrived_during_prefill,
    busy_windows,
    classify_gaps,
    gaps,
    handovers_by_holder_state,
    make_workload,
    parse_variant,
    quantiles_ms,
    summarize,
)

SPEC = WorkloadSpec(duration_s=60.0)


def test_the_workload_is_seeded_sorted_and_bounded():
    w = make_workload(SPEC, 3)
    assert w == make_workload(SPEC, 3)
    assert w != make_workload(SPEC, 4)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(w, w[1:], strict=False))
    assert all(0 <= r.arrival_s < SPEC.duration_s for r in w)
    chats = [r for r in w if r.kind == CHAT]
    longs = [r for r in w if r.kind == LONG]
    assert chats and longs
    assert all(SPEC.long_tokens[0] <= len(r.prompt) <= SPEC.long_tokens[1] for r in longs)
    assert all(SPEC.long_out[0] <= r.max_tokens <= SPEC.long_out[1] for r in longs)
    assert all(SPEC.chat_out[0] <= r.max_tokens <= SPEC.chat_out[1] for r in chats)
    assert all(len(r.prompt) <= SPEC.opening_tokens[1] + (SPEC.turns - 1) * SPEC.turn_tokens[1]
               for r in chats)


def test_a_conversations_turns_extend_its_previous_prompt():
    w = make_workload(SPEC, 1)
    by_conv: dict[int, list] = {}
    for r in w:
        if r.kind == CHAT:
            by_conv.setdefault(r.conversation, []).append(r)
    multi = [turns for turns in by_conv.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        assert [t.turn for t in turns] == list(range(len(turns)))
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.prompt[:len(prev.prompt)] == prev.prompt
            assert len(nxt.prompt) - len(prev.prompt) >= SPEC.turn_tokens[0]
            assert nxt.arrival_s - prev.arrival_s >= SPEC.think_s[0]


def test_gaps_and_quantiles():
    assert gaps([1.0, 1.5, 3.0]) == [0.5, 1.5]
    assert gaps([2.0]) == []
    assert quantiles_ms([0.001, 0.002, 0.003, 0.004], (0.5, 0.9)) == [3.0, 4.0]
    assert all(math.isnan(x) for x in quantiles_ms([]))


def _long(arrival, ttft, served, prefill_pod="", prefill_ms=0.0):
    return Result(LONG, arrival, 5000, ttft_s=ttft, done_s=arrival + ttft + 1.0,
                  chunk_s=[arrival + ttft, arrival + ttft + 1.0], tokens=[1, 2],
                  served_by=served, prefill_pod=prefill_pod, prefill_ms=prefill_ms)


def test_gaps_are_classed_by_what_the_chats_own_pod_did_for_long_prompts():
    split = _long(10.0, 5.0, "dec", "pre", 4000.0)   # prefill 10-14 on pre, handover 14-15
    whole = _long(20.0, 3.0, "dec")                  # prefilling on dec 20-23
    w = busy_windows([split, whole])
    assert w == {"pre": {PREFILLING: [(10.0, 14.0)]},
                 "dec": {HANDOVER: [(14.0, 15.0)], PREFILLING: [(20.0, 23.0)]}}
    chat = Result(CHAT, 0.0, 100, chunk_s=[12.0, 13.0, 14.5, 16.0, 21.0, 22.0, 30.0],
                  served_by="dec")
    got = classify_gaps(chat, w)
    assert got == {PREFILLING: [5.0, 1.0, 8.0], HANDOVER: [1.5, 1.5], OTHER: [1.0]}
    # The same gaps on a pod that did none of it are all "neither".
    chat.served_by = "other"
    assert classify_gaps(chat, w)[OTHER] == gaps(chat.chunk_s)


def test_summary_counts_failures_splits_and_rates_per_run():
    chat = Result(CHAT, 0.0, 100, ttft_s=0.2, done_s=2.0, chunk_s=[0.2, 0.3, 0.5],
                  tokens=[1, 2, 3], served_by="dec", prefill_pod="pre", prefill_ms=150.0,
                  handover_ms=8.0, handover_tokens=96, pd_threshold=32)
    failed = Result(CHAT, 1.0, 100, error="UNAVAILABLE: gone")
    other_run = [Result(CHAT, 0.0, 50, ttft_s=0.1, done_s=1.0, chunk_s=[0.1, 0.2],
                        tokens=[1, 2], served_by="dec", pd_threshold=32)]
    s = summarize([[chat, failed], other_run])
    assert (s["requests"], s["failed"], s["chat"], s["long"]) == (3, 1, 2, 0)
    assert s["split"] == {CHAT: 1, LONG: 0}
    assert s["prefill_ms"][0] == pytest.approx(150.0)
    assert s["handover_ms"][0] == pytest.approx(8.0)
    assert s["thresholds"] == {"32": 2}
    assert s["output_tokens_per_s"] == pytest.approx((3 / 2.0 + 2 / 1.0) / 2)
    assert s["ttft_chat_ms"][0] == pytest.approx(200.0)
    assert sorted(s["gaps_chat_by_class"].items()) == sorted(
        {PREFILLING: 0, HANDOVER: 0, OTHER: 3}.items())


def test_handovers_are_classed_by_whether_their_prefill_pod_was_prefilling_another_prompt():
    first = _long(10.0, 5.0, "dec", "pre", 4000.0)    # prefill 10-14, handover 14-15
    second = _long(12.0, 6.0, "dec", "pre", 5000.0)   # prefill 12-17: over first's handover
    third = _long(30.0, 2.0, "dec", "pre", 1500.0)    # alone
    chat = Result(CHAT, 16.0, 80, ttft_s=1.5, done_s=18.0, chunk_s=[17.5], tokens=[1],
                  served_by="dec", prefill_pod="pre", prefill_ms=500.0)  # handover 16.5-17.5
    got = handovers_by_holder_state([first, second, third, chat])
    assert got == {"busy": [first, chat], "idle": [second, third]}


def test_variants_name_a_threshold_and_maybe_a_pull_deadline():
    assert parse_variant("1024") == (1024, 0.0)
    assert parse_variant("64:10") == (64, 10.0)
    with pytest.raises(ValueError):
        parse_variant("x")


def test_a_chat_arriving_while_its_prompts_pod_prefills_a_long_prompt_is_told_apart():
    whole = _long(20.0, 3.0, "dec")                 # prefilling on dec 20-23
    split = _long(10.0, 5.0, "dec", "pre", 4000.0)  # prefilling on pre 10-14
    w = busy_windows([whole, split])
    on_dec = Result(CHAT, 21.0, 80, ttft_s=2.1, served_by="dec")
    split_chat = Result(CHAT, 12.0, 80, ttft_s=2.5, served_by="dec", prefill_pod="pre",
                        prefill_ms=2300.0)
    late = Result(CHAT, 23.5, 80, ttft_s=0.1, served_by="dec")
    assert arrived_during_prefill(on_dec, w) and arrived_during_prefill(split_chat, w)
    assert not arrived_during_prefill(late, w)
    assert not arrived_during_prefill(whole, w) and not arrived_during_prefill(split, w)
