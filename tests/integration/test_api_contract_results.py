"""The `pagekv.v1.Generation` contract as another client sees it, checked the same way against
a pod and against the router in front of two pods: a client must not be able to tell them
apart (the router only adds `routing`). Here: results, unary and streaming
alike (request ids, n completions, seeds, max_tokens, stop tokens, EOS, text prompts).

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
from tests.integration.contract_fixtures import (
    BOS,
    EOS,
    Target,
    as_dict,
    byte_text,
    check_stream_shape,
    ids_req,
    joined,
    sampling,
    text_req,
)

pytestmark = pytest.mark.integration


# -- results: unary and streaming agree -----------------------------------------------------

def test_unary_and_stream_agree(target: Target) -> None:
    req = text_req("The contract holds.", sampling(12, ignore_eos=True), request_id="agree-1")
    resp = target.gen.Generate(req, timeout=30)
    assert resp.request_id == "agree-1" and len(resp.completions) == 1
    c = resp.completions[0]
    assert c.index == 0 and len(c.token_ids) == 12
    assert c.finish_reason == pb.FINISH_REASON_LENGTH
    assert c.text == byte_text(list(c.token_ids))
    prompt_len = 1 + len(b"The contract holds.")
    assert resp.usage.prompt_tokens == prompt_len and resp.usage.completion_tokens == 12
    assert resp.served_by
    assert resp.HasField("routing") == (target.name == "router")
    if target.name == "router":
        assert resp.routing.chosen_pod == resp.served_by and resp.routing.candidates

    req.request_id = "agree-2"
    chunks = list(target.gen.GenerateStream(req, timeout=30))
    check_stream_shape(chunks, "agree-2", target)
    assert joined(chunks) == as_dict(resp)
    assert chunks[-1].usage.prompt_tokens == prompt_len
    assert chunks[-1].usage.completion_tokens == 12


def test_pod_and_router_answer_alike(channels: dict[str, grpc.Channel]) -> None:
    req = text_req("same weights everywhere", sampling(10, ignore_eos=True))
    pod = pb_grpc.GenerationStub(channels["pod"]).Generate(req, timeout=30)
    routed = pb_grpc.GenerationStub(channels["router"]).Generate(req, timeout=30)
    assert as_dict(pod) == as_dict(routed)
    assert pod.usage.prompt_tokens == routed.usage.prompt_tokens
    assert not pod.HasField("routing") and routed.HasField("routing")


def test_request_id_generated_when_empty(target: Target) -> None:
    a = target.gen.Generate(text_req("id?", sampling(2, ignore_eos=True)), timeout=30)
    b = target.gen.Generate(text_req("id?", sampling(2, ignore_eos=True)), timeout=30)
    assert a.request_id and b.request_id and a.request_id != b.request_id
    chunks = list(target.gen.GenerateStream(text_req("id?", sampling(3, ignore_eos=True)),
                                            timeout=30))
    rid = chunks[0].request_id
    assert rid and rid not in (a.request_id, b.request_id)
    check_stream_shape(chunks, rid, target)


def test_n_completions_in_both_modes(target: Target) -> None:
    sp = sampling(6, temperature=1.0, seed=7, n=3, ignore_eos=True)
    resp = target.gen.Generate(text_req("three ways", sp), timeout=30)
    assert [c.index for c in resp.completions] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == pb.FINISH_REASON_LENGTH
               for c in resp.completions)
    assert resp.usage.completion_tokens == 18
    chunks = list(target.gen.GenerateStream(text_req("three ways", sp, request_id="n3"),
                                            timeout=30))
    check_stream_shape(chunks, "n3", target)
    assert joined(chunks) == as_dict(resp)
    assert chunks[-1].usage.completion_tokens == 18
    # n = 0 means 1
    one = target.gen.Generate(text_req("x", sampling(2, n=0, ignore_eos=True)), timeout=30)
    assert [c.index for c in one.completions] == [0]


def test_n_with_early_stop_reports_each_finish_once(target: Target) -> None:
    """A completion that stops while its siblings go on finishes once, on its last chunk."""
    sp = sampling(8, temperature=1.0, seed=11, n=3, ignore_eos=True)
    free = target.gen.Generate(text_req("siblings", sp), timeout=30)
    stop = free.completions[0].token_ids[1]
    sp.stop_token_ids.append(stop)
    resp = target.gen.Generate(text_req("siblings", sp), timeout=30)
    first = resp.completions[0]
    assert first.finish_reason == pb.FINISH_REASON_STOP and first.token_ids[-1] == stop
    assert len(first.token_ids) <= 2
    chunks = list(target.gen.GenerateStream(text_req("siblings", sp, request_id="early"),
                                            timeout=30))
    check_stream_shape(chunks, "early", target)
    assert joined(chunks) == as_dict(resp)
    # Sibling i draws from seed + i whatever the others do: same tokens up to its stop.
    for c, f in zip(resp.completions[1:], free.completions[1:], strict=True):
        assert list(c.token_ids) == list(f.token_ids)[:len(c.token_ids)]


def test_seeded_sampling_is_reproducible(target: Target) -> None:
    sp = sampling(16, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True)
    a = target.gen.Generate(text_req("roll the dice", sp), timeout=30)
    b = target.gen.Generate(text_req("roll the dice", sp), timeout=30)
    assert as_dict(a) == as_dict(b)
    chunks = list(target.gen.GenerateStream(text_req("roll the dice", sp), timeout=30))
    assert joined(chunks) == as_dict(a)
    # the largest uint64 seed with n > 1 (sample i uses seed + i) is a seed like any other
    big = sampling(4, temperature=1.0, seed=2**64 - 1, n=2, ignore_eos=True)
    x = target.gen.Generate(text_req("big seed", big), timeout=30)
    y = target.gen.Generate(text_req("big seed", big), timeout=30)
    assert len(x.completions) == 2 and as_dict(x) == as_dict(y)


def test_max_tokens_and_length(target: Target) -> None:
    for mode in ("unary", "stream"):
        req = ids_req([BOS, 10, 20, 30], sampling(5, ignore_eos=True))
        if mode == "unary":
            got = as_dict(target.gen.Generate(req, timeout=30))
        else:
            got = joined(list(target.gen.GenerateStream(req, timeout=30)))
        toks, _, reasons = got[0]
        assert len(toks) == 5 and reasons == [pb.FINISH_REASON_LENGTH]


def test_stop_token_ends_the_completion_and_is_not_in_the_text(target: Target) -> None:
    free = target.gen.Generate(text_req("Stop here", sampling(16, ignore_eos=True)),
                               timeout=30).completions[0]
    ids = list(free.token_ids)
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    stop = ids[k]
    sp = sampling(16, ignore_eos=True, stop_token_ids=[stop, 9999])
    resp = target.gen.Generate(text_req("Stop here", sp), timeout=30)
    c = resp.completions[0]
    assert c.finish_reason == pb.FINISH_REASON_STOP
    assert list(c.token_ids) == ids[:k + 1]            # the stop token ends token_ids ...
    assert c.text == byte_text(ids[:k])                 # ... but its text is left out
    assert resp.usage.completion_tokens == k + 1
    chunks = list(target.gen.GenerateStream(text_req("Stop here", sp), timeout=30))
    assert joined(chunks)[0] == (ids[:k + 1], byte_text(ids[:k]), [pb.FINISH_REASON_STOP])


def test_ignore_eos(target: Target) -> None:
    """Without ignore_eos a completion stops at EOS (kept in token_ids, no text); with it, the
    same seeded draw goes on to max_tokens."""
    for seed in range(40):
        sp = sampling(120, temperature=1.5, seed=seed, ignore_eos=True)
        full = list(target.gen.Generate(text_req("eos?", sp), timeout=30)
                    .completions[0].token_ids)
        if EOS in full[:-1]:
            break
    else:
        pytest.fail("no seed produced EOS")
    assert len(full) == 120
    at = full.index(EOS)
    sp.ignore_eos = False
    for got in (as_dict(target.gen.Generate(text_req("eos?", sp), timeout=30)),
                joined(list(target.gen.GenerateStream(text_req("eos?", sp), timeout=30)))):
        assert got[0] == (full[:at + 1], byte_text(full[:at]), [pb.FINISH_REASON_STOP])


def test_text_prompt_equals_its_token_ids(target: Target) -> None:
    text = "Paged KV, café ☕"
    ids = [BOS, *text.encode("utf-8")]
    for sp in (sampling(10, ignore_eos=True), sampling(10, temperature=1.0, seed=3, n=2)):
        a = target.gen.Generate(text_req(text, sp), timeout=30)
        b = target.gen.Generate(ids_req(ids, sp), timeout=30)
        assert as_dict(a) == as_dict(b)
        assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(ids)

