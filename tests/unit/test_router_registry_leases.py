"""The router's registry as the bound on how stale a lookup's pods are (a lookup reads no
lease: on a Redis Cluster the leases sit on another shard): pods whose lease as last read
ran out are dropped, the refresh keeps ahead of the shortest lease, and an outage that ends
with no pod listed keeps the last known ones. A scripted IndexClient, no Redis."""

from __future__ import annotations

import asyncio
import time

from pagekv.proto.index import IndexSchema, PodInfo
from pagekv.router.metrics import RouterMetrics
from pagekv.router.pods import PodRegistry

SCHEMA = IndexSchema("m", 16, "sha256", "s")


def info(pod: str, lease_ms: int, epoch: str = "e1") -> PodInfo:
    """A registration; its claim id follows from pod id and epoch (a new one per epoch)."""
    return PodInfo(pod, "127.0.0.1:1", epoch, SCHEMA.hash_config(), {}, {}, time.time(),
                   lease_ms, claim_id=claim_id(pod, epoch))


def claim_id(pod: str, epoch: str) -> bytes:
    return bytes(2 + b % 254 for b in f"{pod}/{epoch}".encode().ljust(4, b"-")[:4])


class ScriptedIndex:
    """What list_live_pods returns next (or raises); the config key's presence."""

    def __init__(self) -> None:
        self.schema = SCHEMA
        self.replies: list[list[PodInfo] | Exception] = []
        self.config = True

    async def list_live_pods(self, schema: IndexSchema | None = None) -> list[PodInfo]:
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def has_config(self) -> bool:
        return self.config

    async def other_namespaces(self) -> dict:
        return {}

    async def dead_pods(self) -> dict:
        return {}


def test_expired_leases_drop_out_and_the_refresh_keeps_ahead_of_them():
    async def go() -> None:
        index = ScriptedIndex()
        reg = PodRegistry(index, RouterMetrics(), refresh_interval_s=0.5)  # type: ignore[arg-type]
        index.replies = [[info("a", 3000), info("b", 150, "e7")]]
        assert await reg.refresh()
        assert reg.live_epochs() == {"a": "e1", "b": "e7"}
        assert reg.next_refresh_s() == 0.075  # half b's lease: seen renewed before it ends
        reg.drop_expired(time.monotonic() + 0.2)
        assert reg.live_epochs() == {"a": "e1"}
        assert reg.next_refresh_s() == 0.5
        # While the index is down the last known pods stay, expired or not.
        index.replies = [ConnectionError("down")]
        assert not await reg.refresh()
        reg.drop_expired(time.monotonic() + 10)
        assert set(reg.pods) == {"a"}
        await reg.close()

    asyncio.run(go())


def test_an_outage_that_ends_with_no_pod_listed_keeps_the_last_known():
    async def go() -> None:
        index = ScriptedIndex()
        reg = PodRegistry(index, RouterMetrics(), refresh_interval_s=0.5)  # type: ignore[arg-type]
        index.replies = [[info("a", 3000)], ConnectionError("failover"), [], [info("a", 3000)]]
        assert await reg.refresh()
        assert not await reg.refresh()
        # Back, but every lease ran out meanwhile (the pods are re-registering): keep "a".
        assert not await reg.refresh() and set(reg.pods) == {"a"} and not reg.index_up
        assert await reg.refresh() and reg.index_up
        # Without an outage, an empty list with the config key present is believed.
        index.replies = [[]]
        assert await reg.refresh() and reg.pods == {}
        await reg.close()

    asyncio.run(go())


def test_the_lookups_packed_pods_are_built_once_until_the_pods_change():
    async def go() -> None:
        index = ScriptedIndex()
        reg = PodRegistry(index, RouterMetrics(), refresh_interval_s=0.5)  # type: ignore[arg-type]
        index.replies = [[info("a", 3000), info("b", 150, "e7"), info("bad\0id", 3000)],
                         [info("a", 3000, "e2")]]
        assert await reg.refresh()
        live = reg.live_pods()
        assert reg.live_pods() is live  # per request: the same object, nothing rebuilt
        a1, b7, a2 = claim_id("a", "e1"), claim_id("b", "e7"), claim_id("a", "e2")
        assert dict(live) == {"a": a1, "b": b7, "bad\0id": claim_id("bad\0id", "e1")}
        assert live.pods_of == {a1: "a", b7: "b", claim_id("bad\0id", "e1"): "bad\0id"}
        reg.drop_expired(time.monotonic() + 0.2)  # b's lease ran out
        assert reg.live_pods().pods_of == {a1: "a", claim_id("bad\0id", "e1"): "bad\0id"}
        assert await reg.refresh()  # a restarted: a new epoch, a new claim id
        assert a2 != a1 and reg.live_pods().pods_of == {a2: "a"}
        await reg.close()

    asyncio.run(go())
