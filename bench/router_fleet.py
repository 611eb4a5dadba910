"""PageKV's routing decision against NVIDIA Dynamo's KV router, side by side in one run, on
issue #30's synthetic fleet at 16, 64, 256 and 1,024 pods.

The fleet (bench/router_fleet_build.py): 200 chains of 32-128 blocks (16 tokens) on 20 shared
roots, each held by 1-4 pods (seeded); 2,000 requests, each a prefix of one chain plus a
random tail. Both routers see the same claims and the same requests:

* PageKV: a real redis-server (a free loopback port) filled by the pods' real
  `IndexPublisher`s running in other processes than the router's (bench/router_fleet_pods.py:
  each host process many pods, each publisher on its thread renewing its lease every second
  for the whole run); the real `Router` (router/routing.py, constructed as bench/scale.py
  does, the router's defaults), its `PodRegistry` refreshed every 0.5 s between decisions
  (the refresh's CPU is not counted in the decision's). Per request `prepare` (tokens ->
  block hashes) and `decide` (one EVALSHA lookup and the scoring).
* Dynamo (ai-dynamo-runtime 1.6.1, in a venv of its own: bench/router_fleet_dynamo.py): an
  in-process `SelectionService`, one worker per pod subscribed to the pod's KV events in
  vLLM's wire format on ZeroMQ (PageKV's own VllmEventPublisher sends them), `select` per
  request (its hashing, lookup and scoring: compare with PageKV's prepare+decide); and a
  `RadixTree` fed the same events, `find_matches` alone on the requests' block hashes.

Passes alternate (PageKV, Dynamo select, Dynamo radix; `--rounds` times) so that the box's
noise falls on both; rates are each side's median over the rounds. Per core: the deciding
process's CPU time (time.process_time, every thread of it) per decision. Redis's CPU per
decision: INFO cpu (user + sys) over the pass, less its idle rate with the publishers
renewing. Hit quality: the chosen pod's cached depth (in blocks, from the fleet's ground
truth) against the deepest any pod holds, as % of requests that got the deepest. Index
bytes per (block, pod) claim: Redis used_memory after the publishers' writes less before
(registrations included); Dynamo: the RadixTree's RSS growth while loading (and the
selection service's, with its per-worker state, in the JSON).

    python -m bench.router_fleet [--quick] [--pods 16,64,256,1024] [--json PATH]
                                 [--rounds 3] [--requests 2000] [--no-dynamo]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402
import zmq  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from bench.router_fleet_build import Fleet, FleetConfig, build_fleet  # noqa: E402
from bench.router_fleet_pods import PodHosts  # noqa: E402
from bench.stats import pct  # noqa: E402
from pagekv.deploy.redis_server import RedisProcess  # noqa: E402
from pagekv.kvnode.index.kv_events_zmq import VllmEventPublisher, ZmqEventsConfig  # noqa: E402
from pagekv.proto.index import IndexSchema, connect_async  # noqa: E402
from pagekv.proto.kv_events import BlockStored  # noqa: E402
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb  # noqa: E402
from pagekv.proto.vllm_events import short_hash  # noqa: E402
from pagekv.router.config import RouterConfig  # noqa: E402
from pagekv.router.metrics import RouterMetrics  # noqa: E402
from pagekv.router.routing import Router  # noqa: E402
from pagekv.router.tokenize import ByteEncoder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DYNAMO = "ai-dynamo-runtime==1.6.1"
MODEL = "router-fleet"
ZMQ_CHUNK = 128  # pods whose event publishers run at once while Dynamo's service loads


# -- Dynamo's process --------------------------------------------------------------------------

def ensure_dynamo(venv: Path) -> Path:
    """The venv's Python, with Dynamo installed into it on first use (no system site
    packages: Dynamo's pins stay out of PageKV's)."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import dynamo.llm"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"installing {DYNAMO} into {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", DYNAMO], check=True)
    return python


