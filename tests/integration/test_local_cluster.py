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
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagekv", "up", "--nodes", "2", "--router-port", "0", "--router-http-port", "0",
         "--run-dir", str(run_dir), "--node-arg=--num-gpu-blocks=64",
         "--node-arg=--max-model-len=512"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = []
        router = None
        deadline = time.time() + 120
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.match(r"router:\s+grpc (\S+)", line)
            if m:
                router = m.group(1)
            if line.startswith("try: pagekv generate"):
                break
        assert router, "".join(lines)
        redis_port = re.search(r"redis:\s+redis://127\.0\.0\.1:(\d+)", "".join(lines)).group(1)
        assert "metrics" in "".join(lines)

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
