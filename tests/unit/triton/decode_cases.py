"""Decode batches for the Triton decode kernel's tests: each sequence's blocks at random places
in the pool; for the kernel, every block it does not own and every block's unused tail hold
NaN, and the block tables' entries past the last used block are padding (-1, a poisoned
block's id, or an id past the pool), so a read outside the context shows in the output. The
torch reference gets the same pool clean and its padding zeroed (its decode path gathers
whole padded rows of the table, masked)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagekv.kvnode.model.attention.kv_cache import FP8_DTYPES
from pagekv.kvnode.model.attention.paged import paged_attention, write_kv_cache

PADDINGS = ("minus_one", "poisoned", "out_of_range")


@dataclass
class DecodeCase:
    query: torch.Tensor  # [num_seqs, heads, head_size], on the test device
    key_cache: torch.Tensor  # poisoned: the kernel's
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # padded
    seq_lens: torch.Tensor
    scale: float
    k_scale: float
    v_scale: float
    sliding_window: int | None
    clean_key_cache: torch.Tensor  # on CPU: the reference's
    clean_value_cache: torch.Tensor
    clean_block_tables: torch.Tensor

    def kernel_args(self, **extra: object) -> dict:
        return dict(query=self.query, key_cache=self.key_cache, value_cache=self.value_cache,
                    block_tables=self.block_tables, seq_lens=self.seq_lens, scale=self.scale,
                    k_scale=self.k_scale, v_scale=self.v_scale,
                    sliding_window=self.sliding_window, **extra)

    def reference(self) -> torch.Tensor:
        n = self.query.shape[0]
        return paged_attention(
            self.query.cpu(), self.clean_key_cache, self.clean_value_cache,
            self.clean_block_tables, self.seq_lens.cpu(), torch.arange(n + 1, dtype=torch.int32),
            self.scale, self.k_scale, self.v_scale, self.sliding_window,
        )


def make_decode_case(
    lens: list[int],
    *,
    block_size: int = 16,
    kv_heads: int = 2,
    group: int = 4,
    head_size: int = 64,
    cache_dtype: torch.dtype = torch.float32,
    query_dtype: torch.dtype = torch.float32,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    padding: str = "minus_one",
    seed: int = 0,
    device: str = "cpu",
) -> DecodeCase:
    """lens: each sequence's context length (>= 1), the decoded token included."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    spare = 2
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    poisoned_blocks = perm[sum(need):]
    pad_id = {"minus_one": -1, "poisoned": poisoned_blocks[0],
              "out_of_range": num_blocks + 1000}[padding]
    width = max(need) + 3
    tables = torch.full((len(lens), width), pad_id, dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache = torch.zeros(shape, dtype=cache_dtype)
    value_cache = torch.zeros(shape, dtype=cache_dtype)
    live = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    # fp8: values spread over the format's range once divided by the scales.
    amp = 8.0 * min(k_scale, v_scale) if cache_dtype in FP8_DTYPES else 1.0
    taken = 0
    for i, n in enumerate(lens):
        blocks = perm[taken : taken + need[i]]
        taken += need[i]
        tables[i, : need[i]] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        slots = torch.tensor(blocks, dtype=torch.long)[pos // block_size] * block_size
        slots += pos % block_size
        live.view(-1)[slots] = True
        k = torch.randn(n, kv_heads, head_size, generator=gen) * amp
        v = torch.randn(n, kv_heads, head_size, generator=gen) * amp
        write_kv_cache(k, v, key_cache, value_cache, slots, k_scale, v_scale)
    # Poison through a byte view (fp8 has no masked_fill): NaN's bytes, every element.
    nan_bytes = torch.tensor([float("nan")]).to(cache_dtype).view(torch.uint8)
    poisoned_k, poisoned_v = key_cache.clone(), value_cache.clone()
    for cache in (poisoned_k, poisoned_v):
        raw = cache.view(torch.uint8).view(num_blocks, block_size, -1, nan_bytes.numel())
        raw[~live] = nan_bytes
    clean_tables = tables.clone()
    for i in range(len(lens)):
        clean_tables[i, need[i]:] = 0
    query = torch.randn(len(lens), kv_heads * group, head_size, generator=gen).to(query_dtype)
    return DecodeCase(
        query=query.to(device), key_cache=poisoned_k.to(device),
        value_cache=poisoned_v.to(device), block_tables=tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), scale=head_size**-0.5,
        k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
        clean_key_cache=key_cache, clean_value_cache=value_cache,
        clean_block_tables=clean_tables,
    )
