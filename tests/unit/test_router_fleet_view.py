"""The decision at fleet scale (#30): the pods kept ordered by load, the cold-placement ring,
the few pods a decision scores, and the choice they make against scoring every pod.

Pure: the index is scripted (the real Redis lookup: tests/integration/test_router_*.py and
bench/router_fleet.py)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter

import pytest

from pagekv.proto.index import IndexSchema, PodInfo, PodMatch
from pagekv.proto.index.schema import ROLE_PREFILL
from pagekv.proto.medium import Medium
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.router.cold_ring import NEIGHBOURS, ColdRing
from pagekv.router.config import RouterConfig
from pagekv.router.fleet_view import OTHERS, SCORE_ALL_PODS, FleetView
from pagekv.router.load_order import LoadOrder
from pagekv.router.metrics import RouterMetrics
from pagekv.router.placement import rendezvous_weight
from pagekv.router.pods import PodEntry
from pagekv.router.routing import Router
from pagekv.router.scoring import Candidate, CostModel, rank, score_all
from pagekv.router.tokenize import load_tokenizer

BS = 16
COSTS = CostModel(prefill_per_token=1e-3, cpu_per_token=1e-5, disk_per_token=1e-4,
                  queue_per_request=0.05, peer_per_token=1e-4)


class Item:
    def __init__(self, name: str, load: int) -> None:
        self.name, self.load = name, load


def order_of(items: list[Item]) -> LoadOrder[Item]:
    order: LoadOrder[Item] = LoadOrder(lambda i: i.load, lambda i: i.name)
    order.reset(items)
    return order


# -- the load order -----------------------------------------------------------------------------
def test_the_least_loaded_come_first_and_skipped_ones_are_left_out() -> None:
    items = [Item(f"p{i}", load) for i, load in enumerate([3, 0, 2, 0, 5, 1])]
    order = order_of(items)
    assert [i.name for i in order.least(3)] == ["p1", "p3", "p5"]
    assert [i.name for i in order.least(2, skip={"p1"})] == ["p3", "p5"]
    assert order.min_load() == 0 and len(order) == 6 and "p4" in order
    assert order.least(0) == []
    assert len(order.least(100)) == 6


def test_a_load_that_rose_unannounced_is_refiled_before_it_counts() -> None:
    items = [Item(f"p{i}", 0) for i in range(4)]
    order = order_of(items)
    items[0].load = items[1].load = 7  # raised behind the order's back (inflight += 1)
    assert [i.name for i in order.least(2)] == ["p2", "p3"]
    assert [i.name for i in order.least(4)] == ["p2", "p3", "p0", "p1"]
    items[2].load = items[3].load = 9
    assert order.min_load() == 7


def test_a_drop_is_announced_by_touch_and_discard_forgets() -> None:
    items = [Item(f"p{i}", 4) for i in range(3)]
    order = order_of(items)
    items[2].load = 1
    order.touch(items[2])
    assert order.least(1)[0].name == "p2" and order.min_load() == 1
    order.discard("p2")
    order.discard("absent")
    assert "p2" not in order and order.min_load() == 4
    # Back to an old load: behind its equals (a rotation among idle pods).
    items[0].load = 5
    order.touch(items[0])
    items[0].load = 4
    order.touch(items[0])
    assert [i.name for i in order.least(2)] == ["p1", "p0"]


def test_the_order_matches_a_sort_under_random_moves() -> None:
    rng = random.Random(3)
    items = [Item(f"p{i:02d}", rng.randrange(5)) for i in range(40)]
    order = order_of(items)
    for _ in range(500):
        item = rng.choice(items)
        if rng.random() < 0.5:
            item.load += 1  # unannounced
        else:
            item.load = max(0, item.load - 1)
            order.touch(item)
        got = order.least(5)
        assert sorted(i.load for i in got) == sorted(i.load for i in items)[:5]
        assert [i.load for i in got] == sorted(i.load for i in got)


# -- the ring -----------------------------------------------------------------------------------
def ring_of(names: list[str]) -> ColdRing[str]:
    ring: ColdRing[str] = ColdRing(lambda n: n)
    ring.update(names)
    return ring


def keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def test_a_small_fleet_walks_to_every_band_pod_so_the_choice_is_rendezvous() -> None:
    names = [f"pod-{i}" for i in range(NEIGHBOURS - 2)]
    ring = ring_of(names)
    for key in keys(50):
        band = ring.neighbours(key, lambda n: n != "pod-1")
        assert sorted(band) == sorted(n for n in names if n != "pod-1")


def test_the_ring_spreads_keys_evenly_and_a_leaving_pod_moves_few_others() -> None:
    names = [f"pod-{i:03d}" for i in range(64)]

    def winner(ring: ColdRing[str], key: bytes) -> str:
        return max(ring.neighbours(key, lambda n: True),
                   key=lambda n: rendezvous_weight(key, n))

    ring = ring_of(names)
    ks = keys(6400, seed=1)
    before = {k: winner(ring, k) for k in ks}
    counts = Counter(before.values())
    assert len(counts) == 64 and max(counts.values()) / (len(ks) / 64) < 1.6
    smaller = ring_of([n for n in names if n != "pod-007"])
    moved = [k for k in ks if winner(smaller, k) != before[k]]
    own = [k for k in ks if before[k] == "pod-007"]
    # Its own, and the few whose neighbourhood took in a pod that outweighs theirs.
    assert set(own) <= set(moved) and len(moved) <= 2.5 * len(own)
    # Rebuilt in another order: the same ring, the same choices (every router agrees).
    again = ring_of(list(reversed(names)))
    assert all(winner(again, k) == before[k] for k in ks[:200])


def test_an_empty_or_refusing_ring_names_no_one() -> None:
    assert ring_of([]).neighbours(b"k" * 32, lambda n: True) == []
    assert ring_of(["a", "b"]).neighbours(b"k" * 32, lambda n: False) == []


# -- the decision's candidates ------------------------------------------------------------------
SCHEMA = IndexSchema(RouterConfig().model, BS, RouterConfig().hash_algo,
                     RouterConfig().hash_seed)


def info(pod_id: str, waiting: int = 0, prefill: float | None = None, role: str = "mixed",
         backlog: float = 0.0) -> PodInfo:
    load = {"waiting": float(waiting), "running": 0.0, "free_blocks": 100.0,
            "prefill_backlog": backlog}
    costs = {"prefill": prefill} if prefill is not None else {}
    return PodInfo(pod_id, f"{pod_id}:1", "e1", SCHEMA.hash_config(), load, costs,
                   time.time(), 60_000, role=role)


class ScriptedIndex:
    def __init__(self, depths: dict[str, int]) -> None:
        self.depths = depths

    async def lookup_prefix(self, hashes, live, *args) -> dict[str, PodMatch]:
        return {p: PodMatch(d, [Medium.GPU] * d) for p, d in self.depths.items()
                if p in live and d}


def make_router(infos: list[PodInfo], depths: dict[str, int], **config) -> Router:
    router = Router(RouterConfig(costs=COSTS, burst_ttl_s=0.0, **config), None,
                    load_tokenizer("pagekv-tiny"), RouterMetrics())
    router.index = ScriptedIndex(depths)  # type: ignore[assignment]
    reg = router.registry
    reg.pods = {i.pod_id: PodEntry(i, None) for i in infos}  # type: ignore[arg-type]
    for entry in reg.pods.values():
        entry.lease_until = math.inf
    reg.index_up = True
    return router


def decide(router: Router, prompt: list[int]):
    prepared = router.prepare(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt)))
    return prepared, asyncio.run(router.decide(prepared))


def full_choice(router: Router, prompt: list[int], depths: dict[str, int]) -> float:
    """The best cost when every pod is scored (the decision before #30)."""
    view = router.view
    cands = [Candidate(p.pod_id, p.info.address, [Medium.GPU] * depths.get(p.pod_id, 0),
                       waiting=p.info.waiting, running=p.info.running, inflight=p.inflight,
                       free_blocks=p.info.free_blocks,
                       published_costs=view.published.get(p.pod_id, {}),
                       held_blocks=depths.get(p.pod_id, 0))
             for p in router.registry.pods.values()]
    scores = score_all(cands, len(prompt), BS, COSTS, True)
    order, _ = rank([s for s in scores if s.pod_id in view.serving], COSTS)
    return order[0].cost_s


@pytest.mark.parametrize("seed", range(12))
def test_the_few_scored_pods_choose_as_well_as_scoring_every_pod(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.choice([20, 64, 200])
    infos = [info(f"p{i:03d}", waiting=rng.randrange(12),
                  prefill=rng.choice([1e-3, 1e-3, 1e-3, 4e-4, 2e-3])) for i in range(n)]
    blocks = 12
    prompt = list(range(1, blocks * BS + 2))
    # A hot root held by many pods, a deeper prefix by a few.
    depths = {f"p{i:03d}": 2 for i in rng.sample(range(n), n // 3)}
    depths.update({f"p{i:03d}": rng.randrange(3, blocks + 1) for i in rng.sample(range(n), 3)})
    router = make_router(infos, depths)
    _, decision = decide(router, prompt)
    scored = [s for s in decision.scores if s.eligible]
    assert len(scored) < n  # not every pod
    best = full_choice(router, prompt, depths)
    chosen = decision.order[0]
    assert chosen.cost_s <= best + max(COSTS.tie_abs_s, COSTS.tie_rel * best) + 1e-12


def test_the_pods_scored_do_not_grow_with_the_fleet() -> None:
    prompt = list(range(1, 8 * BS + 2))
    sizes = {}
    for n in (16, 64, 256, 1024):
        infos = [info(f"p{i:04d}", waiting=i % 5) for i in range(n)]
        depths = {f"p{i:04d}": 2 for i in range(0, n, 3)}  # a third hold the root
        depths["p0001"] = 8
        _, decision = decide(make_router(infos, depths), prompt)
        sizes[n] = len(decision.scores)
        chosen = decision.order[0]
        assert "p0001" in (chosen.pod_id, chosen.pull_from)  # the deep prefix, held or pulled
    assert max(sizes.values()) <= 2 * OTHERS + 4 and sizes[1024] == sizes[16]


def test_a_small_fleet_is_scored_whole() -> None:
    infos = [info(f"p{i}") for i in range(SCORE_ALL_PODS)]
    _, decision = decide(make_router(infos, {}), list(range(1, 4 * BS + 2)))
    assert len(decision.scores) == SCORE_ALL_PODS


def test_a_cold_prompt_goes_to_its_rendezvous_pod_among_the_least_loaded() -> None:
    infos = [info(f"p{i:03d}", waiting=0 if i % 4 == 0 else 5) for i in range(100)]
    prompt = list(range(1, 4 * BS + 2))
    prepared, decision = decide(make_router(infos, {}), prompt)
    assert decision.reason == "cold_spread"
    chosen = decision.order[0]
    assert chosen.queue == 0
    # Another router, the same fleet: the same pod.
    _, again = decide(make_router(infos, {}), prompt)
    assert again.order[0].pod_id == chosen.pod_id


def test_fast_pods_are_always_scored() -> None:
    infos = [info(f"p{i:03d}", prefill=1e-3) for i in range(50)]
    infos.append(info("quick", waiting=3, prefill=1e-4))  # 10x: outside the speed band
    _, decision = decide(make_router(infos, {}), list(range(1, 20 * BS + 2)))
    assert "quick" in {s.pod_id for s in decision.scores}
    assert decision.order[0].pod_id == "quick"


def test_prefill_pods_are_scored_for_the_split_only_among_the_few() -> None:
    infos = [info(f"d{i:02d}", role="decode") for i in range(20)]
    infos += [info(f"f{i:02d}", role=ROLE_PREFILL, waiting=i) for i in range(20)]
    router = make_router(infos, {}, pd_threshold_tokens=64)
    _, decision = decide(router, list(range(1, 20 * BS + 2)))
    assert decision.order[0].pod_id.startswith("d")
    assert decision.split is not None
    assert [s.pod_id for s in decision.split.prefill_order][:2] == ["f00", "f01"]
    assert sum(1 for s in decision.scores if s.pod_id.startswith("f")) == OTHERS


def test_the_view_follows_the_registry() -> None:
    infos = [info(f"p{i:02d}") for i in range(20)]
    router = make_router(infos, {})
    decide(router, list(range(1, 4 * BS + 2)))
    assert len(router.view.serving) == 20
    router.registry.pods = {k: v for k, v in router.registry.pods.items() if k != "p03"}
    decide(router, list(range(1, 4 * BS + 2)))
    assert "p03" not in router.view.serving and len(router.view.serving) == 19


# -- sticky until saturated ---------------------------------------------------------------------
def test_sticky_keeps_a_warm_pod_until_its_backlog_costs_more_than_its_cache_saves() -> None:
    blocks = 40
    prompt = list(range(1, blocks * BS + 2))
    cached = blocks * BS
    infos = [info("warm", prefill=1e-3), *(info(f"c{i}", prefill=1e-3) for i in range(3))]
    router = make_router(infos, {"warm": blocks}, policy="sticky", kv_pull=False)
    warm = router.registry.pods["warm"]
    _, decision = decide(router, prompt)
    assert decision.order[0].pod_id == "warm"
    # Backlog below the saving (cached tokens at the same rate): still the warm pod.
    warm.add_backlog(cached - 100, 1e-3)
    _, decision = decide(router, prompt)
    assert decision.order[0].pod_id == "warm"
    # Past it: released to a cold pod.
    warm.add_backlog(300, 1e-3)
    _, decision = decide(router, prompt)
    assert decision.order[0].pod_id != "warm"
    # The prefix policy prices the same backlog per request: the warm pod (no queue).
    router = make_router(infos, {"warm": blocks}, policy="prefix", kv_pull=False)
    router.registry.pods["warm"].add_backlog(2 * cached, 1e-3)
    _, decision = decide(router, prompt)
    assert decision.order[0].pod_id == "warm"


def test_the_backlog_drains_at_the_measured_rate_and_the_published_one_counts() -> None:
    entry = PodEntry(info("p", backlog=0.0), None)  # type: ignore[arg-type]
    entry.add_backlog(1000, 1e-3)  # 1 s of work at 1 ms/token
    now = time.monotonic()
    assert entry.backlog(1e-3, now) == pytest.approx(1000, abs=5)
    assert entry.backlog(1e-3, now + 0.5) == pytest.approx(500, abs=5)
    assert entry.backlog(1e-3, now + 2.0) == 0.0
    busy = PodEntry(info("q", backlog=700.0), None)  # type: ignore[arg-type]
    assert busy.backlog(1e-3) == 700.0


def test_dispatch_adds_the_chosen_pods_uncached_tokens() -> None:
    blocks = 10
    prompt = list(range(1, blocks * BS + 2))
    router = make_router([info("a", prefill=1e-3), info("b", prefill=1e-3)], {"a": 4},
                         policy="sticky", kv_pull=False)
    prepared, decision = decide(router, prompt)
    assert decision.order[0].pod_id == "a"
    router.dispatched("a", prepared)
    assert router.registry.pods["a"].backlog(1e-3) == pytest.approx(len(prompt) - 4 * BS,
                                                                    abs=5)


def test_a_fleet_view_without_pods_is_empty() -> None:
    view = FleetView(COSTS)
    view.rebuild({}, [])
    assert view.others([], True) == [] and view.min_queue() == 0
    assert view.cold_pick(b"k" * 32, 0, 1.0, 10) is None


def test_the_backlog_is_gone_when_none_of_our_calls_is_left() -> None:
    entry = PodEntry(info("p"), None)  # type: ignore[arg-type]
    entry.add_backlog(900, 1.0)  # a slow drain: 1 s a token
    entry.inflight = 2  # three were sent, one ends: the others' prompts may still wait
    entry.call_finished()
    assert entry.backlog(1.0) == pytest.approx(900, abs=2)
    entry.inflight = 0  # the last of ours ended: nothing of ours is waiting there
    entry.call_finished()
    assert entry.backlog(1.0) == 0.0
