"""Mooncake's transfer engine as a data transport for cross-pod pulls (`--kv-transports
mooncake`): the puller reads the holder's memory; RDMA where there are NICs, TCP here.

Optional: the package `mooncake-transfer-engine-non-cuda` (pyproject's `mooncake` extra) and
its system libraries (libibverbs1, libnuma1). `unavailable_reason()` says what is missing;
the pod then uses its next transport (kvnode/pod/kv_transports.py).

The control stays `KVNode.PullBlocks` (kvnode/pod/kv_transfer.py). The holder's engine has a
few registered slabs, allocated once and reused. For a pull it takes one, gives the puller a
ticket (its engine's session id, the slab's address, the length of each entry's slot: a raw
entry's, known from the run's hashes before any is packed), and packs the run's entries into
the slots a chunk at a time in a worker thread, each chunk announced as `ready_blocks` on the
control stream. The puller's engine reads the ready slots into a registered staging buffer
of its own, READ_BYTES a read, IN_FLIGHT reads at once (polled, so that its deadline and a
cancel are kept: Mooncake's own sync read waits up to 30 s), and hands each entry to the
pull's BlockSink, which checks it (checksums, chain, layout) before it counts. A slot is sized for
the raw entry; an LZ4 entry (--kv-transfer-compress) is shorter and its header says so.

A slab is lent until no read of it can still come: the puller, its reads done, ends the
control call (PeerFetcher cancels it), so a whole run's control stays open until then (it is
not `finish`ed) and the slab is free again at once. A run packed short (the byte limit, a tier
block gone) is finished, so that the puller learns its count, and its slab waits out the
pull's deadline, after which the puller reads nothing. A puller that gives up (its deadline,
a cancel) lands nothing more, so a read of a reused slab does no harm there; a read it gives
up on may still write into its staging buffer: that buffer is set aside until Mooncake
reports the read over.

Mooncake's ports (its handshake and its TCP transport) listen on every interface whatever
the host given, with no authentication and no TLS: whoever reaches them can read any
registered memory. So a slab is wiped as it is released (a run's KV readable only while it
is lent), the pod does not offer this transport when its connections are TLS, and it is for
a network whose hosts are trusted, as the pods' peer port without a peer token is.
"""

from __future__ import annotations

import functools
import heapq
import importlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pagekv.kvnode.engine.peer_pull import (
    CHECKSUM,
    CONFIG_MISMATCH,
    DEADLINE,
    ERROR,
    PEER_MISSING,
    PEER_UNAVAILABLE,
    BlockSink,
    PullAsk,
    PullFailed,
    PullHandle,
)
from pagekv.kvnode.pod.kv_data_session import ExportSession
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.tiers.codec import CODEC_RAW
from pagekv.tiers.ssd_format import entry_header_size

logger = logging.getLogger(__name__)

NAME = "mooncake"
PROTOCOL = "tcp"                 # Mooncake's transport here ("rdma" where there are NICs)
METADATA = "P2PHANDSHAKE"        # peers exchange their descriptors directly: no etcd
SLABS = 4                        # holder: pulls served at once on slabs (the transfer cap)
SLAB_BYTES = 1 << 30             # holder: a run's entries up to this (--kv-transfer-max-bytes)
WARM_BYTES = 128 << 20           # holder: of a released slab, kept resident (the rest let go)
READ_BYTES = 4 << 20             # puller: bytes one read asks for (an entry more: alone)
MAX_ENTRY = 16 << 20             # puller: the largest entry it takes (a staging half)
IN_FLIGHT = 2                    # puller: reads at once (one lands while the next moves)
MAX_STAGING = 8                  # puller: staging buffers, in use or set aside, at most
POLL_S = (0.0002, 0.002)         # puller: first and longest wait between status checks
REAP_POLL_S = 0.1                # how often set-aside buffers and held slabs are looked at
ABANDONED_LIMIT_S = 120.0        # a read still running after this: its buffer is dropped
WILDCARDS = ("", "0.0.0.0", "::", "[::]")

# transfer_check_status: 1 done, 0 running, -1 failed, -2 timed out (Mooncake's codes).
_DONE, _RUNNING, _FAILED, _TIMEOUT = 1, 0, -1, -2


