"""Offload tiers: SSD tier bandwidth against `dd` direct I/O, and the block codec per KV dtype.

(a) SSD bandwidth, side by side in one run on the same directory, repetitions interleaved:
    * `dd` write: ``dd if=/dev/zero of=F bs=4M count=N oflag=direct conv=fsync``;
      `dd` read:  ``dd if=F of=/dev/null bs=4M iflag=direct``;
    * tier write: `SsdTier.put` of N blocks then `flush()` (timed until every block is on disk:
      write + fdatasync), codec off ("raw": the apples-to-apples disk path) and on ("lz4");
    * tier read: `SsdTier.pop_many` in batches of `--read-batch` blocks (timed until the data
      is verified and decoded in memory), plus single-block `pop` latency.
    Page cache: the tier uses O_DIRECT itself (reported in the table; without it, it drops the
    pages it wrote or read with POSIX_FADV_DONTNEED); before reading, the benchmark also drops
    every segment file's pages (fdatasync + DONTNEED), so tier reads come from the device, as
    dd's O_DIRECT reads do.
(b) Codec, per dtype fp32 / fp16 / bf16 / fp8 (E4M3) on KV-like blocks: compression ratio of
    byte-shuffle + lz4 and of plain lz4, the share of blocks that pass the raw-fallback
    threshold, encode and decode MB/s (one block at a time, as the tier does). The data comes
    from a `KVSource` function argument; the default is synthetic KV (normal values with
    per-channel scales and offsets, K-like outlier channels); pass real KV read from the pool
    to `bench_codec(source=...)` once a model runs.

Usage: ``python -m bench.tiers_io [--quick] [--json PATH] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lz4  # noqa: E402
import lz4.block  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from pagekv.tiers import codec  # noqa: E402
from pagekv.tiers.ssd import SsdTier  # noqa: E402

MiB = 1 << 20
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
}

# (dtype name, block_bytes, n_blocks, seed) -> n_blocks flat uint8 tensors of block_bytes each
KVSource = Callable[[str, int, int, int], list[torch.Tensor]]


def synthetic_kv(dtype: str, block_bytes: int, n_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    """KV-like blocks: [layers, K/V, tokens, heads, head_dim] with per-channel scale and offset.

    Real K has a few large-magnitude channels and channel-wise offsets (RoPE'd keys); V is
    closer to a plain normal. Scales are log-normal per (layer, head, channel).
    """
    tdtype = DTYPES[dtype]
    elem = torch.tensor([], dtype=tdtype).element_size()
    tokens, heads, head_dim = 16, 8, 128
    per_layer = 2 * tokens * heads * head_dim
    n_elems = block_bytes // elem
    layers = max(1, n_elems // per_layer)
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(layers, 2, 1, heads, head_dim, generator=gen) * 0.8)
    offset = torch.randn(layers, 2, 1, heads, head_dim, generator=gen) * 0.5
    offset[:, 1] = 0.0  # V: no channel offset
    out = []
    for _ in range(n_blocks):
        x = torch.randn(layers, 2, tokens, heads, head_dim, generator=gen) * scale + offset
        flat = x.reshape(-1)
        if flat.numel() < n_elems:
            flat = flat.repeat(-(-n_elems // flat.numel()))
        out.append(flat[:n_elems].to(tdtype).view(torch.uint8).reshape(-1).clone())
    return out


# --- machine ------------------------------------------------------------------------------------
def filesystem_of(path: Path) -> str:
    """'<device> <fstype> on <mount point>' for the filesystem holding `path`."""
    best = ("?", "?", "")
    target = str(path.resolve())
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, *_ = line.split()
                if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[2]):
                    best = (dev, fstype, mnt)
    except OSError:
        pass
    return f"{best[0]} {best[1]} on {best[2] or '?'}"


# --- (a) SSD bandwidth --------------------------------------------------------------------------
def _dd(args: list[str]) -> float:
    """Run dd; return its own elapsed seconds (falls back to our clock)."""
    t0 = time.perf_counter()
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - t0
    m = re.search(r"copied, ([0-9.]+) s", proc.stderr)
    return float(m.group(1)) if m else elapsed


def dd_write(path: Path, total: int) -> float:
    return total / _dd(["if=/dev/zero", f"of={path}", "bs=4M", f"count={total // (4 * MiB)}",
                        "oflag=direct", "conv=fsync"]) / 1e6  # fmt: skip


def dd_read(path: Path, total: int) -> float:
    return total / _dd([f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"]) / 1e6


def drop_page_cache(directory: Path) -> None:
    for p in directory.rglob("*.pkv"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_tier(directory: Path, block_bytes: int, total: int, compress: bool) -> SsdTier:
    layout = {"bench": "tiers_io", "block_bytes": block_bytes, "dtype": "float16"}
    return SsdTier(directory, capacity_bytes=2 * total + 256 * MiB, block_bytes=block_bytes,
                   layout=layout, compress=compress)  # fmt: skip


def put_all(tier: SsdTier, hashes: list[bytes], blocks: list[torch.Tensor]) -> None:
    for i, h in enumerate(hashes):
        while not tier.put(h, blocks[i % len(blocks)]):  # backlog full: the disk sets the pace
            time.sleep(0.0002)


def tier_round(
    tier: SsdTier, blocks: list[torch.Tensor], n_blocks: int, read_batch: int, rep: int
) -> dict[str, float]:
    """One timed write + read of `n_blocks` blocks through a warm tier."""
    block_bytes = blocks[0].numel()
    total = n_blocks * block_bytes
    hashes = [(rep * 10_000_000 + i).to_bytes(32, "big") for i in range(n_blocks)]
    before = tier.stats()
    t0 = time.perf_counter()
    put_all(tier, hashes, blocks)
    put_s = time.perf_counter() - t0
    if not tier.flush(600):
        raise RuntimeError("flush timed out")
    write_s = time.perf_counter() - t0
    st = tier.stats()
    drop_page_cache(tier.directory)

    # single-block latency on a sample spread over the data set
    sample = hashes[:: max(1, n_blocks // 32)][:32]
    lat = []
    for h in sample:
        t1 = time.perf_counter()
        if tier.pop(h) is None:
            raise RuntimeError("SSD tier lost a block during the benchmark")
        lat.append(time.perf_counter() - t1)
    rest = [h for h in hashes if tier.contains(h)]
    t0 = time.perf_counter()
    for j in range(0, len(rest), read_batch):
        got = tier.pop_many(rest[j : j + read_batch])
        if any(g is None for g in got):
            raise RuntimeError("SSD tier lost a block during the benchmark")
    read_s = time.perf_counter() - t0
    written = st["raw_bytes_written"] - before["raw_bytes_written"]
    return {
        "write_MBps": total / write_s / 1e6,
        "put_return_MBps": total / put_s / 1e6,
        "read_MBps": len(rest) * block_bytes / read_s / 1e6,
        "pop_p50_ms": statistics.median(lat) * 1e3,
        "disk_bytes_per_block_byte": (st["bytes_written"] - before["bytes_written"]) / max(1.0, written),
        "compressed_share": (st["compressed_entries"] - before["compressed_entries"])
        / max(1.0, st["entries_written"] - before["entries_written"]),
        "direct_io": st["direct_io"],
    }


def bench_io(root: Path, total: int, block_bytes: int, reps: int, read_batch: int,
             source: KVSource = synthetic_kv) -> dict[str, Any]:  # fmt: skip
    n_blocks = total // block_bytes
    blocks = source("fp16", block_bytes, min(n_blocks, max(1, 64 * MiB // block_bytes)), 1)
    runs: dict[str, list[float]] = {}
    tiers = {mode: make_tier(root / f"tier-{mode}", block_bytes, total, compress)
             for mode, compress in (("raw", False), ("lz4", True))}  # fmt: skip
    dd_file = root / "dd.bin"
    try:
        for tier in tiers.values():  # warm-up, untimed: a pod's tier runs warm
            warm = [(99_000_000 + i).to_bytes(32, "big") for i in range(n_blocks)]
            put_all(tier, warm, blocks)
            tier.flush(600)
            tier.pop_many(warm)
        for rep in range(reps):  # interleaved, so a noisy neighbour hits every column alike
            runs.setdefault("dd_write", []).append(dd_write(dd_file, total))
            for mode, tier in tiers.items():
                for k, v in tier_round(tier, blocks, n_blocks, read_batch, rep).items():
                    runs.setdefault(f"{mode}_{k}", []).append(v)
            runs.setdefault("dd_read", []).append(dd_read(dd_file, total))
            dd_file.unlink(missing_ok=True)
    finally:
        for tier in tiers.values():
            tier.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"total_bytes": total, "block_bytes": block_bytes, "reps": reps, "read_batch": read_batch,
            "median": med, "runs": runs}  # fmt: skip


def print_io(res: dict[str, Any]) -> None:
    m = res["median"]
    print(f"\n(a) SSD tier vs dd direct I/O: {res['total_bytes'] / MiB:.0f} MiB in "
          f"{res['block_bytes'] / 1024:.0f} KiB blocks, median of {res['reps']} interleaved runs")  # fmt: skip
    print(f"tier I/O: {'O_DIRECT' if m['raw_direct_io'] else 'buffered + POSIX_FADV_DONTNEED'}")
    print(f"{'path':<34}{'write MB/s':>12}{'read MB/s':>12}{'write/dd':>10}{'read/dd':>10}")
    print(f"{'dd bs=4M oflag/iflag=direct':<34}{m['dd_write']:>12.0f}{m['dd_read']:>12.0f}{'1.00':>10}{'1.00':>10}")
    for mode, label in (("raw", "SsdTier codec off (raw)"), ("lz4", "SsdTier codec on (lz4+shuffle)")):
        w, r = m[f"{mode}_write_MBps"], m[f"{mode}_read_MBps"]
        print(f"{label:<34}{w:>12.0f}{r:>12.0f}{w / m['dd_write']:>10.2f}{r / m['dd_read']:>10.2f}")
    print(f"  put() returns at {m['raw_put_return_MBps']:.0f} MB/s (write-behind); single-block pop p50 "
          f"{m['raw_pop_p50_ms']:.2f} ms raw, {m['lz4_pop_p50_ms']:.2f} ms lz4; codec-on disk bytes per "
          f"block byte {m['lz4_disk_bytes_per_block_byte']:.3f}, blocks stored compressed "
          f"{100 * m['lz4_compressed_share']:.0f}%")  # fmt: skip


# --- (b) codec ----------------------------------------------------------------------------------
def bench_codec(
    block_bytes: int,
    n_blocks: int,
    source: KVSource = synthetic_kv,
    min_ratio: float = codec.DEFAULT_MIN_RATIO,
    reps: int = 3,
) -> list[dict[str, Any]]:
    rows = []
    for name in DTYPES:
        blocks = [b.numpy() for b in source(name, block_bytes, n_blocks, 7)]
        elem = codec.elem_size_of(name)
        raw_total = sum(b.nbytes for b in blocks)
        shuffled = sum(len(lz4.block.compress(codec.shuffle(b, elem), store_size=False)) for b in blocks)
        plain = sum(len(lz4.block.compress(b, store_size=False)) for b in blocks)
        encoded = [codec.encode(b, elem, min_ratio) for b in blocks]
        stored = sum(len(p) for _, p in encoded)
        passed = sum(c != codec.CODEC_RAW for c, _ in encoded)
        # Decode speed of the lz4 path itself (whether or not the threshold kept it).
        packed = [lz4.block.compress(codec.shuffle(b, elem), store_size=False) for b in blocks]
        enc_s = dec_s = float("inf")
        for _ in range(reps):  # best of reps: the box is shared
            t0 = time.perf_counter()
            for b in blocks:
                codec.encode(b, elem, min_ratio)
            t1 = time.perf_counter()
            for p in packed:
                codec.decode_array(codec.CODEC_LZ4_SHUFFLE, p, block_bytes, elem)
            t2 = time.perf_counter()
            enc_s, dec_s = min(enc_s, t1 - t0), min(dec_s, t2 - t1)
        rows.append({
            "dtype": name,
            "ratio_shuffle_lz4": raw_total / shuffled,
            "ratio_plain_lz4": raw_total / plain,
            "stored_ratio": raw_total / stored,
            "blocks_compressed_pct": 100.0 * passed / len(blocks),
            "encode_MBps": raw_total / enc_s / 1e6,
            "decode_MBps": raw_total / dec_s / 1e6,
        })  # fmt: skip
    return rows


def print_codec(rows: list[dict[str, Any]], block_bytes: int, n_blocks: int, min_ratio: float) -> None:
    print(f"\n(b) codec on {n_blocks} KV-like blocks of {block_bytes / 1024:.0f} KiB per dtype "
          f"(raw fallback below ratio {min_ratio})")  # fmt: skip
    print(f"{'dtype':<7}{'shuffle+lz4':>12}{'plain lz4':>11}{'stored':>8}{'blocks lz4':>12}"
          f"{'encode MB/s':>13}{'lz4 decode MB/s':>17}")  # fmt: skip
    for r in rows:
        print(f"{r['dtype']:<7}{r['ratio_shuffle_lz4']:>12.3f}{r['ratio_plain_lz4']:>11.3f}"
              f"{r['stored_ratio']:>8.3f}{r['blocks_compressed_pct']:>11.0f}%"
              f"{r['encode_MBps']:>13.0f}{r['decode_MBps']:>17.0f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--dir", type=Path, help="directory on the SSD to test (default: a temp dir in /var/tmp)")
    ap.add_argument("--block-kib", type=int, default=1024, help="tier block size (default 1 MiB)")
    ap.add_argument("--total-mib", type=int, help="bytes written per run (default 128 quick, 1024 full)")
    ap.add_argument("--reps", type=int, help="interleaved repetitions (default 3 quick, 5 full)")
    ap.add_argument("--read-batch", type=int, default=32, help="blocks per pop_many call")
    args = ap.parse_args(argv)

    total = (args.total_mib or (128 if args.quick else 1024)) * MiB
    total -= total % (4 * MiB)
    reps = args.reps or (3 if args.quick else 5)
    block_bytes = args.block_kib * 1024
    base = args.dir or Path(os.environ.get("PAGEKV_BENCH_DIR", "/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="pagekv-tiers-io-", dir=base))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {machine_info()}; load average {load:.1f} at start (other tenants skew I/O ratios)")
    print(f"directory: {root} ({filesystem_of(root)}); lz4 {lz4.__version__}, numpy {np.__version__}")
    try:
        io = bench_io(root, total, block_bytes, reps, args.read_batch)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_io(io)
    codec_blocks = 16 if args.quick else 64
    rows = bench_codec(block_bytes, codec_blocks)
    print_codec(rows, block_bytes, codec_blocks, codec.DEFAULT_MIN_RATIO)
    if args.json:
        args.json.write_text(json.dumps({
            "machine": machine_info(),
            "loadavg_1m": load,
            "filesystem": filesystem_of(base),
            "io": io,
            "codec": {"block_bytes": block_bytes, "n_blocks": codec_blocks,
                      "min_ratio": codec.DEFAULT_MIN_RATIO, "rows": rows},
        }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
