"""bench.scale --sweep's figures: TTFT and throughput against offered load, and the knee.

The sweep replays, per load (a fraction of the fleet's capacity: bench/scale_trace.py
`trace_for_load`), one trace with a hot prefix through every policy. Per load and policy:
TTFT p50 / p90 (and against the oracle's), input tokens/s served (prompt tokens, cached or
not, of the requests whose first token came in the measured window), requests/s completed
in it, load max/mean (requests per pod), hit rate.

The knee (KNEE_DEFINITION): one bound for every policy, twice the oracle's TTFT p90 at the
lowest load swept (the lowest policy p90 there without an oracle); a policy's knee is the
highest load up to which its TTFT p90 stays within the bound at every load swept, and its
throughput at the knee is its input tokens/s served there. A policy over the bound already
at the lowest load has no knee; its throughput at that load bounds its knee's from above
(served tokens only grow with the offered load), so a ratio against it is a lower bound
("≥"). A policy within the bound at the highest load swept has its knee there or beyond
("≥ load"): its throughput there is a lower bound on its knee's.
"""

from __future__ import annotations

import math

KNEE_FACTOR = 2.0
KNEE_DEFINITION = (f"knee = the highest offered load up to which a policy's TTFT p90 stays "
                   f"within {KNEE_FACTOR:g}x the oracle's TTFT p90 at the lowest load swept "
                   f"(at every load swept up to it); throughput at the knee = input tokens/s "
                   f"served there; no knee: over the bound already at the lowest load (its "
                   f"throughput there is an upper bound on its knee's: ratios against it "
                   f"are lower bounds, ≥)")


def knee_bound(results: dict[float, dict]) -> float:
    """The TTFT p90 bound the knee is measured against (see the module docstring)."""
    low = results[min(results)]
    if "oracle" in low:
        return KNEE_FACTOR * float(low["oracle"]["ttft_p90_s"])
    return KNEE_FACTOR * min(float(r["ttft_p90_s"]) for k, r in low.items() if k != "trace")


def knee(results: dict[float, dict], policy: str, bound: float) -> tuple[float | None, float]:
    """(knee load or None, input tokens/s served at the knee, or at the lowest load when
    there is no knee)."""
    best: float | None = None
    for load in sorted(results):
        r = results[load].get(policy)
        if r is None or not r["ttft_p90_s"] <= bound:
            break
        best = load
    at = results[best if best is not None else min(results)].get(policy, {})
    return best, float(at.get("input_tokens_per_s", math.nan))


def _x(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "-"


def print_sweep(results: dict[float, dict], policies: list[str], pods: int) -> dict:
    """The per-load tables and the knee table; returns the knee figures."""
    for load in sorted(results):
        res = results[load]
        t = res["trace"]
        print(f"### load {load:g}: {pods} pods, {t['requests']} requests "
              f"({t['requests_per_s']:.1f}/s); the hot prompt ({t['hot_share']:.0%} of the "
              f"sessions) needs {t['hot_pods']:.1f} pods' time")
        print()
        print("| policy | TTFT p50 s | TTFT p90 s | p50 / oracle | p90 / oracle | input tok/s "
              "served (offered) | requests/s completed | cached | load max/mean | "
              "preempted |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        orc = res.get("oracle")
        for policy in policies:
            r = res.get(policy)
            if r is None:
                continue
            print(f"| {policy} | {r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | "
                  f"{_x(r['ttft_p50_s'], orc['ttft_p50_s']) if orc else '-'} | "
                  f"{_x(r['ttft_p90_s'], orc['ttft_p90_s']) if orc else '-'} | "
                  f"{r['input_tokens_per_s']:.0f} ({r['offered_tokens_per_s']:.0f}) | "
                  f"{r['requests_per_s']:.2f} | {r['hit_rate']:.1%} | "
                  f"{r['spread_requests']:.2f} | {r['preemptions']} |")
        print()
    bound = knee_bound(results)
    rr_load, rr_tput = knee(results, "round_robin", bound) if any(
        "round_robin" in r for r in results.values()) else (None, math.nan)
    print(f"(knee: {KNEE_DEFINITION}; bound here {bound:.3f} s)")
    print()
    print("| policy | knee load | TTFT p90 at the knee s | input tok/s at the knee | vs "
          "round-robin's | worst TTFT p90 / oracle (load) |")
    print("|---|---|---|---|---|---|")
    knees: dict[str, dict] = {"bound_s": {"value": bound}}
    for policy in policies:
        if not any(policy in r for r in results.values()):
            continue
        load, tput = knee(results, policy, bound)
        p90 = results[load][policy]["ttft_p90_s"] if load is not None else math.nan
        if load is None:
            vs = "(no knee)"
        elif rr_load is None:  # round-robin's knee, if any, lies below the lowest load
            vs = "≥ " + _x(tput, rr_tput)
        else:
            vs = _x(tput, rr_tput)
        worst, worst_at = math.nan, None
        for ld in sorted(results):
            r, o = results[ld].get(policy), results[ld].get("oracle")
            if r and o and o["ttft_p90_s"]:
                ratio = r["ttft_p90_s"] / o["ttft_p90_s"]
                if math.isnan(worst) or ratio > worst:
                    worst, worst_at = ratio, ld
        top = load is not None and load == max(results)  # never over: the knee lies beyond
        shown = "none" if load is None else f"≥ {load:g}" if top else f"{load:g}"
        print(f"| {policy} | {shown} | "
              f"{'-' if load is None else f'{p90:.3f}'} | "
              f"{'-' if load is None else f'{tput:.0f}'} | {vs} | "
              f"{'-' if worst_at is None else f'{worst:.2f}x ({worst_at:g})'} |")
        knees[policy] = {"knee_load": load, "beyond_sweep": top, "input_tokens_per_s": tput,
                         "worst_p90_vs_oracle": worst, "worst_at": worst_at}
    print("(goals: TTFT p90 <= 1.1x the oracle's at every load; throughput at the knee >= "
          "2.5x round-robin's)")
    return knees
