"""A GenerateRequest's prompt, read and checked the same way by a pod and by the router.

A client must not be able to tell which one answered: the router refuses a prompt a pod
would refuse, before routing it, in the pod's words (tests/integration/test_api_contract_errors.py
compares the two word for word). What only a pod can know (vocabulary, max_model_len, the
sampling limits) the router leaves to the pod, whose status it passes through unchanged.

Every field a client sends is bounded here (README "Limits"), so that no request costs more
than its limits to read, tokenize, hash or echo back, and the bounds are checked before any
work that grows with the request.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagekv.proto.retention import CacheControl

if TYPE_CHECKING:
    from pagekv.proto.pagekv.v1.pagekv_pb2 import GenerateRequest

# Also the engine's word for a prompt without tokens (e.g. whitespace a tokenizer without
# BOS drops), so the router cannot be told from a pod by it.
EMPTY_PROMPT = "prompt is empty: at least one token is required"


def already_in_flight(request_id: str) -> str:
    """The ALREADY_EXISTS details for a client request id still being served (the client's
    own id, not the engine's escaped form)."""
    return f"request id {request_id!r} is already in flight"


class BadRequest(ValueError):
    """The request cannot be served as sent: gRPC INVALID_ARGUMENT, the message as details."""


class NoSuchAdapter(BadRequest):
    """No pod serves the LoRA adapter asked for: NOT_FOUND / 404, in the same words on the
    router and the pods."""

    def __init__(self, name: str) -> None:
        super().__init__(unknown_adapter(name))
        self.name = name


# -- limits (README "Limits"; pagekv.proto names them too) --------------------------------------
MAX_REQUEST_ID_BYTES = 256   # echoed in every stream chunk: bounds what a stream carries
MAX_CACHE_SALT_BYTES = 256   # mixed into the first block's hash
MAX_STOP_TOKEN_IDS = 64      # compared with every generated token
MAX_STOP_STRINGS = 64        # searched for in every step's new text
MAX_STOP_STRING_BYTES = 1024  # each; the longest sets how much text a stream holds back
MAX_LOGPROBS = 20            # top tokens per generated token (OpenAI's top_logprobs bound)
# 128 Ki tokens: the longest context the supported model families declare (Llama 3.1, Qwen2.5).
DEFAULT_MAX_PROMPT_TOKENS = 131_072
# 8 bytes a token, about twice what BPE tokenizers average on prose or code: a text refused for
# its bytes would have been refused for its tokens, after a tokenizer pass over all of it.
DEFAULT_MAX_PROMPT_BYTES = 8 * DEFAULT_MAX_PROMPT_TOKENS
# What a request holds besides its prompt, at most: id, salt, stop ids, sampling, tags, and
# the stop strings (64 of 1 KiB and their tags: 65,728 bytes).
_MESSAGE_OVERHEAD_BYTES = 128 * 1024
# A uint32 token id takes at most 5 bytes on the wire (varint).
_MAX_ID_WIRE_BYTES = 5
# Prompts past this (text bytes or token ids) are tokenized and hashed off the event loop:
# about a millisecond of tokenizer work, more than a hop to a thread costs.
LARGE_PROMPT = 8_192


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """The prompt's bounds (--max-prompt-bytes, --max-prompt-tokens): give pods and routers
    the same ones, so that a client cannot tell which one refused."""

    max_bytes: int = DEFAULT_MAX_PROMPT_BYTES    # a text prompt's UTF-8 bytes
    max_tokens: int = DEFAULT_MAX_PROMPT_TOKENS  # token_ids sent, or the text's tokens

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_tokens < 1:
            raise ValueError(f"max_prompt_bytes and max_prompt_tokens must be >= 1, got "
                             f"{self.max_bytes} and {self.max_tokens}")

    def describe(self) -> str:
        """For the start-up log."""
        return (f"prompts up to {self.max_bytes} bytes of text and {self.max_tokens} tokens, "
                f"requests up to {self.max_message_bytes} bytes (README \"Limits\")")

    @property
    def max_message_bytes(self) -> int:
        """gRPC's max_receive_message_length for a GenerateRequest: the larger prompt kind at
        its limit plus every other field at its own. Past it gRPC itself refuses the call
        (RESOURCE_EXHAUSTED) before reading the message."""
        prompt = max(self.max_bytes, _MAX_ID_WIRE_BYTES * self.max_tokens)
        return prompt + _MESSAGE_OVERHEAD_BYTES


def add_prompt_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """--max-prompt-bytes and --max-prompt-tokens, the same on `pagekv node` and `router`."""
    parser.add_argument("--max-prompt-bytes", type=int, default=DEFAULT_MAX_PROMPT_BYTES,
                        help="largest text prompt in UTF-8 bytes, refused before tokenizing "
                             "(INVALID_ARGUMENT); give pods and routers the same limits")
    parser.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                        help="most token ids in a prompt, sent or tokenized")


