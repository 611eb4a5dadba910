"""Two pods' index publishers that lose Redis at the same instant retry at different times
(jittered backoff), and no wait between two tries exceeds the 2 s cap.

Each publisher's "Redis" is a real TCP listener that accepts and closes at once, so every
reconnect try is one accept, timestamped here; both publishers start together.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pagekv.kvnode.index.publisher import IndexPublisher
from tests.integration.index_fixtures import SCHEMA

pytestmark = pytest.mark.integration

CAP_S = 2.0  # the publisher's backoff cap (kvnode/index/publisher.py)
WATCH_S = 6.0  # long enough for the waits to reach the cap: 0.05 * 2**6 > 2


class ClosingListener:
    """A port that takes each connection and drops it: Redis, down for every try."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.tries: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.tries.append(time.monotonic())
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def listeners() -> Iterator[list[ClosingListener]]:
    pair = [ClosingListener(), ClosingListener()]
    yield pair
    for listener in pair:
        listener.close()


def publisher(listener: ClosingListener, pod_id: str) -> IndexPublisher:
    return IndexPublisher(f"redis://127.0.0.1:{listener.port}/0", SCHEMA, pod_id,
                          f"{pod_id}:50051", hash_config=SCHEMA.hash_config(),
                          load_fn=dict, full_state_fn=dict, socket_timeout_s=0.5)


def test_two_publishers_that_lost_redis_together_retry_apart_under_the_cap(
        listeners: list[ClosingListener]) -> None:
    pubs = [publisher(listener, f"pod-{i}") for i, listener in enumerate(listeners)]
    try:
        for pub in pubs:  # together, as pods whose Redis went away at the same moment
            assert pub.start(timeout=0.0) is False
        time.sleep(WATCH_S)
    finally:
        for pub in pubs:
            pub.stop(clear=False, timeout=3)
    a, b = (listener.tries for listener in listeners)
    assert len(a) >= 5 and len(b) >= 5, (len(a), len(b))
    for tries in (a, b):
        gaps = [t1 - t0 for t0, t1 in zip(tries, tries[1:], strict=False)]
        # The cap holds (plus a failed connect's own time on a loaded machine).
        assert max(gaps) <= CAP_S + 0.3, gaps
    # In lockstep, the k-th tries of both would be within a few ms of each other for every
    # k; jittered, they drift apart by hundreds of ms within a few tries.
    apart = [abs(ta - tb) for ta, tb in zip(a[3:], b[3:], strict=False)]
    assert max(apart) > 0.1, apart
