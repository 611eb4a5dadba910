"""The exclusive chain pool ▸ DRAM ▸ SSD: where blocks go, what the index hears, orphans, promotion."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pagekv.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagekv.tiers import ssd_format
from pagekv.tiers.chain import TierChain
from pagekv.tiers.dram import DramTier
from pagekv.tiers.ssd import SsdTier

LAYOUT = {"num_layers": 1, "block_size": 4, "num_kv_heads": 2, "head_size": 64, "dtype": "float16"}
BB = 1 * 2 * 4 * 2 * 64 * 2  # 2 KiB
FOOT = ssd_format.align_up(BB + 200)  # disk bytes per SSD entry (entries are 4 KiB-aligned)
MiB = 1 << 20


def h(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def data(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(name.encode()))
    return torch.randn(BB // 2, generator=gen).half().view(torch.uint8)


def toks(name: str) -> list[int]:
    return [len(name), 1, 2, 3]


@pytest.fixture
def make_ssd(tmp_path: Path) -> Iterator[Callable[..., SsdTier]]:
    made: list[SsdTier] = []

    def make(capacity_bytes: int = 64 * MiB, **kw: object) -> SsdTier:
        tier = SsdTier(tmp_path / "ssd", capacity_bytes, BB, LAYOUT, **kw)  # type: ignore[arg-type]
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def where(chain: TierChain, name: str) -> str | None:
    """The one tier holding a block, asserting it is held at most once."""
    in_dram = chain.dram is not None and chain.dram.contains(h(name))
    in_ssd = chain.ssd is not None and chain.ssd.contains(h(name))
    assert not (in_dram and in_ssd), f"{name} is in two tiers"
    return "CPU" if in_dram else "DISK" if in_ssd else None


def summary(events: list[KVEvent]) -> list[tuple[str, str, tuple[bytes, ...]]]:
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(("stored", e.medium, tuple(e.block_hashes)))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", e.medium, tuple(sorted(e.block_hashes))))
    return out


def demote_chain(chain: TierChain, names: list[str]) -> None:
    """Demote blocks of one prompt, each block's parent being the previous name."""
    for i, name in enumerate(names):
        parent = h(names[i - 1]) if i else None
        chain.demote(h(name), parent, toks(name), data(name))


# --- demotion ---------------------------------------------------------------------------------
def test_demote_cascade_pool_dram_ssd_is_exclusive(make_ssd: Callable[..., SsdTier]) -> None:
    chain = TierChain(DramTier(2 * BB, BB), make_ssd(), block_size=4)
    assert chain.demote(h("a"), None, toks("a"), data("a")) == "CPU"
    assert chain.demote(h("b"), h("a"), toks("b"), data("b")) == "CPU"
    assert chain.demote(h("c"), h("b"), toks("c"), data("c")) == "CPU"  # DRAM full: a moves down
    assert [where(chain, n) for n in "abc"] == ["DISK", "CPU", "CPU"]
    assert chain.full_state() == {h("a"): "DISK", h("b"): "CPU", h("c"): "CPU"}
    events = chain.take_events()
    assert summary(events) == [
        ("stored", "CPU", (h("a"),)),
        ("stored", "CPU", (h("b"),)),
        ("removed", "CPU", (h("a"),)),
        ("stored", "DISK", (h("a"),)),
        ("stored", "CPU", (h("c"),)),
    ]
    disk_event = events[3]
    assert isinstance(disk_event, BlockStored)
    assert disk_event.parent_block_hash is None and disk_event.token_ids == toks("a")
    assert disk_event.block_size == 4
    assert chain.take_events() == []  # drained


def test_demote_copies_the_pool_block(make_ssd: Callable[..., SsdTier]) -> None:
    chain = TierChain(DramTier(1 * BB, BB), make_ssd())
    pool_block = data("a").clone()
    chain.demote(h("a"), None, toks("a"), pool_block)
    pool_block.zero_()  # the pool reuses its block at once
    chain.demote(h("b"), None, toks("b"), data("b"))  # a moves to SSD
    pool_block.fill_(7)
    got = chain.promote(h("a"))
    assert got is not None and torch.equal(got, data("a"))


