"""C++ paged attention kernel against a contiguous reference (gather blocks, causal softmax
in fp32), and against the pure-torch paged path when that module is present."""

from __future__ import annotations

import importlib
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagekv.kvnode.model.attention import cpu_kernel

pytestmark = pytest.mark.skipif(
    not cpu_kernel.available(), reason="C++ paged attention extension could not be built"
)

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def reference(
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
    """Per sequence: gather its blocks into contiguous K/V, dequantize, masked softmax."""
    _, bs, kvh, hd = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // kvh
    out = torch.zeros(query.shape, dtype=torch.float32)
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(seq_lens.tolist()):
        q0, q1 = starts[i], starts[i + 1]
        n = q1 - q0
        if n == 0:
            continue
        nblk = -(-ctx // bs)
        ids = block_tables[i, :nblk].long()
        k = key_cache[ids].float().reshape(-1, kvh, hd)[:ctx] * k_scale
        v = value_cache[ids].float().reshape(-1, kvh, hd)[:ctx] * v_scale
        k = k.repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("nhd,chd->hnc", q, k) * scale
        pos = torch.arange(ctx - n, ctx)
        masked = torch.arange(ctx)[None, :] > pos[:, None]  # [n, ctx]
        scores.masked_fill_(masked[None], float("-inf"))
        out[q0:q1] = torch.einsum("hnc,chd->nhd", torch.softmax(scores, dim=-1), v)
    return out


def make_batch(
    gen: torch.Generator,
    seqs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
) -> dict:
    """seqs = [(seq_len, query_len)]. Blocks are assigned from a random permutation of the
    pool, so tables are non-contiguous; table padding is -1 (must never be read)."""
    need = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max(need) + 2
    tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    kc = torch.randn(shape, generator=gen)
    vc = torch.randn(shape, generator=gen)
    if dtype != torch.float32:
        kc, vc = kc.to(dtype), vc.to(dtype)
    qlens = [q for _, q in seqs]
    qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(sum(qlens), num_heads, head_size, generator=gen)
    return {
        "query": query,
        "key_cache": kc,
        "value_cache": vc,
        "block_tables": tables,
        "seq_lens": torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        "query_start_loc": qsl,
        "scale": 1.0 / math.sqrt(head_size),
    }


# Both code paths of the extension: the default (AVX-512 where compiled in) and the portable
# auto-vectorised loops used on every other CPU.
PATHS = [False, True] if cpu_kernel.available() and cpu_kernel.has_avx512_path() else [True]


def check(batch: dict, atol: float = 1e-4, **scales: float) -> None:
    want = reference(**batch, **scales)
    got = cpu_kernel.paged_attention(**batch, **scales)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)
    for portable in PATHS:
        got = cpu_kernel.paged_attention_splits(**batch, **scales, portable=portable)
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("num_kv_heads,group", [(4, 1), (2, 2), (2, 4)])
def test_decode_matches_reference(block_size: int, num_kv_heads: int, group: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 10 + group)
    seqs = [(1, 1), (block_size, 1), (block_size + 1, 1), (300, 1), (3 * block_size - 1, 1)]
    check(make_batch(gen, seqs, block_size, num_kv_heads * group, num_kv_heads, 64))


@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_prefill_and_decode(block_size: int, group: int) -> None:
    gen = torch.Generator().manual_seed(7 + block_size + group)
    # fresh prefill, prefill chunk on a cached prefix, decodes, a chunk longer than one tile
    seqs = [(37, 37), (200, 45), (129, 1), (1, 1), (90, 1), (150, 70)]
    check(make_batch(gen, seqs, block_size, 2 * group, 2, 64))


@pytest.mark.parametrize("head_size", [32, 80, 96, 128, 256])
def test_head_sizes(head_size: int) -> None:
    gen = torch.Generator().manual_seed(head_size)
    seqs = [(70, 1), (33, 9), (5, 5)]
    check(make_batch(gen, seqs, 16, 4, 2, head_size))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, *FP8])
