"""The `pagekv.v1.Generation` contract as another client sees it, checked the same way against
a pod and against the router in front of two pods: a client must not be able to tell them
apart (the router only adds `routing`). Here: a deadline or a cancelled stream
frees the pod's blocks.

The client side is written from the .proto alone: plain generated stubs, grpc.health.v1 and a
hand-written server-reflection client. One cluster (Redis, two pods, the router, as
processes) serves every test_api_contract_*.py module (conftest.py); helpers are in
contract_fixtures.py.
"""

from __future__ import annotations

import grpc
import pytest

from tests.integration.contract_fixtures import (
    MAX_MODEL_LEN,
    Target,
    running_somewhere,
    sampling,
    text_req,
    wait_idle,
)

pytestmark = pytest.mark.integration


# -- deadlines and cancellation free the pod's blocks --------------------------------------------

def test_deadline_mid_generation_aborts_on_the_pod(target: Target, pods_kv,
                                                  idle_free_blocks) -> None:
    wait_idle(pods_kv, idle_free_blocks)
    long = text_req("never mind", sampling(MAX_MODEL_LEN - 32, ignore_eos=True))
    stream = target.gen.GenerateStream(long, timeout=1.0)
    got = 0
    with pytest.raises(grpc.RpcError) as err:
        for chunk in stream:
            got += len(chunk.token_ids)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < got < MAX_MODEL_LEN - 32  # it was cut mid-generation
    wait_idle(pods_kv, idle_free_blocks)
    with pytest.raises(grpc.RpcError) as err:
        target.gen.Generate(long, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(pods_kv, idle_free_blocks)


def test_cancelled_stream_aborts_on_the_pod(target: Target, pods_kv, idle_free_blocks) -> None:
    wait_idle(pods_kv, idle_free_blocks)
    stream = target.gen.GenerateStream(
        text_req("stop listening", sampling(MAX_MODEL_LEN - 32, n=2, temperature=1.0,
                                            ignore_eos=True)), timeout=60)
    next(stream)
    assert running_somewhere(pods_kv)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_idle(pods_kv, idle_free_blocks)