def test_ssd_victims_are_dropped_and_published(make_ssd: Callable[..., SsdTier]) -> None:
    ssd = make_ssd(capacity_bytes=8 * FOOT, batch_bytes=BB)
    chain = TierChain(DramTier(1 * BB, BB), ssd)
    names = [f"n{i}" for i in range(30)]
    for n in names:
        chain.demote(h(n), None, toks(n), data(n))
        ssd.flush(30)
    stats = chain.stats()
    assert stats["drops"] > 0
    assert stats["ssd_used_bytes"] <= 8 * FOOT
    removed_disk = {
        b for e in chain.take_events() if isinstance(e, BlockRemoved) and e.medium == "DISK" for b in e.block_hashes
    }
    gone = {h(n) for n in names if where(chain, n) is None}
    assert gone and removed_disk == gone
    assert set(chain.full_state()) == {h(n) for n in names} - gone


def test_without_dram_blocks_go_straight_to_ssd(make_ssd: Callable[..., SsdTier]) -> None:
    chain = TierChain(None, make_ssd())
    assert chain.demote(h("a"), None, toks("a"), data("a")) == "DISK"
    assert summary(chain.take_events()) == [("stored", "DISK", (h("a"),))]
    assert chain.stats()["pool_to_ssd_bytes"] == BB


def test_without_tiers_blocks_are_dropped() -> None:
    chain = TierChain(None, None)
    assert chain.demote(h("a"), None, toks("a"), data("a")) is None
    assert chain.take_events() == []
    assert chain.match_prefix([h("a")], 0) == []
    assert chain.stats()["drops"] == 1


# --- orphans ----------------------------------------------------------------------------------
def test_dropping_a_block_drops_its_descendants() -> None:
    chain = TierChain(DramTier(4 * BB, BB), None)
    demote_chain(chain, ["a", "b", "c", "d"])  # a <- b <- c <- d, a least recently used
    chain.take_events()
    chain.demote(h("x"), None, toks("x"), data("x"))  # a is evicted and dropped: b, c, d unreachable
    assert chain.full_state() == {h("x"): "CPU"}
    stats = chain.stats()
    assert stats["orphans_dropped"] == 3
    assert stats["drops"] == 1
    assert summary(chain.take_events()) == [
        ("removed", "CPU", (h("a"),)),
        ("removed", "CPU", tuple(sorted((h("b"), h("c"), h("d"))))),
        ("stored", "CPU", (h("x"),)),
    ]
    assert chain.dram is not None and chain.dram.num_entries == 1


def test_orphans_across_tiers_after_ssd_eviction(make_ssd: Callable[..., SsdTier]) -> None:
    ssd = make_ssd(capacity_bytes=8 * FOOT, batch_bytes=BB)
    chain = TierChain(DramTier(2 * BB, BB), ssd)
    demote_chain(chain, ["r", "s", "t", "u"])  # r, s -> SSD; t, u in DRAM
    ssd.flush(30)
    assert [where(chain, n) for n in "rstu"] == ["DISK", "DISK", "CPU", "CPU"]
    chain.take_events()
    # Unrelated traffic pushes r out of the SSD: s, t and u hang off it and must go too.
    for i in range(12):
        chain.demote(h(f"z{i}"), None, toks("z"), data(f"z{i}"))
        ssd.flush(30)
    assert all(where(chain, n) is None for n in "rstu")
    assert chain.stats()["orphans_dropped"] >= 3
    removed = {
        (e.medium, b) for e in chain.take_events() if isinstance(e, BlockRemoved) for b in e.block_hashes
    }
    assert {("DISK", h("r")), ("DISK", h("s"))} <= removed


def test_promotion_is_not_a_drop_descendants_stay() -> None:
    chain = TierChain(DramTier(3 * BB, BB), None)
    demote_chain(chain, ["a", "b", "c"])
    assert chain.promote(h("a")) is not None  # a is in the pool again: b, c still reachable
    chain.demote(h("x"), None, toks("x"), data("x"))
    assert [where(chain, n) for n in "bcx"] == ["CPU", "CPU", "CPU"]
    assert chain.stats()["orphans_dropped"] == 0
    chain.demote(h("y"), None, toks("y"), data("y"))  # b is evicted and dropped; c hangs off b
    assert chain.stats()["orphans_dropped"] == 1
    assert where(chain, "c") is None and where(chain, "x") == "CPU"


