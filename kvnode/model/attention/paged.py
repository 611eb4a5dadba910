"""Paged attention, pure-torch reference path.

KV cache layout, per layer, for K and for V::

    [num_blocks, block_size, num_kv_heads, head_size]

Why this layout:

* It follows the reduction direction. Q·Kᵀ reduces over ``head_size``, which is the
  innermost, contiguous dimension: one query head against one key row is a dot product over
  consecutive memory. P·V reduces over tokens, which is the next-outer run
  (``block_size × num_kv_heads``); each token's V row is again contiguous and is accumulated
  with one scalar weight, so both products stream through memory in order.
* A block is one contiguous chunk per layer: ``cache[block_id]`` is
  ``block_size × num_kv_heads × head_size`` consecutive elements. Copy-on-write, offload to
  the DRAM/SSD tiers and reload are a single memcpy per layer and K/V, with no gather.
* ``slot = block_id * block_size + offset`` indexes the tensor viewed as
  ``[num_blocks * block_size, num_kv_heads, head_size]``, so writing new tokens is one
  scatter (``slot_mapping``).

vLLM's legacy GPU kernel stores K as ``[num_blocks, num_kv_heads, head_size/x, block_size, x]``
with ``x = 16 bytes / element size`` (8 for fp16, 16 for fp8). It is the same data with the
head dimension cut into 16-byte vectors, and vector ``j`` of consecutive tokens stored side by
side: neighbouring GPU threads, each on a different token, load neighbouring 16-byte vectors
(one coalesced transaction, one vector load per thread) and run the Q·K dot product in
registers. A block is still one contiguous chunk there (block id outermost), so block copies
cost the same; the price is that one token's key row is scattered into ``head_size/x``
pieces (writing a token is a strided scatter) and K and V layouts differ. On CPU a
contiguous ``head_size`` row already vectorises (AVX loads of one key row), so we keep the
simpler layout, identical for K and V, which the C++ kernel also reads.

Everything here is computed in fp32; stored values are dequantized with ``k_scale`` /
``v_scale`` (see ``kv_cache``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Upper bound (in elements) of the K/V gathered at once for a group of decodes: keeps the
# reference path's temporary memory bounded for large batches of long sequences.
_DECODE_GATHER_ELEMS = 1 << 25


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter new tokens' K/V ``[num_tokens, num_kv_heads, head_size]`` into the caches at
    ``slot_mapping`` (``block_id * block_size + offset``; -1 = skip that token)."""
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.long)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    kvh, hd = key_cache.shape[2], key_cache.shape[3]
    _store(key_cache.view(-1, kvh, hd), slots, key, k_scale)
    _store(value_cache.view(-1, kvh, hd), slots, value, v_scale)


