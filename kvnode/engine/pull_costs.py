"""What a pull costs this pod, per holder pod: seconds = fixed + tokens x per_token, fitted
online from this pod's own complete pulls, and published in its cost map for the router.

One figure for every peer (PullStats' median s/token) hides what differs between them: a
holder across a slow link, or a busy one, costs more per token than one on the same host,
and a short pull is dominated by its fixed part (the round trip, setup, landing's fixed
work), which a figure per token alone spreads over the tokens. So per holder this keeps its
last `window` complete pulls (tokens landed, seconds from the request's admission to the
blocks landed) and fits a line through them with the Theil-Sen estimator: the slope is the
median of the pairwise slopes, the intercept the median residual. Medians, because one pull
that waited behind a garbage collection, or for a worker, must not move the figure; a
window, because links and loads change.

A failed or partial pull never enters the fit: it stopped early, so its seconds over the
tokens that landed say nothing of the peer's speed and, when it failed fast, would make the
peer look fast. (How often a peer fails is the fallback counters' business, not its price.)

Where the line is not identifiable (fewer than MIN_LINE_POINTS pulls, or all of about one
length, or a slope or intercept that noise made negative) the fit is the line through zero
at the median seconds per token: the old single figure's meaning, all-in per token.

Bounded memory: `window` pulls for each of at most `max_peers` holders, the least recently
pulled from forgotten first. Thread-safe: pulls are noted on the engine thread and the cost
map is read by the index publisher's.
"""

from __future__ import annotations

import statistics
import threading
from collections import OrderedDict, deque

from pagekv.kvnode.engine.peer_pull import PullResult
from pagekv.proto.index.pod_record import MAX_COST_S_PER_TOKEN, MAX_PULL_FIXED_S
from pagekv.proto.pull_cost import PullCost

MIN_LINE_POINTS = 3   # fewer complete pulls: the line through zero
# Pairs of pulls whose lengths differ by less than this share of the longest one carry no
# slope worth the noise (two pulls of one prefix differ only in their timing).
MIN_LENGTH_SPREAD = 0.25
# A fit beyond what the index parser accepts is clamped to it, so the figure is published
# at the most the router believes instead of being refused.
MAX_FIXED_S = MAX_PULL_FIXED_S
MAX_PER_TOKEN_S = MAX_COST_S_PER_TOKEN
MIN_PER_TOKEN_S = 1e-12  # a pull is never free (the router refuses a published 0)


class PeerPullCosts:
    def __init__(self, window: int = 32, max_peers: int = 64) -> None:
        if window < 1 or max_peers < 1:
            raise ValueError(f"window and max_peers must be >= 1, got {window}, {max_peers}")
        self.window = window
        self.max_peers = max_peers
        self._pulls: OrderedDict[str, deque[tuple[int, float]]] = OrderedDict()
        self._fits: dict[str, PullCost] = {}  # holder -> its fit, until its next pull
        self._lock = threading.Lock()

    # -- what is measured ---------------------------------------------------------------------
    def observe(self, result: PullResult) -> None:
        """A PeerPuller observer: each finished pull; only complete ones are measured."""
        if result.failure is None:
            self.note(result.source_pod, result.tokens, result.seconds)

    def note(self, holder: str, tokens: int, seconds: float) -> None:
        """One complete pull of `tokens` from `holder` that took `seconds`."""
        if not holder or tokens <= 0 or not 0 <= seconds < float("inf"):
            return
        with self._lock:
            pulls = self._pulls.get(holder)
            if pulls is None:
                pulls = self._pulls[holder] = deque(maxlen=self.window)
                while len(self._pulls) > self.max_peers:
                    gone, _ = self._pulls.popitem(last=False)
                    self._fits.pop(gone, None)
            self._pulls.move_to_end(holder)
            pulls.append((tokens, seconds))
            self._fits.pop(holder, None)

    # -- what is published --------------------------------------------------------------------
    def cost(self, holder: str) -> PullCost | None:
        with self._lock:
            return self._cost(holder)

    def costs(self) -> dict[str, PullCost]:
        with self._lock:
            return {holder: cost for holder in self._pulls
                    if (cost := self._cost(holder)) is not None}

    def all_in_s_per_token(self) -> float | None:
        """The median over holders of each one's median seconds per token: the single
        `peer` figure, for routers that price a pull per token only."""
        with self._lock:
            per_holder = [statistics.median(s / t for t, s in pulls)
                          for pulls in self._pulls.values() if pulls]
        return statistics.median(per_holder) if per_holder else None

    def cost_map(self) -> dict[str, float]:
        """The cost-map entries: `peer` (all-in, as before) and each holder's two figures."""
        out: dict[str, float] = {}
        peer = self.all_in_s_per_token()
        if peer is not None:
            out["peer"] = max(MIN_PER_TOKEN_S, min(MAX_PER_TOKEN_S, peer))
        for holder, cost in self.costs().items():
            out.update(cost.cost_fields(holder))
        return out

    def _cost(self, holder: str) -> PullCost | None:
        fit = self._fits.get(holder)
        if fit is None:
            pulls = self._pulls.get(holder)
            if not pulls:
                return None
            fixed, per_token = fit_line(list(pulls))
            fit = self._fits[holder] = PullCost(
                min(MAX_FIXED_S, fixed), max(MIN_PER_TOKEN_S, min(MAX_PER_TOKEN_S, per_token)))
        return fit


def fit_line(pulls: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed s, s per token) of the Theil-Sen line through (tokens, seconds), or of the line
    through zero at the median s/token where no line with both parts >= 0 is identifiable."""
    through_zero = (0.0, statistics.median(s / t for t, s in pulls))
    if len(pulls) < MIN_LINE_POINTS:
        return through_zero
    spread = MIN_LENGTH_SPREAD * max(t for t, _ in pulls)
    slopes = [(s2 - s1) / (t2 - t1)
              for i, (t1, s1) in enumerate(pulls) for t2, s2 in pulls[i + 1:]
              if abs(t2 - t1) >= spread]
    if not slopes:
        return through_zero
    per_token = statistics.median(slopes)
    if per_token <= 0:
        return through_zero
    fixed = statistics.median(s - per_token * t for t, s in pulls)
    if fixed < 0:
        return through_zero
    return fixed, per_token
