"""Cold placement: where a prompt goes when no pod holds any of its prefix (pure functions).

`scoring.rank` breaks cost ties by the pods' recent routing share, then the freer pool. For a
cold prompt that turns a momentary figure into a lasting choice: the prompt's siblings follow
it. A pod that just restarted has the smallest share (its peers still serve their own prefixes'
siblings) and the freest pool, so it took every new prefix (issue #19: 48 of 48 with two pods).

`--cold-placement hash` (the default) puts a cold prompt instead on the pod with the highest
rendezvous weight hash(first block, pod id) among the pods in the load band:

* the same first block picks the same pod on every router, so its siblings meet there even
  before the index or the burst prediction knows;
* different prefixes spread evenly, whatever each pod's share or pool; a pod that leaves moves
  only the prefixes it had.

The load band: the pods as fast as the cost winner (cost without the queue within the tie
tolerance of its own: a slower pod is not spread onto), and of those the ones whose queue is at
most max(1, 25%) above the shortest. Pods outside it follow in rank's order, so a busy pod is
never a cold prompt's first choice. `least_loaded` keeps rank's order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from pagekv.router.scoring import REASON_COLD_SPREAD, CostModel, Score

COLD_PLACEMENTS = ("hash", "least_loaded")
BAND_QUEUE_SLACK = 1      # requests a band member's queue may exceed the shortest by ...
BAND_QUEUE_REL = 0.25     # ... or this fraction of the shortest, if more


def is_cold(order: Sequence[Score]) -> bool:
    """No pod holds (or is predicted to hold) any of the prompt, and none would pull it."""
    return all(s.cached_tokens == 0 and not s.pull_from for s in order)


def load_band(order: Sequence[Score], costs: CostModel) -> list[Score]:
    """The pods of `order` (rank's: eligible, best first) that a cold prompt may be spread on."""
    if not order:
        return []
    work = order[0].cost_s - order[0].queue_s
    limit = work + max(costs.tie_abs_s, costs.tie_rel * work)
    fast = [s for s in order if s.cost_s - s.queue_s <= limit]
    shortest = min(s.queue for s in fast)
    room = shortest + max(BAND_QUEUE_SLACK, BAND_QUEUE_REL * shortest)
    return [s for s in fast if s.queue <= room]


def rendezvous_weight(key: bytes, pod_id: str) -> int:
    # Length-prefixed, so no (key, pod id) pair reads as another.
    data = len(key).to_bytes(4, "big") + key + pod_id.encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def place_cold(order: list[Score], reason: str, costs: CostModel, key: bytes | None
               ) -> tuple[list[Score], str]:
    """Rank's order and reason, with a cold prompt's load band first by rendezvous weight of
    `key` (its first block's hash). Anything else (a hit somewhere, no key, a band of one pod)
    comes back as it was."""
    if not key or len(order) < 2 or not is_cold(order):
        return order, reason
    band = load_band(order, costs)
    if len(band) < 2:
        return order, reason
    band.sort(key=lambda s: (rendezvous_weight(key, s.pod_id), s.pod_id), reverse=True)
    chosen = {s.pod_id for s in band}
    return band + [s for s in order if s.pod_id not in chosen], REASON_COLD_SPREAD


def load_spread(requests_per_pod: Iterable[int]) -> float:
    """max / mean of the requests each pod got (1.0: perfectly even); count idle pods as 0.

    No requests at all: 1.0, nothing was uneven."""
    counts = list(requests_per_pod)
    if not counts:
        raise ValueError("load_spread needs at least one pod")
    if any(c < 0 for c in counts):
        raise ValueError(f"request counts must be >= 0, got {counts}")
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0
