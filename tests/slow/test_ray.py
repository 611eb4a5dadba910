"""PageKV on Ray: pods and the router as actors on a local Ray instance, a real Redis.

Ray 2.60 turns token authentication on for a new local instance and writes the token to
~/.ray/auth_token by itself, so `ray.init(num_cpus=2)` needs no interaction. The instance
is started (and shut down) by this module only: RAY_ADDRESS is cleared and address="local"
is passed, so no other cluster on the machine is ever joined. Our Redis is a private
redis-server on a free port (never 6379, which a Ray head may own).
"""

from __future__ import annotations

import json
import random
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import yaml

from pagekv.deploy.redis_server import RedisProcess
from pagekv.proto.hashing import DEFAULT_HASH_SEED, HashConfig, hash_prompt
from pagekv.proto.index import IndexSchema, list_live_pods, lookup_prefix
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

ray = pytest.importorskip("ray")

from pagekv.deploy.ray_cluster import (  # noqa: E402 - after the importorskip
    ClusterHandles,
    PodActor,
    deploy_cluster,
    shutdown_cluster,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BS = 16
SCHEMA = IndexSchema("pagekv-tiny", BS, "sha256", DEFAULT_HASH_SEED)
ENGINE = {"num_gpu_blocks": 128, "max_model_len": 1024, "max_num_batched_tokens": 1024}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def request(ids: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True))


