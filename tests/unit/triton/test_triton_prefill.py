"""The Triton paged prefill kernel against the torch reference (``paged.paged_attention``).

Without CUDA the kernel runs under Triton's interpreter (see conftest.py), which is slow: each
axis (cache dtype, block size, head size, GQA, sliding window, context length) is varied
alone against a base case instead of the full cross product. ``PAGEKV_KERNEL_MATRIX=full``
adds the cross product (meant for a GPU). ``test_compiles_for_cuda`` checks, without a GPU,
that the kernel compiles for real CUDA targets.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.unit.triton.prefill_cases import MIXED, make_case

MODULE = "pagekv.kvnode.model.attention.triton_prefill"
FULL_MATRIX = os.environ.get("PAGEKV_KERNEL_MATRIX", "").lower() == "full"
CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                torch.float8_e5m2]
# fp8 with calibrated-looking scales, so that a scale applied twice or not at all shows.
FP8_SCALES = dict(k_scale=0.05, v_scale=0.125)
# Triton's interpreter multiplies bf16 operands of tl.dot as their raw bit patterns (it keeps
# bf16 as uint16; "we just don't support it yet", triton-lang/triton#11584): bf16 products are
# checked on a GPU only. fp16 runs the same code path under the interpreter.
BF16_DOT_OK = torch.cuda.is_available()


@pytest.fixture(scope="module")
def prefill(kernel_module):
    return kernel_module(MODULE).paged_prefill


def check(prefill, case) -> None:
    if case.query.dtype == torch.bfloat16 and case.compute_16bit and not BF16_DOT_OK:
        pytest.skip("bf16 tl.dot under Triton's interpreter (triton-lang/triton#11584)")
    out = prefill(**case.kernel_args())
    assert out.dtype == torch.float32 and out.shape == case.query.shape
    ref = case.reference()
    tol = 2e-2 if case.compute_16bit else 1e-4
    torch.testing.assert_close(out.cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_mixed_batch(prefill, triton_device, index_dtype):
    case = make_case(MIXED, kv_heads=2, group=2, device=triton_device)
    case.seq_lens = case.seq_lens.to(index_dtype)
    case.query_start_loc = case.query_start_loc.to(index_dtype)
    check(prefill, case)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES[1:], ids=str)
def test_cache_dtypes(prefill, triton_device, cache_dtype):
    scales = FP8_SCALES if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else {}
    check(prefill, make_case(MIXED, cache_dtype=cache_dtype, device=triton_device, **scales))


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2),
], ids=str)
def test_16bit_products(prefill, triton_device, query_dtype, cache_dtype):
    """A 16-bit query runs both products on 16-bit operands (tensor cores on a GPU)."""
    scales = FP8_SCALES if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else {}
    case = make_case(MIXED, query_dtype=query_dtype, cache_dtype=cache_dtype,
                     device=triton_device, **scales)
    assert case.compute_16bit
    check(prefill, case)


@pytest.mark.parametrize("block_size", [8, 32, 64, 128])
def test_block_sizes(prefill, triton_device, block_size):
    check(prefill, make_case(MIXED, block_size=block_size, device=triton_device))


@pytest.mark.parametrize("head_size", [96, 128, 256])
def test_head_sizes(prefill, triton_device, head_size):
    seqs = [(20, 1), (0, 17), (33, 9)]
    check(prefill, make_case(seqs, head_size=head_size, device=triton_device))


@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (1, 4), (2, 8), (2, 3)])
def test_gqa(prefill, triton_device, kv_heads, group):
    """Query heads per KV head 1, 4, 8 and 3 (not a power of two: padded rows)."""
    check(prefill, make_case(MIXED, kv_heads=kv_heads, group=group, device=triton_device))


@pytest.mark.parametrize("window", [1, 5, 16, 40, 200])
def test_sliding_window(prefill, triton_device, window):
    """Windows inside one key tile, across blocks and tiles, and wider than every context."""
    seqs = [(90, 1), (0, 30), (60, 25), (3, 1), (130, 7)]
    check(prefill, make_case(seqs, sliding_window=window, device=triton_device))


def test_long_context(prefill, triton_device):
    """An 8k context: a short chunk on a long cached prefix and a decode at 8192."""
    seqs = [(8180, 12), (8191, 1)]
    check(prefill, make_case(seqs, block_size=32, kv_heads=1, group=1, device=triton_device))


def test_long_context_window(prefill, triton_device):
    seqs = [(4090, 6), (4095, 1)]
    check(prefill, make_case(seqs, kv_heads=1, group=1, sliding_window=100,
                             device=triton_device))


def test_decodes_only(prefill, triton_device):
    seqs = [(0, 1), (7, 1), (15, 1), (16, 1), (100, 1)]
    check(prefill, make_case(seqs, kv_heads=2, group=4, device=triton_device))


def test_single_sequence_and_no_cached_prefix(prefill, triton_device):
    check(prefill, make_case([(0, 70)], device=triton_device))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_batches(prefill, triton_device, seed):
    """Random mixes of (cached, new) lengths and one random configuration each."""
    gen = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    seqs = [(int(torch.randint(0, 150, (1,), generator=gen)),
             pick([0, 1, 1, 2, 15, 16, 17, 40])) for _ in range(6)]
    cache_dtype = pick(CACHE_DTYPES)
    scales = FP8_SCALES if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else {}
    case = make_case(seqs, block_size=pick([8, 16, 32]), kv_heads=pick([1, 2]),
                     group=pick([1, 2, 4]), head_size=pick([64, 96]), cache_dtype=cache_dtype,
                     sliding_window=pick([None, 9, 33]), seed=seed, device=triton_device,
                     **scales)
    check(prefill, case)


# The interpreter's numpy matmul warns on the E5M2 infinities in V (the results are exact).
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_every_fp8_value_dequantizes_exactly(prefill, triton_device, cache_dtype, query_dtype):
    """One key, so the output is its V row times v_scale: a row of all 256 byte patterns
    must come out as torch converts them, bit for bit (subnormals, infinities and NaN
    included: the kernel decodes fp8 bits itself). The key row is the finite ones."""
    values = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    raw = values.float()
    finite = torch.where(raw.isfinite(), raw, 0.0).to(cache_dtype)
    key_cache = torch.zeros(3, 8, 1, 256, dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    key_cache[2, 0, 0] = finite.view(torch.uint8).flip(0).view(cache_dtype)
    value_cache[2, 0, 0] = values
    out = prefill(
        torch.randn(1, 2, 256).to(query_dtype).to(triton_device), key_cache.to(triton_device),
        value_cache.to(triton_device), torch.tensor([[2, 0]], dtype=torch.int32,
                                                    device=triton_device),
        torch.tensor([1], device=triton_device), torch.tensor([0, 1], device=triton_device),
        scale=0.1, k_scale=3.0, v_scale=0.125)
    expected = (raw * 0.125).expand(2, 256)
    torch.testing.assert_close(out[0].cpu(), expected, atol=0, rtol=0, equal_nan=True)


def test_all_rows_empty(prefill, triton_device):
    case = make_case([(5, 0), (0, 0), (17, 0)], device=triton_device)
    out = prefill(**case.kernel_args())
    assert out.shape == (0, 2, 64) and out.dtype == torch.float32


def test_rejects_bad_arguments(prefill, triton_device):
    case = make_case([(3, 2)], kv_heads=2, group=2, device=triton_device)
    args = case.kernel_args()
    with pytest.raises(ValueError, match="multiple of KV heads"):
        prefill(**{**args, "query": args["query"][:, :3]})
    with pytest.raises(ValueError, match="sliding_window"):
        prefill(**{**args, "sliding_window": 0})
    with pytest.raises(ValueError, match="num_seqs \\+ 1"):
        prefill(**{**args, "query_start_loc": args["query_start_loc"][:1]})
    with pytest.raises(ValueError, match="last"):
        strided = args["key_cache"].transpose(2, 3).contiguous().transpose(2, 3)
        prefill(**{**args, "key_cache": strided})


def _matrix():
    axes = itertools.product(CACHE_DTYPES, [8, 16, 32, 64, 128], [64, 96, 128, 256],
                             [1, 4, 8], [None, 24])
    if FULL_MATRIX:
        return list(axes)
    return [pytest.param(*next(axes), marks=pytest.mark.skip("PAGEKV_KERNEL_MATRIX=full"))]


@pytest.mark.parametrize(("cache_dtype", "block_size", "head_size", "group", "window"),
                         _matrix(), ids=str)
def test_full_matrix(prefill, triton_device, cache_dtype, block_size, head_size, group,
                     window):
    """Each case with the query dtype a GPU model would use (one compile per case: the
    product is about 600 kernels, compile-bound; Triton's cache makes reruns quick): the
    cache's dtype for 16-bit caches, bf16 on fp8 (fp16 where the interpreter cannot run bf16
    products), fp32 on fp32. fp32 queries on the other caches are the base tests' cases."""
    scales = FP8_SCALES if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else {}
    query_dtype = {torch.float32: torch.float32, torch.float16: torch.float16}.get(
        cache_dtype, torch.bfloat16 if BF16_DOT_OK else torch.float16)
    if cache_dtype == torch.bfloat16 and not BF16_DOT_OK:
        query_dtype = torch.float32
    seqs = [(300, 1), (0, 45), (130, 70), (17, 0), (2000, 33), (1, 1)]
    check(prefill, make_case(seqs, block_size=block_size, kv_heads=2, group=group,
                             head_size=head_size, cache_dtype=cache_dtype,
                             query_dtype=query_dtype, sliding_window=window,
                             device=triton_device, **scales))