@pytest.mark.parametrize("head_size", [64, 80])
def test_low_precision_caches(dtype: torch.dtype, head_size: int) -> None:
    gen = torch.Generator().manual_seed(3)
    seqs = [(100, 1), (64, 20), (17, 1)]
    batch = make_batch(gen, seqs, 16, 8, 2, head_size, dtype=dtype)
    scales = {"k_scale": 0.5, "v_scale": 1.5} if dtype in FP8 else {}
    # The reference dequantizes the very same cache, so only fp32 rounding differs.
    check(batch, **scales)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, *FP8])
@pytest.mark.parametrize("portable", PATHS)
def test_every_stored_bit_pattern_decodes_exactly(dtype: torch.dtype, portable: bool) -> None:
    # A context of one token returns that token's V row (times v_scale) exactly, so putting
    # every 8-bit pattern (or a spread of 16-bit ones) in V checks the conversion bit for bit,
    # subnormals, infinities and NaN included.
    nbytes = torch.finfo(dtype).bits // 8
    if nbytes == 1:
        bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    else:
        bits = torch.randint(-(2**15), 2**15, (1024,), generator=torch.Generator().manual_seed(1))
        bits = bits.to(torch.int16)
    values = bits.view(dtype)
    head_size = 64
    nseq = values.numel() // head_size
    vc = values.view(nseq, 1, 1, head_size)
    kc = torch.zeros_like(vc)
    v_scale = 0.5
    out = cpu_kernel.paged_attention_splits(
        torch.randn(nseq, 1, head_size),
        kc,
        vc,
        torch.arange(nseq, dtype=torch.int32).flip(0).view(nseq, 1).contiguous(),
        torch.ones(nseq, dtype=torch.int32),
        torch.arange(nseq + 1, dtype=torch.int32),
        0.125,
        v_scale=v_scale,
        portable=portable,
    )
    want = vc.flip(0).float().view(nseq, 1, head_size) * v_scale
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_context_splits_agree(num_splits: int, portable: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    seqs = [(1000, 1), (513, 1), (20, 1), (300, 30)]
    batch = make_batch(gen, seqs, 16, 8, 2, 64)
    got = cpu_kernel.paged_attention_splits(**batch, num_splits=num_splits, portable=portable)
    torch.testing.assert_close(got, reference(**batch), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(threads: int) -> None:
    # The partitioning (kv heads per item, context splits) depends on the thread count.
    gen = torch.Generator().manual_seed(13)
    batch = make_batch(gen, [(700, 1), (64, 1), (200, 17)], 16, 8, 2, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(batch)
    finally:
        torch.set_num_threads(before)


def test_single_sequence_long_decode_uses_all_threads_correctly() -> None:
    # batch 1 with one kv head is the case that relies on the automatic context split
    gen = torch.Generator().manual_seed(5)
    check(make_batch(gen, [(4000, 1)], 16, 4, 1, 64))


def test_strided_query_and_cache_views() -> None:
    gen = torch.Generator().manual_seed(9)
    batch = make_batch(gen, [(50, 3), (20, 1)], 8, 4, 2, 64)
    ref = reference(**batch)
    # K and V as two halves of one fused [2, ...] tensor, query as a transposed view
    fused = torch.stack([batch["key_cache"], batch["value_cache"]])
    q = batch["query"].transpose(0, 1).contiguous().transpose(0, 1)
    args = {**batch, "query": q, "key_cache": fused[0], "value_cache": fused[1]}
    torch.testing.assert_close(cpu_kernel.paged_attention(**args), ref, atol=1e-4, rtol=1e-4)


def test_sequences_without_new_tokens_are_skipped() -> None:
    gen = torch.Generator().manual_seed(2)
    batch = make_batch(gen, [(40, 1), (30, 1), (25, 2)], 16, 4, 2, 64)
    # the middle sequence contributes no query tokens this step
    batch["query_start_loc"] = torch.tensor([0, 1, 1, 3], dtype=torch.int32)
    batch["query"] = batch["query"][:3]
    check(batch)


def test_concurrent_calls_from_python_threads() -> None:
    # The extension releases the GIL; calls from several threads must not share state.
    gen = torch.Generator().manual_seed(17)
    batches = [make_batch(gen, [(90 + 30 * i, 1), (40, 5)], 16, 4, 2, 64) for i in range(4)]
    wants = [reference(**b) for b in batches]
    with ThreadPoolExecutor(max_workers=4) as pool:
        gots = list(pool.map(lambda b: [cpu_kernel.paged_attention(**b) for _ in range(5)],
                             batches))
    for got, want in zip(gots, wants, strict=True):
        for g in got:
            torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)


def test_failed_build_means_unavailable_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A compiler that rejects the flags stands in for any build failure.
    monkeypatch.setattr(cpu_kernel, "_FLAG_SETS", (("-O3", "--pagekv-no-such-flag"),))
    monkeypatch.setattr(cpu_kernel, "_tried", False)
    monkeypatch.setattr(cpu_kernel, "_ext", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert cpu_kernel.available() is False
        assert cpu_kernel.available() is False  # the build is attempted once per process
    warnings = [r for r in caplog.records if r.name == cpu_kernel.__name__]
    assert len(warnings) == 1 and "pure-torch" in warnings[0].getMessage()
    batch = make_batch(torch.Generator().manual_seed(1), [(10, 1)], 16, 4, 2, 64)
    with pytest.raises(RuntimeError, match="not available"):
        cpu_kernel.paged_attention(**batch)


def test_bad_block_id_is_an_error_not_a_read() -> None:
    gen = torch.Generator().manual_seed(4)
    batch = make_batch(gen, [(40, 1)], 16, 4, 2, 64)
    batch["block_tables"][0, 1] = batch["key_cache"].shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernel.paged_attention(**batch)


def test_query_longer_than_context_is_an_error() -> None:
    gen = torch.Generator().manual_seed(4)
    batch = make_batch(gen, [(10, 4)], 16, 4, 2, 64)
    batch["seq_lens"] = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="query_len"):
        cpu_kernel.paged_attention(**batch)


def test_matches_pure_torch_paged_path() -> None:
    try:
        paged = importlib.import_module("pagekv.kvnode.model.attention.paged")
    except ImportError:
        pytest.skip("kvnode.model.attention.paged not present yet")
    gen = torch.Generator().manual_seed(21)
    for dtype, scales in [
        (torch.float32, {}),
        (torch.bfloat16, {}),
        (torch.float8_e4m3fn, {"k_scale": 0.25, "v_scale": 2.0}),
    ]:
        batch = make_batch(gen, [(77, 1), (160, 32), (16, 16), (5, 1)], 16, 8, 2, 64, dtype)
        got = cpu_kernel.paged_attention(**batch, **scales)
        want = paged.paged_attention(**batch, **scales)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@st.composite
def batches(draw: st.DrawFn) -> tuple[dict, int]:
    block_size = draw(st.sampled_from([8, 16, 32, 64, 128]))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    head_size = draw(st.sampled_from([16, 64, 72, 96]))
    n = draw(st.integers(1, 4))
    seqs = []
    for _ in range(n):
        ctx = draw(st.integers(1, 300))
        qlen = draw(st.one_of(st.just(1), st.integers(1, ctx)))
        seqs.append((ctx, qlen))
    splits = draw(st.integers(0, 4))
    portable = draw(st.sampled_from(PATHS))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(gen, seqs, block_size, num_kv_heads * group, num_kv_heads, head_size)
    return batch, {"num_splits": splits, "portable": portable}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_random_batches_match_reference(case: tuple[dict, dict]) -> None:
    batch, knobs = case
    got = cpu_kernel.paged_attention_splits(**batch, **knobs)
    torch.testing.assert_close(got, reference(**batch), atol=1e-4, rtol=1e-4)
