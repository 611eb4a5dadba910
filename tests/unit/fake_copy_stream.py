"""A CPU stand-in for the CUDA copy stream (tiers.copy_stream) that really is asynchronous.

Submitted work does not run when submitted: it runs, in order, only when an event recorded
after it is synchronized, or has been queried `lag` times (a copy that finishes a few engine
steps later). So a reader that skips the event sees the memory as it was before the copy —
stale slots, stale pool blocks — and the tests that use this stream fail on a missing wait,
which an eager CPU copy would hide. "Compute" (plain CPU torch ops) runs at once, so a
compute-side wait on an event (`order_compute`) runs the work up to that event right there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from pagekv.tiers.copy_stream import CopyStream


class FakeEvent:
    def __init__(self, stream: FakeCopyStream, upto: int) -> None:
        self.stream = stream
        self.upto = upto  # the number of submitted jobs this event follows
        self.queries = 0

    def query(self) -> bool:
        s = self.stream
        with s.lock:
            if s.ran >= self.upto:
                return True
            self.queries += 1
            if self.queries > s.lag:
                s.run_until(self.upto)
                return True
            return False

    def synchronize(self) -> None:
        self.stream.run_until(self.upto)
        self.stream.syncs += 1


class FakeCopyStream(CopyStream):
    def __init__(self, lag: int = 2, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.pin_memory = False
        self.lag = lag
        self.lock = threading.RLock()  # the loader thread may settle a slot meanwhile
        self.jobs: list[Callable[[], None]] = []
        self.ran = 0
        self.syncs = 0  # CPU waits (event.synchronize calls)
        self.compute_waits = 0

    def submit(self, work: Callable[[], None]) -> None:
        with self.lock:
            self.jobs.append(work)

    def record(self) -> FakeEvent:
        with self.lock:
            return FakeEvent(self, len(self.jobs))

    def wait_compute(self) -> None:
        return None  # compute already ran (CPU ops are eager)

    def order_compute(self, event) -> None:
        self.compute_waits += 1
        self.run_until(event.upto)

    @property
    def pending(self) -> int:
        with self.lock:
            return len(self.jobs) - self.ran

    def run_until(self, upto: int) -> None:
        with self.lock:
            while self.ran < upto:
                job = self.jobs[self.ran]
                self.ran += 1
                job()

    def drain(self) -> None:
        with self.lock:
            self.run_until(len(self.jobs))