class DynamoProc:
    """bench/router_fleet_dynamo.py under Dynamo's Python: one JSON command a line."""

    def __init__(self, python: Path, fleet_json: Path, log: Path, threads: int) -> None:
        env = {**os.environ, "DYN_LOG": os.environ.get("DYN_LOG", "warn")}
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [str(python), str(ROOT / "bench" / "router_fleet_dynamo.py"), str(fleet_json),
             str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True, env=env, cwd=str(fleet_json.parent))
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"Dynamo's process exited (rc {self.proc.poll()}); its log: "
                               f"{self.log.name}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"Dynamo's process: {reply['error']}")
        return reply

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def first_error(self) -> str:
        """The first ERROR line of its log, its colour codes out."""
        self.log.flush()
        try:
            for line in Path(self.log.name).read_text(errors="replace").splitlines():
                if " ERROR " in re.sub(r"\x1b\[[0-9;]*m", "", line):
                    return re.sub(r"\x1b\[[0-9;]*m", "", line).strip()[:400]
        except OSError:
            pass
        return "(no error in its log)"

    def idle_cpu_rate(self, seconds: float = 1.0) -> float:
        """Its CPU share while idle (its subscribers retrying the publishers gone since)."""
        a = _proc_cpu_s(self.proc.pid)
        time.sleep(seconds)
        return (_proc_cpu_s(self.proc.pid) - a) / seconds

    def close(self) -> None:
        try:
            if self.proc.poll() is None:  # (quit has no reply)
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def dynamo_fleet_json(fleet: Fleet, path: Path) -> None:
    """The fleet as Dynamo's side reads it: vLLM's 64-bit hashes, tokens, one probe a pod
    (its last run's chain: all of a pod's runs travel in one batch)."""
    runs = [[[[short_hash(h) for h in r.hashes],
              short_hash(r.parent) if r.parent is not None else None, r.tokens]
             for r in pod_runs] for pod_runs in fleet.runs]
    probes = [[[fleet.chain_tokens[pod_runs[-1].chain] + [0],
                len(fleet.chain_hashes[pod_runs[-1].chain])]] if pod_runs else []
              for pod_runs in fleet.runs]
    path.write_text(json.dumps({"block_size": fleet.config.block_size,
                                "requests": [r.tokens for r in fleet.requests],
                                "runs": runs, "probes": probes}))


def zmq_context(pods: int) -> zmq.Context:
    """The process's ZeroMQ context, sized for `pods` pods' sockets (two each) before its
    first socket: libzmq's default of 1,023 sockets takes no later change."""
    ctx = zmq.Context.instance()
    if ctx.get(zmq.MAX_SOCKETS) < 4 * pods + 64:
        ctx.set(zmq.MAX_SOCKETS, 4 * pods + 64)
    return ctx


def pod_events(fleet: Fleet, pod: int) -> list[BlockStored]:
    bs = fleet.config.block_size
    return [BlockStored(list(r.hashes), r.parent, list(r.tokens), bs) for r in fleet.runs[pod]]


