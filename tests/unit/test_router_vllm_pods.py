"""vLLM pods in the router's decision: scored as any pod, but with the configured costs (a
vLLM pod publishes none; the peers' median is for a PageKV pod that has not measured yet),
never given the pull option, never a pull source; the registry reaches them over HTTP. A
scripted index, no Redis; over real pods: tests/integration/test_router_vllm.py."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from pagekv.proto.index import IndexSchema, PodInfo, PodMatch
from pagekv.proto.index.schema import POD_KIND_PAGEKV, POD_KIND_VLLM
from pagekv.proto.medium import Medium
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.router.config import RouterConfig
from pagekv.router.metrics import RouterMetrics
from pagekv.router.openai_forward import VllmStub
from pagekv.router.pods import PodEntry, PodRegistry
from pagekv.router.routing import Router
from pagekv.router.scoring import CostModel
from pagekv.router.tokenize import load_tokenizer

BS = 16
COSTS = CostModel(prefill_per_token=1e-3, cpu_per_token=1e-5, disk_per_token=1e-4,
                  queue_per_request=0.05, peer_per_token=1e-4, tie_rel=0.0, tie_abs_s=0.0)
PROMPT = list(range(1, 6 * BS + 2))  # 6 blocks can hit


def pod(pod_id: str, kind: str, costs: dict[str, float] | None = None) -> PodInfo:
    cfg = RouterConfig()
    schema = IndexSchema(cfg.model, cfg.block_size, cfg.hash_algo, cfg.hash_seed)
    return PodInfo(pod_id, f"{pod_id}:1", "e1", schema.hash_config(), {}, costs or {},
                   time.time(), 60_000, kind=kind,
                   http_address=f"{pod_id}:8000" if kind == POD_KIND_VLLM else "")


class ScriptedIndex:
    def __init__(self, depths: dict[str, int]) -> None:
        self.depths = depths

    async def lookup_prefix(self, hashes, live, *args) -> dict[str, PodMatch]:
        return {p: PodMatch(d, [Medium.GPU] * d) for p, d in self.depths.items() if p in live}


def decide(infos: list[PodInfo], depths: dict[str, int]):
    router = Router(RouterConfig(costs=COSTS, burst_ttl_s=0.0), None,
                    load_tokenizer("pagekv-tiny"), RouterMetrics())
    router.index = ScriptedIndex(depths)  # type: ignore[assignment]
    reg = router.registry
    reg.pods = {i.pod_id: PodEntry(i, None) for i in infos}  # type: ignore[arg-type]
    for entry in reg.pods.values():
        entry.lease_until = math.inf
    reg.index_up = True
    prepared = router.prepare(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT)))
    decision = asyncio.run(router.decide(prepared))
    return {s.pod_id: s for s in decision.scores}, decision


def test_a_vllm_pod_is_scored_with_the_configured_costs() -> None:
    # A PageKV pod measured 10x faster than configured; a fresh one has measured nothing.
    scores, _ = decide([pod("fast", POD_KIND_PAGEKV, {"prefill": 1e-4}),
                        pod("fresh", POD_KIND_PAGEKV), pod("v", POD_KIND_VLLM)], {})
    assert scores["fast"].cost_s == pytest.approx(len(PROMPT) * 1e-4)
    assert scores["fresh"].cost_s == pytest.approx(len(PROMPT) * 1e-4)  # the peers' median
    assert scores["v"].cost_s == pytest.approx(len(PROMPT) * 1e-3)  # configured


def test_a_vllm_pod_never_pulls_and_is_never_pulled_from() -> None:
    # The PageKV pod holds 4 blocks: a PageKV peer without them would pull (peer 1e-4 is
    # far below prefill 1e-3); the vLLM pod cannot.
    scores, decision = decide([pod("p", POD_KIND_PAGEKV), pod("q", POD_KIND_PAGEKV),
                               pod("v", POD_KIND_VLLM)], {"p": 4})
    assert scores["q"].pull_from == "p" and scores["q"].pull_tokens == 4 * BS
    assert scores["v"].pull_from == "" and scores["v"].pull_tokens == 0
    assert scores["v"].cost_s == pytest.approx(len(PROMPT) * 1e-3)
    assert decision.order[0].pod_id == "p"
    # The vLLM pod holds the longest prefix: no one is offered a pull from it.
    scores, decision = decide([pod("p", POD_KIND_PAGEKV), pod("v", POD_KIND_VLLM)], {"v": 6})
    assert scores["p"].pull_from == "" and decision.order[0].pod_id == "v"
    assert scores["v"].cached_tokens == 6 * BS


def test_the_registry_reaches_a_vllm_pod_over_http() -> None:
    class Listing:
        schema = IndexSchema(RouterConfig().model, BS, "sha256", RouterConfig().hash_seed)

        async def list_live_pods(self, schema=None):
            return [pod("p", POD_KIND_PAGEKV), pod("v", POD_KIND_VLLM)]

        async def other_namespaces(self):
            return {}

        async def dead_pods(self):
            return {}

    async def go() -> None:
        reg = PodRegistry(Listing(), RouterMetrics(), pod_token="t")  # type: ignore[arg-type]
        assert await reg.refresh()
        stub = reg.pods["v"].stub
        assert isinstance(stub, VllmStub) and stub.address == "v:8000"
        assert not isinstance(reg.pods["p"].stub, VllmStub)
        await reg.close()

    asyncio.run(go())
