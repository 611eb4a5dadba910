"""GGUF load-time dequantization: PageKV's own dequantizers (Q4_1, Q8_0) against the types it
hands to gguf-py (Q4_K, Q6_K, IQ4_XS), on the same tensors.

One file per type holds the weight matrices of a Llama of the given size (random blocks, fp16
scales kept normal), written with gguf-py's writer; each row times opening the file with
PageKV's reader and dequantizing every tensor to float32 through ``gguf_quant.dequantize`` (the
loader's path, less the copy into the model), the median of --repeat runs.

Each row's time is also given as a ratio to PageKV's own Q4_1 (the baseline, same run).

    python -m bench.gguf_dequant [--layers 12] [--hidden 768] [--intermediate 2048]
                                 [--vocab 32768] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.machine import machine_info  # noqa: E402
from pagekv.kvnode.model.gguf_quant import dequantize, uses_gguf_py  # noqa: E402
from pagekv.proto.model_files.ggml_types import GGML_TYPES  # noqa: E402
from pagekv.proto.model_files.gguf import GGUFFile  # noqa: E402

# Byte offsets of each block's fp16 scales (ggml's block layouts).
FP16_SCALES = {"Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
TYPES = ("Q4_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS")


def shapes(layers: int, hidden: int, intermediate: int, vocab: int) -> dict[str, tuple[int, int]]:
    """The weight matrices of a Llama (rows, columns), llama.cpp's names."""
    out = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            out[f"blk.{i}.{name}.weight"] = (hidden, hidden)
        out[f"blk.{i}.ffn_gate.weight"] = (intermediate, hidden)
        out[f"blk.{i}.ffn_up.weight"] = (intermediate, hidden)
        out[f"blk.{i}.ffn_down.weight"] = (hidden, intermediate)
    return out


def type_id(name: str) -> int:
    return next(i for i, (n, _, _) in GGML_TYPES.items() if n == name)


def blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    _, block, size = GGML_TYPES[type_id(qtype)]
    out = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, out.shape[0]).astype("<f2").view(np.uint8).reshape(-1, 2)
    for at in FP16_SCALES[qtype]:
        out[:, at : at + 2] = scales
    return out.reshape(rows, -1)


def write_file(path: Path, qtype: str, tensors: dict[str, tuple[int, int]]) -> Path:
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (rows, cols) in tensors.items():
        w.add_tensor(name, blocks(qtype, rows, cols, rng),
                     raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_once(path: Path) -> float:
    t0 = time.perf_counter()
    with GGUFFile(path) as f:
        for info in f.tensors.values():
            dequantize(f.tensor_data(info), info.ggml_type, info.shape, info.name)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 layers, one timed run (make bench)")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.repeat = 2, 1
    tensors = shapes(args.layers, args.hidden, args.intermediate, args.vocab)
    n_values = sum(r * c for r, c in tensors.values())
    print(machine_info())
    print(f"{len(tensors)} tensors, {n_values / 1e6:.1f} M values dequantized to float32")
    print(f"{'type':<8} {'by':<8} {'file MiB':>9} {'seconds':>8} {'M values/s':>11} "
          f"{'÷ Q4_1':>7}")
    baseline: float | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in TYPES:
            path = write_file(Path(tmp) / f"{qtype}.gguf", qtype, tensors)
            load_once(path)  # warm: page cache, gguf-py's import and grids
            times = [load_once(path) for _ in range(args.repeat)]
            median = statistics.median(times)
            by = "gguf-py" if uses_gguf_py(type_id(qtype)) else "PageKV"
            if qtype == "Q4_1":
                baseline = median
            ratio = f"{median / baseline:.2f}x" if baseline else "-"
            print(f"{qtype:<8} {by:<8} {path.stat().st_size / 2**20:>9.1f} {median:>8.3f} "
                  f"{n_values / median / 1e6:>11.1f} {ratio:>7}")
            path.unlink()


if __name__ == "__main__":
    main()