# --- lookup and promotion -------------------------------------------------------------------------
def test_match_prefix_stops_at_first_miss_and_counts_per_tier(make_ssd: Callable[..., SsdTier]) -> None:
    chain = TierChain(DramTier(2 * BB, BB), make_ssd())
    for n in ["d3", "c2", "c5"]:  # d3 is pushed to SSD by c2 and c5
        chain.demote(h(n), None, toks(n), data(n))
    assert where(chain, "d3") == "DISK" and where(chain, "c2") == "CPU"
    hashes = [h("p0"), h("p1"), h("c2"), h("d3"), h("missing"), h("c5")]
    assert chain.match_prefix(hashes, 2) == ["CPU", "DISK"]
    assert chain.match_prefix(hashes, 5) == ["CPU"]
    assert chain.match_prefix(hashes, 4) == []
    stats = chain.stats()
    # start=2: c2 (DRAM hit), d3 (DRAM miss, SSD hit), missing (both miss); start=5: c5; start=4: missing.
    assert stats["dram_queries"] == 5 and stats["dram_hits"] == 2
    assert stats["ssd_queries"] == 3 and stats["ssd_hits"] == 1
    assert stats["lookups"] == 3


def test_promote_removes_from_its_tier_and_publishes(make_ssd: Callable[..., SsdTier]) -> None:
    ssd = make_ssd()
    chain = TierChain(DramTier(1 * BB, BB), ssd)
    chain.demote(h("a"), None, toks("a"), data("a"))
    chain.demote(h("b"), h("a"), toks("b"), data("b"))  # a -> SSD
    ssd.flush(30)
    chain.take_events()

    got_b = chain.promote(h("b"))
    got_a = chain.promote(h("a"))
    assert got_a is not None and torch.equal(got_a, data("a"))
    assert got_b is not None and torch.equal(got_b, data("b"))
    assert summary(chain.take_events()) == [("removed", "CPU", (h("b"),)), ("removed", "DISK", (h("a"),))]
    assert where(chain, "a") is None and where(chain, "b") is None
    assert chain.promote(h("a")) is None
    assert chain.match_prefix([h("a"), h("b")], 0) == []
    stats = chain.stats()
    assert stats["promotions_dram"] == 1 and stats["promotions_ssd"] == 1
    assert stats["dram_to_pool_bytes"] == BB and stats["ssd_to_pool_bytes"] == BB
    assert stats["promote_misses"] == 1


def test_promote_many_reads_a_prefix_across_tiers(make_ssd: Callable[..., SsdTier]) -> None:
    ssd = make_ssd()
    chain = TierChain(DramTier(2 * BB, BB), ssd)
    names = ["p0", "p1", "p2", "p3", "p4"]
    demote_chain(chain, names)  # p0..p2 on SSD, p3, p4 in DRAM
    ssd.flush(30)
    hashes = [h(n) for n in names]
    assert chain.match_prefix(hashes, 0) == ["DISK", "DISK", "DISK", "CPU", "CPU"]
    got = chain.promote_many(hashes + [h("absent")])
    for n, g in zip(names, got, strict=False):
        assert g is not None and torch.equal(g, data(n))
    assert got[-1] is None
    assert chain.full_state() == {}


def test_checksum_failure_on_promote_is_a_miss_and_counted(make_ssd: Callable[..., SsdTier]) -> None:
    ssd = make_ssd()
    chain = TierChain(None, ssd)
    demote_chain(chain, ["a", "b", "c"])
    ssd.flush(30)
    seg = sorted(Path(ssd.directory).glob("seg-*.pkv"))[0]
    raw = seg.read_bytes()
    _, _, off, align = ssd_format.parse_segment_header(raw)
    while True:
        hdr = ssd_format.parse_entry_header(raw[off : off + ssd_format.MAX_ENTRY_HEADER_LEN])
        if hdr.block_hash == h("b"):
            break
        off = ssd_format.align_up(off + hdr.entry_len, align)
    with open(seg, "r+b") as f:
        f.seek(off + hdr.header_len + 10)
        f.write(b"\xde\xad")
    chain.take_events()

    got = chain.promote_many([h("a"), h("b"), h("c")])
    assert got[0] is not None and torch.equal(got[0], data("a"))
    assert got[1] is None and got[2] is None  # cut at the corrupt block: the caller recomputes b
    stats = chain.stats()
    assert stats["checksum_failures"] == 1 and stats["promote_failures"] == 1
    assert summary(chain.take_events()) == [("removed", "DISK", (h("a"),)), ("removed", "DISK", (h("b"),))]
    # c was read but not handed out: it is still below the pool (b will be recomputed).
    assert where(chain, "c") == "DISK"
    assert chain.match_prefix([h("c")], 0) == ["DISK"]


