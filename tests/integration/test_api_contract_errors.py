"""The `pagekv.v1.Generation` contract as another client sees it, checked the same way against
a pod and against the router in front of two pods: a client must not be able to tell them
apart (the router only adds `routing`). Here: bad input refused alike, word
for word, and request ids (a duplicate in flight refused, ids otherwise opaque).

The client side is written from the .proto alone: plain generated stubs, grpc.health.v1 and a
hand-written server-reflection client. One cluster (Redis, two pods, the router, as
processes) serves every test_api_contract_*.py module (conftest.py); helpers are in
contract_fixtures.py.
"""

from __future__ import annotations

import grpc
import pytest

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.requests import (
    DEFAULT_MAX_PROMPT_BYTES,
    DEFAULT_MAX_PROMPT_TOKENS,
    MAX_CACHE_SALT_BYTES,
    MAX_REQUEST_ID_BYTES,
    MAX_STOP_TOKEN_IDS,
    PromptLimits,
)
from tests.integration.contract_fixtures import (
    BOS,
    MAX_MODEL_LEN,
    MAX_N,
    SERVICE,
    VOCAB,
    Target,
    as_dict,
    ids_req,
    joined,
    sampling,
    text_req,
    wait_idle,
)

pytestmark = pytest.mark.integration


# -- errors ------------------------------------------------------------------------------------

BAD = {
    "empty text": (pb.GenerateRequest(text=""), "empty"),
    "empty token_ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "empty"),
    "no prompt": (pb.GenerateRequest(), "prompt is required"),
    "token id == vocab": (ids_req([BOS, 65, VOCAB]), "vocabulary"),
    "prompt too long": (ids_req([65] * MAX_MODEL_LEN), "max_model_len"),
    "max_tokens too large": (text_req("hi", sampling(MAX_MODEL_LEN)), "max_tokens"),
    "max_tokens zero": (text_req("hi", sampling(0)), "max_tokens"),
    "temperature < 0": (text_req("hi", sampling(2, temperature=-0.5)), "temperature"),
    "top_p zero": (text_req("hi", sampling(2, top_p=0.0)), "top_p"),
    "top_p over 1": (text_req("hi", sampling(2, top_p=1.5)), "top_p"),
    "n too large": (text_req("hi", sampling(2, n=MAX_N + 1)), "max_n"),
    # No adapter is loaded: a lora_id would only change the cache key (#13, #14).
    "lora_id without adapters": (pb.GenerateRequest(text="hi", lora_id=3), "lora_id"),
    # Every field bounded (#14, README "Limits"): refused before any work, not echoed back.
    "request_id too long": (text_req("hi", request_id="r" * (MAX_REQUEST_ID_BYTES + 1)),
                            f"the limit is {MAX_REQUEST_ID_BYTES}"),
    "cache_salt too long": (text_req("hi", cache_salt="s" * (MAX_CACHE_SALT_BYTES + 1)),
                            "cache_salt has"),
    "too many stop_token_ids": (
        text_req("hi", sampling(2, stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1))),
        "sampling.stop_token_ids has"),
    "text past max prompt bytes": (text_req("a" * (DEFAULT_MAX_PROMPT_BYTES + 1)),
                                   "(--max-prompt-bytes)"),
    "token_ids past max prompt tokens": (ids_req([65] * (DEFAULT_MAX_PROMPT_TOKENS + 1)),
                                         "prompt token_ids has"),
    "text past max prompt tokens": (text_req("a" * DEFAULT_MAX_PROMPT_TOKENS),  # + BOS
                                    f"has {DEFAULT_MAX_PROMPT_TOKENS + 1} tokens"),
    # Bodies protobuf cannot decode, sent as raw bytes (#14: these were UNKNOWN).
    "invalid UTF-8 in text": (b"\x12\x02\xff\xfe", "String field had bad UTF-8"),
    "invalid UTF-8 in request_id": (b"\x0a\x01\x80\x12\x02hi", "bad UTF-8"),
    "invalid UTF-8 in cache_salt": (b"\x12\x02hi\x2a\x02\xc3\x28", "bad UTF-8"),
    "truncated message": (text_req("hello there").SerializeToString()[:-3], "cannot decode"),
}


def calls(channel: grpc.Channel, req: pb.GenerateRequest | bytes) -> tuple:
    """Generate and GenerateStream (drained), with stubs, or raw for a body given as bytes."""
    if isinstance(req, bytes):
        unary = channel.unary_unary(f"/{SERVICE}/Generate")
        stream = channel.unary_stream(f"/{SERVICE}/GenerateStream")
    else:
        stub = pb_grpc.GenerationStub(channel)
        unary, stream = stub.Generate, stub.GenerateStream
    return unary, lambda r, timeout: list(stream(r, timeout=timeout))


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_invalid_argument_alike(case: str,
                                             channels: dict[str, grpc.Channel]) -> None:
    req, needle = BAD[case]
    seen = []
    for name in ("pod", "router"):
        for call in calls(channels[name], req):
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert needle in err.value.details()
            seen.append(err.value.details())
    assert len(set(seen)) == 1, seen  # word for word the same from pod and router


def test_oversized_message_is_refused_by_grpc_alike(channels: dict[str, grpc.Channel]) -> None:
    """Past the message limit that the prompt limits imply, gRPC refuses the call itself,
    before reading it: RESOURCE_EXHAUSTED, in gRPC's words, the same from pod and router."""
    req = pb.GenerateRequest(text="a" * (PromptLimits().max_message_bytes + 1))
    seen = []
    for name in ("pod", "router"):
        for call in calls(channels[name], req):
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            seen.append(err.value.details())
    assert len(set(seen)) == 1 and "larger than max" in seen[0], seen


def test_duplicate_in_flight_request_id(target: Target, pods_kv, idle_free_blocks) -> None:
    long = text_req("long one", sampling(MAX_MODEL_LEN - 16, ignore_eos=True),
                    request_id="dup-id")
    stream = target.gen.GenerateStream(long, timeout=60)
    next(stream)  # in flight now
    for call in (target.gen.Generate, lambda r: list(target.gen.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as err:
            # another prompt: through the router it may well be routed to the other pod
            call(text_req("something else entirely", sampling(2), request_id="dup-id"))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'dup-id'" in err.value.details()
    stream.cancel()
    wait_idle(pods_kv, idle_free_blocks)
    again = target.gen.Generate(text_req("x", sampling(2), request_id="dup-id"), timeout=30)
    assert again.request_id == "dup-id"


def test_request_ids_are_opaque(target: Target, pods_kv, idle_free_blocks) -> None:
    """'r#1' is just an id, not request 'r''s second sample: both run with their own results
    (the engine names an n>1 request's extra samples '<id>#<i>')."""
    want_child = as_dict(target.gen.Generate(
        text_req("alone", sampling(12, ignore_eos=True)), timeout=30))
    parent_sp = sampling(200, temperature=1.0, seed=5, n=2, ignore_eos=True)
    want_parent = as_dict(target.gen.Generate(text_req("parent", parent_sp), timeout=30))
    parent = target.gen.GenerateStream(text_req("parent", parent_sp, request_id="r"),
                                       timeout=60)
    chunks = [next(parent)]  # forked: samples 'r' and 'r#1' are running
    for rid in ("r#1", "r%231", "r#2"):
        got = target.gen.Generate(text_req("alone", sampling(12, ignore_eos=True),
                                           request_id=rid), timeout=30)
        assert got.request_id == rid and as_dict(got) == want_child
    chunks += list(parent)
    assert joined(chunks) == want_parent
    wait_idle(pods_kv, idle_free_blocks)