def load_selection_service(dyn: DynamoProc, fleet: Fleet,
                           keepers: list[zmq.Socket]) -> dict[str, Any]:
    """Each pod's events in vLLM's wire format on ZeroMQ (PageKV's VllmEventPublisher), to
    the service's worker subscribed to it; ZMQ_CHUNK pods at a time, each chunk checked whole
    (a subscriber joining late misses what was sent before: those are sent again). Then
    each publisher's ports are held by idle sockets (`keepers`, closed by the caller): a
    subscriber whose publisher went away retries its connection, which cost Dynamo's
    process 4% of a core at 64 pods."""
    before = dyn.call("rss")["rss"]
    t0 = time.perf_counter()
    resent = 0
    n = len(fleet.pods)
    ctx = zmq_context(n)  # (the publishers' too)
    for start in range(0, n, ZMQ_CHUNK):
        pods = list(range(start, min(n, start + ZMQ_CHUNK)))
        pubs = {p: VllmEventPublisher(ZmqEventsConfig("tcp://127.0.0.1:*",
                                                      "tcp://127.0.0.1:*")) for p in pods}
        try:
            for pub in pubs.values():
                pub.start()
            dyn.call("upsert", workers=[{"pod": p, "kv": pubs[p].endpoint,
                                         "replay": pubs[p].replay_endpoint} for p in pods])
            todo = [p for p in pods if fleet.runs[p]]
            for attempt in range(6):
                time.sleep(0.3 * (attempt + 1))  # the subscriptions reach the publishers
                for p in todo:
                    pubs[p].submit(pod_events(fleet, p))
                deadline = time.monotonic() + 30
                while any(pubs[p].stats()["queued"] for p in todo) and \
                        time.monotonic() < deadline:
                    time.sleep(0.02)
                time.sleep(0.2)
                todo = dyn.call("verify", pods=todo)["missing"]
                if not todo:
                    break
                resent += len(todo)
            else:
                raise RuntimeError(f"Dynamo's service never saw pods {todo[:8]}'s events")
        finally:
            for pub in pubs.values():
                pub.stop()
        for pub in pubs.values():
            for kind, endpoint in ((zmq.PUB, pub.endpoint), (zmq.ROUTER, pub.replay_endpoint)):
                sock = ctx.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(endpoint)
                keepers.append(sock)
    return {"seconds": time.perf_counter() - t0, "rss_delta": dyn.call("rss")["rss"] - before,
            "resent": resent}


# -- PageKV's side -----------------------------------------------------------------------------

def redis_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def keys_bytes(client: redis.Redis) -> int:
    """Every key's exact MEMORY USAGE added up: the index's own bytes, whatever the server
    counts in used_memory beside them (at 1,024 pods used_memory grew ~10x more than this
    with the clients' buffers taken off: per-connection state the allocator reports)."""
    total = 0
    batch: list[bytes] = []
    for key in client.scan_iter(count=1000):
        batch.append(key)
        if len(batch) == 1000:
            total += _usage(client, batch)
            batch = []
    return total + (_usage(client, batch) if batch else 0)


def _usage(client: redis.Redis, keys: list[bytes]) -> int:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key, samples=0)
    return sum(x or 0 for x in pipe.execute())


def index_memory(client: redis.Redis) -> tuple[int, int]:
    """(used_memory less the clients' buffers, the clients' buffers): every pod's
    publisher holds a connection, whose buffers Redis counts in used_memory (~20 KB each:
    800 B a claim at 1,024 pods), and they are no part of the index."""
    info = client.info("memory")
    clients = int(info.get("mem_clients_normal", 0))
    return int(info["used_memory"]) - clients, clients


@dataclass
class PageKV:
    router: Router
    hosts: PodHosts
    sync: redis.Redis
    requests: list[pb.GenerateRequest]
    index: dict[str, Any] = field(default_factory=dict)


