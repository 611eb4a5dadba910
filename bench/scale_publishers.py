"""bench.scale's simulated pods' index publishers: in worker processes, or in the router's.

Every simulated pod publishes through the pod's own `IndexPublisher`. Where those run
matters to what the benchmark measures: a real router shares its process (and its GIL)
with no publisher, so `WorkerPublishers` (the default) hosts them in a few worker
processes of their own (`python -m bench.scale_publishers`, many pods each), and
`ThreadPublishers` keeps them as one thread per pod in the caller's process (what
bench.scale measured before issue #30; kept for the before/after comparison).

Both keep the simulation's semantics: at each 50 ms simulated publish tick the pods' KV
events since the last one are submitted, and `tick` returns only once every batch is
visible in Redis, so simulated time moves on over an index that shows them. Lease renewals
(carrying each pod's load and measured costs) run on the wall clock between ticks, as a
pod's do. A worker drives its publishers from one loop (`IndexPublisher.start(thread=
False)`, then `step()`; the vLLM ingester's mode): `step(write=True)` writes what was
submitted before it returns. Its pods' load and costs are what the last tick sent, and
their full state (for a republish after a Redis error) is a `ClaimMirror` of the events it
was sent: the same tier masks the pod's own would give.

Messages are pickled, length-prefixed frames on the worker's stdin and stdout.
"""

from __future__ import annotations

import heapq
import os
import pickle
import select
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagekv.kvnode.index.publisher import IndexPublisher  # noqa: E402
from pagekv.proto.index.mirror import ClaimMirror  # noqa: E402
from pagekv.proto.index.schema import IndexSchema  # noqa: E402
from pagekv.proto.medium import MEDIUMS  # noqa: E402

_HEADER = struct.Struct("!Q")
WRITE_TIMEOUT_S = 5.0  # a tick's batch not visible by then: counted, the tick goes on


@dataclass(slots=True)
class PodUpdate:
    """What one pod hands its publisher at a tick: its KV events since the last one (none
    when it publishes no claims), and its load and measured costs when they changed."""

    events: list = field(default_factory=list)
    load: dict[str, float] | None = None
    costs: dict[str, float] | None = None


@dataclass(frozen=True, slots=True)
class PodSpec:
    pod_id: str
    address: str


# -- framing ------------------------------------------------------------------------------

