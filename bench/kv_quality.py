"""KV dtype quality on real text: perplexity and top-1 agreement per KV dtype, the "measure it
on your own data before production" table.

The text is English prose that ships with Python itself: the topics of the Python language
reference in the standard library's `pydoc_data.topics` (what `help()` shows), joined in
sorted order. It is tokenized with the model's own tokenizer and cut into windows of
--window tokens; each window is one prefill whose every position is scored, so the K/V each
token attends to has been written to the pool in the dtype under test and read back from it
(quantisation included). Baseline: fp32 KV ("auto" on CPU), in the same run.

For each dtype: perplexity, its ratio to fp32's, top-1 agreement with the fp32-KV run at every
position, KV bytes per token and the maximum concurrency at max_model_len for a fixed budget.
Also written as a PNG (--png).

    python -m bench.kv_quality [--quick] [--model smollm2-135m-instruct] [--tokens 51200]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem  # noqa: E402

DTYPES = ("auto", "fp16", "bf16", "fp8", "fp8_e5m2")
GiB = 1 << 30


def prose() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def score(runner: ModelRunner, windows: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
    """Total negative log-likelihood of every next token, and each window's argmax row."""
    nll = 0.0
    tops = []
    blocks = list(range(runner.num_blocks))
    for w in windows:
        logits = runner.execute([SeqBatchItem(w, 0, blocks)], all_positions=True)
        logp = torch.log_softmax(logits[:-1], dim=-1)
        target = torch.tensor(w[1:])
        nll -= float(logp.gather(1, target[:, None]).sum())
        tops.append(logits[:-1].argmax(-1))
    return nll, tops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4,096 tokens instead of --tokens")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=51_200)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--png", type=Path, default=Path("docs/kv_quality.png"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    n_tokens = 4096 if args.quick else args.tokens
    t0 = time.perf_counter()
    blocks = -(-args.window // 16)
    runners = {d: ModelRunner(args.model, kv_cache_dtype=d, num_gpu_blocks=blocks,
                              max_model_len=args.window, device="cpu",
                              attention_backend="torch") for d in DTYPES[:1]}
    ids = runners["auto"].tokenizer.encode(prose())
    if len(ids) < n_tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {n_tokens}")
    windows = [ids[i:i + args.window] for i in range(0, n_tokens, args.window)]
    scored = sum(len(w) - 1 for w in windows)
    rows = []
    ref_tops: list[torch.Tensor] = []
    for d in DTYPES:
        r = runners.get(d) or ModelRunner(args.model, kv_cache_dtype=d, num_gpu_blocks=blocks,
                                          max_model_len=args.window, device="cpu",
                                          attention_backend="torch")
        nll, tops = score(r, windows)
        if d == "auto":
            ref_tops = tops
        agree = sum(int((a == b).sum()) for a, b in zip(tops, ref_tops, strict=True))
        # Concurrency at max_model_len for the budget: bytes per token from the runner's pool.
        per_token = r.kv_bytes_per_token
        rows.append({"kv_dtype": "auto (fp32)" if d == "auto" else d,
                     "ppl": math.exp(nll / scored), "top1_agree_pct": 100 * agree / scored,
                     "bytes_per_token": per_token,
                     "max_concurrency": args.budget_gib * GiB / per_token / args.max_model_len})
        del r
    base = rows[0]["ppl"]
    elapsed = time.perf_counter() - t0
    print(f"# KV dtype quality: {args.model}, {scored:,} scored tokens of pydoc_data.topics "
          f"(Python {sys.version.split()[0]}), windows of {args.window} — {machine_info()}")
    print(f"| KV dtype | perplexity | vs fp32 | top-1 agreement with fp32 KV | bytes/token | "
          f"max concurrency at {args.max_model_len} ({args.budget_gib:g} GiB) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['kv_dtype']} | {row['ppl']:.3f} | {row['ppl'] / base:.4f}x | "
              f"{row['top1_agree_pct']:.2f}% | {row['bytes_per_token']:,} | "
              f"{row['max_concurrency']:.1f} |")
    print(f"({elapsed:.0f} s)")
    plot(rows, args.png, f"{args.model}: KV dtype vs quality ({scored:,} tokens)")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "tokens": scored,
                                         "machine": machine_info(), "rows": rows}, indent=2))
    return 0


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["kv_dtype"] for r in rows]
    a.bar(names, [r["ppl"] for r in rows], color="#4878a8")
    a.set_ylim(min(r["ppl"] for r in rows) * 0.98, max(r["ppl"] for r in rows) * 1.01)
    a.set_ylabel("perplexity (lower is better)")
    b.scatter([r["bytes_per_token"] for r in rows], [r["top1_agree_pct"] for r in rows])
    for r in rows:
        b.annotate(r["kv_dtype"], (r["bytes_per_token"], r["top1_agree_pct"]),
                   textcoords="offset points", xytext=(4, 4))
    b.set_xlabel("KV bytes per token")
    b.set_ylabel("top-1 agreement with fp32 KV (%)")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
