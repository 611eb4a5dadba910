"""The reconnect backoff's delays (proto/backoff.py): capped, exponential bounds, and spread
by full jitter so that clients that failed together do not retry together."""

from __future__ import annotations

import random
import statistics

import pytest

from pagekv.proto.backoff import jittered_backoff_s

START, CAP = 0.05, 2.0


def test_each_wait_stays_under_its_exponential_bound_and_the_cap() -> None:
    rng = random.Random(7)
    for retry in range(200):  # far past the cap, and past any float overflow of 2**retry
        bound = min(CAP, START * 2 ** min(retry, 60))
        draws = [jittered_backoff_s(retry, START, CAP, rng) for _ in range(200)]
        assert all(0.0 <= d <= bound for d in draws), (retry, max(draws))
    assert jittered_backoff_s(10_000, START, CAP) <= CAP


def test_a_fleet_that_failed_together_retries_spread_over_the_whole_range() -> None:
    """1000 pods, each at its 12th wait (well past the cap): their waits cover [0, cap]
    evenly, instead of 1000 pods retrying at the same instant."""
    rng = random.Random(11)
    waits = [jittered_backoff_s(12, START, CAP, rng) for _ in range(1000)]
    assert len({round(w, 3) for w in waits}) > 600  # millisecond-distinct instants
    assert statistics.pstdev(waits) > CAP / 4  # uniform on [0, 2]: 0.58
    tenths = {int(w / (CAP / 10)) for w in waits}
    assert tenths >= set(range(10))  # every tenth of the range is used
    # and no pile-up at the cap, which decorrelated jitter clamped would make
    assert sum(w > CAP - 0.01 for w in waits) < 30


def test_early_waits_stay_short() -> None:
    rng = random.Random(3)
    assert max(jittered_backoff_s(0, START, CAP, rng) for _ in range(100)) <= START
    assert max(jittered_backoff_s(3, START, CAP, rng) for _ in range(100)) <= START * 8


@pytest.mark.parametrize("retry,start,cap", [(-1, 0.05, 2.0), (0, 0.0, 2.0), (0, 1.0, 0.5)])
def test_nonsense_arguments_are_refused(retry: int, start: float, cap: float) -> None:
    with pytest.raises(ValueError, match="0 < start_s <= cap_s"):
        jittered_backoff_s(retry, start, cap)
