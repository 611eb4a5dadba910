"""IndexSlots (proto/index/index_slots.py): index calls past the pool's size wait for a
slot in arrival order, a waiter cancelled (its request's deadline passed) leaves the queue
without taking a slot, and a wait past `wait_s` is a Redis timeout (REDIS_ERRORS)."""

from __future__ import annotations

import asyncio

import pytest

from pagekv.proto.index import REDIS_ERRORS
from pagekv.proto.index.index_slots import IndexSlots, SlotWaitTimeout


def test_waiters_queue_in_order_and_a_cancelled_one_leaves() -> None:
    async def main() -> list[str]:
        slots = IndexSlots(1, 5.0)
        order: list[str] = []
        release = asyncio.Event()

        async def call(name: str, hold: asyncio.Event | None = None) -> None:
            async with slots.held():
                order.append(name)
                if hold is not None:
                    await hold.wait()

        first = asyncio.create_task(call("first", release))
        await asyncio.sleep(0)
        waiters = [asyncio.create_task(call(n)) for n in ("second", "cancelled", "third")]
        await asyncio.sleep(0.01)
        waiters[1].cancel()  # gRPC cancels a handler whose deadline passed
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(first, waiters[0], waiters[2])
        assert waiters[1].cancelled()
        async with slots.held():  # every slot came back
            pass
        return order

    assert asyncio.run(main()) == ["first", "second", "third"]


def test_a_wait_past_its_bound_is_a_redis_timeout() -> None:
    async def main() -> None:
        slots = IndexSlots(2, 0.05)
        async with slots.held(), slots.held():
            with pytest.raises(SlotWaitTimeout) as err:
                async with slots.held():
                    pass
            assert isinstance(err.value, REDIS_ERRORS)
            assert "2 in use" in str(err.value)
        async with slots.held():  # the timed-out waiter took nothing
            pass

    asyncio.run(main())


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        IndexSlots(0, 1.0)
    with pytest.raises(ValueError):
        IndexSlots(4, 0.0)
