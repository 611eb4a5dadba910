"""Partitions, bounded: Redis, the router and two pods on separate simulated hosts (network
namespaces, deploy/netns_bed.py), a link cut and restored under load through the router.
Every call must be correct or have failed only where its own deadline ran out, none may
hang, every block comes back, and the cluster recovers. The scenarios live in
bench/netns_partitions.py; bench/faults.py runs them longer and prints the figures.

Skipped where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import netns_partitions as parts
from pagekv.deploy.netns_bed import NetnsBed
from pagekv.deploy.netns_mesh import NAME_PREFIX, base36, remove_leftovers, unavailable_reason

WHY_NOT = unavailable_reason()
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(WHY_NOT is not None, reason=f"no test bed: {WHY_NOT}"),
              pytest.mark.xdist_group("netns")]  # one bed at a time (tests/xdist_groups.py)

POD_ARGS = ["--num-gpu-blocks", "128", "--max-model-len", "1024", "--lease-ttl-s", "2",
            "--max-queue", "64"]
DEADLINE_S = 8.0


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(NAME_PREFIX)}


@pytest.fixture(scope="module")
def bed(tmp_path_factory) -> Iterator[NetnsBed]:
    with NetnsBed(2, tmp_path_factory.mktemp("netns-bed"), pod_args=POD_ARGS,
                  router_args=["--refresh-interval-s", "0.3"]).start() as b:
        yield b
    assert not namespaces() & set(b.mesh.made), "the bed left namespaces behind"


def assert_clean(r: dict) -> None:
    assert r["wrong"] == 0, r
    assert r["hung"] == 0, r
    assert r["failed_not_deadline"] == 0, r  # only the client's own deadline may fail a call
    assert not any(r["leaked_blocks"].values()), r
    assert r["recovery_s"] is not None, r


def test_router_to_pod_link_cut_and_restored(bed: NetnsBed) -> None:
    r = parts.router_pod_cut(bed, "node-b", warm_s=2.0, cut_s=4.0, after_s=6.0,
                             deadline_s=DEADLINE_S)
    assert_clean(r)
    assert r["calls"] > 20, r
    assert r["recovery_s"] < 6.0, r


def test_pod_to_redis_link_cut_and_restored(bed: NetnsBed) -> None:
    # Longer than the 2 s lease: the router drops the pod, then takes it back.
    r = parts.pod_redis_cut(bed, "node-b", warm_s=2.0, cut_s=5.0, after_s=8.0,
                            deadline_s=DEADLINE_S)
    assert_clean(r)
    assert r["calls"] > 20 and not r["failed"], r  # the router routes around: none fails
    assert r["recovery_s"] < 8.0, r


def test_pod_to_pod_link_cut_during_a_kv_pull(bed: NetnsBed) -> None:
    r = parts.pod_pod_cut_during_pull(bed, "node-a", "node-b", rate="5mbit", pulls=1,
                                      cut_s=4.0, after_s=20.0, deadline_s=10.0)
    assert_clean(r)
    assert r["pull_wrong"] == 0 and r["pull_hung"] == 0 and not r["pull_failed"], r
    assert r["full_pull_tokens"] > 0, r  # uncut, the pull works across this link
    # The cut landed mid-pull: less than a whole pull arrived, the rest was recomputed.
    assert all(t < r["full_pull_tokens"] for t in r["pulled_tokens_during_cut"]), r


def test_leftovers_of_a_dead_run_are_removed(tmp_path: Path) -> None:
    """A namespace named for a process that is gone (a run killed with SIGKILL) goes at the
    next bed's start, with what still runs inside it."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{NAME_PREFIX}{base36(dead.pid)}-leftover"
    subprocess.run(["ip", "netns", "add", name], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "60"])
    try:
        assert name in remove_leftovers()
        assert name not in namespaces()
        assert sleeper.wait(10) != 0  # killed with its namespace
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
