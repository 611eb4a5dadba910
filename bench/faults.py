"""Fault benchmark: the fault suite's scenarios, longer, with the figures a user of the cluster
sees — failed calls, time to recovery, detection counts, memory growth.

Each scenario runs against a fresh local cluster (embedded Redis, 2 pods, the router) on this
machine; the baseline of every row is the same cluster's own load without the fault
(calls made, all OK).

    python -m bench.faults [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import fault_scenarios as fs  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from pagekv.deploy.local_cluster import LocalCluster  # noqa: E402

POD_ARGS = ["--num-gpu-blocks", "128", "--max-model-len", "512", "--lease-ttl-s", "3",
            "--max-queue", "64"]


def cluster(run_dir: Path) -> LocalCluster:
    return LocalCluster(nodes=2, run_dir=run_dir, node_args=POD_ARGS,
                        router_args=["--refresh-interval-s", "0.5"])


def fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "-" if v is None else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    k = 1 if args.quick else 3
    root = Path(tempfile.mkdtemp(prefix="pagekv-bench-faults-"))
    results: dict[str, dict] = {}
    with cluster(root / "redis") as c:
        results["redis_restart"] = fs.redis_restart(c, down_s=2.0 * k, warm_s=2.0,
                                                     after_s=5.0 * k, concurrency=4)
    with cluster(root / "pod") as c:
        r = fs.pod_kill(c, c.pods[1], warm_s=2.0, dead_s=4.0 * k, after_s=4.0 * k,
                        concurrency=4)
        r.pop("restarted")
        results["pod_kill"] = r
    with cluster(root / "burst") as c:
        pods = [p.address for p in c.pods]
        results["burst_pod"] = fs.burst(pods[0], 150 * k, pods)
        results["burst_router"] = fs.burst(c.router.address, 150 * k, pods)
        results["large_prompts"] = fs.large_prompts(c.router, n=10 * k, size_mb=1.0)
    results["ssd_damage"] = fs.ssd_damage(str(root / "ssd"), prompts_n=6 * k,
                                          flips=100 * k)

    print(f"# Fault benchmark — {machine_info()}")
    r = results["redis_restart"]
    print("\n| fault | calls | failed | figures |")
    print("|---|---|---|---|")
    print(f"| Redis SIGKILL, {2 * k} s down, restarted empty | {r['calls']} | {r['failed']} | "
          f"{r['calls_while_down']} calls while down, {r['fallback_while_down']} routed by "
          f"load only; index answering {fmt(r['prefix_routing_back_s'])} s after restart |")
    r = results["pod_kill"]
    print(f"| pod SIGKILL, restarted with its id | {r['calls']} | {r['failed']} | routed "
          f"around {r['routed_around']} calls, last {fmt(r['dropped_after_s'])} s after the "
          f"kill; a candidate again {fmt(r['rejoined_after_s'])} s after it was healthy |")
    for key, where in (("burst_pod", "a pod"), ("burst_router", "the router")):
        r = results[key]
        codes = ", ".join(f"{n} {c}" for c, n in sorted(r["codes"].items()))
        print(f"| {r['streams']} streams at once at {where} (--max-queue 64) | {r['streams']} | "
              f"{sum(n for c, n in r['codes'].items() if c not in ('OK', 'RESOURCE_EXHAUSTED'))}"
              f" | {codes}; {r['wall_s']:.1f} s; every block back: {r['blocks_back']} |")
    r = results["large_prompts"]
    print(f"| {r['requests']} text prompts of {r['size_mb']:.0f} MiB at the router | "
          f"{r['requests']} | {sum(n for c, n in r['codes'].items() if c != 'INVALID_ARGUMENT')}"
          f" | router RSS {r['rss_before_mb']:.0f} -> {r['rss_after_mb']:.0f} MiB "
          f"(+{r['rss_growth_mb']:.0f}); a small call meanwhile at most "
          f"{r['small_call_max_ms']:.0f} ms |")
    r = results["ssd_damage"]
    print(f"| SSD: {r['flips']} bit flips + a truncated segment, restart | {r['prompts']} | "
          f"{0 if r['equal_to_cold'] else r['prompts']} wrong | {r['entries_recovered']} "
          f"entries recovered, {r['checksum_failures']} checksum failures and "
          f"{r['torn_entries']} torn entries detected, {r['from_disk_tokens']} tokens still "
          f"served from disk; outputs equal to a cold run: {r['equal_to_cold']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
