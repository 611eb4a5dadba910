"""The predicted time to first token of a request on the pod chosen for it (pure functions).

At decision time, for the chosen `Score` and that pod's published figures:

    TTFT = ahead                                  (work already queued there, seconds)
         + steps x step                           (each engine step's own time)
         + uncached x prefill                     (the prompt tokens it computes)
         + uncached x cached x attention          (those tokens attending to the prefix)
         + DRAM tokens x CPU + SSD tokens x DISK  (reloads from the pod's tiers)
         + pull fixed + pulled tokens x per token (a pull from a peer, when the score has one)

- `prefill` is the pod's own published s/token (`cost.prefill`), not the scorer's settled
  median: the scorer wants noise between equal pods not to decide, the predictor wants this
  pod's speed.
- `step` is the pod's decode-only step: its published prefill budget is that step over its
  prefill cost (Engine._measure_prefill_budget), so budget x prefill gives it back; every
  step pays it (scheduling, the running decodes, sampling). Unpublished (a pod that has not
  decoded yet): the configured seconds per queued request at the pod's speed (queue_cost).
- `steps`: the chunks its uncached tokens take at a step's token budget. Pods do not
  publish their budget; DEFAULT_STEP_TOKENS is EngineArgs' default.
- `attention`: the new tokens' attention over a cached prefix, which the prefill cost
  (measured on prefill-heavy steps, mostly cold prompts) leaves out: on SmolLM2-135M on a
  CPU, 512 new tokens over a 1,024-token prefix take 1.6x as long as 512 cold ones. The
  pods publish no such figure; the router fits it per pod (router/ttft_tracker.py), 0 until
  it has.
- `ahead` comes from the caller (router/ttft_tracker.py: the router's own clock of what it
  sent the pod, or the pod's published prefill backlog).

The scorer's `cost_s` (the naive predictor, kept as the baseline) prices the queue as a
count of requests times a configured figure, and counts no step time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pagekv.proto.medium import Medium
from pagekv.proto.pull_cost import PullCost
from pagekv.router.scoring import CostModel, Score, queue_cost

DEFAULT_STEP_TOKENS = 2048  # EngineArgs.max_num_batched_tokens's default (not published)


@dataclass(frozen=True, slots=True)
class PodFigures:
    """What the predictor reads of one pod: its published costs and load."""

    prefill_s_per_token: float
    step_s: float                  # one engine step's own time (a decode-only step)
    cpu_s_per_token: float
    disk_s_per_token: float
    pull: PullCost | None = None   # the chosen score's pull, as the pod priced it
    backlog_tokens: float = 0.0    # load.prefill_backlog: prompt tokens queued there
    step_tokens: int = DEFAULT_STEP_TOKENS
    measured: bool = True          # the pod published its prefill cost and step (budget)
    attention_s: float = 0.0       # per (uncached token x cached token), as fitted


@dataclass(frozen=True, slots=True)
class TtftPrediction:
    seconds: float   # ahead_s + own_s
    ahead_s: float   # the work queued before it
    own_s: float     # its own steps, prefill, reloads and pull
    steps: int


def _cost(published: Mapping[str, float], key: str, default: float) -> float:
    value = published.get(key)
    if value is None or not math.isfinite(value) or value < 0:
        return default
    return float(value)


def pod_figures(published: Mapping[str, float], load: Mapping[str, float],
                pull_costs: Mapping[str, PullCost], score: Score, costs: CostModel,
                attention_per_prefill: float = 0.0) -> PodFigures:
    """The predictor's view of the chosen pod, from its registration (PodInfo.tier_costs,
    .load, .pull_costs), the configured costs standing in for what it has not measured;
    `attention_per_prefill`: the fitted attention cost per pair in units of its prefill
    cost per token."""
    prefill = _cost(published, "prefill", costs.prefill_per_token)
    budget = _cost(load, "prefill_budget", 0.0)
    step = budget * prefill if budget > 0 else queue_cost(costs, prefill)
    pull = None
    if score.pull_from and score.pull_tokens > 0:
        pull = pull_costs.get(score.pull_from) or PullCost(
            0.0, _cost(published, "peer", costs.peer_per_token))
    return PodFigures(prefill, step, _cost(published, Medium.CPU, costs.cpu_per_token),
                      _cost(published, Medium.DISK, costs.disk_per_token), pull,
                      _cost(load, "prefill_backlog", 0.0),
                      measured="prefill" in published and budget > 0,
                      attention_s=max(0.0, attention_per_prefill) * prefill)


def uncached_tokens(score: Score, prompt_len: int) -> int:
    """The prompt tokens the pod computes (at least the last one, always)."""
    return max(1, prompt_len - score.cached_tokens - score.pull_tokens)


def reload_seconds(score: Score, pod: PodFigures) -> float:
    """Bringing the cached prefix into the pool: DRAM and SSD reloads, and the pull."""
    seconds = score.cached_cpu * pod.cpu_s_per_token + score.cached_disk * pod.disk_s_per_token
    if pod.pull is not None:
        seconds += pod.pull.seconds(score.pull_tokens)
    return seconds


def attention_pairs(score: Score, prompt_len: int) -> int:
    """(uncached token, cached token) pairs: the attention over the cached prefix."""
    return uncached_tokens(score, prompt_len) * (score.cached_tokens + score.pull_tokens)


def own_seconds(score: Score, prompt_len: int, pod: PodFigures) -> tuple[float, int]:
    """(seconds, steps) of the request's own work on an idle pod: its steps, its uncached
    tokens' prefill and attention over the prefix, reloads and pull."""
    uncached = uncached_tokens(score, prompt_len)
    steps = max(1, -(-uncached // max(1, pod.step_tokens)))
    seconds = (steps * pod.step_s + uncached * pod.prefill_s_per_token
               + attention_pairs(score, prompt_len) * pod.attention_s
               + reload_seconds(score, pod))
    return seconds, steps


def predict(score: Score, prompt_len: int, pod: PodFigures, ahead_s: float) -> TtftPrediction:
    own, steps = own_seconds(score, prompt_len, pod)
    ahead = max(0.0, ahead_s)
    return TtftPrediction(ahead + own, ahead, own, steps)


def backlog_seconds(pod: PodFigures) -> float:
    """The pod's published prefill backlog as seconds of its work (steps included)."""
    if pod.backlog_tokens <= 0:
        return 0.0
    steps = -(-int(pod.backlog_tokens) // max(1, pod.step_tokens))
    return steps * pod.step_s + pod.backlog_tokens * pod.prefill_s_per_token


def absolute_percentage_error(predicted_s: float, measured_s: float) -> float | None:
    """|predicted - measured| / measured; None when nothing was measured (0 s or less)."""
    if not measured_s > 0 or not math.isfinite(predicted_s):
        return None
    return abs(predicted_s - measured_s) / measured_s
