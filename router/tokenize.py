"""The router's tokenizer: the same token ids the pods would produce, without torch.

`kvnode.model` imports torch in its package `__init__`, so the router cannot reuse
`kvnode.model.tokenizer`. The rules are the pods' rules, restated here:

* a built-in preset (`pagekv-*`) uses the byte tokenizer: ids 0..255 are the UTF-8 bytes of
  the text, 256 is BOS (prepended), 257 is EOS;
* a model directory uses its `tokenizer.json` (the `tokenizers` library) with special
  tokens on: its own post-processor decides whether a BOS goes in front (Llama and Mistral
  add one; Qwen2 names a bos_token_id in config.json but never uses it).

A mismatch here would only cost hit rate (the pod receives the router's token ids and
hashes exactly those), never correctness.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "pagekv-"
BYTE_BOS = 256
BYTE_EOS = 257


class PromptTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ByteEncoder:
    """The built-in presets' byte tokenizer (encode only: the router never decodes)."""

    __slots__ = ()

    def encode(self, text: str) -> list[int]:
        return [BYTE_BOS, *text.encode("utf-8")]


class HFEncoder:
    """A model directory's `tokenizer.json`."""

    __slots__ = ("_tok",)

    def __init__(self, tokenizer_file: Path) -> None:
        from tokenizers import Tokenizer  # Rust library, no torch

        self._tok = Tokenizer.from_file(str(tokenizer_file))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids


def load_tokenizer(model: str) -> PromptTokenizer:
    """The tokenizer pods serving `model` use; ValueError if it cannot be found."""
    path = Path(model)
    if path.is_dir():
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"model directory {model!r} has no tokenizer.json")
        logger.info("tokenizer: %s", tok_file)
        return HFEncoder(tok_file)
    if model.startswith(BUILTIN_PREFIX):
        return ByteEncoder()
    raise ValueError(
        f"model {model!r} is neither a built-in preset ({BUILTIN_PREFIX}*) nor a local "
        "model directory with a tokenizer.json"
    )
