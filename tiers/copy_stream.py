"""Block copies between the KV pool and host memory on a stream of their own, ordered by events.

The forward passes run on the device's current ("compute") stream; copies to and from the
DRAM tier run on a second stream, so a reload overlaps other requests' forward passes. The two
streams are ordered only where they share memory:

- a copy that reads pool blocks first waits for the compute issued so far (`wait_compute`:
  the step that wrote them), and compute that later overwrites those blocks waits for the
  copy (`order_compute`);
- compute that reads blocks a copy wrote waits for the copy's event (`order_compute`);
- the CPU touches host memory a copy reads or writes only once the copy's event has
  completed (`CopyEvent.synchronize`): the DRAM tier keeps each slot's last event for that.

Work on one copy stream runs in submission order, so two copies sharing a staging buffer or
a slot need no event between them. `CudaCopyStream` is the real stream; the tests run the same
code on CPU tensors through a stream that defers its work (tests/unit/fake_copy_stream.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class CopyEvent(Protocol):
    def query(self) -> bool:
        """True once everything submitted before the event has run (never blocks)."""

    def synchronize(self) -> None:
        """Block the calling thread until the event has completed."""


class CopyStream(ABC):
    device: torch.device  # the pool's device
    pin_memory: bool  # host buffers this stream copies should be pinned (async DMA)

    @abstractmethod
    def submit(self, work: Callable[[], None]) -> None:
        """Run tensor work on the copy stream, after everything submitted before it."""

    @abstractmethod
    def record(self) -> CopyEvent:
        """An event that completes once all work submitted so far has run."""

    @abstractmethod
    def wait_compute(self) -> None:
        """Work submitted from now on waits for the compute issued so far."""

    @abstractmethod
    def order_compute(self, event: CopyEvent) -> None:
        """Compute issued from now on waits for `event` (the CPU does not block)."""

    def elapsed_s(self, start: CopyEvent, end: CopyEvent) -> float:
        """Seconds between two completed events of this stream (0.0 where unknown)."""
        return 0.0

    def synchronize(self) -> None:
        """Block until everything submitted so far has run."""
        self.record().synchronize()


def _cuda_event(event: CopyEvent) -> torch.cuda.Event:
    """`event` as the CUDA event it is: a CUDA stream is only handed events it recorded."""
    if not isinstance(event, torch.cuda.Event):
        raise TypeError(f"a CUDA copy stream orders CUDA events, not {type(event).__name__}")
    return event


class CudaCopyStream(CopyStream):
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaCopyStream needs a CUDA device, got {self.device}")
        self.pin_memory = True
        self.stream = torch.cuda.Stream(self.device)

    def submit(self, work: Callable[[], None]) -> None:
        # Tensors `work` allocates belong to this stream's pool in the caching allocator, so
        # their memory is only reused by later work on this same stream (in order).
        with torch.cuda.stream(self.stream):
            work()

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def wait_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def order_compute(self, event: CopyEvent) -> None:
        torch.cuda.current_stream(self.device).wait_event(_cuda_event(event))

    def elapsed_s(self, start: CopyEvent, end: CopyEvent) -> float:
        ms: float = _cuda_event(start).elapsed_time(_cuda_event(end))  # (torch: unannotated)
        return ms / 1e3


def contiguous_runs(values: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive integers in an ascending sequence: (index of the run's first
    element, its first value, its length). One host copy moves each run."""
    runs: list[tuple[int, int, int]] = []
    for i, v in enumerate(values):
        if runs:
            first_i, first_v, n = runs[-1]
            if v == first_v + n:
                runs[-1] = (first_i, first_v, n + 1)
                continue
        runs.append((i, v, 1))
    return runs
