"""Token sampling from a batch of last-token logits.

Greedy rows take the argmax in one batched op. Random rows draw with the exponential race
(argmax of p / q with q ~ Exp(1)), which equals sampling from p; each seeded sequence draws
its noise from its own generator, so a seeded request is reproducible whatever batch it
shares a step with.
"""

from __future__ import annotations

import torch

from pagekv.kvnode.engine.sampling_params import SamplingParams


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


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` [num_seqs, vocab] (float32)."""
    out = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        # Noise is drawn on CPU (where the generators live) so a seed gives the same sample
        # on every device.
        noise = torch.empty(probs.shape).exponential_(generator=generators[i]).to(probs.device)
        out[i] = int((probs / noise).argmax())
    return out


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    # Wrap into torch's range: sample i of an n>1 request uses seed + i, which overflows for a
    # uint64 seed near 2**64 (and the error failed the whole engine step, every request in it).
    g.manual_seed(seed % (1 << 64) if seed >= 1 << 64 else seed)
    return g
