"""Pairs (pod, name) seen recently: the router's prediction that a LoRA adapter it just sent
to a pod is resident there before the pod's registration says so (router/routing.py).

Bounded: past `MAX_PAIRS` the expired ones are dropped, then the oldest.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

MAX_PAIRS = 65_536


class RecentPairs:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._until)

    def record(self, pod_id: str, name: str) -> None:
        key = (pod_id, name)
        self._until[key] = self._clock() + self.ttl_s
        self._until.move_to_end(key)
        if len(self._until) > MAX_PAIRS:
            now = self._clock()
            while self._until and (len(self._until) > MAX_PAIRS
                                   or next(iter(self._until.values())) <= now):
                self._until.popitem(last=False)

    def recent(self, pod_id: str, name: str) -> bool:
        until = self._until.get((pod_id, name))
        return until is not None and until > self._clock()
