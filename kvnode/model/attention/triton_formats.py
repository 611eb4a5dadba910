"""Triton helpers shared by the KV-cache kernels: how a cache's dtype is handed to a kernel,
and the fp32 <-> storage conversions, fp8 (E4M3 / E5M2) and the bf16 encoder done on the bits.

Why the bits and not ``x.to(tl.float8e4nv)``: the same code then runs everywhere with torch's
results. Native fp8 casts need sm89+ for E4M3 and saturate E5M2 overflow (torch gives inf);
Triton's CPU interpreter — where the tests run without a GPU — rounds fp8 wrongly and
truncates fp32 -> bf16. A few integer ops per element are free next to the memory traffic
of attention.

fp8 caches are passed to kernels as ``uint8`` views; fp32/fp16/bf16 caches as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_FLOAT = 0  # fp32 / fp16: the kernel converts with .to()
KV_E4M3 = 1  # torch.float8_e4m3fn, as uint8 bits
KV_E5M2 = 2  # torch.float8_e5m2, as uint8 bits
KV_BF16 = 3  # read with .to(); written through the bit encoder

_FORMATS: dict[torch.dtype, int] = {
    torch.float32: KV_FLOAT,
    torch.float16: KV_FLOAT,
    torch.bfloat16: KV_BF16,
    torch.float8_e4m3fn: KV_E4M3,
    torch.float8_e5m2: KV_E5M2,
}


def kv_format(dtype: torch.dtype) -> int:
    """The kernels' code for a cache dtype; ValueError for one they do not handle."""
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise ValueError(f"triton kernels do not handle KV cache dtype {dtype}") from None


def kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel receives for a cache: fp8 as its uint8 bits (same strides)."""
    return cache.view(torch.uint8) if kv_format(cache.dtype) in (KV_E4M3, KV_E5M2) else cache


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def fp8_bits_to_f16(bits, FORMAT: tl.constexpr):
    """uint8 fp8 bits -> fp16, exactly, by moving the bits. E5M2 is fp16's top byte (inf and
    NaN too). E4M3 (fn: no inf, S.1111.111 is NaN) comes out as value * 2^-8: its exponent and
    mantissa move up into fp16's, whose exponent bias is 8 more (15 vs 7), subnormals
    included; its NaN pattern becomes fp16's NaN. Kernels that compute in 16 bits fold the
    2^8 into their scales; `e4m3_to_f32` multiplies it back."""
    b = bits.to(tl.uint16)
    if FORMAT == 2:  # KV_E5M2 (jit code reads no plain globals)
        half_bits = b << 8
    else:
        half_bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        half_bits = tl.where((b & 0x7F) == 0x7F, 0x7E00, half_bits)
    return half_bits.to(tl.float16, bitcast=True)


@triton.jit
def e4m3_to_f32(bits):
    """uint8 E4M3 -> fp32, exactly."""
    return fp8_bits_to_f16(bits, 1).to(tl.float32) * 256.0  # KV_E4M3


@triton.jit
def e5m2_to_f32(bits):
    """uint8 E5M2 -> fp32, exactly."""
    return fp8_bits_to_f16(bits, 2).to(tl.float32)  # KV_E5M2


@triton.jit
def _fp8_magnitude(mag, MANT: tl.constexpr, BIAS: tl.constexpr):
    """Round |x| (its fp32 bits, int32, sign cleared) to the nearest fp8 code, ties to even.
    Finite codes only: out-of-range inputs give garbage that the callers replace."""
    exp = mag >> 23
    # Normal results: drop the low mantissa bits with round-half-even, then rebias.
    drop: tl.constexpr = 23 - MANT
    m = tl.minimum(mag, 0x7F000000)  # keeps the additions below from overflowing int32
    normal = ((m + ((1 << (drop - 1)) - 1) + ((m >> drop) & 1)) >> drop) - ((127 - BIAS) << MANT)
    # Subnormal results (|x| < 2^(1 - BIAS)): the significand, implicit bit included, in
    # units of the smallest subnormal 2^(1 - BIAS - MANT); a carry lands on the first normal.
    sig = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(151 - BIAS - MANT - exp, 1), 31)
    sub = (sig + ((1 << (shift - 1)) - 1) + ((sig >> shift) & 1)) >> shift
    return tl.where(exp >= 128 - BIAS, normal, sub)


@triton.jit
def f32_to_e4m3(x):
    """fp32 -> uint8 E4M3 bits as torch (2.13) casts: round to nearest even, |x| > 448 (inf
    included) saturates to +-448, NaN -> NaN. (E4M3fn has no inf.)"""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    code = _fp8_magnitude(mag, 3, 7)
    code = tl.where(mag > 0x43E00000, 0x7E, code)  # 0x43E00000 = 448.0
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def f32_to_e5m2(x):
    """fp32 -> uint8 E5M2 bits as torch casts: round to nearest even, |x| >= 61440 -> inf,
    NaN -> NaN."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    code = _fp8_magnitude(mag, 2, 15)
    code = tl.where(mag >= 0x47700000, 0x7C, code)  # 0x47700000 = 61440.0
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def f32_to_bf16(x):
    """fp32 -> bf16 as torch casts: round to nearest even on the bits, NaN -> 0x7FC0."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    code = (tl.minimum(mag, 0x7F800000) + 0x7FFF + ((mag >> 16) & 1)) >> 16
    code = tl.where(mag > 0x7F800000, 0x7FC0, code | ((bits >> 16) & 0x8000))
    return code.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def load_as_f32(ptrs, mask, FORMAT: tl.constexpr):
    """Load cache elements (masked lanes read as 0) and widen them to fp32."""
    raw = tl.load(ptrs, mask=mask, other=0)
    if FORMAT == 1:
        return e4m3_to_f32(raw)
    elif FORMAT == 2:
        return e5m2_to_f32(raw)
    else:
        return raw.to(tl.float32)


@triton.jit
def encode_from_f32(x, FORMAT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """fp32 -> what a cache of FORMAT stores (OUT_DTYPE: the float cache's element type)."""
    if FORMAT == 1:
        return f32_to_e4m3(x)
    elif FORMAT == 2:
        return f32_to_e5m2(x)
    elif FORMAT == 3:
        return f32_to_bf16(x)
    else:
        return x.to(OUT_DTYPE)