def prompt_limits_from(args: argparse.Namespace) -> PromptLimits:
    return PromptLimits(args.max_prompt_bytes, args.max_prompt_tokens)


def _utf8_bytes(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8"))


def _at_most(what: str, n: int, limit: int, unit: str, flag: str = "") -> None:
    if n > limit:
        raise BadRequest(f"{what} has {n} {unit}; the limit is {limit}"
                         + (f" ({flag})" if flag else ""))


def check_request(request: GenerateRequest, limits: PromptLimits) -> None:
    """BadRequest for a field past its limit or one the servers cannot honour; cheap (no
    tokenizing), so call it first, on the event loop."""
    refuse_unsupported(request)
    _at_most("request_id", _utf8_bytes(request.request_id), MAX_REQUEST_ID_BYTES, "bytes")
    _at_most("cache_salt", _utf8_bytes(request.cache_salt), MAX_CACHE_SALT_BYTES, "bytes")
    if request.HasField("kv_source"):
        _at_most("kv_source.pod_id", _utf8_bytes(request.kv_source.pod_id), MAX_REQUEST_ID_BYTES,
                 "bytes")
        _at_most("kv_source.address", _utf8_bytes(request.kv_source.address),
                 MAX_REQUEST_ID_BYTES, "bytes")
    cache_control_of(request)  # its own BadRequest
    sampling = request.sampling
    _at_most("sampling.stop_token_ids", len(sampling.stop_token_ids), MAX_STOP_TOKEN_IDS, "ids")
    _check_stop_strings(sampling.stop)
    for name in ("logprobs", "prompt_logprobs"):
        if sampling.HasField(name) and getattr(sampling, name) > MAX_LOGPROBS:
            raise BadRequest(f"sampling.{name} is {getattr(sampling, name)}; the limit is "
                             f"{MAX_LOGPROBS}")
    # Checked here too (the pod's SamplingParams would): a vLLM pod behind the router is
    # told the same, and the message names the field alike.
    if sampling.HasField("min_p") and not 0.0 <= sampling.min_p <= 1.0:
        raise BadRequest(f"sampling.min_p must be in [0, 1], got {sampling.min_p:g}")
    kind = request.WhichOneof("prompt")
    if kind == "text":
        _at_most("prompt text", _utf8_bytes(request.text), limits.max_bytes, "bytes",
                 "--max-prompt-bytes")
    elif kind == "token_ids":
        _at_most("prompt token_ids", len(request.token_ids.ids), limits.max_tokens, "ids",
                 "--max-prompt-tokens")


def cache_control_of(request: GenerateRequest) -> CacheControl:
    """The request's retention asks (cache_control, one_shot, session_id); BadRequest when
    they are out of bounds or contradict each other."""
    ttl = request.cache_control.ttl_s if request.HasField("cache_control") else 0
    tokens = request.cache_control.tokens if request.HasField("cache_control") else 0
    if request.HasField("cache_control") and ttl == 0:
        raise BadRequest("cache_control.ttl_s must be 1 to 86400 seconds")
    _at_most("session_id", _utf8_bytes(request.session_id), MAX_REQUEST_ID_BYTES, "bytes")
    try:
        return CacheControl(float(ttl), tokens, request.one_shot, request.session_id)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def prompt_request(message: Any, cache_salt: str) -> GenerateRequest:
    """A GenerateRequest with the prompt `message` carries (its `text` or its `token_ids`,
    whichever is set: an admin call's prompt) and `cache_salt`, to be read as a request's."""
    from pagekv.proto.pagekv.v1.pagekv_pb2 import GenerateRequest

    request = GenerateRequest(cache_salt=cache_salt)
    if message.HasField("text"):
        request.text = message.text
    elif message.HasField("token_ids"):
        request.token_ids.CopyFrom(message.token_ids)
    return request


def _check_stop_strings(stop: Sequence[str]) -> None:
    _at_most("sampling.stop", len(stop), MAX_STOP_STRINGS, "strings")
    for i, s in enumerate(stop):
        if not s:
            raise BadRequest(f"sampling.stop[{i}] is empty: a stop string needs 1 to "
                             f"{MAX_STOP_STRING_BYTES} bytes")
        _at_most(f"sampling.stop[{i}]", _utf8_bytes(s), MAX_STOP_STRING_BYTES, "bytes")


def prompt_is_large(request: GenerateRequest) -> bool:
    """Whether tokenizing or hashing this prompt is worth a thread (LARGE_PROMPT)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return len(request.text) > LARGE_PROMPT  # characters: a lower bound of its bytes
    return kind == "token_ids" and len(request.token_ids.ids) > LARGE_PROMPT


def undecodable(message_name: str, error: Exception) -> str:
    """The INVALID_ARGUMENT details for a body protobuf cannot decode (its own words after
    the colon, e.g. 'String field had bad UTF-8')."""
    why = str(error).rpartition(": ")[2] or type(error).__name__
    return (f"cannot decode the request as {message_name}: {why} (a message cut short, or "
            "a string field such as text, request_id or cache_salt that is not UTF-8)")


NO_INT_ADAPTER_IDS = ("lora_id: vLLM's integer adapter id is not used by PageKV (ids are "
                      "assigned per server, so they name different adapters on different "
                      "pods): name the adapter with lora_name")
MAX_ADAPTER_NAME = 128


def unknown_adapter(name: str) -> str:
    """The one refusal of an adapter no pod serves (router and pods say it alike)."""
    return (f"LoRA adapter {name[:MAX_ADAPTER_NAME]!r} is not loaded (start pods with "
            "--lora-modules NAME=PATH or load it with POST /v1/load_lora_adapter)")


def refuse_unsupported(request: GenerateRequest) -> None:
    """BadRequest for a field the servers accept on the wire but cannot honour."""
    if request.HasField("lora_id"):
        raise BadRequest(NO_INT_ADAPTER_IDS)
    if len(request.lora_name) > MAX_ADAPTER_NAME:
        raise BadRequest(f"lora_name is longer than {MAX_ADAPTER_NAME} characters")


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a request asks to be continued, and what changes its block hashes.

    The pods' rules (kvnode.memory.request): an empty cache salt is no salt, and a LoRA
    adapter is named by lora_name (it enters every block's hash, with its path, via
    proto.hashing.lora_key).
    """

    kind: str                  # the field the client set: "text" or "token_ids"
    token_ids: Sequence[int]   # the text's tokens, or the ids as sent
    cache_salt: str | None
    lora_id: str | None


def parse_prompt(request: GenerateRequest, encode: Callable[[str], Sequence[int]],
                 limits: PromptLimits) -> Prompt:
    """The request's prompt as token ids (`encode` tokenizes a text prompt); BadRequest
    when none is set, it is empty, or its text has more tokens than `limits` allow (the
    other bounds are check_request's, which comes first)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        text = request.text  # each read of a string field copies it
        if not text:
            raise BadRequest("prompt text is empty")
        token_ids: Sequence[int] = encode(text)
        if not token_ids:
            raise BadRequest(EMPTY_PROMPT)
        _at_most("prompt text", len(token_ids), limits.max_tokens, "tokens",
                 "--max-prompt-tokens")
    elif kind == "token_ids":
        token_ids = request.token_ids.ids
        if len(token_ids) == 0:
            raise BadRequest("prompt token_ids is empty")
    else:
        raise BadRequest("prompt is required: set exactly one of text or token_ids")
    return Prompt(kind, token_ids, request.cache_salt or None, request.lora_name or None)
