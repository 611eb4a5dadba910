"""Shared by the `pagekv.v1.Generation` contract tests (tests/integration/test_api_contract_*.py):
the cluster's limits, the Target a test talks to (the pod or the router), request builders and
the checks a client makes of what comes back. The fixtures (one cluster for all of those
modules, its channels, the target) are in conftest.py.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import grpc

from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

MAX_MODEL_LEN = 4096  # room for a generation that outlives a client's deadline
MAX_N = 4
VOCAB = 258           # pagekv-tiny's byte tokenizer: bytes, BOS 256, EOS 257
BOS, EOS = 256, 257
POD_ARGS = ["--num-gpu-blocks", "320", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-n", str(MAX_N), "--lease-ttl-s", "2"]
SERVICE = "pagekv.v1.Generation"


@dataclass
class Target:
    name: str
    address: str
    gen: pb_grpc.GenerationStub
    channel: grpc.Channel


# -- helpers -----------------------------------------------------------------------------------

def sampling(max_tokens: int = 8, temperature: float = 0.0, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, **kw)


def text_req(text: str, sp: pb.SamplingParams | None = None, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=sp or sampling(ignore_eos=True), **kw)


def ids_req(ids: list[int], sp: pb.SamplingParams | None = None, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                              sampling=sp or sampling(ignore_eos=True), **kw)


def byte_text(ids: list[int]) -> str:
    """The byte tokenizer's decode: special tokens skipped, bad UTF-8 replaced."""
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


def joined(chunks: list[pb.GenerateChunk]) -> dict[int, tuple[list[int], str, list[int]]]:
    """Per completion index: all token ids, all text, and every finish_reason seen."""
    toks: dict[int, list[int]] = defaultdict(list)
    text: dict[int, str] = defaultdict(str)
    reasons: dict[int, list[int]] = defaultdict(list)
    for c in chunks:
        toks[c.index].extend(c.token_ids)
        text[c.index] += c.text
        if c.finish_reason:
            reasons[c.index].append(c.finish_reason)
    return {i: (toks[i], text[i], reasons[i]) for i in toks}


def as_dict(resp: pb.GenerateResponse) -> dict[int, tuple[list[int], str, list[int]]]:
    return {c.index: (list(c.token_ids), c.text, [c.finish_reason]) for c in resp.completions}


def check_stream_shape(chunks: list[pb.GenerateChunk], rid: str, target: Target) -> None:
    """finish_reason once per completion, on its last chunk; usage and served_by (and
    routing, through the router) on the very last chunk only; the request id everywhere."""
    assert chunks and all(c.request_id == rid for c in chunks)
    last_of: dict[int, int] = {}
    for pos, c in enumerate(chunks):
        last_of[c.index] = pos
    for i, pos in last_of.items():
        finishing = [p for p, c in enumerate(chunks) if c.index == i and c.finish_reason]
        assert finishing == [pos], f"completion {i}: finish_reason on chunks {finishing}"
    for c in chunks[:-1]:
        assert not c.HasField("usage") and not c.served_by and not c.HasField("routing")
    last = chunks[-1]
    assert last.HasField("usage") and last.served_by
    assert last.HasField("routing") == (target.name == "router")


def wait_idle(pods_kv: dict[str, pb_grpc.KVNodeStub], idle: dict[str, int],
              timeout: float = 15.0) -> None:
    """Every pod back to nothing running and its idle free-block count."""
    deadline = time.monotonic() + timeout
    while True:
        stats = {n: kv.Stats(pb.StatsRequest(), timeout=5) for n, kv in pods_kv.items()}
        if all(s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == idle[n]
               for n, s in stats.items()):
            return
        if time.monotonic() > deadline:
            raise AssertionError("pods not idle: " + "; ".join(
                f"{n}: running={s.num_running} waiting={s.num_waiting} "
                f"free={s.num_free_blocks}/{idle[n]}" for n, s in stats.items()))
        time.sleep(0.05)


def running_somewhere(pods_kv: dict[str, pb_grpc.KVNodeStub]) -> bool:
    return any(kv.Stats(pb.StatsRequest(), timeout=5).num_running
               for kv in pods_kv.values())
