"""Paged prefill / extend attention as a Triton kernel (flash-attention style).

Same contract as ``paged.paged_attention`` (the reference): a ragged batch of new query tokens,
each sequence's ``query_len`` tokens being the last positions of its context ``seq_lens[i]``,
attending causally to the cached blocks before them and to themselves, K/V read through the
block table from ``[num_blocks, block_size, num_kv_heads, head_size]`` caches.

Work split: one program per (query block, KV head). A query block is ``BLOCK_Q`` consecutive new
tokens of one sequence times the ``group`` query heads sharing that KV head (GQA), flattened
into ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows, so one K/V tile load serves the whole group. The
program walks key tiles of ``TILE_N`` positions (a tile may span several cache blocks, or part
of one: each position looks up its own block id) with an online softmax, and stops at the
causal limit of its last token (and starts at the sliding window of its first).

The grid needs no host sync: sequence ``i`` owns program slots
``query_start_loc[i] // BLOCK_Q + i`` onwards (enough for ``cdiv(query_len, BLOCK_Q)`` blocks;
strictly increasing in ``i``), so ``num_tokens // BLOCK_Q + num_seqs`` slots cover every batch
and a program finds its sequence by binary search. Surplus slots return at once.

Precision: scores and softmax in fp32. The two products run in ``COMPUTE``: the query's dtype
when it is fp16/bf16 and the cache holds the same dtype or fp8 (tensor cores, fp32
accumulation; the probabilities are rounded to that dtype for P·V), else fp32 with IEEE
products. fp8 caches are passed as bytes and decoded by moving their bits into fp16's
(``_fp8_bytes_to_fp16``: exact, on every GPU, where Triton's own E4M3 type needs sm_89+);
``k_scale`` is folded into the softmax scale and ``v_scale`` into the final normalisation,
so dequantization costs no multiply per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekv.kvnode.model.attention.kv_cache import FP8_DTYPES
from pagekv.kvnode.model.attention.triton_formats import (
    KV_E4M3,
    fp8_bits_to_f16,
    kernel_view,
    kv_format,
)

_LOG2E = 1.4426950408889634
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _find_sequence(qsl_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The largest i with query_start_loc[i] // BLOCK_Q + i <= pid."""
    lo = 0
    hi = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first_slot = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_slot <= pid, mid, lo)
        hi = tl.where(first_slot <= pid, hi, mid)
    return lo


