"""Malformed and extreme requests against a real pod and the router (#14): random bytes,
truncated messages, invalid UTF-8, fields past their limits, extreme, negative and
overflowing numbers (written on the wire by hand where the generated setters refuse them).

A few hundred bodies, the same for both targets, from a fixed seed. Every answer is a status a
client can act on (never UNKNOWN or INTERNAL), pod and router give the same code and, when
they refuse, the same words; afterwards no KV block is left allocated and both still serve.
Cluster and fixtures: conftest.py (contract_cluster), contract_fixtures.py.
"""

from __future__ import annotations

import math
import random
import struct
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

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
from tests.integration.contract_fixtures import SERVICE, VOCAB, wait_idle

pytestmark = pytest.mark.integration

SEED = 1414
CASES = 300
ANSWERS = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}  # anything else fails the test

# -- the wire, by hand ---------------------------------------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + varint(len(payload)) + payload


def as_varint(number: int, value: int) -> bytes:
    """`value` as a varint of up to 64 bits: a negative one is its two's complement (ten
    bytes), as a client in another language would send an int32 -1."""
    return tag(number, 0) + varint(value & (2**64 - 1))


def as_float(number: int, value: float) -> bytes:
    return tag(number, 5) + struct.pack("<f", value)


# Field numbers (pagekv.proto): GenerateRequest and SamplingParams.
REQUEST_ID, TEXT, TOKEN_IDS, SAMPLING, CACHE_SALT, LORA_ID = 1, 2, 3, 4, 5, 6
MAX_TOKENS, TEMPERATURE, TOP_P, TOP_K, SEED_FIELD, N, STOP_IDS, IGNORE_EOS = range(1, 9)

BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xe2\x28\xa1", b"\xf0\x28\x8c\xbc", b"\xed\xa0\x80",
            b"\xc0\xaf", b"ok\x80", b"\xf8\x88\x80\x80\x80"]
EXTREME_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-45, 3.4e38, -1.0, 0.5]
EXTREME_INTS = [0, 1, 2, -1, -2, 2**31 - 1, -(2**31), 2**32 - 1, 2**32, 2**63, 2**64 - 1]
TOKEN_EDGES = [0, 1, 255, VOCAB - 1, VOCAB, 2**31, 2**32 - 1]


