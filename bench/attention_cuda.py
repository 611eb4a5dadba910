"""``bench.attention --device cuda``: the Triton backend against torch's contiguous attention on
the same K/V, and against the GPU's own copy bandwidth (issue #17).

* copy     ``dst.copy_(src)`` of a 2 GiB buffer on the device: the reference bandwidth (bytes
           read + bytes written per second). Decode is bound by reading K/V once, so the goal
           is decode K/V bandwidth >= 80% of this figure.
* decode   one new token per sequence over long contexts, Llama-8B-like heads (32 / 8 KV,
           head 128), the cache in the model's CUDA dtype, blocks at random in the pool.
           ``triton`` is the backend's ``paged_attention`` as the model calls it (its host
           bookkeeping included); ``kernel`` is ``triton_decode.paged_decode`` alone;
           ``sdpa`` / ``flash`` are contiguous ``scaled_dot_product_attention`` (default
           dispatch / forced FlashAttention) over the same K/V in ``[B, ctx, kv_heads, D]``.
           GB/s = bytes of K/V read (every cached token's K and V row, once) / time.
* prefill  cold prompts and an extend over a cached prefix: the backend vs contiguous causal
           SDPA; TFLOP/s counts the causal QK and PV multiply-adds.

Times are triton.testing.do_bench medians (L2 flushed before every call). Imports only torch,
triton and the project's attention modules, so it runs on a bare GPU box.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD = 32, 8, 128
BLOCK = 16
DECODE = ((1, 8192), (1, 32768), (8, 8192), (8, 32768), (32, 8192), (32, 16384), (64, 4096),
          (64, 16384))
QUICK_DECODE = ((1, 32768), (16, 8192), (64, 4096))
PREFILL = (((0, 2048),), ((0, 8192),), ((0, 2048),) * 4, ((8192, 512),), ((32768, 128),))
QUICK_PREFILL = (((0, 2048),), ((8192, 512),))


def median_ms(fn: Callable[[], object], quick: bool) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 200,
                          return_mode="median"))


def copy_bandwidth(device: torch.device, quick: bool) -> float:
    """GB/s moved (read + write) by a device-to-device copy of 2 GiB."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), quick)
    return 2 * n / (ms * 1e-3) / 1e9


def paged_copy(seqs: list[tuple[int, int]], dtype: torch.dtype, device: torch.device,
               gen: torch.Generator) -> dict:
    """seqs: (cached, new). The paged cache (random block placement) and, per sequence,
    the same K/V contiguous as ``[1, ctx, kv_heads, D]``."""
    need = [-(-(c + n) // BLOCK) for c, n in seqs]
    num_blocks = sum(need) + 16
    perm = torch.randperm(num_blocks, generator=gen, device="cpu").to(device)
    key_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, HEAD, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32, device=device)
    contig, used = [], 0
    for i, ((cached, new), nb) in enumerate(zip(seqs, need, strict=True)):
        blocks = perm[used : used + nb]
        used += nb
        tables[i, :nb] = blocks.to(torch.int32)
        ctx = cached + new
        k = torch.randn(1, ctx, KV_HEADS, HEAD, device=device, dtype=dtype)
        v = torch.randn(1, ctx, KV_HEADS, HEAD, device=device, dtype=dtype)
        pad = nb * BLOCK - ctx
        for src, dst in ((k, key_cache), (v, value_cache)):
            dst[blocks] = F.pad(src[0], (0, 0, 0, 0, 0, pad)).view(nb, BLOCK, KV_HEADS, HEAD)
        contig.append((k, v))
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(torch.int32).to(device)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=device)
    return {"key_cache": key_cache, "value_cache": value_cache, "block_tables": tables,
            "seq_lens": seq_lens, "query_start_loc": qsl, "contig": contig}


