"""bench.scale against a real redis-server: the pods' publishers in worker processes (a
tick returns with its claims visible; the load reaches the registry with the lease), the
same through threads in this process, and a short simulated run whose router is restarted
mid-way (the new one sees the fleet at its first read and every request is served)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from bench.scale import Index, SimOptions, simulate, summarize
from bench.scale_pod import PRESETS, PodConfig, SimPod
from bench.scale_publishers import PodSpec, PodUpdate, ThreadPublishers, WorkerPublishers
from bench.scale_trace import TraceConfig, trace_for_load
from pagekv.deploy.redis_server import RedisProcess
from pagekv.proto.hashing import HashConfig, RequestBlockHasher
from pagekv.proto.index import IndexSchema, connect_async
from pagekv.proto.kv_events import BlockStored
from pagekv.router.config import RouterConfig
from pagekv.router.metrics import RouterMetrics
from pagekv.router.routing import Router
from pagekv.router.tokenize import ByteEncoder

MODEL, BS, ALGO, SEED = "sim-test", 16, "sha256", "vllm-none-hash"
SCHEMA = IndexSchema(MODEL, BS, ALGO, SEED)


def _chain(tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    RequestBlockHasher(HashConfig(ALGO, SEED), BS).extend(tokens, hashes)
    return hashes


async def _held(url: str, hashes: list[bytes]) -> tuple[dict[str, int], dict[str, int]]:
    """(pod -> consecutive blocks of `hashes` it holds, pod -> its published `waiting`), as
    a router reads them."""
    cfg = RouterConfig(redis_url=url, model=MODEL, block_size=BS, hash_algo=ALGO,
                       hash_seed=SEED, shared_bursts=False)
    router = Router(cfg, connect_async(url, 2.0), ByteEncoder(), RouterMetrics())
    try:
        await router.index.register_scripts()
        await router.registry.refresh()
        matches = await router.index.lookup_prefix(hashes, router.registry.live_pods())
        waiting = {p.pod_id: p.info.waiting for p in router.registry.eligible()}
        return {k: m.depth for k, m in matches.items()}, waiting
    finally:
        await router.registry.close()
        await router.index.aclose()


@pytest.mark.parametrize("where", ["process", "thread"])
def test_a_tick_returns_with_its_claims_visible(redis_server: RedisProcess, where: str):
    cost = PRESETS["pagekv-small"]
    pods = [SimPod(i, f"pod-{i}", replace(PodConfig(), pool_blocks=64), cost)
            for i in range(3)]
    pubs = (WorkerPublishers(redis_server.url, SCHEMA,
                             [PodSpec(p.pod_id, p.address) for p in pods], workers=2)
            if where == "process" else ThreadPublishers(redis_server.url, SCHEMA, pods))
    hashes = _chain(list(range(5 * BS)))
    try:
        pubs.start()
        event = BlockStored(hashes[:4], None, [], BS)
        lags, late = pubs.tick({"pod-0": PodUpdate(events=[event], load={"waiting": 5}),
                                "pod-2": PodUpdate(events=[BlockStored(hashes[:2], None, [],
                                                                       BS)])})
        assert len(lags) == 2 and not late
        held, _ = asyncio.run(_held(redis_server.url, hashes))  # no wait: visible already
        assert held == {"pod-0": 4, "pod-2": 2}
        assert sum(s["claims"] for s in pubs.stats()) == 6
        if where == "process":  # the load the tick sent rides on the next lease renewal
            deadline = time.monotonic() + 5
            while asyncio.run(_held(redis_server.url, hashes))[1].get("pod-0") != 5:
                assert time.monotonic() < deadline, "pod-0's load never published"
                time.sleep(0.2)
    finally:
        pubs.stop()


def test_a_router_restarted_mid_run_sees_the_fleet_and_serves_every_request(
        redis_server: RedisProcess):
    cost = PRESETS["pagekv-small"]
    pcfg = replace(PodConfig(), pool_blocks=256, dram_blocks=256)
    tcfg = replace(TraceConfig(), system_tokens=(256, 512), message_tokens=(16, 64),
                   output_tokens=(4, 16), think_s=(0.5, 2.0), hot_share=0.3, hot_tokens=384)
    trace, _ = trace_for_load(tcfg, 4, 0.6, 8.0, cost.step_fixed_s, cost.prefill_s_per_token,
                              pcfg.pool_blocks * pcfg.block_size, pcfg.max_num_seqs, seed=1)
    index = Index("single", redis_server.url, [], None)
    index.flush = lambda: None  # (a fresh server per test)
    index.used_memory = lambda: 0

    async def run() -> object:
        return await simulate("prefix", 4, trace, cost, pcfg, index, MODEL, True,
                              SimOptions(restart_at=4.0))

    out = asyncio.run(run())
    assert len(out.restarts) == 1 and out.restarts[0][0] == 4.0
    assert out.restarts[0][2] == 4  # its registry read the whole fleet before deciding
    assert len(out.records) == len(trace) and out.empty_decisions == 0
    s = summarize(out, 0.0, 8.0)
    assert s["hit_rate"] > 0.3 and s["late_writes"] == 0
    assert s["input_tokens_per_s"] > 0 and s["requests_per_s"] > 0