def send(fd: int, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("publisher worker pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv(fd: int) -> Any:
    (n,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    return pickle.loads(_read_exactly(fd, n))


# -- one pod's book in a worker -----------------------------------------------------------

_TIER_OF_BIT = sorted(((m.bit, m.value) for m in MEDIUMS), reverse=True)


class PodBook:
    """A pod as its worker knows it: the load and costs the last tick sent, and a mirror of
    every event sent (its full state, should the publisher have to republish)."""

    __slots__ = ("costs", "load", "mirror")

    def __init__(self) -> None:
        self.load: dict[str, float] = {}
        self.costs: dict[str, float] = {}
        self.mirror = ClaimMirror()

    def get_load(self) -> dict[str, float]:
        return self.load

    def get_costs(self) -> dict[str, float]:
        return self.costs

    def full_state(self) -> dict[bytes, str]:
        # One tier per hash, as a pod's own full state has it (the lowest tier holding it).
        out: dict[bytes, str] = {}
        for h, mask in self.mirror.masks.items():
            for bit, tier in _TIER_OF_BIT:
                if mask & bit:
                    out[h] = tier
                    break
        return out


def _visible(pub: IndexPublisher) -> bool:
    s = pub.stats()
    return bool(s["visible_seq"] >= s["seq"])


def write_now(pub: IndexPublisher, timeout_s: float = WRITE_TIMEOUT_S) -> bool:
    """Step a driven publisher until what was submitted to it is visible in Redis."""
    deadline = time.monotonic() + timeout_s
    pub.step(write=True)
    while not _visible(pub):
        if time.monotonic() > deadline:
            return False
        pub.step(write=True)  # after a failure: its back-off, then the republish
    return True


def worker_main(fd_in: int, fd_out: int) -> None:
    """The worker's loop: build and start its pods' publishers, then serve ticks and step
    each publisher when its lease renewal is due."""
    hello = recv(fd_in)
    schema = IndexSchema(*hello["schema"])
    pubs: list[IndexPublisher] = []
    books: dict[str, PodBook] = {}
    by_id: dict[str, IndexPublisher] = {}
    t0 = time.perf_counter()
    failed = []
    for spec in hello["pods"]:
        book = PodBook()
        pub = IndexPublisher(hello["redis_url"], schema, spec.pod_id, spec.address,
                             schema.hash_config(), book.get_load, book.full_state,
                             book.get_costs, flush_interval_s=hello["flush_interval_s"])
        if not pub.start(timeout=30, thread=False):
            failed.append(spec.pod_id)
        pubs.append(pub)
        books[spec.pod_id] = book
        by_id[spec.pod_id] = pub
    send(fd_out, {"started_s": time.perf_counter() - t0, "failed": failed})
    due = [(time.monotonic(), i) for i in range(len(pubs))]
    heapq.heapify(due)
    while True:
        wait = max(0.0, due[0][0] - time.monotonic()) if due else None
        ready, _, _ = select.select([fd_in], [], [], wait)
        if not ready:
            now = time.monotonic()
            while due and due[0][0] <= now:  # renewals due
                _, i = heapq.heappop(due)
                heapq.heappush(due, (time.monotonic() + pubs[i].step(), i))
            continue
        try:
            msg = recv(fd_in)
        except EOFError:  # the simulation went away without a stop: leave to the leases
            return
        kind = msg[0]
        if kind == "tick":
            updates: Mapping[str, PodUpdate] = msg[1]
            for pod_id, u in updates.items():
                book = books[pod_id]
                if u.load is not None:
                    book.load = u.load
                if u.costs is not None:
                    book.costs = u.costs
                if u.events:
                    book.mirror.apply(u.events)
                    by_id[pod_id].submit(u.events)
            lags, late = [], []
            for pod_id, u in updates.items():
                if u.events:
                    w0 = time.perf_counter()
                    if not write_now(by_id[pod_id]):
                        late.append(pod_id)
                    lags.append(time.perf_counter() - w0)
            send(fd_out, (lags, late))
        elif kind == "stats":
            send(fd_out, [p.stats() for p in pubs])
        elif kind == "cpu":
            send(fd_out, time.process_time())
        elif kind == "stop":
            for p in pubs:
                p.stop(clear=False, timeout=5)
            send(fd_out, "stopped")
            return


# -- the two placements -------------------------------------------------------------------

class WorkerPublishers:
    """The pods' publishers in `workers` processes (pods dealt out in turn)."""

    def __init__(self, redis_url: str, schema: IndexSchema, pods: Sequence[PodSpec],
                 workers: int, flush_interval_s: float = 1.0) -> None:
        self.workers = max(1, min(workers, len(pods)))
        self.redis_url = redis_url
        self.schema = schema
        self.pods = list(pods)
        self.flush_interval_s = flush_interval_s
        self.worker_of: dict[str, int] = {}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._fds: list[tuple[int, int]] = []  # (to the worker, from the worker)
        self.failed: list[str] = []

    @property
    def where(self) -> str:
        return f"{self.workers} worker processes"

    def start(self) -> float:
        """Start the workers and every publisher's first sync; the seconds it took."""
        t0 = time.perf_counter()
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH",
                                                                               "")}
        groups: list[list[PodSpec]] = [[] for _ in range(self.workers)]
        for i, spec in enumerate(self.pods):
            groups[i % self.workers].append(spec)
            self.worker_of[spec.pod_id] = i % self.workers
        for group in groups:
            to_r, to_w = os.pipe()
            from_r, from_w = os.pipe()
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.scale_publishers", str(to_r), str(from_w)],
                pass_fds=(to_r, from_w), cwd=root, env=env)
            os.close(to_r)
            os.close(from_w)
            self._procs.append(proc)
            self._fds.append((to_w, from_r))
            s = self.schema
            send(to_w, {"schema": (s.model, s.block_size, s.hash_algo, s.hash_seed, s.prefix),
                        "redis_url": self.redis_url, "pods": group,
                        "flush_interval_s": self.flush_interval_s})
        for _, fd in self._fds:
            self.failed += recv(fd)["failed"]
        if self.failed:
            raise RuntimeError(f"publishers' first sync failed: {self.failed[:5]}")
        return time.perf_counter() - t0

    def tick(self, updates: Mapping[str, PodUpdate]) -> tuple[list[float], list[str]]:
        """Hand every pod's update to its worker; return once all are visible: (write
        seconds of each pod that had events, pods whose batch was not visible in time)."""
        parts: list[dict[str, PodUpdate]] = [{} for _ in range(self.workers)]
        for pod_id, u in updates.items():
            parts[self.worker_of[pod_id]][pod_id] = u
        asked = []
        for w, part in enumerate(parts):
            if part:
                send(self._fds[w][0], ("tick", part))
                asked.append(w)
        lags: list[float] = []
        late: list[str] = []
        for w in asked:
            got_lags, got_late = recv(self._fds[w][1])
            lags += got_lags
            late += got_late
        return lags, late

    def _ask(self, what: str) -> list[Any]:
        for to_w, _ in self._fds:
            send(to_w, (what,))
        return [recv(from_r) for _, from_r in self._fds]

    def stats(self) -> list[dict[str, Any]]:
        return [s for part in self._ask("stats") for s in part]

    def cpu_s(self) -> float:
        """CPU seconds the workers have used so far."""
        return float(sum(self._ask("cpu")))

    def stop(self) -> None:
        for (to_w, from_r), proc in zip(self._fds, self._procs, strict=True):
            try:
                send(to_w, ("stop",))
                recv(from_r)
            except (OSError, EOFError):
                pass
            os.close(to_w)
            os.close(from_r)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs, self._fds = [], []


