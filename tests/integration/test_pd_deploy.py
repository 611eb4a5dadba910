"""`pagekv up --prefill-nodes 1 --decode-nodes 1` as a user runs it: the pods start with their
roles (ids, start-up lines, Stats, the role metric on the targets prometheus.yml scrapes) and a
long prompt through the router is prefilled on the prefill pod and decoded on the decode pod.
One cluster, one request (P/D correctness itself: the lead's tests of router and engine)."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
THRESHOLD = 64  # the router's --pd-threshold-tokens: a 400-token cold prompt is split


def start_up(*args: str) -> tuple[subprocess.Popen, str]:
    """`pagekv up ARGS` until it prints how to reach the cluster (or ends)."""
    proc = subprocess.Popen([sys.executable, "-m", "pagekv", "up", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("try: pagekv generate"):
            break
    return proc, "".join(lines)


def samples(address: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def metric(address: str, name: str, **labels: str) -> float:
    """Sum of `name`'s samples on a page whose labels include `labels`."""
    return sum(v for (n, lab), v in samples(address).items()
               if n == name and set(labels.items()) <= set(lab))


def test_up_with_roles_starts_role_pods_and_the_router_splits_a_long_prompt(tmp_path):
    run_dir = tmp_path / "run"
    proc, out = start_up("--prefill-nodes", "1", "--decode-nodes", "1", "--router-port", "0",
                         "--router-http-port", "0", "--run-dir", str(run_dir),
                         "--node-arg=--num-gpu-blocks=128", "--node-arg=--max-model-len=1024",
                         f"--router-arg=--pd-threshold-tokens={THRESHOLD}")
    try:
        assert "try: pagekv generate" in out, out
        lines = {m[0]: (m[1], m[2]) for m in
                 re.findall(r"^(\S+):\s+grpc (\S+) .* role (\w+)$", out, re.M)}
        assert {pid: role for pid, (_, role) in lines.items()} == {
            "prefill-a": "prefill", "decode-a": "decode"}, out
        assert re.search(r"^P/D:\s+1 prefill \+ 1 decode pods", out, re.M), out
        router = re.search(r"^router:\s+grpc (\S+)", out, re.M).group(1)

        # Each pod says its role itself (Stats), and was started with it (its argv).
        for pod_id, (address, role) in lines.items():
            with grpc.insecure_channel(address) as channel:
                stats = pb_grpc.KVNodeStub(channel).Stats(pb.StatsRequest(), timeout=10)
            assert (stats.pod_id, stats.role) == (pod_id, role)

        # The role metric is on every pod target of the prometheus.yml the run wrote.
        config = yaml.safe_load((run_dir / "prometheus.yml").read_text())
        jobs = {j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]]
                for j in config["scrape_configs"]}
        roles = {role for target in jobs["pagekv-pods"]
                 for (name, labels), v in samples(target).items()
                 if name == "pagekv_pod_role" and v == 1 for k, role in labels if k == "role"}
        assert roles == {"prefill", "decode"}
        [router_metrics] = jobs["pagekv-router"]

        deadline = time.monotonic() + 30  # the router takes pods in at its index refresh
        while metric(router_metrics, "pagekv_router_live_pods") < 2:
            assert time.monotonic() < deadline, "the router never saw both pods"
            time.sleep(0.2)
        rng = random.Random(29)
        prompt = [rng.randrange(1, 250) for _ in range(400)]
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True))
        with grpc.insecure_channel(router) as channel:
            resp = pb_grpc.GenerationStub(channel).Generate(request, timeout=120)
        info = resp.routing
        assert (resp.served_by, info.prefill_pod) == ("decode-a", "prefill-a"), info
        assert info.pd_fallback == "" and info.pd_threshold_tokens == THRESHOLD, info
        assert info.handover_tokens >= 16 * ((len(prompt) - 1) // 16) - 16, info
        assert len(resp.completions[0].token_ids) == 4
        assert metric(router_metrics, "pagekv_router_pd_requests_total", decision="split") == 1
        decode_metrics = next(t for t in jobs["pagekv-pods"]
                              if metric(t, "pagekv_pod_role", role="decode") == 1)
        assert metric(decode_metrics, "pagekv_handover_seconds_count") == 1
        assert metric(decode_metrics, "pagekv_handover_bytes_total") > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0 and "cluster stopped" in rest, rest
