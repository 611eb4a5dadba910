"""A GenerateRequest's prompt, read and checked the same way by a pod and by the router.

A client must not be able to tell which one answered: the router refuses a prompt a pod
would refuse, before routing it, in the pod's words (tests/integration/test_api_contract_errors.py
compares the two word for word). What only a pod can know (vocabulary, max_model_len, the
sampling limits) the router leaves to the pod, whose status it passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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


NO_ADAPTERS = ("lora_id: LoRA adapters are not supported yet, so a request with lora_id would "
               "be served by the base model; omit the field")


def refuse_unsupported(request: GenerateRequest) -> None:
    """BadRequest for a field the servers accept on the wire but cannot honour (a lora_id
    would only change the cache key while the base model answered)."""
    if request.HasField("lora_id"):
        raise BadRequest(NO_ADAPTERS)


@dataclass(frozen=True, slots=True)
class Prompt:
    """What a request asks to be continued, and what changes its block hashes.

    The pods' rules (kvnode.memory.request): an empty cache salt is no salt, and a LoRA
    adapter is named by str(lora_id) (it enters every block's hash via proto.hashing.lora_key).
    """

    kind: str                  # the field the client set: "text" or "token_ids"
    token_ids: Sequence[int]   # the text's tokens, or the ids as sent
    cache_salt: str | None
    lora_id: str | None


def parse_prompt(request: GenerateRequest, encode: Callable[[str], Sequence[int]]) -> Prompt:
    """The request's prompt as token ids (`encode` tokenizes a text prompt); BadRequest
    when none is set or it is empty."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise BadRequest("prompt text is empty")
        token_ids: Sequence[int] = encode(request.text)
        if not token_ids:
            raise BadRequest(EMPTY_PROMPT)
    elif kind == "token_ids":
        token_ids = request.token_ids.ids
        if len(token_ids) == 0:
            raise BadRequest("prompt token_ids is empty")
    else:
        raise BadRequest("prompt is required: set exactly one of text or token_ids")
    lora = str(request.lora_id) if request.HasField("lora_id") else None
    return Prompt(kind, token_ids, request.cache_salt or None, lora)
