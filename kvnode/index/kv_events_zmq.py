"""A pod's KV events on ZeroMQ in vLLM's wire format (`pagekv node --kv-events-zmq`), so that
whatever reads a vLLM pod's events (`pagekv ingest-vllm`, or another project's indexer)
reads a PageKV pod's too.

As vLLM's own publisher (proto/vllm_events.py has the format): a PUB socket sends each batch
as (topic, sequence number, payload), numbered from 0; the last `buffer_steps` payloads are
kept for a ROUTER socket that replays them from a requested number. Both sockets bind (the
pod is the stable side; subscribers connect).

`submit` runs on the engine thread and never blocks: it numbers the batch and queues it for
the sender thread, which encodes, sends and buffers. A batch that does not fit in the queue
is dropped but keeps its number, so subscribers see a gap, ask for a replay that cannot have
it, and start over from fresh state instead of missing it silently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagekv.proto.kv_events import KVEvent
from pagekv.proto.vllm_events import (
    END_SEQ,
    HASH_FORMS,
    WIRE_FORMS,
    encode_batch,
    seq_from_bytes,
    seq_to_bytes,
    to_wire,
)

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.02  # how long the sender waits for a batch before looking at replay requests


@dataclass(frozen=True, slots=True)
class ZmqEventsConfig:
    """Named like vLLM's KVEventsConfig fields where they mean the same."""

    endpoint: str  # the PUB socket, e.g. tcp://*:5557 (":*" for any free port)
    replay_endpoint: str | None = None  # the ROUTER socket, e.g. tcp://*:5558
    topic: str = ""
    hash_form: str = "int"  # vLLM's default: the low 64 bits; "bytes": the full digest
    wire_form: str = "map"  # events as tagged maps (vLLM today) or positional arrays
    buffer_steps: int = 10_000  # batches kept for replay
    max_queue_size: int = 10_000  # batches waiting for the sender
    hwm: int = 100_000

    def __post_init__(self) -> None:
        if self.hash_form not in HASH_FORMS:
            raise ValueError(f"--kv-events-hash-form must be one of {', '.join(HASH_FORMS)}")
        if self.wire_form not in WIRE_FORMS:
            raise ValueError(f"--kv-events-format must be one of {', '.join(WIRE_FORMS)}")
        if self.buffer_steps < 0 or self.max_queue_size <= 0:
            raise ValueError("buffer_steps must be >= 0 and max_queue_size > 0")


