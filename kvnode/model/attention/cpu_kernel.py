"""C++/OpenMP paged attention for CPU, built on first use.

The extension (``csrc/paged_attention.cpp``) reads K/V blocks in place through the block
table with an online softmax, so no per-step gather copy of the context is made. It is
compiled just-in-time with ``torch.utils.cpp_extension.load`` the first time
:func:`available` is called; the build directory is cached (``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/pagekv/torch_extensions``), keyed by torch version and CPU, so only the first
process on a machine pays for the compile. When the build fails, :func:`available` returns
False and logs one warning; callers then use the pure-torch path (``kvnode.model.attention.paged``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

EXTENSION_NAME = "pagekv_paged_attention"
_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"

# Tried in order: the first that compiles and passes a smoke check is used. -march=native is
# worth ~2x here (AVX-512/AVX2 FMA, F16C); the portable build is the safety net.
_FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
)

_lock = threading.Lock()
_ext: ModuleType | None = None
_tried = False


def _cpu_tag() -> str:
    """Identify the CPU so a -march=native build is never loaded on a different machine that
    shares the cache directory."""
    desc = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    desc += line
                if line.strip() == "":
                    break  # the first processor's entry is enough
    except OSError:
        pass
    return hashlib.sha256(desc.encode()).hexdigest()[:12]


def _build_root() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "pagekv" / "torch_extensions"
    return root


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


def _build() -> ModuleType | None:
    from torch.utils.cpp_extension import load

    base = f"torch{torch.__version__.split('+')[0]}-{platform.python_version()}-{_cpu_tag()}"
    errors: list[str] = []
    for flags in _FLAG_SETS:
        variant = "native" if "-march=native" in flags else "generic"
        build_dir = _build_root() / f"{EXTENSION_NAME}-{base}-{variant}"
        build_dir.mkdir(parents=True, exist_ok=True)
        logger.info("loading C++ paged attention (%s) from %s", " ".join(flags), build_dir)
        try:
            ext = load(
                name=f"{EXTENSION_NAME}_{variant}",
                sources=[str(_SOURCE)],
                extra_cflags=list(flags),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
            if _smoke_check(ext):
                return ext
            errors.append(f"{variant}: smoke check gave wrong results")
        except Exception as exc:  # compiler missing, bad flags, load error: all mean fallback
            errors.append(f"{variant}: {type(exc).__name__}: {str(exc).strip()[-400:]}")
    logger.warning(
        "C++ paged attention unavailable, using the pure-torch path (%s)", "; ".join(errors)
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
