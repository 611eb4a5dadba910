"""Cross-pod KV pull in the engine: a puller engine lands a source engine's blocks.

The transport is a direct call into the source engine's exporter (the same entries the
gRPC service sends), so these tests check the engine's side alone: the landed blocks give
a cold run's tokens, every fault falls back to recompute with its reason, and no block stays
pinned on either side.
"""

from __future__ import annotations

import threading
import time

import pytest

from pagekv.kvnode.engine.engine import Engine
from pagekv.kvnode.engine.peer_pull import KvSource, PullFailed
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.proto.medium import PEER_SHARE, Medium

P = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [(i * 37) % 250 + 1 for i in range(200)]
FILLERS = [[(i * k) % 250 + 1 for i in range(180)] for k in (11, 13, 17)]
SOURCE = KvSource("peer", "127.0.0.1:1", 64)


def engine(block_size=16, **kw) -> Engine:
    kw.setdefault("num_gpu_blocks", 512 // block_size * 2)
    kw.setdefault("max_model_len", 512)
    return Engine(model="pagekv-tiny", block_size=block_size, **kw)


def run(eng: Engine, prompt, source: KvSource | None = None, rid: str = "r"):
    eng.add_request(rid, prompt, P, kv_source=source)
    tokens, last = [], None
    deadline = time.monotonic() + 30
    while eng.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not finish"
        for out in eng.step():
            tokens += out.outputs[0].token_ids
            last = out
    return tokens, last


def direct_fetch(src: Engine, seen_media: list | None = None):
    """Entries of `src`'s blocks, read and packed by its exporter as the transfer service
    asks for them."""
    def fetch(source, ask, handle, sink):
        exporter = src.exporter
        run_ = exporter.open(ask.hashes, ask.parent)
        try:
            if seen_media is not None:
                seen_media.extend(run_.media)
            entries = exporter.read_entries(run_, 0, len(run_.hashes))
            assert len(entries) == len(run_.hashes)
            for entry in entries:
                sink.take_entry(entry)
        finally:
            exporter.close(run_)
    return fetch


@pytest.fixture(scope="module")
def cold():
    return {bs: run(engine(bs, enable_prefix_caching=False), PROMPT)[0] for bs in (16, 32)}


def assert_nothing_pinned(*engines: Engine) -> None:
    for eng in engines:
        assert eng.kv_manager.get_num_free_blocks() == eng.kv_manager.num_blocks
        assert eng.exporter.open_runs == 0
        assert eng.puller is None or not eng.puller.has_pending()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("tier", ["GPU", "CPU", "DISK"])
def test_pulled_prefix_gives_cold_tokens(tmp_path, cold, block_size, tier):
    kw = {}
    if tier != "GPU":  # a small pool: the fillers push the prompt's blocks down a tier
        kw.update(num_gpu_blocks=416 // block_size, max_model_len=400)
        kw.update({"cpu_offload_bytes": 8 << 20} if tier == "CPU" else
                  {"disk_offload_bytes": 32 << 20, "disk_offload_dir": str(tmp_path)})
    src = engine(block_size, **kw)
    run(src, PROMPT)
    for i, filler in enumerate(FILLERS if tier != "GPU" else []):
        run(src, filler, rid=f"f{i}")
    if tier == "DISK":
        src.tiers.chain.ssd.flush(10)
    dst = engine(block_size)
    media: list = []
    dst.enable_peer_pull(direct_fetch(src, media))
    tokens, out = run(dst, PROMPT, SOURCE)
    assert tokens == cold[block_size]
    full = (len(PROMPT) - 1) // block_size
    assert out.cached_tokens_by_tier[PEER_SHARE] == full * block_size
    assert out.cached_tokens_by_tier[Medium.GPU] == 0
    assert out.num_cached_tokens == full * block_size
    assert tier in media  # the blocks were served from that tier
    assert dst.puller.stats.blocks == full and sum(dst.puller.stats.fallbacks.values()) == 0
    assert_nothing_pinned(src, dst)
    # The pulled blocks are ordinary pool blocks now: a second request hits them locally.
    _, again = run(dst, PROMPT, rid="again")
    assert again.cached_tokens_by_tier[Medium.GPU] == full * block_size
    src.close()


class Recorder:
    """A sink stand-in that keeps the entries a fetch gives it, to replay them altered."""

    def __init__(self) -> None:
        self.entries: list[bytes] = []

    def take_entry(self, entry) -> None:
        self.entries.append(bytes(entry))


def faulty(fetch, mode: str, at: int):
    def wrapped(source, ask, handle, sink):
        recorded = Recorder()
        fetch(source, ask, handle, recorded)
        entries = recorded.entries
        for i, entry in enumerate(entries):
            if i == at:
                if mode == "corrupt":
                    torn = bytearray(entry)
                    torn[-5] ^= 0x40  # a payload byte
                    entry = bytes(torn)
                elif mode == "swap":  # the next block's entry where this one belongs
                    entry = entries[i + 1]
                elif mode == "drop":
                    return  # the peer holds fewer blocks than the hint said
                elif mode == "gone":
                    raise PullFailed("peer_unavailable", "connection reset")
                elif mode == "bug":
                    raise RuntimeError("a bug in the transport")
                elif mode == "slow":
                    time.sleep(0.6)
            sink.take_entry(entry)
    return wrapped


@pytest.mark.parametrize("mode, reason", [
    ("corrupt", "checksum"), ("swap", "hash_mismatch"), ("drop", "peer_missing"),
    ("gone", "peer_unavailable"), ("bug", "error"), ("slow", "deadline"),
])
def test_faults_fall_back_to_recompute(cold, mode, reason):
    src = engine()
    run(src, PROMPT)
    dst = engine()
    at = 5
    dst.enable_peer_pull(faulty(direct_fetch(src), mode, at), deadline_s=0.5)
    tokens, out = run(dst, PROMPT, SOURCE)
    assert tokens == cold[16]
    assert dst.puller.stats.fallbacks[reason] == 1
    # What arrived intact before the fault was kept (the deadline is checked before each
    # block: the one that came too late is not).
    kept = at
    assert out.cached_tokens_by_tier.get(PEER_SHARE, 0) == kept * 16
    assert out.num_cached_tokens == kept * 16
    assert_nothing_pinned(src, dst)


def test_no_pull_when_this_pod_holds_as_much(cold):
    calls = []
    dst = engine()
    dst.enable_peer_pull(lambda *a: calls.append(a))
    run(dst, PROMPT)  # now local
    tokens, out = run(dst, PROMPT, KvSource("peer", "x:1", 3), rid="second")
    assert tokens == cold[16] and calls == []
    assert out.cached_tokens_by_tier.get(PEER_SHARE, 0) == 0


def test_abort_during_a_pull_releases_everything():
    src = engine()
    run(src, PROMPT)
    release = threading.Event()
    cancelled = threading.Event()

    def stuck(source, ask, handle, sink):
        handle.on_cancel(cancelled.set)
        release.wait(10)  # a transport still writing the reserved blocks

    dst = engine()
    dst.enable_peer_pull(stuck, deadline_s=10)
    dst.add_request("r", PROMPT, P, kv_source=SOURCE)
    dst.step()  # admission starts the pull; the request waits
    assert dst.puller.has_pending()
    full = (len(PROMPT) - 1) // 16
    # The blocks the pull lands in are reserved, nothing else is held.
    assert dst.kv_manager.get_num_free_blocks() == dst.kv_manager.num_blocks - full
    dst.abort("r")
    assert cancelled.is_set()
    # The worker may still write them: they are not handed out before it stops.
    dst.step()
    assert dst.kv_manager.get_num_free_blocks() == dst.kv_manager.num_blocks - full
    release.set()
    deadline = time.monotonic() + 10
    while dst.puller.has_pending():
        assert time.monotonic() < deadline
        dst.step()
    assert_nothing_pinned(dst)


def test_pulls_respect_the_concurrency_cap(cold):
    prompts = [[(i * k) % 250 + 1 for i in range(120)] for k in (3, 5, 7, 11, 13, 19)]
    src = engine(num_gpu_blocks=128)
    for i, p in enumerate(prompts):
        run(src, p, rid=f"s{i}")
    active, peak, lock = [0], [0], threading.Lock()
    inner = direct_fetch(src)

    def counted(source, ask, handle, sink):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.05)  # long enough for every request to be waiting at once
            inner(source, ask, handle, sink)
        finally:
            with lock:
                active[0] -= 1

    dst = engine(num_gpu_blocks=128)
    dst.enable_peer_pull(counted, max_concurrent=2, deadline_s=10)
    for i, p in enumerate(prompts):
        dst.add_request(f"d{i}", p, P, kv_source=SOURCE)
    outs = {}
    while dst.has_unfinished():
        for out in dst.step():
            outs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert peak[0] == 2
    assert dst.puller.stats.pulls == len(prompts)
    ref = engine(enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        assert outs[f"d{i}"] == run(ref, p, rid=f"c{i}")[0]
    assert_nothing_pinned(dst)


def test_a_request_waits_for_the_pull_in_flight_of_its_prefix(cold):
    """A second request for the same prefix (no hint of its own) waits for the first one's
    pull and hits the landed blocks, instead of recomputing them while the pull runs."""
    src = engine()
    run(src, PROMPT)
    inner = direct_fetch(src)
    calls = []

    def slow(source, ask, handle, sink):
        calls.append(ask)
        time.sleep(0.2)  # the engine steps meanwhile
        inner(source, ask, handle, sink)

    dst = engine()
    dst.enable_peer_pull(slow, deadline_s=10)
    dst.add_request("first", PROMPT, P, kv_source=SOURCE)
    dst.add_request("second", PROMPT, P)
    outs: dict[str, list] = {}
    last = {}
    while dst.has_unfinished():
        for out in dst.step():
            outs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            last[out.request_id] = out
    full = (len(PROMPT) - 1) // 16
    assert len(calls) == 1
    assert outs["first"] == outs["second"] == cold[16]
    assert last["first"].cached_tokens_by_tier[PEER_SHARE] == full * 16
    assert last["second"].cached_tokens_by_tier[Medium.GPU] == full * 16
    assert dst.puller.stats.blocks == full
    assert_nothing_pinned(src, dst)


@pytest.mark.parametrize("room", ["some", "none"])
def test_a_pull_takes_only_the_room_the_pool_has(cold, room):
    """The pulled run lands in pool blocks reserved at the pull's start: with room for some
    of them the rest is recomputed (no_room); with room for none no pull is made at all."""
    src = engine()
    run(src, PROMPT)
    calls = []
    inner = direct_fetch(src)

    def counted(source, ask, handle, sink):
        calls.append(len(ask.hashes))
        inner(source, ask, handle, sink)

    full = (len(PROMPT) - 1) // 16
    dst = engine(num_gpu_blocks=30, max_model_len=480)
    dst.enable_peer_pull(counted, deadline_s=10)
    # Another request holds 21 of the pool's 30 blocks (some room) or all 30 while the pull
    # is admitted.
    other = [(i * 7) % 250 + 1 for i in range(330 if room == "some" else 466)]
    dst.add_request("other", other, SamplingParams(max_tokens=2 if room == "some" else 12,
                                                   temperature=0.0, ignore_eos=True))
    dst.step()
    dst.add_request("r", PROMPT, P, kv_source=SOURCE)
    outs: dict[str, list] = {}
    last = {}
    deadline = time.monotonic() + 60
    while dst.has_unfinished():
        assert time.monotonic() < deadline
        for out in dst.step():
            outs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            last[out.request_id] = out
    assert outs["r"] == cold[16]
    assert dst.puller.stats.fallbacks["no_room"] == 1
    peer = last["r"].cached_tokens_by_tier.get(PEER_SHARE, 0)
    if room == "some":
        assert calls and 0 < calls[0] < full
        assert peer == calls[0] * 16
    else:
        assert calls == [] and peer == 0
    assert_nothing_pinned(src, dst)