class VllmEventPublisher:
    def __init__(self, config: ZmqEventsConfig, clock: Callable[[], float] = time.time
                 ) -> None:
        self.config = config
        self._clock = clock
        self._topic = config.topic.encode()
        self._lock = threading.Lock()
        self._queue: deque[tuple[int, float, list[KVEvent]]] = deque()
        self._ready = threading.Condition(self._lock)
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.endpoint = ""  # as bound (the port filled in)
        self.replay_endpoint = ""
        self.published = 0
        self.dropped = 0
        self.replays_served = 0
        self.errors = 0

    # -- the engine's side ---------------------------------------------------------------
    def submit(self, events: list[KVEvent]) -> None:
        """Queue one step's events as one batch. Never blocks."""
        if not events:
            return
        now = self._clock()
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            if len(self._queue) >= self.config.max_queue_size:
                self.dropped += 1  # its number is never sent: subscribers see the gap
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    logger.warning("kv events zmq: sender behind, %d batches dropped so far "
                                   "(subscribers resync)", self.dropped)
                return
            self._queue.append((seq, now, events))
            self._ready.notify()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 5.0) -> None:
        """Bind both sockets (on the sender thread, which owns them); raises if it cannot."""
        if self._thread is not None:
            raise RuntimeError("VllmEventPublisher already started")
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError("kv events zmq: sockets not bound in time")
        if self._start_error is not None:
            self._thread.join(timeout)
            raise OSError(f"kv events zmq: cannot bind: {self._start_error}")
        logger.info("kv events in vLLM's format on %s (topic %r, %s hashes, %s events)%s",
                    self.endpoint, self.config.topic, self.config.hash_form,
                    self.config.wire_form,
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def stop(self, timeout: float = 5.0) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        with self._lock:
            self._ready.notify()
        thread.join(timeout)

    def collector(self, labels: dict[str, str]) -> Collector:
        """Its counters for Prometheus (`pagekv_kv_events_zmq_*`), read at scrape time."""
        return _ZmqEventsCollector(self, labels)

    def stats(self) -> dict[str, int]:
        with self._lock:
            queued, seq = len(self._queue), self._next_seq
        return {"seq": seq, "queued": queued, "published": self.published,
                "dropped": self.dropped, "replays_served": self.replays_served,
                "errors": self.errors}

    # -- the sender thread ---------------------------------------------------------------
    def _bind(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        pub.bind(self.config.endpoint)
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay = None
        if self.config.replay_endpoint:
            replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            try:
                replay.bind(self.config.replay_endpoint)
            except zmq.ZMQError:
                replay.close()
                pub.close()
                raise
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        return pub, replay

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        try:
            pub, replay = self._bind(ctx)
        except zmq.ZMQError as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            while not self._stop.is_set():
                with self._lock:
                    if not self._queue:
                        self._ready.wait(_IDLE_POLL_S)
                    batches = list(self._queue)
                    self._queue.clear()
                for seq, ts, events in batches:
                    self._send(pub, seq, ts, events)
                while replay is not None and replay.poll(0):
                    self._serve_replay(replay)
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)

    def _send(self, pub: zmq.Socket, seq: int, ts: float, events: list[KVEvent]) -> None:
        cfg = self.config
        try:
            payload = encode_batch(ts, to_wire(events, cfg.hash_form), cfg.wire_form)
            pub.send_multipart((self._topic, seq_to_bytes(seq), payload), copy=False)
        except Exception:  # noqa: BLE001 - a bad batch must not stop the stream; it is a gap
            self.errors += 1
            logger.exception("kv events zmq: batch %d not sent", seq)
            return
        self._buffer.append((seq, payload))
        self.published += 1

    def _serve_replay(self, sock: zmq.Socket) -> None:
        """(identity, "", first seq) -> every buffered batch from there, then the end marker;
        each answer is (topic, seq, payload) after the envelope, as newer vLLM sends."""
        frames = sock.recv_multipart()
        if len(frames) == 3 and frames[1] == b"":
            envelope = frames[:2]  # a REQ client or a DEALER that sent the empty delimiter
        elif len(frames) == 2:
            envelope = frames[:1]
        else:
            logger.warning("kv events zmq: replay request of %d frames ignored", len(frames))
            return
        try:
            start = seq_from_bytes(frames[-1])
        except ValueError:
            logger.warning("kv events zmq: replay request without an 8-byte sequence number")
            return
        sent = 0
        for seq, payload in list(self._buffer):
            if seq >= start:
                sock.send_multipart((*envelope, self._topic, seq_to_bytes(seq), payload))
                sent += 1
        sock.send_multipart((*envelope, self._topic, seq_to_bytes(END_SEQ), b""))
        self.replays_served += 1
        logger.debug("kv events zmq: replayed %d batches from %d", sent, start)


class _ZmqEventsCollector(Collector):
    _COUNTERS = {"published": "batches sent", "dropped": "batches dropped, the sender behind",
                 "replays_served": "replay requests answered",
                 "errors": "batches that could not be encoded or sent"}

    def __init__(self, publisher: VllmEventPublisher, labels: dict[str, str]) -> None:
        self.publisher = publisher
        self.names, self.values = list(labels), list(labels.values())

    def collect(self):
        stats = self.publisher.stats()
        for key, doc in self._COUNTERS.items():
            fam = CounterMetricFamily(f"pagekv_kv_events_zmq_{key}",
                                      f"KV events in vLLM's format: {doc}", labels=self.names)
            fam.add_metric(self.values, stats[key])
            yield fam
        for key, doc in (("seq", "the next batch's sequence number"),
                         ("queued", "batches waiting for the sender")):
            fam = GaugeMetricFamily(f"pagekv_kv_events_zmq_{key}",
                                    f"KV events in vLLM's format: {doc}", labels=self.names)
            fam.add_metric(self.values, stats[key])
            yield fam
