"""Triton KV write: scatter one step's new K/V into the paged caches (``reshape_and_cache``).

Same contract as ``paged.write_kv_cache``: ``key``/``value`` ``[num_tokens, num_kv_heads,
head_size]`` go to ``slot_mapping`` (``block_id * block_size + offset``; -1 = skip), stored as
``(x.float() / scale).to(cache dtype)`` — fp8 and bf16 through the bit-exact encoders of
``triton_formats``, so the bytes equal torch's cast.

One program writes a tile of tokens for one KV head: the source rows may be strided (a view
of a fused QKV projection), the cache is addressed through its own strides, and addresses are
int64 (a pool can exceed 2^31 elements).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from pagekv.kvnode.model.attention.triton_formats import (
    encode_from_f32,
    kernel_view,
    kv_format,
    next_pow2,
)

# Elements one program moves per tensor (K or V): tokens x padded head.
_TILE_ELEMS = 2048


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    k_scale, v_scale, num_tokens, head_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, TOKENS: tl.constexpr,
    FORMAT: tl.constexpr,
):
    head = tl.program_id(1)
    tok = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    keep = slot >= 0
    d = tl.arange(0, HEAD_PAD)
    mask = keep[:, None] & (d < head_size)[None, :]
    tok64 = tok.to(tl.int64)
    # K and V caches share shape and strides (one pool layout).
    dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
           + head * stride_ch)[:, None] + d[None, :]

    k = tl.load(key_ptr + (tok64 * stride_kt + head * stride_kh)[:, None] + d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    k = tl.math.div_rn(k, k_scale)  # correctly rounded, as torch's x / scale
    tl.store(key_cache_ptr + dst,
             encode_from_f32(k, FORMAT, key_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(value_ptr + (tok64 * stride_vt + head * stride_vh)[:, None] + d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    v = tl.math.div_rn(v, v_scale)
    tl.store(value_cache_ptr + dst,
             encode_from_f32(v, FORMAT, value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into the caches
    ``[num_blocks, block_size, num_kv_heads, head_size]`` at ``slot_mapping`` (-1 = skip)."""
    num_tokens, num_kv_heads, head_size = key.shape
    _, block_size, cache_heads, cache_head_size = key_cache.shape
    if (cache_heads, cache_head_size) != (num_kv_heads, head_size):
        raise ValueError(
            f"K/V rows [{num_kv_heads}, {head_size}] do not fit the cache's "
            f"[{cache_heads}, {cache_head_size}]"
        )
    if value.shape != key.shape or value_cache.shape != key_cache.shape:
        raise ValueError("key/value (and their caches) must have the same shapes")
    if key_cache.stride() != value_cache.stride() or key_cache.dtype != value_cache.dtype:
        raise ValueError("key and value caches must share dtype and strides")
    if num_tokens == 0:
        return
    fmt = kv_format(key_cache.dtype)
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    if key_cache.stride(-1) != 1:
        raise ValueError("the cache's head_size dimension must be contiguous")
    slots = slot_mapping.to(device=key_cache.device)
    head_pad = next_pow2(head_size)
    tokens = max(1, min(_TILE_ELEMS // head_pad, next_pow2(num_tokens)))
    grid = (triton.cdiv(num_tokens, tokens), num_kv_heads)
    kc, vc = kernel_view(key_cache), kernel_view(value_cache)
    with torch.cuda.device(key_cache.device) if key_cache.is_cuda else contextlib.nullcontext():
        _write_kv_kernel[grid](
            key, value, kc, vc, slots,
            float(k_scale), float(v_scale), num_tokens, head_size,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2),
            BLOCK_SIZE=block_size, HEAD_PAD=head_pad, TOKENS=tokens, FORMAT=fmt,
        )
