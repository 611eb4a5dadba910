"""The field's own benchmark client through PageKV's OpenAI API: aiperf, prefix-aware routing
vs round-robin, in the same run.

aiperf (NVIDIA's, from PyPI) drives a shared-prefix chat workload — a pool of long prefixes,
each request one of them plus a unique suffix — against the router of a real local cluster
(two pods serving SmolLM2-135M-Instruct, an embedded Redis), then against a second router on
the same index with `--policy round_robin`. The pods' caches are reset before each run and
aiperf's seed is the same, so both runs send byte-identical requests in the same order. The
pods' pools are sized so that every prefix fits on one pod only when the router partitions
them: round-robin has to recompute what prefix routing finds cached. No DRAM or SSD tier, so
the comparison is the routing alone.

aiperf is installed on first use into its own venv (`--aiperf-venv`, default
`.bench-venvs/aiperf`, pinned `aiperf==0.13.0`: it brings its own transformers); its
tokenizer is a Hugging Face directory written here from the model's GGUF (no hub access).
aiperf's own report (its console table) is printed for each run, then the side-by-side table
with the ratios.

    python -m bench.aiperf_routing [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.machine import machine_info
from pagekv.deploy.local_cluster import LocalCluster, wait_healthy
from pagekv.proto.model_files.presets import model_path
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

MODEL = "smollm2-135m-instruct"
AIPERF = "aiperf==0.13.0"
ROOT = Path(__file__).resolve().parents[1]
ROWS = [  # label, aiperf metric, statistic
    ("TTFT p50 ms", "time_to_first_token", "p50"),
    ("TTFT p90 ms", "time_to_first_token", "p90"),
    ("ITL p50 ms", "inter_token_latency", "p50"),
    ("output tokens/s", "output_token_throughput", "avg"),
    ("requests/s", "request_throughput", "avg"),
    ("cached-token share %", "overall_usage_prompt_cache_read_pct", "avg"),
]


def ensure_aiperf(venv: Path) -> Path:
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        print(f"installing {AIPERF} into {venv} (once; about a minute)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", AIPERF], check=True)
    return exe


def hf_tokenizer(out: Path) -> Path:
    """The model's tokenizer as a Hugging Face directory (what aiperf loads), from its GGUF."""
    if (out / "tokenizer.json").exists():
        return out
    from transformers import AutoConfig, AutoTokenizer

    gguf = model_path(MODEL)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.model_max_length = config.max_position_embeddings  # the GGUF says none
    tok.save_pretrained(out)
    config.save_pretrained(out)
    return out


def aiperf_args(args: argparse.Namespace, url: str, tokenizer: Path, out: Path) -> list[str]:
    return [
        "profile", "--model", MODEL, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", str(tokenizer),
        "--num-prefix-prompts", str(args.prefixes), "--prefix-prompt-length",
        str(args.prefix_tokens), "--isl", "48", "--isl-stddev", "0", "--osl", str(args.osl),
        "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
        "--request-count", str(args.requests), "--concurrency", str(args.concurrency),
        # A rate cap as well: in pure concurrency mode aiperf's scheduler spins on a core.
        "--request-rate", "100", "--arrival-pattern", "constant",
        "--random-seed", "42", "--request-timeout-seconds", "300",
        "--artifact-dir", str(out), "--ui", "none", "--no-gpu-telemetry",
        "--no-server-metrics",
    ]


def reset_pods(cluster: LocalCluster) -> None:
    for pod in cluster.pods:
        with grpc.insecure_channel(pod.address) as ch:
            kv = pb_grpc.KVNodeStub(ch)
            deadline = time.monotonic() + 60
            while not kv.ResetPrefixCache(pb.ResetPrefixCacheRequest(include_tiers=True),
                                          timeout=10).success:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{pod.name} still busy")
                time.sleep(0.2)  # refused while requests run
    time.sleep(1.0)  # the pods' removals reach the index before the next run routes


def run_aiperf(exe: Path, args: argparse.Namespace, url: str, tokenizer: Path,
               out: Path) -> dict:
    # aiperf's offline mode breaks a local tokenizer path: leave the hub variables unset (an
    # absolute path is loaded without any hub call).
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run([str(exe), *aiperf_args(args, url, tokenizer, out)], cwd=out.parent,
                          env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    console = out / "profile_export_console.txt"
    if console.exists():
        print(console.read_text(), flush=True)
    return report


def stat(report: dict, key: str, which: str) -> float:
    metric = report.get(key)
    return float(metric[which]) if isinstance(metric, dict) and metric.get(which) is not None \
        else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--aiperf-venv", default=str(ROOT / ".bench-venvs" / "aiperf"))
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--json")
    args = ap.parse_args()
    args.requests = args.requests or (24 if args.quick else 96)
    exe = ensure_aiperf(Path(args.aiperf_venv))
    work = Path(tempfile.mkdtemp(prefix="pagekv-aiperf-"))
    tokenizer = hf_tokenizer(work / "tokenizer")
    # Each pod's pool holds about 5 of the 8 prompts' blocks (running requests hold cached
    # prefix blocks, not extra ones, but for their few own): enough for its half under prefix
    # routing, not for all 8 under round-robin.
    per_prompt = -(-(args.prefix_tokens + 48 + 48 + args.osl) // 16)
    blocks = per_prompt * (args.prefixes * 5 // 8) + 4 * 8
    node_args = ["--num-gpu-blocks", str(blocks), "--max-model-len", "2048",
                 "--max-num-seqs", str(args.concurrency)]
    print(f"# aiperf through the router: prefix-aware vs round-robin ({MODEL}, 2 pods of "
          f"{blocks} blocks, {args.prefixes} prefixes x {args.prefix_tokens} tokens + 48, "
          f"{args.osl} out, {args.requests} requests, concurrency {args.concurrency}) — "
          f"{machine_info()}", flush=True)
    reports = {}
    with LocalCluster(nodes=2, model=MODEL, node_args=node_args, run_dir=work / "run") as c:
        baseline = c.start_router_process("router-rr", ["--policy", "round_robin"])
        wait_healthy(baseline.address, 60, baseline.proc)
        for name, router in (("prefix-aware", c.router), ("round-robin", baseline)):
            reset_pods(c)
            print(f"\n## aiperf's report: {name} router", flush=True)
            reports[name] = run_aiperf(exe, args, f"http://127.0.0.1:{router.http_port}",
                                       tokenizer, work / name)
    names = list(reports)
    print(f"\n| metric | {' | '.join(names)} | prefix-aware / round-robin |")
    print("|---|" + "---|" * (len(names) + 1))
    for label, key, which in ROWS:
        a, b = (stat(reports[n], key, which) for n in names)
        print(f"| {label} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args),
                       "results": {n: {k: stat(r, k, w) for _, k, w in ROWS}
                                   for n, r in reports.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
