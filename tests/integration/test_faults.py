"""The fault suite: real processes, real Redis, each fault injected under load (bounded in
calls and time). The scenarios live in bench/fault_scenarios.py; bench/faults.py runs the same
ones longer and prints the figures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import fault_scenarios as fs
from pagekv.deploy.local_cluster import LocalCluster

pytestmark = pytest.mark.integration

POD_ARGS = ["--num-gpu-blocks", "96", "--max-model-len", "256", "--lease-ttl-s", "1.5",
            "--max-queue", "8"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(nodes=2, run_dir=tmp_path, node_args=POD_ARGS,
                     router_args=["--refresh-interval-s", "0.2"])
    with c:
        yield c


def test_redis_killed_and_restarted_under_load(cluster: LocalCluster) -> None:
    r = fs.redis_restart(cluster, down_s=2.0, warm_s=1.5, after_s=6.0)
    assert r["failed"] == 0, r
    assert r["calls_while_down"] > 0 and r["fallback_while_down"] > 0, r
    assert r["prefix_routing_back_s"] is not None and r["prefix_routing_back_s"] < 6.0, r


def test_pod_killed_under_load_then_restarted_with_its_id(cluster: LocalCluster) -> None:
    victim = cluster.pods[1]
    r = fs.pod_kill(cluster, victim, warm_s=1.5, dead_s=4.0, after_s=5.0)
    assert r["failed"] == 0, r  # the router retried every call the dead pod refused
    assert r["dropped_after_s"] < 4.0, r  # lease 1.5 s + refresh 0.2 s, with slack
    assert r["rejoined_after_s"] is not None, r  # the same pod id serves again


def test_burst_past_max_queue_is_refused_cleanly(cluster: LocalCluster) -> None:
    pods = [p.address for p in cluster.pods]
    r = fs.burst(pods[0], streams=40, pods=pods)
    assert set(r["codes"]) <= {"OK", "RESOURCE_EXHAUSTED"}, r
    assert r["codes"].get("RESOURCE_EXHAUSTED", 0) > 0 and r["codes"].get("OK", 0) >= 8, r
    assert r["blocks_back"], r
    # Through the router: the same two outcomes only (it may retry elsewhere first).
    r = fs.burst(cluster.router.address, streams=40, pods=pods)
    assert set(r["codes"]) <= {"OK", "RESOURCE_EXHAUSTED"}, r
    assert r["blocks_back"], r
