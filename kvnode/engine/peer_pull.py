"""Cross-pod KV pull: at admission, fetch from a peer pod the prefix blocks this pod lacks.

A request may carry a `KvSource` (the router's hint: a peer that holds its first
`num_blocks` blocks). When its admission finds fewer blocks here (pool and tiers), the
missing run is pulled on a worker thread while the request waits and the scheduler runs the
others, so the transfer overlaps their compute. Every entry is checked (tiers.peer_entries:
checksums, layout, hash chain) before it is landed in the pool the way a tier reload lands
its blocks: as free cached blocks continuing the request's pool prefix, which is pinned
until then. A failure of any kind keeps what arrived intact before it and recomputes the
rest; each one is counted by reason and logged. One attempt per request.

The transport is not here: the pod gives a `fetch(source, ask, handle)` that yields the
peer's entries chunk by chunk and raises `PullFailed(reason)` (kvnode/pod/kv_pull_client.py).
The entries are bytes to the pod: the peer's exporter packed them (kvnode/engine/kv_export.py)
and this module unpacks them, both with tiers.peer_entries, whose `EntryRejected` names the
reason an entry is refused; `_receive` counts that reason as it counts a `PullFailed`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
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
    unpack_block,
)

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


Fetch = Callable[[KvSource, PullAsk, PullHandle], Iterable[list[bytes]]]


@dataclass(slots=True)
class PullResult:
    datas: list[np.ndarray]  # the verified leading run
    nbytes: int = 0          # entry bytes received
    failure: str | None = None
    detail: str = ""
    seconds: float = 0.0


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
    pinned: list[KVCacheBlock]
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
        self._landed: dict[str, int] = {}  # request -> tokens pulled (its "peer" share)
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
            if source is not None and min(source.num_blocks, hit.max_blocks) > start:
                self._start(req, source, start, min(source.num_blocks, hit.max_blocks), hit)
                return False
        self._share(rid, hit)
        return True

    def _start(self, req: Request, source: KvSource, start: int, end: int,
               hit: PrefixHit) -> None:
        hashes = list(req.block_hashes[start:end])
        ask = PullAsk(req.request_id, hashes, req.block_hashes[start - 1] if start else None,
                      time.monotonic() + self.deadline_s,
                      req.all_token_ids[:end * self.block_size], req.cache_salt,
                      None if req.lora_id is None else str(req.lora_id))
        pinned = list(hit.blocks)  # the prefix the pulled blocks continue stays in the pool
        self.manager.pin(pinned)
        handle = PullHandle()
        future = self._workers.submit(self._receive, source, ask, handle)
        self._pulls[req.request_id] = _Pull(req, source, start, ask, future, handle, pinned,
                                           time.monotonic())
        self._inflight.update(dict.fromkeys(hashes, req.request_id))
        logger.debug("kv pull %s: blocks %d..%d from %s (%s)", req.request_id, start, end,
                     source.pod_id, source.address)

    def _receive(self, source: KvSource, ask: PullAsk, handle: PullHandle) -> PullResult:
        """The worker's job: the peer's entries, verified one by one; stops at the first
        failure with its reason, keeping the intact run before it."""
        out = PullResult([])
        t0 = time.monotonic()
        try:
            if t0 >= ask.deadline:  # waited for a worker past the deadline
                raise PullFailed(DEADLINE, "no transfer slot before the deadline")
            for entries in self.fetch(source, ask, handle):
                for entry in entries:
                    i = len(out.datas)
                    if i >= len(ask.hashes):
                        raise PullFailed(HASH_MISMATCH, "the peer sent more blocks than asked")
                    out.nbytes += len(entry)
                    parent = ask.hashes[i - 1] if i else ask.parent
                    out.datas.append(unpack_block(self.layout, entry, ask.hashes[i], parent))
                if time.monotonic() > ask.deadline:
                    raise PullFailed(DEADLINE, f"{len(out.datas)} of {len(ask.hashes)} blocks "
                                               f"after {self.deadline_s:g}s")
                if handle.cancelled:
                    return out
            if len(out.datas) < len(ask.hashes):
                raise PullFailed(PEER_MISSING, f"the peer holds {len(out.datas)} of the "
                                               f"{len(ask.hashes)} blocks asked for")
        except (PullFailed, EntryRejected) as exc:  # the transport's reason, or the entry's
            out.failure, out.detail = exc.reason, str(exc)
        except Exception as exc:  # a bug must not fail the request: it recomputes
            logger.exception("kv pull %s failed", ask.request_id)
            out.failure, out.detail = ERROR, repr(exc)
        out.seconds = time.monotonic() - t0
        return out

    def _land(self, pull: _Pull, hit: PrefixHit | None = None) -> None:
        """A finished pull: its blocks into the pool as cached blocks (extending `hit` if
        its request is being admitted now), the pinned prefix released."""
        self._end(pull)
        result = pull.future.result()  # _receive never raises
        req = pull.req
        try:
            if hit is None:
                hit = self.manager.lookup(req)
            # Blocks the pool gained meanwhile (another request computed them) are skipped.
            skip = len(hit.blocks) - pull.start
            datas = result.datas[skip:] if skip >= 0 else []
            landed = 0
            if datas:
                def write(block_ids: list[int], blocks: list) -> None:
                    self.runner.write_blocks(block_ids, torch.from_numpy(np.stack(blocks)))

                start = pull.start + skip
                landed = self.manager.load_cached_blocks(
                    req, start, list(zip(req.block_hashes[start:], datas, strict=False)), write,
                    hit)
            if result.failure is None and landed < len(datas):
                result.failure, result.detail = NO_ROOM, f"the pool took {landed} of {len(datas)}"
        finally:
            self.manager.unpin(pull.pinned)
        tokens = landed * self.block_size
        result.seconds = time.monotonic() - pull.t0  # queueing and landing included
        self.stats.note(result, tokens)
        self.stats.blocks += landed
        for observe in self.observers:
            observe(result)
        if landed:
            self._landed[req.request_id] = self._landed.get(req.request_id, 0) + tokens
        if result.failure is not None:
            self.stats.fallbacks[result.failure] = self.stats.fallbacks.get(result.failure, 0) + 1
            logger.warning("kv pull %s from %s (%s): %s; %d of %d blocks landed, recomputing "
                           "the rest", req.request_id, pull.source.pod_id, pull.source.address,
                           result.detail, landed, len(pull.ask.hashes))
        else:
            logger.info("kv pull %s: %d blocks (%.1f MiB) from %s in %.1f ms", req.request_id,
                        landed, result.nbytes / 2**20, pull.source.pod_id, result.seconds * 1e3)

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
        a request the scheduler cannot reach (see TierConnector.finish_loads)."""
        for pull in [p for p in self._pulls.values() if p.future.done()]:
            self._land(pull)

    def has_pending(self) -> bool:
        return bool(self._pulls)

    def wait_for_pulls(self, timeout: float) -> None:
        wait([p.future for p in self._pulls.values()], timeout, FIRST_COMPLETED)

    def pinned_sets(self) -> list[list[KVCacheBlock]]:
        return [p.pinned for p in self._pulls.values()]

    def forget(self, request_id: str) -> None:
        """The request left: stop its pull; its pinned prefix is released now."""
        self.sources.pop(request_id, None)
        self._landed.pop(request_id, None)
        pull = self._pulls.get(request_id)
        if pull is not None:
            self._end(pull)
            pull.handle.cancel()
            self.manager.unpin(pull.pinned)

    def close(self) -> None:
        for pull in list(self._pulls.values()):
            self.forget(pull.req.request_id)
        self._workers.shutdown(wait=True, cancel_futures=True)
