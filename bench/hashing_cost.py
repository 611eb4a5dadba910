"""Cost of chained block hashing: PageKV's proto.hashing vs vLLM's reference functions.

Per algorithm, the µs per 16-token block of a chained prompt hash (parent = previous block's
hash), for our code (hash_prompt, the path pods and the router use) and for the reference
functions written inline below exactly as vLLM defines them, measured side by side in one run;
plus the share of each that is serialization, and whether both produce the same bytes.

    .venv/bin/python bench/hashing_cost.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import pickle
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import cbor2
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagekv.proto.hashing import (  # noqa: E402
    DEFAULT_HASH_SEED,
    HASH_ALGOS,
    HashConfig,
    RequestBlockHasher,
    cbor_dumps,
    hash_prompt,
    pickle_dumps,
)

BLOCK_SIZE = 16
N_BLOCKS = 64
VOCAB = 128_256  # Llama 3: most ids need CBOR's 3- or 5-byte form


# --- vLLM's reference functions, verbatim in behaviour --------------------------------------
def ref_pickle(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def ref_cbor(obj: object) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def ref_sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def ref_sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def ref_xxhash(obj: object) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def ref_xxhash_cbor(obj: object) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


REFERENCE: dict[str, tuple[Callable[[object], bytes], Callable[[object], bytes]]] = {
    "sha256": (ref_sha256, ref_pickle),
    "sha256_cbor": (ref_sha256_cbor, ref_cbor),
    "xxhash": (ref_xxhash, ref_pickle),
    "xxhash_cbor": (ref_xxhash_cbor, ref_cbor),
}


def ref_chain(hash_fn: Callable[[object], bytes], tokens: list[int],
              extras: list[object] | None = None) -> list[bytes]:
    """vLLM's chain: hash_fn((parent or root, tuple(block tokens), extra_keys))."""
    parent = hash_fn(DEFAULT_HASH_SEED)
    out = []
    for i in range(len(tokens) // BLOCK_SIZE):
        extra = extras[i] if extras is not None else None
        parent = hash_fn((parent, tuple(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]), extra))
        out.append(parent)
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _median_ns_per_block(fns: list[Callable[[], object]], loops: int, repeats: int) -> list[float]:
    """Median ns per block of each fn (each hashes N_BLOCKS blocks), interleaved per repeat
    so that machine noise hits every contender alike."""
    samples: list[list[float]] = [[] for _ in fns]
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for k, fn in enumerate(fns):
                t0 = time.perf_counter_ns()
                for _ in range(loops):
                    fn()
                samples[k].append((time.perf_counter_ns() - t0) / (loops * N_BLOCKS))
    finally:
        if gc_was:
            gc.enable()
    return [statistics.median(s) for s in samples]


def _identical(algo: str, tokens: list[int]) -> bool:
    """Our chain == the reference chain, plain and with every kind of extra key."""
    config = HashConfig(algo)
    ref_hash, _ = REFERENCE[algo]
    if hash_prompt(config, BLOCK_SIZE, tokens) != ref_chain(ref_hash, tokens):
        return False
    lora = ("adapter", "/models/lora/adapter")
    mm = [("img-0", 20, 40)]
    ours = hash_prompt(config, BLOCK_SIZE, tokens, "tenant-a", lora, mm)
    extras: list[object] = []
    for i in range(len(tokens) // BLOCK_SIZE):
        keys: list[tuple] = [("lora", *lora)]
        begin = i * BLOCK_SIZE
        if 20 < begin + BLOCK_SIZE and 60 > begin:
            keys.append(("mm", "img-0", 20 - begin))
        if i == 0:
            keys.append(("cache_salt", "tenant-a"))
        extras.append(tuple(keys))
    return ours == ref_chain(ref_hash, tokens, extras)


def _serialize_all(ser: Callable[[object], bytes], objs: list[tuple]) -> list[bytes]:
    return [ser(o) for o in objs]


def measure(quick: bool) -> list[dict]:
    loops, repeats = (100, 11) if quick else (300, 25)
    rng = random.Random(0)
    tokens = [rng.randrange(VOCAB) for _ in range(N_BLOCKS * BLOCK_SIZE)]
    rows = []
    for algo in HASH_ALGOS:
        config = HashConfig(algo)
        ref_hash, ref_ser = REFERENCE[algo]
        ours_ser = pickle_dumps if ref_ser is ref_pickle else cbor_dumps
        chain = ref_chain(ref_hash, tokens)
        # The exact objects each block serializes, for the serialization-only timings.
        objs = [(chain[i - 1] if i else config.root,
                 tuple(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]), None)
                for i in range(N_BLOCKS)]
        ser_ok = all(ours_ser(o) == ref_ser(o) for o in objs)

        ours_ns, ref_ns, ours_ser_ns, ref_ser_ns = _median_ns_per_block([
            partial(hash_prompt, config, BLOCK_SIZE, tokens),
            partial(ref_chain, ref_hash, tokens),
            partial(_serialize_all, ours_ser, objs),
            partial(_serialize_all, ref_ser, objs),
        ], loops, repeats)
        rows.append({
            "algo": algo,
            "ours_us": ours_ns / 1e3,
            "ref_us": ref_ns / 1e3,
            "speedup": ref_ns / ours_ns,
            "ours_ser_share": ours_ser_ns / ours_ns,
            "ref_ser_share": ref_ser_ns / ref_ns,
            "ours_ser_us": ours_ser_ns / 1e3,
            "ref_ser_us": ref_ser_ns / 1e3,
            "identical": ser_ok and _identical(algo, tokens),
        })
    return rows


