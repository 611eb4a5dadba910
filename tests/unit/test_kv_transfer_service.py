"""`KVNode.PullBlocks` served in process (kvnode/pod/kv_transfer.py) from a real engine of
pagekv-tiny: the concurrency cap, the byte limits, refused configurations, pins released
whatever ends the stream, and the stream cut at the first block the pod lacks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from pagekv.kvnode.engine.async_engine import AsyncEngine
from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.kvnode.pod.kv_transfer import KvTransferService, TransferConfig
from pagekv.kvnode.pod.server import PodServer
from pagekv.proto.hashing import hash_prompt
from pagekv.proto.pagekv.v1 import pagekv_pb2 as pb
from pagekv.tiers.peer_entries import pack_block, unpack_chain
from tests.unit.grpc_context import Aborted, FakeContext

PROMPT = [(i * 7) % 250 for i in range(100)]  # 6 full blocks of 16 cached after one run
CACHED = len(PROMPT) // 16
LABELS = {"pod": "pod-t", "model_name": "pagekv-tiny"}


@dataclass
class FakePod:
    """The attributes KvTransferService reads from kvnode.pod.server's pod."""

    engine: Engine
    aengine: AsyncEngine
    serving: bool = True
    metric_labels: dict = field(default_factory=lambda: dict(LABELS))
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    @property
    def args(self):
        return self.engine.args

    built_engine = PodServer.built_engine
    wire_hash_config = PodServer.wire_hash_config


@pytest.fixture(scope="module")
def aengine():
    eng = AsyncEngine(Engine(model="pagekv-tiny", num_gpu_blocks=64, max_model_len=512))
    eng.start()

    async def warm() -> None:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in eng.generate("warm", PROMPT, params):
            pass

    asyncio.run(warm())
    yield eng
    eng.shutdown()


def make(aengine: AsyncEngine, **config) -> tuple[FakePod, KvTransferService]:
    pod = FakePod(aengine.engine, aengine)
    return pod, KvTransferService(pod, TransferConfig(**config))


def chain(tokens: list[int], engine: Engine) -> list[bytes]:
    return hash_prompt(engine.kv_manager.hash_config, engine.args.block_size, tokens)


LONGER = PROMPT[:CACHED * 16] + [5] * 48  # the cached run, then 3 blocks never computed


def claimed_tokens(engine: Engine, hashes: list[bytes]) -> list[int]:
    """The tokens of the test prompt whose chain holds `hashes`, through the last of them: what
    a puller shows (kv_export.ChainClaim)."""
    for tokens in (PROMPT, LONGER):
        full = chain(tokens, engine)
        if hashes and hashes[-1] in full:
            return tokens[:(full.index(hashes[-1]) + 1) * engine.args.block_size]
    return []


def ask(engine: Engine, hashes: list[bytes], **fields) -> pb.PullBlocksRequest:
    mgr, args = engine.kv_manager, engine.args
    fields.setdefault("chain_token_ids", claimed_tokens(engine, hashes))
    fields.setdefault("hash_config", pb.HashConfig(
        algo=args.hash_algo, seed_fingerprint=mgr.hash_config.fingerprint(),
        block_size=args.block_size))
    fields.setdefault("kv_layout", engine.kv_layout.json)
    return pb.PullBlocksRequest(block_hashes=hashes, **fields)


async def drain(gen) -> list[pb.PullBlocksChunk]:
    return [chunk async for chunk in gen]


def entries(chunks: list[pb.PullBlocksChunk]) -> list[bytes]:
    return [e for c in chunks for e in c.entries]


def settled(aengine: AsyncEngine) -> tuple[int, int]:
    """(runs still open, pool blocks not free), read on the engine thread: after any close
    the service posted before this call."""
    eng = aengine.engine
    return aengine.call(lambda: (eng.exporter.open_runs,
                                 eng.kv_manager.num_blocks - eng.kv_manager.get_num_free_blocks()))


def refused(pod: FakePod, reason: str) -> float:
    value = pod.registry.get_sample_value("pagekv_kv_transfers_refused_total",
                                          {**LABELS, "reason": reason})
    return value or 0.0


