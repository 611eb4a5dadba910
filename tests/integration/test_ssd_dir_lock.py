"""An SSD directory serves one pod (tiers/dir_lock.py), with real pods: a second pod given a
running pod's --disk-offload-dir is refused at start naming the holder; once the holder is
killed (SIGKILL, no clean-up), a pod started on the directory at once recovers its blocks.
`pagekv node` also refuses --disk-offload-bytes without a directory in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.deploy.local_cluster import LocalCluster, wait_healthy
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# A pool of 12 blocks and no DRAM tier: each new prompt evicts the last one's blocks to disk.
POD_ARGS = ["--num-gpu-blocks", "12", "--max-model-len", "160", "--disk-offload-bytes", "8MiB"]
PROMPTS = [[(i * k) % 250 + 1 for i in range(150)] for k in (3, 7, 11, 13, 17)]


def disk_figures(metrics_port: int) -> tuple[float, float]:
    """(entries, used bytes) of the pod's SSD tier, from its /metrics page."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    got = {}
    for family in text_string_to_metric_families(page.decode()):
        for sample in family.samples:
            if sample.labels.get("tier") == "DISK" and sample.name in (
                    "pagekv_tier_entries", "pagekv_tier_used_bytes"):
                got[sample.name] = sample.value
    return got["pagekv_tier_entries"], got["pagekv_tier_used_bytes"]


def settled_disk_figures(metrics_port: int, timeout: float = 30.0) -> tuple[float, float]:
    """The figures once they stop moving (the tier writes behind) and something is on disk."""
    deadline = time.monotonic() + timeout
    last = disk_figures(metrics_port)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = disk_figures(metrics_port)
        if now == last and now[1] > 0:
            return now
        last = now
    raise AssertionError(f"the SSD tier never settled: {last}")


def test_a_second_pod_on_the_directory_is_refused_and_a_killed_pods_is_recovered(tmp_path):
    shared = tmp_path / "ssd"
    with LocalCluster(nodes=0, run_dir=tmp_path, start_router=False) as cluster:
        first = cluster.start_pod("node-a", [*POD_ARGS, "--disk-offload-dir", str(shared)])
        wait_healthy(first.target(), 60, first.proc)
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(first.target()))
        for ids in PROMPTS:
            stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                             sampling=pb.SamplingParams(max_tokens=2)),
                          timeout=60)
        entries, _ = settled_disk_figures(first.metrics_port)
        assert entries > 0

        second = cluster.start_pod("node-b", [*POD_ARGS, "--disk-offload-dir", str(shared)])
        assert second.proc.wait(60) == 2
        last = second.log_tail(1).strip()
        assert last.startswith(f"pagekv node: error: SSD tier directory {shared} is in use by "
                               f"pod node-a (pid {first.proc.pid} on host "), last
        assert "Traceback" not in second.log_tail(200)
        assert first.proc.poll() is None  # the holder serves on

        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
        again = cluster.start_pod("node-c", [*POD_ARGS, "--disk-offload-dir", str(shared)])
        wait_healthy(again.target(), 60, again.proc)
        recovered, _ = disk_figures(again.metrics_port)
        # Every block the killed pod had written is back (a removal is not logged, so an
        # entry promoted before the kill may come back too: at least as many).
        assert recovered >= entries, (recovered, entries)


def test_disk_offload_bytes_without_a_directory_is_one_line_before_the_model_loads():
    got = subprocess.run([sys.executable, "-m", "pagekv", "node", "--port", "0",
                          "--disk-offload-bytes", "8MiB"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        "pagekv node: error: --disk-offload-bytes needs --disk-offload-dir (the SSD tier's "
        "directory, one per pod)"], got.stderr
