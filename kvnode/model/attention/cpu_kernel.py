"""C++/OpenMP paged attention for CPU, built ahead of time (or, failing that, on first use).

The extension (``csrc/paged_attention.cpp``) reads K/V blocks in place through the block
table with an online softmax, so no per-step gather copy of the context is made. `make
install`, the Dockerfile and ``pagekv build-kernels`` compile it ahead of time; a pod then
imports the finished build directly. Where none matches, it is compiled just in time unless
``PAGEKV_KERNEL_JIT=0``. How builds are keyed, cached and locked: ``kernel_build``. When no
build is usable, :func:`available` returns False and logs one warning; callers then use the
pure-torch path (``kvnode.model.attention.paged``).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from types import ModuleType

import torch

from pagekv.kvnode.model.attention.kernel_build import build_dir_for, compile_into, import_built

logger = logging.getLogger(__name__)

JIT_ENV = "PAGEKV_KERNEL_JIT"

# Tried in order: the first that compiles and passes a smoke check is used. -march=native is
# worth ~2x here (AVX-512/AVX2 FMA, F16C); the portable build is the safety net.
_FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
)

_lock = threading.Lock()
_ext: ModuleType | None = None
_tried = False


def _smoke_check(ext: ModuleType) -> bool:
    """One cached token: the output must be exactly that token's V row (times v_scale)."""
    kc = torch.randn(2, 4, 1, 64)
    vc = torch.randn(2, 4, 1, 64)
    q = torch.randn(1, 2, 64)
    out = ext.paged_attention(
        q, kc, vc, torch.tensor([[1, 0]], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
        0.125, 1.0, 2.0, 0,
    )
    expected = (vc[1, 0, 0] * 2.0).expand(1, 2, 64)
    return bool(torch.allclose(out, expected, atol=1e-5))


def _build(jit: bool | None = None) -> ModuleType | None:
    """A finished build that passes the smoke check, compiling one when allowed."""
    if jit is None:
        jit = os.environ.get(JIT_ENV, "1") != "0"
    errors: list[str] = []
    for flags in _FLAG_SETS:
        variant = "native" if "-march=native" in flags else "generic"
        try:
            build_dir = build_dir_for(flags, variant)
        except OSError as exc:  # the source is missing from this install
            errors.append(f"{variant}: {exc}")
            continue
        ext = import_built(build_dir)
        if ext is not None and _smoke_check(ext):
            logger.info("loaded prebuilt C++ paged attention (%s) from %s", " ".join(flags),
                        build_dir)
            return ext
        if not jit:
            errors.append(f"{variant}: not built in {build_dir} and {JIT_ENV}=0")
            continue
        try:
            return compile_into(build_dir, flags, variant, _smoke_check)
        except Exception as exc:  # compiler missing, bad flags, load error: all mean fallback
            errors.append(f"{variant}: {type(exc).__name__}: {str(exc).strip()[-400:]}")
    logger.warning(
        "C++ paged attention unavailable, using the pure-torch path (%s); build it with "
        "`pagekv build-kernels`", "; ".join(errors)
    )
    return None


def _load() -> ModuleType | None:
    global _ext, _tried
    if _tried:
        return _ext
    with _lock:
        if not _tried:
            _ext = _build()
            _tried = True
    return _ext


def available() -> bool:
    """True when the extension is built and loaded (compiles it on the first call)."""
    return _load() is not None


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its whole (paged) context.

    query            [num_tokens, num_heads, head_size] float32
    key/value_cache  [num_blocks, block_size, num_kv_heads, head_size]; fp32, fp16, bf16,
                     fp8 e4m3fn or fp8 e5m2 (fp8 values times k_scale / v_scale)
    block_tables     [num_seqs, max_blocks] int32, padded (padding is never read)
    seq_lens         [num_seqs] int32, context length including the new tokens
    query_start_loc  [num_seqs + 1] int32, cumulative new-token counts

    The new tokens are the last ``query_len`` positions of their sequence and attend
    causally. Returns ``[num_tokens, num_heads, head_size]`` float32. Raises RuntimeError on
    malformed input (including block ids outside the cache) or when the extension is not
    available.
    """
    ext = _ext if _tried else _load()
    if ext is None:
        raise RuntimeError("C++ paged attention is not available; check available() first")
    return ext.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        float(scale), float(k_scale), float(v_scale), 0,
    )


def paged_attention_splits(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int = 0,
    portable: bool = False,
) -> torch.Tensor:
    """:func:`paged_attention` with the tuning knobs exposed, for tests and benchmarks:
    ``num_splits`` forces the number of context partitions (0 = automatic) and ``portable``
    selects the plain auto-vectorised loops even where the AVX-512 path is compiled in."""
    ext = _load()
    if ext is None:
        raise RuntimeError("C++ paged attention is not available; check available() first")
    return ext.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        float(scale), float(k_scale), float(v_scale), int(num_splits), bool(portable),
    )


def has_avx512_path() -> bool:
    """True when the loaded build contains the AVX-512 path (built with -march=native on an
    AVX-512 CPU)."""
    ext = _load()
    return ext is not None and bool(ext.has_avx512_path())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagekv build-kernels`: compile the C++ kernel now, so no pod compiles at start."""
    parser.add_argument("--all", action="store_true",
                        help="build every variant, the portable one too (for an image that "
                             "may run on another CPU than the one that built it)")


def main(args: argparse.Namespace | None = None) -> int:
    if args is not None and args.all:
        failed = 0
        for flags in _FLAG_SETS:
            variant = "native" if "-march=native" in flags else "generic"
            try:
                compile_into(build_dir_for(flags, variant), flags, variant, _smoke_check)
                print(f"C++ paged attention ({variant}) ready")
            except Exception as exc:
                failed += 1
                print(f"C++ paged attention ({variant}) failed: {exc}")
        return 1 if failed == len(_FLAG_SETS) else 0
    ok = available()
    if ok:
        print(f"C++ paged attention ready (AVX-512 path: {has_avx512_path()})")
    else:
        print("C++ paged attention could not be built: see the warning above; pods will use "
              "the pure-torch path")
    return 0 if ok else 1
