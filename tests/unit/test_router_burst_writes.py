"""The router's shared burst writes without Redis (a scripted index): off the request's path,
failures counted and never raised, bounded in flight, and the --[no-]shared-bursts flag.
Against a real Redis and several routers: tests/integration/test_router_shared_bursts.py.
"""

from __future__ import annotations

import argparse
import asyncio

import redis

from pagekv.router import cli
from pagekv.router.metrics import RouterMetrics
from pagekv.router.shared_bursts import MAX_IN_FLIGHT, MAX_PODS_PER_KEY, SharedBursts

CHAIN = [bytes([i]) * 32 for i in range(6)]


class ScriptedIndex:
    """Records each predict call; fails with `error`; waits on `gate` when one is set."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[tuple] = []
        self.error = error
        self.gate: asyncio.Event | None = None

    def claim_id_of(self, pod_id: str) -> bytes | None:
        """The registry's claim ids: pod-x has no valid one."""
        return None if pod_id == "pod-x" else b"\x02" + pod_id[-1].encode() * 3

    async def predict(self, claim_id, block_hashes, start, ttl_ms, max_pods) -> int:
        self.calls.append((claim_id, list(block_hashes[start:]), ttl_ms, max_pods))
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return len(block_hashes) - start


def counts(metrics: RouterMetrics) -> dict[str, float]:
    get = metrics.registry.get_sample_value
    return {r: get("pagekv_router_shared_predictions_total", {"result": r}) or 0.0
            for r in ("written", "error", "dropped")}


def test_writes_the_blocks_past_the_held_prefix_off_the_callers_path() -> None:
    async def run() -> None:
        index, metrics = ScriptedIndex(), RouterMetrics()
        shared = SharedBursts(index, 2.0, metrics)  # type: ignore[arg-type]
        shared.record("pod-a", CHAIN, 4)
        assert index.calls == []  # not yet: the caller goes on first
        shared.record("pod-b", CHAIN, 6)  # the index holds it all there: nothing to write
        shared.record("pod-x", CHAIN, 0)  # no valid claim id: not predicted
        await asyncio.sleep(0)
        assert index.calls == [(b"\x02aaa", CHAIN[4:], 2000, MAX_PODS_PER_KEY)]
        assert counts(metrics) == {"written": 1, "error": 0, "dropped": 0}

    asyncio.run(run())


def test_failures_are_counted_not_raised_and_the_backlog_is_bounded() -> None:
    async def run() -> None:
        index, metrics = ScriptedIndex(redis.ConnectionError("refused")), RouterMetrics()
        shared = SharedBursts(index, 2.0, metrics)  # type: ignore[arg-type]
        index.gate = asyncio.Event()
        for _ in range(MAX_IN_FLIGHT + 5):
            shared.record("pod-a", CHAIN, 0)
        assert counts(metrics)["dropped"] == 5
        await asyncio.sleep(0)
        index.gate.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert counts(metrics) == {"written": 0, "error": MAX_IN_FLIGHT, "dropped": 5}
        shared.record("pod-a", CHAIN, 0)  # room again once they ended
        await shared.close()  # cancels what still waits, raises nothing

    asyncio.run(run())


def test_without_a_running_loop_nothing_is_written() -> None:
    index, metrics = ScriptedIndex(), RouterMetrics()
    SharedBursts(index, 2.0, metrics).record("pod-a", CHAIN, 0)  # type: ignore[arg-type]
    assert index.calls == [] and counts(metrics)["written"] == 0


def test_the_flag_turns_sharing_off() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.config_from(parser.parse_args([])).shared_bursts is True
    assert cli.config_from(parser.parse_args(["--no-shared-bursts"])).shared_bursts is False