@functools.cache
def unavailable_reason() -> str | None:
    """Why this transport cannot run here (a sentence), or None."""
    try:
        importlib.import_module("mooncake.engine")  # its shared libraries load here
    except ImportError as exc:
        hint = (" (Debian: apt-get install libibverbs1 libnuma1)"
                if ".so" in str(exc) else
                " (pip install 'pagekv[mooncake]': mooncake-transfer-engine-non-cuda)")
        return f"Mooncake's transfer engine cannot be loaded: {exc}{hint}"
    return None


def _new_engine(host: str):
    """A TransferEngine on `host`, TCP, P2P handshake; RuntimeError when it will not start."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines come per connection
    from mooncake.engine import TransferEngine  # type: ignore[import-untyped,import-not-found,unused-ignore]

    engine = TransferEngine()
    if engine.initialize(host, METADATA, PROTOCOL, "") != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}) failed")
    return engine


class _Registered:
    """Page-aligned memory, registered with an engine for its lifetime."""

    def __init__(self, engine, nbytes: int) -> None:
        # Private: pages handed back with MADV_DONTNEED read as zeros after (_wipe).
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # Not touched here: a page costs its first touch once, on the first run that
        # reaches it, and is reused after (a small run never pays for a whole slab).
        self.array = np.frombuffer(self.map, np.uint8)
        self.view = memoryview(self.map)
        self.address = int(self.array.ctypes.data)
        self.nbytes = nbytes
        if engine.register_memory(self.address, nbytes) != 0:
            raise RuntimeError(f"Mooncake register_memory of {nbytes} bytes failed")


def _slot_lengths(session: ExportSession, capacity: int) -> list[int]:
    """Each raw entry's bytes (header + block), as many as fit in `capacity`."""
    run = session.run
    block_bytes = session.exporter.layout.block_bytes
    lengths: list[int] = []
    total = 0
    parent = run.parent
    for h in run.hashes:
        n = entry_header_size(len(h), len(parent or b""), 0) + block_bytes
        if total + n > capacity:
            break
        total += n
        lengths.append(n)
        parent = h
    return lengths


@dataclass(slots=True)
class _Lease:
    """A slab lent to one session, until its worker and its control call are both out."""

    slab: _Registered
    session: ExportSession
    worker_out: bool = False
    control_out: bool = False
    used: int = 0           # bytes of the slab the run's slots take
    aborted: bool = False   # the control ended first: stop packing
    short: bool = False     # fewer entries packed than the ticket's slots


