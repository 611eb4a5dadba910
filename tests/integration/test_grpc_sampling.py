"""Stop strings, min_tokens, penalties and logprobs over gRPC, against a pod and through the
router (which forwards the request as sent): Generate and GenerateStream give what the offline
`LLM` gives for the same parameters, the new Completion / GenerateChunk fields included, and
bad values are INVALID_ARGUMENT naming the field, word for word alike from pod and router.

The cluster is the contract tests' one (tests/integration/conftest.py: Redis, two pods,
the router, as processes)."""

from __future__ import annotations

import grpc
import pytest

from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.requests import MAX_LOGPROBS, MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS
from tests.integration.contract_fixtures import (
    MAX_MODEL_LEN,
    MAX_N,
    Target,
    check_stream_shape,
    sampling,
    text_req,
)

pytestmark = pytest.mark.integration

PROMPT = "Sampling over the wire."
NAMES = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


@pytest.fixture(scope="module")
def offline() -> LLM:
    """The pods' model and limits, in this process: the reference."""
    return LLM("pagekv-tiny", num_gpu_blocks=320, max_model_len=MAX_MODEL_LEN, max_n=MAX_N)


@pytest.fixture(scope="module")
def free_text(offline: LLM) -> tuple[list[int], str]:
    out = offline.generate([PROMPT], SamplingParams(max_tokens=32, temperature=0,
                                                    ignore_eos=True))[0].outputs[0]
    return out.token_ids, out.text


def stop_reason(msg: pb.Completion | pb.GenerateChunk) -> str | int | None:
    which = msg.WhichOneof("stop_reason")
    return getattr(msg, which) if which else None


def check_logprobs(got, want) -> None:
    """The wire's (float32) logprobs against the engine's."""
    if want is None:
        assert len(got) == 0
        return
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.sampled.token_id == w.token_id
        assert g.sampled.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [t.token_id for t in g.top] == [t for t, _ in w.top]
        assert [t.logprob for t in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)


def round_trip(target: Target, offline: LLM, sp: pb.SamplingParams, params: SamplingParams):
    """Generate and GenerateStream agree with the offline run, field by field."""
    want = offline.generate([PROMPT], params)[0].outputs[0]
    resp = target.gen.Generate(text_req(PROMPT, sp), timeout=60)
    c = resp.completions[0]
    assert list(c.token_ids) == want.token_ids
    assert c.text == want.text
    assert c.finish_reason == NAMES[want.finish_reason]
    assert stop_reason(c) == want.stop_reason
    check_logprobs(c.logprobs, want.logprobs)
    assert resp.usage.completion_tokens == len(want.token_ids)

    chunks = list(target.gen.GenerateStream(text_req(PROMPT, sp, request_id="s"), timeout=60))
    check_stream_shape(chunks, "s", target)
    for ch in chunks:
        assert len(ch.logprobs) == (len(ch.token_ids) if params.logprobs is not None else 0)
        assert (stop_reason(ch) is None) or ch.finish_reason == pb.FINISH_REASON_STOP
    assert [t for ch in chunks for t in ch.token_ids] == want.token_ids
    assert "".join(ch.text for ch in chunks) == want.text
    check_logprobs([lp for ch in chunks for lp in ch.logprobs], want.logprobs)
    finishing = [ch for ch in chunks if ch.finish_reason]
    assert stop_reason(finishing[-1]) == want.stop_reason
    return want


def test_stop_string_and_logprobs_round_trip(target: Target, offline: LLM, free_text) -> None:
    tokens, text = free_text
    stop = text[6:9]  # three bytes: three tokens
    sp = sampling(32, ignore_eos=True, stop=["never-there", stop], logprobs=3)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                            stop=["never-there", stop], logprobs=3)
    want = round_trip(target, offline, sp, params)
    assert want.finish_reason == "stop" and want.stop_reason == stop
    assert want.text == text[: text.find(stop)] and len(want.token_ids) < len(tokens)


def test_penalties_and_min_tokens_round_trip(target: Target, offline: LLM, free_text) -> None:
    tokens, _ = free_text
    stop_id = tokens[1]
    kw = dict(stop_token_ids=[stop_id], min_tokens=4, presence_penalty=0.5,
              frequency_penalty=0.25, repetition_penalty=1.25)  # exact in float32
    want = round_trip(target, offline, sampling(32, ignore_eos=True, logprobs=0, **kw),
                      SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0,
                                     **kw))
    assert stop_id not in want.token_ids[:4]
    plain = offline.generate([PROMPT], SamplingParams(max_tokens=32, temperature=0,
                                                      ignore_eos=True, min_tokens=4,
                                                      stop_token_ids=[stop_id]))[0].outputs[0]
    assert plain.token_ids != want.token_ids  # the penalties made a difference on the wire too
    if want.finish_reason == "stop":
        assert want.stop_reason == stop_id


