"""What `LLM.get_tokenizer()` returns: the model's tokenizer with transformers' method names.

vLLM hands out the Hugging Face tokenizer, and scripts call ``encode``, ``decode`` and
``apply_chat_template`` on it. This is a thin face over PageKV's own tokenizer
(proto.model_files.tokenizer) and chat-template renderer (proto.model_files.chat), with
transformers' names and defaults: ``encode(add_special_tokens=True)``,
``decode(skip_special_tokens=False)``, ``apply_chat_template(tokenize=True,
add_generation_prompt=False)``, returning token ids when tokenizing — transformers 4's
``return_dict=False``, which scripts written for vLLM expect (transformers 5 returns a dict
by default; ``return_dict=True`` gives that).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from pagekv.proto.model_files.chat import Message, apply_chat_template
from pagekv.proto.model_files.tokenizer import Tokenizer


class TransformersStyleTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer  # PageKV's own

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def __len__(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def bos_token(self) -> str | None:
        return self.tokenizer.bos_token

    @property
    def eos_token(self) -> str | None:
        return self.tokenizer.eos_token

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_bos=add_special_tokens)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: Sequence[Message] | Sequence[Sequence[Message]],
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """One conversation (a list of {"role", "content"} dicts) rendered with the model's
        template: the text, or with `tokenize` its token ids (no BOS added: the template
        writes its own special tokens); several conversations give a list of those."""
        if continue_final_message:
            raise ValueError("continue_final_message is not supported")
        if tools is not None:
            kwargs["tools"] = tools
        if documents is not None:
            kwargs["documents"] = documents
        if conversation and not isinstance(conversation[0], Mapping):  # a batch
            return [self.apply_chat_template(c, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             tokenize=tokenize, return_dict=return_dict,
                                             **kwargs)
                    for c in cast("Sequence[Sequence[Message]]", conversation)]
        text = apply_chat_template(self.tokenizer, cast("Sequence[Message]", conversation),
                                   chat_template=chat_template,
                                   add_generation_prompt=add_generation_prompt, **kwargs)
        if not tokenize:
            return text
        ids = self.tokenizer.encode(text, add_bos=False)
        if return_dict:
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        return ids
