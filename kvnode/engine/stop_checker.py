"""Whether a sequence ends with the token it just took, and why (vLLM's rules).

In order: a stop token id (stop_reason = the id) or EOS unless ignore_eos (stop_reason None),
whose text stays out of the completion; a stop string that the new text completes
(stop_reason = the string; the text ends before it, the token ids keep the token); max_tokens
or max_model_len ("length"). None of the stops count before min_tokens tokens.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagekv.kvnode.engine.scheduler import Sequence
    from pagekv.proto.model_files.tokenizer import Tokenizer


def check_stop(seq: Sequence, tokenizer: Tokenizer, eos_token_ids: Collection[int],
               max_model_len: int) -> None:
    """Decode the sequence's last token into its text and set its finish_reason and
    stop_reason when that token ends it."""
    p = seq.group.params
    req = seq.req
    out = req.output_token_ids
    token = out[-1]
    may_stop = len(out) > p.min_tokens
    if may_stop and token in p.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
    elif may_stop and not p.ignore_eos and token in eos_token_ids:
        seq.finish_reason = "stop"
    if seq.finish_reason is not None:
        seq.text.flush(tokenizer, out[:-1])  # the stop token's text is not the completion's
        return
    hit = seq.text.add(tokenizer, out, p.stop if may_stop else ())
    if hit is not None:
        seq.finish_reason, seq.stop_reason = "stop", hit
    elif len(out) >= p.max_tokens or req.num_tokens >= max_model_len:
        seq.finish_reason = "length"
        seq.text.flush(tokenizer, out)
