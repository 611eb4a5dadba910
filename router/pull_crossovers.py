"""The pull crossover of every pod pair, as a metric and a debug line.

For a pod C and a peer H, the crossover is the token delta above which C pulling from H
beats recomputing (router/scoring.py `pull_crossover`, from what C measured pulling from H).
It is what the scorer applies to every request, so it is exported as it moves rather than
per request: at most once per `interval_s` (the pods' figures change with their lease
renewals, no faster), over the candidates of the request that comes then. A pair whose pod
is gone leaves the metric; a crossover that moved by more than `LOG_CHANGE` is logged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from prometheus_client import Gauge

from pagekv.router.scoring import Candidate, CostModel, pull_cost, pull_crossover

logger = logging.getLogger(__name__)

LOG_CHANGE = 0.1  # a relative move of the crossover worth a debug line


class PullCrossovers:
    def __init__(self, gauge: Gauge, interval_s: float) -> None:
        self.gauge = gauge  # labels pod, peer
        self.interval_s = interval_s
        self.values: dict[tuple[str, str], float] = {}  # (pod, peer) -> as exported
        self._next_at = -math.inf

    def update(self, cands: Sequence[Candidate], costs: CostModel, now: float) -> None:
        """Export the crossovers of the pairs among `cands` (monotonic `now`), if due."""
        if now < self._next_at:
            return
        self._next_at = now + self.interval_s
        pullers = [c for c in cands if c.eligible and c.can_pull]
        pairs = {(c.pod_id, h.pod_id): pull_crossover(c, h.pod_id, costs)
                 for c in pullers for h in pullers if h.pod_id != c.pod_id}
        for gone in self.values.keys() - pairs.keys():
            self.gauge.remove(*gone)
            del self.values[gone]
        by_id = {c.pod_id: c for c in pullers}
        for (pod, peer), tokens in pairs.items():
            self.gauge.labels(pod=pod, peer=peer).set(tokens)
            before = self.values.get((pod, peer))
            self.values[(pod, peer)] = tokens
            if before is None or _moved(before, tokens):
                self._log(by_id[pod], peer, tokens, costs)

    @staticmethod
    def _log(c: Candidate, peer: str, tokens: float, costs: CostModel) -> None:
        cost = pull_cost(c, peer, costs)
        origin = ("measured" if peer in c.pull_costs else
                  "the pod's single figure" if "peer" in c.published_costs else "configured")
        logger.debug("pull crossover %s <- %s: %s tokens (%s: %.4f s + %.3g s/token; prefill "
                     "%.3g s/token; floor %d)", c.pod_id, peer,
                     "never" if math.isinf(tokens) else f"{tokens:.0f}", origin, cost.fixed_s,
                     cost.per_token_s, c.published_costs.get("prefill", costs.prefill_per_token),
                     costs.pull_min_token_delta)


def _moved(before: float, after: float) -> bool:
    if math.isinf(before) or math.isinf(after):
        return before != after
    return abs(after - before) > LOG_CHANGE * max(before, after, 1.0)
