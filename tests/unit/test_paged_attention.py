"""Paged attention (reference path) against plain contiguous attention. The dispatcher's
tests: test_attention_backends.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagekv.kvnode.model.attention.paged as paged
from pagekv.kvnode.model.attention.paged import paged_attention, write_kv_cache


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int,
                         scale: float) -> torch.Tensor:
    """q [n_new, H, D], k/v [ctx, KVH, D] -> [n_new, H, D]; new tokens are the last n_new
    positions, causal. Computed in float64 as the ground truth."""
    n_new, heads, _ = q.shape
    group = heads // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
    vv = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("hqd,hkd->hqk", q.double().transpose(0, 1), kk) * scale
    qpos = torch.arange(ctx - n_new, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,hkd->hqd", scores.softmax(-1), vv).transpose(0, 1).float()


def build_case(seqs: list[tuple[int, int]], block_size: int, kv_heads: int, group: int,
               head_size: int, seed: int, dtype: torch.dtype = torch.float32,
               k_scale: float = 1.0, v_scale: float = 1.0):
    """seqs: (cached, new) per sequence. Returns everything paged_attention needs plus the
    contiguous K/V (as stored, i.e. after quantisation) for the reference."""
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous
    tables, taken = [], 0
    for nb in need:
        tables.append(perm[taken : taken + nb])
        taken += nb
    max_blocks = max(need) + 1
    block_tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)  # -1 padding
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache = torch.zeros(shape, dtype=dtype)
    value_cache = torch.zeros(shape, dtype=dtype)
    ks, vs, qs, refs = [], [], [], []
    for (c, n), t in zip(seqs, tables, strict=True):
        ctx = c + n
        k = torch.randn(ctx, kv_heads, head_size, generator=gen)
        v = torch.randn(ctx, kv_heads, head_size, generator=gen)
        pos = torch.arange(ctx)
        slots = torch.tensor(t)[pos // block_size] * block_size + pos % block_size
        write_kv_cache(k, v, key_cache, value_cache, slots, k_scale, v_scale)
        # What attention must see: the stored (possibly quantised) values, dequantised.
        ks.append((k / k_scale).to(dtype).float() * k_scale)
        vs.append((v / v_scale).to(dtype).float() * v_scale)
        qs.append(torch.randn(n, heads, head_size, generator=gen))
    query = torch.cat(qs)
    q_lens = torch.tensor([n for _, n in seqs])
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    scale = head_size**-0.5
    for (c, n), q, k, v in zip(seqs, qs, ks, vs, strict=True):
        refs.append(contiguous_attention(q, k, v, c + n, scale))
    return dict(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
        seq_lens=seq_lens, query_start_loc=qsl, scale=scale, k_scale=k_scale, v_scale=v_scale,
    ), torch.cat(refs)


seq_strategy = st.lists(
    st.tuples(st.integers(0, 70), st.integers(1, 40)), min_size=1, max_size=5
)


@settings(max_examples=60, deadline=None)
@given(
    seqs=seq_strategy,
    block_size=st.sampled_from([8, 16, 32]),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    head_size=st.sampled_from([8, 16, 32]),
    seed=st.integers(0, 2**16),
)
def test_paged_equals_contiguous(seqs, block_size, kv_heads, group, head_size, seed):
    args, ref = build_case(seqs, block_size, kv_heads, group, head_size, seed)
    out = paged_attention(**args)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=12),
    block_size=st.sampled_from([8, 16, 128]),
    seed=st.integers(0, 2**16),
)
def test_decode_batch_of_different_lengths(lens, block_size, seed):
    args, ref = build_case([(n - 1, 1) for n in lens], block_size, 2, 2, 16, seed)
    torch.testing.assert_close(paged_attention(**args), ref, atol=2e-5, rtol=1e-5)


def test_decode_chunking_keeps_results(monkeypatch):
    # A tiny gather budget forces one chunk per sequence.
    seqs = [(n, 1) for n in (5, 70, 33, 1, 128)] + [(20, 9)]
    args, ref = build_case(seqs, 16, 2, 2, 16, seed=7)
    monkeypatch.setattr(paged, "_DECODE_GATHER_ELEMS", 1)
    torch.testing.assert_close(paged_attention(**args), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.25, 2.0)])
def test_quantised_cache_dequantises_with_scales(dtype, scales):
    k_scale, v_scale = scales
    args, ref = build_case([(30, 4), (0, 9), (17, 1)], 16, 2, 2, 16, seed=3, dtype=dtype,
                           k_scale=k_scale, v_scale=v_scale)
    assert args["key_cache"].dtype == dtype
    torch.testing.assert_close(paged_attention(**args), ref, atol=1e-4, rtol=1e-4)


def test_slot_minus_one_is_skipped():
    kc = torch.zeros(2, 4, 1, 2)
    vc = torch.zeros(2, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    write_kv_cache(k, 2 * k, kc, vc, torch.tensor([5, -1, 0]), 1.0, 1.0)
    assert kc.view(-1, 2)[[0, 5]].eq(1).all() and vc.view(-1, 2)[[0, 5]].eq(2).all()
    assert kc.sum() == 4 and kc.view(-1, 2)[7].eq(0).all()  # -1 did not wrap to the last slot
