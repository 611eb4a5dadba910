"""guidellm (the vLLM project's benchmark client, from PyPI) against a PageKV cluster, offline,
with the tokenizer `pagekv export-tokenizer` wrote: shared prompt prefixes vs unique prompts
of the same length, through the router, in the same run.

A real local cluster (two pods serving SmolLM2-135M-Instruct, an embedded Redis, the
prefix-aware router) takes two guidellm runs of streamed chat completions with synthetic
prompts, the same request count, concurrency, prompt and output lengths:

- shared: `--prefixes` prefixes of `--prefix-tokens` tokens, each prompt one of them plus
  `--suffix-tokens` of its own (a system prompt or a document many requests repeat);
- unique: prompts of `--prefix-tokens + --suffix-tokens` tokens that share nothing, the
  baseline: every prompt token is prefilled.

The pods' caches are reset before each run, so the shared run's first request per prefix is
cold. guidellm counts prompt tokens with the exported tokenizer directory, loaded through
transformers' AutoTokenizer with HF_HUB_OFFLINE=1 (nothing is fetched). guidellm is installed
on first use into its own venv (`--guidellm-venv`, default `.bench-venvs/guidellm`, pinned
`guidellm==0.8.1`), as bench/aiperf_routing.py installs aiperf; its console report is printed
for each run, then the side-by-side table with the ratios and the pods' own prefix-cache hit
share (from their /metrics: guidellm does not read `cached_tokens`).

    python -m bench.guidellm_run [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from bench.aiperf_routing import reset_pods
from bench.kv_pull import scrape
from bench.machine import machine_info
from pagekv.deploy.local_cluster import LocalCluster, pagekv_cmd

MODEL = "smollm2-135m-instruct"
GUIDELLM = "guidellm==0.8.1"
ROOT = Path(__file__).resolve().parents[1]
HITS, QUERIES = "pagekv_prefix_cache_hits_tokens_total", "pagekv_prefix_cache_queries_tokens_total"
FINISHED = "pagekv_requests_total"  # by finish reason, summed by scrape()


def ensure_venv_tool(venv: Path, requirement: str, exe_name: str) -> Path:
    """`exe_name` from a venv of its own, made and filled on first use (the tool pins other
    versions of packages PageKV's venv holds). torch first, at this venv's version: guidellm
    declares it, and pip would otherwise resolve a CUDA build of several GB."""
    exe = venv / "bin" / exe_name
    if not exe.exists():
        print(f"installing {requirement} into {venv} (once; about a minute)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        torch = "torch==" + metadata.version("torch").split("+")[0]
        for req in (torch, requirement):
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", req], check=True)
    return exe


def export_tokenizer(out: Path) -> Path:
    subprocess.run(pagekv_cmd("export-tokenizer", MODEL, str(out)), check=True)
    return out


ROWS = [  # label, guidellm metric, statistic (of its successful requests)
    ("TTFT p50 ms", "time_to_first_token_ms", "p50"),
    ("TTFT p90 ms", "time_to_first_token_ms", "p90"),
    ("ITL p50 ms", "inter_token_latency_ms", "p50"),
    ("request latency p50 s", "request_latency", "p50"),
    ("output tokens/s", "output_tokens_per_second", "mean"),
    ("requests/s", "requests_per_second", "mean"),
    ("prompt tokens / request", "prompt_token_count", "p50"),
]


def data_arg(args: argparse.Namespace, shared: bool) -> str:
    """guidellm's synthetic text: the same prompt length either way, shared prefixes or not."""
    if shared:
        return (f"kind=synthetic_text,prompt_tokens={args.suffix_tokens},"
                f"output_tokens={args.osl},prefix_count={args.prefixes},"
                f"prefix_tokens={args.prefix_tokens}")
    return (f"kind=synthetic_text,prompt_tokens={args.prefix_tokens + args.suffix_tokens},"
            f"output_tokens={args.osl}")


def guidellm_argv(exe: Path, args: argparse.Namespace, url: str, tokenizer: Path,
                  shared: bool, out: Path) -> list[str]:
    return [
        str(exe), "run",
        "--backend", f"kind=openai_http,target={url},model={MODEL}",
        "--profile", f"kind=concurrent,streams={args.concurrency}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--data", data_arg(args, shared),
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--seed", "kind=static,value=42",
        "--output", f"kind=json,path={out}",  # guidellm prints its console report anyway
        "--disable-console-interactive",
    ]


def offline_env() -> dict[str, str]:
    """No hub: the tokenizer is a local directory and the data synthetic."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                HF_DATASETS_OFFLINE="1")


def run_guidellm(argv: list[str], out: Path) -> dict:
    done = subprocess.run(argv, cwd=out.parent, env=offline_env(), capture_output=True,
                          text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    print(done.stdout, flush=True)
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    totals = benchmark["metrics"]["request_totals"]
    if totals["errored"] or totals["incomplete"]:
        raise RuntimeError(f"guidellm saw failed requests: {totals}")
    return benchmark


def stat(benchmark: dict, key: str, which: str) -> float:
    metric = (benchmark["metrics"].get(key) or {}).get("successful") or {}
    value = metric.get(which, (metric.get("percentiles") or {}).get(which))
    return float(value) if value is not None else float("nan")


def pods_since(cluster: LocalCluster, before: list[dict[str, float]]) -> dict[str, float]:
    """What the pods did since `before`: the share of looked-up prompt tokens they served from
    cache, and the requests they finished."""
    after = [scrape(pod) for pod in cluster.pods]

    def grew(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True))

    asked = grew(QUERIES)
    return {"hit_share": grew(HITS) / asked if asked else float("nan"),
            "finished": grew(FINISHED)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--guidellm-venv", default=str(ROOT / ".bench-venvs" / "guidellm"))
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=None)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--json")
    args = ap.parse_args()
    args.requests = args.requests or (24 if args.quick else 64)
    args.prefix_tokens = args.prefix_tokens or (512 if args.quick else 1024)
    exe = ensure_venv_tool(Path(args.guidellm_venv), GUIDELLM, "guidellm")
    work = Path(tempfile.mkdtemp(prefix="pagekv-guidellm-"))
    tokenizer = export_tokenizer(work / "tokenizer")
    node_args = ["--max-model-len", "2048", "--max-num-seqs", str(args.concurrency)]
    print(f"# guidellm through the router: shared prefixes vs unique prompts ({MODEL}, 2 pods, "
          f"{args.prefixes} prefixes x {args.prefix_tokens} tokens + {args.suffix_tokens} vs "
          f"{args.prefix_tokens + args.suffix_tokens} unique, {args.osl} out, {args.requests} "
          f"requests, concurrency {args.concurrency}) — {machine_info()}", flush=True)
    reports, pods = {}, {}
    with LocalCluster(nodes=2, model=MODEL, node_args=node_args, run_dir=work / "run") as c:
        assert c.router is not None and c.router.http_port is not None
        url = f"http://127.0.0.1:{c.router.http_port}"
        for name, shared in (("shared prefixes", True), ("unique prompts", False)):
            reset_pods(c)
            before = [scrape(pod) for pod in c.pods]
            print(f"\n## guidellm's report: {name}", flush=True)
            out = work / f"{'shared' if shared else 'unique'}.json"
            argv = guidellm_argv(exe, args, url, tokenizer, shared, out)
            print("$ HF_HUB_OFFLINE=1 " + " ".join(argv), flush=True)
            reports[name] = run_guidellm(argv, out)
            time.sleep(0.5)  # the last stream's counters
            pods[name] = pods_since(c, before)
    names = list(reports)
    print(f"\n| metric | {' | '.join(names)} | shared / unique |")
    print("|---|" + "---|" * (len(names) + 1))
    for label, key, which in ROWS:
        a, b = (stat(reports[n], key, which) for n in names)
        print(f"| {label} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    a, b = (pods[n]["hit_share"] * 100 for n in names)
    print(f"| pods' prefix-cache hit share % | {a:.1f} | {b:.1f} | - |")
    done = [reports[n]["metrics"]["request_totals"]["successful"] for n in names]
    cells = [f"{d} / {pods[n]['finished']:.0f}" for d, n in zip(done, names, strict=True)]
    print(f"| requests guidellm completed / pods finished | {' | '.join(cells)} | "
          f"of {args.requests} sent, none errored |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args),
                       "results": {n: {**{k + "." + w: stat(r, k, w) for _, k, w in ROWS},
                                       **pods[n]}
                                   for n, r in reports.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
