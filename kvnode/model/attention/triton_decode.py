"""Triton paged decode attention: one query token per sequence over its block table.

* GQA: a program owns one (sequence, KV head[, split]) and computes all the query heads of
  that KV head's group at once, so each K/V block is read once per KV head. The group is
  padded to at least 16 rows (``tl.dot``'s minimum); the padding rows hold zero queries.
* Split-K (flash-decoding): with ``num_splits > 1`` the visible context is cut into that many
  partitions; each program runs an online softmax over its partition and writes (max, sum,
  unnormalised output), and a second kernel merges the partitions. ``num_splits == 1`` writes
  the normalised output directly.
* Tokens are walked in tiles of ``TILE`` positions, independent of the page size: each
  position's block id comes from the block table, so any block size works and table entries
  past the sequence's last block (padding: -1 or junk) are never read.
* fp32 math throughout (``tl.dot`` with ``input_precision="ieee"``: no TF32 rounding), fp8
  caches dequantised in the kernel; ``k_scale`` is folded into the softmax scale and
  ``v_scale`` applied to the output.
* Sliding window: the query at position ``ctx - 1`` sees keys ``j > ctx - 1 - window``.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from pagekv.kvnode.model.attention.triton_formats import (
    kernel_view,
    kv_format,
    load_as_f32,
    next_pow2,
)

_LOG2E = 1.4426950408889634
_MIN_GROUP_ROWS = 16  # tl.dot needs M >= 16
_TILE_ELEMS = 8192  # K (or V) elements per tile: TILE * padded head_size
_MAX_SPLITS = 32
_MIN_SPLIT_TOKENS = 256  # the automatic split keeps partitions at least this long


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    qk_scale, v_scale, window, head_size, num_heads,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    FORMAT: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(ctx - window, 0)
    # This split's token range [lo, hi): equal partitions rounded up to whole tiles.
    per_split = tl.cdiv(tl.cdiv(ctx - start, NUM_SPLITS), TILE) * TILE
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, ctx)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    head_ok = rows < GROUP
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < head_size
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq64 * stride_bt
    for t0 in range(lo, hi, TILE):
        pos = t0 + tl.arange(0, TILE)
        pos_ok = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_ptrs = row[:, None] + d[None, :]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = load_as_f32(k_cache_ptr + kv_ptrs, kv_mask, FORMAT)
        # Scores in log2 units: exp2 below is the natural softmax.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        rescale = tl.exp2(row_max - new_max)
        p = tl.exp2(s - new_max[:, None])
        v = load_as_f32(v_cache_ptr + kv_ptrs, kv_mask, FORMAT)
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
        row_max = new_max

    if NUM_SPLITS == 1:
        out = acc * (v_scale / row_sum)[:, None]
        tl.store(out_ptr + seq64 * stride_os + heads[:, None] * stride_oh + d[None, :], out,
                 mask=head_ok[:, None] & d_ok[None, :])
    else:
        # Partials are [num_seqs, num_heads, NUM_SPLITS(, HEAD_PAD)], contiguous. An empty
        # split (a short sequence) leaves max -inf, sum 0: it weighs nothing in the merge.
        part = (seq64 * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, row_max, mask=head_ok)
        tl.store(part_sum_ptr + part, row_sum, mask=head_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc,
                 mask=head_ok[:, None])


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, v_scale, head_size, num_heads,
    stride_os, stride_oh,
    HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    part = (seq * num_heads + head) * NUM_SPLITS + splits
    part_max = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    d = tl.arange(0, HEAD_PAD)
    part_acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :],
                       mask=split_ok[:, None], other=0.0)
    top = tl.max(part_max, axis=0)  # finite: the first split always holds a token
    weight = tl.exp2(part_max - top)  # in log2 units, like the scores
    total = tl.sum(part_sum * weight, axis=0)
    out = tl.sum(part_acc * weight[:, None], axis=0) * (v_scale / total)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out, mask=d < head_size)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split-K partitions (a power of two) so that (seq, kv_head, split) programs fill about
    two waves of ``num_sms``, while each partition keeps ``_MIN_SPLIT_TOKENS`` or more."""
    splits = 1
    while (
        splits < _MAX_SPLITS
        and num_seqs * num_kv_heads * splits < 2 * num_sms
        and max_context >= 2 * splits * _MIN_SPLIT_TOKENS
    ):
        splits *= 2
    return splits


