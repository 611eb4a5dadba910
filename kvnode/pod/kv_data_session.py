"""A run a pod serves to a puller over a data transport: its frames, its limits, its end.

`KVNode.PullBlocks` (kvnode/pod/kv_transfer.py) keeps the control: it checks the puller,
opens the run (its pool blocks pinned) and hands it to a data transport (kvnode/pod/
kv_data_tcp.py, kv_data_mooncake.py) as an `ExportSession`, whose random token the puller
presents on the data connection. The session gives the transport each block as the frame it
sends: the entry header (tiers.peer_entries: hashes, layout, both checksums) and the payload
where it lies (a host pool's block planes, no copy; a tier block's or a device pool's rows,
copied once), within the call's byte limit.

Two sides hold the session: the control call, until it ends (done, cancelled, its deadline),
and the transport's worker once it has attached. The run is closed (pins released) when the
last of them lets go, so a cancelled call never frees blocks a worker still reads, and a
worker that never comes never keeps them. Ending the control also aborts the worker (its
callbacks close the connection), so neither waits on the other.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from pagekv.kvnode.engine.kv_export import ExportRun, KvExporter
from pagekv.tiers.peer_entries import pack_block, pack_header

TOKEN_BYTES = 32

Frame = list[bytes | memoryview]  # an entry: its header, then its payload's pieces


class ExportSession:
    def __init__(self, exporter: KvExporter, run: ExportRun, *, budget: int, deadline: float,
                 compress: bool, chunk_bytes: int, close_run: Callable[[], None]) -> None:
        self.exporter = exporter
        self.run = run
        self.budget = budget          # entry bytes this call may send
        self.deadline = deadline      # time.monotonic() after which it is over
        self.compress = compress
        self.per_chunk = max(1, chunk_bytes // exporter.layout.block_bytes)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.sent_blocks = 0
        self.sent_bytes = 0
        self.ready = 0                # blocks made available so far (a transport's progress)
        self.finished = False         # the transport sent everything it will
        self._pending_bytes = 0       # bytes of the frames given, not yet sent
        self._close_run = close_run
        self._holders = 1             # the control call
        self._ended = False           # the control call let go
        self._aborts: list[Callable[[], None]] = []
        self._changed = threading.Condition()

    @property
    def num_blocks(self) -> int:
        return len(self.run.hashes)

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    # -- the transport's side ---------------------------------------------------------------
    def attach(self) -> bool:
        """The transport's worker takes hold; False when the control has already ended (the
        worker must then send nothing)."""
        with self._changed:
            if self._ended:
                return False
            self._holders += 1
            return True

    def on_abort(self, fn: Callable[[], None]) -> None:
        """Called once if the control ends first (a cancelled or timed-out call): it stops
        the worker's I/O (closes its connection)."""
        with self._changed:
            if not self._ended:
                self._aborts.append(fn)
                return
        fn()

    def frames(self, lo: int, hi: int) -> list[Frame]:
        """Blocks lo..hi of the run as frames, in order; fewer when the byte limit is
        reached or a tier block is gone (the run ends there). Any thread, run open."""
        exporter, run = self.exporter, self.run
        parent = run.hashes[lo - 1] if lo else run.parent
        out: list[Frame] = []
        sent = self.sent_bytes
        for h, pieces, block in zip(run.hashes[lo:hi], exporter.payloads(run, lo, hi),
                                    exporter.pool_blocks(run, lo, hi), strict=False):
            if self.compress:
                frame: Frame = [pack_block(exporter.layout, h, parent, _joined(pieces), True)]
                size = len(frame[0])
            else:
                # A pinned pool block's checksum is kept on it (it cannot change meanwhile).
                known = block.payload_xxh if block is not None else None
                header, xxh = pack_header(exporter.layout, h, parent, pieces, known)
                if block is not None:
                    block.payload_xxh = xxh
                frame = [header, *pieces]
                size = len(header) + exporter.layout.block_bytes  # pack_header checked it
            if sent + size > self.budget:
                break
            sent += size
            out.append(frame)
            parent = h
        self._pending_bytes = sent - self.sent_bytes
        return out

    def sent(self, frames: list[Frame]) -> None:
        """The frames the last `frames` call gave are delivered (or ready to be read)."""
        with self._changed:
            self.sent_blocks += len(frames)
            self.sent_bytes += self._pending_bytes
            self._pending_bytes = 0
            self.ready = self.sent_blocks
            self._changed.notify_all()

    def finish(self) -> None:
        """Everything the transport will send is sent."""
        with self._changed:
            self.finished = True
            self._changed.notify_all()

    def detach(self) -> None:
        """The worker is out: it touches the run no more."""
        self._let_go()

    # -- the control's side -----------------------------------------------------------------
    def wait_progress(self, seen: int, timeout: float) -> tuple[int, bool]:
        """(blocks ready, finished) once either moved past `seen`, or after `timeout`."""
        with self._changed:
            self._changed.wait_for(lambda: self.ready > seen or self.finished, timeout)
            return self.ready, self.finished

    def end(self) -> None:
        """The control call is over (always called, once): abort a worker still running."""
        with self._changed:
            if self._ended:
                return
            self._ended = True
            aborts, self._aborts = self._aborts, []
            self._changed.notify_all()
        for fn in aborts:
            fn()
        self._let_go()

    def _let_go(self) -> None:
        with self._changed:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self._close_run()


def _joined(pieces: list[memoryview]) -> NDArray[np.uint8]:
    """A block's pieces as one contiguous array (the LZ4 codec reads it whole)."""
    return np.concatenate([np.frombuffer(p, np.uint8) for p in pieces])
