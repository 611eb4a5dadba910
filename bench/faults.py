"""Fault benchmark: the fault suite's scenarios, longer, with the figures a user of the cluster
sees — failed calls, time to recovery, detection counts, memory growth.

Each scenario runs against a fresh local cluster (embedded Redis, 2 pods, the router) on this
machine; the baseline of every row is the same cluster's own load without the fault
(calls made, all OK).

The partition rows and #27's findings run on the network-namespace test bed instead
(deploy/netns_bed.py: Redis, the router and each pod on a simulated host of its own, links
shaped with tc; root only, skipped otherwise): one row each with calls, failures by code,
wrong tokens, hung calls, leaked blocks and the recovery time.

    python -m bench.faults [--quick] [--only local|netns] [--json PATH]
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
from bench import netns_findings as nf  # noqa: E402
from bench import netns_partitions as parts  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from pagekv.deploy.local_cluster import LocalCluster  # noqa: E402
from pagekv.deploy.netns_bed import NetnsBed  # noqa: E402
from pagekv.deploy.netns_mesh import unavailable_reason  # noqa: E402

BED_POD_ARGS = ["--num-gpu-blocks", "128", "--max-model-len", "1024", "--lease-ttl-s", "2",
                "--max-queue", "64"]
BED_ROUTER_ARGS = ["--refresh-interval-s", "0.3"]

POD_ARGS = ["--num-gpu-blocks", "128", "--max-model-len", "512", "--lease-ttl-s", "3",
            "--max-queue", "64"]


def cluster(run_dir: Path) -> LocalCluster:
    return LocalCluster(nodes=2, run_dir=run_dir, node_args=POD_ARGS,
                        router_args=["--refresh-interval-s", "0.5"])


def fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return "-" if v is None else str(v)


def bed(run_dir: Path) -> NetnsBed:
    return NetnsBed(2, run_dir, pod_args=BED_POD_ARGS, router_args=BED_ROUTER_ARGS)


def netns_results(root: Path, k: int) -> dict[str, dict]:
    """The partitions, then #27's findings, each group on a fresh bed."""
    out: dict[str, dict] = {}
    with bed(root / "bed-partitions").start() as b:
        out["router_pod_cut"] = parts.router_pod_cut(b, "node-b", cut_s=4.0 * k,
                                                     after_s=8.0 * k, deadline_s=10.0)
        out["router_pod_cut_past_deadline"] = parts.router_pod_cut(
            b, "node-b", cut_s=12.0, after_s=8.0 * k, deadline_s=5.0, seed=7)
        out["pod_redis_cut"] = parts.pod_redis_cut(b, "node-b", cut_s=6.0 * k,
                                                   after_s=10.0 * k)
        out["pod_pod_cut"] = parts.pod_pod_cut_during_pull(b, "node-a", "node-b",
                                                           rate="5mbit", pulls=2 * k)
    with bed(root / "bed-findings").start() as b:
        out["hung_pod"] = nf.hung_pod(b, "node-b", stop_s=6.0 * k, after_s=8.0 * k)
        out["index_garbage"] = nf.index_garbage(b, garbage_s=5.0 * k)
        out["slowloris"] = nf.slowloris(b, connections=50 * k, hold_s=40.0)  # > the 30 s default
        out["client_hangups"] = nf.client_hangups(b, clients=50 * k)
        out["cancelled_pulls"] = nf.cancelled_pulls(b, "node-a", "node-b", pulls=6 * k)
    return out


def failed_by_code(r: dict) -> str:
    return ", ".join(f"{n} {c}" for c, n in sorted(r["failed"].items())) or "0"


def leaked(r: dict) -> int:
    return sum(r["leaked_blocks"].values())