def auto_num_splits(device: torch.device, num_seqs: int, num_kv_heads: int, max_context: int,
                    sliding_window: int | None = None) -> int:
    """``choose_num_splits`` for this device; 1 off CUDA (the interpreter runs programs one
    by one: splitting only adds work)."""
    if device.type != "cuda":
        return 1
    span = max_context if sliding_window is None else min(max_context, sliding_window)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return choose_num_splits(num_seqs, num_kv_heads, span, sms)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention of one new token per sequence over its whole context.

    query            [num_seqs, num_heads, head_size], the token at position seq_lens[i] - 1
    key/value_cache  [num_blocks, block_size, num_kv_heads, head_size]
    block_tables     [num_seqs, max_blocks] int32 (entries past the last used block unread)
    seq_lens         [num_seqs] context lengths (>= 1), the new token included
    num_splits       split-K partitions; None = chosen from the batch (one host sync on GPU)

    Returns [num_seqs, num_heads, head_size] float32.
    """
    num_seqs, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, cache_head_size = key_cache.shape
    if cache_head_size != head_size or num_heads % num_kv_heads:
        raise ValueError(
            f"query [{num_heads} heads, {head_size}] does not fit a cache of "
            f"{num_kv_heads} KV heads x {cache_head_size}"
        )
    if key_cache.stride() != value_cache.stride() or key_cache.dtype != value_cache.dtype:
        raise ValueError("key and value caches must share dtype and strides")
    if key_cache.stride(-1) != 1:
        raise ValueError("the cache's head_size dimension must be contiguous")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    out = torch.empty(num_seqs, num_heads, head_size, dtype=torch.float32, device=query.device)
    if num_seqs == 0:
        return out
    fmt = kv_format(key_cache.dtype)
    if query.stride(-1) != 1:
        query = query.contiguous()
    block_tables = block_tables.to(query.device)
    seq_lens = seq_lens.to(query.device)
    if num_splits is None:  # the longest context: one host sync, on CUDA only
        longest = int(seq_lens.max()) if query.is_cuda else 0
        num_splits = auto_num_splits(query.device, num_seqs, num_kv_heads, longest,
                                     sliding_window)
    num_splits = max(1, int(num_splits))

    group = num_heads // num_kv_heads
    head_pad = max(16, next_pow2(head_size))
    tile = max(16, min(128, _TILE_ELEMS // head_pad))
    kc, vc = kernel_view(key_cache), kernel_view(value_cache)
    if num_splits > 1:
        part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                               device=query.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_pad,
                               dtype=torch.float32, device=query.device)
    else:
        part_max = part_sum = part_acc = out  # unused
    device_ctx = torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext()
    with device_ctx:
        _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
            query, kc, vc, block_tables, seq_lens,
            out, part_max, part_sum, part_acc,
            float(scale) * float(k_scale) * _LOG2E, float(v_scale),
            int(sliding_window or 0), head_size, num_heads,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
            BLOCK_SIZE=block_size, GROUP=group,
            GROUP_PAD=max(_MIN_GROUP_ROWS, next_pow2(group)), HEAD_PAD=head_pad, TILE=tile,
            NUM_SPLITS=num_splits, FORMAT=fmt, HAS_WINDOW=sliding_window is not None,
        )
        if num_splits > 1:
            _decode_merge_kernel[(num_seqs, num_heads)](
                out, part_max, part_sum, part_acc, float(v_scale), head_size, num_heads,
                out.stride(0), out.stride(1),
                HEAD_PAD=head_pad, NUM_SPLITS=num_splits, SPLITS_PAD=next_pow2(num_splits),
            )
    return out


def interpreted() -> bool:
    """Whether this module's kernels were decorated for Triton's interpreter (fixed at import,
    by TRITON_INTERPRET at that moment)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_split_kernel, InterpretedFunction)


__all__ = ["auto_num_splits", "choose_num_splits", "interpreted", "paged_decode"]
