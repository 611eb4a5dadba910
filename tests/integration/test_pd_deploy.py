"""Deploying with P/D roles. `pagekv up --prefill-nodes 1 --decode-nodes 1` as a user runs it:
the pods start with their roles (ids, start-up lines, Stats, the role metric on the targets
prometheus.yml scrapes) and a long prompt through the router is prefilled on the prefill pod
and decoded on the decode pod: one cluster, one request (P/D itself is tested with the router
and the engine). docker-compose.pd.yml: docker-compose.yml's pods with roles, nothing else
changed, validated by `docker-compose config` (no Docker engine needed).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
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
COMPOSE, PD_OVERRIDE = ROOT / "docker-compose.yml", ROOT / "docker-compose.pd.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"
PD_PODS = {"kvnode-a": ("prefill-a", "prefill"), "kvnode-b": ("decode-a", "decode")}
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
        # The run's prometheus.yml loads every rules file, the P/D alerts' included.
        check = subprocess.run(["promtool", "check", "config", str(run_dir / "prometheus.yml")],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0 and "pagekv-pd.rules.yml" in check.stdout, check.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0 and "cluster stopped" in rest, rest


# -- docker-compose.pd.yml ----------------------------------------------------------------

def without_role(argv: list[str]) -> list[str]:
    at = argv.index("--role")
    return argv[:at] + argv[at + 2:]


def flag(argv: list[str], name: str) -> str:
    return str(argv[argv.index(name) + 1])


def test_pd_compose_override_is_the_compose_pods_with_roles() -> None:
    base = yaml.safe_load(COMPOSE.read_text())["services"]
    override = yaml.safe_load(PD_OVERRIDE.read_text())["services"]
    assert set(override) == set(PD_PODS)
    from pagekv.kvnode.pod.node_cli import add_arguments

    for service, (pod_id, role) in PD_PODS.items():
        assert set(override[service]) == {"command"}  # volumes, health, GPUs: the base's
        command = override[service]["command"]
        assert (flag(command, "--pod-id"), flag(command, "--role")) == (pod_id, role)
        # Every other flag is the base file's (a command replaces the base's whole).
        expected = list(base[service]["command"])
        expected[expected.index("--pod-id") + 1] = pod_id
        assert without_role(command) == expected
        parser = argparse.ArgumentParser()
        add_arguments(parser)  # what `pagekv node` in the container parses, with the defaults
        defaults = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg) for arg in command[1:]]
        assert parser.parse_args(defaults).role == role


def test_pd_compose_validates_with_docker_compose() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose); the "
                    "override is still checked against the base file without it")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEKV_")}
    base = subprocess.run([binary, "--project-directory", str(ROOT), "-f", str(COMPOSE),
                           "config", "--services"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert base.returncode == 0, base.stderr
    for extra in ([], [GPU_OVERRIDE]):
        args = [binary, "--project-directory", str(ROOT)]
        for f in (COMPOSE, PD_OVERRIDE, *extra):
            args += ["-f", str(f)]
        done = subprocess.run([*args, "config"], capture_output=True, text=True, env=env,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        merged = yaml.safe_load(done.stdout)["services"]
        assert set(merged) == set(base.stdout.split())  # the same services, none added
        for service, (pod_id, role) in PD_PODS.items():
            command = merged[service]["command"]
            assert (flag(command, "--pod-id"), flag(command, "--role")) == (pod_id, role)
            assert merged[service]["volumes"] and merged[service]["healthcheck"]
            if extra:  # the GPU override still reserves a device per pod
                assert merged[service]["deploy"]["resources"]["reservations"]["devices"]
        router = merged["router"]["command"]
        assert "--role" not in router
