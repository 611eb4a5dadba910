"""`pagekv up` and `pagekv generate` as a user runs them: real processes, clean shutdown."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def pagekv(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagekv", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, **kw)


def processes_mentioning(needle: str) -> list[int]:
    """Processes with `needle` in their command line or environment (`pagekv up` hands its
    children the Redis URL as $PAGEKV_REDIS_URL: it may hold a password)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            seen = b" ".join((entry / f).read_bytes() for f in ("cmdline", "environ"))
        except OSError:
            continue
        if needle in seen.replace(b"\0", b" ").decode(errors="replace") and (
                int(entry.name) != os.getpid()):
            pids.append(int(entry.name))
    return pids


def test_up_generate_and_sigterm_leaves_no_orphans(tmp_path):
    run_dir = tmp_path / "run"
    proc, output = start_up("--nodes", "2", "--router-port", "0", "--router-http-port", "0",
                            "--run-dir", str(run_dir), "--node-arg=--num-gpu-blocks=64",
                            "--node-arg=--max-model-len=512")
    try:
        found = re.search(r"^router:\s+grpc (\S+)", output, re.M)
        assert found, output
        router = found.group(1)
        redis_port = re.search(r"redis:\s+redis://127\.0\.0\.1:(\d+)", output).group(1)
        assert "metrics" in output

        out = pagekv("generate", "Hello cluster", "--router", router, "--max-tokens", "5",
                     "--ignore-eos")
        assert out.returncode == 0, out.stderr
        assert "served_by=node-" in out.stderr
        streamed = pagekv("generate", "Hello cluster", "--router", router, "--max-tokens", "5",
                          "--ignore-eos", "--stream")
        assert streamed.returncode == 0 and "cached=" in streamed.stderr
        bad = pagekv("generate", "x", "--router", router, "--max-tokens", "100000")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr

        children = processes_mentioning(f"127.0.0.1:{redis_port}")
        assert len(children) >= 3  # two pods and the router talk to this Redis
    except BaseException:
        proc.send_signal(signal.SIGTERM)  # a failed check must not leave the cluster running
        proc.communicate(timeout=60)
        raise
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert "cluster stopped" in rest
    time.sleep(0.5)
    assert processes_mentioning(f"127.0.0.1:{redis_port}") == []
    assert processes_mentioning(f"--port {redis_port}") == []