def small_prompt(rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return length_delimited(TEXT, rng.choice([b"hi", b"hello there", " é ✓".encode()]))
    return length_delimited(TOKEN_IDS, length_delimited(1, b"".join(
        varint(rng.choice([65, 66, 256])) for _ in range(rng.randrange(1, 6)))))


def bounded_sampling(rng: random.Random) -> bytes:
    """A sampling message that keeps a served request short (max_tokens <= 3); merged into
    an earlier one, its fields win (protobuf's rule for a repeated embedded message)."""
    return length_delimited(SAMPLING, as_varint(MAX_TOKENS, rng.randrange(1, 4)))


def random_bytes(rng: random.Random) -> bytes:
    body = rng.randbytes(rng.randrange(0, 200))
    return body + bounded_sampling(rng) if rng.random() < 0.5 else body


def truncated(rng: random.Random) -> bytes:
    whole = pb.GenerateRequest(
        request_id=f"t{rng.randrange(10**9)}", text="a fairly long prompt " * 3,
        sampling=pb.SamplingParams(max_tokens=2, stop_token_ids=[1, 2, 3]),
        cache_salt="salt").SerializeToString()
    return whole[:rng.randrange(1, len(whole))]


def invalid_utf8(rng: random.Random) -> bytes:
    where = rng.choice([REQUEST_ID, TEXT, CACHE_SALT])
    body = length_delimited(where, b"x" * rng.randrange(3) + rng.choice(BAD_UTF8))
    if where != TEXT:
        body += small_prompt(rng)
    return body + bounded_sampling(rng)


def huge_field(rng: random.Random) -> bytes:
    what = rng.choice(["request_id", "cache_salt", "stop_token_ids", "lora_id", "text",
                       "token_ids", "text_tokens", "message"])
    req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
    if what == "request_id":
        req.request_id = "r" * rng.choice([MAX_REQUEST_ID_BYTES + 1, 4096, 1 << 20])
    elif what == "cache_salt":
        req.cache_salt = "s" * rng.choice([MAX_CACHE_SALT_BYTES + 1, 100_000])
    elif what == "stop_token_ids":
        req.sampling.stop_token_ids.extend([7] * rng.choice([MAX_STOP_TOKEN_IDS + 1, 50_000]))
    elif what == "lora_id":
        req.lora_id = rng.choice([0, 2**32 - 1])
    elif what == "text":
        req.text = "t" * (DEFAULT_MAX_PROMPT_BYTES + 1)
    elif what == "token_ids":
        req.token_ids.ids.extend([65] * (DEFAULT_MAX_PROMPT_TOKENS + 1))
    elif what == "text_tokens":  # within the bytes, past the tokens once tokenized
        req.text = "u" * DEFAULT_MAX_PROMPT_TOKENS
    else:  # past the message limit: gRPC's own RESOURCE_EXHAUSTED
        req.text = "m" * (PromptLimits().max_message_bytes + 1)
    return req.SerializeToString()


def extreme_numbers(rng: random.Random) -> bytes:
    sampling = b""
    for number, kind in ((TEMPERATURE, "f"), (TOP_P, "f"), (TOP_K, "i"), (SEED_FIELD, "i"),
                         (N, "i"), (IGNORE_EOS, "i")):
        if rng.random() < 0.5:
            sampling += (as_float(number, rng.choice(EXTREME_FLOATS)) if kind == "f"
                         else as_varint(number, rng.choice(EXTREME_INTS)))
    if rng.random() < 0.3:
        sampling += length_delimited(STOP_IDS, b"".join(
            varint(rng.choice(EXTREME_INTS) & (2**64 - 1)) for _ in range(rng.randrange(1, 5))))
    # max_tokens last, and small unless it is the extreme one: a served request stays short.
    sampling += as_varint(MAX_TOKENS, rng.choice(EXTREME_INTS) if rng.random() < 0.3
                          else rng.randrange(1, 4))
    if rng.random() < 0.5:
        prompt = length_delimited(TOKEN_IDS, length_delimited(1, b"".join(
            varint(rng.choice(TOKEN_EDGES + EXTREME_INTS) & (2**64 - 1))
            for _ in range(rng.randrange(1, 6)))))
    else:
        prompt = small_prompt(rng)
    return prompt + length_delimited(SAMPLING, sampling)


def odd_wire(rng: random.Random) -> bytes:
    """Unknown fields, wrong wire types, an overlong varint, nesting past the parser's depth."""
    kind = rng.randrange(4)
    if kind == 0:
        return small_prompt(rng) + length_delimited(99, rng.randbytes(8)) + bounded_sampling(rng)
    if kind == 1:  # text as a varint: an unknown field to the parser, so no prompt
        return as_varint(TEXT, 5) + bounded_sampling(rng)
    if kind == 2:
        return small_prompt(rng) + tag(SAMPLING, 0) + b"\xff" * 11
    depth = rng.choice([50, 200])
    return small_prompt(rng) + tag(77, 3) * depth + tag(77, 4) * depth


def valid(rng: random.Random) -> bytes:
    return small_prompt(rng) + bounded_sampling(rng)


MAKERS = [random_bytes, truncated, invalid_utf8, huge_field, extreme_numbers, odd_wire, valid]


def one_extreme_each() -> list[bytes]:
    """Each extreme value alone in each sampling field, with a prompt that can be served."""
    prompt = length_delimited(TEXT, b"hi")
    out = []
    for number in (TEMPERATURE, TOP_P):
        out += [prompt + length_delimited(SAMPLING, as_float(number, v) + as_varint(MAX_TOKENS, 2))
                for v in EXTREME_FLOATS]
    for number in (TOP_K, SEED_FIELD, N, MAX_TOKENS):
        out += [prompt + length_delimited(SAMPLING, as_varint(MAX_TOKENS, 2) + as_varint(number, v))
                for v in EXTREME_INTS]
    return out


def bodies() -> list[tuple[str, bytes, bool]]:
    """(what, body, streaming) for every case, from SEED."""
    rng = random.Random(SEED)
    out = [("one_extreme", body, rng.random() < 0.5) for body in one_extreme_each()]
    for i in range(CASES):
        make = MAKERS[i % len(MAKERS)]
        out.append((make.__name__, make(rng), rng.random() < 0.5))
    return out


def answer(channel: grpc.Channel, body: bytes, streaming: bool) -> tuple[str, str]:
    try:
        if streaming:
            list(channel.unary_stream(f"/{SERVICE}/GenerateStream")(body, timeout=60))
        else:
            channel.unary_unary(f"/{SERVICE}/Generate")(body, timeout=60)
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""


def test_fuzzed_requests_get_clear_answers(channels: dict[str, grpc.Channel], pods_kv,
                                           idle_free_blocks) -> None:
    cases = bodies()

    def both(case: tuple[str, bytes, bool]) -> tuple[tuple[str, str], tuple[str, str]]:
        _, body, streaming = case
        return (answer(channels["pod"], body, streaming),
                answer(channels["router"], body, streaming))

    with ThreadPoolExecutor(4) as pool:  # a few at once, as real clients would send them
        results = list(pool.map(both, cases))
    tally: dict[str, Counter] = {"pod": Counter(), "router": Counter()}
    by_kind: Counter = Counter()
    for (what, body, _), (pod, router) in zip(cases, results, strict=True):
        tally["pod"][pod[0]] += 1
        tally["router"][router[0]] += 1
        by_kind[what, pod[0]] += 1
        where = f"{what} {body[:60]!r}"
        assert pod[0] in ANSWERS and router[0] in ANSWERS, (where, pod, router)
        assert pod[0] == router[0], (where, pod, router)
        if pod[0] == "INVALID_ARGUMENT":
            assert pod[1] == router[1], (where, pod, router)  # word for word
    print("fuzz tally:", {k: dict(v) for k, v in tally.items()}, dict(sorted(by_kind.items())))
    # Each kind of answer was reached: the cases are not all refused, nor all served.
    assert {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"} <= set(tally["pod"])
    wait_idle(pods_kv, idle_free_blocks)  # no block left behind
    for name in ("pod", "router"):
        req = pb.GenerateRequest(text="still here?", sampling=pb.SamplingParams(max_tokens=2))
        got = pb_grpc.GenerationStub(channels[name]).Generate(req, timeout=30)
        assert got.usage.completion_tokens == 2, name
