"""Prompts as the server's token ids, for the generation routes and for vLLM's tokenizer
routes (`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`), with vLLM's fields:

- /tokenize: `prompt` (a string; `add_special_tokens`, default true: BOS as the server adds
  it) or `messages` (rendered with the model's chat template; `add_generation_prompt`,
  default true, `chat_template_kwargs`, `add_special_tokens` default false), and
  `return_token_strs`. Reply: `count`, `max_model_len` (null on a router, which has no
  model), `tokens`, `token_strs` (each token decoded alone, special tokens included; null
  unless asked).
- /detokenize: `tokens` -> `prompt` (special tokens included, as vLLM decodes a prompt).
- /tokenizer_info: what lm-evaluation-harness's remote tokenizer reads (`eos_token`,
  `bos_token`, `chat_template`, ...), so it needs no tokenizer files of its own.

The ids are the ones a generation request with the same prompt is served with: the same
tokenizer, the same template, the same BOS rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagekv.proto.model_files.chat import ChatTemplateError, apply_chat_template
from pagekv.proto.openai.backend import Tokenizer
from pagekv.proto.openai.errors import invalid
from pagekv.proto.openai.params import (
    UINT32_MAX,
    parse_messages,
    read_bool,
    read_str,
    template_kwargs,
)
from pagekv.proto.requests import PromptLimits


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], kwargs: dict[str, Any],
                add_special_tokens: bool = False) -> list[int]:
    """A conversation rendered with the model's template and tokenized as the servers do:
    the template writes its own special tokens, so no BOS is added (vLLM's rule)."""
    try:
        text = apply_chat_template(tokenizer, messages, **kwargs)
    except ChatTemplateError as exc:
        raise invalid(str(exc), "messages") from None
    except TypeError as exc:  # a chat_template_kwargs key the renderer reserves
        raise invalid(f"chat_template_kwargs: {exc}", "chat_template_kwargs") from None
    return tokenizer.encode(text, add_bos=add_special_tokens)


@dataclass(slots=True)
class TokenizeAsk:
    """One /tokenize body, read: a prompt or a conversation."""

    model: str | None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = True
    token_strs: bool = False

    def size(self) -> int:
        """Characters to tokenize (whether to do it off the event loop)."""
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m["content"]) for m in self.messages or ())


def parse_tokenize(body: dict[str, Any], limits: PromptLimits) -> TokenizeAsk:
    for name, why in (("chat_template", "a client's template would run in the server"),
                      ("continue_final_message", "not supported"),
                      ("tools", "tools are not supported")):
        if body.get(name):
            raise invalid(f"{name}: {why}", name)
    ask = TokenizeAsk(model=read_str(body, "model"),
                      token_strs=read_bool(body, "return_token_strs"))
    if "messages" in body and "prompt" not in body:
        ask.messages = parse_messages(body["messages"])
        ask.template_kwargs = template_kwargs(body)
        ask.add_special_tokens = read_bool(body, "add_special_tokens", False)
        size = sum(len(m["content"].encode("utf-8")) for m in ask.messages)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise invalid("prompt must be a string (or send messages instead)", "prompt")
        ask.prompt = prompt
        ask.add_special_tokens = read_bool(body, "add_special_tokens", True)
        size = len(prompt.encode("utf-8"))
    if size > limits.max_bytes:
        raise invalid(f"the prompt has {size} bytes; the limit is {limits.max_bytes} "
                      f"(--max-prompt-bytes)", "messages" if ask.messages else "prompt")
    return ask


def tokenize_reply(tokenizer: Tokenizer, ask: TokenizeAsk, max_model_len: int | None,
                   token_text: Callable[[int], str]) -> dict[str, Any]:
    if ask.messages is not None:
        ids = render_chat(tokenizer, ask.messages, ask.template_kwargs, ask.add_special_tokens)
    else:
        ids = tokenizer.encode(ask.prompt or "", add_bos=ask.add_special_tokens)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": [token_text(t) for t in ids] if ask.token_strs else None}


def parse_detokenize(body: dict[str, Any], vocab_size: int) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid("tokens must be an array of token ids", "tokens")
    for i, t in enumerate(tokens):
        if not 0 <= t < min(vocab_size, UINT32_MAX + 1):
            raise invalid(f"tokens[{i}] = {t} is outside the vocabulary (0..{vocab_size - 1})",
                          "tokens")
    return tokens


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int | None) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's configuration."""
    info: dict[str, Any] = {
        "tokenizer_class": type(tokenizer).__name__, "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token, "pad_token": None,
        "model_max_length": max_model_len, "vocab_size": tokenizer.vocab_size}
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info
