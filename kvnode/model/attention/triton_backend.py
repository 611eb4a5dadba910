"""The ``triton`` attention backend: the Triton kernels behind the reference's signatures.

``paged_attention`` splits a mixed batch by rows: sequences with one new token (decodes) go
to ``triton_decode.paged_decode`` (GQA-grouped, split-K over long contexts), sequences with
more (prefill chunks, prefix hits) to ``triton_prefill.paged_prefill``. A batch of one phase
only, the common case, goes through whole with no copy. KV writes are
``triton_cache.reshape_and_cache``.

Kernels run on CUDA. On CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1``
when their modules were imported), which is for tests: it is orders of magnitude slower.
"""

from __future__ import annotations

import os
from typing import TypedDict

import torch

from pagekv.kvnode.model.attention import AttentionBackend


class _Scales(TypedDict):
    """The keyword arguments both kernels take alike."""

    scale: float
    k_scale: float
    v_scale: float
    sliding_window: int | None


def _interpreted() -> tuple[bool, bool]:
    """(kernels, triton's own library) decorated for Triton's interpreter? Both are fixed at
    import, by TRITON_INTERPRET at that moment: ``triton.language``'s jit helpers (tl.sum,
    tl.cdiv...) when triton is imported, ours when their modules are."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from pagekv.kvnode.model.attention import triton_decode

    return triton_decode.interpreted(), isinstance(tl.cdiv, InterpretedFunction)


def available(device: torch.device | str) -> tuple[bool, str]:
    """(True, "") if the kernels can run on ``device``, else (False, why)."""
    try:
        import triton  # noqa: F401

        from pagekv.kvnode.model.attention import (  # noqa: F401 - each must import
            triton_cache,
            triton_decode,
            triton_prefill,
        )
    except Exception as exc:  # no triton, or a kernel module that does not import
        return False, f"triton kernels do not import ({type(exc).__name__}: {exc})"
    kind = torch.device(device).type
    kernels, library = _interpreted()
    if kind == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        if kernels or library:
            return False, ("triton or the kernels were imported for Triton's interpreter "
                           "(TRITON_INTERPRET=1), not for the GPU")
        return True, ""
    if kind == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            return False, ("the kernels run on CUDA; on CPU only under Triton's interpreter "
                           "(TRITON_INTERPRET=1 before triton is imported; for tests)")
        if not (kernels and library):
            return False, ("TRITON_INTERPRET=1 was set after triton or the kernel modules "
                           "were imported: they were built for the GPU")
        return True, ""
    return False, f"no triton kernels for device type {kind!r}"


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    from pagekv.kvnode.model.attention.triton_cache import reshape_and_cache

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


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
    """``paged.paged_attention`` on the Triton kernels (same arguments and result)."""
    from pagekv.kvnode.model.attention.triton_decode import auto_num_splits, paged_decode

    num_tokens, num_heads, head_size = query.shape
    out = torch.empty(num_tokens, num_heads, head_size, dtype=torch.float32, device=query.device)
    if num_tokens == 0:
        return out
    # One host sync for the bookkeeping, as the reference: which rows are decodes, and the
    # longest decode context (the split-K choice; paged_decode then needs no sync).
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes: list[int] = []
    others: list[int] = []
    for i, ctx in enumerate(lens):
        qlen = starts[i + 1] - starts[i]
        if qlen <= 0:
            continue
        if ctx < qlen:
            raise ValueError(f"sequence {i}: seq_len {ctx} < query_len {qlen}")
        (decodes if qlen == 1 else others).append(i)
    common = _Scales(scale=scale, k_scale=k_scale, v_scale=v_scale,
                     sliding_window=sliding_window)
    if decodes:
        splits = auto_num_splits(query.device, len(decodes), key_cache.shape[2],
                                 max(lens[i] for i in decodes), sliding_window)
        if not others and len(decodes) == len(lens):  # every row a decode: no gather
            return paged_decode(query, key_cache, value_cache, block_tables, seq_lens,
                                num_splits=splits, **common)
        rows = _index(decodes, block_tables.device)
        tok = _index([starts[i] for i in decodes], query.device)
        out[tok] = paged_decode(query[tok], key_cache, value_cache, block_tables[rows],
                                seq_lens[rows.to(seq_lens.device)], num_splits=splits,
                                **common)
    if others:
        from pagekv.kvnode.model.attention.triton_prefill import paged_prefill as prefill

        if not decodes:  # paged_prefill skips rows without new tokens itself
            return prefill(query, key_cache, value_cache, block_tables, seq_lens,
                           query_start_loc, **common)
        rows = _index(others, block_tables.device)
        tok = torch.cat([torch.arange(starts[i], starts[i + 1], device=query.device)
                         for i in others])
        qsl = [0]
        for i in others:
            qsl.append(qsl[-1] + starts[i + 1] - starts[i])
        out[tok] = prefill(query[tok], key_cache, value_cache, block_tables[rows],
                           seq_lens[rows.to(seq_lens.device)],
                           _index(qsl, seq_lens.device, torch.int32), **common)
    return out


def _index(values: list[int], device: torch.device,
           dtype: torch.dtype = torch.long) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def backend() -> AttentionBackend:
    return AttentionBackend("triton", paged_attention, write_kv_cache)