def print_netns_rows(res: dict[str, dict]) -> None:
    print("\n| scenario (netns bed) | calls | failed (by code) | wrong | hung | leaked blocks "
          "| recovery s | figures |")
    print("|---|---|---|---|---|---|---|---|")

    def row(name: str, r: dict, figures: str) -> None:
        print(f"| {name} | {r['calls']} | {failed_by_code(r)} | {r['wrong']} | {r['hung']} | "
              f"{leaked(r)} | {fmt(r.get('recovery_s'))} | {figures} |")

    for key, deadline in (("router_pod_cut", 10), ("router_pod_cut_past_deadline", 5)):
        if key in res:
            r = res[key]
            row(f"router <-> pod cut {r['cut_s']:.0f} s (deadline {deadline} s)", r,
                f"longest call {r['max_call_s']:.1f} s")
    if "pod_redis_cut" in res:
        r = res["pod_redis_cut"]
        row(f"pod <-> Redis cut {r['cut_s']:.0f} s (lease 2 s)", r,
            f"longest call {r['max_call_s']:.1f} s")
    if "pod_pod_cut" in res:
        r = res["pod_pod_cut"]
        row(f"pod <-> pod cut mid KV pull (link {r['rate']})", r,
            f"{r['pulls']} pulls: failed {r['pull_failed'] or 0}, wrong {r['pull_wrong']}, "
            f"hung {r['pull_hung']}; uncut pull {r['uncut_pull_s']:.2f} s "
            f"({r['full_pull_tokens']} tokens); cut pulls got "
            f"{r['pulled_tokens_during_cut']} tokens in "
            f"{', '.join(f'{s:.1f}' for s in r['cut_pull_s'])} s, recomputed the rest")
    if "hung_pod" in res:
        r = res["hung_pod"]
        row(f"pod SIGSTOPped {r['stop_s']:.0f} s (deadline 10 s)", r,
            f"longest call {r['max_call_s']:.1f} s")
    if "index_garbage" in res:
        r = res["index_garbage"]
        row(f"NaN/1e308 load + Z: claims in the index for {r['garbage_s']:.0f} s", r,
            f"{r['failed_while_garbage']} failed while the garbage was there")
    if "slowloris" in res:
        r = res["slowloris"]
        row(f"{r['connections']} slowloris HTTP connections, {r['hold_s']:.0f} s", r,
            f"{r['closed_by_server']} closed by the router (median "
            f"{fmt(r['closed_median_s'])} s)")
    if "client_hangups" in res:
        r = res["client_hangups"]
        print(f"| {r['clients']} HTTP clients hanging up mid-body | {r['clients']} | - | - | "
              f"- | - | - | counted status 500: {r['status_500']:.0f}, 499: "
              f"{r['status_499']:.0f}; {r['traceback_lines']} tracebacks, {r['log_lines']} "
              f"router log lines; serving after: {r['router_serving_after']} |")
    if "cancelled_pulls" in res:
        r = res["cancelled_pulls"]
        row(f"{r['pulls']} pulls cancelled at a 0.3 s deadline", r,
            f"pulls: {', '.join(f'{n} {c}' for c, n in sorted(r['pull_codes'].items()))}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("local", "netns"), default=None,
                    help="only the local cluster's rows, or only the netns bed's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    k = 1 if args.quick else 3
    root = Path(tempfile.mkdtemp(prefix="pagekv-bench-faults-"))
    results: dict[str, dict] = {}
    netns: dict[str, dict] = {}
    why_not = unavailable_reason()
    if args.only != "local" and why_not is None:
        netns = netns_results(root, k)
    if args.only == "netns":
        print(f"# Fault benchmark (netns bed) — {machine_info()}")
        if why_not is not None:
            print(f"\nnetns rows skipped: {why_not}")
        print_netns_rows(netns)
        if args.json:
            Path(args.json).write_text(json.dumps(netns, indent=2, default=str))
        return 0
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
    if why_not is not None:
        print(f"\nnetns rows skipped: {why_not}")
    elif netns:
        print_netns_rows(netns)
    if args.json:
        Path(args.json).write_text(json.dumps({**results, **netns}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
