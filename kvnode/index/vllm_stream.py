"""The subscriber's sockets to one KV-event publisher in vLLM's format (a vLLM pod, or a
PageKV pod with --kv-events-zmq): the live stream on SUB, missed batches from the replay
ROUTER on a DEALER. Frames only; what the batches mean is vllm_ingest.py's business.

Both connect (the publisher binds), so either side may start first and a restarted
publisher is reconnected by ZeroMQ itself.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import zmq

from pagekv.proto.vllm_events import END_SEQ, seq_from_bytes, seq_to_bytes

logger = logging.getLogger(__name__)


class BadFrames(ValueError):
    """A message that is not (topic, 8-byte sequence number, payload)."""


@dataclass(frozen=True, slots=True)
class Frame:
    seq: int
    payload: bytes


class ReplayFailed(Exception):
    """The replay socket did not finish answering in time (or there is none)."""


class VllmEventStream:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 rcvhwm: int = 100_000) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)  # a prefix match, as ZeroMQ does
        self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        # interrupt() writes a byte here: a wait() of any length returns at once.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._pipe_only = zmq.Poller()
        self._pipe_only.register(self._wake_r, zmq.POLLIN)

    def wait(self, timeout_s: float, batches: bool = True) -> bool:
        """Wait up to `timeout_s` for a live batch (batches=False: only sleep) or an
        interrupt(); whether a batch is there to read."""
        poller = self._poller if batches else self._pipe_only
        # Whole milliseconds, rounded up: rounded down, the last one would spin.
        ready = dict(poller.poll(max(0, math.ceil(timeout_s * 1000))))
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        return self._sub in ready

    def interrupt(self) -> None:
        """Make the wait() in progress (or the next one) return now; any thread."""
        if self._wake_w < 0:
            return  # closed: a number that another file may have been given since
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    def recv_nowait(self) -> Frame | None:
        """The next live batch if one is there, else None. BadFrames for a malformed one."""
        try:
            frames = self._sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        if len(frames) != 3:
            raise BadFrames(f"{len(frames)} frames, not 3 (topic, seq, payload)")
        try:
            return Frame(seq_from_bytes(frames[1]), frames[2])
        except ValueError as exc:
            raise BadFrames(str(exc)) from None

    def replay(self, start_seq: int, timeout_s: float) -> list[Frame]:
        """Every batch the publisher still buffers from `start_seq` on, in its order.

        The answer ends with the publisher's end marker; if it does not within `timeout_s`
        the socket is replaced (a late answer must not be read as the next one's) and
        ReplayFailed raised."""
        endpoint = self.replay_endpoint
        if not endpoint:
            raise ReplayFailed("no replay endpoint configured")
        sock = self._replay_socket(endpoint)
        sock.send_multipart((b"", seq_to_bytes(start_seq)))
        deadline = time.monotonic() + timeout_s
        got: list[Frame] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                self._drop_replay_socket()
                raise ReplayFailed(f"no end of replay within {timeout_s:.1f}s "
                                   f"({len(got)} batches so far)")
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]  # the envelope's delimiter
            # (topic, seq, payload) from newer vLLM, (seq, payload) from older.
            if len(frames) == 3:
                frames = frames[1:]
            if len(frames) != 2:
                self._drop_replay_socket()
                raise ReplayFailed(f"a replay answer of {len(frames)} frames")
            try:
                seq = seq_from_bytes(frames[0])
            except ValueError as exc:
                self._drop_replay_socket()
                raise ReplayFailed(f"a replay answer's sequence number: {exc}") from None
            if seq == END_SEQ:
                return got
            got.append(Frame(seq, frames[1]))

    def _replay_socket(self, endpoint: str) -> zmq.Socket:
        if self._replay is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._replay = sock
        return self._replay

    def _drop_replay_socket(self) -> None:
        if self._replay is not None:
            self._replay.close(0)
            self._replay = None

    def close(self) -> None:
        """Idempotent."""
        if self._sub.closed:
            return
        self._drop_replay_socket()
        self._sub.close(0)
        wake_r, wake_w = self._wake_r, self._wake_w
        self._wake_r = self._wake_w = -1  # interrupt() from now on writes nothing
        for fd in (wake_r, wake_w):
            os.close(fd)
