"""Offload tiers in the engine: time to first token by where the prefix comes from.

1. TTFT for a 2,048-token prefix + 32-token suffix on `pagekv-small`, the prefix served from
   the pool, DRAM, SSD, or recomputed — side by side (targets: DRAM ≤ 1.5x pool, DRAM ≥ 5x
   faster than recompute, SSD faster than recompute).
2. Codec ratio and MB/s on REAL KV blocks of the model, per KV dtype.
3. SSD tier bandwidth vs `dd` direct I/O on the same directory: `python -m bench.tiers_io`.
4. `--device cuda`: the DRAM tier on CUDA, restore GB/s and TTFT restoring vs recomputing a
   2k and a 16k prefix (bench/tiers_cuda.py; imports only torch, triton and the project).

    python -m bench.tiers [--quick] [--json PATH] [--dir DIR]
    python -m bench.tiers --device cuda [--lengths 2048,16384] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import machine_info

# The CPU benchmark's imports (the engine: xxhash, cbor2; the codec and tiers_io: lz4, numpy)
# come in main(), after --device cuda has gone to bench.tiers_cuda, which needs none of them.
LLM = codec = drop_page_cache = ONE = None

MODEL = "pagekv-small"
PREFIX_LEN, SUFFIX_LEN = 2048, 32


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def make_llm(source: str, disk_dir: Path) -> LLM:
    # The pool holds one 2,080-token request plus a little: the filler evicts the prefix.
    kw: dict = {"num_gpu_blocks": 140, "max_model_len": 2100}
    if source == "CPU":
        kw["cpu_offload_bytes"] = 512 << 20
    elif source == "DISK":
        kw.update(disk_offload_bytes=1 << 30, disk_offload_dir=str(disk_dir))
    return LLM(MODEL, **kw)


def ttft_once(source: str, disk_dir: Path, trial: int) -> tuple[float, dict, list[int]]:
    llm = make_llm(source, disk_dir)
    prefix = tokens(PREFIX_LEN, 100 + trial)
    target = prefix + tokens(SUFFIX_LEN, 200 + trial)
    if source != "recompute":
        llm.generate([prefix + tokens(SUFFIX_LEN, 300 + trial)], ONE)  # caches the prefix
    if source in ("CPU", "DISK"):
        llm.generate([tokens(PREFIX_LEN + SUFFIX_LEN, 400 + trial)], ONE)  # evicts it
        if source == "DISK":
            llm.engine.tiers.chain.ssd.flush()
            drop_page_cache(disk_dir)
    t0 = time.perf_counter()
    out = llm.generate([target], ONE)[0]
    ttft = time.perf_counter() - t0
    llm.engine.close()
    return ttft, out.cached_tokens_by_tier, out.outputs[0].token_ids


def real_kv_blocks(kv_dtype: str, n_blocks: int) -> tuple[list[torch.Tensor], int]:
    llm = LLM(MODEL, kv_cache_dtype=kv_dtype, num_gpu_blocks=n_blocks + 8,
              max_model_len=n_blocks * 16 + 64)
    text = "The paged KV cache keeps blocks of keys and values for every layer. " * 40
    llm.generate([llm.tokenizer.encode(text)[: n_blocks * 16]], ONE)
    runner = llm.engine.runner
    cached = llm.engine.kv_manager.idle_cached_blocks()  # nothing runs: every cached block
    blocks = [runner.read_block(b.block_id) for b in cached]
    return blocks, runner.block_bytes


def codec_rows(n_blocks: int) -> list[dict]:
    rows = []
    for kv_dtype, name in (("auto", "float32"), ("fp16", "float16"), ("bf16", "bfloat16"),
                           ("fp8", "float8_e4m3fn")):
        blocks, block_bytes = real_kv_blocks(kv_dtype, n_blocks)
        elem = codec.elem_size_of(name)
        raw = sum(b.numel() for b in blocks)
        t0 = time.perf_counter()
        # min_ratio=1.0: measure what the codec achieves, not what the threshold keeps.
        encoded = [codec.encode(b.numpy(), elem, 1.0) for b in blocks]
        t1 = time.perf_counter()
        for (cid, payload), b in zip(encoded, blocks, strict=True):
            assert codec.decode(cid, payload, b.numel(), elem) == b.numpy().tobytes()
        t2 = time.perf_counter()
        stored = sum(len(p) for _, p in encoded)
        rows.append({"kv_dtype": kv_dtype, "block_bytes": block_bytes, "blocks": len(blocks),
                     "ratio": raw / stored, "encode_MBps": raw / (t1 - t0) / 1e6,
                     "decode_MBps": raw / (t2 - t1) / 1e6})
    return rows


def _import_cpu_benchmark() -> None:
    global LLM, codec, drop_page_cache, ONE
    from bench.tiers_io import drop_page_cache
    from pagekv.kvnode.engine.llm import LLM
    from pagekv.kvnode.engine.sampling_params import SamplingParams
    from pagekv.tiers import codec

    ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def main() -> None:
    global MODEL  # --model replaces the default the helpers read
    if "--device" in sys.argv:
        i = sys.argv.index("--device")
        if sys.argv[i + 1:i + 2] == ["cuda"]:
            from bench.tiers_cuda import main as cuda_main

            return cuda_main(sys.argv[1:])
    _import_cpu_benchmark()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--dir", help="directory for the SSD tier (default: a temp dir in /var/tmp)")
    ap.add_argument("--model", default=MODEL, help="e.g. smollm2-135m-instruct (a real model)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the DRAM tier on CUDA (bench/tiers_cuda.py)")
    args = ap.parse_args()
    MODEL = args.model
    torch.set_num_threads(2)
    info = machine_info()
    print(f"# Tier benchmark ({MODEL}) — {info}")
    trials = 2 if args.quick else 5
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="pagekv-tiers-",
                                                                 dir="/var/tmp"))
    results: dict[str, list[float]] = {}
    by_tier: dict[str, dict] = {}
    first_tokens: dict[str, list[int]] = {}
    for trial in range(trials):  # interleaved, so load drift hits every source alike
        for source in ("GPU", "CPU", "DISK", "recompute"):
            ttft, tiers_used, toks = ttft_once(source, root / f"{source}-{trial}", trial)
            results.setdefault(source, []).append(ttft)
            by_tier[source] = {str(k): v for k, v in tiers_used.items()}  # Medium -> "GPU"
            if trial == 0:
                first_tokens[source] = toks
    med = {s: statistics.median(v) for s, v in results.items()}
    print(f"\n## TTFT, {PREFIX_LEN}-token prefix + {SUFFIX_LEN}-token suffix "
          f"(median of {trials})")
    print("| prefix from | TTFT ms | cached tokens by tier | vs pool | recompute / this |")
    print("|---|---|---|---|---|")
    names = {"GPU": "pool", "CPU": "DRAM tier", "DISK": "SSD tier", "recompute": "recompute"}
    for s in ("GPU", "CPU", "DISK", "recompute"):
        print(f"| {names[s]} | {med[s] * 1e3:.1f} | {by_tier[s]} | {med[s] / med['GPU']:.2f}x | "
              f"{med['recompute'] / med[s]:.1f}x |")
    same = len({tuple(v) for v in first_tokens.values()}) == 1
    print(f"same first token from every source: {same}")

    rows = codec_rows(16 if args.quick else 48)
    print("\n## Codec (byte-plane shuffle + lz4) on real KV blocks of the model")
    print("| KV dtype | block bytes | blocks | ratio | encode MB/s | decode MB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv_dtype']} | {r['block_bytes']:,} | {r['blocks']} | {r['ratio']:.3f} | "
              f"{r['encode_MBps']:.0f} | {r['decode_MBps']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "ttft_s": results, "codec": rows}, f, indent=2)


if __name__ == "__main__":
    main()
