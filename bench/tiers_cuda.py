"""DRAM tier on CUDA: restore bandwidth, and time to first token restoring vs recomputing.

For each prefix length (2,048 and 16,384 tokens by default) plus a 32-token suffix, on a
dummy-weight Llama-shaped model (`bench-1b`: 16 layers, 8 KV heads of 64, 32 KiB of bf16 KV
per token; or `pagekv-small-32k`):

- restore GB/s: the prefix's blocks, demoted into the DRAM tier's pinned slab, copied back
  into the pool by `BlockTransfer.from_host` (one async copy per contiguous slot run into the
  staging tensor, one scatter per chunk, on the copy stream), timed by the stream's events;
  demotion (`to_host`) likewise;
- TTFT, from the host's point of view (synchronized on the first token):
  * recompute: prefix + suffix prefilled in chunks of `--chunk` tokens (the engine's
    max_num_batched_tokens), as a cold request;
  * DRAM: restore the prefix, then the suffix's forward on top of it (the compute stream
    waits for the copy's event);
  * pool: the suffix's forward on a prefix already in the pool (the floor);
- checks: the restored blocks equal the computed ones byte for byte, and the first token
  after a restore equals the one after a pool hit (same shapes, same kernels).

It drives the model runner, the DRAM tier and the transfer directly: the same code the
engine runs, without the engine's scheduler, whose import chain needs xxhash and cbor2
(proto.hashing). Imports: torch (+ triton, through the attention backend) and the project's
kvnode.model, kvnode.engine.block_transfer, tiers.dram, tiers.copy_stream — nothing else.

    python -m bench.tiers --device cuda [--lengths 2048,16384] [--model bench-1b] [--json P]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import torch

from pagekv.kvnode.engine.block_transfer import BlockTransfer
from pagekv.kvnode.model import presets
from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem
from pagekv.tiers.copy_stream import CopyStream, CudaCopyStream, contiguous_runs
from pagekv.tiers.dram import DramTier

SUFFIX = 32
BLOCK = 16


def register_models() -> None:
    """Long-context dummy models for this benchmark (the built-in presets stop at 4,096)."""
    small = presets.preset_config("pagekv-small")
    models = {
        "pagekv-small-32k": dataclasses.replace(small, name="pagekv-small-32k",
                                                max_position_embeddings=32768),
        "bench-1b": dataclasses.replace(
            small, name="bench-1b", hidden_size=2048, intermediate_size=5632,
            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=32768),
    }
    for name, cfg in models.items():
        presets.PRESETS.setdefault(name, (cfg, 777))


class SyncStream(CopyStream):
    """--cpu-smoke only: a CPU "stream" that runs everything at once (numbers meaningless)."""

    device = torch.device("cpu")
    pin_memory = False

    class _Done:
        def __init__(self) -> None:
            self.t = time.perf_counter()

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            return None

    def submit(self, work) -> None:
        work()

    def record(self):
        return self._Done()

    def elapsed_s(self, start, end) -> float:
        return end.t - start.t

    def wait_compute(self) -> None:
        return None

    def order_compute(self, event) -> None:
        return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def block_bytes_of(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """The blocks' packed bytes, gathered on the pool's device (no numpy needed)."""
    rows = torch.empty((len(ids), runner.block_bytes), dtype=torch.uint8, device=runner.device)
    runner.kv_cache.gather_rows(torch.tensor(ids, device=runner.device), rows)
    return rows


def prefill(runner: ModelRunner, tokens: list[int], start: int, blocks: list[int],
            chunk: int) -> int:
    """Prefill tokens[start:] over the cached tokens[:start] in chunks; the greedy token."""
    pos = start
    logits = None
    while pos < len(tokens):
        n = min(chunk, len(tokens) - pos)
        logits = runner.execute([SeqBatchItem(tokens[pos:pos + n], pos, blocks)])
        pos += n
    assert logits is not None
    return int(logits[0].argmax())


def one_length(runner: ModelRunner, transfer: BlockTransfer, dram: DramTier, n_prefix: int,
               chunk: int, trials: int, seed: int) -> dict:
    dev = runner.device
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    tokens = torch.randint(0, vocab, (n_prefix + SUFFIX,), generator=gen).tolist()
    nb = -(-len(tokens) // BLOCK)
    n_pre = n_prefix // BLOCK  # full prefix blocks
    home = list(range(nb))  # where the prompt is computed
    other = list(range(nb, nb + n_pre))  # where the restored prefix lands
    restored_table = other + home[n_pre:]
    slots = list(range(n_pre))
    bb = runner.block_bytes
    stream = transfer.stream

    first_cold = prefill(runner, tokens, 0, home, chunk)  # also warms the kernels up
    original = block_bytes_of(runner, home[:n_pre])
    out: dict = {"prefix_tokens": n_prefix, "blocks": n_pre, "block_bytes": bb,
                 "bytes": n_pre * bb, "host_copy_runs": len(contiguous_runs(slots))}

    def timed(fn) -> float:
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        return time.perf_counter() - t0

    demote_s, restore_s, restore_wall = [], [], []
    copies = []

    def restore() -> None:
        copies.append(transfer.from_host(other, dram.slab, slots))
        copies[-1].done.synchronize()

    for _ in range(trials + 1):  # the first round warms up
        down = transfer.to_host(home[:n_pre], dram.slab, slots)
        down.done.synchronize()
        demote_s.append(transfer.seconds(down))
        restore_wall.append(timed(restore))
        restore_s.append(transfer.seconds(copies[-1]))
    out["restore_equal"] = bool(torch.equal(block_bytes_of(runner, other), original))

    ttft: dict[str, list[float]] = {"recompute": [], "DRAM": [], "pool": []}
    firsts: dict[str, int] = {}
    for trial in range(trials + 1):
        def recompute() -> None:
            firsts["recompute"] = prefill(runner, tokens, 0, home, chunk)

        def from_dram() -> None:
            copy = transfer.from_host(other, dram.slab, slots)
            stream.order_compute(copy.done)  # the suffix's forward reads what it wrote
            firsts["DRAM"] = prefill(runner, tokens, n_pre * BLOCK, restored_table, chunk)

        def from_pool() -> None:
            firsts["pool"] = prefill(runner, tokens, n_pre * BLOCK, home, chunk)

        for name, fn in (("recompute", recompute), ("DRAM", from_dram), ("pool", from_pool)):
            t = timed(fn)
            if trial:
                ttft[name].append(t)
    med = {k: statistics.median(v) for k, v in ttft.items()}
    gb = n_pre * bb / 1e9
    out.update(
        demote_GBps=gb / statistics.median(demote_s[1:]),
        restore_GBps=gb / statistics.median(restore_s[1:]),
        restore_wall_ms=statistics.median(restore_wall[1:]) * 1e3,
        ttft_ms={k: v * 1e3 for k, v in med.items()},
        recompute_over_dram=med["recompute"] / med["DRAM"],
        first_token_dram_equals_pool=firsts["DRAM"] == firsts["pool"],
        first_token_cold=first_cold, first_tokens=firsts,
    )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda"])
    ap.add_argument("--lengths", default="2048,16384", help="prefix lengths, comma-separated")
    ap.add_argument("--model", default="bench-1b",
                    help="bench-1b, pagekv-small-32k, or any model the runner loads")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (recompute)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the script's code on CPU with a synchronous stand-in stream "
                         "(checks the benchmark itself; the numbers mean nothing)")
    args = ap.parse_args(argv)
    register_models()
    lengths = [int(x) for x in args.lengths.split(",")]
    device = "cpu" if args.cpu_smoke else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    longest = max(lengths) + SUFFIX
    need = 2 * (-(-longest // BLOCK)) + 2
    runner = ModelRunner(args.model, block_size=BLOCK, num_gpu_blocks=need, device=device,
                         max_model_len=longest, max_num_batched_tokens=args.chunk)
    stream = CudaCopyStream(runner.device) if device == "cuda" else SyncStream()
    transfer = BlockTransfer(runner.kv_cache, stream)
    dram = DramTier((longest // BLOCK) * runner.block_bytes, runner.block_bytes,
                    copy_stream=stream)
    gpu = torch.cuda.get_device_name(runner.device) if device == "cuda" else "CPU (smoke)"
    info = (f"{gpu}, torch {torch.__version__}, Python {platform.python_version()}, "
            f"model {args.model}, {runner.kv_bytes_per_token} B of KV per token, "
            f"slab pinned: {dram.pinned}, staging {transfer.staging_rows} blocks")
    print(f"# DRAM tier on {device}: restore vs recompute — {info}")
    rows = [one_length(runner, transfer, dram, n, args.chunk, args.trials, seed=n)
            for n in lengths]
    print("\n| prefix | KV MB | demote GB/s | restore GB/s | restore ms (wall) | TTFT recompute "
          "ms | TTFT DRAM ms | TTFT pool ms | recompute / DRAM | restored bytes equal | "
          "first token DRAM = pool |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["ttft_ms"]
        print(f"| {r['prefix_tokens']:,} | {r['bytes'] / 1e6:.0f} | {r['demote_GBps']:.1f} | "
              f"{r['restore_GBps']:.1f} | {r['restore_wall_ms']:.2f} | {t['recompute']:.1f} | "
              f"{t['DRAM']:.1f} | {t['pool']:.1f} | {r['recompute_over_dram']:.1f}x | "
              f"{r['restore_equal']} | {r['first_token_dram_equals_pool']} |")
    goals = all(r["restore_GBps"] >= 20 and r["recompute_over_dram"] > 1 for r in rows)
    print(f"\ngoals (restore >= 20 GB/s, DRAM faster than recompute at every length): {goals}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
