"""GET /openapi.json on a pod and on the router: a valid OpenAPI 3.1 document (checked by
openapi-spec-validator) naming every route the app serves, by the app's own route table,
and nothing it does not serve; every request field the API accepts and PageKV's extension
fields are described."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from openapi_spec_validator import validate
from starlette.routing import Route

from pagekv.proto.openai.app import build_app
from pagekv.proto.openai.backend import Backend
from pagekv.proto.openai.openapi import openapi_document
from pagekv.proto.openai.params import CHAT_FIELDS, COMPLETION_FIELDS
from tests.integration.openai_fixtures import HttpTarget

pytestmark = pytest.mark.integration


def document(target: HttpTarget) -> dict:
    with urllib.request.urlopen(target.base_url.removesuffix("/v1") + "/openapi.json",
                                timeout=30) as resp:
        assert resp.headers["Content-Type"] == "application/json"
        return json.loads(resp.read())


def route_table(kind: str) -> set[tuple[str, str]]:
    """The routes a pod's (with its run-time adapter loading) or a router's app serves."""
    async def nothing(*_: object) -> None:
        return None

    class Adapters:
        async def load(self, name: str, path: str) -> None: ...

        async def unload(self, name: str) -> None: ...

    app = build_app(Backend(kind=kind, model_names=["m"], root="m", tokenizer=lambda: None,
                            generate_stream=nothing, ready=lambda: True,  # type: ignore[arg-type]
                            adapter_admin=Adapters() if kind == "pod" else None))
    return {(m.lower(), r.path) for r in app.routes if isinstance(r, Route)
            for m in (r.methods or ()) if m != "HEAD"}


def test_the_document_is_valid_and_names_every_served_route(http_target: HttpTarget) -> None:
    doc = document(http_target)
    validate(doc)  # OpenAPI 3.1, by the spec's own schema
    assert doc["openapi"] == "3.1.0" and http_target.name in doc["info"]["title"]
    described = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert described == route_table(http_target.name)
    assert {("post", "/tokenize"), ("post", "/detokenize"), ("get", "/metrics"),
            ("get", "/openapi.json"), ("post", "/v1/completions")} <= described
    # Each described route is served: no 404 or 405 from any of them.
    base = http_target.base_url.removesuffix("/v1")
    for method, path in sorted(described):
        req = urllib.request.Request(base + path, method=method.upper(),
                                     data=b"{}" if method == "post" else None,
                                     headers={"Content-Type": "application/json"})
        try:
            status = urllib.request.urlopen(req, timeout=30).status
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert status not in (404, 405), (method, path, status)


def test_request_fields_and_extensions_are_described(http_target: HttpTarget) -> None:
    schemas = document(http_target)["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert set(completion) == COMPLETION_FIELDS
    assert set(schemas["ChatCompletionRequest"]["properties"]) == CHAT_FIELDS
    for name in ("cache_salt", "request_id", "echo", "min_p", "prompt_logprobs",
                 "skip_special_tokens"):
        assert completion[name].get("description"), name
    reply = schemas["Completion"]["properties"]
    extension = reply["pagekv"]["properties"]
    assert set(extension["cached_tokens_by_tier"]["properties"]) == {"gpu", "cpu", "disk",
                                                                     "peer"}
    routing = extension["routing"]["properties"]
    assert {"chosen_pod", "reason", "predicted_cached_tokens", "pull_from",
            "candidates"} <= set(routing)
    assert "kv_source" in routing["pull_from"]["description"]
    assert "served_by" in extension
    assert "prompt_logprobs" in reply["choices"]["items"]["properties"]
    ops = document(http_target)["paths"]["/v1/completions"]["post"]
    assert "X-PageKV-Served-By" in ops["responses"]["200"]["headers"]


def test_a_route_without_a_description_cannot_be_served() -> None:
    async def nothing(*_: object) -> None:
        return None

    with pytest.raises(RuntimeError, match="GET /v1/undocumented has no OpenAPI description"):
        openapi_document([Route("/v1/undocumented", nothing, methods=["GET"])], "pod", "0")
