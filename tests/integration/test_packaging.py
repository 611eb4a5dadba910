"""The built wheel, installed into a fresh venv the way a light router host would install it:
one `pagekv` namespace and no generic top-level names, the public API, a router and a client
that run without torch or Ray, and one error line (never a traceback) for what is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagekv.deploy.redis_server import RedisProcess, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def run(argv: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
             "-w", str(out), str(ROOT)])
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("pagekv-*.whl")
    return whl


@pytest.fixture(scope="module")
def light_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the wheel (no dependencies) and deploy/requirements-router.txt."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    r = run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run([str(py), "-m", "pip", "install", "-q", "-r",
             str(ROOT / "deploy" / "requirements-router.txt")], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    yield env_dir


def plain_host_env() -> dict[str, str]:
    """The environment of a plain host: not this checkout's venv or PYTHONPATH, and no
    redis-server named by the test run's own PAGEKV_REDIS_SERVER."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PAGEKV_REDIS_SERVER")}


def in_venv(env_dir: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run outside the checkout, so nothing resolves to the repository's folders."""
    env = plain_host_env()
    env["PATH"] = str(env_dir / "bin")  # no system redis-server, compiler or torch here
    return run(list(argv), timeout=timeout, cwd=env_dir, env=env)


def test_the_wheel_claims_only_the_pagekv_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"pagekv", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    for needed in ("pagekv/__init__.py", "pagekv/cli.py",
                   "pagekv/kvnode/model/attention/csrc/paged_attention.cpp",
                   "pagekv/proto/pagekv/v1/pagekv_pb2.py", "pagekv/tiers/ssd.py",
                   "pagekv/router/server.py", "pagekv/deploy/prometheus/pagekv.rules.yml"):
        assert needed in names, needed
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pagekv = pagekv.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_public_api_and_light_parts_without_torch(light_venv: Path) -> None:
    py = str(light_venv / "bin" / "python")
    code = ("import sys, pagekv\n"
            "from pagekv import Client, __version__\n"
            "import pagekv.router.server, pagekv.kvnode.pod.client, pagekv.proto.index\n"
            "import pagekv.kvnode.index.vllm_ingest_cli\n"
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules\n"
            "from redis.utils import HIREDIS_AVAILABLE\n"  # replies parsed in C (hiredis)
            "assert HIREDIS_AVAILABLE, 'redis-py without hiredis'\n"
            "for generic in ('kvnode', 'router', 'proto', 'deploy', 'tiers'):\n"
            "    try:\n"
            "        __import__(generic)\n"
            "    except ModuleNotFoundError:\n"
            "        continue\n"
            "    raise SystemExit(f'{generic} is importable')\n"
            "print(__version__, pagekv.__all__)\n")
    r = in_venv(light_venv, py, "-c", code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LLM" in r.stdout and "SamplingParams" in r.stdout and "Client" in r.stdout
    for argv in (["--version"], ["router", "--help"], ["generate", "--help"],
                 ["ingest-vllm", "--help"]):
        r = in_venv(light_venv, str(light_venv / "bin" / "pagekv"), *argv)
        assert r.returncode == 0, (argv, r.stderr[-2000:])


@pytest.mark.parametrize("argv, says", [
    (["node", "--model", "pagekv-tiny"], "needs torch installed: pip install 'dist/pagekv-*.whl'"),
    (["ray-up", "--local"], "pip install 'dist/pagekv-*.whl[ray]'"),
    (["up", "--nodes", "1"], "no redis-server found"),
])
def test_a_missing_piece_is_one_line(light_venv: Path, argv: list[str], says: str) -> None:
    r = in_venv(light_venv, str(light_venv / "bin" / "pagekv"), *argv)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert says in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


def test_the_light_router_serves(light_venv: Path, tmp_path: Path) -> None:
    """A router from the light install starts, reads the (real) index and reports SERVING."""
    redis = RedisProcess(data_dir=tmp_path / "redis").start()
    port = free_port()
    env = plain_host_env()
    proc = subprocess.Popen(
        [str(light_venv / "bin" / "pagekv"), "router", "--host", "127.0.0.1", "--port",
         str(port), "--redis-url", redis.url, "--metrics-port", "0"],
        cwd=light_venv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            status = None
            for _ in range(150):
                if proc.poll() is not None:
                    break
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                subprocess.run(["sleep", "0.2"])
        assert status == health_pb2.HealthCheckResponse.SERVING, proc.stdout.read() \
            if proc.poll() is not None else status
    finally:
        proc.terminate()
        proc.wait(15)
        redis.close()
