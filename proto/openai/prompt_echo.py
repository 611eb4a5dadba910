"""What a completion shows of its own prompt, by vLLM's rules, and the prompt token ids the
front end needs for it.

- `echo`: each choice's text starts with its prompt: the text as given, or a token-id prompt
  decoded with its special tokens (as vLLM detokenizes a prompt). With `return_token_ids`
  the prompt comes back as `prompt_token_ids` instead and the text holds none of it.
- `echo` with `logprobs`, and `return_token_ids`, need the prompt's ids: a text prompt is
  then tokenized here, by the server's own rules (proto.requests: its limits, its
  tokenizer, BOS as it adds one), and sent as those ids, which the server takes as given —
  the same tokens either way. The router tokenizes text prompts this way too.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pagekv.proto.openai.backend import Tokenizer
from pagekv.proto.openai.errors import from_grpc
from pagekv.proto.openai.params import Parsed
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.requests import (
    BadRequest,
    PromptLimits,
    check_request,
    parse_prompt,
    prompt_is_large,
)

logger = logging.getLogger(__name__)

LARGE_PROMPT_IDS = 16384  # decode a token-id prompt off the event loop past this


@dataclass(slots=True)
class PromptEcho:
    """One prompt as its choices show it."""

    text: str = ""                      # what echo puts before each choice's text
    token_ids: list[int] | None = None  # the prompt's ids, where the response needs them


def needs_prompt_ids(parsed: Parsed) -> bool:
    return (parsed.echo and parsed.logprobs) or parsed.token_ids


async def prompt_echoes(requests: list[pb.GenerateRequest], parsed: Parsed,
                        tokenizer: Tokenizer, limits: PromptLimits) -> list[PromptEcho]:
    """Each request's PromptEcho; a text prompt whose ids are needed is tokenized and its
    request changed to carry the ids. BadRequest becomes the 400 the server would give."""
    out = []
    for req in requests:
        try:
            out.append(await _echo_of(req, parsed, tokenizer, limits))
        except BadRequest as exc:
            raise from_grpc("INVALID_ARGUMENT", str(exc)) from None
    return out


async def _echo_of(req: pb.GenerateRequest, parsed: Parsed, tokenizer: Tokenizer,
                   limits: PromptLimits) -> PromptEcho:
    echo = PromptEcho()
    is_text = req.WhichOneof("prompt") == "text"
    if parsed.echo and not parsed.token_ids:
        echo.text = req.text if is_text else await _decoded(tokenizer, list(req.token_ids.ids))
    if not needs_prompt_ids(parsed):
        return echo
    if is_text:
        check_request(req, limits)  # the server's bounds, before the tokenizer's work
        if prompt_is_large(req):
            prompt = await asyncio.to_thread(parse_prompt, req, tokenizer.encode, limits)
        else:
            prompt = parse_prompt(req, tokenizer.encode, limits)
        req.token_ids.ids.extend(prompt.token_ids)  # setting the oneof clears `text`
    echo.token_ids = list(req.token_ids.ids)
    return echo


async def _decoded(tokenizer: Tokenizer, ids: list[int]) -> str:
    """A token-id prompt's text, special tokens included; "" for ids the tokenizer cannot
    decode (the server refuses those ids, naming them)."""
    def decode() -> str:
        try:
            return tokenizer.decode(ids, skip_special_tokens=False)
        except Exception as exc:  # an id outside the vocabulary: the pod says which
            logger.debug("echo: cannot decode the prompt's ids (%s)", exc)
            return ""

    if len(ids) > LARGE_PROMPT_IDS:
        return await asyncio.to_thread(decode)
    return decode()