# num_seqs bounds the binary search's loop: kept a runtime value even when it is 1 (Triton
# would otherwise make it a compile-time constant, and the loop's bound a constant).
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    qk_scale,  # scale * k_scale * log2(e): scores go through exp2
    v_scale,
    window,  # sliding window (used when USE_WINDOW)
    num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of 2
    BLOCK_Q: tl.constexpr,  # query tokens per program
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_SIZE rounded up to a power of 2 (96 -> 128)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_N: tl.constexpr,  # key positions per iteration
    USE_WINDOW: tl.constexpr,
    COMPUTE: tl.constexpr,  # dtype of the two matrix products
    FP8_FORMAT: tl.constexpr,  # 0: none; caches as uint8 of 1: E4M3 (scales carry 2**8), 2: E5M2
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(qsl_ptr, num_seqs, pid, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    q_block = pid - (q_begin // BLOCK_Q + seq)
    if (q_block < 0) | (q_block * BLOCK_Q >= q_len):
        return  # a surplus slot, a zero-length sequence (or slots before query_start_loc[0])
    ctx = tl.load(seq_lens_ptr + seq)
    first_pos = ctx - q_len  # absolute position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP_PAD  # index among the sequence's new tokens
    grp = rows % GROUP_PAD
    row_ok = (tok < q_len) & (grp < GROUP)
    qpos = first_pos + tok
    head = kv_head * GROUP + grp
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE

    q_rows = (q_begin + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(COMPUTE)

    # Keys this block can see: up to its last token's position, from its first token's window.
    last_tok = tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
    kv_end = first_pos + last_tok + 1
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(first_pos + q_block * BLOCK_Q - window + 1, 0)
        kv_begin = (kv_begin // TILE_N) * TILE_N

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for start in range(kv_begin, kv_end, TILE_N):
        kpos = start + tl.arange(0, TILE_N)
        k_ok = (kpos < kv_end) & (kpos >= 0)
        block_id = tl.load(table_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        offset = (kpos % BLOCK_SIZE).to(tl.int64)
        k_off = block_id * stride_kb + offset * stride_kt
        kt = tl.load(k_head + k_off[None, :] + dims[:, None],
                     mask=k_ok[None, :] & dim_ok[:, None], other=0.0)
        if FP8_FORMAT != 0:
            kt = fp8_bits_to_f16(kt, FP8_FORMAT)
        kt = kt.to(COMPUTE)
        if COMPUTE == tl.float32:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * qk_scale
        visible = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :]
        if USE_WINDOW:
            visible = visible & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block_id * stride_vb + offset * stride_vt
        v = tl.load(v_head + v_off[:, None] + dims[None, :],
                    mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        if FP8_FORMAT != 0:
            v = fp8_bits_to_f16(v, FP8_FORMAT)
        v = v.to(COMPUTE)
        if COMPUTE == tl.float32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(COMPUTE), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows that see nothing (masked out anyway)
    out = acc * (v_scale / l_i)[:, None]
    o_rows = (q_begin + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + dims[None, :], out,
             mask=row_ok[:, None] & dim_ok[None, :])


def _compute_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    if query_dtype in _HALF_DTYPES and (cache_dtype == query_dtype or cache_dtype in FP8_DTYPES):
        return query_dtype
    return torch.float32


def _tiles(head_pad: int, group_pad: int) -> tuple[int, int, int]:
    """(BLOCK_Q, TILE_N, num_warps): about 64 query rows and 32 keys per program (32 and 16
    for 256-wide heads); every tl.dot side at least 16. Chosen so that ptxas reports no
    register spills for sm_80 and sm_90 with 16-bit products (64 x 64 tiles on 4 warps
    spilled); not tuned on a GPU."""
    rows, tile_n, warps = (64, 32, 8) if head_pad <= 128 else (32, 16, 8)
    block_q = max(1, rows // group_pad)
    block_q = max(block_q, triton.cdiv(16, group_pad))
    return block_q, tile_n, warps


def _check(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
           sliding_window) -> None:
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"expected query [tokens, heads, head_size] and K/V caches [blocks, block_size, "
            f"kv_heads, head_size]; got {tuple(query.shape)}, {tuple(key_cache.shape)}, "
            f"{tuple(value_cache.shape)}"
        )
    num_heads, head_size = query.shape[1], query.shape[2]
    kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_size or num_heads % kv_heads:
        raise ValueError(
            f"query has {num_heads} heads of {head_size}, caches {kv_heads} KV heads of "
            f"{key_cache.shape[3]}: need equal head sizes and heads a multiple of KV heads"
        )
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"K cache is {key_cache.dtype}, V cache {value_cache.dtype}")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_size) dimension")
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError("block_tables must be [num_seqs, max_blocks], one row per seq_lens entry")
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError("query_start_loc must have num_seqs + 1 entries")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of a ragged batch of new tokens (prefills, chunked prefills, prefix hits and
    decodes alike) over their paged context. Arguments as ``paged.paged_attention``; returns
    ``[num_tokens, num_heads, head_size]`` float32. ``seq_lens[i] >= query_len`` is not
    checked (that would need a host sync); a row that breaks it reads no memory out of place.
    """
    _check(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
           sliding_window)
    num_tokens, num_heads, head_size = query.shape
    out = torch.empty(num_tokens, num_heads, head_size, dtype=torch.float32, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    _, block_size, kv_heads, _ = key_cache.shape
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(head_size))
    block_q, tile_n, warps = _tiles(head_pad, group_pad)
    compute = _TL_DTYPES[_compute_dtype(query.dtype, key_cache.dtype)]
    fp8_format = kv_format(key_cache.dtype) if key_cache.dtype in FP8_DTYPES else 0
    key_cache, value_cache = kernel_view(key_cache), kernel_view(value_cache)
    if fp8_format == KV_E4M3:  # E4M3 decodes to value * 2**-8: the scales take the 2**8 back
        k_scale, v_scale = k_scale * 256.0, v_scale * 256.0
    grid = (num_tokens // block_q + num_seqs, kv_heads)
    _paged_prefill_kernel[grid](
        query, key_cache, value_cache, out, block_tables, seq_lens, query_start_loc,
        float(scale) * float(k_scale) * _LOG2E, float(v_scale),
        int(sliding_window or 0), num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_SIZE=head_size,
        HEAD_PAD=head_pad, BLOCK_SIZE=block_size, TILE_N=tile_n,
        USE_WINDOW=sliding_window is not None, COMPUTE=compute,
        FP8_FORMAT=fp8_format, num_warps=warps,
    )
    return out