def wait_for(check, what: str, timeout: float = 60.0, interval: float = 0.2):
    """Poll `check()` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with RedisProcess(data_dir=tmp_path_factory.mktemp("ray-redis")) as proc:
        assert proc.port != 6379
        yield proc.url


@pytest.fixture(scope="module")
def cluster(redis_url: str) -> Iterator[ClusterHandles]:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no reporting thread, no network
        # "local": always a new instance, never a `ray start` cluster found on this machine.
        # Ray's own start-up deadlines (30 s for the GCS and for the raylet to register) are
        # sometimes missed on a 2-core box after a long suite: try again, from scratch.
        for attempt in (1, 2, 3):
            try:
                ray.init(address="local", num_cpus=2, include_dashboard=False,
                         namespace="pagekv-test")
                break
            except Exception:  # Ray raises RuntimeError or a bare Exception for these
                ray.shutdown()
                if attempt == 3:
                    raise
                time.sleep(2.0)
        try:
            # 2 logical CPUs: two half-CPU pods and a half-CPU router fit with room to spare.
            handles = deploy_cluster(
                2, redis_url, "pagekv-tiny", engine_kwargs=ENGINE, host="127.0.0.1",
                pod_cpus=0.5, router_cpus=0.5, router_port=0, router_http_port=0,
                serve_metrics=False,
                lease_ttl_s=1.5, start_timeout_s=120.0,
            )
            try:
                yield handles
            finally:
                shutdown_cluster(handles, drain_timeout_s=5.0)
        finally:
            ray.shutdown()


def router_stub(handles: ClusterHandles) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(handles.router_address))


def test_pods_and_router_serve_with_prefix_affinity(cluster: ClusterHandles,
                                                     redis_url: str) -> None:
    assert len(cluster.pods) == 2 and cluster.router_address
    assert all(a.startswith("127.0.0.1:") for a in cluster.pod_addresses)
    # Both pods registered in Redis, each under the address its actor reports.
    client = redis.Redis.from_url(redis_url)
    live = wait_for(lambda: len(list_live_pods(client, SCHEMA)) == 2
                    and list_live_pods(client, SCHEMA), "two live pods in Redis")
    assert {p.pod_id: p.address for p in live} == dict(zip(cluster.pod_ids,
                                                           cluster.pod_addresses, strict=True))
    wait_for(lambda: ray.get(cluster.router.live_pods.remote()) == sorted(cluster.pod_ids),
             "the router to see both pods")
    # Distinct worker processes, all alive.
    pids = ray.get([p.pid.remote() for p in cluster.pods] + [cluster.router.pid.remote()])
    assert len(set(pids)) == 3

    stub = router_stub(cluster)
    system = [256] + tokens(1, 159)  # ten full blocks
    first = stub.Generate(request(system + tokens(2, 12)), timeout=60)
    assert first.served_by in cluster.pod_ids
    assert len(first.completions[0].token_ids) == 2
    hashes = hash_prompt(HashConfig("sha256", DEFAULT_HASH_SEED), BS, system)
    wait_for(lambda: (m := lookup_prefix(client, SCHEMA, hashes).get(first.served_by))
             and m.depth == len(hashes), "the served prefix in the index")
    again = stub.Generate(request(system + tokens(3, 12)), timeout=60)
    assert again.served_by == first.served_by
    assert again.usage.cached_tokens == len(system)
    # The router actor's OpenAI API routes the same prefix to the same pod.
    assert cluster.router_http_address
    body = json.dumps({"prompt": system + tokens(4, 12), "max_tokens": 2, "temperature": 0,
                       "ignore_eos": True}).encode()
    with urllib.request.urlopen(urllib.request.Request(
            f"http://{cluster.router_http_address}/v1/completions", body,
            {"Content-Type": "application/json"}), timeout=60) as resp:
        out = json.loads(resp.read())
    assert out["pagekv"]["served_by"] == first.served_by
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(system)


def test_killed_pod_restarts_with_a_new_epoch_and_serves(cluster: ClusterHandles,
                                                         redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    victim, pod_id = cluster.pods[0], cluster.pod_ids[0]
    old_pid = ray.get(victim.pid.remote())
    old_epoch = ray.get(victim.epoch.remote())
    assert client.get(SCHEMA.lease_key(pod_id)).decode() == old_epoch

    ray.kill(victim, no_restart=False)  # a crash, as far as the pod knows: no clean-up runs
    # Method calls wait for the restart (max_task_retries); a call may still land on the
    # dying instance, hence the loop.
    new_pid = wait_for(lambda: (p := _try(victim.pid)) not in (None, old_pid) and p,
                       "the pod actor to restart", timeout=90)
    new_epoch = ray.get(victim.epoch.remote())
    assert new_pid != old_pid and new_epoch and new_epoch != old_epoch
    lease = wait_for(lambda: client.get(SCHEMA.lease_key(pod_id)), "the new lease")
    assert lease.decode() == new_epoch
    cluster.refresh()  # the restarted pod picked a free port anew
    new_address = cluster.pod_addresses[0]
    assert {p.pod_id: p.address for p in list_live_pods(client, SCHEMA)}[pod_id] == new_address

    # It serves directly...
    direct = pb_grpc.GenerationStub(grpc.insecure_channel(new_address))
    system = [256] + tokens(10, 959)  # 60 blocks: reuse outweighs any prefill-speed gap
    resp = direct.Generate(request(system + tokens(11, 12)), timeout=60)
    assert resp.served_by == pod_id and resp.usage.cached_tokens == 0  # a cold cache
    # ...and through the router, which dials the new address for the prefix it now holds,
    # once the router has the pod's new registration and its measured prefill cost (the
    # other pod publishes one already; a pod without one is costed at a slow default).
    hashes = hash_prompt(HashConfig("sha256", DEFAULT_HASH_SEED), BS, system)
    wait_for(lambda: (m := lookup_prefix(client, SCHEMA, hashes).get(pod_id))
             and m.depth == len(hashes), "the restarted pod's blocks in the index")
    wait_for(lambda: (seen := ray.get(cluster.router.pods.remote()).get(pod_id))
             and seen["address"] == new_address and "prefill" in seen["costs"],
             "the router to take the restarted pod back")
    routed = router_stub(cluster).Generate(request(system + tokens(12, 12)), timeout=60)
    assert routed.served_by == pod_id, routed.routing
    assert routed.usage.cached_tokens == len(system)
    # The other pod never stopped serving.
    other = pb_grpc.GenerationStub(grpc.insecure_channel(cluster.pod_addresses[1]))
    assert other.Generate(request(tokens(13, 40)), timeout=60).served_by == cluster.pod_ids[1]


def _try(method) -> int | None:
    try:
        return ray.get(method.remote(), timeout=30)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def test_pod_actor_retries_when_its_port_is_taken_before_bind(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor class itself, in this process (no Ray needed): the first port it picks is
    taken by someone else by the time it binds."""
    from pagekv.deploy import redis_server

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        real, picks = redis_server.free_port, iter([busy])
        monkeypatch.setattr(redis_server, "free_port",
                            lambda host="127.0.0.1": next(picks, None) or real(host))
        actor = PodActor("bind-test", redis_url, {"model": "pagekv-tiny", **ENGINE},
                         host="127.0.0.1", serve_metrics=False)
        try:
            address = actor.address()
            assert address != f"127.0.0.1:{busy}"
            stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
            assert stub.Generate(request(tokens(20, 30)), timeout=60).served_by == "bind-test"
        finally:
            actor.stop(1.0)


# -- the cluster configs: structure only (no cloud, no Kubernetes here) ----------------------

def test_ray_launcher_config_installs_and_starts_pagekv() -> None:
    cfg = yaml.safe_load((ROOT / "deploy" / "ray-cluster.yaml").read_text())
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types and len(types) >= 2
    workers = [t for name, t in types.items() if name != cfg["head_node_type"]]
    assert any(t["resources"].get("GPU") == 1 for t in workers)  # one pod per GPU
    setup = " ".join(cfg["setup_commands"])
    assert "pip install" in setup and "pagekv" in setup
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    assert any("ray start" in c and "--address" in c for c in cfg["worker_start_ray_commands"])
    assert "6379" not in " ".join(cfg.get("head_setup_commands", []))  # the index's Redis


