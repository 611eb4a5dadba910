"""Helpers of the vLLM ingest tests (test_vllm_ingest*.py): a publisher in vLLM's format that
the test scripts batch by batch (which go out live, which the replay socket still has,
garbage), a real hash chain to publish, and reading one pod's claims out of Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pagekv.proto.hashing import DEFAULT_HASH_SEED, HashConfig, hash_prompt
from pagekv.proto.index import IndexSchema
from pagekv.proto.medium import mask_codes
from pagekv.proto.vllm_events import (
    END_SEQ,
    WireEvent,
    encode_batch,
    seq_from_bytes,
    seq_to_bytes,
)
from tests.integration.index_fixtures import claim_id_of, claims_by_id

# The router's defaults, and a real pagekv-tiny pod's: the tests route over what they ingest.
SCHEMA = IndexSchema("pagekv-tiny", 16, "sha256", DEFAULT_HASH_SEED)
HASH = HashConfig(SCHEMA.hash_algo, SCHEMA.hash_seed)
TOPIC = "kv-events"


def chain(tokens: list[int]) -> list[bytes]:
    """The full hashes of `tokens`' blocks, as PageKV and vLLM compute them."""
    return hash_prompt(HASH, SCHEMA.block_size, tokens)


def wait_for(check: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what or check}")


class ScriptedPublisher:
    """vLLM's two sockets on loopback, driven by the test: `send` a batch live and/or keep
    it for replay; `send_frames` anything at all. XPUB instead of PUB so that a test can wait
    for the subscriber to be there (a PUB drops what it sends before that)."""

    def __init__(self, topic: str = TOPIC, replay_with_topic: bool = True) -> None:
        self.topic = topic.encode()
        self.replay_with_topic = replay_with_topic  # newer vLLM; older sends (seq, payload)
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, bytes] = {}
        self.replay_requests: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def wait_subscriber(self, timeout: float = 10.0) -> None:
        assert self._subscribed.wait(timeout), "no subscriber connected"

    def send(self, seq: int, events: list[WireEvent], *, live: bool = True,
             keep: bool = True, form: str = "map") -> bytes:
        payload = encode_batch(time.time(), events, form)
        if keep:
            with self._lock:
                self.buffer[seq] = payload
        if live:
            self.send_frames([self.topic, seq_to_bytes(seq), payload])
        return payload

    def send_frames(self, frames: list[bytes]) -> None:
        with self._lock:  # the socket is shared with the serving thread
            self.pub.send_multipart(frames)

    def forget(self) -> None:
        """A restarted publisher: nothing left to replay."""
        with self._lock:
            self.buffer.clear()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pub, zmq.POLLIN)
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            with self._lock:
                ready = dict(poller.poll(0))
            if not ready:
                time.sleep(0.005)
                continue
            with self._lock:
                if self.pub in ready:
                    msg = self.pub.recv()
                    if msg[:1] == b"\x01":
                        self._subscribed.set()
                if self.router in ready:
                    self._replay(self.router.recv_multipart())

    def _replay(self, frames: list[bytes]) -> None:
        client, _, start_bytes = frames
        start = seq_from_bytes(start_bytes)
        self.replay_requests.append(start)
        head = [client, b""] + ([self.topic] if self.replay_with_topic else [])
        for seq in sorted(self.buffer):
            if seq >= start:
                self.router.send_multipart([*head, seq_to_bytes(seq), self.buffer[seq]])
        self.router.send_multipart([*head, seq_to_bytes(END_SEQ), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(0)
        self.router.close(0)


def pod_claims(client: Any, schema: IndexSchema, pod_id: str) -> dict[bytes, str]:
    """Every block the pod's registration claims: claim field -> tier codes ("G", "GC"...)
    (tests.integration.index_fixtures.by_field keys an expectation alike)."""
    mine = claims_by_id(client, schema).get(claim_id_of(client, pod_id, schema), {})
    return {field: mask_codes(mask) for field, mask in mine.items()}


def codes(mask: int) -> str:
    return mask_codes(mask)
