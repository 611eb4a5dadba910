"""An OpenAI request body read into the pods' own contract (pb.SamplingParams).

Each check names the field it refuses, as OpenAI's 400s do. Types are checked here; ranges
that the engine defines (temperature >= 0, top_p in (0, 1], n <= max_n, ...) are left to the
pod, whose INVALID_ARGUMENT names the field too, so one rule holds for gRPC and HTTP alike.
Parameters PageKV does not implement are refused by name (`REFUSED`) rather than ignored;
parameters it has never heard of are ignored and listed in `Parsed.ignored`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagekv.proto.openai.errors import invalid
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.requests import MAX_LOGPROBS
from pagekv.proto.retention import MAX_TTL_S

UINT32_MAX = (1 << 32) - 1
MAX_PROMPTS = 64  # prompts in one /v1/completions call (each is its own engine request)
MAX_CHOICES = 256  # prompts x n

T = TypeVar("T")


def _is_false(v: Any) -> bool:
    return v is None or v is False


def _is_empty(v: Any) -> bool:
    return v is None or v == {} or v == [] or v == ""


# Parameters users send that PageKV does not implement: a request that uses one is refused
# with a 400 naming it (a silent ignore would return something other than what was asked).
# Each entry says when the parameter is harmless (its default or an "off" value).
REFUSED: dict[str, Callable[[Any], bool]] = {
    "logit_bias": _is_empty,
    "suffix": _is_empty,
    "tools": _is_empty,
    "functions": _is_empty,
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
    "structured_outputs": lambda v: v is None,
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "use_beam_search": _is_false,
    "include_stop_str_in_output": _is_false,
    "continue_final_message": _is_false,
    "chat_template": lambda v: v is None,  # a client's template would run in the server
    "truncate_prompt_tokens": lambda v: v is None,
    "allowed_token_ids": lambda v: v is None,
    "bad_words": _is_empty,
    "documents": lambda v: v is None,
    "mm_processor_kwargs": lambda v: v is None,
    "priority": lambda v: v in (None, 0),
}

# Accepted and used, or accepted as harmless metadata (user, metadata, store, ...).
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
    "stop_token_ids", "ignore_eos", "stream", "stream_options", "logprobs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "cache_salt", "request_id", "user",
    "best_of", "metadata", "store", "service_tier", "parallel_tool_calls", "length_penalty",
    "spaces_between_special_tokens", "return_tokens_as_token_ids", "return_token_ids",
    "min_p", "skip_special_tokens", "prompt_logprobs", "echo",
    "cache_control", "one_shot", "session_id",
}
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                         "add_generation_prompt", "chat_template_kwargs"}


@dataclass(slots=True)
class Parsed:
    """What one request asks for, ready to become one engine request per prompt."""

    model: str | None
    sampling: pb.SamplingParams
    n: int
    stream: bool
    include_usage: bool
    cache_salt: str
    request_id: str | None
    logprobs: bool
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:<id>"
    token_ids: bool = False  # vLLM's return_token_ids: each choice's ids and the prompt's
    # vLLM's echo: completions prepend the prompt (its tokens to logprobs too); chat the
    # last message when it is the answer's role.
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (1 token computed)
    num_logprobs: int | None = None  # completions' `logprobs` (top_logprobs shows k + 1)
    prompt_logprobs: int | None = None  # vLLM's, shown as prompt_logprobs (not streamed)
    ignored: list[str] = field(default_factory=list)
    # PageKV's cache control (README "Cache control"): a pin of the prompt's first
    # `pin_tokens` (0: all of it; a chat message's breakpoint sets `pin_message`), one-shot,
    # and the session (`session_id`, else `user`).
    pin_ttl_s: int = 0
    pin_tokens: int = 0
    pin_message: int | None = None
    one_shot: bool = False
    session_id: str = ""


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean",
            type(None): "null"}.get(type(v), "number")


def read_int(body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None
             ) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # 16.0 is 16, as lenient JSON readers take it
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"{name} must be an integer, got {_type_name(v)} {_show(v)}", name)
    if lo is not None and v < lo:
        raise invalid(f"{name} must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise invalid(f"{name} must be <= {hi}, got {v}", name)
    return v


def read_number(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise invalid(f"{name} must be a number, got {_type_name(v)} {_show(v)}", name)
    if not math.isfinite(v) or abs(v) > 3.4e38:  # beyond float32: the wire's type
        raise invalid(f"{name} must be a finite number, got {_show(v)}", name)
    return float(v)


def _typed(body: dict[str, Any], name: str, kind: type[T], what: str) -> T | None:
    v = body.get(name)
    if v is not None and not isinstance(v, kind):
        raise invalid(f"{name} must be {what}, got {_type_name(v)} {_show(v)}", name)
    return v


def read_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = _typed(body, name, bool, "a boolean")
    return default if v is None else v


def read_str(body: dict[str, Any], name: str) -> str | None:
    return _typed(body, name, str, "a string")


def _stop_strings(body: dict[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid("stop must be a string or an array of strings", "stop")
    return v


def _token_ids(body: dict[str, Any], name: str) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in v):
        raise invalid(f"{name} must be an array of non-negative integer token ids", name)
    return v


def _check_fields(body: dict[str, Any], known: set[str]) -> list[str]:
    for name, harmless in REFUSED.items():
        if name in body and not harmless(body[name]):
            raise invalid(f"{name} is not supported by PageKV (README \"OpenAI API\" lists what "
                          f"is)", name)
    return sorted(k for k in body if k not in known and k not in REFUSED)


_TTL_UNITS = {"s": 1, "m": 60, "h": 3600}
# Anthropic's breakpoint without a ttl keeps its cache five minutes: so does PageKV's.
DEFAULT_PIN_TTL_S = 300


def read_cache_control(value: Any, where: str) -> tuple[int, int]:
    """A `cache_control` object, `{"type": "ephemeral", "ttl": "1h" | 3600, "tokens": N}`, as
    (ttl seconds, tokens); `type` is optional, and `ephemeral` the only one."""
    if not isinstance(value, dict) or set(value) - {"type", "ttl", "tokens"}:
        raise invalid(f"{where} must be an object with optional type, ttl and tokens",
                      "cache_control")
    if value.get("type", "ephemeral") != "ephemeral":
        raise invalid(f"{where}.type must be \"ephemeral\"", "cache_control")
    ttl: Any = value.get("ttl", DEFAULT_PIN_TTL_S)
    if isinstance(ttl, str) and ttl[-1:] in _TTL_UNITS and ttl[:-1].isdigit():
        ttl = int(ttl[:-1]) * _TTL_UNITS[ttl[-1]]
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= int(MAX_TTL_S):
        raise invalid(f"{where}.ttl must be 1 to {int(MAX_TTL_S)} seconds, as a number or "
                      f"\"30s\", \"5m\", \"1h\"; got {_show(ttl)}", "cache_control")
    tokens = read_int(value, "tokens", 0, UINT32_MAX) or 0
    return ttl, tokens


def _retention(body: dict[str, Any], parsed: Parsed) -> None:
    if body.get("cache_control") is not None:
        parsed.pin_ttl_s, parsed.pin_tokens = read_cache_control(body["cache_control"],
                                                                 "cache_control")
    parsed.one_shot = read_bool(body, "one_shot")
    session = read_str(body, "session_id")
    if session is None:
        session = read_str(body, "user")
    if session is not None and len(session.encode()) > 256:
        raise invalid("session_id is at most 256 bytes", "session_id")
    parsed.session_id = session or ""
    if parsed.one_shot and (parsed.pin_ttl_s or parsed.session_id):
        raise invalid("a one_shot request cannot also pin a prefix or join a session "
                      "(cache_control, session_id or user)", "one_shot")


def parse_common(body: dict[str, Any], *, chat: bool) -> Parsed:
    """The fields completions and chat share; `sampling.logprobs` and max_tokens' default
    differ between them and are set here by kind."""
    ignored = _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    sp = pb.SamplingParams()
    if chat:
        max_tokens = read_int(body, "max_completion_tokens", 1, UINT32_MAX)
        if max_tokens is None:
            max_tokens = read_int(body, "max_tokens", 1, UINT32_MAX)
    else:
        # OpenAI's legacy completions default: 16 tokens (chat: up to the context length);
        # an explicit null is up to the context length, as vLLM reads it. With echo, 0 asks
        # for the prompt alone: one token is computed and left out (vLLM's rule).
        max_tokens = read_int(body, "max_tokens", 0 if read_bool(body, "echo") else 1,
                              UINT32_MAX)
        max_tokens = 16 if "max_tokens" not in body else max_tokens
    if max_tokens is not None:
        sp.max_tokens = max(max_tokens, 1)
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = read_number(body, name)
        if value is not None:
            setattr(sp, name, value)
    min_p = read_number(body, "min_p")
    if min_p is not None:
        if not 0.0 <= min_p <= 1.0:
            raise invalid(f"min_p must be in [0, 1], got {_show(min_p)}", "min_p")
        sp.min_p = min_p
    skip_special = _typed(body, "skip_special_tokens", bool, "a boolean")
    if skip_special is not None:
        sp.skip_special_tokens = skip_special
    top_k = read_int(body, "top_k", -1, (1 << 31) - 1)
    if top_k is not None and top_k > 0:
        sp.top_k = top_k
    seed = read_int(body, "seed")
    if seed is not None:
        sp.seed = seed % (1 << 64)  # any integer: the wire's uint64 takes it modulo 2**64
    n = read_int(body, "n", 1, MAX_CHOICES) or 1
    best_of = read_int(body, "best_of", 1, MAX_CHOICES)
    if best_of is not None and best_of != n:
        raise invalid(f"best_of={best_of} != n={n} is not supported (no beam or best-of "
                      f"selection)", "best_of")
    sp.n = n
    sp.stop.extend(_stop_strings(body))
    sp.stop_token_ids.extend(_token_ids(body, "stop_token_ids"))
    sp.ignore_eos = read_bool(body, "ignore_eos")
    min_tokens = read_int(body, "min_tokens", 0, UINT32_MAX)
    if min_tokens:
        sp.min_tokens = min_tokens
    stream = read_bool(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options is only allowed when stream is true",
                          "stream_options")
        if not isinstance(options, dict):
            raise invalid("stream_options must be an object", "stream_options")
        include_usage = read_bool(options, "include_usage")
    prompt_logprobs = read_int(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    if prompt_logprobs and stream:  # vLLM's rule: a stream's events have no place for them
        raise invalid("prompt_logprobs is not available when stream is true",
                      "prompt_logprobs")
    parsed = Parsed(model=read_str(body, "model"), sampling=sp, n=n, stream=stream,
                    include_usage=include_usage, cache_salt=read_str(body, "cache_salt") or "",
                    request_id=read_str(body, "request_id"), logprobs=False,
                    tokens_as_ids=read_bool(body, "return_tokens_as_token_ids"),
                    token_ids=read_bool(body, "return_token_ids"), echo=read_bool(body, "echo"),
                    echo_only=read_bool(body, "echo") and max_tokens == 0,
                    prompt_logprobs=None if stream else prompt_logprobs, ignored=ignored)
    _retention(body, parsed)
    return parsed


def parse_completion(body: dict[str, Any]) -> tuple[Parsed, list[str | list[int]]]:
    """A /v1/completions body: its parameters and its prompts (text or token ids each).
    Echo with logprobs puts the prompt's tokens first in logprobs: the engine is asked for
    the prompt's logprobs then (as many top tokens as `prompt_logprobs`, else `logprobs`)."""
    parsed = parse_common(body, chat=False)
    logprobs = read_int(body, "logprobs", 0, UINT32_MAX)
    if logprobs is not None:
        parsed.sampling.logprobs = logprobs
        parsed.logprobs = True
        parsed.num_logprobs = logprobs
    _ask_prompt_logprobs(parsed, logprobs if parsed.echo else None)
    return parsed, _prompts(body.get("prompt"))