_COMPILE_SCRIPT = textwrap.dedent("""
    import sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagekv.kvnode.model.attention import triton_prefill as tp

    fn = tp._paged_prefill_kernel
    # (arch, query, cache, GROUP, HEAD_SIZE, BLOCK_SIZE, USE_WINDOW), the tiles the launcher
    # would pick; strides and the window equal to 1 are compile-time constants, as Triton
    # specialises them at launch.
    configs = [
        (90, "fp32", "fp32", 1, 64, 16, False),
        (90, "bf16", "bf16", 8, 128, 32, True),
        (90, "bf16", "e4m3", 4, 96, 16, True),
        (80, "fp16", "e4m3", 4, 256, 128, False),  # Ampere: Triton's fp8e4nv needs sm_89
        (80, "fp16", "e5m2", 2, 64, 8, True),
    ]
    for arch, qdt, kvdt, group, head, block, window in configs:
        head_pad = triton.next_power_of_2(head)
        block_q, tile_n, warps = tp._tiles(head_pad, triton.next_power_of_2(group))
        compute = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}[qdt]
        consts = dict(GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_Q=block_q,
                      HEAD_SIZE=head, HEAD_PAD=head_pad, BLOCK_SIZE=block, TILE_N=tile_n,
                      USE_WINDOW=window, COMPUTE=compute,
                      FP8_FORMAT={"e4m3": 1, "e5m2": 2}.get(kvdt, 0),
                      window=1, stride_bt=1)
        sig = {name: "i32" for name in fn.arg_names}
        cache = "*u8" if kvdt in ("e4m3", "e5m2") else "*" + kvdt  # fp8 goes as bytes
        sig.update(q_ptr="*" + qdt, k_cache_ptr=cache, v_cache_ptr=cache,
                   out_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                   qsl_ptr="*i64", qk_scale="fp32", v_scale="fp32")
        sig.update({name: "constexpr" for name in consts})
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                             for k, v in consts.items()})
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": warps})
        assert "cubin" in compiled.asm, arch
""")


def test_compiles_for_cuda():
    """The kernel is real Triton: it compiles to cubin for Hopper and Ampere (ptxas ships
    with triton), in a fresh interpreter (this one decorates kernels for the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas on this machine")
    assert proc.returncode == 0, proc.stderr[-4000:]
