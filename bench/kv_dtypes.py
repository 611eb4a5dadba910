"""KV cache dtypes: capacity gained and quality lost.

For each KV dtype (fp32 = ``auto`` on CPU, fp16, bf16, fp8 = E4M3, fp8_e5m2):

* capacity: KV bytes per token, pool tokens and maximum concurrency at ``max_model_len``
  for a fixed memory budget (pure arithmetic from the model shape);
* quality on the built-in model, against fp32 KV, same prompts, all in one run:
  - ``greedy agree``: free-running greedy decoding, % of generated tokens identical to the
    fp32-KV run at the same position;
  - ``forced agree``: teacher-forced on the fp32 tokens, % of steps whose argmax matches
    (isolates per-step error from divergence after a first different token);
  - ``max |dlogit|`` / ``mean |dlogit|``: logit error vs fp32 KV, teacher-forced.

Scales are the fixed default 1.0 (see ``kvnode.model.attention.kv_cache``).

Usage: ``python -m bench.kv_dtypes [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from pagekv.kvnode.model.attention.kv_cache import KVCacheSpec, resolve_kv_dtype  # noqa: E402
from pagekv.kvnode.model.presets import preset_config  # noqa: E402
from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem  # noqa: E402

logger = logging.getLogger(__name__)

DTYPES = ("auto", "fp16", "bf16", "fp8", "fp8_e5m2")
GiB = 1 << 30


def capacity(model: str, budget: int, max_model_len: int, block_size: int) -> list[dict]:
    cfg = preset_config(model)
    rows = []
    for name in DTYPES:
        dtype = resolve_kv_dtype(name, torch.float32)
        spec = KVCacheSpec(cfg.num_hidden_layers, block_size, cfg.num_key_value_heads,
                           cfg.head_dim, dtype)
        blocks = budget // spec.block_bytes
        rows.append({
            "kv_dtype": name if name != "auto" else "auto(fp32)",
            "bytes_per_token": spec.bytes_per_token,
            "pool_tokens": blocks * block_size,
            "max_concurrency": blocks / -(-max_model_len // block_size),
        })
    return rows


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = ("the cache holds keys and values for every layer while blocks move between "
             "pool dram and disk as requests come and go").split()
    out = []
    for _ in range(n):
        length = rng.randrange(96, 480)
        text = " ".join(rng.choice(words) for _ in range(length // 5))
        out.append([256, *list(text.encode())[:length]])
    return out


def _runner(model: str, kv: str, blocks: int) -> ModelRunner:
    return ModelRunner(model, kv_cache_dtype=kv, num_gpu_blocks=blocks, max_model_len=1024,
                       device="cpu", attention_backend="torch")


def _run(r: ModelRunner, prompts: list[list[int]], steps: int,
         forced: list[list[int]] | None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decode (or feed ``forced`` tokens); returns tokens and per-step logits."""
    per = r.num_blocks // len(prompts)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    logits = r.execute([SeqBatchItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    toks: list[list[int]] = [[] for _ in prompts]
    all_logits = [logits]
    for step in range(steps):
        nxt = logits.argmax(-1).tolist()
        for i, seq in enumerate(toks):
            seq.append(forced[i][step] if forced else nxt[i])
        if step == steps - 1:
            break
        logits = r.execute([
            SeqBatchItem([seq[-1]], len(p) + len(seq) - 1, t)
            for p, seq, t in zip(prompts, toks, tables, strict=True)
        ])
        all_logits.append(logits)
    return toks, all_logits


def quality(model: str, n_prompts: int, steps: int) -> list[dict]:
    prompts = _prompts(n_prompts, seed=0)
    blocks = n_prompts * -(-(max(map(len, prompts)) + steps) // 16)
    ref_toks, ref_logits = _run(_runner(model, "auto", blocks), prompts, steps, None)
    ref_greedy = [lg.argmax(-1) for lg in ref_logits]
    rows = []
    for name in DTYPES[1:]:
        r = _runner(model, name, blocks)
        free, _ = _run(r, prompts, steps, None)
        _, forced_logits = _run(r, prompts, steps, ref_toks)
        same = sum(a == b for x, y in zip(free, ref_toks, strict=True)
                   for a, b in zip(x, y, strict=True))
        agree = sum(int((lg.argmax(-1) == g).sum()) for lg, g in zip(forced_logits, ref_greedy,
                                                                        strict=True))
        diffs = torch.stack([(a - b).abs() for a, b in zip(forced_logits, ref_logits,
                                                             strict=True)])
        total = n_prompts * steps
        rows.append({
            "kv_dtype": name,
            "greedy_agree_pct": 100.0 * same / total,
            "forced_agree_pct": 100.0 * agree / total,
            "max_abs_logit_err": float(diffs.max()),
            "mean_abs_logit_err": float(diffs.mean()),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts / tokens")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--model", default="pagekv-small")
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    n_prompts, steps = (4, 16) if args.quick else (8, 32)

    start = time.perf_counter()
    cap = capacity(args.model, int(args.budget_gib * GiB), args.max_model_len, 16)
    qual = quality(args.model, n_prompts, steps)
    elapsed = time.perf_counter() - start

    print(f"KV dtypes on {args.model}: capacity for {args.budget_gib:g} GiB of KV at "
          f"max_model_len={args.max_model_len}, block size 16")
    print(f"machine: {machine_info()}")
    print(f"{'kv dtype':<11} {'bytes/token':>12} {'pool tokens':>12} {'max concurrency':>16} "
          f"{'vs fp16':>8}")
    fp16 = next(r for r in cap if r["kv_dtype"] == "fp16")
    for r in cap:
        print(f"{r['kv_dtype']:<11} {r['bytes_per_token']:>12} {r['pool_tokens']:>12} "
              f"{r['max_concurrency']:>15.2f}x {r['pool_tokens'] / fp16['pool_tokens']:>7.2f}x")
    print(f"\nquality vs fp32 KV: {n_prompts} prompts x {steps} greedy tokens "
          f"(prompts {min(map(len, _prompts(n_prompts, 0)))}-"
          f"{max(map(len, _prompts(n_prompts, 0)))} tokens)")
    print(f"{'kv dtype':<11} {'greedy agree':>13} {'forced agree':>13} {'max |dlogit|':>13} "
          f"{'mean |dlogit|':>14}")
    for r in qual:
        print(f"{r['kv_dtype']:<11} {r['greedy_agree_pct']:>12.1f}% {r['forced_agree_pct']:>12.1f}% "
              f"{r['max_abs_logit_err']:>13.2e} {r['mean_abs_logit_err']:>14.2e}")
    print(f"({elapsed:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "kv_dtypes", "model": args.model, "budget_bytes": int(args.budget_gib * GiB),
            "max_model_len": args.max_model_len, "prompts": n_prompts, "steps": steps,
            "machine": machine_info(), "capacity": cap, "quality": qual,
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
