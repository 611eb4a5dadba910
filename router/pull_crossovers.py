"""The pull crossovers the router applies, as a metric and a debug line.

For a pod C and a peer H, the crossover is the token delta above which C pulling from H
beats recomputing (router/scoring.py `pull_crossover`, from what C measured pulling from H).
It is exported as it moves rather than per request: at most once per `interval_s` (the
pods' figures change with their lease renewals, no faster), when the router's fleet view is
rebuilt. Exported are the pairs C measured (peer = H) and, per pod, the crossover of any
peer it has not measured (peer = `ANY_PEER`: its single peer figure or the configured one):
every pair of a 1,024-pod fleet would be a million series. A pair whose pod is gone leaves
the metric; a crossover that moved by more than `LOG_CHANGE` is logged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from prometheus_client import Gauge

from pagekv.router.scoring import Candidate, CostModel, pull_cost, pull_crossover

logger = logging.getLogger(__name__)

LOG_CHANGE = 0.1  # a relative move of the crossover worth a debug line
ANY_PEER = "*"    # the `peer` label of a pod's crossover from any peer it has not measured


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
        present = {c.pod_id for c in pullers}
        pairs = {(c.pod_id, h): pull_crossover(c, h, costs)
                 for c in pullers for h in c.pull_costs if h in present and h != c.pod_id}
        pairs.update({(c.pod_id, ANY_PEER): pull_crossover(c, ANY_PEER, costs)
                      for c in pullers})
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
