"""How a pod reads a request's prompt (#14): bounds first, without tokenizing; a large prompt
tokenized on another thread, so that its event loop keeps serving every other call."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from pagekv.kvnode.engine.config import EngineArgs
from pagekv.kvnode.pod.server import PodServer, PodServicer
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.requests import LARGE_PROMPT, BadRequest, PromptLimits


class RecordingTokenizer:
    def __init__(self) -> None:
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return [256, *text.encode("utf-8")]


def servicer(limits: PromptLimits | None = None) -> tuple[PodServicer, RecordingTokenizer]:
    tok = RecordingTokenizer()
    pod = PodServer(EngineArgs(model="pagekv-tiny"), "p0", prompt_limits=limits)
    pod.engine = SimpleNamespace(tokenizer=tok, max_model_len=1 << 20)
    return PodServicer(pod), tok


def parse(svc: PodServicer, req: pb.GenerateRequest):
    async def run():
        return await svc._parse(req, None), threading.current_thread().name  # no tenants
    return asyncio.run(run())


def test_large_prompts_are_tokenized_off_the_event_loop() -> None:
    svc, tok = servicer()
    for size in (LARGE_PROMPT // 2, LARGE_PROMPT * 4):
        (_, tokens, *_), loop_thread = parse(svc, pb.GenerateRequest(text="z" * size))
        assert len(tokens) == size + 1
    small, large = tok.threads
    assert small == loop_thread
    assert large != loop_thread


def test_bounds_come_before_the_tokenizer() -> None:
    svc, tok = servicer(PromptLimits(max_bytes=1000, max_tokens=100))
    for req, words in [
        (pb.GenerateRequest(text="z" * 1001), "prompt text has 1001 bytes"),
        (pb.GenerateRequest(text="hi", request_id="r" * 300), "request_id has 300 bytes"),
    ]:
        with pytest.raises(BadRequest, match=words):
            parse(svc, req)
    assert tok.threads == []
    with pytest.raises(BadRequest, match="prompt text has 201 tokens; the limit is 100"):
        parse(svc, pb.GenerateRequest(text="z" * 200))