def active(pod: FakePod) -> float:
    return pod.registry.get_sample_value("pagekv_kv_transfers_active", LABELS)


def test_serves_the_cached_chain_with_the_pool_bytes(aengine):
    eng = aengine.engine
    pod, svc = make(aengine)
    hashes = chain(PROMPT, eng)
    chunks = asyncio.run(drain(svc.pull_blocks(ask(eng, hashes), FakeContext())))
    got = unpack_chain(eng.kv_layout, entries(chunks), hashes, None)
    assert len(got) == CACHED
    ids = aengine.call(lambda: [eng.kv_manager.block_pool.get_cached_block(h).block_id
                                for h in hashes])
    want = aengine.call(lambda: eng.runner.read_blocks(ids).cpu().numpy())
    assert np.array_equal(np.stack(got), want)
    assert settled(aengine) == (0, 0)
    assert pod.registry.get_sample_value("pagekv_kv_served_blocks_total",
                                         {**LABELS, "tier": "GPU"}) == CACHED
    assert active(pod) == 0


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("chunk_bytes", [1, 4 << 20])
def test_entries_are_the_blocks_packed_in_the_entry_format(aengine, compress, chunk_bytes):
    """The bytes on the wire: each entry is tiers.peer_entries' pack_block of the pool block,
    its parent the block before (the one asked for first continues the request's parent),
    whatever the message size; the pod sends what the engine's exporter packed."""
    eng = aengine.engine
    _, svc = make(aengine, compress=compress, chunk_bytes=chunk_bytes)
    hashes = chain(PROMPT, eng)
    for first in (0, 2):
        parent = hashes[first - 1] if first else b""
        chunks = asyncio.run(drain(svc.pull_blocks(
            ask(eng, hashes[first:], parent_hash=parent), FakeContext())))
        ids = aengine.call(lambda: [eng.kv_manager.block_pool.get_cached_block(h).block_id
                                    for h in hashes])
        rows = aengine.call(lambda ids=ids: eng.runner.read_blocks(ids).cpu().numpy())
        want = [pack_block(eng.kv_layout, hashes[i], hashes[i - 1] if i else None, rows[i],
                           compress) for i in range(first, CACHED)]
        assert entries(chunks) == want
    assert settled(aengine) == (0, 0)


def test_concurrency_cap_refuses_then_frees_its_slot(aengine):
    eng = aengine.engine
    pod, svc = make(aengine, serve_max_concurrent=2, chunk_bytes=1)  # one block per message
    req = ask(eng, chain(PROMPT, eng))

    async def main() -> None:
        first, second = svc.pull_blocks(req, FakeContext()), svc.pull_blocks(req, FakeContext())
        assert len((await first.__anext__()).entries) == 1  # both suspended mid-stream
        assert len((await second.__anext__()).entries) == 1
        assert svc.active == 2 and active(pod) == 2
        with pytest.raises(Aborted) as info:
            await svc.pull_blocks(req, FakeContext()).__anext__()
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused(pod, "busy") == 1
        assert len(await drain(first)) == CACHED - 1
        assert len(await drain(second)) == CACHED - 1
        assert svc.active == 0
        assert len(entries(await drain(svc.pull_blocks(req, FakeContext())))) == CACHED

    asyncio.run(main())
    assert refused(pod, "busy") == 1 and active(pod) == 0
    assert settled(aengine) == (0, 0)


def entry_sizes(aengine: AsyncEngine) -> list[int]:
    eng = aengine.engine
    _, svc = make(aengine)
    chunks = asyncio.run(drain(svc.pull_blocks(ask(eng, chain(PROMPT, eng)), FakeContext())))
    return [len(e) for e in entries(chunks)]


@pytest.mark.parametrize("chunk_bytes", [1, 4 << 20])  # cut between messages, within one
def test_request_max_bytes_cuts_at_a_block_boundary(aengine, chunk_bytes):
    eng = aengine.engine
    sizes = entry_sizes(aengine)
    hashes = chain(PROMPT, eng)
    _, svc = make(aengine, chunk_bytes=chunk_bytes)
    for limit, want in ((sum(sizes[:3]), 3), (sum(sizes[:3]) - 1, 2), (sizes[0] - 1, 0)):
        chunks = asyncio.run(drain(svc.pull_blocks(ask(eng, hashes, max_bytes=limit),
                                                   FakeContext())))
        got = entries(chunks)
        assert [len(e) for e in got] == sizes[:want], limit
        assert len(unpack_chain(eng.kv_layout, got, hashes, None)) == want
        assert all(c.entries for c in chunks)  # no empty message
    assert settled(aengine) == (0, 0)


