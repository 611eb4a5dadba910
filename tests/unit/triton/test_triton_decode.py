"""The Triton paged decode kernel against the torch reference (``paged.paged_attention``).

Without CUDA the kernel runs under Triton's interpreter (see conftest.py), which is slow: each
axis (block size, head size, GQA ratio, cache dtype, split-K, sliding window, table padding,
context length up to 8k) is varied alone against a base case instead of the full cross
product. ``PAGEKV_KERNEL_MATRIX=full`` adds the cross product (meant for a GPU).
``test_compiles_for_cuda`` checks, without a GPU, that the kernels compile for real CUDA
targets.
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

from tests.unit.triton.decode_cases import PADDINGS, make_decode_case

FORMATS = "pagekv.kvnode.model.attention.triton_formats"
MODULE = "pagekv.kvnode.model.attention.triton_decode"
FULL_MATRIX = os.environ.get("PAGEKV_KERNEL_MATRIX", "").lower() == "full"
CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                torch.float8_e5m2]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Scales that are not powers of two: a scale applied twice, or not at all, shows.
FP8_SCALES = dict(k_scale=0.05, v_scale=0.3)
# Contexts 1 (a single key) to a few blocks, on and off block and tile edges.
BASE_LENS = [1, 7, 16, 17, 64, 129, 300]


@pytest.fixture(scope="module")
def decode(kernel_module):
    kernel_module(FORMATS)  # the kernels' helpers first: a re-executed kernel module uses them
    return kernel_module(MODULE)


def check(decode, case, **extra) -> None:
    out = decode.paged_decode(**case.kernel_args(**extra))
    assert out.dtype == torch.float32 and out.shape == case.query.shape
    torch.testing.assert_close(out.cpu(), case.reference(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("padding", PADDINGS)
def test_base_case(decode, triton_device, padding):
    """GQA 4, block 16; table padding -1, a poisoned block, or an id past the pool."""
    check(decode, make_decode_case(BASE_LENS, padding=padding, device=triton_device))


@pytest.mark.parametrize("block_size", [8, 32, 64, 128])
def test_block_sizes(decode, triton_device, block_size):
    check(decode, make_decode_case(BASE_LENS, block_size=block_size, device=triton_device))


@pytest.mark.parametrize("head_size", [96, 128, 256])
def test_head_sizes(decode, triton_device, head_size):
    """96 is not a power of two: a padded, masked head dimension."""
    check(decode, make_decode_case([1, 40, 150], head_size=head_size, device=triton_device))


@pytest.mark.parametrize(("kv_heads", "group"), [(3, 1), (1, 8), (2, 3)])
def test_gqa(decode, triton_device, kv_heads, group):
    """Query heads per KV head 1 (MHA), 8, and 3 (not a power of two); 4 is the base."""
    check(decode, make_decode_case(BASE_LENS, kv_heads=kv_heads, group=group,
                                   device=triton_device))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES[1:], ids=str)
def test_cache_dtypes(decode, triton_device, cache_dtype):
    scales = FP8_SCALES if cache_dtype in FP8 else {}
    check(decode, make_decode_case(BASE_LENS, cache_dtype=cache_dtype, device=triton_device,
                                   **scales))


@pytest.mark.parametrize("query_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16bit_query(decode, triton_device, query_dtype):
    """The query is widened to fp32 in the kernel: the result is the reference's."""
    check(decode, make_decode_case(BASE_LENS, cache_dtype=query_dtype, query_dtype=query_dtype,
                                   device=triton_device))


@pytest.mark.parametrize("num_splits", [2, 3, 7, 16])
def test_split_k(decode, triton_device, num_splits):
    """Partitions merged by the reduction kernel; short sequences leave some empty."""
    check(decode, make_decode_case(BASE_LENS, device=triton_device), num_splits=num_splits)


@pytest.mark.parametrize(("window", "num_splits"), [(1, 1), (5, 1), (40, 3), (40, 1),
                                                    (1000, 2)])
