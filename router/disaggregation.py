"""Prefill/decode disaggregation: when to split a request, and onto which pods.

A fleet with prefill pods (`pagekv node --role prefill`) serves every request on a decode
or mixed pod, chosen as always (prefix, load, pull option). A request whose prompt is still
mostly uncached there — at least the pod's split threshold — is split: its prompt is first
computed on a prefill pod (one token sampled, the blocks held for a pull), then the decode
pod pulls that KV on admission (KvSource with the handover id) and generates. Below the
threshold, or when the decode pod holds the prefix already, nothing is split: the handover
would cost more than the prefill it spares the decode pod.

The threshold is the decode pod's prefill budget, which it measures and publishes
(`load.prefill_budget`, kvnode/engine/engine.py): the prompt tokens it can compute in about
one decode step's time. A shorter prefill costs its decodes less than a step, so it is never
split; a longer one would stall them a step or more (or, under its per-step cap, take that
many steps). `--pd-threshold-tokens` (1024) raises it: splitting from the budget alone
(16-31 tokens on the 2-core box) sent chat turns to the one prefill pod, where the ones that
arrived during a document's prefill waited seconds (bench/pd.py, docs/BENCHMARKS.md §21).
A prompt over it still stays local
when every prefill pod's queue would delay it longer than the local prefill takes (BUSY).
Prefill pods are ranked among themselves by the same scores (their own prefix hits first,
so a prefix prefilled once is prefilled there again, cheaply), and never get a whole
request while a decode or mixed pod is live.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagekv.proto.index.schema import ROLE_PREFILL
from pagekv.router.config import RouterConfig
from pagekv.router.pods import PodEntry
from pagekv.router.scoring import Score

# The `decision` label of pagekv_router_pd_requests_total.
SPLIT, LOCAL, BUSY = "split", "local", "prefill_busy"
# Router-side fallback reasons (pagekv_router_pd_fallbacks_total): the prefill half failed,
# so the decode pod computes the whole prompt. A decode pod's pull that fell back reports
# its own reason (kvnode/engine/peer_pull.py FALLBACK_REASONS) in its usage.
PREFILL_UNAVAILABLE = "prefill_unavailable"  # every prefill pod tried was UNAVAILABLE
PREFILL_STALLED = "prefill_stalled"          # the prefill call made no progress in its bound
PREFILL_FAILED = "prefill_failed"            # any other status from the prefill pod
# A decode pod's own pull fallbacks (kvnode/engine/peer_pull.py FALLBACK_REASONS; a test
# keeps the two equal): a reason a pod reports that is not one of them counts as "other".
PULL_FALLBACKS = ("peer_unavailable", "peer_busy", "peer_missing", "deadline", "checksum",
                  "hash_mismatch", "config_mismatch", "no_room", "error")


def fallback_label(reason: str) -> str:
    """A pod-reported pull fallback as a bounded metric label."""
    return reason if reason in PULL_FALLBACKS else "other"


@dataclass(slots=True)
class SplitPlan:
    """A request to split: the prefill pods to try, best first, and why it was split."""

    prefill_order: list[Score]
    threshold: int  # the decode pod's split threshold (tokens)
    uncached: int   # the prompt tokens the decode pod would have computed itself


def is_prefill(entry: PodEntry) -> bool:
    return entry.info.role == ROLE_PREFILL


def serving_pods(pods: Sequence[PodEntry]) -> list[PodEntry]:
    """The pods a whole request may go to: decode and mixed ones; the prefill pods only
    when none of those is live (a degraded fleet still serves)."""
    others = [p for p in pods if not is_prefill(p)]
    return others or list(pods)


def split_threshold(entry: PodEntry, config: RouterConfig) -> int:
    """The uncached prompt tokens from which a request for `entry` is split: the configured
    floor, or the pod's measured prefill budget where larger (never under a block: a pod
    measures at least one, and a forged 1 would split everything)."""
    measured = int(entry.info.load.get("prefill_budget", 0))
    return max(config.pd_threshold_tokens, measured, config.block_size)


def prefill_s_per_token(entry: PodEntry, config: RouterConfig) -> float:
    """What the pod measured a prompt token's prefill costs (else the configured cost)."""
    return entry.info.tier_costs.get("prefill", config.costs.prefill_per_token)


def prefill_wait_s(entry: PodEntry, config: RouterConfig) -> float:
    """How long a prompt sent to a prefill pod now waits behind the prompts it has queued
    or is computing (`load.prefill_backlog` tokens, at its measured prefill cost)."""
    return entry.info.load.get("prefill_backlog", 0.0) * prefill_s_per_token(entry, config)


def plan_split(order: Sequence[Score], prefill_order: Sequence[Score],
               pods: Mapping[str, PodEntry], prompt_len: int,
               config: RouterConfig) -> tuple[SplitPlan | None, int, str]:
    """The split of a request whose serving pods are ranked `order` (best first) and whose
    prefill pods `prefill_order`: None to serve it whole on order[0]. Also returns the
    threshold considered (0: no split possible: no prefill pod, or order[0] is one) and the
    decision (SPLIT, LOCAL, BUSY: long enough, but every prefill pod's queue would delay it
    longer than computing it on the decode pod takes, as Dynamo's conditional
    disaggregation keeps a prefill local when the prefill queue is long)."""
    if not config.pd_split or not order or not prefill_order:
        return None, 0, ""
    best = pods.get(order[0].pod_id)
    if best is None or is_prefill(best):
        return None, 0, ""
    threshold = split_threshold(best, config)
    first = order[0]
    # What the decode pod would compute itself: neither cached there nor pulled.
    uncached = prompt_len - first.cached_tokens - (first.pull_tokens if first.pull_from else 0)
    if uncached < threshold:
        return None, threshold, LOCAL
    local_s = uncached * prefill_s_per_token(best, config)
    ready = [s for s in prefill_order
             if s.pod_id in pods and prefill_wait_s(pods[s.pod_id], config) <= local_s]
    if not ready:
        return None, threshold, BUSY
    return SplitPlan(ready, threshold, uncached), threshold, SPLIT
