"""How long a client waits before its next reconnect try: capped exponential backoff with
full jitter, `uniform(0, min(cap, start * 2**retry))` for the retry-th wait in a row.

Jitter, because clients that lost their server together (every pod of a fleet when Redis
restarts) would otherwise retry in lockstep and hit it all at the same instants. Full jitter
rather than decorrelated jitter (`min(cap, uniform(start, 3 * previous))`): once the growing
range passes the cap, decorrelated jitter clamps most draws to exactly the cap, so a long
outage turns a fleet's retries back into one period; full jitter keeps them uniform over
[0, cap] however long it lasts. The cap stays a hard upper bound, and no wait is longer than
the plain exponential one it replaces.
"""

from __future__ import annotations

import random

# 2**64 times any sensible start is far past any cap; bounding the exponent keeps the float
# finite however long an outage lasts.
_MAX_DOUBLINGS = 64


def jittered_backoff_s(retry: int, start_s: float, cap_s: float,
                       rng: random.Random | None = None) -> float:
    """Seconds to wait before the next try; `retry` counts the waits since the last success
    (0: the first one, at most `start_s`)."""
    if retry < 0 or start_s <= 0 or cap_s < start_s:
        raise ValueError(f"need retry >= 0 and 0 < start_s <= cap_s, got {retry}, {start_s}, "
                         f"{cap_s}")
    ceiling = min(cap_s, start_s * 2.0 ** min(retry, _MAX_DOUBLINGS))
    return (rng or random).uniform(0.0, ceiling)
