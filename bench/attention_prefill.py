"""Prefill rows of ``bench.attention`` (issue #17): which path is fastest for each phase on CPU.

For each case the same K/V is stored in a paged cache (random block tables) and as contiguous
``[1, kv_heads, ctx, head]`` tensors. Timed side by side, interleaved:

* ``sdpa``    contiguous ``scaled_dot_product_attention`` (is_causal for a cold prompt, the
              bottom-right causal mask for an extend): the bar, no paging at all;
* ``kernel``  the C++ kernel alone (``cpu_kernel.paged_attention``) for every row;
* ``ref``     the pure-torch reference (``paged.paged_attention``: gather, then SDPA);
* ``auto``    what ``get_attention_backend("auto", "cpu")`` dispatches to (the ``cpp``
              backend: decode rows to the kernel, the others to the reference).

Cases: cold prompts of 128 to 2,048 tokens, extends of 8 to 128 new tokens over a 2,048-token
cached prefix (the kernel/reference crossover lies in both ranges), and one mixed engine step
(16 decodes at 2,048 beside a 1,008-token chunk over 1,024 cached tokens; its ``sdpa`` is one
call per sequence).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagekv.kvnode.model.attention import cpu_kernel, get_attention_backend
from pagekv.kvnode.model.attention.paged import paged_attention as reference_attention

Timer = Callable[[dict[str, Callable[[], object]], int, float],
                 dict[str, tuple[float, float, float]]]

COLD = ((0, 128), (0, 512), (0, 1024), (0, 2048))
QUICK_COLD = ((0, 512), (0, 2048))
EXTENDS = ((2048, 8), (2048, 32), (2048, 64), (2048, 128))
QUICK_EXTENDS = ((2048, 32), (2048, 128))


def build_batch(seqs: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int,
                head_size: int, seed: int = 0) -> dict:
    """seqs: (cached, new) per sequence. The paged batch plus each sequence's contiguous
    ``k``/``v`` ``[1, kv_heads, ctx, head]`` and query ``[1, heads, new, head]``."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=gen)
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, head_size)
    value_cache = torch.zeros_like(key_cache)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    contig, queries, used = [], [], 0
    for i, ((cached, new), nb) in enumerate(zip(seqs, need, strict=True)):
        ctx = cached + new
        blocks = perm[used : used + nb]
        used += nb
        tables[i, :nb] = blocks.to(torch.int32)
        k = torch.randn(1, kv_heads, ctx, head_size, generator=gen)
        v = torch.randn(1, kv_heads, ctx, head_size, generator=gen)
        pad = nb * block_size - ctx
        for src, dst in ((k, key_cache), (v, value_cache)):
            rows = F.pad(src[0].transpose(0, 1), (0, 0, 0, 0, 0, pad))  # [nb*bs, kvh, D]
            dst[blocks] = rows.reshape(nb, block_size, kv_heads, head_size)
        q = torch.randn(new, heads, head_size, generator=gen)
        queries.append(q)
        contig.append((q.transpose(0, 1).unsqueeze(0), k, v))
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(torch.int32)
    return {
        "paged": {
            "query": torch.cat(queries), "key_cache": key_cache, "value_cache": value_cache,
            "block_tables": tables,
            "seq_lens": torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
            "query_start_loc": qsl, "scale": 1.0 / math.sqrt(head_size),
        },
        "contig": contig,
    }


def sdpa_contiguous(batch: dict) -> torch.Tensor:
    """Each sequence on its own contiguous tensors, packed like the paged output."""
    scale = batch["paged"]["scale"]
    outs = []
    for q, k, v in batch["contig"]:
        new, ctx = q.shape[2], k.shape[2]
        if new == ctx:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:  # new tokens are the last positions: bottom-right causal
            mask = torch.ones(new, ctx, dtype=torch.bool).tril(ctx - new)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def run(timer: Timer, rounds: int, min_round_s: float, quick: bool, heads: int,
        kv_heads: int, head_size: int) -> list[dict]:
    """Print the prefill table and return its rows."""
    auto = get_attention_backend("auto", "cpu")
    cases: list[tuple[str, list[tuple[int, int]]]] = [
        (f"cold {n}", [(c, n)]) for c, n in (QUICK_COLD if quick else COLD)
    ] + [(f"extend {c}+{n}", [(c, n)]) for c, n in (QUICK_EXTENDS if quick else EXTENDS)]
    # An engine step of chunked prefill: 16 decodes beside a prompt's second 1,008-token chunk.
    cases.append(("mixed 16x1+1008", [(2047, 1)] * 16 + [(1024, 1008)]))
    print(f"\nprefill by phase, fp32, {heads} heads / {kv_heads} KV heads, head {head_size}, "
          f"block 16; µs per call (fastest); ratio = method / sdpa; auto = {auto.describe()}")
    names = ["sdpa", "kernel", "ref", "auto"]
    print(f"{'case':>18} " + " ".join(f"{n:>11}" for n in names)
          + f" {'kernel/sdpa':>11} {'ref/sdpa':>9} {'auto/sdpa':>9} {'auto/best':>9}"
          + f" {'max_err':>9}")
    rows = []
    for label, seqs in cases:
        batch = build_batch(seqs, 16, heads, kv_heads, head_size)
        args = batch["paged"]
        fns: dict[str, Callable[[], object]] = {
            "sdpa": lambda b=batch: sdpa_contiguous(b),
            "kernel": lambda a=args: cpu_kernel.paged_attention(**a),
            "ref": lambda a=args: reference_attention(**a),
            "auto": lambda a=args: auto.paged_attention(**a),
        }
        want = sdpa_contiguous(batch)
        err = max(float((fn() - want).abs().max()) for name, fn in fns.items()
                  if name != "sdpa")
        t = {k: v[0] for k, v in timer(fns, rounds, min_round_s).items()}
        row = {"case": label, "seqs": seqs, **{f"{k}_us": round(v, 1) for k, v in t.items()},
               "kernel_over_sdpa": t["kernel"] / t["sdpa"], "ref_over_sdpa": t["ref"] / t["sdpa"],
               "auto_over_sdpa": t["auto"] / t["sdpa"],
               "auto_over_best": t["auto"] / min(t["kernel"], t["ref"]), "max_abs_err": err}
        rows.append(row)
        print(f"{label:>18} " + " ".join(f"{t[n]:>11.1f}" for n in names)
              + f" {row['kernel_over_sdpa']:>11.2f} {row['ref_over_sdpa']:>9.2f}"
              + f" {row['auto_over_sdpa']:>9.2f} {row['auto_over_best']:>9.2f} {err:>9.1e}",
              flush=True)
    return rows
