"""proto.loop_thread: an asyncio loop in a daemon thread, driven from blocking code."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagekv.proto.loop_thread import LoopThread


async def _where() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


def test_run_returns_the_coroutines_result_from_the_loop_thread() -> None:
    lt = LoopThread("probe-loop")
    try:
        assert lt.thread.daemon
        assert lt.run(_where(), 10) == "probe-loop"
        assert lt.submit(_where()).result(10) == "probe-loop"
    finally:
        assert lt.stop()


def test_errors_and_timeouts_reach_the_caller() -> None:
    async def boom() -> None:
        raise KeyError("x")

    lt = LoopThread("probe-loop")
    try:
        with pytest.raises(KeyError):
            lt.run(boom(), 10)
        with pytest.raises(TimeoutError):
            lt.run(asyncio.sleep(5), 0.05)
        assert lt.run(_where(), 10) == "probe-loop"  # still serving
    finally:
        lt.stop()


def test_blocking_call_from_the_loop_thread_is_refused_not_deadlocked() -> None:
    lt = LoopThread("probe-loop")
    try:
        async def nested() -> str:
            try:
                lt.run(_where(), 1)
            except RuntimeError as exc:
                return str(exc)
            return "ran"

        assert "own thread" in lt.run(nested(), 10)
    finally:
        lt.stop()


def test_call_soon_and_the_default_executor() -> None:
    executor = ThreadPoolExecutor(1, thread_name_prefix="probe-io")
    lt = LoopThread("probe-loop", executor)
    try:
        done = threading.Event()
        lt.call_soon(done.set)
        assert done.wait(10)

        async def in_executor() -> str:
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: threading.current_thread().name)

        assert lt.run(in_executor(), 10).startswith("probe-io")
    finally:
        lt.stop()


def test_stop_joins_the_thread_closes_the_loop_and_is_idempotent() -> None:
    lt = LoopThread("probe-loop")
    assert lt.stop(10)
    assert not lt.thread.is_alive() and lt.loop.is_closed()
    assert lt.stop(10)