class MooncakeDataServer:
    """The holder's end: one engine, its slabs, a packing worker per pull."""

    name = NAME

    def __init__(self, host: str, slabs: int = SLABS, slab_bytes: int = SLAB_BYTES) -> None:
        self.engine = _new_engine(host)
        # A wildcard host stays in the id: the puller puts the host it dialed in its place.
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self.slab_bytes = slab_bytes
        self._max_slabs = slabs
        self._made = 0
        self._free: list[_Registered] = []
        self._held: list[tuple[float, int, _Lease]] = []  # (deadline, seq, lease): a heap
        self._dirty: list[_Lease] = []  # released, to be wiped before they are lent again
        self._seq = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self.offers_without_slab = 0  # all slabs lent (a test hook, a metric)
        self._reaper = threading.Thread(target=self._reap, name="kv-mooncake-slabs",
                                        daemon=True)
        self._reaper.start()

    def offer(self, session: ExportSession) -> pb.TransferTicket:
        slab = self._take_slab()
        if slab is None or not session.attach():
            if slab is not None:
                self._give_back(slab)
            self.offers_without_slab += slab is None
            session.finish()  # nothing offered: the puller recomputes
            return pb.TransferTicket(transport=NAME, token=session.token, num_blocks=0,
                                     session=self.session_id)
        lengths = _slot_lengths(session, slab.nbytes)
        lease = _Lease(slab, session, used=sum(lengths))
        session.on_abort(lambda: self._control_over(lease))
        threading.Thread(target=self._pack, args=(lease, lengths), name="kv-mooncake-pack",
                         daemon=True).start()
        return pb.TransferTicket(transport=NAME, token=session.token,
                                 num_blocks=len(lengths), session=self.session_id,
                                 buffer=slab.address, entry_lengths=lengths)

    def _take_slab(self) -> _Registered | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._made >= self._max_slabs:
                return None
            self._made += 1
        try:
            return _Registered(self.engine, self.slab_bytes)
        except (RuntimeError, OSError) as exc:
            logger.warning("mooncake: no slab of %d bytes: %s", self.slab_bytes, exc)
            with self._lock:
                self._made -= 1
            return None

    def _give_back(self, slab: _Registered) -> None:
        with self._lock:
            self._free.append(slab)

    def _pack(self, lease: _Lease, lengths: list[int]) -> None:
        """The run's entries into their slots, a chunk at a time, each chunk made ready.
        A whole run is not `finish`ed: the control stays open until the puller, its reads
        done, ends the call (so the slab is free again at once); a short one is, so the
        puller learns its count (the slab then waits out the pull's deadline)."""
        session, view = lease.session, lease.slab.view
        packed = 0
        try:
            offset = 0
            for lo in range(0, len(lengths), session.per_chunk):
                if lease.aborted or session.remaining_s() <= 0:
                    return
                hi = min(lo + session.per_chunk, len(lengths))
                frames = session.frames(lo, hi)
                for i, frame in enumerate(frames):
                    end = offset
                    for piece in frame:
                        p = memoryview(piece).cast("B")
                        view[end : end + p.nbytes] = p
                        end += p.nbytes
                    if end - offset > lengths[lo + i]:
                        raise ValueError(f"an entry of {end - offset} bytes for a slot of "
                                         f"{lengths[lo + i]}")
                    offset += lengths[lo + i]
                session.sent(frames)
                packed += len(frames)
                if len(frames) < hi - lo:
                    break  # the byte limit, or a tier block gone
        except Exception:  # a bug: the puller gets what was made ready and falls back
            logger.exception("mooncake: packing a run failed")
        finally:
            if packed < len(lengths) and not lease.aborted:
                lease.short = True
                session.finish()
            session.detach()
            self._worker_over(lease)

    def _worker_over(self, lease: _Lease) -> None:
        with self._lock:
            lease.worker_out = True
            self._release_if_out(lease)

    def _control_over(self, lease: _Lease) -> None:
        with self._lock:
            lease.aborted = not lease.worker_out
            lease.control_out = True
            self._release_if_out(lease)

    def _release_if_out(self, lease: _Lease) -> None:
        """Under the lock. Both out: the slab is free again, or, for a short run (whose
        puller may still read when the control has ended), at the pull's deadline. A puller
        that gave up may have a read of the slab still on the wire: it lands nothing."""
        if not (lease.worker_out and lease.control_out):
            return
        if lease.short:
            self._seq += 1
            heapq.heappush(self._held, (lease.session.deadline, self._seq, lease))
        else:
            self._dirty.append(lease)
            self._wake.set()

    def _reap(self) -> None:
        """Released slabs wiped, then free again. Wiped: Mooncake serves any registered
        memory to whoever reaches its ports, which do not authenticate (and listen on every
        interface), so a run's KV stays readable only while its puller is lent the slab."""
        while not self._closed:
            self._wake.wait(REAP_POLL_S)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                while self._held and self._held[0][0] <= now:
                    self._dirty.append(heapq.heappop(self._held)[2])
                dirty, self._dirty = self._dirty, []
            for lease in dirty:
                _wipe(lease.slab, lease.used)
            with self._lock:
                self._free.extend(lease.slab for lease in dirty)

    def close(self) -> None:
        self._closed = True
        self._wake.set()


def _wipe(slab: _Registered, used: int) -> None:
    """Zero what a run wrote: its first WARM_BYTES in place (those pages stay resident, so
    the next run does not pay their first touch again), the rest handed back to the kernel
    (zero pages when next touched)."""
    slab.array[: min(used, WARM_BYTES)] = 0
    if used > WARM_BYTES:
        slab.map.madvise(mmap.MADV_DONTNEED, WARM_BYTES, used - WARM_BYTES)