def sdpa_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flash: bool,
            causal_from: int | None) -> Callable[[], torch.Tensor]:
    """Contiguous SDPA over [B, heads, n, D] views of [B, ctx, heads, D] tensors (no copy).
    causal_from: None for a decode (every key visible); else the cached prefix length."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scale = 1.0 / math.sqrt(HEAD)
    mask, causal = None, False
    if causal_from == 0:
        causal = True
    elif causal_from:  # bottom-right causal: the new tokens are the last positions
        n, ctx = q.shape[1], k.shape[1]
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)

    def call() -> torch.Tensor:
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)

    if not flash:
        return call

    def forced() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return call()

    return forced


def _try_ms(fn: Callable[[], object], quick: bool) -> float | None:
    try:
        fn()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except (RuntimeError, ValueError, TypeError):  # e.g. no flash kernel for these inputs
        return None
    return median_ms(fn, quick)


def _fmt(x: float | None, spec: str = "9.1f") -> str:
    return f"{x:{spec}}" if x is not None else f"{'n/a':>{int(spec.split('.')[0])}}"


def _decode_kernel_ms(q: torch.Tensor, p: dict, scale: float, quick: bool) -> float | None:
    """``triton_decode.paged_decode`` alone, split-K chosen up front (no host sync inside)."""
    try:
        from pagekv.kvnode.model.attention import triton_decode

        ctx = int(p["seq_lens"].max())
        splits = triton_decode.auto_num_splits(q.device, q.shape[0], KV_HEADS, ctx, None)
        args = (q, p["key_cache"], p["value_cache"], p["block_tables"], p["seq_lens"], scale)
        return _try_ms(lambda: triton_decode.paged_decode(*args, num_splits=splits), quick)
    except (ImportError, AttributeError, TypeError):  # the module missing or its API moved
        return None


def decode_case(backend, batch: int, ctx: int, dtype: torch.dtype, device: torch.device,
                gen: torch.Generator, copy_gbs: float, quick: bool) -> dict:
    """One decode row; its tensors are freed when it returns."""
    p = paged_copy([(ctx - 1, 1)] * batch, dtype, device, gen)
    contig = p.pop("contig")
    k = torch.cat([kv[0] for kv in contig])  # [B, ctx, kv_heads, D]
    v = torch.cat([kv[1] for kv in contig])
    del contig
    q = torch.randn(batch, HEADS, HEAD, device=device)  # fp32, as the model passes it
    scale = 1.0 / math.sqrt(HEAD)
    args = (q, p["key_cache"], p["value_cache"], p["block_tables"], p["seq_lens"],
            p["query_start_loc"], scale)
    qc = q.to(dtype).unsqueeze(1)  # [B, 1, heads, D]
    t_triton = median_ms(lambda: backend.paged_attention(*args), quick)
    t_kernel = _decode_kernel_ms(q, p, scale, quick)
    t_sdpa = _try_ms(sdpa_fn(qc, k, v, False, None), quick)
    t_flash = _try_ms(sdpa_fn(qc, k, v, True, None), quick)
    want = sdpa_fn(qc, k, v, False, None)()[:, :, 0].float()  # [B, heads, D]
    err = float((backend.paged_attention(*args) - want).abs().max())
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD * k.element_size()
    gbs = {n: (kv_bytes / (t * 1e-3) / 1e9 if t else None)
           for n, t in (("triton", t_triton), ("kernel", t_kernel), ("sdpa", t_sdpa),
                        ("flash", t_flash))}
    best_sdpa = min((t for t in (t_sdpa, t_flash) if t is not None), default=float("nan"))
    return {"batch": batch, "ctx": ctx, "kv_bytes": kv_bytes, "triton_ms": t_triton,
            "kernel_ms": t_kernel, "sdpa_ms": t_sdpa, "flash_ms": t_flash,
            **{f"{n}_gbs": g for n, g in gbs.items()}, "ratio": t_triton / best_sdpa,
            "kernel_over_copy": (gbs["kernel"] or gbs["triton"]) / copy_gbs,
            "max_abs_err": err}


def decode_rows(backend, dtype: torch.dtype, device: torch.device, copy_gbs: float,
                quick: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    print(f"\ndecode, {HEADS} heads / {KV_HEADS} KV heads, head {HEAD}, {dtype}, block {BLOCK}; "
          "ms (do_bench median); GB/s = K/V bytes read / time; ratio = triton / best SDPA; "
          "of copy = kernel GB/s / copy GB/s")
    cols = ["batch", "ctx", "triton", "kernel", "sdpa", "flash", "triton GB/s", "kernel GB/s",
            "sdpa GB/s", "flash GB/s", "ratio", "of copy", "max_err"]
    print(" ".join(f"{c:>11}" for c in cols))
    rows = []
    for batch, ctx in (QUICK_DECODE if quick else DECODE):
        row = decode_case(backend, batch, ctx, dtype, device, gen, copy_gbs, quick)
        rows.append(row)
        torch.cuda.empty_cache()
        print(" ".join([f"{batch:>11}", f"{ctx:>11}",
                        *(_fmt(row[f"{n}_ms"], "11.3f") for n in ("triton", "kernel", "sdpa",
                                                                  "flash")),
                        *(_fmt(row[f"{n}_gbs"], "11.0f") for n in ("triton", "kernel", "sdpa",
                                                                  "flash")),
                        f"{row['ratio']:>11.2f}", f"{row['kernel_over_copy']:>11.0%}",
                        f"{row['max_abs_err']:>11.1e}"]), flush=True)
    return rows


def _causal_flops(cached: int, new: int) -> float:
    """2 x multiply-adds of QK^T and PV over the visible keys, all heads."""
    visible = new * cached + new * (new + 1) / 2
    return 4.0 * HEADS * HEAD * visible


def prefill_case(backend, seqs: list[tuple[int, int]], dtype: torch.dtype,
                 query_dtype: torch.dtype, device: torch.device, gen: torch.Generator,
                 quick: bool) -> dict:
    """One prefill row: the backend on the paged batch vs one contiguous SDPA per sequence."""
    p = paged_copy(seqs, dtype, device, gen)
    contig = p.pop("contig")
    q = torch.randn(sum(n for _, n in seqs), HEADS, HEAD, device=device, dtype=query_dtype)
    scale = 1.0 / math.sqrt(HEAD)
    args = (q, p["key_cache"], p["value_cache"], p["block_tables"], p["seq_lens"],
            p["query_start_loc"], scale)
    t_triton = median_ms(lambda: backend.paged_attention(*args), quick)
    calls: dict[str, list[Callable[[], torch.Tensor]]] = {"sdpa": [], "flash": []}
    start = 0
    for (cached, new), (k, v) in zip(seqs, contig, strict=True):
        qc = q[start : start + new].to(dtype).unsqueeze(0)  # [1, new, heads, D]
        start += new
        calls["sdpa"].append(sdpa_fn(qc, k, v, False, cached))
        calls["flash"].append(sdpa_fn(qc, k, v, True, cached))
    t = {n: _try_ms(lambda fs=fs: [f() for f in fs], quick) for n, fs in calls.items()}
    want = torch.cat([f()[0].transpose(0, 1).float() for f in calls["sdpa"]])
    err = float((backend.paged_attention(*args).float() - want).abs().max())
    flops = sum(_causal_flops(c, n) for c, n in seqs)
    best = min((x for x in t.values() if x is not None), default=float("nan"))
    c0, n0 = seqs[0]
    label = f"cold {n0}" if c0 == 0 else f"extend {c0}+{n0}"
    label += f" x{len(seqs)}" if len(seqs) > 1 else ""
    return {"case": label, "seqs": seqs, "triton_ms": t_triton, "sdpa_ms": t["sdpa"],
            "flash_ms": t["flash"], "triton_tflops": flops / (t_triton * 1e-3) / 1e12,
            "sdpa_tflops": flops / (best * 1e-3) / 1e12, "ratio": t_triton / best,
            "max_abs_err": err}


def prefill_rows(backend, dtype: torch.dtype, query_dtype: torch.dtype, device: torch.device,
                 quick: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    print(f"\nprefill, {HEADS} heads / {KV_HEADS} KV heads, head {HEAD}, cache {dtype}, query "
          f"{query_dtype}; ms (do_bench median); ratio = triton / best SDPA (contiguous)")
    cols = ["case", "triton", "sdpa", "flash", "triton TF/s", "sdpa TF/s", "ratio", "max_err"]
    print(f"{cols[0]:>22} " + " ".join(f"{c:>11}" for c in cols[1:]))
    rows = []
    for seqs in (QUICK_PREFILL if quick else PREFILL):
        row = prefill_case(backend, list(seqs), dtype, query_dtype, device, gen, quick)
        rows.append(row)
        torch.cuda.empty_cache()
        print(f"{row['case']:>22} " + " ".join([
            *(_fmt(row[f"{n}_ms"], "11.3f") for n in ("triton", "sdpa", "flash")),
            f"{row['triton_tflops']:>11.1f}", f"{row['sdpa_tflops']:>11.1f}",
            f"{row['ratio']:>11.2f}", f"{row['max_abs_err']:>11.1e}"]), flush=True)
    return rows


def run(quick: bool, query_fp32: bool) -> dict:
    """The whole CUDA report; returns its rows for --json."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    from pagekv.kvnode.model.attention import get_attention_backend

    device = torch.device("cuda")
    backend = get_attention_backend("triton", "cuda")  # RuntimeError says why not
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    props = torch.cuda.get_device_properties(device)
    import triton

    print(f"device: {props.name}, {props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    copy_gbs = copy_bandwidth(device, quick)
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write); decode goal: kernel "
          f"K/V GB/s >= 80% of it ({0.8 * copy_gbs:.0f} GB/s)")
    decode = decode_rows(backend, dtype, device, copy_gbs, quick)
    prefill = prefill_rows(backend, dtype, torch.float32 if query_fp32 else dtype, device, quick)
    worst = min(r["kernel_over_copy"] for r in decode)
    print(f"\ndecode K/V bandwidth: worst {worst:.0%} of copy bandwidth over these cases; "
          f"triton/best-SDPA ratio max {max(r['ratio'] for r in decode):.2f}")
    return {"device": props.name, "dtype": str(dtype), "copy_gbs": copy_gbs,
            "decode": decode, "prefill": prefill}
