"""OpenAI's error shape and the HTTP status each failure gets.

Every error leaves as ``{"error": {"message", "type", "param", "code"}}`` — what OpenAI's own
clients parse into their exception classes (`openai.BadRequestError` for 400, `NotFoundError`
for 404, `RateLimitError` for 429, `InternalServerError` for 5xx, ...). A backend failure
arrives as a gRPC status name (the pods' and the router's one contract) and is mapped here.
"""

from __future__ import annotations

from typing import Any

# gRPC status -> (HTTP status, OpenAI error type, our code)
_BY_GRPC_CODE: dict[str, tuple[int, str, str | None]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", None),
    "ALREADY_EXISTS": (409, "invalid_request_error", "request_id_in_use"),
    "NOT_FOUND": (404, "invalid_request_error", None),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "queue_full"),
    "UNAVAILABLE": (503, "service_unavailable_error", "unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout_error", "deadline_exceeded"),
    "CANCELLED": (499, "cancelled_error", "cancelled"),
    "UNAUTHENTICATED": (401, "authentication_error", "invalid_api_key"),
    "PERMISSION_DENIED": (403, "permission_error", None),
    # A LoRA adapter that is known but failed to load (the pod keeps serving the rest).
    "FAILED_PRECONDITION": (503, "service_unavailable_error", "adapter_unavailable"),
}


class ApiError(Exception):
    """A request that fails with `status`; `param` names the offending field."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    return "invalid_request_error" if status < 500 else "server_error"


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def from_grpc(code_name: str, details: str) -> ApiError:
    """A backend's gRPC status as the HTTP error a client of OpenAI's API expects. Anything
    unexpected is a 500 with the backend's message (which never carries a stack trace)."""
    status, kind, code = _BY_GRPC_CODE.get(code_name, (500, "server_error", "internal_error"))
    param = _param_named_in(details) if status == 400 else None
    return ApiError(status, details or code_name, type=kind, param=param, code=code)


# The request fields a pod's INVALID_ARGUMENT message can start with.
_FIELDS = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stop_token_ids",
    "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
    "cache_salt", "request_id", "prompt", "ignore_eos", "min_p", "prompt_logprobs",
    "skip_special_tokens"})


def _param_named_in(details: str) -> str | None:
    """The field a pod's INVALID_ARGUMENT message starts with ("max_tokens=..." or
    "SamplingParams.top_p ..."), so `param` names it as OpenAI's errors do."""
    head = details.split(" ", 1)[0].split("=", 1)[0]
    head = head.removeprefix("SamplingParams.").removeprefix("sampling.")
    head = head.rstrip(":,")
    return head if head in _FIELDS else None
