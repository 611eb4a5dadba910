"""Cache control on the wire: the OpenAI API's extension fields and the gRPC request's, read
into one CacheControl, refused in clear words when out of bounds; session affinity's table."""

from __future__ import annotations

import pytest

from pagekv.proto.openai.errors import ApiError
from pagekv.proto.openai.params import parse_chat, parse_completion
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.requests import BadRequest, cache_control_of
from pagekv.router.sessions import SessionAffinity


def completion(**extra):
    return parse_completion({"prompt": "hi", **extra})[0]


@pytest.mark.parametrize("ttl, seconds", [(None, 300), (90, 90), ("30s", 30), ("5m", 300),
                                          ("1h", 3600)])
def test_a_cache_control_ttl_reads_as_seconds(ttl, seconds) -> None:
    control = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
    parsed = completion(cache_control={**control, "tokens": 64})
    assert (parsed.pin_ttl_s, parsed.pin_tokens) == (seconds, 64)


@pytest.mark.parametrize("body", [{"cache_control": {"ttl": 0}},
                                  {"cache_control": {"ttl": "2d"}},
                                  {"cache_control": {"type": "persistent"}},
                                  {"cache_control": {"ttl": 10, "color": 1}},
                                  {"cache_control": "1h"},
                                  {"one_shot": True, "session_id": "s"},
                                  {"one_shot": True, "cache_control": {"ttl": 5}},
                                  {"session_id": "x" * 257}])
def test_bad_cache_control_is_a_400_naming_the_field(body) -> None:
    with pytest.raises(ApiError) as err:
        completion(**body)
    assert err.value.status == 400


def test_one_shot_and_sessions_read_from_their_fields_and_user() -> None:
    assert completion(one_shot=True).one_shot
    assert completion(session_id="conv-1", user="u").session_id == "conv-1"
    assert completion(user="u").session_id == "u"


def test_a_chat_messages_breakpoint_pins_the_prompt_through_it() -> None:
    parsed, messages, _ = parse_chat({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "long rules",
                                        "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
        {"role": "user", "content": "question"}]})
    assert parsed.pin_ttl_s == 3600 and parsed.pin_message == 0
    assert messages[0]["content"] == "long rules"


def test_the_grpc_fields_read_into_one_cache_control() -> None:
    req = pb.GenerateRequest(text="x", session_id="s", cache_control=pb.CacheControl(
        ttl_s=60, tokens=32))
    control = cache_control_of(req)
    assert (control.pin_ttl_s, control.pin_tokens, control.session_id) == (60.0, 32, "s")
    for bad in (pb.GenerateRequest(text="x", cache_control=pb.CacheControl(tokens=3)),
                pb.GenerateRequest(text="x", one_shot=True, session_id="s"),
                pb.GenerateRequest(text="x", cache_control=pb.CacheControl(ttl_s=86_401))):
        with pytest.raises(BadRequest):
            cache_control_of(bad)


def test_a_session_is_remembered_for_its_idle_time_and_bounded() -> None:
    now = [0.0]
    sessions = SessionAffinity(10.0, 2, max_sessions=2, clock=lambda: now[0])
    a, b, c = (SessionAffinity.key("", s) for s in "abc")
    assert SessionAffinity.key("", "") is None
    sessions.record(a, "pod-1")
    assert sessions.pod_of(a) == "pod-1"
    assert SessionAffinity.key("tenant-x", "a") != a  # two tenants' equal ids: two sessions
    now[0] = 11.0
    assert sessions.pod_of(a) is None  # idle too long
    sessions.record(a, "pod-1")
    sessions.record(b, "pod-2")
    sessions.record(c, "pod-3")
    assert len(sessions) == 2 and sessions.pod_of(a) is None  # the oldest went
    assert sessions.saturated(2) and not sessions.saturated(1)
