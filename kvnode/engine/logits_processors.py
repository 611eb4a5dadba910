"""What changes a batch's logits before sampling: penalties and min_tokens' stop-token mask.

Only the rows that ask for it pay for it: `process_logits` returns the batch unchanged (the
same tensor) when no row is penalised or still short of its min_tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pagekv.kvnode.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SeqHistory:
    """What the penalties and min_tokens read of one row's sequence."""

    output_ids: Sequence[int]  # the completion's tokens so far
    prompt_ids: torch.Tensor | None = None  # long tensor; only the repetition penalty reads it


def token_counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """counts[r, t]: how often token t occurs in ids[r] ([rows, vocab], float32), with one
    bincount over the rows' ids offset by row."""
    lengths = [len(x) for x in ids]
    flat = [t for x in ids for t in x]
    if not flat:
        return torch.zeros(len(ids), vocab, device=device)
    offsets = torch.repeat_interleave(torch.arange(len(ids)) * vocab, torch.tensor(lengths))
    keys = (torch.tensor(flat, dtype=torch.long) + offsets).to(device)
    return torch.bincount(keys, minlength=len(ids) * vocab).view(len(ids), vocab).float()


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[SeqHistory]) -> torch.Tensor:
    """vLLM's order: the repetition penalty on every token seen in the prompt or the output
    (a positive logit divided by it, any other multiplied), then OpenAI's
    logits -= frequency * count + presence * (count > 0) over the output's tokens."""
    rows, vocab = logits.shape
    dev = logits.device
    counts = token_counts([h.output_ids for h in histories], vocab, dev)
    in_output = counts > 0
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        seen = in_output.clone()
        for r, h in enumerate(histories):
            if rep[r] != 1.0 and h.prompt_ids is not None:
                seen[r].index_fill_(0, h.prompt_ids.to(dev), True)
        factor = torch.tensor(rep, device=dev, dtype=logits.dtype)[:, None]
        scaled = torch.where(logits > 0, logits / factor, logits * factor)
        logits = torch.where(seen, scaled, logits)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    return logits - freq * counts - pres * in_output


def stop_ids_to_mask(p: SamplingParams, eos_token_ids: Collection[int], vocab: int) -> list[int]:
    """The tokens min_tokens keeps out of sampling: stop_token_ids and, unless ignore_eos, EOS
    (ids past the vocabulary cannot be sampled anyway)."""
    ids = set(p.stop_token_ids)
    if not p.ignore_eos:
        ids.update(eos_token_ids)
    return sorted(t for t in ids if t < vocab)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   histories: Sequence[SeqHistory],
                   eos_token_ids: Collection[int]) -> torch.Tensor:
    """The batch with each row's penalties and min_tokens mask applied (a new tensor), or
    `logits` itself when no row needs either."""
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    short = [i for i, p in enumerate(params) if len(histories[i].output_ids) < p.min_tokens]
    if not penalised and not short:
        return logits
    logits = logits.clone()
    if penalised:
        logits[penalised] = apply_penalties(logits[penalised], [params[i] for i in penalised],
                                            [histories[i] for i in penalised])
    vocab = logits.shape[-1]
    for i in short:
        masked = stop_ids_to_mask(params[i], eos_token_ids, vocab)
        if masked:
            logits[i, masked] = float("-inf")
    return logits
