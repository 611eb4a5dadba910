"""A completion's text as its tokens arrive: incremental detokenizing, stop strings, and the
tail held back while it could still be the start of a stop string.

Detokenizing decodes a short window of tokens per step, not the whole output: the text of
tokens[prefix:] minus that of tokens[prefix:read], where `prefix` and `read` move on each time
new text is complete (the prefix window gives the new tokens their left context, which
tokenizers that drop a word's leading space at the start of a decode need). Text that ends in
U+FFFD, a UTF-8 character cut between tokens, waits for the next token, unless it is the end.
Special tokens (BOS, EOS, a chat template's markers) are left out of the text unless the
request's skip_special_tokens is False (the tokenizer's decode does either).

Stop strings follow vLLM: checked on the new text each step (a match may begin in earlier text
and must end in the new text), the text ends just before the match, and the last (longest stop
string - 1) characters are held back until the completion ends, so that a streamed client never
sees text that a later match cuts. Where several stop strings match, the earliest one wins
(vLLM takes the first in list order), so the text never contains any of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagekv.proto.model_files.tokenizer import Tokenizer


def find_stop(text: str, new_chars: int, stop: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence in `text` of a stop string that ends within its last
    `new_chars` characters: (where it starts, which one), or None."""
    best: tuple[int, str] | None = None
    for s in stop:
        at = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if at != -1 and (best is None or at < best[0]):
            best = (at, s)
    return best


class OutputText:
    __slots__ = ("_prefix", "_read", "_skip_special", "_unsent")

    def __init__(self, skip_special_tokens: bool = True) -> None:
        self._skip_special = skip_special_tokens  # SamplingParams.skip_special_tokens
        self._prefix = 0  # the window's first token: left context for the new ones
        self._read = 0  # tokens before this one are in the text
        self._unsent = ""  # text not handed out yet (take)

    def _decode_new(self, tokenizer: Tokenizer, ids: Sequence[int], final: bool) -> str:
        skip = self._skip_special
        before = tokenizer.decode(ids[self._prefix : self._read], skip_special_tokens=skip)
        text = tokenizer.decode(ids[self._prefix :], skip_special_tokens=skip)
        if len(text) <= len(before) or (not final and text.endswith("\ufffd")):
            return ""  # nothing new yet, or a character still cut short
        self._prefix, self._read = self._read, len(ids)
        return text[len(before) :]

    def add(self, tokenizer: Tokenizer, ids: Sequence[int], stop: Sequence[str]) -> str | None:
        """Take in the text of the tokens of `ids` (the whole output so far) that are new
        since the last call. Returns the stop string of `stop` that the new text completes,
        the text then ending just before it; None otherwise."""
        new = self._decode_new(tokenizer, ids, final=False)
        if not new:
            return None
        self._unsent += new
        hit = find_stop(self._unsent, len(new), stop) if stop else None
        if hit is None:
            return None
        self._unsent = self._unsent[: hit[0]]
        return hit[1]

    def flush(self, tokenizer: Tokenizer, ids: Sequence[int]) -> None:
        """The completion ended after `ids`: what is still undecoded joins the text, a cut
        character included (as U+FFFD)."""
        self._unsent += self._decode_new(tokenizer, ids, final=True)

    def take(self, stop: Sequence[str], finished: bool) -> str:
        """The text to hand out now: all of it once finished, otherwise all but the last
        (longest stop string - 1) characters."""
        keep = max(map(len, stop)) - 1 if stop and not finished else 0
        cut = max(0, len(self._unsent) - keep)
        out, self._unsent = self._unsent[:cut], self._unsent[cut:]
        return out
