"""`pagekv ray-up`: deploy the pods and the router as Ray actors.

    python -m pagekv.deploy.ray_cluster --num-nodes 4 --redis-url redis://10.0.0.5:6380/0 \\
        --model pagekv-small --address auto            # on a running Ray cluster
    pagekv ray-up --local --num-nodes 2 --redis-url redis://127.0.0.1:6380/0   # a local one
    pagekv ray-up --local --prefill-nodes 1 --decode-nodes 1 --redis-url ...  # P/D roles

One pod per GPU (`num_gpus=1`) where the cluster has GPUs, else one pod per `--pod-cpus`
CPUs. The pods' bundles sit in one placement group with strategy SPREAD, so they land on
different nodes when there are several. --num-nodes counts mixed pods; --prefill-nodes and
--decode-nodes add pods of those P/D roles (ids ray-prefill-0, ray-decode-0: deploy/
pod_roles.py), each actor's engine started with its role. Each pod actor runs a `PodServer`
(engine, gRPC, metrics, Redis index publisher) on an asyncio loop in a thread of its own,
bound to its node's IP and a free port. The router is one more actor, placed on the driver's node (normally the
head) so that clients have a fixed address to dial.

Actors restart when they die (`max_restarts`): Ray runs the constructor again, which starts a
fresh PodServer on a new port, and its index publisher registers a new epoch, so the router
drops the dead instance's claims and dials the new address. `--detach` leaves the actors
running after this command exits (named, in the `pagekv` namespace); `--down` removes them.

Tests use `deploy_cluster(...)`, which returns the actor handles and their addresses.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from pagekv.deploy.pod_roles import mixed_pod_count, ray_pod_specs
from pagekv.deploy.ray_actors import START_TIMEOUT_S, PodActor, RouterActor, pod_name
from pagekv.deploy.ray_placement import plan_pod_cpus, wait_ready
from pagekv.proto.index.schema import ROLE_MIXED

logger = logging.getLogger(__name__)

NAMESPACE = "pagekv"
PG_NAME = "pagekv-pods"
ROUTER_NAME = "pagekv-router"
@dataclass
class ClusterHandles:
    pods: list[Any]                  # PodActor handles, in pod order
    pod_ids: list[str]
    pod_addresses: list[str]
    router: Any | None               # RouterActor handle
    router_address: str | None
    placement_group: PlacementGroup
    detached: bool = False
    metrics_addresses: list[str] = field(default_factory=list)
    router_http_address: str | None = None  # the router's OpenAI API
    pod_roles: list[str] = field(default_factory=list)  # P/D role of each pod, in pod order

    def refresh(self, timeout: float = 60.0) -> bool:
        """Re-read every actor's address (they move when an actor restarts); True when any
        changed."""
        before = (list(self.pod_addresses), self.router_address)
        self.pod_addresses = ray.get([p.address.remote() for p in self.pods], timeout=timeout)
        if self.router is not None:
            self.router_address = ray.get(self.router.address.remote(), timeout=timeout)
            self.router_http_address = ray.get(self.router.http_address.remote(),
                                               timeout=timeout)
        self.metrics_addresses = self._metrics(timeout)
        return before != (self.pod_addresses, self.router_address)

    def _metrics(self, timeout: float) -> list[str]:
        actors = [*self.pods, *([self.router] if self.router is not None else [])]
        found = ray.get([a.metrics_address.remote() for a in actors], timeout=timeout)
        return [m for m in found if m]

    def describe(self) -> str:
        lines = [f"router:  {self.router_address or '(none)'}"]
        if self.router_http_address:
            lines.append(f"OpenAI API: http://{self.router_http_address}/v1")
        roles = self.pod_roles or [ROLE_MIXED] * len(self.pod_ids)
        named = any(role != ROLE_MIXED for role in roles)
        lines += [f"{pid}:  {addr}" + (f"   role {role}" if named else "")
                  for pid, addr, role in zip(self.pod_ids, self.pod_addresses, roles,
                                             strict=True)]
        if self.metrics_addresses:
            lines.append("metrics: " + " ".join(self.metrics_addresses))
        return "\n".join(lines)


def _cluster_gpus() -> float:
    return float(ray.cluster_resources().get("GPU", 0.0))


def deploy_cluster(
    num_pods: int,
    redis_url: str,
    model: str = "pagekv-tiny",
    *,
    engine_kwargs: dict[str, Any] | None = None,
    router_kwargs: dict[str, Any] | None = None,
    host: str | None = None,
    use_gpus: bool | None = None,
    pod_cpus: float | None = None,
    router_cpus: float = 1.0,
    router_port: int = 50050,
    router_metrics_port: int = 0,
    router_http_port: int | None = None,
    start_router: bool = True,
    serve_metrics: bool = True,
    lease_ttl_s: float = 3.0,
    max_restarts: int = -1,
    max_task_retries: int = 3,
    detach: bool = False,
    start_timeout_s: float = START_TIMEOUT_S,
    prefill_pods: int = 0,
    decode_pods: int = 0,
) -> ClusterHandles:
    """Start `num_pods` mixed pod actors, `prefill_pods` prefill and `decode_pods` decode
    ones (P/D roles: deploy/pod_roles.py) and the router on the connected Ray cluster.

    `host=None` binds every server to its node's IP; tests pass "127.0.0.1". `use_gpus=None`
    reserves one GPU per pod when the cluster has that many. `pod_cpus=None` gives each pod at
    most one CPU and leaves the router its share (deploy.ray_placement). Blocks until all are
    serving; refuses up front what cannot fit.
    """
    if not ray.is_initialized():
        raise RuntimeError("connect to Ray first: ray.init(address='auto') or ray.init()")
    from pagekv.kvnode.engine.config import EngineArgs  # plain dataclass, no torch

    ekw = {"model": model, **(engine_kwargs or {})}
    eargs = EngineArgs(**ekw)  # a misspelt option fails here, not in every actor
    specs = ray_pod_specs(num_pods, prefill_pods, decode_pods, ekw)
    num_pods = len(specs)
    gpus = _cluster_gpus()
    if use_gpus is None:
        use_gpus = gpus >= num_pods
    elif use_gpus and gpus < num_pods:
        raise ValueError(f"{num_pods} GPU pods asked for; the cluster has {gpus:g} GPUs")
    pod_cpus = plan_pod_cpus(num_pods, pod_cpus, router_cpus, start_router,
                             float(ray.cluster_resources().get("CPU", 0.0)))
    bundle: dict[str, float] = {"CPU": pod_cpus}
    if use_gpus:
        bundle["GPU"] = 1.0
    lifetime = "detached" if detach else None
    pg = placement_group([dict(bundle) for _ in range(num_pods)], strategy="SPREAD",
                         name=PG_NAME if detach else "", lifetime=lifetime)
    try:
        wait_ready({"the pods' placement group": pg.ready()},
                   {"the pods' placement group": {k: v * num_pods for k, v in bundle.items()}},
                   start_timeout_s)
    except TimeoutError:
        remove_placement_group(pg)
        raise
    logger.info("placement group ready: %d bundles of %s (SPREAD)", num_pods, bundle)

    pod_ids = [spec.pod_id for spec in specs]
    pod_cls = ray.remote(PodActor)
    # Actor handles are Any, as in ClusterHandles: Ray types `handle.method.remote` only for
    # methods decorated with @ray.method.
    pods: list[Any] = []
    for i, spec in enumerate(specs):
        opts: dict[str, Any] = {
            "num_cpus": pod_cpus, "num_gpus": 1 if use_gpus else 0,
            "max_restarts": max_restarts, "max_task_retries": max_task_retries,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i),
        }
        if detach:  # numbered over every role: `--down` finds them all
            opts.update(name=pod_name(i), namespace=NAMESPACE, lifetime="detached")
        pods.append(pod_cls.options(**opts).remote(
            spec.pod_id, redis_url, spec.engine_kwargs, host, serve_metrics, lease_ttl_s))

    router: Any = None
    if start_router:
        # The router hashes exactly like the pods, or it routes on misses only.
        rkw = {"redis_url": redis_url, "model": model, "block_size": eargs.block_size,
               "hash_algo": eargs.hash_algo, "hash_seed": eargs.hash_seed,
               **(router_kwargs or {})}
        opts = {
            "num_cpus": router_cpus, "max_restarts": max_restarts,
            "max_task_retries": max_task_retries,
            # The driver's node (the head, normally) so the entry point stays put; soft, so a
            # lost head does not leave the router unschedulable.
            "scheduling_strategy": NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=True),
        }
        if detach:
            opts.update(name=ROUTER_NAME, namespace=NAMESPACE, lifetime="detached")
        router_host = host if host is not None else "0.0.0.0"
        router = ray.remote(RouterActor).options(**opts).remote(
            rkw, router_host, router_port, router_metrics_port, None, router_http_port)

    handles = ClusterHandles(pods=pods, pod_ids=pod_ids, pod_addresses=[], router=router,
                             router_address=None, placement_group=pg, detached=detach,
                             pod_roles=[spec.role for spec in specs])
    try:
        demands = {pid: dict(bundle) for pid in pod_ids}
        refs = {pid: p.address.remote() for pid, p in zip(pod_ids, pods, strict=True)}
        if router is not None:
            refs["router"], demands["router"] = router.address.remote(), {"CPU": router_cpus}
        wait_ready(refs, demands, start_timeout_s)
        handles.refresh(timeout=start_timeout_s)
    except BaseException:
        shutdown_cluster(handles, graceful=False)
        raise
    logger.info("PageKV on Ray:\n%s", handles.describe())
    return handles


def shutdown_cluster(handles: ClusterHandles, graceful: bool = True,
                     drain_timeout_s: float = 10.0) -> None:
    """Router first (no new traffic), then the pods (they drain and leave the index)."""
    actors = ([handles.router] if handles.router is not None else []) + list(handles.pods)
    if graceful:
        refs = [a.stop.remote(drain_timeout_s) for a in handles.pods]
        if handles.router is not None:  # (its stop takes no timeout)
            refs.insert(0, handles.router.stop.remote())
        try:
            ray.get(refs, timeout=drain_timeout_s + 60.0)
        except Exception as exc:  # a dead or wedged actor must not stop the teardown
            logger.warning("graceful stop incomplete: %s", exc)
    for actor in actors:
        ray.kill(actor, no_restart=True)
    remove_placement_group(handles.placement_group)


def down(timeout: float = 60.0) -> int:
    """Remove the detached actors and placement group of an earlier `--detach`."""
    found = 0
    names = [ROUTER_NAME] + [pod_name(i) for i in range(1024)]
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            if name.startswith("pagekv-pod-"):
                break  # pods are numbered from 0 without gaps
            continue
        found += 1
        try:
            ray.get(actor.stop.remote(), timeout=timeout)
        except Exception as exc:
            logger.warning("%s did not stop cleanly: %s", name, exc)
        ray.kill(actor, no_restart=True)
    try:
        remove_placement_group(ray.util.get_placement_group(PG_NAME))
    except ValueError:
        pass
    logger.info("removed %d PageKV actors", found)
    return found


def write_prometheus_targets(handles: ClusterHandles, path: str) -> None:
    """Prometheus file_sd: the metrics addresses move when actors restart, so a scrape
    config points at this file (`file_sd_configs: [{files: [path]}]`)."""
    data = [{"targets": handles.metrics_addresses, "labels": {"job": "pagekv-ray"}}]
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # atomic: Prometheus never reads half a file


# -- the CLI ---------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagekv.kvnode.pod.engine_flags import add_engine_arguments

    p.add_argument("--num-nodes", "--num-pods", dest="num_pods", type=int, default=None,
                   metavar="N",
                   help="mixed pods to run (default: one per GPU in the cluster, else 2; 0 "
                        "with --prefill-nodes/--decode-nodes)")
    p.add_argument("--prefill-nodes", type=int, default=0, metavar="N",
                   help="prefill pods (ray-prefill-0...: --role prefill), beside the mixed ones")
    p.add_argument("--decode-nodes", type=int, default=0, metavar="M",
                   help="decode pods (ray-decode-0...: --role decode)")
    p.add_argument("--redis-url", default=None,
                   help="the Redis index every pod and the router use (required, except with "
                        "--down)")
    p.add_argument("--address", default="auto",
                   help="Ray cluster to join (ignored with --local)")
    p.add_argument("--local", action="store_true",
                   help="start a local Ray instance instead of joining a cluster")
    p.add_argument("--host", default=None,
                   help="bind address of the pods and the router (default: each node's IP)")
    p.add_argument("--gpus", choices=("auto", "yes", "no"), default="auto",
                   help="one GPU per pod (auto: when the cluster has one for every pod)")
    p.add_argument("--pod-cpus", type=float, default=None,
                   help="CPUs reserved per pod (default: at most 1, leaving the router its "
                        "share of the cluster)")
    p.add_argument("--router-cpus", type=float, default=1.0)
    p.add_argument("--router-port", type=int, default=50050)
    p.add_argument("--router-metrics-port", type=int, default=9100, help="0: not served")
    p.add_argument("--router-http-port", type=int, default=8000,
                   help="the router's OpenAI HTTP API (0: any free port; -1: not served)")
    p.add_argument("--no-router", action="store_true", help="pods only")
    p.add_argument("--lease-ttl-s", type=float, default=3.0)
    p.add_argument("--max-restarts", type=int, default=-1, help="-1: restart forever")
    p.add_argument("--detach", action="store_true",
                   help="leave the actors running when this command exits")
    p.add_argument("--down", action="store_true", help="remove a --detach deployment")
    p.add_argument("--prometheus-sd-file", default=None,
                   help="write the metrics targets here (Prometheus file_sd), kept current")
    add_engine_arguments(p)


def _connect(args: argparse.Namespace, needed_cpus: float) -> None:
    if args.local:
        # Logical CPUs: enough to place every actor, whatever the machine's core count.
        # address="local": a new instance even when `ray start` left one on this machine.
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(needed_cpus)),
                 include_dashboard=False, namespace=NAMESPACE)
    else:
        ray.init(address=args.address, namespace=NAMESPACE)


def main(args: argparse.Namespace) -> int:
    from pagekv.kvnode.pod.engine_flags import engine_args_from

    engine = asdict(engine_args_from(args))
    model = engine.pop("model")
    if args.down:
        _connect(args, 0)
        try:
            down()
        finally:
            ray.shutdown()
        return 0
    if not args.redis_url:
        logger.error("--redis-url is required (the index the pods publish to)")
        return 2
    roles = args.prefill_nodes + args.decode_nodes
    try:  # refused before Ray starts: a bad count or a --role beside the role counts
        ray_pod_specs(mixed_pod_count(args.num_pods, args.prefill_nodes, args.decode_nodes, 0),
                      args.prefill_nodes, args.decode_nodes, {**engine, "model": model})
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    pods_guess = roles + (args.num_pods if args.num_pods is not None else 0 if roles else 2)
    _connect(args, pods_guess * (args.pod_cpus or 1.0) + args.router_cpus)
    try:
        num_pods = mixed_pod_count(args.num_pods, args.prefill_nodes, args.decode_nodes,
                                   _cluster_gpus())
        try:
            handles = deploy_cluster(
                num_pods, args.redis_url, model, engine_kwargs=engine, host=args.host,
                prefill_pods=args.prefill_nodes, decode_pods=args.decode_nodes,
                use_gpus={"auto": None, "yes": True, "no": False}[args.gpus],
                pod_cpus=args.pod_cpus, router_cpus=args.router_cpus,
                router_port=args.router_port, router_metrics_port=args.router_metrics_port,
                router_http_port=None if args.router_http_port < 0 else args.router_http_port,
                start_router=not args.no_router, lease_ttl_s=args.lease_ttl_s,
                max_restarts=args.max_restarts, detach=args.detach,
            )
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, TimeoutError,
                ValueError) as exc:
            # A constructor that raised (bad engine options, a port taken) is final: Ray
            # restarts actors that die, not ones that never started.
            logger.error("PageKV did not start on Ray: %s", exc)
            return 1
        print("PageKV on Ray is up:\n" + handles.describe(), flush=True)
        if args.prometheus_sd_file:
            write_prometheus_targets(handles, args.prometheus_sd_file)
        if args.detach:
            print("detached: `pagekv ray-up --down` removes it", flush=True)
            return 0
        _watch(handles, args.prometheus_sd_file)
        shutdown_cluster(handles)
        return 0
    finally:
        ray.shutdown()


def _watch(handles: ClusterHandles, sd_file: str | None, interval_s: float = 5.0) -> None:
    """Until SIGINT/SIGTERM: report address changes (restarted actors)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(interval_s):
        try:
            changed = handles.refresh(timeout=interval_s * 6)
        except Exception as exc:  # an actor mid-restart: try again next round
            logger.warning("cannot read actor addresses: %s", exc)
            continue
        if changed:
            logger.info("an actor restarted; now:\n%s", handles.describe())
            if sd_file:
                write_prometheus_targets(handles, sd_file)
    logger.info("stopping PageKV actors")


def cli_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagekv.deploy.ray_cluster",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return main(args)


if __name__ == "__main__":
    # Re-import under the package name: Ray ships actor classes by module reference, and a
    # class defined in __main__ would not be importable on the workers.
    from pagekv.deploy.ray_cluster import cli_main as _cli_main

    sys.exit(_cli_main())
