"""The index publisher's queue: what the engine's step loop hands over (`submit`, never
blocking on Redis) and the publisher thread takes, numbered, in order.

While the thread cannot publish deltas (Redis away, before the first full sync, after an
overflow) the queue is *discarding*: events are only counted, the next full republish
covers their tier changes. Not their parent links, though, which place each block in its
bucket (proto.index.placement): the stored runs of dropped events are kept in a placement
log, bounded like the queue (the oldest go first), for the thread to learn at that
republish.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagekv.proto.index.mirror import BucketChange
from pagekv.proto.kv_events import BlockStored, KVEvent

# What an owner submits: a pod's KV events; the vLLM ingester, which places every block
# itself (IndexPublisher(placed=True)), one list of claim changes per tick instead.
Publishable = KVEvent | Sequence[BucketChange]
Queued = tuple[int, float, Publishable]  # (sequence number, monotonic submit time, item)


@dataclass(frozen=True, slots=True)
class QueueCounts:
    pending: int
    submitted: int
    dropped: int
    seq: int  # the last sequence number handed out


class EventQueue:
    """Thread-safe: `submit` runs on the engine's thread, the rest on the publisher's."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._queue: deque[Queued] = deque()
        self._placement_log: deque[BlockStored] = deque(maxlen=max_pending)
        self._seq = 0
        self._discarding = True  # until the first full sync, the snapshot covers everything
        self._dropped = 0
        self._submitted = 0

    def submit(self, events: Iterable[Publishable]) -> bool:
        """Queue events in order. True when this overflowed `max_pending`: the queue was
        dropped and is discarding until the next full republish."""
        now = time.monotonic()
        with self._lock:
            if self._discarding:
                n = 0
                for ev in events:
                    n += 1
                    if isinstance(ev, BlockStored):
                        self._placement_log.append(ev)
                self._seq += n
                self._submitted += n
                self._dropped += n
                return False
            for ev in events:
                self._seq += 1
                self._queue.append((self._seq, now, ev))
                self._submitted += 1
            if len(self._queue) <= self.max_pending:
                return False
            self._discard_locked()  # the thread cannot keep up: resync rather than grow
            return True

    def _discard_locked(self) -> None:
        self._dropped += len(self._queue)
        self._placement_log.extend(ev for _, _, ev in self._queue if isinstance(ev, BlockStored))
        self._queue.clear()
        self._discarding = True

    def discard(self) -> None:
        """Drop the queued deltas (keeping their placements) and stop queueing."""
        with self._lock:
            self._discard_locked()

    def take(self) -> list[Queued]:
        """Everything queued so far, oldest first."""
        with self._lock:
            batch = list(self._queue)
            self._queue.clear()
        return batch

    def reopen(self) -> tuple[int, list[BlockStored]]:
        """Start queueing again, for a full republish: the last sequence number the full
        state must cover, and the stored runs dropped since the last one (the log empties)."""
        with self._lock:
            self._queue.clear()
            self._discarding = False
            runs = list(self._placement_log)
            self._placement_log.clear()
            return self._seq, runs

    def queued_events(self) -> list[Publishable]:
        """The events queued now, left in place (a full state read meanwhile may reflect
        them: their placements are needed for it)."""
        with self._lock:
            return [ev for _, _, ev in self._queue]

    def counts(self) -> QueueCounts:
        with self._lock:
            return QueueCounts(len(self._queue), self._submitted, self._dropped, self._seq)

    @property
    def seq(self) -> int:
        with self._lock:
            return self._seq
