"""bench.scale --warm-start's figures: the hit rate against seconds since a router restart.

The same trace runs twice through the same policy: once with one router throughout (the
control), once with the router thrown away at `restart_at` and a fresh one (its own
process state: no burst predictions, no recent or in-flight counts; its registry read
once from Redis, as a starting server reads it before it reports SERVING) put into the
live fleet. Per simulated second since the restart: the hit rate (prompt tokens cached:
pool, DRAM or pulled, over prompt tokens, of the requests arriving in that second) of both
runs, and the restarted run's against the control's and against its own steady state (the
window from the warm-up to the restart).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

GOAL_POINTS = 2.0  # within 2 points of steady state from the first second


class _Rec(Protocol):
    arrival: float
    prompt: int
    cached_gpu: int
    cached_cpu: int
    cached_peer: int


def hit_rate(recs: Iterable[_Rec]) -> tuple[float, int]:
    """(cached prompt tokens over prompt tokens, requests)."""
    cached = prompt = n = 0
    for r in recs:
        cached += r.cached_gpu + r.cached_cpu + r.cached_peer
        prompt += r.prompt
        n += 1
    return (cached / prompt if prompt else math.nan), n


def by_second(records: list[_Rec], start: float, seconds: int) -> list[tuple[float, int]]:
    """Hit rate and requests of the arrivals in each second [start + k, start + k + 1)."""
    return [hit_rate(r for r in records if start + k <= r.arrival < start + k + 1)
            for k in range(seconds)]


def warm_figures(restarted: list[_Rec], control: list[_Rec], restart_at: float,
                 warm_from: float, seconds: int) -> dict:
    steady, _ = hit_rate(r for r in restarted if warm_from <= r.arrival < restart_at)
    steady_ctl, _ = hit_rate(r for r in control if warm_from <= r.arrival < restart_at)
    after, _ = hit_rate(r for r in restarted if restart_at <= r.arrival < restart_at + seconds)
    after_ctl, _ = hit_rate(r for r in control if restart_at <= r.arrival < restart_at + seconds)
    return {"restart_at": restart_at, "steady": steady, "steady_control": steady_ctl,
            "first_seconds": after, "first_seconds_control": after_ctl,
            "per_second": by_second(restarted, restart_at, seconds),
            "per_second_control": by_second(control, restart_at, seconds)}


def print_warm(policy: str, pods: int, fig: dict, restart: tuple | None) -> None:
    steady = fig["steady"]
    print(f"### warm start: {policy}, {pods} pods, router restarted at "
          f"{fig['restart_at']:g} simulated s"
          + (f" (the new one built and its registry read in {restart[1] * 1e3:.0f} ms wall; "
             f"{restart[2]} pods seen at its first read)" if restart else ""))
    print()
    print(f"steady state before the restart: {steady:.1%} (control run {fig['steady_control']:.1%});"
          f" the first {len(fig['per_second'])} s after it: {fig['first_seconds']:.1%} "
          f"(control {fig['first_seconds_control']:.1%})")
    print()
    print("| s since restart | requests | hit rate | control's (no restart) | vs control, "
          "points | vs steady state, points |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for k, ((hr, n), (hc, nc)) in enumerate(zip(fig["per_second"], fig["per_second_control"],
                                               strict=True)):
        d_ctl = 100 * (hr - hc) if n and nc else math.nan
        d_st = 100 * (hr - steady) if n else math.nan
        if not math.isnan(d_ctl):
            worst = min(worst, d_ctl)
        print(f"| {k}-{k + 1} | {n} | {hr:.1%} | {hc:.1%} | {d_ctl:+.1f} | {d_st:+.1f} |")
    print(f"(goal: within {GOAL_POINTS:g} points from the first second; worst second vs the "
          f"control {worst:+.1f} points; a second's hit rate varies with the prompts that "
          f"arrive in it: the control run, same trace, no restart, is the yardstick)")
    print()