def test_serve_max_bytes_caps_every_request(aengine):
    eng = aengine.engine
    sizes = entry_sizes(aengine)
    hashes = chain(PROMPT, eng)
    _, svc = make(aengine, serve_max_bytes=sum(sizes[:2]) + 10, chunk_bytes=1)
    for asked in (0, 1 << 40):  # the peer's limit; a bigger one asked is not granted
        got = entries(asyncio.run(drain(svc.pull_blocks(ask(eng, hashes, max_bytes=asked),
                                                        FakeContext()))))
        assert [len(e) for e in got] == sizes[:2]
    small = entries(asyncio.run(drain(svc.pull_blocks(ask(eng, hashes, max_bytes=sizes[0]),
                                                      FakeContext()))))
    assert len(small) == 1  # a smaller limit asked is kept
    assert settled(aengine) == (0, 0)


@pytest.mark.parametrize("change", [
    {"algo": "xxhash"},
    {"seed_fingerprint": "sha256-0000000000000000"},
    {"block_size": 32},
])
def test_another_hash_config_is_failed_precondition(aengine, change):
    eng = aengine.engine
    pod, svc = make(aengine)
    mine = ask(eng, []).hash_config
    theirs = pb.HashConfig(algo=mine.algo, seed_fingerprint=mine.seed_fingerprint,
                           block_size=mine.block_size)
    for key, value in change.items():
        setattr(theirs, key, value)
    req = ask(eng, chain(PROMPT, eng), hash_config=theirs)
    with pytest.raises(Aborted) as info:
        asyncio.run(drain(svc.pull_blocks(req, FakeContext())))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    # What differs, never this pod's values (a caller learns nothing of its configuration).
    assert info.value.details == "the puller's hash configuration differs from this pod's"
    assert refused(pod, "config_mismatch") == 1
    assert svc.active == 0 and settled(aengine) == (0, 0)


def test_another_kv_layout_is_failed_precondition(aengine):
    eng = aengine.engine
    pod, svc = make(aengine)
    other = eng.kv_layout.json.replace('"dtype":"float32"', '"dtype":"float16"')
    assert other != eng.kv_layout.json
    with pytest.raises(Aborted) as info:
        asyncio.run(drain(svc.pull_blocks(ask(eng, chain(PROMPT, eng), kv_layout=other),
                                          FakeContext())))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details == "the puller's KV layout differs from this pod's"
    assert refused(pod, "config_mismatch") == 1
    assert settled(aengine) == (0, 0)


def test_not_serving_is_unavailable(aengine):
    eng = aengine.engine
    pod, svc = make(aengine)
    pod.serving = False
    with pytest.raises(Aborted) as info:
        asyncio.run(drain(svc.pull_blocks(ask(eng, chain(PROMPT, eng)), FakeContext())))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert refused(pod, "unavailable") == 1


def test_stream_closed_early_releases_the_pins(aengine):
    eng = aengine.engine
    pod, svc = make(aengine, chunk_bytes=1)
    req = ask(eng, chain(PROMPT, eng))

    async def main() -> None:
        gen = svc.pull_blocks(req, FakeContext())
        assert len((await gen.__anext__()).entries) == 1
        runs, held = await asyncio.to_thread(settled, aengine)
        assert (runs, held) == (1, CACHED)  # the run's pool blocks are out of the free queue
        await gen.aclose()
        assert svc.active == 0 and active(pod) == 0
        # The close was posted to the engine thread by now: a later call runs after it.
        assert await asyncio.to_thread(settled, aengine) == (0, 0)

    asyncio.run(main())


