"""The `pagekv.v1.Generation` contract as another client sees it, checked the same way against
a pod and against the router in front of two pods: a client must not be able to tell them
apart (the router only adds `routing`).

The client side is written from the .proto alone: plain generated stubs, grpc.health.v1 and a
hand-written server-reflection client. One cluster (Redis, two pods, the router, as
processes) serves the whole module.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from deploy.local_cluster import LocalCluster
from proto.pagekv.v1 import pagekv_pb2 as pb
from proto.pagekv.v1 import pagekv_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    run_dir = tmp_path_factory.mktemp("contract-run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # two pods and a router on two cores
        with LocalCluster(nodes=2, run_dir=run_dir, node_args=POD_ARGS) as c:
            yield c


@pytest.fixture(scope="module")
def channels(cluster: LocalCluster) -> Iterator[dict[str, grpc.Channel]]:
    addrs = {"pod": cluster.pods[0].address, "router": cluster.router.address}
    addrs.update({p.name: p.address for p in cluster.pods})
    chans = {name: grpc.insecure_channel(a) for name, a in addrs.items()}
    yield chans
    for ch in chans.values():
        ch.close()


@pytest.fixture(scope="module")
def pods_kv(cluster: LocalCluster, channels: dict[str, grpc.Channel]
            ) -> dict[str, pb_grpc.KVNodeStub]:
    return {p.name: pb_grpc.KVNodeStub(channels[p.name]) for p in cluster.pods}


@pytest.fixture(scope="module")
def idle_free_blocks(pods_kv: dict[str, pb_grpc.KVNodeStub]) -> dict[str, int]:
    """Each pod's num_free_blocks with nothing in flight (taken before any request)."""
    return {name: kv.Stats(pb.StatsRequest(), timeout=10).num_free_blocks
            for name, kv in pods_kv.items()}


@pytest.fixture(params=["pod", "router"])
def target(request: pytest.FixtureRequest, cluster: LocalCluster,
           channels: dict[str, grpc.Channel]) -> Target:
    name = request.param
    addr = cluster.pods[0].address if name == "pod" else cluster.router.address
    return Target(name, addr, pb_grpc.GenerationStub(channels[name]), channels[name])


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


# -- errors ------------------------------------------------------------------------------------

BAD = {
    "empty text": (pb.GenerateRequest(text=""), "empty"),
    "empty token_ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "empty"),
    "no prompt": (pb.GenerateRequest(), "prompt is required"),
    "token id == vocab": (ids_req([BOS, 65, VOCAB]), "vocabulary"),
    "prompt too long": (ids_req([65] * MAX_MODEL_LEN), "max_model_len"),
    "max_tokens too large": (text_req("hi", sampling(MAX_MODEL_LEN)), "max_tokens"),
    "max_tokens zero": (text_req("hi", sampling(0)), "max_tokens"),
    "temperature < 0": (text_req("hi", sampling(2, temperature=-0.5)), "temperature"),
    "top_p zero": (text_req("hi", sampling(2, top_p=0.0)), "top_p"),
    "top_p over 1": (text_req("hi", sampling(2, top_p=1.5)), "top_p"),
    "n too large": (text_req("hi", sampling(2, n=MAX_N + 1)), "max_n"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_invalid_argument_alike(case: str,
                                             channels: dict[str, grpc.Channel]) -> None:
    req, needle = BAD[case]
    seen = []
    for name in ("pod", "router"):
        stub = pb_grpc.GenerationStub(channels[name])
        for call in (stub.Generate, lambda r, timeout, s=stub: list(s.GenerateStream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert needle in err.value.details()
            seen.append(err.value.details())
    assert len(set(seen)) == 1, seen  # word for word the same from pod and router


def test_duplicate_in_flight_request_id(target: Target, pods_kv, idle_free_blocks) -> None:
    long = text_req("long one", sampling(MAX_MODEL_LEN - 16, ignore_eos=True),
                    request_id="dup-id")
    stream = target.gen.GenerateStream(long, timeout=60)
    next(stream)  # in flight now
    for call in (target.gen.Generate, lambda r: list(target.gen.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as err:
            # another prompt: through the router it may well be routed to the other pod
            call(text_req("something else entirely", sampling(2), request_id="dup-id"))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'dup-id'" in err.value.details()
    stream.cancel()
    wait_idle(pods_kv, idle_free_blocks)
    again = target.gen.Generate(text_req("x", sampling(2), request_id="dup-id"), timeout=30)
    assert again.request_id == "dup-id"


def test_request_ids_are_opaque(target: Target, pods_kv, idle_free_blocks) -> None:
    """'r#1' is just an id, not request 'r''s second sample: both run with their own results
    (the engine names an n>1 request's extra samples '<id>#<i>')."""
    want_child = as_dict(target.gen.Generate(
        text_req("alone", sampling(12, ignore_eos=True)), timeout=30))
    parent_sp = sampling(200, temperature=1.0, seed=5, n=2, ignore_eos=True)
    want_parent = as_dict(target.gen.Generate(text_req("parent", parent_sp), timeout=30))
    parent = target.gen.GenerateStream(text_req("parent", parent_sp, request_id="r"),
                                       timeout=60)
    chunks = [next(parent)]  # forked: samples 'r' and 'r#1' are running
    for rid in ("r#1", "r%231", "r#2"):
        got = target.gen.Generate(text_req("alone", sampling(12, ignore_eos=True),
                                           request_id=rid), timeout=30)
        assert got.request_id == rid and as_dict(got) == want_child
    chunks += list(parent)
    assert joined(chunks) == want_parent
    wait_idle(pods_kv, idle_free_blocks)


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


# -- discovery: reflection and health ----------------------------------------------------------

def test_reflection_lists_and_describes_the_service(target: Target) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(target.channel)
    reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)]
    listed, described = list(stub.ServerReflectionInfo(iter(reqs), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    services = {f"{f.package}.{s.name}": s for f in files for s in f.service}
    methods = {m.name: (m.input_type, m.output_type, m.server_streaming)
               for m in services[SERVICE].method}
    assert methods == {
        "Generate": (".pagekv.v1.GenerateRequest", ".pagekv.v1.GenerateResponse", False),
        "GenerateStream": (".pagekv.v1.GenerateRequest", ".pagekv.v1.GenerateChunk", True),
    }


@pytest.mark.parametrize("service", ["", SERVICE])
def test_health_serving(target: Target, service: str) -> None:
    stub = health_pb2_grpc.HealthStub(target.channel)
    resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING

