"""A pod listens before its model is loaded: a call that needs the engine meanwhile is
answered UNAVAILABLE ("pod is starting"), like a generate call, not with an AttributeError."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagekv.kvnode.engine.config import EngineArgs
from pagekv.kvnode.pod.server import PodServer, PodServicer, PodStarting
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from tests.unit.grpc_context import Aborted, FakeContext


def starting_pod() -> PodServer:
    return PodServer(EngineArgs(model="pagekv-tiny"), "p0")  # start() not called: no engine


@pytest.mark.parametrize("call, request_", [
    ("Stats", pb.StatsRequest()),
    ("ResetPrefixCache", pb.ResetPrefixCacheRequest()),
])
def test_calls_before_the_engine_is_built_are_unavailable(call: str, request_) -> None:
    svc = PodServicer(starting_pod())
    with pytest.raises(Aborted) as info:
        asyncio.run(getattr(svc, call)(request_, FakeContext()))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_the_engine_is_asked_for_only_once_built() -> None:
    pod = starting_pod()
    with pytest.raises(PodStarting, match="p0 is starting"):
        pod.stats_response()
    with pytest.raises(PodStarting):
        pod.load()
