"""Tokenizers: a byte tokenizer for the built-in presets and a wrapper around a Hugging Face
``tokenizer.json`` (via the ``tokenizers`` library). Both expose the same small interface."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer as RustTokenizer

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    # The model's Jinja chat template (None: the model has none) and the text of its BOS and
    # EOS tokens, which templates refer to as bos_token / eos_token.
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Tokens 0..255 are the UTF-8 bytes of the text; 256 = BOS, 257 = EOS."""

    BOS = 256
    EOS = 257

    def __init__(self) -> None:
        self.vocab_size = 258
        self.bos_token_id: int | None = self.BOS
        self.eos_token_id: int | None = self.EOS
        self.chat_template: str | None = None
        self.bos_token: str | None = "<s>"
        self.eos_token: str | None = "</s>"

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Random token streams are often not valid UTF-8 (a lone continuation byte, a cut
        # multi-byte character): replace those bytes with U+FFFD instead of raising.
        out: list[str] = []
        run = bytearray()
        for t in token_ids:
            if 0 <= t < 256:
                run.append(t)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
            if not skip_special_tokens:
                out.append({self.BOS: "<s>", self.EOS: "</s>"}.get(t, f"<unk:{t}>"))
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A ``tokenizers`` tokenizer: a ``tokenizer.json`` path, or one already built (from a
    GGUF file's vocabulary, kvnode.model.gguf_tokenizer)."""

    def __init__(self, source: str | Path | RustTokenizer, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        self._tok: RustTokenizer = (_RustTokenizer.from_file(str(source))
                                    if isinstance(source, str | Path) else source)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.bos_token = None if bos_token_id is None else self._tok.id_to_token(bos_token_id)
        self.eos_token = None if eos_token_id is None else self._tok.id_to_token(eos_token_id)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # The tokenizer's own post-processor decides whether a BOS goes in front (Llama and
        # Mistral add one; Qwen2 has a bos_token_id in config.json but never uses it).
        return self._tok.encode(text, add_special_tokens=add_bos).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """This tokenizer as the text of a ``tokenizer.json`` (what `pagekv export-tokenizer`
        writes for a GGUF file, whose vocabulary has no such file)."""
        return self._tok.to_str()