def test_length_finish_has_no_stop_reason(target: Target) -> None:
    resp = target.gen.Generate(text_req(PROMPT, sampling(4, ignore_eos=True, stop=["\x00" * 9])),
                               timeout=30)
    c = resp.completions[0]
    assert c.finish_reason == pb.FINISH_REASON_LENGTH and stop_reason(c) is None
    assert len(c.logprobs) == 0 and len(c.token_ids) == 4


BAD = {
    "presence_penalty": (dict(presence_penalty=2.5), "SamplingParams.presence_penalty"),
    "frequency_penalty": (dict(frequency_penalty=-3.0), "SamplingParams.frequency_penalty"),
    "repetition_penalty": (dict(repetition_penalty=0.0), "SamplingParams.repetition_penalty"),
    "min_tokens": (dict(min_tokens=9), "SamplingParams.min_tokens"),  # > max_tokens 8
    "logprobs": (dict(logprobs=MAX_LOGPROBS + 1), "sampling.logprobs is 21"),
    "too many stop": (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "sampling.stop has 65"),
    "stop too long": (dict(stop=["y" * (MAX_STOP_STRING_BYTES + 1)]),
                      "sampling.stop[0] has 1025 bytes"),
    "empty stop": (dict(stop=["ok", ""]), "sampling.stop[1] is empty"),
    "min_p": (dict(min_p=1.5), "sampling.min_p must be in [0, 1], got 1.5"),
    "min_p nan": (dict(min_p=float("nan")), "sampling.min_p must be in [0, 1], got nan"),
    "prompt_logprobs": (dict(prompt_logprobs=MAX_LOGPROBS + 1),
                        "sampling.prompt_logprobs is 21"),
}


def unary_and_stream(stub: pb_grpc.GenerationStub) -> tuple:
    return stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_are_invalid_argument_alike(case: str,
                                               channels: dict[str, grpc.Channel]) -> None:
    kw, needle = BAD[case]
    req = text_req("hi", sampling(8, **kw))
    seen = []
    for name in ("pod", "router"):
        for call in unary_and_stream(pb_grpc.GenerationStub(channels[name])):
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert needle in err.value.details()
            seen.append(err.value.details())
    assert len(set(seen)) == 1, seen


# -- prompt_logprobs, min_p, skip_special_tokens (#26) -----------------------------------------

def test_prompt_logprobs_come_once_and_equal_the_engines(target: Target, offline: LLM) -> None:
    """Completion 0 of a response carries them, the stream's first chunk (of any
    completion) does, and no other chunk: entry j is prompt token j + 1."""
    sp = sampling(4, ignore_eos=True, n=2, logprobs=1, prompt_logprobs=3)
    want = offline.generate([PROMPT], SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, n=2, logprobs=1,
        prompt_logprobs=3))[0]
    assert want.prompt_logprobs is not None and want.prompt_logprobs[0] is None
    entries = want.prompt_logprobs[1:]
    resp = target.gen.Generate(text_req(PROMPT, sp), timeout=60)
    check_logprobs(resp.completions[0].prompt_logprobs, entries)
    assert [len(c.prompt_logprobs) for c in resp.completions[1:]] == [0]
    assert len(entries) == resp.usage.prompt_tokens - 1
    chunks = list(target.gen.GenerateStream(text_req(PROMPT, sp, request_id="plp"),
                                            timeout=60))
    check_stream_shape(chunks, "plp", target)
    check_logprobs(chunks[0].prompt_logprobs, entries)
    assert all(len(ch.prompt_logprobs) == 0 for ch in chunks[1:])
    # Not asked: none; the generated tokens' own logprobs as without them.
    plain = target.gen.Generate(text_req(PROMPT, sampling(4, ignore_eos=True, logprobs=1)),
                                timeout=60)
    assert len(plain.completions[0].prompt_logprobs) == 0
    check_logprobs(plain.completions[0].logprobs, want.outputs[0].logprobs)


def test_min_p_and_skip_special_tokens_round_trip(target: Target, offline: LLM) -> None:
    kw = dict(seed=11, ignore_eos=True, min_p=0.25)  # exact in float32
    want = round_trip(target, offline, sampling(48, temperature=1.5, **kw),
                      SamplingParams(max_tokens=48, temperature=1.5, **kw))
    loose = offline.generate([PROMPT], SamplingParams(max_tokens=48, temperature=1.5, seed=11,
                                                      ignore_eos=True))[0].outputs[0]
    assert loose.token_ids != want.token_ids  # min_p made a difference
    # A seed whose draw holds special tokens: their text is kept when asked.
    kw = dict(seed=30, ignore_eos=True, skip_special_tokens=False)
    want = round_trip(target, offline, sampling(24, temperature=2.0, **kw),
                      SamplingParams(max_tokens=24, temperature=2.0, **kw))
    assert {256, 257} & set(want.token_ids) and ("<s>" in want.text or "</s>" in want.text)
