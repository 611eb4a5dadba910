"""One attention call, two kernels: each sequence goes to whichever path is fastest for its
phase.

The C++ kernel (``cpu_kernel``) reads K/V blocks in place and wins decode by 2-10x over the
reference, but for long queries the reference's gather + torch's fused (flash) SDPA kernel is
faster: a 2,048-token prompt takes 1.4-1.6x longer in the kernel. The crossover, measured with
``python -m bench.attention`` (docs/BENCHMARKS.md §2, "Prefill by phase"), lies near 32 new
tokens over a cached prefix and near 512 tokens for a whole prompt (no prefix) with the
kernel's AVX-512 path, at 8 and 128 with its portable path. So a batch is split by rows:
short queries (decodes, small extends, short prompts) go to the kernel, the others to
``paged.paged_attention``. Batches of one side only, the common case, are passed through
whole with no copy.

The kernel has no sliding window. A row is only sent to it when the window cannot mask
anything (its whole context fits in the window); every other row takes the reference path,
which implements the window, so results equal the reference's for every row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagekv.kvnode.model.attention.paged import paged_attention as reference_attention

PagedAttentionFn = Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class KernelLimits:
    """The longest queries the kernel is faster for (measured, 2 threads, head 64, GQA 4)."""

    max_query_len: int  # new tokens of a sequence, whatever its cached prefix
    max_prompt_len: int  # new tokens of a sequence with no cached prefix (a whole prompt)

    def describe(self) -> str:
        return (f"cpp decode and short prefill (<= {self.max_query_len} new tokens, prompts "
                f"<= {self.max_prompt_len}), torch SDPA longer prefill")


AVX512_LIMITS = KernelLimits(max_query_len=32, max_prompt_len=512)
PORTABLE_LIMITS = KernelLimits(max_query_len=8, max_prompt_len=128)


def _kernel_rows(starts: list[int], lens: list[int], window: int | None,
                 limits: KernelLimits) -> tuple[list[int], list[int]]:
    """(rows for the kernel, rows for the reference); rows without new tokens are in
    neither."""
    kernel, reference = [], []
    for i, ctx in enumerate(lens):
        qlen = starts[i + 1] - starts[i]
        if qlen <= 0:
            continue
        short = qlen <= limits.max_query_len or (qlen == ctx and qlen <= limits.max_prompt_len)
        if short and (window is None or ctx <= window):
            kernel.append(i)
        else:
            reference.append(i)
    return kernel, reference


def _token_index(rows: list[int], starts: list[int], device: torch.device) -> torch.Tensor:
    """Packed positions of the rows' new tokens, in row order."""
    if all(starts[i + 1] - starts[i] == 1 for i in rows):
        return torch.tensor([starts[i] for i in rows], dtype=torch.long, device=device)
    return torch.cat([torch.arange(starts[i], starts[i + 1], device=device) for i in rows])


def _run_rows(fn: PagedAttentionFn, rows: list[int], starts: list[int], out: torch.Tensor,
              query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
              k_scale: float, v_scale: float) -> None:
    """Attention for a subset of the batch's sequences, written into their rows of ``out``."""
    tok = _token_index(rows, starts, query.device)
    sel = torch.tensor(rows, dtype=torch.long, device=block_tables.device)
    qlens = torch.tensor([starts[i + 1] - starts[i] for i in rows], dtype=torch.int32)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    torch.cumsum(qlens, 0, out=qsl[1:])
    out[tok] = fn(
        query[tok], key_cache, value_cache, block_tables[sel],
        seq_lens[sel.to(seq_lens.device)], qsl.to(seq_lens.device), scale, k_scale, v_scale,
    )


def phase_dispatched(kernel: PagedAttentionFn, limits: KernelLimits) -> PagedAttentionFn:
    """A ``paged.paged_attention``-compatible function (``sliding_window`` included) that runs
    the rows within ``limits`` on ``kernel`` (same signature, without ``sliding_window``) and
    the rest on the reference path."""

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
        starts = query_start_loc.tolist()
        if sliding_window is None and len(starts) > 1 and starts == list(range(len(starts))):
            # Every row one token (a decode step): straight to the kernel, no more bookkeeping.
            return kernel(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, scale, k_scale, v_scale)
        lens = seq_lens.tolist()
        to_kernel, to_reference = _kernel_rows(starts, lens, sliding_window, limits)
        args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                scale, k_scale, v_scale)
        if not to_kernel:  # also a batch without new tokens: the reference handles it
            return reference_attention(*args, sliding_window=sliding_window)
        if not to_reference:
            return kernel(*args)
        out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
        common = (starts, out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                  k_scale, v_scale)
        _run_rows(kernel, to_kernel, *common)
        _run_rows(functools.partial(reference_attention, sliding_window=sliding_window),
                  to_reference, *common)
        return out

    paged_attention.__doc__ = phase_dispatched.__doc__
    return paged_attention