# --- restart and failures -------------------------------------------------------------------------
def test_warm_restart_republishes_ssd_blocks(make_ssd: Callable[..., SsdTier]) -> None:
    chain = TierChain(None, make_ssd())
    demote_chain(chain, ["a", "b"])
    chain.close()

    again = TierChain(DramTier(2 * BB, BB), make_ssd(), block_size=4)
    assert again.full_state() == {h("a"): "DISK", h("b"): "DISK"}
    stored = {e.block_hashes[0]: e for e in again.take_events() if isinstance(e, BlockStored)}
    assert stored[h("b")].parent_block_hash == h("a") and stored[h("b")].medium == "DISK"
    assert stored[h("b")].token_ids == toks("b")
    got = again.promote(h("b"))
    assert got is not None and torch.equal(got, data("b"))
    # Restart keeps the tree: dropping a now drops nothing else (b is in the pool).
    assert again.match_prefix([h("a")], 0) == ["DISK"]


def test_ssd_failure_publishes_losses_and_keeps_serving_dram(
    make_ssd: Callable[..., SsdTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    ssd = make_ssd()
    chain = TierChain(DramTier(1 * BB, BB), ssd)
    chain.demote(h("a"), None, toks("a"), data("a"))
    chain.demote(h("b"), None, toks("b"), data("b"))  # a -> SSD
    ssd.flush(30)

    def broken(fd: int) -> None:  # an I/O error (a full disk would only shrink the budget)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", broken)
    chain.demote(h("c"), None, toks("c"), data("c"))  # b -> SSD -> sync fails -> disabled
    ssd.flush(30)
    assert ssd.disabled
    chain.demote(h("d"), None, toks("d"), data("d"))  # c has nowhere to go now: dropped
    assert chain.full_state() == {h("d"): "CPU"}
    removed_disk = {b for e in chain.take_events() if isinstance(e, BlockRemoved) and e.medium == "DISK"
                    for b in e.block_hashes}  # fmt: skip
    assert removed_disk == {h("a"), h("b")}
    assert chain.match_prefix([h("d")], 0) == ["CPU"]
    assert chain.stats()["ssd_disabled"] == 1


def test_concurrent_engine_and_writer_keep_blocks_exclusive(make_ssd: Callable[..., SsdTier]) -> None:
    ssd = make_ssd(capacity_bytes=40 * FOOT, batch_bytes=2 * BB)
    chain = TierChain(DramTier(4 * BB, BB), ssd)
    errors: list[BaseException] = []

    def engine(tag: str) -> None:
        try:
            for i in range(150):
                name = f"{tag}{i}"
                chain.demote(h(name), h(f"{tag}{i - 1}") if i else None, toks(name), data(name))
                if i % 3 == 0:
                    back = chain.promote(h(f"{tag}{i // 2}"))
                    if back is not None:
                        assert torch.equal(back, data(f"{tag}{i // 2}"))
                chain.match_prefix([h(f"{tag}{j}") for j in range(i)], 0)
                chain.take_events()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(t,)) for t in ("e", "f")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    ssd.flush(30)
    state = chain.full_state()
    for block_hash, medium in state.items():
        assert (medium == "CPU") == (chain.dram is not None and chain.dram.contains(block_hash))
    assert chain.stats()["ssd_used_bytes"] <= 40 * FOOT


def test_clear_drops_everything_and_says_so(make_ssd: Callable[..., SsdTier]) -> None:
    chain = TierChain(DramTier(2 * BB, BB), make_ssd())
    demote_chain(chain, ["a", "b", "c", "d"])
    chain.take_events()
    assert chain.clear() == 4
    assert chain.full_state() == {}
    assert chain.match_prefix([h("a")], 0) == []
    cleared = [e for e in chain.take_events() if isinstance(e, AllBlocksCleared)]
    assert {e.medium for e in cleared} == {"CPU", "DISK"}
    chain.demote(h("e"), None, toks("e"), data("e"))  # still usable
    assert chain.full_state() == {h("e"): "CPU"}
