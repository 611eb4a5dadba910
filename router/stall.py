"""The progress bound of a pod call: how long the router waits for a pod's next chunk.

A pod that stops (SIGSTOPped, its host frozen, its engine wedged) keeps its TCP connection
open, so a call on it would wait out the client's whole deadline. The router bounds each
wait instead: the first chunk within `floor_s + factor x` the pod's estimated TTFT for this
prompt (the score's cost_s: its uncached tokens at the pod's published prefill seconds per
token, its reloads and its queue), at most `cap_s`; each later chunk within the same bound
(a step may carry another request's prefill chunk, as long as this prompt's). Before the
first chunk the call is moved to the next-best pod (router/server.py); after it the tokens
sent cannot be taken back, and the call ends with UNAVAILABLE naming the stall.

A unary call has no chunks to watch: its bound is the first chunk's plus `factor x` its
max_tokens steps at the pod's step time as this router measured it (a completed call's time
over its steps, prefill included: never too short), or, before any measurement, the first
chunk's bound once more per step (a backstop only); unbounded without max_tokens. The
channels' keepalive (router/pods.py) notices a stopped pod or a dead peer either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_COOLDOWN_CAP_S = 30.0  # however many stalls in a row: a pod is tried first again by then


@dataclass(frozen=True, slots=True)
class StallBound:
    floor_s: float   # 0: no bound (the client's deadline only)
    factor: float
    cap_s: float
    cooldown_s: float  # a stalled pod is tried last this long, doubled per stall in a row

    @property
    def active(self) -> bool:
        return self.floor_s > 0

    def chunk_s(self, estimated_ttft_s: float) -> float | None:
        """Seconds to wait for the first (or next) chunk; None: unbounded."""
        if not self.active:
            return None
        if not math.isfinite(estimated_ttft_s) or estimated_ttft_s < 0:
            return max(self.floor_s, self.cap_s)
        return min(max(self.floor_s, self.cap_s),
                   self.floor_s + self.factor * estimated_ttft_s)

    def unary_s(self, estimated_ttft_s: float, max_tokens: int | None, step_s: float
                ) -> float | None:
        """Seconds for a whole unary call of up to `max_tokens` steps, `step_s` each as
        measured (0: not yet); None: unbounded."""
        first = self.chunk_s(estimated_ttft_s)
        if first is None or not max_tokens:
            return None
        if step_s <= 0 or not math.isfinite(step_s):
            return first * (1 + max_tokens)
        return first + self.factor * max_tokens * step_s

    def cooldown_after(self, stalls_in_a_row: int) -> float:
        return min(_COOLDOWN_CAP_S, self.cooldown_s * 2.0 ** max(0, stalls_in_a_row - 1))
