"""The router's progress bound of a pod call (router/stall.py) and its settings: pure
arithmetic, so tested alone; the behaviour against stopped pods is in
tests/integration/test_router_hung_pods.py."""

from __future__ import annotations

import math

import pytest

from pagekv.router.config import RouterConfig
from pagekv.router.stall import StallBound

BOUND = StallBound(floor_s=5.0, factor=4.0, cap_s=60.0, cooldown_s=2.0)


def test_the_chunk_bound_grows_with_the_estimated_ttft_up_to_the_cap() -> None:
    assert BOUND.chunk_s(0.0) == 5.0
    assert BOUND.chunk_s(1.5) == pytest.approx(11.0)
    assert BOUND.chunk_s(100.0) == 60.0
    assert BOUND.chunk_s(math.inf) == 60.0  # no estimate: the cap, never unbounded
    assert StallBound(5.0, 4.0, 1.0, 2.0).chunk_s(0.0) == 5.0  # a cap below the floor


def test_a_zero_floor_means_no_bound() -> None:
    off = StallBound(0.0, 4.0, 60.0, 2.0)
    assert off.chunk_s(1.0) is None and off.unary_s(1.0, 16, 0.01) is None


def test_the_unary_bound_counts_max_tokens_steps() -> None:
    assert BOUND.unary_s(0.0, None, 0.01) is None  # no max_tokens: the deadline only
    assert BOUND.unary_s(0.0, 10, 0.0) == pytest.approx(55.0)  # unmeasured: a backstop
    assert BOUND.unary_s(0.0, 10, 0.02) == pytest.approx(5.0 + 4.0 * 10 * 0.02)


def test_the_cooldown_doubles_per_stall_in_a_row_up_to_30_s() -> None:
    assert [BOUND.cooldown_after(n) for n in (1, 2, 3, 4, 10)] == [2.0, 4.0, 8.0, 16.0, 30.0]


@pytest.mark.parametrize("fields, needle", [
    ({"pod_stall_floor_s": -1.0}, "pod_stall_floor_s"),
    ({"pod_keepalive_s": 0.5}, "pods refuse faster pings"),
    ({"pod_keepalive_timeout_s": 0.0}, "pod_keepalive_timeout_s"),
])
def test_bad_settings_are_refused(fields: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        RouterConfig(**fields)  # type: ignore[arg-type]
    assert RouterConfig(pod_keepalive_s=0.0).pod_keepalive_s == 0.0  # 0: off, accepted
