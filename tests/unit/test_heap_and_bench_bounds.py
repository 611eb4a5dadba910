"""The start-up heap freeze, and the routing benchmark's analytic bounds."""

import gc
import logging
from dataclasses import replace

import pytest

from bench.routing_workloads import FULL, group_oracle, scatter_bound
from pagekv.proto.heap import freeze_startup_heap


def test_freeze_moves_survivors_out_of_full_collections(caplog):
    keep = [object() for _ in range(1000)]  # noqa: F841 - alive across the freeze
    try:
        with caplog.at_level(logging.INFO):
            frozen = freeze_startup_heap(logging.getLogger("test"))
        assert frozen >= 1000 and gc.get_freeze_count() > 0
        assert f"froze {frozen} start-up objects" in caplog.text
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 16])
def test_scatter_bound(p):
    w = replace(FULL, prompts_per_group=p)
    oracle = group_oracle(w)
    assert scatter_bound(w, pods=1) == pytest.approx(oracle)  # one pod: nothing scatters
    bound = scatter_bound(w, pods=4)
    assert 0.0 <= bound < oracle or p == 1 and bound == oracle == 0.0
    if p == 2:  # the second prompt lands on the first's pod one time in four
        assert bound == pytest.approx(oracle / 4)
    # More pods scatter more.
    assert scatter_bound(w, pods=8) <= bound