class ThreadPublishers:
    """One publisher thread per pod in this process, reading the pod's live load, costs and
    state (bench.scale before issue #30: they share the router's GIL)."""

    def __init__(self, redis_url: str, schema: IndexSchema, pods: Sequence[Any]) -> None:
        self.pubs: dict[str, IndexPublisher] = {}
        self._make: list[tuple[str, Callable[[], IndexPublisher]]] = [
            (p.pod_id, lambda p=p: IndexPublisher(
                redis_url, schema, p.pod_id, p.address, schema.hash_config(), p.load,
                p.full_state, p.tier_costs, flush_interval_s=1.0))
            for p in pods]
        self.failed: list[str] = []

    @property
    def where(self) -> str:
        return "the router's process (one thread each)"

    def start(self) -> float:
        t0 = time.perf_counter()
        for pod_id, make in self._make:
            self.pubs[pod_id] = make()
        for pod_id, pub in self.pubs.items():
            if not pub.start(timeout=30):
                self.failed.append(pod_id)
        if self.failed:
            raise RuntimeError(f"publishers' first sync failed: {self.failed[:5]}")
        return time.perf_counter() - t0

    def tick(self, updates: Mapping[str, PodUpdate]) -> tuple[list[float], list[str]]:
        """Each pod's events to its publisher, which writes them before the next pod's."""
        lags: list[float] = []
        late: list[str] = []
        for pod_id, u in updates.items():
            if not u.events:
                continue
            pub = self.pubs[pod_id]
            w0 = time.perf_counter()
            pub.submit(u.events)
            if not pub.flush(WRITE_TIMEOUT_S):
                late.append(pod_id)
            lags.append(time.perf_counter() - w0)
        return lags, late

    def stats(self) -> list[dict[str, Any]]:
        return [p.stats() for p in self.pubs.values()]

    def cpu_s(self) -> float:
        return 0.0  # counted in this process's own time

    def stop(self) -> None:
        for pub in self.pubs.values():
            pub.stop(clear=False, timeout=5)


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]))
