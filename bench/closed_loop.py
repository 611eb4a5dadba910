"""Closed-loop load for the fault benchmarks: `concurrency` threads, each on its own channel to
`address`, each making one call after another (`one_call(stub, i)`, i counting the thread's
calls strided by the thread count, so the threads walk the work list between them) until
stopped or `max_calls` results are in."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc

from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

T = TypeVar("T")


class ClosedLoop(Generic[T]):
    def __init__(self, address: str, concurrency: int, max_calls: int,
                 one_call: Callable[[Any, int], T]) -> None:
        self.address = address
        self.concurrency = concurrency
        self.max_calls = max_calls
        self.one_call = one_call
        self.results: list[T] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(self.concurrency)]
        for t in self._threads:
            t.start()

    def _run(self, worker: int) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            i = worker
            while not self._stop.is_set() and len(self.results) < self.max_calls:
                result = self.one_call(stub, i)
                i += self.concurrency
                with self._lock:
                    self.results.append(result)

    def stop(self, join_s: float) -> tuple[list[T], int]:
        """(the results, threads still inside a call `join_s` after the stop)."""
        self._stop.set()
        for t in self._threads:
            t.join(join_s)
        return list(self.results), sum(t.is_alive() for t in self._threads)