def test_sliding_window(decode, triton_device, window, num_splits):
    """Windows of one key, inside a block, across blocks and tiles (split or not), and
    wider than every context."""
    check(decode, make_decode_case(BASE_LENS, sliding_window=window, device=triton_device),
          num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 8])
def test_long_context(decode, triton_device, num_splits):
    """An 8k context (and a short one beside it), fp8, split-K on and off."""
    case = make_decode_case([8192, 3], block_size=32, kv_heads=1, group=4, head_size=128,
                            cache_dtype=torch.float8_e4m3fn, device=triton_device,
                            **FP8_SCALES)
    check(decode, case, num_splits=num_splits)


def test_long_context_window(decode, triton_device):
    case = make_decode_case([8000], kv_heads=1, group=2, sliding_window=700,
                            device=triton_device)
    check(decode, case, num_splits=4)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_batches(decode, triton_device, seed):
    """Many sequences of random lengths and one random configuration each."""
    gen = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    lens = torch.randint(1, 400, (12,), generator=gen).tolist()
    cache_dtype = pick(CACHE_DTYPES)
    case = make_decode_case(
        lens, block_size=pick([8, 16, 32, 64, 128]), kv_heads=pick([1, 2]),
        group=pick([1, 4, 8]), head_size=pick([64, 96, 128]), cache_dtype=cache_dtype,
        sliding_window=pick([None, 30]), padding=pick(PADDINGS), seed=seed,
        device=triton_device, **(FP8_SCALES if cache_dtype in FP8 else {}))
    check(decode, case, num_splits=pick([1, 2, 5]))