def test_kuberay_manifest_is_a_raycluster_with_gpu_workers() -> None:
    docs = [d for d in yaml.safe_load_all(
        (ROOT / "deploy" / "kuberay-raycluster.yaml").read_text()) if d]
    rc = next(d for d in docs if d["kind"] == "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert 50050 in {p["containerPort"] for p in head["ports"]}  # the router
    group = rc["spec"]["workerGroupSpecs"][0]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert str(limits["nvidia.com/gpu"]) == "1"
    assert any(d["kind"] == "Service" and d["metadata"]["name"] == "pagekv-redis" for d in docs)


def test_a_deployment_that_cannot_fit_is_refused_up_front_with_the_numbers(
        cluster: ClusterHandles, redis_url: str) -> None:
    """Two 1-CPU pods and a 1-CPU router on 2 CPUs: the router could never be placed."""
    with pytest.raises(ValueError, match=r"needs 3 CPUs \(2 pods x 1 \+ router 1\).* has 2"):
        deploy_cluster(2, redis_url, "pagekv-tiny", engine_kwargs=ENGINE, host="127.0.0.1",
                       pod_cpus=1.0, router_cpus=1.0, start_timeout_s=5.0)


def test_waiting_for_placement_logs_and_times_out_naming_what_is_missing(
        cluster: ClusterHandles, redis_url: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """It fits the cluster's total, but the running deployment holds the CPUs it needs."""
    import logging

    from pagekv.deploy import ray_placement

    monkeypatch.setattr(ray_placement, "LOG_EVERY_S", 0.5)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger=ray_placement.__name__), \
            pytest.raises(TimeoutError, match=r"placement group \(needs \{'CPU': 1\.0\}\)"):
        deploy_cluster(1, redis_url, "pagekv-tiny", engine_kwargs=ENGINE, host="127.0.0.1",
                       pod_cpus=1.0, router_cpus=0.5, start_timeout_s=2.0)
    assert time.monotonic() - t0 < 30
    assert sum("waiting for the pods' placement group" in r.getMessage()
               for r in caplog.records) >= 2
    # Nothing was left behind: the live deployment still serves.
    assert router_stub(cluster).Generate(request(tokens(9, 40)), timeout=60).completions


def test_ray_up_deploys_pods_with_their_roles(cluster: ClusterHandles,
                                              redis_url: str) -> None:
    """--prefill-nodes/--decode-nodes on the suite's Ray instance: each actor's engine has its
    role (Stats, the registration). Pods only, a quarter CPU each (what the running deployment
    leaves free), in Redis database 1: the running router never sees them."""
    other_db = redis_url.rsplit("/", 1)[0] + "/1"
    handles = deploy_cluster(0, other_db, "pagekv-tiny", engine_kwargs=ENGINE,
                             host="127.0.0.1", pod_cpus=0.25, start_router=False,
                             serve_metrics=False, lease_ttl_s=1.5, start_timeout_s=120.0,
                             prefill_pods=1, decode_pods=1)
    try:
        assert handles.pod_ids == ["ray-prefill-0", "ray-decode-0"]
        assert handles.pod_roles == ["prefill", "decode"]
        assert "ray-prefill-0:  127.0.0.1:" in handles.describe()
        assert "role decode" in handles.describe()
        for pod_id, address, role in zip(handles.pod_ids, handles.pod_addresses,
                                         handles.pod_roles, strict=True):
            with grpc.insecure_channel(address) as channel:
                stats = pb_grpc.KVNodeStub(channel).Stats(pb.StatsRequest(), timeout=30)
            assert (stats.pod_id, stats.role) == (pod_id, role)
        client = redis.Redis.from_url(other_db)
        live = wait_for(lambda: len(pods := list_live_pods(client, SCHEMA)) == 2 and pods,
                        "both role pods in the index")
        assert {p.pod_id: p.role for p in live} == {"ray-prefill-0": "prefill",
                                                    "ray-decode-0": "decode"}
    finally:
        shutdown_cluster(handles, drain_timeout_s=5.0)
    # The running deployment's router saw none of them.
    assert ray.get(cluster.router.live_pods.remote()) == sorted(cluster.pod_ids)


def test_ray_up_refuses_an_engine_role_beside_role_counts_before_starting_ray() -> None:
    from pagekv.deploy.ray_cluster import cli_main

    was_up = ray.is_initialized()
    rc = cli_main(["--local", "--redis-url", "redis://127.0.0.1:1/0", "--role", "decode",
                   "--prefill-nodes", "1"])
    assert rc == 2
    assert ray.is_initialized() == was_up  # neither joined nor shut down


def test_pod_cpus_fit_the_router_in_when_not_given() -> None:
    from pagekv.deploy.ray_placement import plan_pod_cpus

    assert plan_pod_cpus(2, None, 1.0, True, 2.0) == 0.5
    assert plan_pod_cpus(2, None, 1.0, True, 16.0) == 1.0
    assert plan_pod_cpus(4, None, 1.0, False, 2.0) == 0.5
    with pytest.raises(ValueError, match="needs"):
        plan_pod_cpus(2, None, 2.0, True, 2.0)
