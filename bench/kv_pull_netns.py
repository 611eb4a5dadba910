"""A cross-pod KV pull between hosts simulated by network namespaces, on a link shaped with tc,
against a plain socket on the same link in the same run (issue #28).

Two real pods (SmolLM2-135M-Instruct, one torch thread each) on hosts of their own
(deploy/netns_bed.py: Redis, the router and each pod in its own namespace); the link between
the pods is shaped (`tc tbf`, NetnsMesh.set_rate, a 1 ms bucket) to each rate of `--rates` in
turn. Per rate, alternating rounds (the order flips each round, so drift on a shared box hits
both alike):

- socket: bench/plain_socket.py, its two ends run with `ip netns exec` in the pods'
  namespaces, moves the bytes of one pull from the holder's host to the puller's (`sendall`
  from a preallocated buffer, `recv_into` a preallocated buffer, timed from the ask to the
  last byte); twice on one connection: the first on a fresh connection (TCP's slow start
  included), the second on a warm one; the faster of the two is the round's reference;
- pull: pod A computes a fresh random prefix (with another suffix), then answers the prompt
  (prefix + suffix) itself: the local hit (its TTFT and greedy tokens); B's cache is reset
  and B is asked the same prompt with `kv_source` naming A: B pulls the prefix's blocks
  (KVNode.PullBlocks, or whatever moves a pull's bytes) and prefills only the suffix.
  Checked: every prefix token from the peer, no fallback, the greedy tokens equal to the
  local hit's; GB/s = B's pagekv_kv_pulled_bytes_total / pagekv_kv_pull_seconds (admission
  to landed).

Then, unless `--no-cut`, the cut row (bench/pull_cut.py): the link shaped to `--cut-rate`,
set down mid-pull: the call's outcome, its fallback's reason, the pools with the link down,
and the pulls after the restore.

    python -m bench.kv_pull_netns [--quick] [--rates 1gbit,10gbit,25gbit] [--rounds N]
                                  [--burst-ms 1]
                                  [--cut-rate 250mbit] [--cut-prompt 1024] [--no-cut]
                                  [--json PATH]

Root is needed (namespaces); where they cannot be made it says why and exits 2.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import pull_cut
from bench.kv_pull import MODEL, random_tokens, reset, stream
from bench.machine import machine_info
from bench.pod_metrics import fallback_reasons, grown, scrape_url, transports
from bench.stats import pct
from pagekv.deploy.netns_bed import NetnsBed
from pagekv.deploy.netns_mesh import rate_bits, unavailable_reason
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb

BLOCK = 16
HOLDER, PULLER = "node-a", "node-b"
SOCKET_PORT = 50061  # on the holder's address (each host has its own ports)
PULLED_BYTES, PULL_SECONDS = "pagekv_kv_pulled_bytes_total", "pagekv_kv_pull_seconds_sum"
PULLED_BLOCKS = "pagekv_kv_pulled_blocks_total"
REPO = Path(__file__).resolve().parents[1]


class SocketBaseline:
    """bench/plain_socket.py's server in the holder's namespace, its fetcher run in the
    puller's for each measurement."""

    def __init__(self, bed: NetnsBed, nbytes: int) -> None:
        self.bed, self.nbytes = bed, nbytes
        self.host = bed.mesh.address(HOLDER)
        self.server = subprocess.Popen(
            bed.mesh.exec_argv(HOLDER, [sys.executable, "-m", "bench.plain_socket", "serve",
                                        self.host, str(SOCKET_PORT), str(nbytes)]),
            cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert self.server.stdout is not None
        if self.server.stdout.readline().strip() != "listening":
            raise RuntimeError("the socket baseline's server did not start")

    def fetch(self, times: int = 2) -> list[float]:
        """Seconds of each of `times` transfers on one fresh connection."""
        out = subprocess.run(
            self.bed.mesh.exec_argv(PULLER, [
                sys.executable, "-m", "bench.plain_socket", "fetch", self.host,
                str(SOCKET_PORT), str(self.nbytes), "--times", str(times)]),
            cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
        return list(json.loads(out)["seconds"])

    def stop(self) -> None:
        self.server.kill()
        self.server.wait(10)


@dataclass
class RateRun:
    rate: str
    socket_fresh_s: list[float] = field(default_factory=list)
    socket_best_s: list[float] = field(default_factory=list)
    pull_s: list[float] = field(default_factory=list)
    pull_bytes: list[float] = field(default_factory=list)
    pull_ttft_s: list[float] = field(default_factory=list)
    local_ttft_s: list[float] = field(default_factory=list)
    transports: dict[str, float] = field(default_factory=dict)  # "<transport>/<outcome>"


@dataclass
class Bench:
    bed: NetnsBed
    prefix_len: int
    suffix_len: int
    max_tokens: int
    rng: random.Random
    problems: list[str] = field(default_factory=list)

    @property
    def prefix_blocks(self) -> int:
        return self.prefix_len // BLOCK

    def source(self, blocks: int) -> pb.KvSource:
        return pb.KvSource(pod_id=HOLDER, address=self.bed.address(HOLDER), num_blocks=blocks)

    def pull_round(self, run: RateRun) -> None:
        a, b = self.bed.address(HOLDER), self.bed.address(PULLER)
        prefix = random_tokens(self.rng, self.prefix_len)
        stream(a, prefix + random_tokens(self.rng, self.suffix_len), 1)  # A holds the prefix
        prompt = prefix + random_tokens(self.rng, self.suffix_len)
        local = stream(a, prompt, self.max_tokens)
        reset(b)
        before = scrape_url(self.bed.metrics_url(PULLER))
        shot = stream(b, prompt, self.max_tokens, self.source(self.prefix_blocks))
        change = grown(before, scrape_url(self.bed.metrics_url(PULLER)))
        want = self.prefix_blocks * BLOCK
        if (shot.usage.cached_tokens, shot.usage.cached_tokens_peer) != (want, want):
            self.problems.append(f"{run.rate}: cached/peer tokens {shot.usage.cached_tokens}/"
                                 f"{shot.usage.cached_tokens_peer}, expected {want}/{want}")
        if fallback_reasons(change) or change.get(PULLED_BLOCKS) != self.prefix_blocks:
            self.problems.append(f"{run.rate}: pull metrics {change}")
        if shot.tokens != local.tokens:
            self.problems.append(f"{run.rate}: greedy tokens {shot.tokens} pulled, "
                                 f"{local.tokens} from the local hit")
        run.pull_s.append(change.get(PULL_SECONDS, float("nan")))
        run.pull_bytes.append(change.get(PULLED_BYTES, 0.0))
        run.pull_ttft_s.append(shot.ttft_s)
        for k, v in transports(change).items():
            run.transports[k] = run.transports.get(k, 0.0) + v
        run.local_ttft_s.append(local.ttft_s)

    def pull_bytes(self) -> int:
        """A whole prefix's pull, untimed (warms both pods and the link): its bytes."""
        a, b = self.bed.address(HOLDER), self.bed.address(PULLER)
        small = random_tokens(self.rng, 8 * BLOCK + 5)
        for pod in (a, b):
            stream(pod, random_tokens(self.rng, 64), 2)
        stream(a, small, 2)
        stream(b, small, 2, self.source(8))
        prefix = random_tokens(self.rng, self.prefix_len)
        stream(a, prefix + random_tokens(self.rng, self.suffix_len), 1)
        reset(b)
        before = scrape_url(self.bed.metrics_url(PULLER))
        stream(b, prefix + random_tokens(self.rng, self.suffix_len), 1,
               self.source(self.prefix_blocks))
        nbytes = int(grown(before, scrape_url(self.bed.metrics_url(PULLER))).get(PULLED_BYTES, 0))
        if nbytes <= 0:
            raise RuntimeError("the warm-up pull moved no bytes: is the pull path working?")
        return nbytes


def gbps(nbytes: float, seconds: list[float]) -> float:
    """The median round's GB/s (taken over rates, as the pull's, so both pick alike)."""
    return pct([nbytes / s for s in seconds], 0.5) / 1e9 if seconds else float("nan")


def summarize(run: RateRun, nbytes: int) -> dict:
    link = rate_bits(run.rate) / 8 / 1e9
    sock = gbps(nbytes, run.socket_best_s)
    pull = (pct([b / s for b, s in zip(run.pull_bytes, run.pull_s, strict=True)], 0.5) / 1e9
            if run.pull_s else float("nan"))
    return {"rate": run.rate, "link_gb_per_s": link, "socket_gb_per_s": sock,
            "socket_fresh_gb_per_s": gbps(nbytes, run.socket_fresh_s),
            "pull_gb_per_s": pull, "pull_over_socket": pull / sock, "pull_over_link": pull / link,
            "socket_over_link": sock / link, "pull_ms_p50": pct(run.pull_s, 0.5) * 1e3,
            "pull_ttft_ms_p50": pct(run.pull_ttft_s, 0.5) * 1e3,
            "local_ttft_ms_p50": pct(run.local_ttft_s, 0.5) * 1e3, "rounds": len(run.pull_s),
            "transports": ", ".join(f"{k} {v:.0f}" for k, v in run.transports.items())
            or "(not reported)",
            "raw": vars(run)}


def print_rates(rows: list[dict], nbytes: int, burst_ms: float) -> None:
    print(f"\n| link (tc tbf, burst {burst_ms:g} ms) | socket GB/s | socket, fresh connection | pull GB/s | "
          f"pull / socket | pull / link | socket / link | pull ms | TTFT pulled ms | "
          f"TTFT local hit ms | rounds | pulls by transport |  ({nbytes / 1e6:.1f} MB a pull, "
          f"medians)")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate']} ({r['link_gb_per_s']:.3f} GB/s) | {r['socket_gb_per_s']:.3f} | "
              f"{r['socket_fresh_gb_per_s']:.3f} | {r['pull_gb_per_s']:.3f} | "
              f"{r['pull_over_socket']:.2f} | {r['pull_over_link']:.2f} | "
              f"{r['socket_over_link']:.2f} | {r['pull_ms_p50']:.0f} | "
              f"{r['pull_ttft_ms_p50']:.0f} | {r['local_ttft_ms_p50']:.0f} | {r['rounds']} | "
              f"{r['transports']} |")


def print_cut(r: dict) -> None:
    c, n = r["cut"], r["next"] or {}
    print(f"\n| cut mid-pull at {r['rate']} | uncut call s (its pull s) | cut after s | call | call s "
          f"(bound) | peer tokens kept / {r['full_tokens']} | fallback | pool blocks in use, "
          f"link down | first pull after restore | whole pull again after s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fell_back = f", fallback {n['fallbacks']}" if n.get("fallbacks") else ""
    first = (f"{n.get('code')} {n.get('peer_tokens')} peer tokens, {n.get('seconds', 0):.2f} s"
             f"{fell_back}")
    recovery = "never" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
    print(f"| {r['rate']} | {r['uncut']['seconds']:.2f} ({r['uncut']['pull_s']:.2f}) | "
          f"{c['cut_after_s']:.2f} | "
          f"{c['code']}{', WRONG' if c['wrong'] else ''}{', HUNG' if c['hung'] else ''} | "
          f"{c['seconds']:.2f} ({r['pull_deadline_s'] + r['recompute_bound_s']:.1f}) | "
          f"{c['peer_tokens']} | {c['fallbacks']} | "
          f"{r['in_use_after_cut']} | {first} | {recovery} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10gbit only, 2 rounds")
    ap.add_argument("--rates", default=None,
                    help="comma-separated tc rates of the pods' link (default: 10gbit quick, "
                         "1gbit,10gbit,25gbit full)")
    ap.add_argument("--rounds", type=int, default=None, help="per rate (default 2 quick, 6)")
    ap.add_argument("--prefix", type=int, default=2048, help="prefix tokens pulled")
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--pull-deadline-s", type=float, default=5.0, help="the pods' "
                    "--kv-pull-deadline-s (also bounds the cut call)")
    ap.add_argument("--burst-ms", type=float, default=1.0, help="the tbf bucket of the "
                    "measured links, in ms at their rate (the mesh's default 10 ms lets the "
                    "first 12.5 MB through a 10 Gbit/s link unshaped)")
    ap.add_argument("--cut", action=argparse.BooleanOptionalAction, default=True,
                    help="the cut-mid-pull row")
    ap.add_argument("--cut-rate", default=None, help="the link's rate for the cut row, slow "
                    "enough that its pull takes a second or two (default 250mbit, 125mbit "
                    "quick)")
    ap.add_argument("--cut-prompt", type=int, default=None, help="the cut row's prompt tokens "
                    "(each computed cold by the holder: a long one costs minutes here; "
                    "default 1024, 512 quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    why_not = unavailable_reason()
    if why_not is not None:
        print(f"no network-namespace test bed here: {why_not}", file=sys.stderr)
        return 2
    if args.prefix % BLOCK:
        ap.error(f"--prefix must be a multiple of the block size {BLOCK}")
    rates = (args.rates or ("10gbit" if args.quick else "1gbit,10gbit,25gbit")).split(",")
    args.cut_rate = args.cut_rate or ("125mbit" if args.quick else "250mbit")
    args.cut_prompt = args.cut_prompt or (512 if args.quick else 1024)
    for rate in [*rates, args.cut_rate]:
        rate_bits(rate)  # a wrong rate fails now, not after the pods started
    rounds = args.rounds or (2 if args.quick else 6)
    total = max(args.prefix + args.suffix, args.cut_prompt) + args.max_tokens
    per_prompt = -(-total // BLOCK)
    pod_args = ["--num-gpu-blocks", str(4 * per_prompt + 16), "--max-model-len",
                str(total + BLOCK), "--kv-pull-deadline-s", str(args.pull_deadline_s)]
    print(f"# Cross-pod KV pull between network namespaces vs a plain socket on the same shaped "
          f"link ({MODEL}, {args.prefix}-token prefix + {args.suffix}-token suffix, {rounds} "
          f"rounds a rate, pods of 1 torch thread) — {machine_info()}", flush=True)
    rng = random.Random(args.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="pagekv-kvpull-netns-"))
    rows: list[dict] = []
    cut: dict | None = None
    bench_problems: list[str] = []
    t_start = time.monotonic()
    with NetnsBed(2, run_dir, model=MODEL, pod_args=pod_args, rate=rates[0]).start(180) as bed:
        bench = Bench(bed, args.prefix, args.suffix, args.max_tokens, rng)
        nbytes = bench.pull_bytes()
        sock = SocketBaseline(bed, nbytes)
        try:
            for rate in rates:
                bed.mesh.set_rate(HOLDER, PULLER, rate, args.burst_ms)
                run = RateRun(rate)
                for r in range(rounds):
                    for step in ("socket", "pull") if r % 2 == 0 else ("pull", "socket"):
                        if step == "socket":
                            fresh, warm = sock.fetch(2)
                            run.socket_fresh_s.append(fresh)
                            run.socket_best_s.append(min(fresh, warm))
                        else:
                            bench.pull_round(run)
                    print(f"{rate} round {r + 1}/{rounds}: socket "
                          f"{nbytes / run.socket_best_s[-1] / 1e9:.3f} GB/s, pull "
                          f"{run.pull_bytes[-1] / run.pull_s[-1] / 1e9:.3f} GB/s, TTFT "
                          f"{run.pull_ttft_s[-1] * 1e3:.0f} ms (local hit "
                          f"{run.local_ttft_s[-1] * 1e3:.0f})", flush=True)
                rows.append(summarize(run, nbytes))
        finally:
            sock.stop()
        if args.cut:
            cut = pull_cut.cut_mid_pull(
                bed, HOLDER, PULLER,
                lambda: random_tokens(rng, args.cut_prompt), rate=args.cut_rate,
                pull_deadline_s=args.pull_deadline_s, cut_at=0.3, after_s=20.0)
            bench_problems = pull_cut.problems(cut)
    print_rates(rows, nbytes, args.burst_ms)
    for row in rows:
        if row["rate"] == "10gbit":
            met = "met" if row["pull_over_link"] >= 0.8 else "not met"
            print(f"\ngoal (#28): pull within 80% of the shaped 10 Gbit/s link: pull / link "
                  f"{row['pull_over_link']:.2f} ({met}); the socket reaches "
                  f"{row['socket_over_link']:.2f} of it here")
    if cut is not None:
        print_cut(cut)
        first = pull_cut.first_pull_problem(cut)
        if first:
            print(f"note: {first}")
    problems = bench.problems + bench_problems
    for p in problems:
        print(f"PROBLEM: {p}")
    if not problems:
        print("checks: every pull brought all prefix tokens from the peer (no fallback), its "
              "greedy tokens the local hit's" + ("; the cut call fell back with the cold tokens, "
                                                  "no pin outlived the cut, pulls came back"
                                                  if cut else ""))
    print(f"({time.monotonic() - t_start:.0f} s, logs in {run_dir})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "kv_pull_netns", "model": MODEL, "machine": machine_info(),
                       "args": vars(args), "pull_bytes": nbytes, "rates": rows, "cut": cut,
                       "problems": problems}, f, indent=2, default=str)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
