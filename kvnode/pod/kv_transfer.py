"""`KVNode.PullBlocks`: a pod serves the KV blocks of a chain to a peer that pulls them.

Only peer pods reach it (the peer token: proto/grpc_security.py's TokenGuard). Checks first
(the pod serving, the same hash configuration and KV layout, the list's size, a free transfer
slot: `--kv-transfer-max-concurrent`); a refused configuration is told only what differs, the
values are logged here. Then the caller must show the chain is its own request's: the hashes
asked are the ones its prompt tokens and cache salt give (kv_export.ChainClaim), or it gets an
empty stream, as for blocks not held. Then the run this pod holds is found
and its pool blocks pinned on the engine thread (kvnode.engine.kv_export). The blocks go out
a message at a time (about `chunk_bytes` each), as the entries the engine's exporter packed
(tiers.peer_entries: this module never looks inside one); each message waits for gRPC's flow
control, so a slow puller slows the reads instead of filling this pod's memory. The stream stops at `--kv-transfer-max-bytes` (or the puller's
smaller limit). Whatever ends the call — done, cancelled, the puller gone — the pins are
released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from prometheus_client import Counter, Gauge

from pagekv.kvnode.engine.kv_export import ChainClaim, ExportRun, KvExporter
from pagekv.kvnode.pod.kv_data_session import ExportSession
from pagekv.kvnode.pod.messages import engine_request_id
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb

logger = logging.getLogger(__name__)

MAX_PULL_BLOCKS = 8192
GRPC = "grpc"  # the blocks in the PullBlocks stream itself
TRANSPORTS = ("tcp", "mooncake", GRPC)
PROGRESS_POLL_S = 0.5  # how often the control call looks at a data transfer's progress


class DataServer(Protocol):
    """A data transport's holder end (kvnode/pod/kv_data_tcp.py, kv_data_mooncake.py)."""

    name: str

    def offer(self, session: ExportSession) -> pb.TransferTicket: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """The pod's cross-pod KV flags (README "Cross-pod KV pull")."""

    pull: bool = True                 # --kv-pull: act on a request's kv_source
    pull_max_concurrent: int = 4      # --kv-pull-max-concurrent: pulls running at once
    pull_deadline_s: float = 2.0      # --kv-pull-deadline-s: then recompute the rest
    serve_max_concurrent: int = 4     # --kv-transfer-max-concurrent: peers served at once
    serve_max_bytes: int = 1 << 30    # --kv-transfer-max-bytes: per call
    compress: bool = False            # --kv-transfer-compress: LZ4 entries (slow links)
    chunk_bytes: int = 4 << 20        # bytes of blocks per stream message
    peer_token: str | None = None     # the fleet's peer token: presented, and required here
    # --kv-transports: the data transports this pod pulls with (its preference first) and
    # serves; "grpc" alone: the blocks in PullBlocks' own stream, as before transports.
    transports: tuple[str, ...] = ("tcp",)
    data_port: int = 0                # --kv-data-port: the tcp transport's port (0: any free)

    def __post_init__(self) -> None:
        for name in ("pull_max_concurrent", "serve_max_concurrent", "serve_max_bytes",
                     "chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        unknown = [t for t in self.transports if t not in TRANSPORTS]
        if unknown or not self.transports or len(set(self.transports)) < len(self.transports):
            raise ValueError(f"transports must be distinct names among {', '.join(TRANSPORTS)}"
                             f", got {', '.join(self.transports) or 'none'}")
        if not 0 <= self.data_port < 1 << 16:
            raise ValueError(f"data_port must be 0..65535, got {self.data_port}")
        if not self.pull_deadline_s > 0:
            raise ValueError(f"pull_deadline_s must be > 0, got {self.pull_deadline_s}")


@dataclass(slots=True)
class _OpenState:
    """One pull's open, as the engine thread sees it (KvTransferService._open)."""

    run: ExportRun | None = None
    abandoned: bool = False


class KvTransferService:
    def __init__(self, pod, config: TransferConfig) -> None:
        self.pod = pod
        self.data_servers: dict[str, DataServer] = {}  # add_data_server, once listening
        self.max_concurrent = config.serve_max_concurrent
        self.max_bytes = config.serve_max_bytes
        self.compress = config.compress
        self.chunk_bytes = config.chunk_bytes
        self.active = 0
        labels = pod.metric_labels
        names = [*labels]
        self._served_blocks = Counter(
            "pagekv_kv_served_blocks", "KV blocks sent to peers that pulled them, by tier",
            [*names, "tier"], registry=pod.registry)
        self._served_bytes = Counter(
            "pagekv_kv_served_bytes", "Entry bytes sent to peers that pulled KV blocks",
            names, registry=pod.registry).labels(**labels)
        self._refused = Counter(
            "pagekv_kv_transfers_refused", "Pull calls refused, by reason", [*names, "reason"],
            registry=pod.registry)
        self._active = Gauge("pagekv_kv_transfers_active", "Pull calls being served now",
                             names, registry=pod.registry).labels(**labels)
        self._handovers_lent = Counter(
            "pagekv_handover_served_from_hold", "P/D handover pulls served straight from the "
            "prefill's hold (no wait for the engine thread)", names,
            registry=pod.registry).labels(**labels)
        self._labels = labels
        self._warned: set[str] = set()

    def add_data_server(self, server: DataServer) -> None:
        self.data_servers[server.name] = server

    def close(self) -> None:
        for server in self.data_servers.values():
            server.close()
        self.data_servers.clear()

    def _refuse(self, reason: str) -> None:
        self._refused.labels(**self._labels, reason=reason).inc()

    def mismatch(self, request: pb.PullBlocksRequest) -> tuple[str, str] | None:
        """None when this pod's blocks would be the puller's, else (what differs, the detail
        with both sides' values, for this pod's log only: a caller learns nothing of this
        pod's configuration from a refusal)."""
        def shown(c: pb.HashConfig) -> str:
            return f"{c.algo}/{c.seed_fingerprint}/{c.block_size}"

        mine, theirs = self.pod.wire_hash_config(), request.hash_config
        key = ("algo", "seed_fingerprint", "block_size")  # not the namespace: the puller's own
        if [getattr(theirs, k) for k in key] != [getattr(mine, k) for k in key]:
            return "hash configuration", f"{shown(theirs)} (puller) vs {shown(mine)} (this pod)"
        layout = self.pod.engine.kv_layout.json
        if request.kv_layout != layout:
            return "KV layout", f"{request.kv_layout[:512]} (puller) vs {layout} (this pod)"
        return None

    def _log_mismatch(self, what: str, detail: str, peer: str) -> None:
        # One warning per kind: a misconfigured or hostile peer retrying must not flood the log.
        log = logger.debug if what in self._warned else logger.warning
        self._warned.add(what)
        log("refused a pull from %s: its %s differs: %s", peer, what, detail)

    async def pull_blocks(self, request: pb.PullBlocksRequest, context):
        pod = self.pod
        if pod.aengine is None or not pod.serving:
            self._refuse("unavailable")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "pod is starting or stopping")
        if len(request.block_hashes) > MAX_PULL_BLOCKS:
            self._refuse("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"at most {MAX_PULL_BLOCKS} block hashes per pull")
        differs = self.mismatch(request)
        if differs is not None:
            self._refuse("config_mismatch")
            self._log_mismatch(*differs, context.peer())
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the puller's {differs[0]} differs from this pod's")
        if self.active >= self.max_concurrent:
            self._refuse("busy")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.active} transfers running "
                                f"(--kv-transfer-max-concurrent {self.max_concurrent})")
        self.active += 1
        self._active.inc()
        try:
            # Closed here, not left to the garbage collector: its finally releases the pins.
            async with contextlib.aclosing(self._serve(request, context)) as stream:
                async for chunk in stream:
                    yield chunk
        finally:
            self.active -= 1
            self._active.dec()

    async def _serve(self, request: pb.PullBlocksRequest, context):
        pod = self.pod
        eng = pod.engine
        exporter = eng.exporter
        hashes = list(request.block_hashes)
        parent = request.parent_hash or None
        claim = ChainClaim(list(request.chain_token_ids), request.cache_salt or None,
                           request.lora_id or None)
        # Hashing the claim is microseconds a block: off the loop for a long chain.
        if not await asyncio.to_thread(exporter.is_chain_of, hashes, parent, claim):
            # Nothing, as for blocks this pod does not hold: not even whether it holds them.
            self._refuse("not_callers_chain")
            logger.debug("pull %s: the hashes asked are not the chain the caller's tokens "
                         "and salt give: nothing served", request.request_id or "-")
            return
        run, close = await self._run(request, hashes, parent)
        budget = min(request.max_bytes or self.max_bytes, self.max_bytes)
        server = next((self.data_servers[t] for t in request.transports
                       if t in self.data_servers), None)
        if server is not None:
            left = context.time_remaining()
            # From here the session owns the run: it is closed once neither this call nor
            # the transport's worker holds it.
            session = ExportSession(
                exporter, run, budget=budget,
                deadline=time.monotonic() + (left if left is not None else 600.0),
                compress=self.compress, chunk_bytes=self.chunk_bytes, close_run=close)
            try:
                yield pb.PullBlocksChunk(ticket=server.offer(session))
                async for chunk in self._progress(session):
                    yield chunk
            finally:
                session.end()
                self._count(run, 0, session.sent_blocks, session.sent_bytes)
                # Here, not after: a puller that has its end frame cancels this call.
                self._served(request, session.sent_blocks)
            logger.debug("served %s on %s: %d of %d blocks asked, %d bytes",
                         request.request_id or "-", server.name, session.sent_blocks,
                         len(hashes), session.sent_bytes)
            return
        per_message = max(1, self.chunk_bytes // eng.kv_layout.block_bytes)
        sent = served = 0
        try:
            for lo in range(0, len(run.hashes), per_message):
                hi = min(lo + per_message, len(run.hashes))
                # Off the engine thread: a busy pod must not pace the pull.
                entries = await asyncio.to_thread(exporter.read_entries, run, lo, hi,
                                                  self.compress)
                kept = []
                for entry in entries:
                    if sent + len(entry) > budget:
                        break
                    sent += len(entry)
                    kept.append(entry)
                if kept:
                    self._count(run, lo, len(kept), sum(len(e) for e in kept))
                    yield pb.PullBlocksChunk(entries=kept)
                served += len(kept)
                if len(kept) < hi - lo:
                    break  # the byte limit, or a tier block gone since the run was found
        finally:
            close()  # posted or quick, not awaited: this also runs when the call is cancelled
            self._served(request, served)
        logger.debug("served %s: %d of %d blocks asked, %d bytes", request.request_id or "-",
                     len(run.hashes), len(hashes), sent)

    async def _run(self, request: pb.PullBlocksRequest, hashes: list[bytes],
                   parent: bytes | None) -> tuple[ExportRun, Callable[[], None]]:
        """The run to serve and how to let it go. A P/D handover's blocks come straight from
        the prefill's hold (no wait for the engine thread, busy with the next prompt's
        step on a prefill pod); any other run is opened on the engine thread."""
        pod = self.pod
        eng = pod.engine
        if request.handover_id:
            hid = engine_request_id(request.handover_id)
            lent = eng.lend_handover(hid, hashes, parent)
            if lent is not None:
                self._handovers_lent.inc()
                return lent, lambda: eng.return_handover(hid)
        exporter = eng.exporter
        run = await self._open(exporter, hashes, parent)
        return run, lambda: pod.aengine.post(lambda: exporter.close(run))

    def _served(self, request: pb.PullBlocksRequest, blocks: int) -> None:
        """A P/D handover's pull was served all it asked for: the prefill's hold ends (its
        blocks go to the prefix cache). A pull served short leaves the hold to its deadline,
        so a retry (another decode pod) still finds the blocks."""
        if not request.handover_id or blocks < len(request.block_hashes):
            return
        eng = self.pod.engine
        hid = engine_request_id(request.handover_id)
        self.pod.aengine.post(lambda: eng.release_handover(hid))

    @staticmethod
    async def _progress(session: ExportSession):
        """The transport's progress as messages (a transport that reads the holder's memory,
        as Mooncake's, reads up to `ready_blocks`), until it has sent all it will."""
        seen, finished = 0, False
        while not finished and session.remaining_s() > 0:
            wait_s = min(PROGRESS_POLL_S, max(session.remaining_s(), 0.0))
            ready, finished = await asyncio.to_thread(session.wait_progress, seen, wait_s)
            if ready > seen or finished:
                seen = ready
                yield pb.PullBlocksChunk(ready_blocks=ready)

    async def _open(self, exporter: KvExporter, hashes: list[bytes], parent: bytes | None
                    ) -> ExportRun:
        """The run, its blocks pinned — and never pinned for good by a caller that gives up
        first: a busy engine runs the open after the puller's deadline has cancelled this
        call (or `call`'s own timeout has passed), and nothing would close that run. Both the
        open and the giving up run on the engine thread, in the order they were queued, so
        whichever comes second closes it."""
        aengine = self.pod.aengine
        state = _OpenState()

        def open_run() -> ExportRun:
            run = exporter.open(hashes, parent)
            if state.abandoned:
                exporter.close(run)
            else:
                state.run = run
            return run

        def give_up() -> None:
            state.abandoned = True
            if state.run is not None:
                exporter.close(state.run)

        try:
            return await asyncio.to_thread(aengine.call, open_run)
        except BaseException:  # cancelled, or the engine did not answer in time
            aengine.post(give_up)
            raise

    def _count(self, run: ExportRun, lo: int, blocks: int, nbytes: int) -> None:
        for m in run.media[lo : lo + blocks]:
            self._served_blocks.labels(**self._labels, tier=m).inc()
        self._served_bytes.inc(nbytes)
