"""Batches for the paged prefill kernel's tests: a block pool with the sequences' blocks at
random places, the rest of the pool, every block's unused tail and the block tables' padding
poisoned with NaN (a kernel that reads outside the context shows it in its output), and the
same pool clean for the torch reference (whose decode path reads whole blocks, masked)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagekv.kvnode.model.attention.kv_cache import FP8_DTYPES
from pagekv.kvnode.model.attention.paged import paged_attention, write_kv_cache


@dataclass
class Case:
    """What the kernel and the reference are called with."""

    query: torch.Tensor
    key_cache: torch.Tensor  # poisoned: the kernel's
    value_cache: torch.Tensor
    clean_key_cache: torch.Tensor  # the reference's
    clean_value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    k_scale: float = 1.0
    v_scale: float = 1.0
    sliding_window: int | None = None
    compute_16bit: bool = field(default=False)  # the kernel's products run in fp16/bf16

    def kernel_args(self) -> dict:
        return dict(
            query=self.query, key_cache=self.key_cache, value_cache=self.value_cache,
            block_tables=self.block_tables, seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc, scale=self.scale, k_scale=self.k_scale,
            v_scale=self.v_scale, sliding_window=self.sliding_window,
        )

    def reference(self) -> torch.Tensor:
        args = self.kernel_args()
        args.update(key_cache=self.clean_key_cache, value_cache=self.clean_value_cache)
        return paged_attention(**{k: v.cpu() if torch.is_tensor(v) else v
                                  for k, v in args.items()})


def make_case(
    seqs: list[tuple[int, int]],
    *,
    block_size: int = 16,
    kv_heads: int = 1,
    group: int = 2,
    head_size: int = 64,
    cache_dtype: torch.dtype = torch.float32,
    query_dtype: torch.dtype = torch.float32,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    table_padding: int = 2,
    seed: int = 0,
    device: str = "cpu",
) -> Case:
    """seqs: (cached, new) tokens per sequence, in batch order."""
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    need = [-(-(c + n) // block_size) for c, n in seqs]
    spare = 3
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    poison_blocks = perm[sum(need):]
    # Padding points at poisoned blocks (a read of it shows), not at -1 (a read of -1 would
    # land before the pool, undetected).
    width = max(need, default=0) + table_padding
    block_tables = torch.tensor(poison_blocks[:1] * (len(seqs) * width),
                                dtype=torch.int32).view(len(seqs), width)
    shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache = torch.zeros(shape, dtype=cache_dtype)
    value_cache = torch.zeros(shape, dtype=cache_dtype)
    taken = 0
    tails: list[tuple[int, int]] = []  # (block, first unused offset)
    # Values near the fp8 ranges' middle once divided by the scales.
    amp = min(k_scale, v_scale) * 8 if cache_dtype in FP8_DTYPES else 1.0
    for i, (c, n) in enumerate(seqs):
        ctx = c + n
        blocks = perm[taken : taken + need[i]]
        taken += need[i]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        if ctx % block_size:
            tails.append((blocks[-1], ctx % block_size))
        pos = torch.arange(ctx)
        slots = torch.tensor(blocks, dtype=torch.long)[pos // block_size] * block_size
        slots += pos % block_size
        k = torch.randn(ctx, kv_heads, head_size, generator=gen) * amp
        v = torch.randn(ctx, kv_heads, head_size, generator=gen) * amp
        write_kv_cache(k, v, key_cache, value_cache, slots, k_scale, v_scale)
    poisoned_k, poisoned_v = key_cache.clone(), value_cache.clone()
    nan = torch.tensor(float("nan")).to(cache_dtype)
    for cache in (poisoned_k, poisoned_v):
        cache[poison_blocks] = nan
        for block, first in tails:
            cache[block, first:] = nan
    q_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    query = torch.randn(int(q_lens.sum()), heads, head_size, generator=gen).to(query_dtype)
    compute_16bit = query_dtype in (torch.float16, torch.bfloat16) and (
        cache_dtype == query_dtype or cache_dtype in FP8_DTYPES)
    return Case(
        query=query.to(device), key_cache=poisoned_k.to(device),
        value_cache=poisoned_v.to(device), clean_key_cache=key_cache,
        clean_value_cache=value_cache, block_tables=block_tables.to(device),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device), scale=head_size**-0.5, k_scale=k_scale,
        v_scale=v_scale, sliding_window=sliding_window, compute_16bit=compute_16bit,
    )


# A mixed batch: decodes (one at context 1), a fresh prefill, chunked prefills and prefix
# hits that start mid-block and on block edges, and a zero-length row between them.
MIXED = [(37, 1), (0, 19), (16, 16), (0, 1), (45, 0), (50, 13), (3, 29), (70, 1)]
