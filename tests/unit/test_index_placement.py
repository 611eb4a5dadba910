"""ChainBuckets: a pod learns each block's bucket (its chain's block 0) from the parent links
of its KV events, waits for unknown parents instead of guessing, and forgets what it no
longer holds. Pure: no Redis."""

from __future__ import annotations

import hashlib

from pagekv.proto.index.mirror import PodClaims
from pagekv.proto.index.placement import ChainBuckets
from pagekv.proto.index.schema import BUCKETS, IndexSchema, bucket_of
from pagekv.proto.kv_events import BlockRemoved, BlockStored
from pagekv.proto.medium import Medium


def chain(n: int, tag: str) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def stored(hashes: list[bytes], parent: bytes | None, medium: str = "GPU") -> BlockStored:
    return BlockStored(hashes, parent, [], 16, medium=medium)  # type: ignore[arg-type]


def test_a_run_without_parent_is_rooted_at_its_first_block_and_children_follow():
    a = chain(6, "a")
    cb = ChainBuckets()
    assert cb.learn([stored(a[:2], None)]) == a[:2]
    assert cb.learn([stored(a[2:4], a[1]), stored(a[4:], a[3], "CPU")]) == a[2:]
    assert {cb.get(h) for h in a} == {bucket_of(a[0])}
    # Learning again (a replay, a demotion's second event) places nothing new.
    assert cb.learn([stored(a[2:4], a[1], "CPU"), BlockRemoved(a[:1])]) == []


def test_an_unknown_parent_waits_then_places_the_whole_run_transitively():
    a = chain(7, "a")
    cb = ChainBuckets()
    # Recovered from SSD in no particular order: children before their parents.
    assert cb.learn([stored([a[5]], a[4], "DISK"), stored([a[3]], a[2], "DISK"),
                     stored(a[1:3], a[0], "DISK")]) == []
    assert cb.get(a[1]) is None and len(cb) == 4
    assert cb.learn([stored([a[4]], a[3], "DISK")]) == []
    placed = cb.learn([stored([a[0]], None, "DISK")])
    assert sorted(placed) == sorted(a[:6])  # a[6] was never stored
    assert {cb.get(h) for h in a[:6]} == {bucket_of(a[0])} and cb.get(a[6]) is None
    assert not cb.waits_on and not cb.waiting


def test_a_run_with_one_placed_member_places_the_rest_without_its_parent():
    a = chain(4, "a")
    cb = ChainBuckets()
    cb.learn([stored(a[:2], None)])
    # A later run naming a parent this pod never saw, but holding a[1]: same chain.
    assert cb.learn([stored([a[1], a[2], a[3]], b"\x00" * 32, "CPU")]) == a[2:]
    assert cb.get(a[3]) == bucket_of(a[0])


def test_never_a_guess_for_a_parent_that_never_comes():
    a = chain(3, "a")
    cb = ChainBuckets()
    assert cb.learn([stored(a[1:], a[0])]) == []
    assert cb.get(a[1]) is None and cb.get(a[2]) is None


def test_compact_keeps_only_held_hashes_and_their_waits():
    a, b = chain(3, "a"), chain(3, "b")
    cb = ChainBuckets()
    cb.learn([stored(a, None), stored(b[1:], b[0])])
    cb.compact({a[0], b[2]})
    assert set(cb.buckets) == {a[0]} and cb.waits_on == {b[2]: b[1]}
    assert cb.waiting == {b[1]: [b[2]]}
    # b[1] stored again later (with its parent, recomputed) still releases b[2].
    assert cb.learn([stored([b[0], b[1]], None)]) == [b[0], b[1], b[2]]
    assert cb.get(b[2]) == bucket_of(b[0])


def test_buckets_spread_and_every_key_of_a_chain_shares_its_tag():
    roots = [hashlib.sha256(str(i).encode()).digest() for i in range(20_000)]
    counts = [0] * BUCKETS
    for r in roots:
        counts[bucket_of(r)] += 1
    assert min(counts) > 0 and max(counts) < 3 * len(roots) / BUCKETS
    schema = IndexSchema("m", 16, "sha256", "s")
    keys = [schema.chain_claims_key(chain(5, "a")), *schema.chain_prediction_keys(chain(5, "a"))]
    tags = {k[k.index("{"):k.index("}") + 1] for k in keys}
    assert tags == {f"{{{schema.namespace}.{bucket_of(chain(1, 'a')[0]):03x}}}"}
    assert schema.pods_key.startswith(f"pagekv:{{{schema.namespace}}}:")


def test_pod_claims_hold_back_an_unplaced_block_then_write_its_whole_claim():
    a, b = chain(3, "a"), chain(2, "b")
    gpu, disk = Medium.GPU.bit, Medium.DISK.bit
    claims = PodClaims()
    assert claims.apply([stored([a[2]], a[1], "DISK")]) == []  # its chain is unknown yet
    assert claims.unplaced == {a[2]} and len(claims) == 1
    bucket = bucket_of(a[0])
    out = claims.apply([stored(a[:2], None)])
    assert sorted(out) == sorted([(a[0], bucket, 0, gpu), (a[1], bucket, 0, gpu),
                                  (a[2], bucket, 0, disk)])
    assert not claims.unplaced
    # A placed block's removal is written; an unplaced one's never was, nor is its removal.
    claims.apply([stored([b[1]], b[0])])
    assert claims.apply([BlockRemoved([a[1]]), BlockRemoved([b[1]])]) == [(a[1], bucket, gpu, 0)]
    assert not claims.unplaced
    # A full state read back: what is placed, by bucket; the rest held back.
    wanted = claims.reset({a[0]: "GPU", a[2]: "DISK", b[1]: "GPU"})
    assert wanted == {bucket: {a[0].hex(): gpu, a[2].hex(): disk}}
    assert claims.unplaced == {b[1]}
