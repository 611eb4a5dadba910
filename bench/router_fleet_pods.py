"""bench.router_fleet's pods on PageKV's side: real `IndexPublisher`s, in processes other than
the router's (issue #30: in one process they shared its GIL, most of the lookup's tail).

Each host process runs many pods' publishers, each on its own thread as in a pod: it starts
(registers, an empty first sync), is handed its pod's KV events (`Run`s as BlockStored,
parent-linked, so the publisher places them itself), flushes, then renews its lease every
second with a constant idle load until told to stop. The parent gets each host's count of
claims published and of claims left unplaced (their chain's block 0 unknown: a bug).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from bench.router_fleet_build import Fleet, Run
from pagekv.kvnode.index.publisher import IndexPublisher
from pagekv.proto.index import IndexSchema
from pagekv.proto.kv_events import BlockStored
from pagekv.proto.medium import Medium

logger = logging.getLogger(__name__)

IDLE_LOAD = {"waiting": 0.0, "running": 0.0, "free_blocks": 4096.0, "num_blocks": 4096.0}


@dataclass(frozen=True)
class HostSpec:
    redis_url: str
    schema: tuple[str, int, str, str]  # IndexSchema(model, block_size, hash_algo, hash_seed)
    pods: list[tuple[str, list[Run]]]
    lease_s: float


def _host(spec: HostSpec, conn: Connection) -> None:
    """A host process: start its pods' publishers, publish, report, renew until "stop"."""
    logging.basicConfig(level=logging.WARNING)
    schema = IndexSchema(*spec.schema)
    bs = schema.block_size
    pubs: list[tuple[IndexPublisher, dict[bytes, str]]] = []
    try:
        for pod_id, _runs in spec.pods:
            state: dict[bytes, str] = {}
            pub = IndexPublisher(spec.redis_url, schema, pod_id, f"{pod_id}.fleet.invalid:50051",
                                 schema.hash_config(), lambda: dict(IDLE_LOAD),
                                 lambda state=state: dict(state), lease_ttl_s=spec.lease_s)
            if not pub.start(timeout=30):
                raise RuntimeError(f"{pod_id}: the publisher's first sync failed")
            pubs.append((pub, state))
        for (pub, state), (_pod_id, runs) in zip(pubs, spec.pods, strict=True):
            for run in runs:  # the state first: full_state_fn reflects every event submitted
                state.update(dict.fromkeys(run.hashes, Medium.GPU))
            pub.submit([BlockStored(list(run.hashes), run.parent, list(run.tokens), bs)
                        for run in runs])
        for pub, _ in pubs:
            if not pub.flush(30.0):
                raise RuntimeError(f"{pub.pod_id}: claims not visible after 30 s")
        stats = [pub.stats() for pub, _ in pubs]
        conn.send({"claims": sum(s["claims"] for s in stats),
                   "unplaced": sum(s["claims_unplaced"] for s in stats),
                   "errors": sum(s["errors"] for s in stats)})
        conn.recv()  # "stop"
        conn.send({"lease_renewals": sum(pub.stats()["lease_renewals"] for pub, _ in pubs),
                   "errors": sum(pub.stats()["errors"] for pub, _ in pubs)})
    except Exception as exc:  # noqa: BLE001 - told to the parent, which fails the run
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        for pub, _ in pubs:
            pub.stop(clear=False, timeout=5)


class PodHosts:
    """`processes` host processes sharing the fleet's pods round-robin."""

    def __init__(self, fleet: Fleet, redis_url: str, schema: IndexSchema, processes: int,
                 lease_s: float = 10.0) -> None:
        ctx = mp.get_context("spawn")  # nothing of the parent's state (its loop, its clients)
        args = (schema.model, schema.block_size, schema.hash_algo, schema.hash_seed)
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        n = max(1, min(processes, len(fleet.pods)))
        for i in range(n):
            pods = [(fleet.pods[p], fleet.runs[p]) for p in range(i, len(fleet.pods), n)]
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_host, args=(HostSpec(redis_url, args, pods, lease_s),
                                                   child), daemon=True,
                               name=f"router-fleet-pods-{i}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def wait_published(self, timeout: float = 600.0) -> dict[str, int]:
        """Every host's claims visible in Redis: their counts added up."""
        total = {"claims": 0, "unplaced": 0, "errors": 0}
        for conn in self.conns:
            if not conn.poll(timeout):
                raise TimeoutError("a pod host did not publish in time")
            reply = conn.recv()
            if "error" in reply:
                raise RuntimeError(f"pod host: {reply['error']}")
            for k in total:
                total[k] += reply[k]
        return total

    def stop(self) -> dict[str, int]:
        total = {"lease_renewals": 0, "errors": 0}
        for conn in self.conns:
            try:
                conn.send("stop")
                if conn.poll(30):
                    reply = conn.recv()
                    for k in total:
                        total[k] += reply.get(k, 0)
            except (OSError, EOFError):
                pass
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
        return total