async def start_pagekv(fleet: Fleet, url: str, sync: redis.Redis, processes: int,
                       lease_s: float) -> PageKV:
    c = fleet.config
    schema = IndexSchema(MODEL, c.block_size, c.hash_algo, c.hash_seed)
    sync.flushall()
    mem0, conn0 = index_memory(sync)
    t0 = time.perf_counter()
    hosts = PodHosts(fleet, url, schema, processes, lease_s)
    try:
        published = hosts.wait_published()
    except BaseException:
        hosts.stop()
        raise
    publish_s = time.perf_counter() - t0
    if published["claims"] != fleet.claims or published["unplaced"]:
        hosts.stop()
        raise RuntimeError(f"the publishers hold {published} claims, the fleet {fleet.claims}")
    mem1, conn1 = index_memory(sync)
    keys = keys_bytes(sync)
    cfg = RouterConfig(redis_url=url, model=MODEL, block_size=c.block_size,
                       hash_algo=c.hash_algo, hash_seed=c.hash_seed, policy="prefix",
                       random_seed=7, shared_bursts=False)
    client = connect_async(cfg.redis_url, cfg.redis_timeout_s)
    router = Router(cfg, client, ByteEncoder(), RouterMetrics())
    await router.index.register_scripts()
    deadline = time.monotonic() + 60
    while len(router.registry.eligible()) < len(fleet.pods):
        await router.registry.refresh()
        if time.monotonic() > deadline:
            hosts.stop()
            raise RuntimeError(f"only {len(router.registry.eligible())} of {len(fleet.pods)} "
                               f"pods live in the index")
        await asyncio.sleep(0.05)
    requests = [pb.GenerateRequest(request_id=f"r{i}", token_ids=pb.TokenIds(ids=r.tokens),
                                   sampling=pb.SamplingParams(max_tokens=16))
                for i, r in enumerate(fleet.requests)]
    r0, w0 = redis_cpu_s(sync), time.perf_counter()
    await asyncio.sleep(2.0)  # Redis's idle rate: the publishers' lease renewals
    idle = (redis_cpu_s(sync) - r0) / (time.perf_counter() - w0)
    return PageKV(router, hosts, sync, requests, {
        "used_memory_delta": mem1 - mem0, "bytes_per_claim": (mem1 - mem0) / fleet.claims,
        "clients_memory_delta": conn1 - conn0, "keys_bytes": keys,
        "bytes_per_claim_keys": keys / fleet.claims,
        "mem_allocator": str(sync.info("memory").get("mem_allocator", "")),
        "bytes_per_claim_with_connections": (mem1 + conn1 - mem0 - conn0) / fleet.claims,
        "publish_s": publish_s, "publisher_processes": len(hosts.procs),
        "redis_idle_cpu": idle, **published})


async def stop_pagekv(p: PageKV) -> dict[str, int]:
    await p.router.close()
    await p.router.registry.close()
    await p.router.index.aclose()
    return p.hosts.stop()


async def pagekv_pass(p: PageKV) -> dict[str, Any]:
    router, registry = p.router, p.router.registry
    refresh_s = router.config.refresh_interval_s
    prepare_cpu = decide_cpu = refresh_cpu = 0.0
    lat: list[float] = []
    chosen: list[str] = []
    pulled: list[int] = []  # blocks the chosen pod is told to pull from a peer
    reasons: Counter[str] = Counter()
    process_time, perf = time.process_time, time.perf_counter
    await registry.refresh()
    next_refresh = perf() + refresh_s
    gc.collect()
    r0 = redis_cpu_s(p.sync)
    loop_c0, w0 = process_time(), perf()
    for req in p.requests:
        if perf() >= next_refresh:  # as the router's server does, off the decision's clock
            c = process_time()
            await registry.refresh()
            refresh_cpu += process_time() - c
            next_refresh = perf() + refresh_s
        c0 = process_time()
        prepared = router.prepare(req)
        c1 = process_time()
        w1 = perf()
        decision = await router.decide(prepared)
        w2 = perf()
        c2 = process_time()
        prepare_cpu += c1 - c0
        decide_cpu += c2 - c1
        lat.append((w2 - w1) * 1e3)
        top = decision.order[0] if decision.order else None
        chosen.append(top.pod_id if top else "")
        pulled.append(top.pull_blocks if top and top.pull_from else 0)
        reasons[decision.reason] += 1
    loop_cpu = process_time() - loop_c0 - refresh_cpu
    wall = perf() - w0
    redis_cpu = redis_cpu_s(p.sync) - r0
    n = len(p.requests)
    return {"decisions": n, "prepare_cpu_s": prepare_cpu, "decide_cpu_s": decide_cpu,
            "loop_cpu_s": loop_cpu, "refresh_cpu_s": refresh_cpu, "wall_s": wall,
            "decide_per_core_s": n / decide_cpu if decide_cpu else float("inf"),
            "prepare_decide_per_core_s": n / (prepare_cpu + decide_cpu),
            "loop_per_core_s": n / loop_cpu if loop_cpu > 0 else float("inf"),
            "decide_p50_ms": pct(lat, 0.5), "decide_p99_ms": pct(lat, 0.99),
            "redis_cpu_us": redis_cpu / n * 1e6,
            "redis_cpu_net_us": max(0.0, redis_cpu - p.index["redis_idle_cpu"] * wall) / n * 1e6,
            "reasons": dict(reasons), "chosen": chosen, "pulled": pulled}


