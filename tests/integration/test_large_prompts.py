"""Large prompts (#14) must not grow a server's memory, nor hold its event loop.

Memory: a router's RSS grew ~21 MB per refused
1 MiB text prompt (52 -> 921 MB after 40) and a pod's ~3 MB, memory the allocator kept after
grpc held each aborted call's frames, tokens and hashes in a reference cycle.

The RSS of the real `pagekv router` and `pagekv node` processes of the contract cluster
(conftest.py), measured around a bounded number of prompts at the largest size the limits
let through (tokenized, then refused for their token count), under a bound the unfixed code
passed after a handful of them.

The event loop: the router tokenized and hashed a whole prompt on it (a 3 MB one held every
other call for ~1 s); a large prompt is now tokenized on another thread.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc
from pagekv.proto.requests import DEFAULT_MAX_PROMPT_BYTES, LARGE_PROMPT

pytestmark = pytest.mark.integration

REQUESTS = 40
WARM_UP = 5        # the first calls start threads and fill caches for good
# Measured over 40 (2-core dev machine): fixed, router +5 MB and pod +22 MB (it levels off:
# +16 MB after 80); unfixed, router +858 MB and pod +117..137 MB.
GROWTH_MB = 64.0


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def send(stub: pb_grpc.GenerationStub, i: int) -> str:
    text = (f"{i} " + "x" * DEFAULT_MAX_PROMPT_BYTES)[:DEFAULT_MAX_PROMPT_BYTES]
    req = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=1))
    try:
        if i % 2:
            list(stub.GenerateStream(req, timeout=60))
        else:
            stub.Generate(req, timeout=60)
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()}"
    return "OK"


@pytest.mark.parametrize("name", ["router", "pod"])
def test_refused_large_prompts_do_not_grow_rss(name: str, contract_cluster,
                                               channels: dict[str, grpc.Channel]) -> None:
    proc = contract_cluster.router if name == "router" else contract_cluster.pods[0]
    stub = pb_grpc.GenerationStub(channels[name])
    for i in range(WARM_UP):
        send(stub, i)
    before = rss_mb(proc.proc.pid)
    answers = {send(stub, WARM_UP + i) for i in range(REQUESTS)}
    growth = rss_mb(proc.proc.pid) - before
    # Within the byte limit, past the token limit once tokenized (BOS + every byte).
    assert answers == {f"INVALID_ARGUMENT: prompt text has {DEFAULT_MAX_PROMPT_BYTES + 1} "
                       "tokens; the limit is 131072 (--max-prompt-tokens)"}, answers
    assert growth < GROWTH_MB, f"{name} RSS grew {growth:.0f} MB over {REQUESTS} prompts"


class RecordingEncoder:
    """The byte tokenizer, noting the thread each prompt was tokenized on."""

    def __init__(self, encode) -> None:
        self._encode = encode
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return self._encode(text)


def test_the_router_tokenizes_large_prompts_off_its_event_loop(make_router,
                                                                redis_server) -> None:
    router = make_router(redis_server.url)
    encoder = RecordingEncoder(router.server.router.tokenizer.encode)
    router.server.router.tokenizer = encoder
    for size in (LARGE_PROMPT // 2, LARGE_PROMPT * 4):
        # No pod has joined: UNAVAILABLE, once the prompt is tokenized and hashed.
        with pytest.raises(grpc.RpcError) as err:
            router.stub.Generate(pb.GenerateRequest(text="y" * size), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    loop_thread = router.call(_thread_name())
    small, large = encoder.threads
    assert small == loop_thread  # a thread hop would cost more than the work
    assert large != loop_thread


async def _thread_name() -> str:
    return threading.current_thread().name
