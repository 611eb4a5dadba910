"""Time to first token with and without a prefix-cache hit, through ModelRunner.

A 2,048-token shared prefix plus a 32-token suffix on ``pagekv-small``:

* ``cold``        prefill all 2,080 tokens into fresh blocks;
* ``prefix hit``  the prefix's 128 blocks are already in the pool (written once, up front);
                  run only the 32 new tokens on top of them.

TTFT = one ``execute`` plus the greedy pick of the first token. Cold and hit runs alternate
in the same process, so machine noise hits both alike; each attention backend available
(pure-torch reference, C++ kernel) is measured side by side. The first tokens of the two
paths are checked to agree.

Usage: ``python -m bench.prefix_ttft [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from pagekv.kvnode.model.attention import get_attention_backend  # noqa: E402
from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem  # noqa: E402

logger = logging.getLogger(__name__)


def _ttft(runner: ModelRunner, item: SeqBatchItem) -> tuple[float, int, torch.Tensor]:
    start = time.perf_counter()
    logits = runner.execute([item])
    token = int(logits[0].argmax())
    return time.perf_counter() - start, token, logits[0]


def measure(backend: str, model: str, prefix_len: int, suffix_len: int, rounds: int,
            hits_per_round: int, seed: int = 0) -> dict:
    bs = 16
    total = prefix_len + suffix_len
    need = -(-total // bs)
    runner = ModelRunner(model, block_size=bs, num_gpu_blocks=2 * need + 2,
                         max_model_len=max(total, 4096), device="cpu",
                         attention_backend=backend)
    rng = random.Random(seed)
    tokens = [runner.model_config.bos_token_id or 0]
    tokens += [rng.randrange(256) for _ in range(total - 1)]
    prefix, suffix = tokens[:prefix_len], tokens[prefix_len:]
    cold_blocks = list(range(need))
    hit_blocks = list(range(need, 2 * need))

    runner.execute([SeqBatchItem(tokens[:64], 0, cold_blocks)])  # warm-up (allocator, threads)
    runner.execute([SeqBatchItem(prefix, 0, hit_blocks)])  # the cached prefix, written once

    cold_t: list[float] = []
    hit_t: list[float] = []
    for _ in range(rounds):
        t, cold_tok, cold_logits = _ttft(runner, SeqBatchItem(tokens, 0, cold_blocks))
        cold_t.append(t)
        for _ in range(hits_per_round):
            t, hit_tok, hit_logits = _ttft(runner, SeqBatchItem(suffix, prefix_len, hit_blocks))
            hit_t.append(t)
    cold_med, hit_med = statistics.median(cold_t), statistics.median(hit_t)
    return {
        "backend": runner.attention.name,
        "cold_ms": 1e3 * cold_med,
        "hit_ms": 1e3 * hit_med,
        "cold_min_ms": 1e3 * min(cold_t),
        "hit_min_ms": 1e3 * min(hit_t),
        "ratio": cold_med / hit_med,
        "same_first_token": cold_tok == hit_tok,
        "max_abs_logit_diff": float((cold_logits - hit_logits).abs().max()),
        "cold_runs": len(cold_t),
        "hit_runs": len(hit_t),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--model", default="pagekv-small")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=32)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    rounds, hits = (3, 4) if args.quick else (9, 5)
    backends = ["torch"]
    if get_attention_backend("auto").name == "cpp":
        backends.append("cpp")
    rows = [measure(b, args.model, args.prefix, args.suffix, rounds, hits) for b in backends]

    print(f"prefix TTFT: {args.model}, {args.prefix}-token cached prefix + {args.suffix} new "
          f"tokens, block size 16, fp32 KV")
    print(f"machine: {machine_info()}, torch threads {torch.get_num_threads()}")
    print(f"{'backend':<8} {'cold TTFT ms':>13} {'hit TTFT ms':>12} {'cold/hit':>9} "
          f"{'same 1st tok':>13} {'max |dlogit|':>13}")
    for r in rows:
        print(f"{r['backend']:<8} {r['cold_ms']:>13.1f} {r['hit_ms']:>12.2f} "
              f"{r['ratio']:>8.1f}x {str(r['same_first_token']):>13} "
              f"{r['max_abs_logit_diff']:>13.2e}")
    print("(medians; target cold/hit >= 8x)")
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "prefix_ttft", "model": args.model, "prefix_tokens": args.prefix,
            "suffix_tokens": args.suffix, "machine": machine_info(),
            "torch_threads": torch.get_num_threads(), "results": rows,
        }, indent=2))
    return 0 if all(r["same_first_token"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