def test_strided_query(decode, triton_device):
    """A query that is a view into a fused QKV tensor (rows not contiguous)."""
    case = make_decode_case([5, 33], device=triton_device)
    fused = torch.cat([case.query, torch.zeros_like(case.query)], dim=1)
    case.query = fused[:, : case.query.shape[1]]
    assert not case.query.is_contiguous()
    check(decode, case)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN codes
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_every_stored_value_decodes_exactly(decode, triton_device, cache_dtype):
    """A context of one key returns that token's V row: for fp8, a row holding all 256 bit
    patterns must come back as torch decodes them (NaN codes as NaN)."""
    head = 256
    kc = torch.zeros(1, 8, 1, head, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    if cache_dtype in FP8:
        vc.view(torch.uint8)[0, 0, 0] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    else:
        vc[0, 0, 0] = torch.randn(head).to(cache_dtype)
    query = torch.randn(1, 2, head)
    out = decode.paged_decode(query.to(triton_device), kc.to(triton_device),
                              vc.to(triton_device),
                              torch.tensor([[0]], dtype=torch.int32, device=triton_device),
                              torch.tensor([1], dtype=torch.int32, device=triton_device),
                              scale=0.1, num_splits=1)
    expect = vc[0, 0, 0].float().expand(2, head)
    torch.testing.assert_close(out[0].cpu(), expect, atol=0, rtol=0, equal_nan=True)


def test_empty_batch_and_bad_arguments(decode, triton_device):
    case = make_decode_case([3], device=triton_device)
    args = case.kernel_args()
    out = decode.paged_decode(**{**args, "query": args["query"][:0],
                                 "seq_lens": args["seq_lens"][:0]})
    assert out.shape == (0, 8, 64)
    with pytest.raises(ValueError, match="does not fit"):
        decode.paged_decode(**{**args, "query": args["query"][:, :3]})
    with pytest.raises(ValueError, match="sliding_window"):
        decode.paged_decode(**{**args, "sliding_window": 0})
    with pytest.raises(ValueError, match="dtype"):
        decode.paged_decode(**{**args, "key_cache": args["key_cache"].double(),
                               "value_cache": args["value_cache"].double()})


def test_choose_num_splits(decode):
    choose = decode.choose_num_splits
    assert choose(256, 8, 8192, 132) == 1  # the batch alone fills the GPU
    assert choose(1, 8, 8192, 132) == 32  # one long sequence: split up to the cap
    assert choose(1, 8, 300, 132) == 1  # too short to split
    assert choose(4, 2, 2048, 132) == 8  # partitions stay >= 256 tokens
    assert decode.auto_num_splits(torch.device("cpu"), 1, 1, 8192) == 1


def _matrix():
    axes = itertools.product(CACHE_DTYPES, [8, 16, 32, 64, 128], [64, 96, 128, 256],
                             [1, 4, 8], [1, 4], [None, 50])
    if FULL_MATRIX:
        return list(axes)
    return [pytest.param(*next(axes), marks=pytest.mark.skip("PAGEKV_KERNEL_MATRIX=full"))]


@pytest.mark.parametrize(("cache_dtype", "block_size", "head_size", "group", "num_splits",
                          "window"), _matrix(), ids=str)
def test_full_matrix(decode, triton_device, cache_dtype, block_size, head_size, group,
                     num_splits, window):
    case = make_decode_case([1, 17, 300, 2049], block_size=block_size, kv_heads=2,
                            group=group, head_size=head_size, cache_dtype=cache_dtype,
                            sliding_window=window, device=triton_device,
                            **(FP8_SCALES if cache_dtype in FP8 else {}))
    check(decode, case, num_splits=num_splits)


_COMPILE_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagekv.kvnode.model.attention import triton_cache as tc, triton_decode as td

    def build(fn, types, consts, arch):
        sig = {name: types.get(name, "i32") for name in fn.arg_names}
        sig.update({name: "constexpr" for name in consts})
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                             for k, v in consts.items()})
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": 4})
        assert "cubin" in compiled.asm, (fn, arch)

    f32 = "*fp32"
    # (arch, cache pointer type, FORMAT): fp32 and E4M3 bytes on Hopper, E4M3 on Ampere (no
    # native fp8 there); the KV write for bf16 (its encoder) and E4M3 bytes.
    for arch, kv, fmt in [(90, "fp32", 0), (90, "u8", 1), (80, "u8", 1)]:
        build(td._decode_split_kernel,
              dict(q_ptr="*bf16", k_cache_ptr="*" + kv, v_cache_ptr="*" + kv,
                   block_tables_ptr="*i32", seq_lens_ptr="*i32", out_ptr=f32,
                   part_max_ptr=f32, part_sum_ptr=f32, part_acc_ptr=f32, qk_scale="fp32",
                   v_scale="fp32"),
              dict(BLOCK_SIZE=16, GROUP=4, GROUP_PAD=16, HEAD_PAD=128, TILE=64,
                   NUM_SPLITS=4, FORMAT=fmt, HAS_WINDOW=True), arch)
    for arch, kv, fmt in [(90, "bf16", 3), (80, "u8", 1)]:
        build(tc._write_kv_kernel,
              dict(key_ptr="*bf16", value_ptr="*bf16", key_cache_ptr="*" + kv,
                   value_cache_ptr="*" + kv, slot_ptr="*i64", k_scale="fp32",
                   v_scale="fp32"),
              dict(BLOCK_SIZE=16, HEAD_PAD=128, TOKENS=16, FORMAT=fmt), arch)
    build(td._decode_merge_kernel,
          dict(out_ptr=f32, part_max_ptr=f32, part_sum_ptr=f32, part_acc_ptr=f32,
               v_scale="fp32"),
          dict(HEAD_PAD=128, NUM_SPLITS=4, SPLITS_PAD=4), 90)
""")


def test_compiles_for_cuda():
    """The decode and KV-write kernels are real Triton: they compile to cubin for Hopper and
    Ampere (ptxas ships with triton), in a fresh interpreter (this one decorates kernels for
    the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas on this machine")
    assert proc.returncode == 0, proc.stderr[-4000:]