def measure_cbor_paths(quick: bool) -> list[dict]:
    """Canonical CBOR of one block, ours vs cbor2, on the paths the fast encoder can take."""
    loops, repeats = (100, 11) if quick else (300, 25)
    rng = random.Random(1)
    parents = [rng.randbytes(32) for _ in range(N_BLOCKS)]

    def blocks(lo: int, hi: int) -> list[list[int]]:
        return [[rng.randrange(lo, hi) for _ in range(BLOCK_SIZE)] for _ in range(N_BLOCKS)]

    warm = blocks(2, VOCAB)
    # 1 == True: the bool guard must not push these off the fast path (Llama-2 BOS, Llama-3 '"').
    with_one = [b[:3] + [1] + b[4:] for b in warm]
    lora_mm = (("lora", "sql-adapter", "/adapters/sql-adapter"), ("mm", "img-7f3a", -5))
    cases = [
        ("warm ids, no extra keys", warm, None),
        ("block holding id 0 or 1", with_one, None),
        # ids >= 2**18 are never cached: every repeat pays what a first sighting of an id does.
        ("ids not cached: first sighting", blocks(1 << 18, 1 << 20), None),
        ("warm ids, lora + mm keys", warm, lora_mm),
    ]
    rows = []
    for name, token_blocks, extra in cases:
        objs = [(parents[i], tuple(token_blocks[i]), extra) for i in range(N_BLOCKS)]
        identical = all(cbor_dumps(o) == ref_cbor(o) for o in objs)  # also warms the cache
        ours_ns, ref_ns = _median_ns_per_block([
            partial(_serialize_all, cbor_dumps, objs),
            partial(_serialize_all, ref_cbor, objs),
        ], loops, repeats)
        rows.append({"case": name, "ours_us": ours_ns / 1e3, "ref_us": ref_ns / 1e3,
                     "speedup": ref_ns / ours_ns, "identical": identical})
    return rows


def measure_decode_step(quick: bool) -> float:
    """ns per RequestBlockHasher.extend call that finds no new full block (per decoded token)."""
    hasher = RequestBlockHasher(HashConfig(), BLOCK_SIZE)
    tokens = list(range(N_BLOCKS * BLOCK_SIZE + 5))
    hashes: list[bytes] = []
    hasher.extend(tokens, hashes)
    n = 20_000 if quick else 200_000
    extend = hasher.extend
    samples = []
    for _ in range(5 if quick else 11):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            extend(tokens, hashes)
        samples.append((time.perf_counter_ns() - t0) / n)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (< 10 s)")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(f"workload: {N_BLOCKS} chained blocks of {BLOCK_SIZE} random ids < {VOCAB}, "
          "no extra keys; median of repeats, interleaved")
    rows = measure(args.quick)
    print(f"{'algo':<12} {'ours µs/blk':>11} {'vLLM µs/blk':>11} {'vLLM/ours':>9} "
          f"{'ours ser µs':>11} {'vLLM ser µs':>11} {'ours ser%':>9} {'vLLM ser%':>9} "
          f"{'identical':>9}")
    for r in rows:
        print(f"{r['algo']:<12} {r['ours_us']:>11.2f} {r['ref_us']:>11.2f} {r['speedup']:>8.2f}x "
              f"{r['ours_ser_us']:>11.2f} {r['ref_ser_us']:>11.2f} "
              f"{r['ours_ser_share']:>8.0%} {r['ref_ser_share']:>8.0%} "
              f"{'yes' if r['identical'] else 'NO':>9}")
    paths = measure_cbor_paths(args.quick)
    print(f"\n{'canonical CBOR of one block':<30} {'ours µs':>8} {'cbor2 µs':>8} "
          f"{'cbor2/ours':>10} {'identical':>9}")
    for r in paths:
        print(f"{r['case']:<30} {r['ours_us']:>8.2f} {r['ref_us']:>8.2f} {r['speedup']:>9.2f}x "
              f"{'yes' if r['identical'] else 'NO':>9}")
    print(f"\ndecode step, no block completed: {measure_decode_step(args.quick):.0f} ns per extend()")
    if not all(r["identical"] for r in rows + paths):
        sys.exit("hash outputs differ from the vLLM reference")


if __name__ == "__main__":
    main()