# -- figures -----------------------------------------------------------------------------------

def hit_quality(fleet: Fleet, chosen: list[int | None],
                pulled: list[int] | None = None) -> dict[str, float]:
    """% of requests whose chosen pod holds the deepest prefix any pod holds, and the chosen
    depths' sum over the oracle's; with `pulled` (PageKV: blocks the chosen pod is told to
    pull from a peer), the same counting a pull's blocks as the pod's."""
    got_best = got = best = with_pull = 0
    for i, (req, pod) in enumerate(zip(fleet.requests, chosen, strict=True)):
        depths = fleet.depths(req)
        top = max(depths.values(), default=0)
        mine = depths.get(pod, 0) if pod is not None else 0
        got_best += mine == top
        with_pull += max(mine, pulled[i] if pulled else 0) >= top
        got += mine
        best += top
    out = {"best_pod_pct": 100.0 * got_best / len(chosen),
           "depth_vs_oracle": got / best if best else 1.0}
    if pulled is not None:
        out["best_pod_pct_with_pulls"] = 100.0 * with_pull / len(chosen)
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run_pods(n: int, args: argparse.Namespace, cfg: FleetConfig, url: str,
                   sync: redis.Redis, dynamo_python: Path | None, work: Path) -> dict[str, Any]:
    fleet = build_fleet(n, cfg)
    res: dict[str, Any] = {"pods": n, "claims": fleet.claims,
                           "distinct_blocks": fleet.distinct_blocks,
                           "holds": sum(len(h) for h in fleet.holders),
                           "requests": len(fleet.requests),
                           "oracle_mean_depth": statistics.mean(
                               fleet.best_depth(r) for r in fleet.requests)}
    print(f"[{n} pods: {fleet.claims} claims on {fleet.distinct_blocks} blocks; loading]",
          flush=True)
    dyn = None
    keepers: list[zmq.Socket] = []
    if dynamo_python is not None:
        path = work / f"fleet-{n}.json"
        dynamo_fleet_json(fleet, path)
        dyn = DynamoProc(dynamo_python, path, work / f"dynamo-{n}.log", args.dynamo_threads)
    pk = await start_pagekv(fleet, url, sync, args.publisher_processes, args.lease_s)
    pods_by_id = {pid: i for i, pid in enumerate(fleet.pods)}
    try:
        res["pagekv_index"] = dict(pk.index)
        if dyn is not None:
            tree = dyn.call("load_tree")
            res["dynamo_tree"] = {**tree, "bytes_per_claim":
                                  (tree["rss_after"] - tree["rss_before"]) / fleet.claims}
            try:
                svc = load_selection_service(dyn, fleet, keepers)
                res["dynamo_service"] = {**svc,
                                         "bytes_per_claim": svc["rss_delta"] / fleet.claims}
            except (RuntimeError, OSError) as exc:  # (1,024 pods: a ZMQ socket a worker)
                res["dynamo_service_error"] = f"{exc}; {dyn.first_error()}"
                print(f"  Dynamo's selection service not measured: "
                      f"{res['dynamo_service_error']}", flush=True)
                dyn.close()  # (its process may not outlive its failed listeners)
                for sock in keepers:
                    sock.close(0)
                keepers.clear()
                dyn = DynamoProc(dynamo_python, path, work / f"dynamo-{n}-tree.log",
                                 args.dynamo_threads)
                tree = dyn.call("load_tree")
                res["dynamo_tree"] = {**tree, "bytes_per_claim":
                                      (tree["rss_after"] - tree["rss_before"]) / fleet.claims}
            res["dynamo_idle_cpu"] = dyn.idle_cpu_rate()
        gc.collect()
        gc.freeze()  # the fleet's objects: no full collection walks them mid-pass
        rounds: dict[str, list[dict[str, Any]]] = {"pagekv": [], "select": [], "radix": []}
        for r in range(args.rounds):
            out = await pagekv_pass(pk)
            rounds["pagekv"].append(out)
            line = (f"  round {r + 1}: PageKV decide {out['decide_per_core_s']:.0f}/s per core "
                    f"(p99 {out['decide_p99_ms']:.2f} ms)")
            if dyn is not None and "dynamo_service" in res:
                sel = dyn.call("select_pass")
                sel["cpu_net_s"] = max(1e-9, sel["cpu_s"] - res["dynamo_idle_cpu"] *
                                       sel["wall_s"])
                rounds["select"].append(sel)
                line += f", Dynamo select {len(sel['chosen']) / sel['cpu_net_s']:.0f}/s"
            if dyn is not None:
                rad = dyn.call("radix_pass")
                rounds["radix"].append(rad)
                line += f", Dynamo radix {len(rad['best']) / rad['cpu_s']:.0f}/s"
            print(line, flush=True)
        gc.unfreeze()
    finally:
        host_stats = await stop_pagekv(pk)
        if dyn is not None:
            dyn.close()
        for sock in keepers:
            sock.close(0)
    res["publishers"] = host_stats
    pk_rounds = rounds["pagekv"]
    last = pk_rounds[-1]
    res["pagekv"] = {
        **{k: median([o[k] for o in pk_rounds]) for k in (
            "decide_per_core_s", "prepare_decide_per_core_s", "loop_per_core_s",
            "redis_cpu_us", "redis_cpu_net_us")},
        "decide_p50_ms": median([o["decide_p50_ms"] for o in pk_rounds]),
        "decide_p99_ms": median([o["decide_p99_ms"] for o in pk_rounds]),
        "prepare_us": median([o["prepare_cpu_s"] / o["decisions"] * 1e6 for o in pk_rounds]),
        "decide_us": median([o["decide_cpu_s"] / o["decisions"] * 1e6 for o in pk_rounds]),
        "refresh_cpu_s_per_s": median([o["refresh_cpu_s"] / o["wall_s"] for o in pk_rounds]),
        "reasons": last["reasons"],
        **hit_quality(fleet, [pods_by_id.get(c) for c in last["chosen"]], last["pulled"]),
        "rounds": [{k: v for k, v in o.items() if k not in ("chosen", "pulled")}
                   for o in pk_rounds]}
    dyn_out: dict[str, Any] = {}
    if rounds["select"]:
        sel = rounds["select"]
        dyn_out.update({
            "select_per_core_s": median([len(s["chosen"]) / s["cpu_net_s"] for s in sel]),
            "select_per_core_s_raw": median([len(s["chosen"]) / s["cpu_s"] for s in sel]),
            "select_p50_ms": median([s["p50_ms"] for s in sel]),
            "select_p99_ms": median([s["p99_ms"] for s in sel]),
            **hit_quality(fleet, [c if 0 <= c < n else None for c in sel[-1]["chosen"]]),
            "rounds": [{k: v for k, v in s.items() if k != "chosen"} for s in sel]})
    if rounds["radix"]:
        rad = rounds["radix"]
        dyn_out.update({
            "radix_per_core_s": median([len(x["best"]) / x["cpu_s"] for x in rad]),
            "radix_hash_us": median([x["hash_cpu_s"] / len(x["best"]) * 1e6 for x in rad]),
            # The tree's deepest match equals the oracle's on every request: it was fed right.
            "radix_matches_oracle": sum(b == fleet.best_depth(q) for b, q in
                                        zip(rad[-1]["best"], fleet.requests, strict=True)),
            "radix_rounds": [{k: v for k, v in x.items() if k != "best"} for x in rad]})
    if dyn_out:
        res["dynamo"] = dyn_out
    return res


