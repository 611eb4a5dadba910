"""Cross-pod KV pull: at admission, fetch from a peer pod the prefix blocks this pod lacks.

A request may carry a `KvSource` (the router's hint: a peer that holds its first
`num_blocks` blocks). When its admission finds fewer blocks here (pool and tiers), the
missing run is pulled on a worker thread while the request waits and the scheduler runs the
others, so the transfer overlaps their compute. The pool blocks the run lands in are
reserved when the pull starts, and each block is received into its own (a host pool: the
transport's socket writes straight into the block's memory; no landing copy after the last
byte) and checked there (tiers.peer_entries: checksums, layout, hash chain) before it
counts. Landing is then bookkeeping: the verified blocks become free cached blocks
continuing the request's pool prefix (pinned until then), the way a tier reload lands its
blocks. A failure of any kind keeps what arrived intact before it and recomputes the rest;
each one is counted by reason and logged. One attempt per request.

The transport is not here: the pod gives a `fetch(source, ask, handle, sink)` that puts the
peer's blocks into the `BlockSink` and raises `PullFailed(reason)` (kvnode/pod/
kv_pull_client.py: the control on gRPC, the bytes on a data transport). The sink checks
every block with tiers.peer_entries, whose `EntryRejected` names the reason one is refused;
`_receive` counts that reason as it counts a `PullFailed`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from pagekv.kvnode.memory.block_pool import KVCacheBlock
from pagekv.kvnode.memory.kv_cache_manager import KVCacheManager, PrefixHit
from pagekv.kvnode.memory.request import Request
from pagekv.proto.medium import PEER_SHARE, Medium
from pagekv.tiers.peer_entries import (
    BAD_CHAIN,
    BAD_CHECKSUM,
    BAD_LAYOUT,
    EntryRejected,
    KvLayout,
    check_header,
    check_pieces,
    raw_header_len,
    scatter,
    unpack_block,
)
from pagekv.tiers.ssd_format import EntryHeader

logger = logging.getLogger(__name__)

# Fallback reasons (the `reason` label of pagekv_kv_pull_fallbacks_total).
PEER_UNAVAILABLE = "peer_unavailable"  # unreachable, gone mid-transfer, starting/stopping
PEER_BUSY = "peer_busy"                # the peer's transfer cap was reached
PEER_MISSING = "peer_missing"          # the peer holds fewer blocks than the hint said
DEADLINE = "deadline"                  # --kv-pull-deadline-s passed
NO_ROOM = "no_room"                    # the pool could not take the blocks
ERROR = "error"                        # anything else (a bug: logged with its trace)
CHECKSUM = BAD_CHECKSUM                # "checksum": an entry torn or corrupt
HASH_MISMATCH = BAD_CHAIN              # "hash_mismatch": not the block asked for, or too many
CONFIG_MISMATCH = BAD_LAYOUT           # "config_mismatch": another KV layout or hash config
FALLBACK_REASONS = (PEER_UNAVAILABLE, PEER_BUSY, PEER_MISSING, DEADLINE, CHECKSUM,
                    HASH_MISMATCH, CONFIG_MISMATCH, NO_ROOM, ERROR)


@dataclass(frozen=True, slots=True)
class KvSource:
    pod_id: str
    address: str
    num_blocks: int
    handover_id: str = ""  # P/D: the prefill whose held blocks these are ("" : a plain pull)


class PullFailed(Exception):
    """A pull that stopped for its peer, its transport or its deadline: `reason` is one of
    FALLBACK_REASONS (an entry the puller refuses raises tiers' EntryRejected instead)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PullAsk:
    """What is asked of the peer: consecutive blocks of one chain."""

    request_id: str
    hashes: list[bytes]
    parent: bytes | None
    deadline: float  # time.monotonic() by which the pull must be over
    # What the peer checks the chain against (kv_export.ChainClaim): the request's tokens
    # through the last block asked, and its salt and adapter.
    tokens: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    lora_id: str | None = None
    handover_id: str = ""  # KvSource.handover_id: the holder ends its hold once served


class PullHandle:
    """Lets the engine stop a pull it no longer wants (its request left)."""

    def __init__(self) -> None:
        self.cancelled = False
        self._on_cancel: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def on_cancel(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self.cancelled:
                self._on_cancel.append(fn)
                return
        fn()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            fns, self._on_cancel = self._on_cancel, []
        for fn in fns:
            fn()


class BlockSink:
    """Where a pull's blocks land as they arrive, each checked before it counts: the pool
    blocks reserved for them (a host pool: a transport receives straight into their memory)
    or, on a device pool, rows of a staging buffer the pool is written from at landing.

    A transport gives each block either whole (`take_entry`: an entry in memory, as a gRPC
    message or a Mooncake read carries it) or in two steps (`expect`, the header; then it
    fills `pieces()`, the block's raw payload in place, and calls `commit`). Blocks arrive in
    order; `count` is the verified run. Any thread: one transport fills a sink at a time."""

    def __init__(self, layout: KvLayout, ask: PullAsk, targets: list[list[memoryview]]) -> None:
        self.layout = layout
        self.ask = ask
        self.targets = targets  # one list of byte views per block the sink can take
        self.count = 0          # blocks verified and in place
        self.nbytes = 0         # entry bytes received
        self.transport = ""     # what the transport says it is (metrics, logs)
        self.started = time.monotonic()
        self.answered = 0.0     # time.monotonic() when the peer's first message came
        self.finished = 0.0     # ... when the last block was in place

    @property
    def capacity(self) -> int:
        return len(self.targets)

    def expect(self, header: bytes | bytearray | memoryview) -> EntryHeader:
        """The next block's header, checked (its chain position, layout, checksum)."""
        i = self.count
        if i >= self.capacity:
            raise PullFailed(HASH_MISMATCH, "the peer sent more blocks than asked")
        if time.monotonic() > self.ask.deadline:
            raise PullFailed(DEADLINE, f"{i} of {len(self.ask.hashes)} blocks before the "
                                       f"deadline")
        parent = self.ask.hashes[i - 1] if i else self.ask.parent
        return check_header(self.layout, header, self.ask.hashes[i], parent)

    def pieces(self, ahead: int = 0) -> list[memoryview]:
        """Where the raw payload of the next block (or of the one `ahead` after it) goes."""
        return self.targets[self.count + ahead]

    def header_len(self, ahead: int = 0) -> int:
        """The length of the next block's header (or that of the one `ahead` after it) as
        its holder packs a raw entry (tiers.peer_entries.pack_header)."""
        i = self.count + ahead
        return raw_header_len(self.ask.hashes[i], self.ask.hashes[i - 1] if i else self.ask.parent)

    def commit(self, hdr: EntryHeader) -> None:
        """The payload `hdr` announced is in `pieces()`: verify it; the block counts."""
        check_pieces(hdr, self.targets[self.count])
        self.count += 1
        self.nbytes += hdr.entry_len
        self.finished = time.monotonic()

    def take_entry(self, entry: bytes | memoryview) -> None:
        """The next block as one whole entry (raw or LZ4), verified and copied into place."""
        mv = memoryview(entry)
        i = self.count
        self.expect(mv)  # position, deadline
        parent = self.ask.hashes[i - 1] if i else self.ask.parent
        scatter(unpack_block(self.layout, mv, self.ask.hashes[i], parent), self.targets[i])
        self.count += 1
        self.nbytes += len(mv)
        self.finished = time.monotonic()

    def phases_ms(self) -> str:
        """Where a pull's time went, for its log line."""
        if not self.answered:
            return "no answer"
        done = self.finished or self.answered
        return (f"answered in {(self.answered - self.started) * 1e3:.1f} ms, blocks in "
                f"{(done - self.answered) * 1e3:.1f} ms")


# A transport: the peer's blocks of `ask` into the sink, in order; raises PullFailed (its
# reason) or EntryRejected (an entry's); returns when the peer has sent all it holds.
Fetch = Callable[[KvSource, PullAsk, PullHandle, BlockSink], None]


@dataclass(slots=True)
class PullResult:
    blocks: int = 0          # the verified leading run received
    nbytes: int = 0          # entry bytes received
    failure: str | None = None
    detail: str = ""
    seconds: float = 0.0
    source_pod: str = ""     # the holder
    tokens: int = 0          # tokens landed in the pool
    transport: str = ""      # the data transport the pair used ("": none reached)
    phases: str = ""         # where the time went (the log line)
    handover: bool = False   # a P/D handover (its source named a prefill's hold)


@dataclass(slots=True)
class PullStats:
    """Cumulative figures (read by the pod's metrics and its published peer cost)."""

    pulls: int = 0
    blocks: int = 0
    bytes: int = 0
    fallbacks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FALLBACK_REASONS, 0))
    recent_s_per_token: list[float] = field(default_factory=list)  # the last 32 pulls

    def note(self, result: PullResult, tokens: int) -> None:
        self.pulls += 1
        self.bytes += result.nbytes
        if tokens and result.failure is None:
            self.recent_s_per_token = [*self.recent_s_per_token[-31:], result.seconds / tokens]

    def s_per_token(self) -> float | None:
        """Median seconds per token of recent complete pulls, landing included."""
        recent = sorted(self.recent_s_per_token)
        return recent[len(recent) // 2] if recent else None


@dataclass(slots=True)
class _Pull:
    req: Request
    source: KvSource
    start: int  # the first block pulled (the request's pool prefix ends there)
    ask: PullAsk
    future: Future
    handle: PullHandle
    pinned: list[KVCacheBlock]  # the pool prefix the pulled blocks continue
    dest: list[KVCacheBlock]    # the pool blocks the pulled ones land in, reserved
    sink: BlockSink
    staging: torch.Tensor | None  # a device pool's: the rows written to `dest` at landing
    wanted: int                 # blocks the pull was for (more than `dest` when short of room)
    t0: float


class PeerPuller:
    def __init__(self, manager: KVCacheManager, runner, layout: KvLayout, fetch: Fetch,
                 *, max_concurrent: int = 4, deadline_s: float = 2.0) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.manager = manager
        self.runner = runner
        self.layout = layout
        self.fetch = fetch
        self.deadline_s = deadline_s
        self.block_size = manager.block_size
        # At most max_concurrent pulls run; more wait for a worker (inside their deadline).
        self._workers = ThreadPoolExecutor(max_concurrent, thread_name_prefix="kv-pull")
        self.sources: dict[str, KvSource] = {}  # request -> its hint, until its admission
        self._pulls: dict[str, _Pull] = {}
        # Pulls whose request left while a worker may still write their reserved blocks:
        # those go back to the pool only once the worker is out (finish_pulls).
        self._abandoned: list[_Pull] = []
        self._landed: dict[str, int] = {}  # request -> tokens pulled (its "peer" share)
        self._results: dict[str, PullResult] = {}  # request -> its landed pull, until taken
        self._inflight: dict[bytes, str] = {}  # block hash -> the request pulling it
        self.stats = PullStats()
        self.observers: list[Callable[[PullResult], None]] = []  # each finished pull (metrics)

    # -- the scheduler's hook ---------------------------------------------------------------
    def load_prefix(self, req: Request, hit: PrefixHit) -> bool:
        """Extend the admission's hit with blocks pulled from the request's peer; False
        while the pull runs (the request waits, others are served)."""
        rid = req.request_id
        pull = self._pulls.get(rid)
        if pull is not None:
            if not pull.future.done():
                return False
            self._land(pull, hit)
        else:
            start = len(hit.blocks)
            if start < hit.max_blocks and req.block_hashes[start] in self._inflight:
                # Another request is pulling this prefix: wait and hit it in the pool, rather
                # than recompute (or pull) the same blocks a second time.
                return False
            source = self.sources.pop(rid, None)  # one attempt per request
            if (source is not None and min(source.num_blocks, hit.max_blocks) > start
                    and self._start(req, source, start, min(source.num_blocks, hit.max_blocks),
                                    hit)):
                return False
        self._share(rid, hit)
        return True

    def _start(self, req: Request, source: KvSource, start: int, end: int,
               hit: PrefixHit) -> bool:
        """Start pulling blocks start..end (as many as the pool has room for); False when it
        has room for none (counted as no_room: the request recomputes them)."""
        pinned = list(hit.blocks)  # the prefix the pulled blocks continue stays in the pool
        self.manager.pin(pinned)   # before reserving: making room must not evict it
        dest = self.manager.take_free_blocks(end - start)
        if not dest:
            self.manager.unpin(pinned)
            self.stats.fallbacks[NO_ROOM] += 1
            result = self._results[req.request_id] = PullResult(
                failure=NO_ROOM, source_pod=source.pod_id, handover=bool(source.handover_id))
            for observe in self.observers:
                observe(result)
            logger.warning("kv pull %s from %s: no room in the pool for any of its %d blocks, "
                           "recomputing them", req.request_id, source.pod_id, end - start)
            return False
        hashes = list(req.block_hashes[start : start + len(dest)])
        ask = PullAsk(req.request_id, hashes, req.block_hashes[start - 1] if start else None,
                      time.monotonic() + self.deadline_s,
                      req.all_token_ids[: (start + len(dest)) * self.block_size],
                      req.cache_salt, None if req.lora_id is None else str(req.lora_id),
                      source.handover_id)
        staging, targets = self._targets(dest)
        sink = BlockSink(self.layout, ask, targets)
        handle = PullHandle()
        future = self._workers.submit(self._receive, source, ask, handle, sink)
        self._pulls[req.request_id] = _Pull(req, source, start, ask, future, handle, pinned,
                                           dest, sink, staging, end - start, time.monotonic())
        self._inflight.update(dict.fromkeys(hashes, req.request_id))
        logger.debug("kv pull %s: blocks %d..%d from %s (%s), %d reserved", req.request_id,
                     start, end, source.pod_id, source.address, len(dest))
        return True

    def _targets(self, dest: list[KVCacheBlock]
                 ) -> tuple[torch.Tensor | None, list[list[memoryview]]]:
        """Where each reserved block's bytes are received: in place on a host pool; else in
        a staging row (pinned host memory on CUDA) copied into the pool at landing."""
        views = [self.runner.block_views(b.block_id) for b in dest]
        if all(v is not None for v in views):
            return None, views
        device = getattr(self.runner, "device", None)
        pin = isinstance(device, torch.device) and device.type == "cuda"
        staging = torch.empty((len(dest), self.layout.block_bytes), dtype=torch.uint8,
                              pin_memory=pin)
        return staging, [[row.numpy().data] for row in staging]

    def _receive(self, source: KvSource, ask: PullAsk, handle: PullHandle,
                 sink: BlockSink) -> PullResult:
        """The worker's job: the peer's blocks into the sink, each verified as it comes;
        stops at the first failure with its reason, keeping the intact run before it."""
        out = PullResult(source_pod=source.pod_id, handover=bool(source.handover_id))
        t0 = time.monotonic()
        try:
            if t0 >= ask.deadline:  # waited for a worker past the deadline
                raise PullFailed(DEADLINE, "no transfer slot before the deadline")
            if not handle.cancelled:
                self.fetch(source, ask, handle, sink)
            if not handle.cancelled and sink.count < len(ask.hashes):
                raise PullFailed(PEER_MISSING, f"the peer holds {sink.count} of the "
                                               f"{len(ask.hashes)} blocks asked for")
        except (PullFailed, EntryRejected) as exc:  # the transport's reason, or the entry's
            out.failure, out.detail = exc.reason, str(exc)
        except Exception as exc:  # a bug must not fail the request: it recomputes
            logger.exception("kv pull %s failed", ask.request_id)
            out.failure, out.detail = ERROR, repr(exc)
        out.blocks, out.nbytes, out.transport = sink.count, sink.nbytes, sink.transport
        out.phases = sink.phases_ms()
        out.seconds = time.monotonic() - t0
        return out

    def _land(self, pull: _Pull, hit: PrefixHit | None = None) -> None:
        """A finished pull: its verified blocks become cached pool blocks (extending `hit`
        if its request is being admitted now); the rest of its reserved blocks, and the
        pinned prefix, are released."""
        self._end(pull)
        result = pull.future.result()  # _receive never raises
        req = pull.req
        landed = 0
        try:
            if hit is None:
                hit = self.manager.lookup(req)
            # Blocks the pool gained meanwhile (another request computed them) are skipped.
            skip = len(hit.blocks) - pull.start
            got = result.blocks
            if 0 <= skip < got:
                if pull.staging is not None:
                    self.runner.write_blocks([b.block_id for b in pull.dest[skip:got]],
                                             pull.staging[skip:got])
                landed = self.manager.land_blocks(req, pull.start + skip, pull.dest[skip:got],
                                                  hit)
                self.manager.release(pull.dest[:skip] + pull.dest[got:])
            else:
                self.manager.release(pull.dest)
            if result.failure is None and pull.wanted > len(pull.dest):
                result.failure, result.detail = NO_ROOM, (f"the pool had room for "
                                                          f"{len(pull.dest)} of {pull.wanted}")
        finally:
            self.manager.unpin(pull.pinned)
        tokens = landed * self.block_size
        result.tokens = tokens
        result.seconds = time.monotonic() - pull.t0  # queueing and landing included
        self.stats.note(result, tokens)
        self.stats.blocks += landed
        for observe in self.observers:
            observe(result)
        if landed:
            self._landed[req.request_id] = self._landed.get(req.request_id, 0) + tokens
        self._results[req.request_id] = result
        if result.failure is not None:
            self.stats.fallbacks[result.failure] = self.stats.fallbacks.get(result.failure, 0) + 1
            logger.warning("kv pull %s from %s (%s) via %s: %s; %d of %d blocks landed, "
                           "recomputing the rest", req.request_id, pull.source.pod_id,
                           pull.source.address, result.transport or "-", result.detail, landed,
                           pull.wanted)
        else:
            logger.info("kv pull %s: %d blocks (%.1f MiB) from %s via %s in %.1f ms (%s)",
                        req.request_id, landed, result.nbytes / 2**20, pull.source.pod_id,
                        result.transport, result.seconds * 1e3, result.phases)

    def _end(self, pull: _Pull) -> None:
        """The pull leaves the books: its blocks are no longer in flight."""
        del self._pulls[pull.req.request_id]
        for h in pull.ask.hashes:
            if self._inflight.get(h) == pull.req.request_id:
                del self._inflight[h]

    def _share(self, rid: str, hit: PrefixHit) -> None:
        """Report pulled tokens as the hit's peer share (they are pool blocks by now)."""
        pulled = min(self._landed.get(rid, 0), hit.num_tokens)
        if not pulled:
            return
        by_tier: dict[str, int] = dict(hit.by_tier().items())  # the media, and PEER_SHARE
        by_tier[Medium.GPU] = by_tier.get(Medium.GPU, 0) - pulled
        by_tier[PEER_SHARE] = pulled
        # PrefixHit.tokens_by_tier (kvnode/memory) is annotated dict[Medium, int], but a key
        # may be PEER_SHARE, which is no Medium: its annotation should be dict[str, int].
        hit.tokens_by_tier = by_tier  # type: ignore[assignment]

    # -- the engine's bookkeeping -----------------------------------------------------------
    def finish_pulls(self) -> None:
        """Land every finished pull now, admitted or not, so pinned prefixes never wait on
        a request the scheduler cannot reach (see TierConnector.finish_loads); give back the
        reserved blocks of abandoned pulls whose worker is out."""
        for pull in [p for p in self._pulls.values() if p.future.done()]:
            self._land(pull)
        self._release_abandoned()

    def _release_abandoned(self) -> None:
        done = [p for p in self._abandoned if p.future.done()]
        self._abandoned = [p for p in self._abandoned if not p.future.done()]
        for pull in done:
            self.manager.release(pull.dest)

    def has_pending(self) -> bool:
        return bool(self._pulls) or bool(self._abandoned)

    def wait_for_pulls(self, timeout: float) -> None:
        wait([p.future for p in (*self._pulls.values(), *self._abandoned)], timeout,
             FIRST_COMPLETED)

    def pinned_sets(self) -> list[list[KVCacheBlock]]:
        return [p.pinned + p.dest for p in self._pulls.values()] + [
            p.dest for p in self._abandoned]

    def take_result(self, request_id: str) -> PullResult | None:
        """The request's landed pull (its wait and its fallback), once: None when it had
        none, or it was taken already."""
        return self._results.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request left: stop its pull; its pinned prefix is released now, its reserved
        blocks once the worker has stopped writing them."""
        self.sources.pop(request_id, None)
        self._landed.pop(request_id, None)
        self._results.pop(request_id, None)
        pull = self._pulls.get(request_id)
        if pull is not None:
            self._end(pull)
            pull.handle.cancel()
            self.manager.unpin(pull.pinned)
            self._abandoned.append(pull)
            self._release_abandoned()

    def close(self) -> None:
        for pull in list(self._pulls.values()):
            self.forget(pull.req.request_id)
        self._workers.shutdown(wait=True, cancel_futures=True)
        self._release_abandoned()