def test_stream_stops_at_the_first_block_not_held(aengine):
    eng = aengine.engine
    _, svc = make(aengine)
    hashes = chain(LONGER, eng)
    assert hashes[:CACHED] == chain(PROMPT, eng) and len(hashes) == CACHED + 3
    got = entries(asyncio.run(drain(svc.pull_blocks(ask(eng, hashes), FakeContext()))))
    assert len(unpack_chain(eng.kv_layout, got, hashes, None)) == CACHED
    # hashes that are not one chain (a gap): nothing at all, they are no request's
    gap = [hashes[0], hashes[1], hashes[CACHED + 1], *hashes[3:CACHED]]
    got = entries(asyncio.run(drain(svc.pull_blocks(
        ask(eng, gap, chain_token_ids=LONGER[:CACHED * 16]), FakeContext()))))
    assert got == []
    # asked from the middle of the chain: entries continue the parent given
    mid = entries(asyncio.run(drain(svc.pull_blocks(
        ask(eng, hashes[2:], parent_hash=hashes[1]), FakeContext()))))
    assert len(unpack_chain(eng.kv_layout, mid, hashes[2:], hashes[1])) == CACHED - 2
    none = entries(asyncio.run(drain(svc.pull_blocks(ask(eng, hashes[CACHED:]),
                                                     FakeContext()))))
    assert none == []
    assert settled(aengine) == (0, 0)


def test_a_pull_given_up_while_the_engine_is_busy_pins_nothing(aengine):
    """A busy holder opens (pins) the run only after the puller's deadline has cancelled the
    call: that run used to stay pinned for good (free blocks fell by a run per pull)."""
    import threading

    eng = aengine.engine
    _, svc = make(aengine)
    req = ask(eng, chain(PROMPT, eng))
    for cancel_after_open in (False, True):
        busy = threading.Event()
        aengine.post(lambda busy=busy: busy.wait(5))  # the engine thread, mid-step

        async def main(busy=busy, cancel_after_open=cancel_after_open) -> None:
            pull = asyncio.ensure_future(drain(svc.pull_blocks(req, FakeContext())))
            await asyncio.sleep(0.2)  # the open is queued behind the busy step
            if cancel_after_open:
                # The engine frees up and opens the run; the cancel lands right after.
                busy.set()
                await asyncio.sleep(0)
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            busy.set()

        asyncio.run(main())
        assert settled(aengine) == (0, 0), cancel_after_open


def test_only_the_chain_the_callers_tokens_and_salt_give_is_served(aengine):
    """Blocks cached for a salted request go only to a pull that shows that salt and those
    tokens: the hashes alone (readable in the index) or another salt get an empty stream,
    as blocks not held do."""
    eng = aengine.engine
    pod, svc = make(aengine)
    tenant = [(i * 5) % 240 + 3 for i in range(100)]

    async def run(salt: str) -> None:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in aengine.generate("salted", tenant, params, salt):
            pass

    asyncio.run(run("tenant:b"))
    cfg, bs = eng.kv_manager.hash_config, eng.args.block_size
    held = hash_prompt(cfg, bs, tenant, "tenant:b")[:CACHED]
    tokens = tenant[:CACHED * bs]

    def pulled(**claim) -> int:
        req = ask(eng, held, chain_token_ids=claim.pop("tokens", tokens), **claim)
        return len(entries(asyncio.run(drain(svc.pull_blocks(req, FakeContext())))))

    assert pulled(cache_salt="tenant:b") == CACHED
    assert pulled(cache_salt="tenant:a") == 0    # another tenant's salt
    assert pulled() == 0                           # no salt
    assert pulled(tokens=[]) == 0                  # the hashes alone
    assert pulled(cache_salt="tenant:b", tokens=tokens[:-1]) == 0  # not whole blocks
    assert pulled(cache_salt="tenant:b", lora_id="3") == 0         # another adapter
    # from the middle of the chain: the parent must be the claim's too
    mid = ask(eng, held[2:], parent_hash=held[1], chain_token_ids=tokens, cache_salt="tenant:b")
    assert len(entries(asyncio.run(drain(svc.pull_blocks(mid, FakeContext()))))) == CACHED - 2
    mid.parent_hash = held[0]
    assert entries(asyncio.run(drain(svc.pull_blocks(mid, FakeContext())))) == []
    assert refused(pod, "not_callers_chain") == 6
    assert settled(aengine) == (0, 0)
