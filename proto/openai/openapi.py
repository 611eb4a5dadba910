"""GET /openapi.json: the HTTP API as an OpenAPI 3.1 document, built from the app's own route
table and the request fields params.py accepts, so it cannot fall behind either: a route or
an accepted field without a description here fails the app's construction.

PageKV's extensions are described where they appear: `cache_salt` and `request_id` in the
requests; the `pagekv` object in the replies (cached tokens by tier, the pod that served it,
the router's decision with its candidates and the peer a pod pulled its prefix from — the
`kv_source` the router set); the response headers naming the pod and the ignored fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.routing import Route

from pagekv.proto.openai.params import CHAT_FIELDS, COMPLETION_FIELDS, REFUSED
from pagekv.proto.requests import MAX_LOGPROBS

Schema = dict[str, Any]
REF = "#/components/schemas/"


def _t(kind: str, description: str = "", **extra: Any) -> Schema:
    out: Schema = {"type": kind, **extra}
    if description:
        out["description"] = description
    return out


def _nullable(schema: Schema) -> Schema:
    return {**schema, "type": [schema["type"], "null"]}


def _obj(properties: dict[str, Schema], description: str = "",
         required: Sequence[str] = ()) -> Schema:
    out = _t("object", description, properties=properties)
    if required:
        out["required"] = list(required)
    return out


def _ref(name: str) -> Schema:
    return {"$ref": REF + name}


def _array(items: Schema, description: str = "") -> Schema:
    return _t("array", description, items=items)


_INT_IDS = _array(_t("integer", minimum=0))
_STRINGS = {"oneOf": [_t("string"), _array(_t("string"))]}

# Every request field the completion and chat routes accept (params.py's sets) and the
# parameters they refuse by name.
FIELDS: dict[str, Schema] = {
    "model": _t("string", "A served model name (GET /v1/models); default: the first"),
    "prompt": {"description": "Text, token ids, or an array of either (one request each, "
               "at most 64)", "oneOf": [_t("string"), _INT_IDS, _array(
                   {"oneOf": [_t("string"), _INT_IDS]})]},
    "messages": _array(_obj({"role": _t("string"), "content": {"oneOf": [
        _t("string"), _array(_obj({"type": _t("string", enum=["text"]),
                                   "text": _t("string")}))]}}, required=("role", "content")),
        "The conversation, rendered with the model's chat template (text content only)"),
    "max_tokens": _nullable(_t("integer", "Completions: default 16, null: up to the context "
                               "length; with echo, 0 returns the prompt alone", minimum=0)),
    "max_completion_tokens": _t("integer", "Chat: the answer's length limit", minimum=1),
    "temperature": _t("number", "0: greedy", minimum=0),
    "top_p": _t("number", exclusiveMinimum=0, maximum=1),
    "top_k": _t("integer", "0 or -1: off"),
    "min_p": _t("number", "vLLM's: after temperature, tokens below min_p x the most likely "
                "one's probability are dropped", minimum=0, maximum=1),
    "n": _t("integer", minimum=1),
    "best_of": _t("integer", "Only equal to n (no best-of selection)"),
    "seed": _t("integer"),
    "stop": _STRINGS,
    "stop_token_ids": _INT_IDS,
    "ignore_eos": _t("boolean"),
    "min_tokens": _t("integer", minimum=0),
    "presence_penalty": _t("number", minimum=-2, maximum=2),
    "frequency_penalty": _t("number", minimum=-2, maximum=2),
    "repetition_penalty": _t("number", exclusiveMinimum=0),
    "stream": _t("boolean", "Server-sent events, `data: [DONE]` last"),
    "stream_options": _obj({"include_usage": _t("boolean")}),
    "logprobs": {"description": "Completions: the number of top tokens per position (at most "
                 f"{MAX_LOGPROBS}); chat: a boolean (with top_logprobs)",
                 "oneOf": [_t("integer", minimum=0, maximum=MAX_LOGPROBS), _t("boolean")]},
    "top_logprobs": _t("integer", "Chat: top tokens per position", minimum=0,
                       maximum=MAX_LOGPROBS),
    "prompt_logprobs": _t("integer", "vLLM's: every prompt token's logprob and this many top "
                          "tokens' (choices[].prompt_logprobs; chat: the response's); not "
                          "with stream", minimum=0, maximum=MAX_LOGPROBS),
    "echo": _t("boolean", "Completions: each choice starts with its prompt (its tokens first "
               "in logprobs); chat: with the last message when it is the answer's role"),
    "skip_special_tokens": _t("boolean", "Default true: special tokens left out of the text"),
    "spaces_between_special_tokens": _t("boolean", "Accepted, no effect"),
    "return_tokens_as_token_ids": _t("boolean", "vLLM's: logprob tokens as `token_id:<id>`"),
    "return_token_ids": _t("boolean", "vLLM's: each choice's token_ids and prompt_token_ids"),
    "add_generation_prompt": _t("boolean", "Chat: default true"),
    "chat_template_kwargs": _t("object", "Chat: extra variables for the template"),
    "cache_salt": _t("string", "PageKV and vLLM: mixed into the first block's hash, so "
                     "requests with different salts never share a cached prefix", maxLength=256),
    "request_id": _t("string", "The request's id (also from the X-Request-Id header); echoed "
                     "in `id` and the X-Request-Id response header", maxLength=256),
    "user": _t("string", "PageKV: the session id when session_id is not given"),
    "cache_control": _obj({"type": _t("string", enum=["ephemeral"]),
                           "ttl": {"oneOf": [_t("integer", minimum=1, maximum=86400),
                                             _t("string", "e.g. \"30s\", \"5m\", \"1h\"")]},
                           "tokens": _t("integer", "The prompt's first tokens; 0 or absent: "
                                        "all of it", minimum=0)},
                          "PageKV extension: keep the prompt (its first `tokens`) cached for "
                          "`ttl` (default 5m), renewed by every hit. On chat, a message (or "
                          "a content part) may carry it instead: the prompt through that "
                          "message is kept"),
    "one_shot": _t("boolean", "PageKV extension: this prompt will not come back; its blocks "
                   "are evicted first and never written to DRAM or SSD"),
    "session_id": _t("string", "PageKV extension: a conversation's turns stay on one pod "
                     "while it is not saturated, and its blocks are kept between turns "
                     "(--session-idle-s)", maxLength=256),
    "metadata": _t("object", "Accepted, not used"),
    "store": _t("boolean", "Accepted, not used"),
    "service_tier": _t("string", "Accepted, not used"),
    "parallel_tool_calls": _t("boolean", "Accepted, not used"),
    "length_penalty": _t("number", "Accepted, not used"),
}

_LOGPROB = _obj({"logprob": _t("number"), "rank": _nullable(_t("integer")),
                 "decoded_token": _t("string")})
_PROMPT_LOGPROBS = _array({"oneOf": [_t("null"), _t("object", additionalProperties=_LOGPROB)]},
                          "null for the first prompt token, then per token its entry and the "
                          "top ones', keyed by token id (vLLM's shape)")
_TOKEN = _obj({"token": _t("string"), "logprob": _t("number"), "bytes": _INT_IDS})
_USAGE = _obj({"prompt_tokens": _t("integer"), "completion_tokens": _t("integer"),
               "total_tokens": _t("integer"),
               "prompt_tokens_details": _obj({"cached_tokens": _t("integer")})})
_TIERS = _obj({t: _t("integer") for t in ("gpu", "cpu", "disk", "peer")},
              "Cached prompt tokens by where their KV came from: the pool, the DRAM and SSD "
              "tiers, a peer pod")
_CANDIDATE = _obj({
    "pod_id": _t("string"), "address": _t("string"), "cached_tokens": _t("integer"),
    "cached_tokens_by_tier": _obj({t: _t("integer") for t in ("gpu", "cpu", "disk")}),
    "queue_waiting": _t("integer"), "queue_running": _t("integer"),
    "estimated_cost_s": _t("number"), "eligible": _t("boolean"),
    "excluded_reason": _nullable(_t("string")), "pull_from": _nullable(_t("string")),
    "pull_tokens": _t("integer"), "pull_saving_s": _t("number")})
_ROUTING = _nullable(_obj({
    "chosen_pod": _t("string"), "chosen_address": _t("string"), "reason": _t("string"),
    "predicted_cached_tokens": _t("integer"), "prompt_blocks": _t("integer"),
    "lookup_ms": _t("number"),
    "pull_from": _nullable(_t("string", "The peer the chosen pod pulled its prefix from (the "
                              "kv_source the router set)")),
    "pull_tokens": _t("integer"), "predicted_pull_saving_s": _t("number"),
    "candidates": _array(_CANDIDATE)}, "The router's decision (null from a pod)"))
_EXTENSION = _obj({
    "cached_tokens_by_tier": _TIERS,
    "served_by": _nullable(_t("string", "The pod that served the request")),
    "routing": _ROUTING,
    "prompts": _array(_t("object"), "Per prompt, when there are several: served_by, "
                      "cached_tokens_by_tier, routing")}, "PageKV's extension")

SCHEMAS: dict[str, Schema] = {
    "Error": _obj({"error": _obj({"message": _t("string"), "type": _t("string"),
                                  "param": _nullable(_t("string")),
                                  "code": _nullable(_t("string"))})}, required=("error",)),
    "CompletionRequest": _obj({name: FIELDS[name] for name in sorted(COMPLETION_FIELDS)},
                              required=("prompt",)),
    "ChatCompletionRequest": _obj({name: FIELDS[name] for name in sorted(CHAT_FIELDS)},
                                  required=("messages",)),
    "CompletionLogprobs": _nullable(_obj({
        "tokens": _array(_t("string")), "token_logprobs": _array(_nullable(_t("number"))),
        "top_logprobs": _array(_nullable(_t("object", additionalProperties=_t("number")))),
        "text_offset": _array(_t("integer"))}, "With echo, the prompt's tokens come first "
        "(the first with null logprobs)")),
    "Completion": _obj({
        "id": _t("string"), "object": _t("string", enum=["text_completion"]),
        "created": _t("integer"), "model": _t("string"),
        "choices": _array(_obj({
            "index": _t("integer"), "text": _t("string"),
            "logprobs": _ref("CompletionLogprobs"),
            "finish_reason": _nullable(_t("string", enum=["stop", "length", "abort"])),
            "stop_reason": {"description": "The stop string or token id that ended it",
                            "type": ["string", "integer", "null"]},
            "token_ids": _INT_IDS, "prompt_token_ids": _INT_IDS,
            "prompt_logprobs": _PROMPT_LOGPROBS})),
        "usage": _USAGE, "pagekv": _EXTENSION}),
    "ChatCompletion": _obj({
        "id": _t("string"), "object": _t("string", enum=["chat.completion"]),
        "created": _t("integer"), "model": _t("string"),
        "choices": _array(_obj({
            "index": _t("integer"),
            "message": _obj({"role": _t("string"), "content": _t("string")}),
            "logprobs": _nullable(_obj({"content": _array(
                {**_TOKEN, "properties": {**_TOKEN["properties"],
                                          "top_logprobs": _array(_TOKEN)}})})),
            "finish_reason": _nullable(_t("string")), "stop_reason": {
                "type": ["string", "integer", "null"]}, "token_ids": _INT_IDS})),
        "usage": _USAGE, "pagekv": _EXTENSION, "prompt_logprobs": _PROMPT_LOGPROBS}),
    "TokenizeRequest": _obj({
        "model": FIELDS["model"], "prompt": _t("string"), "messages": FIELDS["messages"],
        "add_special_tokens": _t("boolean", "Default true for prompt (BOS as the server adds "
                                 "it), false for messages"),
        "add_generation_prompt": _t("boolean"), "chat_template_kwargs": _t("object"),
        "return_token_strs": _t("boolean")}, "vLLM's: `prompt` or `messages`"),
    "TokenizeResponse": _obj({
        "count": _t("integer"), "max_model_len": _nullable(_t("integer", "null on a router")),
        "tokens": _INT_IDS, "token_strs": _nullable(_array(_t("string")))}),
    "DetokenizeRequest": _obj({"model": FIELDS["model"], "tokens": _INT_IDS},
                              required=("tokens",)),
    "DetokenizeResponse": _obj({"prompt": _t("string")}),
    "LoadLoraAdapterRequest": _obj({
        "lora_name": _t("string", "The adapter's name: what `model` names it by"),
        "lora_path": _t("string", "A PEFT adapter directory on the pod (adapter_config.json, "
                                  "adapter_model.safetensors)")},
        required=("lora_name", "lora_path")),
    "UnloadLoraAdapterRequest": _obj({"lora_name": _t("string")}, required=("lora_name",)),
    "LoraAdapterResponse": _obj({"status": _t("string"), "lora_name": _t("string"),
                                 "message": _t("string")}),
}

_HEADERS = {
    "X-Request-Id": "The request's id",
    "X-PageKV-Served-By": "The pod that served it",
    "X-PageKV-Routing-Reason": "Through a router: why that pod",
    "X-PageKV-Predicted-Cached-Tokens": "Through a router: the prefix hit it predicted",
    "X-PageKV-Ignored-Fields": "Request fields PageKV does not know (ignored)",
}


def _json_body(schema: str) -> Schema:
    return {"required": True, "content": {"application/json": {"schema": _ref(schema)}}}


def _reply(schema: Schema | str, description: str, *, stream: bool = False,
           headers: bool = False) -> Schema:
    body = _ref(schema) if isinstance(schema, str) else schema
    content: Schema = {"application/json": {"schema": body}}
    if stream:
        content["text/event-stream"] = {"schema": _t("string", "`data: <chunk JSON>` events, "
                                                     "then `data: [DONE]`")}
    out: Schema = {"description": description, "content": content}
    if headers:
        out["headers"] = {h: {"description": d, "schema": _t("string")}
                          for h, d in _HEADERS.items()}
    return out


def _errors(*statuses: int) -> dict[str, Schema]:
    words = {400: "A field refused (`param` names it)", 401: "Missing or wrong API key",
             404: "Unknown model", 408: "The body stalled (--http-body-timeout-s)",
             409: "request_id in flight", 413: "Body too large", 429: "Queue full",
             503: "Starting, stopping, or no pod",
             504: "Past the deadline (--http-request-timeout-s, x-pagekv-timeout-s)"}
    return {str(s): _reply("Error", words[s]) for s in statuses}


_SECURED: list[dict[str, list[str]]] = [{"bearer": []}, {}]  # only when the server has an API token
_GENERATION_ERRORS = _errors(400, 401, 404, 408, 409, 413, 429, 503, 504)

OPERATIONS: dict[tuple[str, str], Schema] = {
    ("post", "/v1/completions"): {
        "summary": "Text completions (OpenAI's legacy API, vLLM's extensions)",
        "security": _SECURED, "requestBody": _json_body("CompletionRequest"),
        "responses": {"200": _reply("Completion", "The completion (or its event stream)",
                                    stream=True, headers=True), **_GENERATION_ERRORS}},
    ("post", "/v1/chat/completions"): {
        "summary": "Chat completions", "security": _SECURED,
        "requestBody": _json_body("ChatCompletionRequest"),
        "responses": {"200": _reply("ChatCompletion", "The answer (or its event stream)",
                                    stream=True, headers=True), **_GENERATION_ERRORS}},
    ("get", "/v1/models"): {
        "summary": "The served model names, then the LoRA adapters (parent: the base model)",
        "security": _SECURED,
        "responses": {"200": _reply(_obj({"object": _t("string"), "data": _array(_obj({
            "id": _t("string"), "object": _t("string"), "created": _t("integer"),
            "owned_by": _t("string"), "root": _t("string", "an adapter's: its path"),
            "parent": _nullable(_t("string", "an adapter's base model")),
            "max_model_len": _t("integer")}))}), "The models"), **_errors(401)}},
    ("post", "/v1/load_lora_adapter"): {
        "summary": "vLLM's: load a LoRA adapter at run time (a pod; the admin token)",
        "security": _SECURED, "requestBody": _json_body("LoadLoraAdapterRequest"),
        "responses": {"200": _reply("LoraAdapterResponse", "Loaded"),
                      **_errors(400, 401, 404)}},
    ("post", "/v1/unload_lora_adapter"): {
        "summary": "vLLM's: unload a LoRA adapter (a pod; the admin token)",
        "security": _SECURED, "requestBody": _json_body("UnloadLoraAdapterRequest"),
        "responses": {"200": _reply("LoraAdapterResponse", "Unloaded"),
                      **_errors(400, 401, 404)}},
    ("post", "/tokenize"): {
        "summary": "vLLM's: a prompt or a conversation as the server's token ids",
        "security": _SECURED, "requestBody": _json_body("TokenizeRequest"),
        "responses": {"200": _reply("TokenizeResponse", "The ids"),
                      **_errors(400, 401, 404, 408, 413, 503)}},
    ("post", "/detokenize"): {
        "summary": "vLLM's: token ids as text (special tokens included)",
        "security": _SECURED, "requestBody": _json_body("DetokenizeRequest"),
        "responses": {"200": _reply("DetokenizeResponse", "The text"),
                      **_errors(400, 401, 404, 408, 413, 503)}},
    ("get", "/tokenizer_info"): {
        "summary": "vLLM's: the tokenizer's configuration (lm-evaluation-harness reads it)",
        "security": _SECURED,
        "responses": {"200": _reply(_obj({
            "tokenizer_class": _t("string"), "bos_token": _nullable(_t("string")),
            "eos_token": _nullable(_t("string")), "pad_token": _nullable(_t("string")),
            "model_max_length": _nullable(_t("integer")), "vocab_size": _t("integer"),
            "chat_template": _t("string")}), "The configuration"), **_errors(401, 503)}},
    ("get", "/health"): {
        "summary": "200 serving, 503 starting or stopping",
        "responses": {"200": _reply(_obj({"status": _t("string")}), "Serving"),
                      "503": _reply(_obj({"status": _t("string")}), "Not serving")}},
    ("get", "/version"): {
        "summary": "PageKV's version and what serves it (pod or router)",
        "responses": {"200": _reply(_obj({"version": _t("string"), "server": _t("string"),
                                          "kind": _t("string")}), "The version")}},
    ("get", "/metrics"): {
        "summary": "Prometheus metrics: the page the metrics port serves",
        "security": _SECURED,
        "responses": {"200": {"description": "The exposition (text, or OpenMetrics when "
                              "asked)", "content": {"text/plain": {"schema": _t("string")}}},
                      **_errors(401),
                      "404": _reply("Error", "This server keeps no metrics")}},
    ("get", "/openapi.json"): {
        "summary": "This document",
        "responses": {"200": _reply(_t("object"), "OpenAPI 3.1")}},
}


def openapi_document(routes: Sequence[Route], kind: str, version: str) -> dict[str, Any]:
    """The document for `routes`; RuntimeError naming a route that has no description."""
    paths: dict[str, dict[str, Schema]] = {}
    for route in routes:
        for method in sorted((route.methods or set()) - {"HEAD"}):
            operation = OPERATIONS.get((method.lower(), route.path))
            if operation is None:
                raise RuntimeError(f"{method} {route.path} has no OpenAPI description "
                                   f"(proto/openai/openapi.py)")
            paths.setdefault(route.path, {})[method.lower()] = operation
    refused = ", ".join(sorted(REFUSED))
    return {
        "openapi": "3.1.0",
        "info": {"title": f"PageKV ({kind})", "version": version,
                 "description": "OpenAI's API over PageKV, with vLLM's extensions. Refused "
                                f"by name (400) unless harmless: {refused}."},
        "paths": paths,
        "components": {"schemas": SCHEMAS, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "The server's --api-token, when it has one"}}},
    }
