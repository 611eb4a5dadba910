"""Session affinity: a conversation (`session_id`) stays on the pod that served its last turn
while that pod is not saturated.

The index knows a session's blocks only once the pod has published them (a lease renewal
later for a turn's output) and forgets them when they are evicted; the pod keeps a session's
blocks for its idle time (`--session-idle-s`, proto/retention.py) whatever the index says,
so the router sends the next turn back there. A pod is saturated when it has
`--session-max-waiting` requests or more waiting (published load): the turn then goes where
the scores send it, and the session follows it there. Keys are the cache salt and the
session id together: two tenants' equal ids are two sessions.

Bounded: at most `max_sessions` are remembered (least recently used dropped first), each for
`idle_s` after its last turn.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

KEPT = "kept"  # the turn went to its session's pod
MOVED = "moved"  # its pod was saturated or gone: the scores chose another
NEW = "new"  # the first turn the router sees
OUTCOMES = (KEPT, MOVED, NEW)


class SessionAffinity:
    def __init__(self, idle_s: float, max_waiting: int, max_sessions: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self.max_waiting = max_waiting
        self.max_sessions = max_sessions
        self._clock = clock
        self._pods: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pods)

    @staticmethod
    def key(cache_salt: str, session_id: str) -> tuple[str, str] | None:
        return (cache_salt, session_id) if session_id else None

    def pod_of(self, key: tuple[str, str]) -> str | None:
        """The pod of the session's last turn, while its idle time runs."""
        entry = self._pods.get(key)
        if entry is None:
            return None
        pod_id, seen = entry
        if self._clock() - seen > self.idle_s:
            del self._pods[key]
            return None
        return pod_id

    def saturated(self, waiting: int) -> bool:
        return waiting >= self.max_waiting

    def record(self, key: tuple[str, str], pod_id: str) -> None:
        """A turn of the session went to `pod_id`."""
        self._pods[key] = (pod_id, self._clock())
        self._pods.move_to_end(key)
        while len(self._pods) > self.max_sessions:
            self._pods.popitem(last=False)
