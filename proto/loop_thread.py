"""An asyncio event loop running in a daemon thread of its own.

Blocking code (a Ray actor's methods, the SSD tier's callers) hands coroutines to the loop and
waits for their results, while the loop keeps serving whatever else lives on it (gRPC servers,
the SSD tier's writer). Torch-free: pods, tiers and deploy code all use it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Start a loop in a daemon thread; run coroutines on it; stop it and join the thread."""

    def __init__(self, name: str, executor: Executor | None = None) -> None:
        """`executor`, when given, becomes the loop's default one (`run_in_executor(None, ...)`);
        closing the loop shuts it down without waiting."""
        self.loop = asyncio.new_event_loop()
        if executor is not None:
            self.loop.set_default_executor(executor)
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule a coroutine on the loop from any thread; its result as a concurrent future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result (TimeoutError after `timeout`)."""
        if self.in_loop_thread():
            coro.close()  # waiting here for the loop would wait for ourselves forever
            raise RuntimeError(f"{self.thread.name}: blocking call from the loop's own thread")
        return self.submit(coro).result(timeout)

    def call_soon(self, callback: Callable[..., object], *args: object) -> None:
        """Call `callback(*args)` on the loop thread (safe from any thread)."""
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self, timeout: float | None = 5.0) -> bool:
        """Stop the loop and join its thread; the loop is closed once the thread has ended.
        True if it ended within `timeout`. Idempotent."""
        if self.loop.is_closed():
            return True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if self.thread.is_alive():
            return False
        self.loop.close()
        return True
