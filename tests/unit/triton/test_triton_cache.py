"""The Triton KV write (``reshape_and_cache``) against the torch reference
(``paged.write_kv_cache``): the caches' bytes must be equal, fp8 and bf16 rounding included.

The reference runs on CPU copies (torch divides by the scale exactly there; on CUDA it
multiplies by the reciprocal, which can round differently)."""

from __future__ import annotations

import pytest
import torch

from pagekv.kvnode.model.attention.paged import write_kv_cache

FORMATS = "pagekv.kvnode.model.attention.triton_formats"
MODULE = "pagekv.kvnode.model.attention.triton_cache"
CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                torch.float8_e5m2]


@pytest.fixture(scope="module")
def cache(kernel_module):
    kernel_module(FORMATS)
    return kernel_module(MODULE)


def run_both(cache, device, key, value, slots, shape, dtype, k_scale, v_scale):
    """The kernel's and the reference's caches (CPU) after writing into equal pools that
    start out as random bytes (so that a slot written by mistake shows)."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randint(0, 256, (2, *shape, torch.finfo(dtype).bits // 8),
                          dtype=torch.uint8, generator=gen).view(dtype).squeeze(-1)
    ref_k, ref_v = start[0].clone(), start[1].clone()
    write_kv_cache(key.cpu(), value.cpu(), ref_k, ref_v, slots.cpu(), k_scale, v_scale)
    kc, vc = start[0].to(device), start[1].to(device)
    cache.reshape_and_cache(key.to(device), value.to(device), kc, vc, slots.to(device),
                            k_scale, v_scale)
    return (kc.cpu(), vc.cpu()), (ref_k, ref_v)


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[:3].tolist()}"


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.3, 1.7)], ids=str)
def test_random_rows_equal_reference(cache, triton_device, cache_dtype, src_dtype, scales):
    """Random slots across the pool, two of them -1 (skipped); values spread over fp8's
    range (some overflow E4M3: saturated to 448, as torch does)."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, head = 9, 16, 2, 64
    n = 40
    key = (torch.randn(n, kv_heads, head, generator=gen) * 100).to(src_dtype)
    value = (torch.randn(n, kv_heads, head, generator=gen) * 3).to(src_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[[3, 17]] = -1
    got, want = run_both(cache, triton_device, key, value, slots,
                         (num_blocks, block_size, kv_heads, head), cache_dtype, *scales)
    assert_same_bytes(got[0], want[0])
    assert_same_bytes(got[1], want[1])


@pytest.mark.parametrize(("block_size", "head"), [(8, 96), (128, 256), (32, 128)])
def test_block_and_head_sizes(cache, triton_device, block_size, head):
    gen = torch.Generator().manual_seed(2)
    n, kv_heads = 21, 3
    key, value = torch.randn(2, n, kv_heads, head, generator=gen)
    slots = torch.randperm(4 * block_size, generator=gen)[:n].to(torch.int32)
    got, want = run_both(cache, triton_device, key, value, slots,
                         (4, block_size, kv_heads, head), torch.bfloat16, 1.0, 1.0)
    assert_same_bytes(got[0], want[0])
    assert_same_bytes(got[1], want[1])


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (ties) and values
    one fp32 ulp either side, both signs; overflow, inf, NaN, fp32 subnormals and zeros."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    else:  # a sample of 16-bit values: every exponent, random mantissas
        gen = torch.Generator().manual_seed(3)
        grid = torch.randint(0, 1 << 16, (4096,), dtype=torch.int32, generator=gen)
        grid = grid.to(torch.int16).view(dtype).float()
    grid = grid[grid.isfinite()].unique()
    mids = ((grid[1:].double() + grid[:-1].double()) / 2).float()
    near = torch.cat([mids, mids.nextafter(torch.tensor(float("inf"))),
                      mids.nextafter(torch.tensor(-float("inf")))])
    info = torch.finfo(dtype)
    specials = torch.tensor([0.0, -0.0, info.max, info.max * 1.01, info.max * 2, 1e30,
                             float("inf"), -float("inf"), float("nan"), 1e-40, -1e-45,
                             info.tiny, info.tiny / 2, info.smallest_normal * 0.75])
    return torch.cat([grid, near, -near, specials, -specials])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 inf
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES[1:], ids=str)
def test_rounding_edges_equal_torch(cache, triton_device, cache_dtype):
    """Round-half-even ties, saturation / inf on overflow, subnormals, NaN."""
    values = _edge_values(cache_dtype)
    head = 128
    n = -(-values.numel() // head)
    flat = torch.zeros(n * head)
    flat[: values.numel()] = values
    key = flat.view(n, 1, head)
    value = -key
    slots = torch.arange(n)
    got, want = run_both(cache, triton_device, key, value, slots, (n, 1, 1, head),
                         cache_dtype, 1.0, 1.0)
    nan_in = key.isnan().view(n, 1, 1, head)
    for g, w in ((got[0], want[0]), (got[1], want[1])):
        assert g.float()[nan_in].isnan().all()
        assert_same_bytes(g[~nan_in], w[~nan_in])


def test_strided_source_rows(cache, triton_device):
    """K and V as views of a fused QKV projection: rows strided, heads contiguous."""
    gen = torch.Generator().manual_seed(4)
    n, kv_heads, head = 13, 2, 64
    qkv = torch.randn(n, 4 * kv_heads, head, generator=gen)
    key, value = qkv[:, 2 * kv_heads: 3 * kv_heads], qkv[:, 3 * kv_heads:]
    assert not key.is_contiguous()
    slots = torch.arange(n) * 3
    got, want = run_both(cache, triton_device, key, value, slots, (10, 8, kv_heads, head),
                         torch.float8_e5m2, 0.5, 0.25)
    assert_same_bytes(got[0], want[0])
    assert_same_bytes(got[1], want[1])


def test_no_tokens_and_bad_shapes(cache, triton_device):
    kc = torch.zeros(2, 8, 2, 64, device=triton_device)
    vc = torch.zeros_like(kc)
    empty = torch.zeros(0, 2, 64, device=triton_device)
    cache.reshape_and_cache(empty, empty, kc, vc, torch.zeros(0, dtype=torch.long))
    assert kc.abs().sum() == 0
    rows = torch.ones(3, 1, 64, device=triton_device)
    with pytest.raises(ValueError, match="do not fit"):
        cache.reshape_and_cache(rows, rows, kc, vc, torch.arange(3))
