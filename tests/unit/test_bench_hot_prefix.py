"""bench.hot_prefix's pure helpers: the open-loop arrival schedule (the same for every
configuration it compares) and the per-run summary (what its table's ratios divide)."""

from __future__ import annotations

import pytest

from bench.hot_prefix import Result, arrival_times, summarize


def test_constant_arrivals_are_evenly_spaced_from_zero():
    assert arrival_times(4, 2.0) == [0.0, 0.5, 1.0, 1.5]
    assert arrival_times(0, 3.0) == []


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate():
    a = arrival_times(2000, 4.0, "poisson", seed=7)
    assert a == arrival_times(2000, 4.0, "poisson", seed=7)
    assert a != arrival_times(2000, 4.0, "poisson", seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    assert len(a) / a[-1] == pytest.approx(4.0, rel=0.1)


@pytest.mark.parametrize("n, rate, kind", [(-1, 1.0, "constant"), (3, 0.0, "constant"),
                                           (3, 1.0, "bursty")])
def test_bad_schedules_are_refused(n, rate, kind):
    with pytest.raises(ValueError):
        arrival_times(n, rate, kind)


def test_summary_times_the_ok_requests_and_counts_the_rest():
    rs = [Result(0.0, ttft_s=0.1, done_s=1.0, tokens=[1, 2], served_by="a",
                 reason="prefix_hit", cached=64),
          Result(0.5, ttft_s=0.3, done_s=2.0, tokens=[3, 4], served_by="b",
                 reason="peer_pull", cached=64, cached_peer=64),
          Result(1.0, error="UNAVAILABLE: gone")]
    s = summarize(rs)
    assert (s["requests"], s["failed"]) == (3, 1)
    assert s["ttft_p50_ms"] == pytest.approx(300.0) and s["ttft_max_ms"] == pytest.approx(300)
    assert s["span_s"] == 2.0 and s["requests_per_s"] == 1.0
    assert s["output_tokens_per_s"] == 2.0
    assert s["served_by"] == {"a": 1, "b": 1}
    assert s["reasons"] == {"prefix_hit": 1, "peer_pull": 1}
    assert (s["pulls"], s["cached_tokens_peer"], s["cached_tokens"]) == (1, 64, 128)
