"""Issue #27's findings as scenarios on the network-namespace test bed (deploy/netns_bed.py),
measured from public behaviour only: calls through the router and their codes and tokens,
the pods' Stats, the router's /metrics and log. bench/faults.py prints one row each.

- hung pod: a pod SIGSTOPped under load, then SIGCONTed;
- garbage in the index: NaN in a pod's published load, a block-0 claim of an unknown tier,
  written over and over (the pod rewrites its own record) while calls go through the router;
- slowloris: HTTP connections to the router's API that send a header line a second and never
  finish their headers, while gRPC calls go on;
- client hangups: HTTP requests whose client closes halfway through the body;
- cancelled pulls: pulls the puller gives up on (a short deadline over a slow link) while the
  holder is busy; every block must come back on both.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.request

import grpc
import redis
from prometheus_client.parser import text_string_to_metric_families

from bench import netns_partitions as parts
from pagekv.deploy.netns_bed import NetnsBed
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb


def hung_pod(bed: NetnsBed, victim: str, warm_s: float = 2.0, stop_s: float = 6.0,
             after_s: float = 8.0, concurrency: int = 4, deadline_s: float = 10.0) -> dict:
    load = parts.start_load(bed, concurrency, deadline_s, seed=3)
    time.sleep(warm_s)
    pid = bed.pod(victim).proc.pid
    os.killpg(pid, signal.SIGSTOP)
    try:
        time.sleep(stop_s)
    finally:
        os.killpg(pid, signal.SIGCONT)
    resumed = time.monotonic()
    time.sleep(after_s)
    calls, stuck = load.stop()
    return {**parts.summary(calls, deadline_s, stuck), "stop_s": stop_s,
            "recovery_s": parts.recovery_after(calls, resumed,
                                               lambda c: c.served_by == victim),
            "leaked_blocks": parts.leaked_blocks(bed)}


def index_garbage(bed: NetnsBed, warm_s: float = 2.0, garbage_s: float = 5.0,
                  after_s: float = 5.0, concurrency: int = 4, deadline_s: float = 10.0) -> dict:
    """Garbage written into the index every 50 ms for `garbage_s`; calls must not notice."""
    r = redis.Redis.from_url(bed.redis_url(), socket_timeout=5, decode_responses=True)
    load = parts.start_load(bed, concurrency, deadline_s, seed=4)
    time.sleep(warm_s)
    pod_keys = [k for k in r.scan_iter(match="*:p:*", count=1000) if r.type(k) == "hash"]
    raw = redis.Redis.from_url(bed.redis_url(), socket_timeout=5)  # claims are binary
    claims = [k for k in raw.scan_iter(match="*:c", count=1000) if raw.type(k) == b"hash"]
    end = time.monotonic() + garbage_s
    while time.monotonic() < end:
        for k in pod_keys:
            r.hset(k, mapping={"load.waiting": "nan", "load.free_blocks": "1e308"})
        for k in claims[:50]:  # a block's claims that are not whole (claim id, mask) entries
            for field in raw.hkeys(k)[:1]:
                raw.hset(k, field, b"Z" * 7)
        time.sleep(0.05)
    cleaned = time.monotonic()
    time.sleep(after_s)
    calls, stuck = load.stop()
    r.close()
    raw.close()
    during = [c for c in calls if c.started < cleaned]
    return {**parts.summary(calls, deadline_s, stuck), "garbage_s": garbage_s,
            "pod_records": len(pod_keys), "claims_spoiled": min(len(claims), 50),
            "failed_while_garbage": sum(c.code != "OK" for c in during),
            "recovery_s": parts.recovery_after(calls, cleaned, lambda c: True),
            "leaked_blocks": parts.leaked_blocks(bed)}


def router_metric(bed: NetnsBed, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(bed.metrics_url("router"), timeout=5).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def slowloris(bed: NetnsBed, connections: int = 50, hold_s: float = 20.0,
              concurrency: int = 4, deadline_s: float = 10.0) -> dict:
    """`connections` sockets each sending one more header line a second for `hold_s`."""
    host, port = bed.router_http()
    closed_after: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        t0 = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n")
                s.settimeout(1.0)
                i = 0
                while time.monotonic() - t0 < hold_s:
                    s.sendall(b"X-Slow-%d: %s\r\n" % (i, b"a" * 64))
                    i += 1
                    try:
                        if s.recv(4096) == b"":  # the server closed it
                            break
                    except TimeoutError:
                        continue
                else:
                    return  # still open at the end
        except OSError:
            pass
        with lock:
            closed_after.append(time.monotonic() - t0)

    load = parts.start_load(bed, concurrency, deadline_s, seed=5)
    threads = [threading.Thread(target=one, daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(hold_s + 10)
    calls, stuck = load.stop()
    closed_after.sort()
    return {**parts.summary(calls, deadline_s, stuck), "connections": connections,
            "hold_s": hold_s, "closed_by_server": len(closed_after),
            "closed_median_s": closed_after[len(closed_after) // 2] if closed_after else None,
            "leaked_blocks": parts.leaked_blocks(bed)}


def client_hangups(bed: NetnsBed, clients: int = 50) -> dict:
    """Requests announcing a 10 kB body that close after 100 bytes of it."""
    host, port = bed.router_http()
    before_500 = router_metric(bed, "pagekv_router_http_requests_total", status="500")
    before_499 = router_metric(bed, "pagekv_router_http_requests_total", status="499")
    log = bed.pod("router").log_path
    log_before = log.stat().st_size
    body = b'{"model": "pagekv-tiny", "prompt": "' + b"x" * 80
    for _ in range(clients):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 10000\r\n\r\n" + body)
            time.sleep(0.02)
    time.sleep(2.0)
    with open(log, "rb") as f:
        f.seek(log_before)
        added = f.read().decode(errors="replace")
    ok = grpc_ok(bed)
    return {"clients": clients, "status_500": router_metric(
                bed, "pagekv_router_http_requests_total", status="500") - before_500,
            "status_499": router_metric(
                bed, "pagekv_router_http_requests_total", status="499") - before_499,
            "traceback_lines": added.count("Traceback"), "log_lines": added.count("\n"),
            "router_serving_after": ok}


def grpc_ok(bed: NetnsBed) -> bool:
    try:
        parts.generate(bed.address("router"), parts.request([1, 2, 3, 4], 2), 10)
        return True
    except grpc.RpcError:
        return False


def cancelled_pulls(bed: NetnsBed, holder: str, puller: str, pulls: int = 6,
                    rate: str = "2mbit", pull_deadline_s: float = 0.3,
                    prompt_tokens: int = 720) -> dict:
    """Pulls given up on at the client's short deadline while the holder serves load."""
    import random
    rng = random.Random(6)
    load = parts.start_load(bed, 4, 10.0, seed=6)
    bed.mesh.set_rate(holder, puller, rate)
    source = pb.KvSource(pod_id=holder, address=bed.address(holder),
                         num_blocks=(prompt_tokens - 1) // parts.BLOCK)
    codes: dict[str, int] = {}
    try:
        for _ in range(pulls):
            p = [rng.randrange(1, 256) for _ in range(prompt_tokens)]
            parts.generate(bed.address(holder), parts.request(p, 2, cold=True), 60)
            try:
                parts.generate(bed.address(puller), parts.request(p, 2, source=source),
                               pull_deadline_s)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            codes[code] = codes.get(code, 0) + 1
    finally:
        bed.mesh.set_rate(holder, puller, bed.mesh.rate)
    calls, stuck = load.stop()
    return {**parts.summary(calls, 10.0, stuck), "pulls": pulls, "pull_codes": codes,
            "leaked_blocks": parts.leaked_blocks(bed, timeout=20.0)}