def _store(flat_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    if scale != 1.0:
        x = x.float() / scale
    # index_put (not index_copy_) because CPU index_copy_ has no float8 kernel.
    flat_cache[slots] = x.to(flat_cache.dtype)


def _load(cache_rows: torch.Tensor, scale: float) -> torch.Tensor:
    out = cache_rows.float()
    return out * scale if scale != 1.0 else out


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
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of new tokens over their sequence's whole context, read through the block
    table.

    query            [num_tokens, num_heads, head_size], new tokens of all sequences, packed
    key/value_cache  [num_blocks, block_size, num_kv_heads, head_size]
    block_tables     [num_seqs, max_blocks] int32, padded (padding is never read)
    seq_lens         [num_seqs] total context per sequence, cached + new tokens
    query_start_loc  [num_seqs + 1] cumulative new-token counts

    Sequence ``i``'s new tokens sit at positions ``seq_lens[i] - query_len .. seq_lens[i]-1``
    and attend causally to everything before them (cached prefix included). A decode is
    ``query_len == 1``. Returns ``[num_tokens, num_heads, head_size]`` float32.
    ``sliding_window`` (Mistral, Qwen2): the query at position p sees keys p - window < j <= p,
    as transformers masks it.
    """
    num_tokens, num_heads, head_size = query.shape
    out = torch.empty(num_tokens, num_heads, head_size, dtype=torch.float32, device=query.device)
    if num_tokens == 0:
        return out
    q = query.float()
    # One host sync for the per-sequence bookkeeping; the loop below is per sequence (and only
    # for prefill chunks), never per token.
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes: list[int] = []
    for i, ctx in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        qlen = q1 - q0
        if qlen <= 0:
            continue
        if ctx < qlen:
            raise ValueError(f"sequence {i}: seq_len {ctx} < query_len {qlen}")
        if qlen == 1:
            decodes.append(i)
            continue
        out[q0:q1] = _prefill_one(
            q[q0:q1], key_cache, value_cache, block_tables[i], ctx, scale, k_scale, v_scale,
            sliding_window,
        )
    if decodes:
        _decode_batch(
            q, out, decodes, starts, lens, key_cache, value_cache, block_tables,
            scale, k_scale, v_scale, sliding_window,
        )
    return out


def _gather_seq(cache: torch.Tensor, table: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
    """[ctx, num_kv_heads, head_size] fp32 for one sequence."""
    bs = cache.shape[1]
    nblk = -(-ctx // bs)
    rows = cache[table[:nblk].long()].flatten(0, 1)[:ctx]
    return _load(rows, scale)


def _prefill_one(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    ctx: int,
    scale: float,
    k_scale: float,
    v_scale: float,
    window: int | None = None,
) -> torch.Tensor:
    qlen, num_heads, _ = q.shape
    k = _gather_seq(key_cache, table, ctx, k_scale)
    v = _gather_seq(value_cache, table, ctx, v_scale)
    kvh = k.shape[1]
    # 4-D [1, heads, tokens, dim]: SDPA's fused CPU (flash) kernel only takes batched input;
    # 3-D falls back to the unfused math path, several times slower.
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if window is not None and window >= ctx:
        window = None  # every key is inside every query's window
    if qlen == ctx and window is None:
        # No cached prefix: top-left causal is the right mask and takes SDPA's fast path.
        o = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=kvh != num_heads
        )
    else:
        # Query i sits at absolute position ctx - qlen + i and sees keys 0..that position.
        qpos = torch.arange(ctx - qlen, ctx, device=q.device)
        kpos = torch.arange(ctx, device=q.device)[None, :]
        mask = kpos <= qpos[:, None]
        if window is not None:
            mask &= kpos > qpos[:, None] - window
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=kvh != num_heads
        )
    return o[0].transpose(0, 1)


def _decode_batch(
    q: torch.Tensor,
    out: torch.Tensor,
    seq_ids: list[int],
    starts: list[int],
    lens: list[int],
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    window: int | None = None,
) -> None:
    """All single-token queries at once: gather each sequence's padded context, mask the
    padding. Sorted by length and chunked so padding and temporary memory stay small."""
    _, bs, kvh, hd = key_cache.shape
    num_heads = q.shape[1]
    dev = q.device
    seq_ids = sorted(seq_ids, key=lambda i: lens[i])
    pos = 0
    while pos < len(seq_ids):
        # Grow the chunk while the padded gather fits the budget (longest is last).
        end = pos + 1
        while end < len(seq_ids):
            padded = -(-lens[seq_ids[end]] // bs) * bs
            if (end + 1 - pos) * padded * kvh * hd > _DECODE_GATHER_ELEMS:
                break
            end += 1
        chunk = seq_ids[pos:end]
        pos = end
        max_ctx = lens[chunk[-1]]
        nblk = -(-max_ctx // bs)
        sel = torch.tensor(chunk, device=block_tables.device, dtype=torch.long)
        table = block_tables[sel, :nblk].long().clamp_(min=0).to(dev)
        k = _load(key_cache[table].flatten(1, 2), k_scale)  # [n, T, kvh, hd]
        v = _load(value_cache[table].flatten(1, 2), v_scale)
        tok = torch.tensor([starts[i] for i in chunk], device=dev, dtype=torch.long)
        ctx = torch.tensor([lens[i] for i in chunk], device=dev)
        kpos = torch.arange(nblk * bs, device=dev)[None, :]
        valid = kpos < ctx[:, None]  # [n, T]
        if window is not None and max_ctx > window:
            valid &= kpos >= ctx[:, None] - window  # the query sits at ctx - 1
        # SDPA (fused kernel) over [n, heads, 1, T] with the padding masked out: about twice
        # as fast on CPU as explicit matmul + softmax + matmul.
        o = F.scaled_dot_product_attention(
            q[tok].unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=kvh != num_heads,
        )
        out[tok] = o.squeeze(2)
