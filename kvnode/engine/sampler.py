"""Token sampling from a batch of last-token logits.

Greedy rows take the argmax in one batched op. Random rows draw with the exponential race
(argmax of p / q with q ~ Exp(1)), which equals sampling from p, after temperature, min_p,
then top-k and top-p (vLLM's order; greedy rows ignore all four); each seeded sequence draws
its noise from its own generator, so a seeded request is reproducible whatever batch it
shares a step with.

Penalties and min_tokens (logits_processors.py) change the logits of the rows that ask for
them before either; logprobs come from the raw logits (vLLM's default, "raw_logprobs"), for
the rows that ask only. A batch that asks for none of these runs the plain path.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pagekv.kvnode.engine.logits_processors import SeqHistory, process_logits
from pagekv.kvnode.engine.outputs import TokenLogprobs
from pagekv.kvnode.engine.sampling_params import SamplingParams


def _filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p x the most likely token's."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top one always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


@dataclass(slots=True)
class SamplerOutput:
    tokens: list[int]
    # Per row: its TokenLogprobs, or None where it did not ask; None when no row asked.
    logprobs: list[TokenLogprobs | None] | None = None


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[SeqHistory] | None = None,
    eos_token_ids: Collection[int] = (),
) -> SamplerOutput:
    """One token per row of `logits` [num_seqs, vocab] (float32). `histories` (one per row)
    is needed when any row has penalties or min_tokens; `eos_token_ids` for min_tokens."""
    # Row -> how many top logprobs it asked for (besides its sampled token's), ascending rows.
    asked = {i: p.logprobs for i, p in enumerate(params) if p.logprobs is not None}
    # Before anything changes the logits: the model's own distribution.
    raw = logits[list(asked)].log_softmax(-1) if asked else None
    if histories is not None:
        logits = process_logits(logits, params, histories, eos_token_ids)
    tokens = _draw(logits, params, generators)
    if raw is None:
        return SamplerOutput(tokens)
    return SamplerOutput(tokens, _gather_logprobs(raw, asked, len(params), tokens))


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams],
          generators: Sequence[torch.Generator | None]) -> list[int]:
    out = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        # vLLM's order: temperature, then min_p, then top-k and top-p.
        row = logits[i] / p.temperature
        if p.min_p > 0.0:
            row = _filter_min_p(row, p.min_p)
        row = _filter_top_k_top_p(row, p.top_k, p.top_p)
        probs = row.softmax(-1)
        # Noise is drawn on CPU (where the generators live) so a seed gives the same sample
        # on every device.
        noise = torch.empty(probs.shape).exponential_(generator=generators[i]).to(probs.device)
        out[i] = int((probs / noise).argmax())
    return out


def _gather_logprobs(logprobs: torch.Tensor, asked: dict[int, int], num_rows: int,
                     tokens: list[int]) -> list[TokenLogprobs | None]:
    """`logprobs` [len(asked), vocab]: each asking row's sampled token and top k (`asked`:
    row -> k), with one gather and one topk for all of them."""
    picked = torch.tensor([tokens[i] for i in asked], device=logprobs.device)
    sampled = logprobs.gather(1, picked[:, None])[:, 0].tolist()
    k = min(max(asked.values()), logprobs.shape[-1])
    top_vals: list[list[float]] = [[] for _ in asked]
    top_ids: list[list[int]] = [[] for _ in asked]
    if k:
        vals, ids = logprobs.topk(k, -1)  # sorted, best first
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out: list[TokenLogprobs | None] = [None] * num_rows
    for j, (i, n) in enumerate(asked.items()):
        out[i] = TokenLogprobs(tokens[i], sampled[j], list(zip(top_ids[j][:n], top_vals[j][:n],
                                                               strict=True)))
    return out


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    # Wrap into torch's range: sample i of an n>1 request uses seed + i, which overflows for a
    # uint64 seed near 2**64 (and the error failed the whole engine step, every request in it).
    g.manual_seed(seed % (1 << 64) if seed >= 1 << 64 else seed)
    return g
