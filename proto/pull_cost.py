"""What a pull from one peer costs a pod: a fixed part and a part per token (seconds).

The puller pod fits it from its own complete pulls (kvnode/engine/pull_costs.py) and
publishes it per holder in its cost map, as two `cost.` fields per peer:

    cost.peer.<holder pod id>        seconds per token pulled from that holder
    cost.peer_fixed.<holder pod id>  seconds per pull, whatever its length

A router before these fields reads them as two more tier costs it never looks up, so they
are ignored there; this one reads them back (proto/index/pod_record.py) and prices a pull
from that holder with them (router/scoring.py). The pod's single `cost.peer` stays too.

The crossover is the token delta above which pulling beats recomputing on the puller:
fixed + n x per_token < n x prefill, i.e. n > fixed / (prefill - per_token); never (inf)
when a pulled token is no cheaper than a recomputed one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PER_TOKEN_PREFIX = "peer."      # the cost-map key of a holder's s/token: "peer.<pod id>"
FIXED_PREFIX = "peer_fixed."    # and of its fixed seconds per pull: "peer_fixed.<pod id>"


@dataclass(frozen=True, slots=True)
class PullCost:
    fixed_s: float       # seconds per pull: the round trip, setup, landing's fixed work
    per_token_s: float   # seconds per token moved and landed

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + tokens * self.per_token_s

    def crossover_tokens(self, prefill_per_token: float) -> float:
        """The token delta above which this pull is cheaper than recomputing those tokens at
        `prefill_per_token` (inf: never)."""
        saving = prefill_per_token - self.per_token_s
        if saving <= 0:
            return math.inf
        return self.fixed_s / saving

    def cost_fields(self, holder: str) -> dict[str, float]:
        """The two cost-map entries that publish this cost for `holder`."""
        return {PER_TOKEN_PREFIX + holder: self.per_token_s, FIXED_PREFIX + holder: self.fixed_s}