class _Staging:
    """The puller's registered staging buffers (IN_FLIGHT halves of MAX_ENTRY each), reused;
    one a read was given up on is set aside until Mooncake says every such read is over."""

    def __init__(self, engine, limit: int) -> None:
        self.engine = engine
        self.limit = limit
        self._free: list[_Registered] = []
        self._made = 0
        self._aside: list[tuple[float, list[int], _Registered]] = []  # (since, batches, buf)
        self._lock = threading.Lock()

    def take(self) -> _Registered | None:
        with self._lock:
            self._reap_locked()
            if self._free:
                return self._free.pop()
            if self._made >= self.limit:
                return None
            self._made += 1
        try:
            return _Registered(self.engine, IN_FLIGHT * MAX_ENTRY)
        except (RuntimeError, OSError):
            with self._lock:
                self._made -= 1
            raise

    def give_back(self, buf: _Registered) -> None:
        with self._lock:
            self._free.append(buf)

    def set_aside(self, buf: _Registered, batches: list[int]) -> None:
        with self._lock:
            self._aside.append((time.monotonic(), batches, buf))

    def _reap_locked(self) -> None:
        kept = []
        now = time.monotonic()
        for since, batches, buf in self._aside:
            # A batch reported done or failed is freed by Mooncake: never asked again.
            running = [b for b in batches if self.engine.transfer_check_status(b)
                       not in (_DONE, _FAILED)]
            if not running:
                self._free.append(buf)
            elif now - since > ABANDONED_LIMIT_S:
                # Never reported over: never reused either (its memory stays registered).
                logger.warning("mooncake: a read given up %.0f s ago still runs: its staging "
                               "buffer is dropped", now - since)
            else:
                kept.append((since, running, buf))
        self._aside = kept


class _Progress:
    """The control stream's `ready_blocks`, read on a thread of its own so that reads move
    while the holder packs (and a read in flight is watched while no message comes)."""

    def __init__(self, control: Iterator[pb.PullBlocksChunk], limit: int) -> None:
        self.ready = 0
        self.ended = False
        self.error: BaseException | None = None
        self._limit = limit
        self._changed = threading.Condition()
        threading.Thread(target=self._follow, args=(control,), name="kv-mooncake-ready",
                         daemon=True).start()

    def _follow(self, control: Iterator[pb.PullBlocksChunk]) -> None:
        try:
            for chunk in control:
                with self._changed:
                    self.ready = max(self.ready, min(chunk.ready_blocks, self._limit))
                    self._changed.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the pull's thread
            with self._changed:
                self.error = exc
        finally:
            with self._changed:
                self.ended = True
                self._changed.notify_all()

    def wait(self, beyond: int, timeout: float) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.ready > beyond or self.ended, timeout)


@dataclass(slots=True)
class _Read:
    batch: int
    lo: int        # its entries: lo..hi
    hi: int
    at: int        # where in the staging buffer