def _num(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}" if x == x else "-"  # (nan: not measured)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if b == b and b else "-"


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    nan = float("nan")
    print(f"router_fleet: PageKV's Router.decide vs Dynamo's KV router ({DYNAMO}), one run")
    print(f"machine: {machine_info()}; load average {args.loadavg[0]:.2f} at the start, "
          f"{args.loadavg[1]:.2f} at the end; {args.rounds} alternating rounds a size, "
          f"medians; code {args.code['commit'][:10]}"
          + (f" + {len(args.code['modified'])} modified files under router/ proto/ "
             f"kvnode/index/" if args.code["modified"] else ""))
    c = args.fleet
    print(f"fleet: {c.chains} chains of {c.chain_blocks[0]}-{c.chain_blocks[1]} blocks "
          f"({c.block_size} tokens) on {c.roots} roots sharing {c.root_blocks[0]}-"
          f"{c.root_blocks[1]} blocks, {c.holders[0]}-{c.holders[1]} holders each; "
          f"{c.requests} requests (a chain's prefix + {c.tail_tokens[0]}-{c.tail_tokens[1]} "
          f"random tokens); PageKV's publishers in "
          f"{results[0]['pagekv_index']['publisher_processes'] if results else 0} processes")
    print()
    print("| pods | claims | Dynamo select, decisions/s per core | Dynamo radix lookup /s | "
          "PageKV decide /s per core | PageKV prepare+decide /s per core | "
          "PageKV decide p50 / p99 ms | Redis CPU µs per decision | "
          "best-pod % PageKV / Dynamo | B per claim PageKV (keys alone) / Dynamo | "
          "PageKV decide / Dynamo select | PageKV prepare+decide / Dynamo select |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        p, d = r["pagekv"], r.get("dynamo", {})
        sel = d.get("select_per_core_s", nan)
        tree = r.get("dynamo_tree", {}).get("bytes_per_claim", nan)
        print(f"| {r['pods']:,} | {r['claims']:,} | {_num(sel)} | "
              f"{_num(d.get('radix_per_core_s', nan))} | {_num(p['decide_per_core_s'])} | "
              f"{_num(p['prepare_decide_per_core_s'])} | {p['decide_p50_ms']:.2f} / "
              f"{p['decide_p99_ms']:.2f} | {_num(p['redis_cpu_net_us'])} | "
              f"{p['best_pod_pct']:.1f} / {_num(d.get('best_pod_pct', nan), 1)} | "
              f"{r['pagekv_index']['bytes_per_claim']:.0f} "
              f"({r['pagekv_index']['bytes_per_claim_keys']:.0f}) / {_num(tree)} | "
              f"{_ratio(p['decide_per_core_s'], sel)} | "
              f"{_ratio(p['prepare_decide_per_core_s'], sel)} |")
    print()
    for r in results:
        p, d = r["pagekv"], r.get("dynamo")
        line = (f"{r['pods']} pods: PageKV prepare {p['prepare_us']:.0f} µs + decide "
                f"{p['decide_us']:.0f} µs CPU; reasons "
                + ", ".join(f"{k} {v}" for k, v in sorted(p["reasons"].items()))
                + f"; best pod counting the pulls {p['best_pod_pct_with_pulls']:.1f}%; depth "
                f"vs oracle {p['depth_vs_oracle']:.3f}; Redis CPU "
                f"{p['redis_cpu_us']:.0f} µs per decision before its idle "
                f"{r['pagekv_index']['redis_idle_cpu']:.1%} of a core is taken off; registry "
                f"refresh {p['refresh_cpu_s_per_s']:.1%} of a core (not counted)")
        if d and "select_per_core_s" in d:
            svc = r["dynamo_service"]
            line += (f". Dynamo: select p50 / p99 {d['select_p50_ms']:.3f} / "
                     f"{d['select_p99_ms']:.3f} ms, depth vs oracle "
                     f"{d['depth_vs_oracle']:.3f}, its idle CPU {r['dynamo_idle_cpu']:.1%} of "
                     f"a core taken off ({_num(d['select_per_core_s_raw'])}/s before); "
                     f"selection service's RSS {svc['bytes_per_claim']:.0f} B per claim with "
                     f"its per-worker state")
        elif "dynamo_service_error" in r:
            line += f". Dynamo's select not measured: {r['dynamo_service_error']}"
        if d and "radix_per_core_s" in d:
            line += (f"; radix deepest match = oracle's on {d['radix_matches_oracle']}/"
                     f"{r['requests']} requests, its hashing apart {d['radix_hash_us']:.0f} µs")
        print(line)
    print("(per core: the deciding process's CPU time, every thread, per decision; "
          "Dynamo select = its hashing + lookup + scoring: compare with prepare+decide; "
          "Redis CPU: INFO cpu over the pass less its idle rate with the publishers renewing; "
          "best-pod %: the chosen pod holds the deepest cached prefix of any pod; B per "
          "claim: Redis used_memory growth less its clients' buffers (in brackets: every "
          "key's MEMORY USAGE added up) / Dynamo RadixTree RSS growth, per (block, pod))")


async def run_all(args: argparse.Namespace, dynamo_python: Path | None, url: str,
                  sync: redis.Redis, work: Path) -> list[dict[str, Any]]:
    return [await run_pods(n, args, args.fleet, url, sync, dynamo_python, work)
            for n in args.pods]


def raise_fd_limit() -> None:
    """Every pod a ZeroMQ publisher (2 sockets) here and a subscriber in Dynamo's process
    (which inherits the limit): 1,024 pods pass the usual soft limit of 1,024 files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def code_state() -> dict[str, Any]:
    """The commit, and the files under the decision's packages that differ from it (others'
    work in progress in a shared tree shows in the figures)."""
    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD"),
            "modified": git("status", "--short", "--", "router", "proto", "kvnode/index"
                            ).splitlines()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="16 and 64 pods, 400 requests, one round (a test)")
    ap.add_argument("--pods", type=lambda s: [int(x) for x in s.split(",")],
                    help="pod counts (default 16,64,256,1024; --quick 16,64)")
    ap.add_argument("--requests", type=int, help="requests (default 2000; --quick 400)")
    ap.add_argument("--rounds", type=int, help="alternating rounds a size (default 3; "
                                               "--quick 1)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-work", action="store_true",
                    help="keep the run's folder (Dynamo's logs, the fleets as it read them)")
    ap.add_argument("--no-dynamo", action="store_true", help="PageKV's side only")
    ap.add_argument("--dynamo-venv", type=Path, default=ROOT / ".bench-venvs" / "dynamo")
    ap.add_argument("--dynamo-threads", type=int, default=4,
                    help="SelectionService(indexer_threads=...), Dynamo's default 4")
    ap.add_argument("--publisher-processes", type=int, default=2,
                    help="processes hosting the pods' publishers (default 2)")
    ap.add_argument("--lease-s", type=float, default=10.0,
                    help="the pods' lease TTL (renewed every second; long enough that a "
                         "starved host process does not drop pods mid-pass)")
    args = ap.parse_args(argv)
    args.pods = args.pods or ([16, 64] if args.quick else [16, 64, 256, 1024])
    args.rounds = args.rounds or (1 if args.quick else 3)
    requests = args.requests or (400 if args.quick else 2000)
    args.fleet = replace(FleetConfig(), requests=requests, seed=args.seed)
    dynamo_python = None if args.no_dynamo else ensure_dynamo(args.dynamo_venv)
    raise_fd_limit()
    if dynamo_python is not None:
        zmq_context(max(args.pods))
    args.code = code_state()  # (before the run: what it ran)
    work = Path(tempfile.mkdtemp(prefix="pagekv-bench-router-fleet-"))
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    rp = RedisProcess(data_dir=work / "redis").start()
    sync = redis.Redis.from_url(rp.url)
    try:
        results = asyncio.run(run_all(args, dynamo_python, rp.url, sync, work))
    finally:
        sync.close()
        rp.close()
        if args.keep_work:
            print(f"(the run's files, Dynamo's logs among them: {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
    args.loadavg = (load_start, os.getloadavg()[0])
    print()
    print_table(results, args)
    print(f"(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "router_fleet", "machine": machine_info(), "dynamo": DYNAMO,
            "fleet": asdict(args.fleet), "rounds": args.rounds, "loadavg": args.loadavg,
            "publisher_processes": args.publisher_processes, "lease_s": args.lease_s,
            "code": args.code, "results": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
