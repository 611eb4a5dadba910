"""ExportSession's lifecycle (kvnode/pod/kv_data_session.py): the control call and the data
transport's worker both hold a served run, and its pins are released exactly once, when the
last of them lets go, whatever order they end in: the control before the worker attaches,
after it detaches, or while it sends (the worker's I/O then aborted). A worker that comes
after the control ended gets nothing. Also: frames stay within the byte limit, and progress
wakes the control."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from pagekv.kvnode.pod.kv_data_session import ExportSession
from pagekv.tiers.peer_entries import KvLayout, check_header, check_pieces

BLOCK_BYTES = 256
ROUNDS = 150  # races tried per test
LAYOUT = KvLayout.of({"model": "stand-in", "dtype": "float32", "block_size": 16,
                      "num_layers": 2, "num_kv_heads": 1, "head_size": 2}, 4, BLOCK_BYTES)


@dataclass
class StandInRun:
    hashes: list[bytes]
    parent: bytes | None = None


@dataclass
class StandInExporter:
    """What a session reads of kv_export.KvExporter: its layout and the blocks' pieces."""

    layout: KvLayout = LAYOUT
    planes: dict[bytes, list[np.ndarray]] = field(default_factory=dict)

    def pool_blocks(self, run: StandInRun, lo: int, hi: int) -> list[None]:
        return [None] * len(run.hashes[lo:hi])  # as a tier's blocks: nothing kept on them

    def payloads(self, run: StandInRun, lo: int, hi: int) -> list[list[memoryview]]:
        out = []
        for h in run.hashes[lo:hi]:
            if h not in self.planes:  # two planes per block, as a pool's layers lie
                seed = int.from_bytes(h[:4], "little")
                data = np.random.default_rng(seed).integers(0, 256, BLOCK_BYTES, np.uint8)
                self.planes[h] = [data[: BLOCK_BYTES // 2], data[BLOCK_BYTES // 2 :]]
            out.append([p.data for p in self.planes[h]])
        return out


class Closes:
    """The session's close_run: counts, and says whether a worker still held the run."""

    def __init__(self) -> None:
        self.count = 0
        self.worker_inside = False
        self.closed_while_inside = False
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.count += 1
            self.closed_while_inside |= self.worker_inside


def hashes(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 32 for i in range(n)]


def session(closes: Closes, n: int = 4, budget: int = 1 << 30, deadline_s: float = 30.0,
            chunk_bytes: int = 2 * BLOCK_BYTES) -> ExportSession:
    return ExportSession(StandInExporter(), StandInRun(hashes(n)), budget=budget,  # type: ignore[arg-type]
                         deadline=time.monotonic() + deadline_s, compress=False,
                         chunk_bytes=chunk_bytes, close_run=closes)


def test_control_ends_before_the_worker_attaches():
    closes = Closes()
    s = session(closes)
    aborted = []
    s.on_abort(lambda: aborted.append("abort"))
    s.end()
    assert closes.count == 1          # nobody else held it: closed right away
    assert aborted == ["abort"]
    assert s.attach() is False        # the worker that comes late must send nothing
    s.end()                           # a second end changes nothing
    assert closes.count == 1


def test_on_abort_after_the_end_runs_at_once():
    closes = Closes()
    s = session(closes)
    s.end()
    called = []
    s.on_abort(lambda: called.append(1))
    assert called == [1]
    assert closes.count == 1


def test_worker_detaches_before_the_control_ends():
    closes = Closes()
    s = session(closes)
    aborted = []
    assert s.attach()
    s.on_abort(lambda: aborted.append("abort"))
    frames = s.frames(0, s.num_blocks)
    s.sent(frames)
    s.finish()
    s.detach()
    assert closes.count == 0          # the control still holds the run
    assert s.wait_progress(0, 0.0) == (s.num_blocks, True)
    s.end()
    assert closes.count == 1
    assert aborted == ["abort"]       # end aborts whatever registered (a finished worker: no-op)


def test_control_ends_while_the_worker_sends():
    """The control's end aborts the worker's blocked I/O; the run closes only once the
    worker is out, never while it still reads the blocks."""
    closes = Closes()
    s = session(closes)
    assert s.attach()
    unblock = threading.Event()
    s.on_abort(unblock.set)           # as TcpDataServer's: shut the connection down
    in_send = threading.Event()

    def worker() -> None:
        with closes.lock:
            closes.worker_inside = True
        s.frames(0, 1)
        in_send.set()
        unblock.wait(10)              # a send blocked on a full socket, until aborted
        with closes.lock:
            closes.worker_inside = False
        s.detach()

    t = threading.Thread(target=worker)
    t.start()
    assert in_send.wait(10)
    s.end()
    t.join(10)
    assert not t.is_alive(), "the abort did not reach the worker"
    assert unblock.is_set()
    assert closes.count == 1
    assert not closes.closed_while_inside


def racing(*sides) -> None:
    """Run the callables at once (as near as threads start), wait for all."""
    go = threading.Barrier(len(sides))

    def side(fn) -> None:
        go.wait()
        fn()

    threads = [threading.Thread(target=side, args=(fn,)) for fn in sides]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
        assert not t.is_alive()


def attach_then_detach(s: ExportSession, got: list[bool]) -> None:
    """A worker: if it gets hold of the run, it lets go again."""
    got.append(s.attach())
    if got[-1]:
        s.detach()


def test_end_and_detach_racing_close_exactly_once():
    for _ in range(ROUNDS):
        closes = Closes()
        s = session(closes)
        assert s.attach()
        racing(s.end, s.detach)
        assert closes.count == 1


def test_attach_racing_end_never_leaves_the_run_open():
    """Whichever of attach and end comes first: if attach won, its detach closes the run;
    if end won, attach says False and the run is already closed."""
    outcomes = set()
    for _ in range(ROUNDS):
        closes = Closes()
        s = session(closes)
        got: list[bool] = []
        racing(s.end, lambda s=s, got=got: attach_then_detach(s, got))
        assert closes.count == 1, got
        outcomes.add(got[0])
    assert outcomes  # (both orders are usually seen; either must close once)


def test_frames_stop_at_the_byte_limit_and_chain_their_parents():
    closes = Closes()
    sizes = [sum(memoryview(p).nbytes for p in f) for f in session(closes, n=6).frames(0, 6)]
    s = session(closes, n=6, budget=sum(sizes[:3]) + sizes[3] // 2)
    first = s.frames(0, 2)
    s.sent(first)
    rest = s.frames(2, 6)
    assert len(first) == 2 and len(rest) == 1   # three whole frames fit, never a part
    s.sent(rest)
    assert s.sent_blocks == 3 and s.sent_bytes == sum(sizes[:3]) <= s.budget
    parent = None
    for h, frame in zip(s.run.hashes, first + rest, strict=False):
        hdr = check_header(LAYOUT, frame[0], h, parent)
        check_pieces(hdr, [memoryview(p) for p in frame[1:]])
        parent = h
    assert s.per_chunk == 2


def test_progress_wakes_the_control():
    closes = Closes()
    s = session(closes)
    assert s.wait_progress(0, 0.0) == (0, False)    # nothing yet: back after the timeout
    done = threading.Event()
    seen: list[tuple[int, bool]] = []

    def control() -> None:
        seen.append(s.wait_progress(0, 10.0))
        done.set()

    t = threading.Thread(target=control)
    t.start()
    assert s.attach()
    s.sent(s.frames(0, 2))
    assert done.wait(5), "sent() did not wake the control"
    t.join(5)
    assert seen == [(2, False)]
    s.finish()
    assert s.wait_progress(2, 10.0) == (2, True)
    s.detach()
    s.end()
    assert closes.count == 1