class MooncakeDataClient:
    """The puller's end: one engine (started on first use), its staging buffers."""

    name = NAME

    def __init__(self, host: str = "127.0.0.1", max_staging: int = MAX_STAGING) -> None:
        self._host = host
        self._max_staging = max_staging
        self._staging: _Staging | None = None
        self._lock = threading.Lock()

    def _buffers(self) -> _Staging:
        with self._lock:
            if self._staging is None:
                self._staging = _Staging(_new_engine(self._host), self._max_staging)
            return self._staging

    def receive(self, host: str, ticket: pb.TransferTicket, ask: PullAsk, sink: BlockSink,
                handle: PullHandle, control: Iterator[pb.PullBlocksChunk]) -> None:
        lengths = list(ticket.entry_lengths)
        if time.monotonic() >= ask.deadline:
            raise PullFailed(DEADLINE, "no time left before the pull's deadline")
        if not lengths:
            return  # the holder offered nothing (no slab free): the puller recomputes
        if max(lengths) > MAX_ENTRY:
            raise PullFailed(CONFIG_MISMATCH, f"mooncake: entries of {max(lengths)} bytes, "
                                              f"more than {MAX_ENTRY}")
        try:
            staging = self._buffers()
            buf = staging.take()
        except (RuntimeError, OSError) as exc:
            raise PullFailed(ERROR, f"mooncake: {exc}") from None
        if buf is None:
            raise PullFailed(PEER_UNAVAILABLE, "mooncake: every staging buffer is in use")
        reads: list[_Read] = []
        try:
            self._pull(staging.engine, _dialed(ticket.session, host), ticket.buffer, lengths,
                       buf, reads, ask, sink, handle, _Progress(control, len(lengths)))
        except BaseException:
            if reads:  # Mooncake may still write into the buffer: not reused until it is over
                staging.set_aside(buf, [r.batch for r in reads])
            else:
                staging.give_back(buf)
            if handle.cancelled:
                return
            raise
        staging.give_back(buf)

    def _pull(self, engine, session: str, remote: int, lengths: list[int], buf: _Registered,
              reads: list[_Read], ask: PullAsk, sink: BlockSink, handle: PullHandle,
              progress: _Progress) -> None:
        """Ranges of ready slots read into the staging halves, IN_FLIGHT at once, each
        landed in order as its read completes. `reads`: those in flight (the caller's, to
        set the buffer aside on a failure)."""
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        nxt = 0
        while True:
            if handle.cancelled:
                return
            if time.monotonic() >= ask.deadline:
                raise PullFailed(DEADLINE, f"{sink.count} of {len(ask.hashes)} blocks before "
                                           f"the deadline")
            ready = progress.ready
            while len(reads) < IN_FLIGHT and nxt < ready:
                hi = nxt + 1
                while hi < ready and starts[hi + 1] - starts[nxt] <= READ_BYTES:
                    hi += 1
                at = next(k * MAX_ENTRY for k in range(IN_FLIGHT)
                          if all(r.at != k * MAX_ENTRY for r in reads))
                nbytes = starts[hi] - starts[nxt]
                batch = engine.batch_transfer_async_read(
                    session, [buf.address + at], [remote + starts[nxt]], [nbytes])
                if not batch:
                    raise PullFailed(PEER_UNAVAILABLE, f"mooncake: no read from {session} "
                                     f"after {sink.count} blocks (unreachable, or the range "
                                     f"not registered there)")
                reads.append(_Read(batch, nxt, hi, at))
                nxt = hi
            if reads:
                status = self._wait(engine, reads[0])
                if status == _FAILED:  # freed by Mooncake: never to be asked about again
                    reads.pop(0)
                    raise PullFailed(PEER_UNAVAILABLE, f"mooncake: a read from {session} "
                                                       f"failed after {sink.count} blocks")
                if status == _TIMEOUT:
                    raise PullFailed(DEADLINE, f"mooncake: a read from {session} timed out "
                                               f"after {sink.count} blocks")
                if status == _DONE:
                    r = reads.pop(0)
                    for i in range(r.lo, r.hi):
                        at = r.at + starts[i] - starts[r.lo]
                        _land(buf.view[at : at + lengths[i]], sink)
                continue
            if sink.count == len(lengths):
                return  # all of it: the caller ends the control call (the holder's slab)
            if progress.ended and nxt >= progress.ready:
                break
            progress.wait(nxt, min(0.05, max(ask.deadline - time.monotonic(), 0.0)))
        if progress.error is not None and not handle.cancelled:
            raise progress.error  # the control stream's gRPC error: PeerFetcher maps it
        if progress.ready != sink.count:
            raise PullFailed(PEER_MISSING, f"the peer made {progress.ready} blocks ready, "
                                           f"{sink.count} arrived")

    @staticmethod
    def _wait(engine, read: _Read) -> int:
        """The read's status once it is over, or _RUNNING after a short wait (so that the
        deadline and a cancel are looked at)."""
        wait = POLL_S[0]
        give_up = time.monotonic() + 10 * POLL_S[1]
        while True:
            status = engine.transfer_check_status(read.batch)
            if status != _RUNNING or time.monotonic() >= give_up:
                return status
            time.sleep(wait)
            wait = min(wait * 2, POLL_S[1])


def _land(entry: memoryview, sink: BlockSink) -> None:
    """One slot: its entry checked and put in place (a raw one copied into the pool block's
    pieces and verified there, an LZ4 one decoded)."""
    hdr = sink.expect(entry)
    if hdr.entry_len > entry.nbytes:
        raise PullFailed(CHECKSUM, f"an entry of {hdr.entry_len} bytes in a slot of "
                                   f"{entry.nbytes}")
    if hdr.codec == CODEC_RAW and hdr.payload_len == hdr.raw_len:
        at = hdr.header_len
        for piece in sink.pieces():
            piece[:] = entry[at : at + piece.nbytes]
            at += piece.nbytes
        sink.commit(hdr)
    else:
        sink.take_entry(entry[: hdr.entry_len])


def _dialed(session: str, host: str) -> str:
    """The holder's session id, on the host this pod dialed when the holder named none
    reachable (a wildcard)."""
    name, _, port = session.rpartition(":")
    return f"{host}:{port}" if name in WILDCARDS else session
