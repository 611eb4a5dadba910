"""What the HTTP front end needs from whoever serves it: a pod or a router.

Both already serve `pagekv.v1.Generation.GenerateStream`. The front end calls that very
handler, in process, with a `CallContext` standing in for gRPC's servicer context, so an HTTP
request runs exactly the code a gRPC one does — the same checks, tokens, errors, routing and
failover — and the front end only translates OpenAI's JSON to the contract and back.
"""

from __future__ import annotations

import time
import types
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from prometheus_client import CollectorRegistry

from pagekv.proto.openai.limits import HttpLimits
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.requests import PromptLimits


class CallAborted(Exception):
    """A handler aborted the call: `code` is the gRPC status name (e.g. INVALID_ARGUMENT)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class HandlerContext(Protocol):
    """The part of grpc.aio.ServicerContext the pods' and the router's GenerateStream
    handlers use: a gRPC call's context has it, and so has a CallContext."""

    async def abort(self, code: Any, details: str = "",
                    trailing_metadata: Sequence[tuple[str, str | bytes]] = ()) -> NoReturn: ...

    def time_remaining(self) -> float | None: ...

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str]], /) -> None: ...

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]], /) -> None: ...


class CallContext:
    """A HandlerContext for a handler called in process (by the HTTP front end).

    `authorization` is the HTTP request's header: the handlers read it as a gRPC call's
    metadata, so a tenant's token names its tenant over HTTP as over gRPC."""

    def __init__(self, deadline: float | None = None, authorization: str | None = None
                 ) -> None:
        self.deadline = deadline  # time.monotonic() at which the call's time is up
        self.initial_metadata: list[tuple[str, str]] = []
        self.trailing_metadata: list[tuple[str, str]] = []
        self._metadata = (() if authorization is None else
                          (types.SimpleNamespace(key="authorization", value=authorization),))

    def invocation_metadata(self) -> tuple[types.SimpleNamespace, ...]:
        """As grpc's: items with `.key` and `.value`."""
        return self._metadata

    async def abort(self, code: Any, details: str = "",
                    trailing_metadata: Sequence[tuple[str, str | bytes]] = ()) -> NoReturn:
        raise CallAborted(getattr(code, "name", str(code)), details)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.initial_metadata.extend(metadata)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.trailing_metadata.extend(metadata)


class Tokenizer(Protocol):
    vocab_size: int
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


StreamHandler = Callable[[pb.GenerateRequest, HandlerContext],
                         AsyncGenerator[pb.GenerateChunk, None]]


class AdapterAdmin(Protocol):
    """Loads and unloads LoRA adapters at run time (a pod). `load` raises ValueError with a
    one-line reason (a bad adapter, a name taken); `unload` raises NoSuchAdapter."""

    async def load(self, name: str, path: str) -> None: ...

    async def unload(self, name: str) -> None: ...


@dataclass(slots=True)
class Backend:
    """A pod or a router, as the HTTP front end sees it."""

    kind: str                       # "pod" | "router": names it in logs and /version
    model_names: list[str]          # served names; the first is the id /v1/models reports
    root: str                       # the model the names stand for (a preset or a path)
    tokenizer: Callable[[], Tokenizer]  # renders chat, names logprob tokens (once ready)
    generate_stream: StreamHandler  # the gRPC GenerateStream handler itself
    ready: Callable[[], bool]       # serving (model loaded; a router: the index read)
    max_model_len: Callable[[], int | None] = lambda: None  # once ready
    api_token: str | None = None    # Authorization: Bearer <token> for /v1/*
    # Other tokens that may call /v1/* (a tenants file's); the handler then reads the tenant.
    accepts_token: Callable[[str], bool] | None = None
    max_body_bytes: int = 8 << 20
    limits: HttpLimits = field(default_factory=HttpLimits)  # headers, timeouts, deadline
    headers: dict[str, str] = field(default_factory=dict)  # sent on every response
    on_response: Callable[[str, int], None] | None = None   # (route, status): metrics
    # The bounds the server checks a prompt against: the front end applies the same ones
    # where it tokenizes a prompt itself (echo with logprobs, /tokenize).
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)
    metrics: CollectorRegistry | None = None  # what /metrics serves (the metrics port's)
    # LoRA adapters served, name -> path (a pod's own; a router's: what its pods publish):
    # `model` may name one (vLLM's convention), and /v1/models lists them.
    adapters: Callable[[], Mapping[str, str]] = dict
    # A pod's run-time adapter loading (POST /v1/load_lora_adapter, /v1/unload_lora_adapter,
    # under `admin_token`); None: those routes answer 404 here.
    adapter_admin: AdapterAdmin | None = None
    admin_token: str | None = None
