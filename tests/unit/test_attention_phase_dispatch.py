"""The `cpp` backend (decode rows on the C++ kernel, the rest on the reference's SDPA) against
float64 attention over the contiguous K/V, on mixed batches: cold prefills, prefix hits
(extends over cached blocks), decodes, empty rows, sliding windows."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagekv.kvnode.model.attention import cpu_kernel, get_attention_backend
from pagekv.kvnode.model.attention.phase_dispatch import KernelLimits, phase_dispatched
from tests.unit.attention_stand_in import stand_in

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(),
                                  reason="C++ paged attention extension could not be built")


def expected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             window: int | None) -> torch.Tensor:
    """q [n, H, D] are the last n positions of k/v [ctx, KVH, D]; position p sees keys j with
    p - window < j <= p. float64."""
    n, heads, _ = q.shape
    ctx, kvh, dim = k.shape
    kk = k.double().repeat_interleave(heads // kvh, dim=1)
    vv = v.double().repeat_interleave(heads // kvh, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), kk) * dim**-0.5
    p = torch.arange(ctx - n, ctx)[:, None]
    j = torch.arange(ctx)[None, :]
    hidden = (j > p) | ((j <= p - window) if window is not None else False)
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), vv).float()


def mixed_batch(seqs: list[tuple[int, int]], block_size: int, window: int | None,
                seed: int, heads: int = 4, kv_heads: int = 2, dim: int = 16):
    """seqs: (cached, new) per sequence. K/V written straight into shuffled blocks, so the
    expected output never reads the paged cache."""
    gen = torch.Generator().manual_seed(seed)
    need = [max(1, -(-(c + n) // block_size)) for c, n in seqs]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    value_cache = torch.zeros_like(key_cache)
    tables = torch.full((len(seqs), max(need) + 1), -1, dtype=torch.int32)
    queries, wants, used = [], [], 0
    for i, ((cached, new), nb) in enumerate(zip(seqs, need, strict=True)):
        blocks = perm[used : used + nb]
        used += nb
        tables[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        ctx = cached + new
        k = torch.randn(ctx, kv_heads, dim, generator=gen)
        v = torch.randn(ctx, kv_heads, dim, generator=gen)
        for pos in range(ctx):
            b, off = blocks[pos // block_size], pos % block_size
            key_cache[b, off], value_cache[b, off] = k[pos], v[pos]
        q = torch.randn(new, heads, dim, generator=gen)
        queries.append(q)
        if new:
            wants.append(expected(q, k, v, window))
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(torch.int32)
    args = dict(query=torch.cat(queries), key_cache=key_cache, value_cache=value_cache,
                block_tables=tables, seq_lens=torch.tensor([c + n for c, n in seqs],
                                                           dtype=torch.int32),
                query_start_loc=qsl, scale=dim**-0.5)
    return args, torch.cat(wants) if wants else torch.empty(0, heads, dim)


# A step of a real engine: decodes, short and long cold prefill chunks, prefix hits that
# extend cached blocks (short and long), an empty row, a decode right at a block boundary.
MIXED = [(40, 1), (0, 23), (1, 1), (32, 9), (17, 0), (63, 1), (64, 1), (5, 30), (10, 40),
         (0, 530)]


@needs_kernel
@pytest.mark.parametrize("window", [None, 8, 33, 200])
@pytest.mark.parametrize("block_size", [16, 32])
def test_auto_on_cpu_matches_float64_on_mixed_batches(window, block_size):
    backend = get_attention_backend("auto", "cpu")
    assert backend.name == "cpp"
    args, want = mixed_batch(MIXED, block_size, window, seed=block_size + (window or 0))
    extra = {} if window is None else {"sliding_window": window}
    got = backend.paged_attention(**args, **extra)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("seqs", [[(100, 1), (7, 1), (0, 1)], [(0, 40), (16, 16)], [(3, 0)]])
def test_single_phase_batches(seqs):
    args, want = mixed_batch(seqs, 16, None, seed=len(seqs))
    got = get_attention_backend("cpp").paged_attention(**args)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 12)), min_size=1, max_size=6),
    window=st.one_of(st.none(), st.integers(1, 90)),
    seed=st.integers(0, 2**16),
)
def test_random_mixed_batches(seqs, window, seed):
    args, want = mixed_batch(seqs, 8, window, seed)
    extra = {} if window is None else {"sliding_window": window}
    got = get_attention_backend("cpp").paged_attention(**args, **extra)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_rows_reach_the_right_path():
    """Only short queries the window cannot cut reach the kernel; its answers land on their
    rows, the reference's on the others."""
    calls = []

    def kernel(query, key_cache, value_cache, block_tables, seq_lens, qsl, *rest):
        calls.append((seq_lens.tolist(), qsl.tolist(), block_tables[:, 0].tolist()))
        return torch.full(query.shape, -7.0)

    # Token offsets: 0 | 1-16 | 17-33 | 34 | 35-38 | 39-43 | 44
    seqs = [(40, 1), (0, 16), (0, 17), (9, 1), (5, 4), (5, 5), (63, 1)]
    args, want = mixed_batch(seqs, 16, window=30, seed=1)
    got = phase_dispatched(kernel, KernelLimits(4, 16))(**args, sliding_window=30)
    # To the kernel: the 16-token prompt, the decode at seq_len 10, the 4-token extend. Not:
    # the 17-token prompt and the 5-token extend (too long), the decodes at 41 and 64 (the
    # window cuts their context).
    tables = args["block_tables"][:, 0].tolist()
    assert calls == [([16, 10, 9], [0, 16, 17, 21], [tables[1], tables[3], tables[4]])]
    to_kernel = torch.zeros(len(got), dtype=torch.bool)
    to_kernel[1:17] = to_kernel[34:39] = True
    assert got[to_kernel].eq(-7.0).all()
    torch.testing.assert_close(got[~to_kernel], want[~to_kernel], atol=2e-5, rtol=1e-5)


def test_dispatcher_uses_the_kernel_module(monkeypatch):
    """get_attention_backend wraps whatever cpu_kernel.paged_attention is, not a copy."""
    mod = types.ModuleType(cpu_kernel.__name__)
    mod.available = lambda: True  # type: ignore[attr-defined]
    mod.paged_attention = lambda q, *a: torch.full(q.shape, 3.0)  # type: ignore[attr-defined]
    stand_in(monkeypatch, cpu_kernel.__name__, mod)
    args, _ = mixed_batch([(4, 1), (8, 1)], 16, None, seed=0)
    assert get_attention_backend("cpp").paged_attention(**args).eq(3.0).all()