def _ask_prompt_logprobs(parsed: Parsed, for_echo: int | None) -> None:
    """Set the engine's prompt_logprobs where the response shows them."""
    wanted = parsed.prompt_logprobs if parsed.prompt_logprobs is not None else for_echo
    if wanted is not None:
        parsed.sampling.prompt_logprobs = wanted


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                       for t in v)


def _prompts(v: Any) -> list[str | list[int]]:
    if v is None:
        raise invalid("prompt is required", "prompt")
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v and _is_ids(v):
        prompts: list[str | list[int]] = [v]
    elif isinstance(v, list) and v and all(isinstance(p, str) or (_is_ids(p) and p) for p in v):
        prompts = list(v)
    else:
        raise invalid("prompt must be a string, an array of token ids, or a non-empty array of "
                      "either", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise invalid(f"prompt has {len(prompts)} prompts; the limit is {MAX_PROMPTS}", "prompt")
    for p in prompts:
        if not isinstance(p, str) and any(t < 0 or t > UINT32_MAX for t in p):
            raise invalid("prompt token ids must be non-negative integers", "prompt")
    return prompts


def parse_chat(body: dict[str, Any]) -> tuple[Parsed, list[dict[str, Any]], dict[str, Any]]:
    """A /v1/chat/completions body: its parameters, its messages (text content only) and the
    template's extra variables."""
    parsed = parse_common(body, chat=True)
    if read_bool(body, "logprobs"):
        parsed.sampling.logprobs = read_int(body, "top_logprobs", 0, UINT32_MAX) or 0
        parsed.logprobs = True
    elif body.get("top_logprobs") is not None:
        read_int(body, "top_logprobs", 0, UINT32_MAX)
        raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    _ask_prompt_logprobs(parsed, None)
    messages = parse_messages(body.get("messages"))
    breakpoint = _last_breakpoint(body["messages"])
    if breakpoint is not None:
        index, control = breakpoint
        ttl, _ = read_cache_control(control, f"messages[{index}].cache_control")
        parsed.pin_ttl_s = max(parsed.pin_ttl_s, ttl)
        parsed.pin_message = index
    if parsed.one_shot and parsed.pin_ttl_s:
        raise invalid("a one_shot request cannot also pin a prefix", "one_shot")
    return parsed, messages, template_kwargs(body)


def _last_breakpoint(messages: list[Any]) -> tuple[int, Any] | None:
    """The last message with a `cache_control` (on the message or on one of its content
    parts, as Anthropic's API places it): the prompt through that message is pinned."""
    found = None
    for i, m in enumerate(messages):
        parts = m.get("content") if isinstance(m.get("content"), list) else []
        marks = [m.get("cache_control")] + [p.get("cache_control") for p in parts
                                           if isinstance(p, dict)]
        marks = [c for c in marks if c is not None]
        if marks:
            found = (i, marks[-1])
    return found


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The chat template's extra variables: chat_template_kwargs and add_generation_prompt."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs must be an object", "chat_template_kwargs")
    return {**kwargs, "add_generation_prompt": read_bool(body, "add_generation_prompt", True)}


def parse_messages(v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not v:
        raise invalid("messages must be a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where} must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise invalid(f"{where}.role must be a non-empty string", "messages")
        if m.get("tool_calls") or m.get("function_call"):
            raise invalid(f"{where}: tool calls are not supported", "messages")
        out.append({"role": role, "content": _content(m.get("content"), where)})
    return out


def _content(v: Any, where: str) -> str:
    """A message's content: a string, or an array of text parts (joined, as OpenAI reads
    them); an image, audio or file part is refused."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for j, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}]: only text parts are supported, got "
                              f"{_show(kind) if kind else _type_name(part)}", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"{where}.content must be a string or an array of text parts", "messages")
