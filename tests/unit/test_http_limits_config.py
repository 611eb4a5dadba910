"""HttpLimits: the flags' checks and a request's deadline (the server's, or the client's
header when shorter)."""

from __future__ import annotations

import argparse

import pytest

from pagekv.proto.openai.limits import HttpLimits, add_http_limit_arguments, http_limits_from


def test_a_client_may_only_shorten_the_deadline() -> None:
    limits = HttpLimits(request_timeout_s=600)
    assert limits.deadline_s(None) == 600
    assert limits.deadline_s("2.5") == 2.5
    assert limits.deadline_s("9999") == 600
    for junk in ("", "abc", "-1", "0", "nan", "inf"):
        assert limits.deadline_s(junk) == 600, junk


def test_no_server_deadline_leaves_the_client_s() -> None:
    limits = HttpLimits(request_timeout_s=0)
    assert limits.deadline_s(None) is None
    assert limits.deadline_s("inf") is None
    assert limits.deadline_s("3") == 3


def test_flags_fill_the_limits_and_bad_ones_are_refused() -> None:
    parser = argparse.ArgumentParser()
    add_http_limit_arguments(parser)
    got = http_limits_from(parser.parse_args(["--http-max-header-bytes", "8192",
                                              "--http-header-timeout-s", "5"]))
    assert got == HttpLimits(max_header_bytes=8192, header_timeout_s=5)
    with pytest.raises(ValueError, match="--http-max-header-bytes"):
        HttpLimits(max_header_bytes=0)
    with pytest.raises(ValueError, match="--http-body-timeout-s"):
        HttpLimits(body_timeout_s=float("nan"))
    with pytest.raises(ValueError, match="--http-request-timeout-s"):
        HttpLimits(request_timeout_s=-1)
