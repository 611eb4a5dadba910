"""bench.router_fleet on its quick mode's fleet at 16 pods: the fleet's shape and its oracle,
one PageKV pass on a real redis-server (the publishers in their own processes, the real
Router), and, where Dynamo's venv is installed, Dynamo's side on the same fleet. No timing
is checked: what the decisions were, and that every one was recorded."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from bench.router_fleet import (
    DynamoProc,
    dynamo_fleet_json,
    hit_quality,
    load_selection_service,
    pagekv_pass,
    start_pagekv,
    stop_pagekv,
)
from bench.router_fleet_build import FleetConfig, build_fleet
from pagekv.deploy.redis_server import RedisProcess, find_redis_server
from pagekv.proto.hashing import HashConfig, RequestBlockHasher

PODS = 16
QUICK = replace(FleetConfig(), requests=400)  # as --quick builds it
DYNAMO_PYTHON = Path(__file__).resolve().parents[2] / ".bench-venvs" / "dynamo" / "bin" / "python"


@pytest.fixture(scope="module")
def fleet():
    return build_fleet(PODS, QUICK)


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    try:
        binary = find_redis_server()
    except FileNotFoundError as exc:
        pytest.skip(f"no redis-server: {exc}")
    proc = RedisProcess(data_dir=tmp_path / "redis", binary=binary).start()
    try:
        yield proc.url
    finally:
        proc.close()


def test_the_fleet_has_the_issues_shape(fleet):
    c = QUICK
    assert len(fleet.pods) == PODS and len(fleet.chain_hashes) == c.chains == 200
    assert len(set(fleet.chain_root)) == c.roots == 20
    for tokens, hashes in zip(fleet.chain_tokens, fleet.chain_hashes, strict=True):
        assert c.chain_blocks[0] <= len(hashes) <= c.chain_blocks[1]
        assert len(tokens) == len(hashes) * c.block_size
    assert all(c.holders[0] <= len(h) <= c.holders[1] and len(set(h)) == len(h)
               for h in fleet.holders)
    # The chains of a root share their first blocks, and only those.
    for root in range(c.roots):
        mine = [h for h, r in zip(fleet.chain_hashes, fleet.chain_root, strict=True) if r == root]
        shared = 0
        while all(h[shared] == mine[0][shared] for h in mine):
            shared += 1
        assert c.root_blocks[0] <= shared <= c.root_blocks[1]
    # The claims are the distinct (block, pod) pairs of the holders' chains, and the runs
    # each pod publishes are exactly those, each linked to a block the pod already holds.
    want = [set() for _ in range(PODS)]
    for chain, pods in enumerate(fleet.holders):
        for pod in pods:
            want[pod].update(fleet.chain_hashes[chain])
    assert fleet.held == want and fleet.claims == sum(map(len, want)) > 25_000
    for pod, runs in enumerate(fleet.runs):
        seen: set[bytes] = set()
        for run in runs:
            assert run.parent is None if run.start == 0 else run.parent in seen
            assert len(run.tokens) == len(run.hashes) * c.block_size
            assert not seen & set(run.hashes)
            seen.update(run.hashes)
        assert seen == want[pod]
    assert len(fleet.requests) == 400
    assert statistics.mean(len(r.tokens) for r in fleet.requests) > 400
    assert build_fleet(PODS, QUICK).requests == fleet.requests  # seeded
    assert build_fleet(64, QUICK).requests == fleet.requests  # the same at every pod count


def test_the_oracle_reads_the_requests_own_hashes(fleet):
    config = HashConfig(QUICK.hash_algo, QUICK.hash_seed)
    for req in fleet.requests[:50]:
        hashes: list[bytes] = []
        RequestBlockHasher(config, QUICK.block_size).extend(req.tokens, hashes)
        limit = (len(req.tokens) - 1) // QUICK.block_size
        for pod, depth in fleet.depths(req).items():
            d = 0
            while d < limit and hashes[d] in fleet.held[pod]:
                d += 1
            assert d == depth
        assert fleet.best_depth(req) == req.prefix_blocks  # its chain's holders hold it all
    assert hit_quality(fleet, [None] * len(fleet.requests))["best_pod_pct"] == 0.0


def test_one_pagekv_pass_on_a_real_redis(fleet, redis_url):
    sync = redis.Redis.from_url(redis_url)

    async def run():
        pk = await start_pagekv(fleet, redis_url, sync, processes=2, lease_s=10.0)
        try:
            return pk.index, await pagekv_pass(pk)
        finally:
            await stop_pagekv(pk)

    try:
        index, out = asyncio.run(run())
    finally:
        sync.close()
    assert index["claims"] == fleet.claims and index["unplaced"] == 0
    assert index["bytes_per_claim"] > 0
    assert out["decisions"] == len(out["chosen"]) == len(fleet.requests)
    assert set(out["chosen"]) <= set(fleet.pods) and sum(out["reasons"].values()) == 400
    assert out["prepare_cpu_s"] > 0 and out["decide_cpu_s"] > 0
    q = hit_quality(fleet, [fleet.pods.index(p) for p in out["chosen"]], out["pulled"])
    # Routing on the index the publishers wrote: all but a few go to the deepest holder
    # (the rest are told to pull it), so the claims reached the router whole.
    assert q["best_pod_pct"] > 85 and q["best_pod_pct_with_pulls"] > 98


def _has_dynamo() -> bool:
    return DYNAMO_PYTHON.exists() and subprocess.run(
        [str(DYNAMO_PYTHON), "-c", "import dynamo.llm"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_dynamo(), reason="Dynamo's venv (.bench-venvs/dynamo) absent")
def test_dynamo_side_on_the_same_fleet(fleet, tmp_path):
    path = tmp_path / "fleet.json"
    dynamo_fleet_json(fleet, path)
    dyn = DynamoProc(DYNAMO_PYTHON, path, tmp_path / "dynamo.log", 1)
    keepers: list = []
    try:
        tree = dyn.call("load_tree")
        assert tree["events"] == sum(map(len, fleet.runs))
        load_selection_service(dyn, fleet, keepers)
        sel = dyn.call("select_pass")
        rad = dyn.call("radix_pass")
    finally:
        dyn.close()
        for sock in keepers:
            sock.close(0)
    assert len(sel["chosen"]) == len(rad["best"]) == len(fleet.requests)
    assert rad["best"] == [fleet.best_depth(r) for r in fleet.requests]
    assert hit_quality(fleet, sel["chosen"])["best_pod_pct"] > 98
