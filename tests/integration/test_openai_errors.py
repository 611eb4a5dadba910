"""The OpenAI API's failures, as the official client and plain HTTP see them: each error in
OpenAI's JSON shape with the status a client expects (400 naming the field — min_p's and
prompt_logprobs' bounds alike over gRPC —, 401, 404, 409, 413, 429, 503, 500 without a stack
trace), a fuzz pass of malformed bodies (each a 4xx with a reason, the server still
serving), and a client that hangs up aborting its request and freeing its blocks."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from pagekv.deploy.redis_server import free_port
from pagekv.kvnode.engine.config import EngineArgs
from pagekv.proto.openai.errors import from_grpc
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from tests.integration.contract_fixtures import running_somewhere, wait_idle
from tests.integration.openai_fixtures import (
    MODEL,
    HttpTarget,
    InProcessPod,
    error_of,
    in_process_pod,
    open_stream,
    raw_post,
    wait_until,
)

pytestmark = pytest.mark.integration

OK_BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 2}


def post(target: HttpTarget, body: object, path: str = "/completions") -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, out = raw_post(target, path, raw)
    return status, (error_of(out) if status >= 400 else json.loads(out))


@pytest.mark.parametrize(("change", "param"), [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 99}, "n"),
    ({"seed": "x"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a"] * 65}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 5}, "min_tokens"),  # > max_tokens=2
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [99999]}, None),  # outside the vocabulary: the pod's message names the id
    ({"prompt": None}, "prompt"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"echo": "yes"}, "echo"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": "high"}, "min_p"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),  # vLLM's rule
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"max_tokens": 0, "echo": False}, "max_tokens"),  # 0 only with echo
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"temperature": float("nan")}, "temperature"),
])
def test_invalid_requests_are_400_naming_the_field(http_target: HttpTarget, change: dict,
                                                   param: str | None) -> None:
    body = {**OK_BODY, **change}
    raw = json.dumps(body, allow_nan=True).encode()
    status, err = post(http_target, raw)
    assert status == 400, err
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    # The official client raises its own class for it (every field sent as it is).
    if "prompt" not in change and "nan" not in raw.decode().lower():
        with pytest.raises(openai.BadRequestError):
            http_target.client().completions.create(
                model=MODEL, prompt="hello", extra_body={k: v for k, v in body.items()
                                                         if k not in ("model", "prompt")})


def test_chat_errors(http_target: HttpTarget) -> None:
    status, err = post(http_target, {"model": MODEL, "messages": []}, "/chat/completions")
    assert status == 400 and err["param"] == "messages"
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    status, err = post(http_target, {"model": MODEL, "messages": [
        {"role": "user", "content": image}]}, "/chat/completions")
    assert status == 400 and "text parts" in err["message"]
    status, err = post(http_target, {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        "/chat/completions")
    assert status == 400 and err["param"] == "tools"
    # pagekv-tiny has no chat template: a 400 that says so.
    with pytest.raises(openai.BadRequestError, match="chat template"):
        http_target.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}])
    status, err = post(http_target, {"model": MODEL, "messages": [{"role": "user"}],
                                     "top_logprobs": 2}, "/chat/completions")
    assert status == 400 and err["param"] == "top_logprobs"


def test_the_wire_bounds_min_p_and_prompt_logprobs_alike(http_target: HttpTarget) -> None:
    """gRPC callers are refused by the same bounds (proto.requests.check_request), in words
    that name the field."""
    import grpc

    from tests.integration.contract_fixtures import sampling, text_req

    for kw, words, param in ((dict(min_p=1.5), "sampling.min_p must be in [0, 1], got 1.5",
                              "min_p"),
                             (dict(prompt_logprobs=21),
                              "sampling.prompt_logprobs is 21; the limit is 20",
                              "prompt_logprobs")):
        with pytest.raises(grpc.RpcError) as info:
            http_target.grpc.gen.Generate(text_req("x", sampling(2, **kw)), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == words
        assert from_grpc("INVALID_ARGUMENT", words).param == param


def test_unknown_model_is_404(http_target: HttpTarget) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        http_target.client().completions.create(model="gpt-4", prompt="x")
    assert info.value.code == "model_not_found"
    status, err = post(http_target, {**OK_BODY, "model": "gpt-4"})
    assert status == 404 and err["param"] == "model"
    status, _, raw = raw_post(http_target, "/nowhere", b"{}")
    assert status == 404 and error_of(raw)["code"] == "not_found"


def test_duplicate_request_id_in_flight_is_409(http_target: HttpTarget) -> None:
    long = {**OK_BODY, "max_tokens": 3000, "ignore_eos": True, "stream": True,
            "request_id": f"dup-{http_target.name}"}
    sock = open_stream(http_target, long)
    try:
        status, err = post(http_target, {**OK_BODY, "request_id": long["request_id"]})
        assert status == 409 and err["code"] == "request_id_in_use", err
    finally:
        sock.close()


def test_huge_body_is_413_and_the_server_keeps_serving(http_target: HttpTarget) -> None:
    big = json.dumps({**OK_BODY, "prompt": "x" * (20 << 20)}).encode()
    status, _, raw = raw_post(http_target, "/completions", big)
    assert status == 413 and error_of(raw)["code"] == "body_too_large"
    assert post(http_target, OK_BODY)[0] == 200


def test_fuzzed_bodies_get_4xx_with_a_reason(http_target: HttpTarget) -> None:
    rng = random.Random(16)
    good = json.dumps({**OK_BODY, "stop": ["\n"], "n": 1, "temperature": 0.5}).encode()
    values = [None, True, -1, 0, 2**70, 1e308, -1e-300, "", "x" * 300, "\udcff", [], {},
              [None], [[1, 2]], {"a": {"b": []}}, "NaN"]
    fields = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed",
              "stop", "stop_token_ids", "logprobs", "stream", "stream_options", "min_tokens",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "cache_salt",
              "request_id", "user", "ignore_eos", "best_of", "echo", "min_p",
              "prompt_logprobs", "skip_special_tokens"]
    bodies: list[bytes] = [b"", b"{", b"[]", b"null", b"\xff\xfe\x00", b'{"prompt": "a"',
                           b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "\\ud800"}',
                           good[: len(good) // 2], good.replace(b"{", b"[", 1)]
    for _ in range(60):
        body = dict(OK_BODY)
        for name in rng.sample(fields, rng.randint(1, 3)):
            body[name] = rng.choice(values)
        bodies.append(json.dumps(body).encode())
    for raw in bodies:
        status, _, out = raw_post(http_target, "/completions", raw)
        if status == 200:  # some mixes are valid (e.g. user="")
            continue
        assert 400 <= status < 500, (raw[:200], status, out[:300])
        error_of(out)
    assert post(http_target, OK_BODY)[0] == 200


def test_client_that_hangs_up_frees_its_blocks(http_target: HttpTarget, pods_kv: dict,
                                               idle_free_blocks: dict) -> None:
    long = {**OK_BODY, "max_tokens": 3000, "ignore_eos": True}
    # Streaming: hang up after the first event.
    sock = open_stream(http_target, {**long, "stream": True})
    assert running_somewhere(pods_kv)
    sock.close()
    wait_idle(pods_kv, idle_free_blocks)
    # Not streaming: hang up while the pod generates.
    host, port = http_target.host_port
    s = socket.create_connection((host, port), timeout=30)
    payload = json.dumps(long).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    wait_until(lambda: running_somewhere(pods_kv), "the request to run")
    s.close()
    wait_idle(pods_kv, idle_free_blocks)


# -- in-process pods: a token, a full queue, a failing engine, a pod still starting ---------

def test_api_token_is_401_without_the_bearer() -> None:
    with in_process_pod(api_token="s3cret") as pod:
        with pytest.raises(openai.AuthenticationError):
            pod.client("wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            pod.client("wrong").models.list()
        out = pod.client("s3cret").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert out.usage.completion_tokens == 1
        # vLLM's tokenizer routes are API calls too, and so is the metrics page on the API
        # port: it faces the clients (the metrics port is the operator's, bound privately).
        base = pod.base_url.removesuffix("/v1")
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(req, timeout=10)
            assert info.value.code == 401
            req.add_header("Authorization", "Bearer s3cret")
            assert urllib.request.urlopen(req, timeout=10).status == 200
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + "/tokenizer_info", timeout=10)
        assert info.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + "/metrics", timeout=10)
        assert info.value.code == 401 and b"pagekv_" not in info.value.read()
        page = urllib.request.urlopen(urllib.request.Request(
            base + "/metrics", headers={"Authorization": "Bearer s3cret"}), timeout=10)
        assert page.status == 200 and b"pagekv_" in page.read()


def test_full_queue_is_429() -> None:
    with in_process_pod(max_queue=1) as pod:
        target = HttpTarget("pod", pod.base_url, None)  # type: ignore[arg-type]
        sock = open_stream(target, {**OK_BODY, "max_tokens": 900, "ignore_eos": True,
                                    "stream": True})
        try:
            with pytest.raises(openai.RateLimitError) as info:
                pod.client().completions.create(model=MODEL, prompt="x", max_tokens=1)
            assert info.value.code == "queue_full"
        finally:
            sock.close()


def test_engine_failure_is_500_without_a_stack_trace() -> None:
    with in_process_pod() as pod:
        def broken_step():
            raise RuntimeError("kernel exploded at /secret/path.py line 3")

        pod.pod.engine.step = broken_step
        status, _, raw = raw_post(HttpTarget("pod", pod.base_url, None),  # type: ignore[arg-type]
                                  "/completions", json.dumps(OK_BODY).encode())
        assert status == 500
        err = error_of(raw)
        assert "secret" not in err["message"] and err["type"] == "server_error"


def test_starting_pod_is_503_and_health_says_so() -> None:
    from pagekv.kvnode.engine import engine as engine_mod

    started = threading.Event()
    real_init = engine_mod.Engine.__init__

    def slow_init(self, *a, **kw):  # the model "loads" until the test has looked
        started.wait(30)
        real_init(self, *a, **kw)

    engine_mod.Engine.__init__ = slow_init
    try:
        port = free_port()
        box: list[InProcessPod] = []
        boot = threading.Thread(target=lambda: box.append(InProcessPod(
            EngineArgs(model=MODEL, num_gpu_blocks=64, max_model_len=512), http_port=port)))
        boot.start()
        # The HTTP port answers before the model is loaded.
        wait_until(lambda: _accepts(port), "the HTTP port")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        assert info.value.code == 503
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert err.value.status_code == 503 and err.value.code == "starting"
    finally:
        started.set()
        engine_mod.Engine.__init__ = real_init
    boot.join(60)
    pod = box[0]
    try:
        with urllib.request.urlopen(f"{pod.base_url.removesuffix('/v1')}/health") as resp:
            assert resp.status == 200
    finally:
        pod.close()


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_router_without_pods_is_503(make_router, redis_server) -> None:
    router = make_router(redis_server.url)
    status, _, raw = raw_post(HttpTarget("router", router.http_url, None),  # type: ignore[arg-type]
                              "/completions", json.dumps(OK_BODY).encode())
    assert status == 503, raw
    assert "no live pods" in error_of(raw)["message"]


def test_grpc_and_http_refuse_alike(http_target: HttpTarget) -> None:
    """A value only the pod can judge: the same words over both transports."""
    import grpc

    from tests.integration.contract_fixtures import sampling, text_req

    with pytest.raises(grpc.RpcError) as info:
        http_target.grpc.gen.Generate(text_req("x", sampling(2, top_p=5.0)), timeout=30)
    status, err = post(http_target, {**OK_BODY, "top_p": 5.0})
    assert status == 400 and err["message"] == info.value.details()
    assert isinstance(http_target.grpc.gen, pb_grpc.GenerationStub)
    time.sleep(0)


def test_client_strings_cannot_inject_headers(http_target: HttpTarget) -> None:
    body = {**OK_BODY, "request_id": "日本\r\nset-cookie: x=1", "weird\r\nfield": 1}
    status, headers, raw = raw_post(http_target, "/completions", json.dumps(body).encode())
    assert status == 200, raw
    assert "set-cookie" not in headers
    assert headers["x-request-id"] == "%E6%97%A5%E6%9C%AC%0D%0Aset-cookie:%20x=1"
    assert json.loads(raw)["id"] == "cmpl-" + body["request_id"]  # the body keeps it as sent
    assert headers["x-pagekv-ignored-fields"] == "weird%0D%0Afield"
