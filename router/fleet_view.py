"""What a routing decision needs of the whole fleet, kept between requests.

A decision scores exactly the pods that hold some of the prompt's prefix (the index lookup
returns only those, and the burst predictions name only those) and a few others: the
least-loaded serving pods (`OTHERS`) and any pod measurably faster than the fleet's median
(a fast pod with a queue may still beat an idle slow one). Everything else a score needs of
a pod — its settled prefill speed, its role, the excluded pods' entries — is derived here
once per change of the registry (a refresh, a lease that ran out), and the load order and the
cold-placement ring are kept up to date as calls start and end. So a decision costs the
same with 16 pods as with 1,024.

Skipping the other pods loses nothing: a pod that holds none of the prefix is scored as its
prefill speed and its queue; among pods of one speed (the median band) the least-loaded few
are the best of them, and the faster ones are always scored.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence

from pagekv.proto.index import PodMatch
from pagekv.proto.index.schema import POD_KIND_VLLM
from pagekv.router.cold_ring import ColdRing
from pagekv.router.disaggregation import is_prefill
from pagekv.router.load_order import LoadOrder
from pagekv.router.placement import rendezvous_weight
from pagekv.router.pods import ForeignPod, PodEntry
from pagekv.router.scoring import CostModel, Score, settle_prefill_costs

OTHERS = 2  # least-loaded pods scored besides the holders, per role group; holders alike kept
# A fleet this small is scored whole: a few candidates more, and RoutingInfo.candidates
# shows every pod (what operators of a handful of pods read to see why one was chosen).
SCORE_ALL_PODS = 8


def _pod_id(entry: PodEntry) -> str:
    return entry.pod_id


def _queue(entry: PodEntry) -> int:
    return entry.queue()


class FleetView:
    __slots__ = ("costs", "serving", "prefill", "published", "speeds", "fast", "excluded",
                 "ring", "serving_load", "prefill_load")

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self.serving: dict[str, PodEntry] = {}  # pods that take whole requests
        self.prefill: dict[str, PodEntry] = {}  # prefill pods, while serving pods exist
        self.published: dict[str, Mapping[str, float]] = {}  # costs to score each pod with
        self.speeds: dict[str, float] = {}  # the prefill s/token each pod is scored at
        self.fast: list[PodEntry] = []  # serving pods faster than the median band
        self.excluded: list[Score] = []  # RoutingInfo.candidates' entries of refused pods
        self.ring: ColdRing[PodEntry] = ColdRing(_pod_id)
        self.serving_load: LoadOrder[PodEntry] = LoadOrder(_queue, _pod_id)
        self.prefill_load: LoadOrder[PodEntry] = LoadOrder(_queue, _pod_id)

    def rebuild(self, pods: Mapping[str, PodEntry], foreign: Sequence[ForeignPod]) -> None:
        """After every change of the registry's pods: O(pods), never per request."""
        eligible = [p for p in pods.values() if p.eligible]
        serving = [p for p in eligible if not is_prefill(p)] or eligible
        ids = {p.pod_id for p in serving}
        self.serving = {p.pod_id: p for p in serving}
        self.prefill = {p.pod_id: p for p in eligible if p.pod_id not in ids}
        # A vLLM pod never publishes costs: the configured ones are its, not the peers'
        # median, which only stands in for a PageKV pod that has not measured yet.
        speeds = settle_prefill_costs(
            {p.pod_id: p.info.tier_costs["prefill"] for p in eligible
             if "prefill" in p.info.tier_costs}, self.costs.speed_band,
            [p.pod_id for p in eligible
             if "prefill" not in p.info.tier_costs and p.info.kind != POD_KIND_VLLM])
        self.published = {
            p.pod_id: {**p.info.tier_costs, "prefill": speeds[p.pod_id]}
            if p.pod_id in speeds else p.info.tier_costs for p in eligible}
        self.speeds = {pid: costs.get("prefill", self.costs.prefill_per_token)
                       for pid, costs in self.published.items()}
        serving_speeds = {pid: self.speed(pid) for pid in ids}
        typical = sorted(serving_speeds.values())[len(serving_speeds) // 2] \
            if serving_speeds else self.costs.prefill_per_token
        self.fast = [p for p in serving if serving_speeds[p.pod_id] < typical]
        for entry in eligible:
            entry.on_load = self.touch
        self.serving_load.reset(serving)
        self.prefill_load.reset(self.prefill.values())
        self.ring.update(serving)
        self.excluded = [
            Score(p.pod_id, p.info.address, waiting=p.info.waiting, running=p.info.running,
                  eligible=False, excluded_reason=p.excluded_reason)
            for p in pods.values() if not p.eligible]
        self.excluded += [
            Score(f.pod_id, f.address, eligible=False,
                  excluded_reason=f"registered under index namespace {f.namespace}: "
                                  f"{f.reason} (router vs pod)") for f in foreign]

    def speed(self, pod_id: str) -> float:
        """The prefill s/token a pod is scored at (settled; else the configured figure)."""
        return self.speeds.get(pod_id, self.costs.prefill_per_token)

    def touch(self, entry: PodEntry) -> None:
        """A pod's queue moved (a call of ours started or ended)."""
        if self.serving.get(entry.pod_id) is entry:
            self.serving_load.touch(entry)
        elif self.prefill.get(entry.pod_id) is entry:
            self.prefill_load.touch(entry)

    def holders(self, matches: Mapping[str, PodMatch], bursts: Mapping[str, int]
                ) -> list[PodEntry]:
        """The pods the index or the burst predictions name, worth scoring: all of them,
        except that of holders alike — the same tiers block by block, the same prediction,
        the same role and speed, so the same cost but for the queue — only the `OTHERS`
        least-loaded (a hot root block can have hundreds of holders; the rest cannot win).
        Pods not in the view (gone, refused) are left out."""
        serving, prefill, speeds = self.serving, self.prefill, self.speeds
        entries: list[PodEntry] = []
        named = [*matches, *(pid for pid in bursts if pid not in matches)]
        if len(named) <= OTHERS or len(serving) + len(prefill) <= SCORE_ALL_PODS:
            for pid in named:
                entry = serving.get(pid) or prefill.get(pid)
                if entry is not None:
                    entries.append(entry)
            return entries
        groups: dict[tuple[object, ...], list[PodEntry]] = {}
        for pid in named:
            entry = serving.get(pid)
            role = entry is not None
            if entry is None:
                entry = prefill.get(pid)
                if entry is None:
                    continue
            match = matches.get(pid)
            key = (match.depth, match.predicted, bursts.get(pid, 0), role, speeds.get(pid)) \
                if match is not None else (0, 0, bursts[pid], role, speeds.get(pid))
            group = groups.get(key)
            if group is None:
                groups[key] = [entry]
            else:
                group.append(entry)
        for group in groups.values():
            if len(group) <= OTHERS:
                entries += group
                continue
            alike: dict[tuple[str, ...], list[PodEntry]] = {}  # then the tiers themselves
            for entry in group:
                match = matches.get(entry.pod_id)
                alike.setdefault(tuple(match.tiers) if match else (), []).append(entry)
            for same in alike.values():
                entries += same if len(same) <= OTHERS else heapq.nsmallest(OTHERS, same,
                                                                             key=_queue)
        return entries

    def others(self, holders: Iterable[str], prefill: bool) -> list[PodEntry]:
        """The pods to score besides `holders`: the least-loaded serving ones and the fast
        ones; with `prefill`, the least-loaded prefill pods too."""
        skip = set(holders)
        if len(self.serving) + len(self.prefill) <= SCORE_ALL_PODS:
            return [p for group in (self.serving, self.prefill) for pid, p in group.items()
                    if pid not in skip]
        out = self.serving_load.least(OTHERS, skip)
        skip.update(p.pod_id for p in out)
        out += [p for p in self.fast if p.pod_id not in skip]
        if prefill and self.prefill:
            out += self.prefill_load.least(OTHERS, skip)
        return out

    def cold_pick(self, key: bytes, room: int, work_limit: float, prompt_len: int
                  ) -> PodEntry | None:
        """The cold prompt's pod: of the ring's first band pods from `key` (queue at most
        `room`, prefill of the prompt within `work_limit` seconds), the one of the highest
        rendezvous weight; None when the walk met none."""
        def accept(entry: PodEntry) -> bool:
            return entry.queue() <= room and prompt_len * self.speed(entry.pod_id) <= work_limit
        band = self.ring.neighbours(key, accept)
        if not band:
            return None
        return max(band, key=lambda e: (rendezvous_weight(key, e.pod_id), e.pod_id))

    def min_queue(self) -> int:
        """The shortest queue of any serving pod."""
        least = self.serving_load.min_load()
        return 0 if least is None else least