def child_pid(parent: int, needle: str) -> int:
    """The child of `parent` (only its own: other clusters may run here) whose command line,
    its arguments joined by NULs, holds `needle`."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    for pid in map(int, children):
        if needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no child of {parent} runs with {needle!r}")


def start_up(*args: str) -> tuple[subprocess.Popen, str]:
    """`pagekv up ARGS` until it says how to reach the cluster (or ends): (process, output)."""
    proc = subprocess.Popen([sys.executable, "-m", "pagekv", "up", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("try: pagekv generate"):
            break
    return proc, "".join(lines)


def stop_up(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    return rest


def test_a_shared_ssd_dir_is_one_per_pod_and_prometheus_scrapes_the_live_ports(tmp_path):
    import json
    import urllib.request

    import yaml

    shared = tmp_path / "ssd"
    proc, out = start_up("--nodes", "2", "--router-port", "0", "--router-http-port", "0",
                         "--run-dir", str(tmp_path / "run"), "--node-arg=--num-gpu-blocks=64",
                         "--node-arg=--max-model-len=512", "--node-arg=--disk-offload-bytes=8MiB",
                         f"--node-arg=--disk-offload-dir={shared}")
    try:
        assert "try: pagekv generate" in out, out
        assert f"--disk-offload-dir {shared} is given to every pod, so each pod gets its own " \
               f"sub-directory, {shared}/<pod id>" in out
        for pod in ("node-a", "node-b"):  # each pod holds its own directory's lock
            holder = json.loads((shared / pod / "pagekv.lock").read_text())
            assert holder["pod_id"] == pod
            os.kill(holder["pid"], 0)  # alive
        assert not list(shared.glob("layout-*")), "no pod writes the shared directory itself"

        config = Path(re.search(r"^prometheus: (\S+)", out, re.M).group(1))
        assert config == tmp_path / "run" / "prometheus.yml"
        check = subprocess.run(["promtool", "check", "config", str(config)],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        jobs = {j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]]
                for j in yaml.safe_load(config.read_text())["scrape_configs"]}
        # The dedicated metrics ports this run printed, and nothing else.
        pods = re.findall(r"^node-\w+:.*metrics http://(\S+)/metrics", out, re.M)
        router = re.findall(r"^router metrics: http://(\S+)/metrics", out, re.M)
        assert len(pods) == 2 and len(router) == 1
        assert jobs == {"pagekv-pods": pods, "pagekv-router": router}
        for target in pods + router:
            page = urllib.request.urlopen(f"http://{target}/metrics", timeout=10).read()
            assert b"pagekv_" in page, target
    finally:
        rest = stop_up(proc)
    assert proc.returncode == 0 and "cluster stopped" in rest


def _router_port_in_use(tmp_path: Path) -> tuple[list[str], str, object]:
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    return (["--router-port", str(port)],
            rf"port {port} \(--router-port\) on 127\.0\.0\.1 is not free", taken)


def _redis_cannot_start(tmp_path: Path) -> tuple[list[str], str, object]:
    (tmp_path / "run" / "redis" / "redis.log").mkdir(parents=True)  # its log file: a directory
    log = re.escape(str(tmp_path / "run" / "redis" / "redis.log"))
    return [], rf"the embedded Redis did not start: .*log file.* \(log: {log}\)$", None


def _a_pod_refuses_its_flags(tmp_path: Path) -> tuple[list[str], str, object]:
    log = re.escape(str(tmp_path / "run" / "node-a.log"))
    return (["--node-arg=--no-such-flag"],
            rf"node-a did not start: it exited with code 2: .*unrecognized arguments: "
            rf"--no-such-flag \(log: {log}\)$", None)


def _a_misspelt_placeholder(tmp_path: Path) -> tuple[list[str], str, object]:
    return (["--node-arg=--disk-offload-dir=/tmp/{podid}"],
            r"unknown placeholder \{podid\} \(known: \{pod_id\}, \{run_dir\}\)$", None)


@pytest.mark.parametrize("failure", [_router_port_in_use, _redis_cannot_start,
                                     _a_pod_refuses_its_flags, _a_misspelt_placeholder])
def test_a_failed_start_is_one_line_naming_the_reason_and_the_log(tmp_path, failure):
    args, reason, keep = failure(tmp_path)
    try:
        got = pagekv("up", "--nodes", "1", "--router-http-port", "0", "--run-dir",
                     str(tmp_path / "run"), *(["--router-port", "0"] if "--router-port" not in args
                                             else []), *args)
    finally:
        if keep is not None:
            keep.close()
    assert got.returncode != 0
    assert "Traceback" not in got.stdout + got.stderr, got.stderr
    errors = [line for line in got.stderr.splitlines() if line.startswith("pagekv up: error:")]
    assert errors == [got.stderr.splitlines()[-1]], got.stderr
    assert re.search(reason, errors[0]), errors[0]
    assert "PageKV local cluster is up" not in got.stdout


def test_a_signal_while_starting_stops_everything_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "pagekv", "up", "--nodes", "2",
                             "--router-port", "0", "--router-http-port", "0", "--run-dir",
                             str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        redis_port = None
        while redis_port is None:
            line = proc.stderr.readline()
            assert line, "pagekv up ended before starting Redis"
            m = re.search(r"embedded Redis on redis://127\.0\.0\.1:(\d+)", line)
            redis_port = m and m.group(1)
        time.sleep(0.5)  # the pods and the router are loading
        assert processes_mentioning(f"127.0.0.1:{redis_port}")
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)  # not the 180 s a start may wait for pods
    finally:
        if proc.poll() is None:  # a failed check: stop it cleanly, children included
            stop_up(proc)
    assert proc.returncode == 130
    assert rest.strip().splitlines()[-1] == (
        "pagekv up: stopped while starting; nothing is left running")
    assert "Traceback" not in rest
    time.sleep(0.5)
    assert processes_mentioning(f"127.0.0.1:{redis_port}") == []
    assert processes_mentioning(f"--port {redis_port}") == []


def test_a_pod_that_dies_stops_the_cluster_with_one_line_and_exit_code_1(tmp_path):
    proc, out = start_up("--nodes", "1", "--router-port", "0", "--router-http-port", "0",
                         "--run-dir", str(tmp_path))
    try:
        assert "try: pagekv generate" in out, out
        os.kill(child_pid(proc.pid, "--pod-id\0node-a\0"), signal.SIGKILL)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # a failed check: stop it cleanly, children included
            stop_up(proc)
    assert proc.returncode == 1
    errors = [line for line in rest.splitlines() if line.startswith("pagekv up: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "pagekv up: error: node-a was killed by SIGKILL: "), rest
    assert errors[0].endswith(f"(log: {tmp_path / 'node-a.log'}); stopping the cluster")
    assert "Traceback" not in rest and "cluster stopped" in rest
