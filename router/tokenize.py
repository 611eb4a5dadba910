"""The router's tokenizer is the pods' own (pagekv.proto.model_files), read without torch, so
the ids it hashes are the ids a pod would produce: the byte tokenizer for a built-in preset, the
vocabulary inside a GGUF file (or a file preset such as smollm2-135m-instruct), a model
directory's tokenizer.json. A mismatch would only cost hit rate (the pod receives the router's
token ids and hashes exactly those), never correctness.
"""

from __future__ import annotations

import logging

from pagekv.proto.model_files import Tokenizer, prompt_tokenizer
from pagekv.proto.model_files.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

PromptTokenizer = Tokenizer  # what Router needs of it: encode(text)
ByteEncoder = ByteTokenizer  # the built-in presets' byte tokenizer


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer pods serving `model` use; ValueError (ModelLoadError) naming why not."""
    tok = prompt_tokenizer(model)
    logger.info("tokenizer for %s: %s (vocabulary %d)", model, type(tok).__name__,
                tok.vocab_size)
    return tok
