"""The vLLM ingester: one vLLM pod's KV events, read off its ZeroMQ publisher, written into
PageKV's Redis index as that pod's claims, so the router sees its blocks next to PageKV
pods'. `pagekv ingest-vllm` runs one (vllm_ingest_cli.py).

Writes go through the same IndexPublisher a PageKV pod uses, registered with the vLLM pod's
hash configuration (the router's handshake refuses a pod whose configuration is not its own,
naming the field) and `kind=vllm` with its OpenAI address. Its full state, for republishing
after Redis comes back, is the ingester's own book of the pod's blocks (proto/vllm_chain.py).

Sequence numbers (one per batch, from 0 per publisher process):
* the next one: applied;
* a jump ahead (batches lost on the way): the missing ones are asked from the replay socket
  and applied in order; those the publisher no longer buffers are gone, so the pod's claims
  are cleared and the index follows fresh events from there (said in one log line);
* one not above the last: a batch seen already (the live copy of one replayed) is skipped;
  any other means the publisher restarted, its cache empty: cleared, then read as a new
  stream;
* the first one seen, if not 0: everything before it is asked from the replay socket.
At start the ingester asks the replay socket for everything it still has, so it does not
wait for the pod's next batch to learn what the pod already holds.
Frames or payloads that cannot be read are counted, logged (throttled) and skipped.

Batches are read in ticks of `flush_interval_s`: one that arrives a tick or more after the
last drain is applied at once; one that arrives sooner waits for that tick to end, and every
batch queued by then is applied together, their claim changes written in one round trip;
ticks go on while they gather batches. One thread does it all: it drives the index
publisher itself (no thread of its own), so while events flow it wakes once per tick, not
once per batch (a wake-up costs more CPU than a small batch's work), and an idle one only to
renew the lease. The price is the index lag: up to one tick while batches keep coming.

While the pod's OpenAI server does not answer /health (vllm_health.py) the pod is out of the
index: its claims and lease removed, its events still followed, and republished in full when
it answers again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from pagekv.kvnode.index.publish_stats import LAG_BUCKETS
from pagekv.kvnode.index.publisher import IndexPublisher
from pagekv.kvnode.index.vllm_health import HealthProbe, health_url
from pagekv.kvnode.index.vllm_stream import BadFrames, Frame, ReplayFailed, VllmEventStream
from pagekv.kvnode.memory.metrics import Histogram as PlainHistogram
from pagekv.proto.credentials import TlsFiles, client_ssl_context
from pagekv.proto.hashing import DEFAULT_HASH_SEED, HashConfig
from pagekv.proto.index.mirror import BucketChange
from pagekv.proto.index.schema import POD_KIND_VLLM, IndexSchema
from pagekv.proto.index.writes import kind_fields
from pagekv.proto.redact import redact_url
from pagekv.proto.serving import ThrottledWarning
from pagekv.proto.vllm_chain import VllmBlockBook
from pagekv.proto.vllm_events import (
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    WireError,
    decode_batch,
)

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 10.0  # at most one line per kind of trouble per this many seconds
_SEEN_BATCHES = 4096  # recent batches remembered (by payload hash) to know a duplicate
_EVENT_NAMES = {WireBlockStored: "BlockStored", WireBlockRemoved: "BlockRemoved",
                WireAllBlocksCleared: "AllBlocksCleared"}  # the metric's label


@dataclass(frozen=True, slots=True)
class IngestConfig:
    zmq_endpoint: str  # the vLLM pod's PUB socket, e.g. tcp://vllm-0:5557
    pod_id: str
    openai_address: str  # host:port of its OpenAI server
    model: str
    block_size: int
    redis_url: str
    replay_endpoint: str | None = None  # its ROUTER socket, e.g. tcp://vllm-0:5558
    topic: str = ""
    hash_algo: str = "sha256"
    hash_seed: str = DEFAULT_HASH_SEED
    lease_ttl_s: float = 6.0  # renewed every third of it (it carries no load to update)
    replay_timeout_s: float = 2.0
    max_blocks: int = 4_000_000
    recent_blocks: int = 262_144
    redis_tls: TlsFiles | None = None
    # An https:// openai_address: the CA of the pod's certificate, the ingester's own.
    openai_tls: TlsFiles | None = None
    health_interval_s: float = 2.0  # 0: no health probe, the pod is always taken as up
    health_failures: int = 3
    load_from_metrics: bool = True  # with the health check: its /metrics into the lease
    flush_interval_s: float = 0.05  # a tick: how long a batch may wait to be written


@dataclass(slots=True)
class IngestCounters:
    """Plain numbers owned by the ingest thread; Prometheus reads them at scrape time."""

    batches: int = 0
    events: Counter[str] = field(default_factory=Counter)  # by vLLM event type
    garbage: int = 0  # frames or payloads that could not be read
    gaps: int = 0
    replays: Counter[str] = field(default_factory=Counter)  # ok | partial | failed
    resets: int = 0  # the publisher started over (sequence went back)
    duplicates: int = 0  # live copies of batches already replayed
    clears: int = 0  # the pod's claims removed: a gap replay could not fill, a reset
    last_seq: int = -1
    lag: PlainHistogram = field(default_factory=lambda: PlainHistogram(LAG_BUCKETS))


class VllmIngester:
    def __init__(self, config: IngestConfig) -> None:
        self.config = config
        self.schema = IndexSchema(config.model, config.block_size, config.hash_algo,
                                  config.hash_seed)
        self.book = VllmBlockBook(HashConfig(config.hash_algo, config.hash_seed),
                                  config.block_size, max_blocks=config.max_blocks,
                                  recent_blocks=config.recent_blocks)
        self.counters = IngestCounters()
        self.publisher = IndexPublisher(
            config.redis_url, self.schema, config.pod_id, config.openai_address,
            self.schema.hash_config(), load_fn=self.published_load,
            full_state_fn=self._full_state,
            lease_ttl_s=config.lease_ttl_s, flush_interval_s=config.flush_interval_s,
            redis_tls=config.redis_tls, placed=True, renew_every_third=True,
            registration=kind_fields(POD_KIND_VLLM, config.openai_address))
        self.health: HealthProbe | None = None
        if config.health_interval_s > 0:
            self.health = HealthProbe(health_url(config.openai_address), self._pod_down,
                                      self._pod_up, config.health_interval_s,
                                      config.health_failures,
                                      "/metrics" if config.load_from_metrics else None,
                                      client_ssl_context(config.openai_tls)
                                      if config.openai_address.startswith("https://") else None)
        self.stream: VllmEventStream | None = None
        self._last: int | None = None  # the last batch applied, None before the first
        self._pending: list[BucketChange] = []  # claim changes of this tick, in order
        self._handed: int | None = None  # the last batch whose changes the publisher has
        self._poked = False
        self._seen: OrderedDict[int, int] = OrderedDict()  # seq -> hash of its payload
        self.joined = threading.Event()  # set once the start's replay is done
        self._applied = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warn: dict[str, ThrottledWarning] = {}

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 5.0) -> bool:
        """Join the index, connect to the publisher, ingest on a thread. Returns whether the
        index's first sync finished in time (if not, it keeps trying in the background)."""
        c = self.config
        logger.info("ingesting vLLM pod %s: events from %s (replay %s, topic %r) into the "
                    "index at %s; OpenAI API at %s; model %s, block size %d, %s",
                    c.pod_id, c.zmq_endpoint, c.replay_endpoint or "none", c.topic,
                    redact_url(c.redis_url), c.openai_address, c.model, c.block_size,
                    self.book.hash_config.fingerprint())
        self.stream = VllmEventStream(c.zmq_endpoint, c.replay_endpoint, c.topic)
        self.publisher.on_wake = self._poke
        synced = self.publisher.start(timeout, thread=False)
        if self.health is not None:
            self.health.start()
        self._thread = threading.Thread(target=self._run, name=f"ingest-{c.pod_id}",
                                        daemon=True)
        self._thread.start()
        return synced

    def stop(self, clear: bool = True, timeout: float = 5.0) -> None:
        """Stop reading; clear=True also removes the pod's claims and registration."""
        if self.health is not None:
            self.health.stop()
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            self.publisher.request_stop()
            self._poke()
            thread.join(timeout)
        self.publisher.on_wake = None
        if self.stream is not None:
            self.stream.close()
        self.publisher.stop(clear=clear)
        logger.info("ingester for vLLM pod %s stopped after %d batches", self.config.pod_id,
                    self.counters.batches)

    def wait_applied(self, seq: int, timeout: float = 5.0) -> bool:
        """Wait until batch `seq` is applied and what it changed is visible in Redis."""
        deadline = time.monotonic() + timeout
        with self._applied:
            while self._handed is None or self._handed < seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._applied.wait(left)
        if self.health is not None and not self.health.up:
            return True  # out of the index: nothing of it is to become visible
        return self.publisher.flush(max(0.0, deadline - time.monotonic()))

    def published_load(self) -> dict[str, float]:
        """What the lease tells of the pod's queue: its own /metrics, read by the probe."""
        return self.health.fresh_load() if self.health is not None else {}

    def _full_state(self) -> dict[int, dict[str, int]]:
        return self.book.full_state()  # (the publisher runs on this thread: no lock)

    def _poke(self) -> None:
        """Wake the ingest thread: the publisher has work (a flush, a pause), or stop."""
        self._poked = True
        if self.stream is not None:
            self.stream.interrupt()

    def _hand_over(self) -> None:
        """The tick's claim changes to the publisher, as one item (it nets them), then wake
        whoever waits for the batches applied."""
        if self._pending:
            self.publisher.submit([self._pending])
            self._pending = []
        if self._handed != self._last:
            with self._applied:
                self._handed = self._last
                self._applied.notify_all()

    # -- the pod's health (the probe's thread) ------------------------------------------
    def _pod_down(self, why: str) -> None:
        logger.warning("vLLM pod %s is not serving (%s): removing it from the index; its "
                       "events are still followed, and it rejoins once /health answers",
                       self.config.pod_id, why)
        self.publisher.pause()

    def _pod_up(self) -> None:
        logger.info("vLLM pod %s serves again: back in the index with its %d blocks",
                    self.config.pod_id, len(self.book))
        self.publisher.resume()  # a full republish of the book

    # -- the ingest thread ---------------------------------------------------------------
    def _run(self) -> None:
        assert self.stream is not None
        try:
            self._join()
        except Exception:
            logger.exception("ingester %s: the start's replay failed", self.config.pod_id)
        self._hand_over()
        pub, stream, stop = self.publisher, self.stream, self._stop
        due = time.monotonic() + pub.step(write=True)
        self.joined.set()
        tick = self.config.flush_interval_s
        tick_end: float | None = None  # when the batches queued are to be applied
        at_once = False  # this drain is a lone batch's, after a quiet tick
        last_drain = -tick
        while not stop.is_set():
            now = time.monotonic()
            if tick_end is None:
                if stream.wait(max(0.0, due - now)) and not self._poked:
                    now = time.monotonic()
                    # A batch after a quiet tick is applied at once (one wake-up for it,
                    # no lag); one sooner than that waits for the tick to gather more.
                    at_once = now - last_drain >= tick
                    tick_end = now if at_once else last_drain + tick
                    if not at_once:
                        continue
            else:
                stream.wait(max(0.0, min(due, tick_end) - now), batches=False)
            if stop.is_set():
                break
            now = time.monotonic()
            write = self._poked
            if tick_end is not None and now >= tick_end:
                drained = self._drain()
                # Ticks go on while they gather batches; after a lone batch, or an empty
                # tick, the next batch is waited for.
                tick_end = now + tick if drained and not at_once else None
                at_once = False
                last_drain = now
                self._hand_over()
                write = True
            if write or now >= due:
                self._poked = False
                due = time.monotonic() + pub.step(write=write)

    def _drain(self) -> int:
        """Apply every batch queued; how many there were."""
        assert self.stream is not None
        n = 0
        while True:
            try:
                frame = self.stream.recv_nowait()
            except BadFrames as exc:
                self._garbage(f"a message that is not a KV event batch: {exc}")
                continue
            if frame is None:
                return n
            n += 1
            try:
                self._on_frame(frame)
            except Exception:  # a bug must not stop ingesting: say so, carry on
                logger.exception("ingester %s: batch %d failed", self.config.pod_id,
                                 frame.seq)

    def _join(self) -> None:
        """Apply whatever the publisher still buffers (the pod's state so far, if its buffer
        reaches back to batch 0)."""
        pod = self.config.pod_id
        if not self.config.replay_endpoint:
            logger.info("vLLM pod %s: no replay endpoint; indexing from its next batch", pod)
            return
        try:
            replayed = self.stream.replay(0, self.config.replay_timeout_s)  # type: ignore[union-attr]
        except ReplayFailed as exc:
            logger.info("vLLM pod %s: nothing replayed at start (%s); indexing from its next "
                        "batch", pod, exc)
            return
        if not replayed:
            logger.info("vLLM pod %s: no batches published yet", pod)
            return
        first = replayed[0].seq
        if first > 0:
            logger.warning("vLLM pod %s: joined at batch %d; batches before it are gone from "
                           "its replay buffer: blocks stored before are indexed once stored "
                           "again", pod, first)
        self.counters.replays["ok" if first == 0 else "partial"] += 1
        for f in replayed:
            if self._last is None or f.seq == self._last + 1:
                self._apply(f)
        logger.info("vLLM pod %s: replayed batches %d..%d at start: %d blocks indexed", pod,
                    first, self._last, len(self.book))

    def _on_frame(self, frame: Frame) -> None:
        last = self._last
        if last is not None and frame.seq <= last:
            if self._seen.get(frame.seq) == hash(frame.payload):
                self.counters.duplicates += 1
                return
            self.counters.resets += 1
            logger.warning("vLLM pod %s: batch %d after %d: its publisher restarted; clearing "
                           "its %d indexed blocks and reading the new stream",
                           self.config.pod_id, frame.seq, last, len(self.book))
            self._clear()
            self._seen.clear()  # the new stream's numbers say nothing about the old one's
            last = self._last = None
            with self._applied:
                self._handed = None
        if last is None and frame.seq > 0:
            self._catch_up(0, frame, joining=True)
        elif last is not None and frame.seq > last + 1:
            self.counters.gaps += 1
            self._catch_up(last + 1, frame, joining=False)
        self._apply(frame)

    def _catch_up(self, start: int, frame: Frame, joining: bool) -> None:
        """Apply batches start..frame.seq-1 from the replay socket; what it cannot supply is
        lost, and unless this is the stream's start the pod's claims are cleared."""
        pod, end = self.config.pod_id, frame.seq - 1
        why = ""
        try:
            replayed = self.stream.replay(start, self.config.replay_timeout_s)  # type: ignore[union-attr]
        except ReplayFailed as exc:
            replayed, why = [], str(exc)
        # The run of consecutive batches that ends right before this one.
        by_seq = {f.seq: f for f in replayed if start <= f.seq <= end}
        first = end + 1
        while first - 1 in by_seq:
            first -= 1
        tail = [by_seq[s] for s in range(first, end + 1)]
        if first == start:
            self.counters.replays["ok"] += 1
            logger.info("vLLM pod %s: %s batches %d..%d replayed", pod,
                        "joined the stream late:" if joining else "gap:", start, end)
        else:
            self.counters.replays["partial" if tail else "failed"] += 1
            gone = f"batches {start}..{first - 1} are gone from its replay buffer" + (
                f" ({why})" if why else "")
            if joining or not len(self.book):
                logger.warning("vLLM pod %s: joined at batch %d; %s: blocks stored before are "
                               "indexed once stored again", pod, frame.seq, gone)
            else:
                logger.warning("vLLM pod %s: %s: cleared its %d indexed blocks; indexing "
                               "fresh state from batch %d on", pod, gone, len(self.book),
                               first)
                self._clear()
        for f in tail:
            self._apply(f)

    def _clear(self) -> None:
        self._pending += self.book.clear()
        self.counters.clears += 1

    def _apply(self, frame: Frame) -> None:
        try:
            batch = decode_batch(frame.payload)
        except WireError as exc:
            self._garbage(f"batch {frame.seq}: {exc}")
        else:
            book = self.book
            for reason in batch.skipped:
                book.refuse(reason, f"an event of batch {frame.seq} could not be read")
            self._pending += book.apply(batch.events)
            c = self.counters
            c.batches += 1
            for ev in batch.events:
                c.events[_EVENT_NAMES[type(ev)]] += 1
            c.lag.observe(max(0.0, time.time() - batch.ts))
            for refusal in book.take_refusals():
                self._warning(refusal.reason, "vLLM pod %s: event refused (%s): %s",
                              self.config.pod_id, refusal.reason, refusal.detail)
        self.counters.last_seq = frame.seq
        self._seen[frame.seq] = hash(frame.payload)
        if len(self._seen) > _SEEN_BATCHES:
            self._seen.popitem(last=False)
        self._last = frame.seq

    def _garbage(self, detail: str) -> None:
        self.counters.garbage += 1
        self._warning("garbage", "vLLM pod %s: skipped %s", self.config.pod_id, detail)

    def _warning(self, kind: str, msg: str, *args: object) -> None:
        warn = self._warn.get(kind)
        if warn is None:
            warn = self._warn[kind] = ThrottledWarning(logger, _WARN_EVERY_S)
        warn.warn(msg, *args)
