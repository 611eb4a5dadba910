"""Prompt log-probabilities (SamplingParams.prompt_logprobs), computed as the prompt prefills.

The logits at position p predict token p + 1, so prompt token j (j >= 1) is scored by the row
of position j - 1; token 0 has no entry (None, as vLLM). A prefill chunk scores the prompt
tokens its positions predict, and a chunk recomputed after a preemption skips what is already
scored. The values are the raw model's (log_softmax of the logits, before any penalty or
temperature), as vLLM's default "raw_logprobs".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagekv.kvnode.engine.outputs import TokenLogprobs

# log_softmax over this many rows at a time: a whole 2,048-token chunk at once would hold a
# second [rows, vocab] float32 copy of the logits (400 MB for a 49k vocabulary).
ROWS_PER_SLICE = 256


def rows_to_score(num_computed: int, num_new: int, num_prompt: int,
                  num_scored: int) -> tuple[int, int] | None:
    """Which new tokens of a step's chunk (positions num_computed ... + num_new - 1) predict a
    prompt token not scored yet (tokens 1 .. num_scored - 1 are): (offset among the new
    tokens, count), or None."""
    first = max(num_scored, num_computed + 1)  # the first prompt token to score
    last = min(num_prompt - 1, num_computed + num_new)
    if last < first:
        return None
    return first - 1 - num_computed, last - first + 1


def score_tokens(logits: torch.Tensor, targets: Sequence[int],
                 num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Row i of `logits` [rows, vocab] scores token targets[i] and lists its num_top[i] most
    likely tokens (best first), one topk for all the rows."""
    k = min(max(num_top, default=0), logits.shape[-1])
    picked: list[float] = []
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    tgt = torch.tensor(list(targets), device=logits.device)
    for a in range(0, logits.shape[0], ROWS_PER_SLICE):
        lp = logits[a : a + ROWS_PER_SLICE].log_softmax(-1)
        picked += lp.gather(1, tgt[a : a + ROWS_PER_SLICE, None])[:, 0].tolist()
        if k:
            vals, ids = lp.topk(k, -1)
            top_vals += vals.tolist()
            top_ids += ids.tolist()
    out = []
    for i, (tok, n) in enumerate(zip(targets, num_top, strict=True)):
        top = list(zip(top_ids[i][:n], top_vals[i][:n], strict=True)) if n else []
        out.append(TokenLogprobs(tok, picked[i], top))
    return out
