"""Records read from the index that do not parse: counted per reason, warned about rarely.

Anyone who can write to Redis can leave garbage in a key the index reads (a NaN load, a tier
letter no pod writes, a key of the wrong type). One bad record must cost only itself: the
reader skips it (a pod's load unknown, a claim ignored) and tells `BadRecords`, which counts
it, hands the reason to a listener (the router's metric) and logs one warning per reason per
`warn_every_s`, so a key rewritten on every lease renewal cannot flood the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# The reasons (a metric label: a small fixed set).
BAD_LOAD = "bad_load"                  # load.<k> not a finite count (nan, inf, 1e308, -1, "x")
BAD_COST = "bad_cost"                  # cost.<k> not a finite positive seconds-per-token
BAD_REGISTRATION = "bad_registration"  # a pod HASH without a usable address, kind or field
BAD_CLAIM = "bad_claim"                # a claim value with a tier letter no pod writes
BAD_PREDICTION = "bad_prediction"      # an r: entry whose expiry is not a number
WRONG_TYPE = "wrong_type"              # a key of the wrong Redis type (WRONGTYPE)
BAD_ENCODING = "bad_encoding"          # bytes that are not UTF-8 where text is expected
BAD_REPLY = "bad_reply"                # a script reply of the wrong shape
REASONS = (BAD_LOAD, BAD_COST, BAD_REGISTRATION, BAD_CLAIM, BAD_PREDICTION, WRONG_TYPE,
           BAD_ENCODING, BAD_REPLY)

WARN_EVERY_S = 60.0


class BadRecords:
    """Per-reason counts of skipped records; `listener(reason, n)` is told of each."""

    def __init__(self, listener: Callable[[str, int], None] | None = None,
                 warn_every_s: float = WARN_EVERY_S) -> None:
        self.listener = listener
        self.warn_every_s = warn_every_s
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._warned_at: dict[str, float] = {}

    def note(self, reason: str, detail: str, n: int = 1) -> None:
        """`n` records skipped for `reason`; `detail` (which key, which value) is logged
        with the first one of each `warn_every_s`."""
        if n <= 0:
            return
        self.counts[reason] = self.counts.get(reason, 0) + n
        if self.listener is not None:
            self.listener(reason, n)
        now = time.monotonic()
        last = self._warned_at.get(reason)
        if last is None or now - last >= self.warn_every_s:
            self._warned_at[reason] = now
            logger.warning("redis index: skipped a bad record (%s): %s; it is ignored, the "
                           "rest of the index is used (next warning for this reason in %.0fs "
                           "at the earliest)", reason, detail[:300], self.warn_every_s)


# For readers that were given none (a pod's or a tool's synchronous reads): still warned.
UNCOUNTED = BadRecords()
